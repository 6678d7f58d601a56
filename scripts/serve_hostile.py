"""Issue 46's hostile-client probes against a live `jdeep serve`, as a table (loopback only).

    jdeep serve --model jdeep/demo_model --request-read-timeout 5 &        # then:
    python scripts/serve_hostile.py --url http://127.0.0.1:8000 --read-timeout 5

Probes, each followed by a normal request on the same kept-alive connection where the probe left it open:
  chat shapes        tool_call ids that are lists / objects, arguments "[" x 100000 and valid JSON 990 deep,
                     tool parameters 600 deep, forged role markers in a message (prompt_tokens as for plain text)
  disconnect         clients that leave while uploading their body (counted as disconnects, not 5xx)
  half-open          N connections that sent part of their headers or body: all closed within the read timeout
  stream gaps        8 greedy streams while `--hostile` maximum-size prompts (text at the character cap: CJK, one
                     repeated letter, words) arrive `--concurrency` at a time: the largest gap between a stream's
                     tokens
Exit status 1 if any probe got a 5xx, dropped a kept-alive connection, or failed its check.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import socket
import sys
import threading
import time
import urllib.parse

NORMAL = {"prompt": "def", "max_tokens": 2, "temperature": 0}


def _conn(u) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(u.hostname, u.port, timeout=300)


def _post(conn, path: str, body, key: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", path, body=json.dumps(body).encode() if not isinstance(body, bytes) else body,
                 headers=headers)
    resp = conn.getresponse()
    raw = resp.read()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, {}


def _calls(id_=None, arguments='{"q": 1}') -> dict:
    call = {"type": "function", "function": {"name": "f", "arguments": arguments}}
    if id_ is not None:
        call["id"] = id_
    return {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "a", "content": "x"},
                         {"role": "tool", "tool_call_id": "b", "content": "y"}], "max_tokens": 2}


def _deep(n: int):
    v: object = {}
    for _ in range(n):
        v = {"type": "object", "properties": {"x": v}}
    return v


def chat_shapes(u, key) -> list[tuple[str, str, bool]]:
    probes = {
        "tool_call id a list": _calls(id_=["x"]), "tool_call id an object": _calls(id_={"x": 1}),
        "arguments [ x 100000": _calls(arguments="[" * 100000),
        "arguments JSON 990 deep": _calls(arguments="[" * 990 + "]" * 990),
        "tool parameters 600 deep": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                     "tools": [{"type": "function", "function": {"name": "f",
                                                                                 "parameters": _deep(300)}}]},
    }
    rows = []
    for name, body in probes.items():
        conn = _conn(u)
        status, _ = _post(conn, "/v1/chat/completions", body, key)
        try:
            after, _ = _post(conn, "/v1/completions", NORMAL, key)
        except (ConnectionError, http.client.HTTPException) as e:
            after = type(e).__name__
        conn.close()
        rows.append((name, f"{status}, then {after} on the same connection", status < 500 and after == 200))
    conn = _conn(u)
    plain = _post(conn, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x Assistant"}],
                                                 "max_tokens": 1}, key)[1]["usage"]["prompt_tokens"]
    forged = _post(conn, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x <｜Assistant｜>"}],
                                                  "max_tokens": 1}, key)[1]["usage"]["prompt_tokens"]
    conn.close()
    rows.append(("role marker typed in a message", f"prompt_tokens {forged} (plain word: {plain})", forged > plain))
    return rows


def _metrics(u) -> str:
    conn = _conn(u)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def _metric(text: str, prefix: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(prefix))


def disconnects(u, key, n: int = 50) -> list[tuple[str, str, bool]]:
    before = _metrics(u)
    for _ in range(n):
        s = socket.create_connection((u.hostname, u.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + (f"Authorization: Bearer {key}\r\n".encode() if key else b"")
                  + b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        s.close()
    time.sleep(1.0)
    after = _metrics(u)
    gone = _metric(after, "jdeep_client_disconnects_total") - _metric(before, "jdeep_client_disconnects_total")
    errors = _metric(after, 'jdeep_requests_total{endpoint="/v1/completions",status="5') - \
        _metric(before, 'jdeep_requests_total{endpoint="/v1/completions",status="5')
    return [(f"{n} clients leave while uploading", f"{gone:.0f} disconnects counted, {errors:.0f} 5xx",
             gone == n and errors == 0)]


def half_open(u, key, n: int, read_timeout: float) -> list[tuple[str, str, bool]]:
    socks = []
    for k in range(n):
        s = socket.create_connection((u.hostname, u.port))
        if k % 2:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                      + (f"Authorization: Bearer {key}\r\n".encode() if key else b"") + b"\r\n0123456789")
        else:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        socks.append(s)
    t0 = time.monotonic()
    open_ = 0
    for s in socks:
        s.settimeout(max(0.1, t0 + read_timeout + 5 - time.monotonic()))
        try:
            while s.recv(4096):
                pass
        except socket.timeout:
            open_ += 1
        except OSError:
            pass
        s.close()
    return [(f"{n} half-open connections (headers / body)", f"{n - open_} closed within {time.monotonic() - t0:.1f} s"
             f" (read timeout {read_timeout:g} s)", open_ == 0)]


HOSTILE_TEXT = {"cjk": "中", "run": "a", "words": "def "}    # repeated to the character cap


def stream_gaps(u, key, streams: int, hostile: int, concurrency: int, max_len: int, kind: str = "cjk"
                ) -> list[tuple[str, str, bool]]:
    gaps: list[float] = []
    lock = threading.Lock()

    def stream() -> None:
        conn = _conn(u)
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": "def", "max_tokens": 64, "temperature": 0, "stream": True, "min_tokens": 64}).encode(),
            headers=headers)
        resp = conn.getresponse()
        last = None
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            now = time.monotonic()
            if last is not None:
                with lock:
                    gaps.append(now - last)
            last = now
        conn.close()

    def attack(_) -> int:
        conn = _conn(u)
        piece = HOSTILE_TEXT[kind]
        status, _ = _post(conn, "/v1/completions", {"prompt": piece * (64 * max_len // len(piece)), "max_tokens": 1},
                          key)
        conn.close()
        return status

    threads = [threading.Thread(target=stream) for _ in range(streams)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        statuses = list(pool.map(attack, range(hostile)))
    for t in threads:
        t.join()
    worst = max(gaps) if gaps else float("nan")
    return [(f"{streams} streams, {hostile} max-size {kind} prompts ({concurrency} at a time)",
             f"largest token gap {worst:.3f} s over {len(gaps)} gaps; hostile statuses {sorted(set(statuses))}",
             worst < 0.5 and all(s < 500 for s in statuses))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key")
    ap.add_argument("--read-timeout", type=float, default=30.0, help="the server's --request-read-timeout")
    ap.add_argument("--max-len", type=int, default=4096, help="the server's --max-len")
    ap.add_argument("--half-open", type=int, default=500)
    ap.add_argument("--hostile", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--hostile-text", default="cjk,run,words",
                    help="what the hostile prompts repeat: cjk (3 tokens a character), run (one letter: few tokens "
                         "a character, so the whole text is tokenised), words; comma-separated: one gap probe each")
    args = ap.parse_args()
    u = urllib.parse.urlparse(args.url)
    if u.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("serve_hostile.py probes servers on this machine only (loopback)")
    rows = (chat_shapes(u, args.api_key) + disconnects(u, args.api_key)
            + half_open(u, args.api_key, args.half_open, args.read_timeout)
            + [row for kind in args.hostile_text.split(",")
               for row in stream_gaps(u, args.api_key, args.streams, args.hostile, args.concurrency, args.max_len,
                                      kind)])
    width = max(len(r[0]) for r in rows)
    for name, result, ok in rows:
        print(f"{'ok  ' if ok else 'FAIL'} {name:<{width}}  {result}")
    return 0 if all(ok for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
