"""Soak the OpenAI-compatible server: N requests of every kind, some concurrency, and the server's memory over time.

The mix (seeded): completions and chat, plain and streamed, token-id and text prompts of mixed lengths, greedy and
seeded sampling, stop strings; clients that disconnect mid-stream; and bad requests that must get a 4xx (a seed of
2**80, NaN literals, huge or wrong-typed fields, JSON nested too deep, bodies that are not JSON, an unknown model or
route, a prompt longer than the context). Every reply is classified: completed (200, a whole response or a stream
ending in [DONE]), disconnected (the client left on purpose), rejected (429: past --max-waiting), bad (a 4xx for a bad
request, as expected) or unexpected (anything else: a 5xx, a 4xx for a good request, a broken stream, a timeout).
The server's RSS is read at the start, after the warm-up requests and at the end (and every --rss-every requests).

    python scripts/serve_soak.py -n 10000 --concurrency 16                 # serves a tiny random model itself
    python scripts/serve_soak.py --url http://127.0.0.1:8000 --served-model-name NAME --server-pid PID -n 1000

Without --url the script writes a random tiny DeepSeek-V4 (with a word-level tokenizer, id i <-> "tok<i>") to a
temporary folder and starts `jdeep serve` on it as a child process. Exit status 0 when nothing was unexpected.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlparse

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jdeep.config.small_models import TINY_CONFIG, one_layer_config  # noqa: E402
from jdeep.tools.testing.random_weights import random_checkpoint, write_word_tokenizer  # noqa: E402

CONFIGS = ("one-layer", "tiny")


# ---------------------------------------------------------------------- the request mix
@dataclass
class Planned:
    kind: str                 # completion, chat, disconnect, bad
    method: str
    path: str
    body: bytes
    stream: bool = False
    headers: dict = field(default_factory=dict)


def _bad_requests(model: str, vocab: int, max_len: int) -> list[tuple[str, str, bytes, dict]]:
    """(method, path, body, extra headers) of requests that must get a 4xx."""
    ok = {"model": model, "prompt": [0, 5, 9], "max_tokens": 4}

    def js(**kw) -> bytes:
        return json.dumps({**ok, **kw}).encode()

    return [
        ("POST", "/v1/completions", js(seed=2 ** 80), {}),
        ("POST", "/v1/completions", js(seed=-1), {}),
        ("POST", "/v1/completions", b'{"prompt": [0, 5], "temperature": NaN}', {}),
        ("POST", "/v1/completions", b'{"prompt": [0, 5], "top_p": Infinity}', {}),
        ("POST", "/v1/completions", js(max_tokens=0), {}),
        ("POST", "/v1/completions", js(max_tokens=2 ** 40), {}),
        ("POST", "/v1/completions", js(top_k=2 ** 70), {}),
        ("POST", "/v1/completions", js(temperature=True), {}),
        ("POST", "/v1/completions", js(n=3), {}),
        ("POST", "/v1/completions", js(logit_bias={"5": 100}), {}),
        ("POST", "/v1/completions", js(prompt=[0, vocab + 7]), {}),
        ("POST", "/v1/completions", js(prompt=[0, 2 ** 64]), {}),
        ("POST", "/v1/completions", js(prompt=list(range(2, max_len + 3))), {}),
        ("POST", "/v1/completions", js(stop=[["nested"], {"x": 1}]), {}),
        ("POST", "/v1/completions", js(stop_token_ids=[1] * 1000), {}),
        ("POST", "/v1/completions", js(model="gpt-4"), {}),
        ("POST", "/v1/completions", b'{"prompt": [0, 5], "max_tokens": ' + b"9" * 5000 + b"}", {}),
        ("POST", "/v1/completions", b"[" * 50_000, {}),
        ("POST", "/v1/completions", b'{"prompt": [0, 5', {}),
        ("POST", "/v1/completions", b"\xff\xfe\x00garbage", {"Content-Type": "application/octet-stream"}),
        ("POST", "/v1/completions", b"prompt=hello&max_tokens=3",
         {"Content-Type": "application/x-www-form-urlencoded"}),
        ("POST", "/v1/completions", b"[1, 2, 3]", {}),
        ("POST", "/v1/chat/completions", json.dumps({"model": model, "messages": [{"role": "wizard",
                                                                                   "content": "hi"}]}).encode(), {}),
        ("POST", "/v1/chat/completions", json.dumps({"model": model, "messages": "hello"}).encode(), {}),
        ("POST", "/v1/chat/completions", json.dumps({"model": model, "messages": [
            {"role": "user", "content": "tok5"}], "max_completion_tokens": -2}).encode(), {}),
        ("GET", "/v1/completions", b"", {}),
        ("POST", "/v1/nothing-here", b"{}", {}),
    ]


def make_plan(n: int, model: str, vocab: int, max_len: int, max_tokens: int, max_prompt: int, seed: int = 0,
              bad_share: float = 0.12, disconnect_share: float = 0.06) -> list[Planned]:
    """n requests: bad_share bad ones, disconnect_share streams the client leaves, the rest completions (60 %) and
    chats (40 %), half of them streamed; prompts of 1..max_prompt tokens, max_tokens 1..max_tokens."""
    rng = random.Random(seed)
    bad = _bad_requests(model, vocab, max_len)
    plan = []
    for i in range(n):
        r = rng.random()
        if r < bad_share:
            method, path, body, headers = bad[i % len(bad)]
            plan.append(Planned("bad", method, path, body, headers=headers))
            continue
        stream = r < bad_share + disconnect_share or rng.random() < 0.5
        kind = "disconnect" if r < bad_share + disconnect_share else "completion"
        length = rng.randint(1, max_prompt)
        ids = [0] + [rng.randrange(2, vocab) for _ in range(length - 1)]
        body = {"model": model, "max_tokens": rng.randint(1, max_tokens), "stream": stream}
        if rng.random() < 0.3:
            body.update(temperature=0.8, top_p=0.9, seed=rng.randrange(2 ** 63))
        else:
            body["temperature"] = 0
        if rng.random() < 0.2:
            body["stop"] = [f"tok{rng.randrange(2, vocab)}"]
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if kind == "completion" and rng.random() < 0.4:
            kind = "chat"
            body["messages"] = [{"role": "user", "content": " ".join(f"tok{t}" for t in ids[1:] or [5])}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = ids if rng.random() < 0.5 else " ".join(f"tok{t}" for t in ids[1:] or [5])
            path = "/v1/completions"
        plan.append(Planned(kind, "POST", path, json.dumps(body).encode(), stream))
    return plan


# ---------------------------------------------------------------------- a minimal HTTP/1.1 client (asyncio streams)
async def _read_body(reader: asyncio.StreamReader, headers: dict, on_chunk=None) -> bytes:
    """The response body (Content-Length or chunked); on_chunk(data) -> True stops reading (a disconnect)."""
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    out = b""
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await reader.readline()
            return out
        data = await reader.readexactly(size)
        await reader.readexactly(2)
        out += data
        if on_chunk is not None and on_chunk(data):
            return out


async def send(host: str, port: int, req: Planned, timeout: float) -> tuple[int, bytes, bool]:
    """(status, body, left early) of one request on its own connection."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = [f"{req.method} {req.path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close",
                f"Content-Length: {len(req.body)}"]
        headers = {"Content-Type": "application/json", **req.headers}
        head += [f"{k}: {v}" for k, v in headers.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + req.body)
        await writer.drain()

        async def response():
            status = int((await reader.readline()).split()[1])
            hs = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                k, _, v = line.decode("latin-1").partition(":")
                hs[k.strip().lower()] = v.strip()
            left = [False]

            def chunk(data: bytes) -> bool:
                left[0] = req.kind == "disconnect" and b"data: {" in data
                return left[0]

            body = await _read_body(reader, hs, chunk)
            return status, body, left[0]

        return await asyncio.wait_for(response(), timeout)
    finally:
        writer.close()


def classify(req: Planned, status: int, body: bytes, left: bool) -> tuple[str, str | None]:
    """(outcome, why when unexpected) of one reply."""
    if req.kind == "bad":
        return ("bad", None) if 400 <= status < 500 and status != 429 else ("unexpected", f"{status} for a bad request")
    if status == 429:
        return "rejected", None
    if status != 200:
        return "unexpected", f"{status}: {body[:200]!r}"
    if left:
        return "disconnected", None
    if req.stream:
        text = body.decode("utf-8", "replace")
        if '"error"' in text or not text.rstrip().endswith("data: [DONE]"):
            return "unexpected", f"stream: {text[-200:]!r}"
        return "completed", None
    try:
        reply = json.loads(body)
        ok = bool(reply["choices"]) and reply["usage"]["completion_tokens"] >= 1
    except (ValueError, KeyError, TypeError):
        ok = False
    return ("completed", None) if ok else ("unexpected", f"200 body: {body[:200]!r}")


async def drive(url: str, plan: list[Planned], concurrency: int, timeout: float = 120.0, backoff: float = 0.25,
                on_progress=None) -> dict:
    """Send every planned request, at most `concurrency` at a time (a client that got 429 waits `backoff` seconds
    before its next request, as Retry-After asks); returns the counts by outcome and up to 10 examples of
    unexpected replies. on_progress(done) is called after each reply."""
    u = urlparse(url)
    counts = {k: 0 for k in ("completed", "disconnected", "rejected", "bad", "unexpected")}
    examples: list[str] = []
    sem = asyncio.Semaphore(concurrency)
    done = [0]

    async def one(req: Planned) -> None:
        async with sem:
            try:
                outcome, why = classify(req, *await send(u.hostname, u.port, req, timeout))
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError) as e:
                outcome, why = "unexpected", f"{type(e).__name__}: {e}"
            counts[outcome] += 1
            if outcome == "rejected":
                await asyncio.sleep(backoff)
            if why is not None and len(examples) < 10:
                examples.append(f"{req.kind} {req.path}: {why}")
            done[0] += 1
            if on_progress is not None:
                on_progress(done[0])

    await asyncio.gather(*(one(r) for r in plan))
    return {"counts": counts, "unexpected_examples": examples}


# ---------------------------------------------------------------------- the server
def rss_mib(pid: int) -> float | None:
    """Resident set size of a process in MiB (Linux /proc), None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def server_metrics(base: str) -> dict:
    """The server's /metrics after the run: slots in use, waiting requests, 429s and timeouts, replies by status."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        lines = [ln for ln in r.read().decode().splitlines() if ln and not ln.startswith("#")]
    values = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines}
    by_status: dict[str, int] = {}
    for k, v in values.items():
        if k.startswith("jdeep_requests_total{"):
            status = k.split('status="')[1].split('"')[0]
            by_status[status] = by_status.get(status, 0) + int(v)
    keep = ("jdeep_slots_used", "jdeep_requests_waiting", "jdeep_requests_rejected_total",
            "jdeep_request_timeouts_total")
    return {**{k: values.get(k) for k in keep}, "http_status": dict(sorted(by_status.items()))}


def start_server(args, folder: str) -> tuple[subprocess.Popen, str]:
    """`jdeep serve` on a free port as a child process; returns it and its base URL once /health answers 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "jdeep.cli", "serve", "--model", folder, "--port", str(port), "--served-model-name",
           args.served_model_name, "--max-num-seqs", str(args.max_num_seqs), "--max-len", str(args.max_len),
           "--prefill-chunk", str(args.prefill_chunk), "--log-level", "warning"]
    if args.max_waiting is not None:
        cmd += ["--max-waiting", str(args.max_waiting)]
    log = open(os.path.join(folder, "server.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while time.time() - t0 < 900:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log.name}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not answer /health within 900 s")


def write_model(config: str, folder: str) -> int:
    """A seeded random tiny DeepSeek-V4 with a word-level tokenizer in `folder`; returns its vocabulary size."""
    cfg = one_layer_config() if config == "one-layer" else dict(TINY_CONFIG)
    random_checkpoint(cfg, folder, seed=0)
    write_word_tokenizer(os.path.join(folder, "tokenizer.json"), cfg["vocab_size"], chat_markers=True)
    return cfg["vocab_size"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (http://HOST:PORT, without /v1); default: start one")
    p.add_argument("--server-pid", type=int, help="with --url: the server's pid, for its RSS")
    p.add_argument("--served-model-name", default="soak")
    p.add_argument("--config", choices=CONFIGS, default="tiny", help="the random model started without --url")
    p.add_argument("-n", "--num-requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--backoff", type=float, default=0.25, help="seconds a client waits after a 429")
    p.add_argument("--warmup-requests", type=int, default=500, help="requests before the 'warm' RSS reading")
    p.add_argument("--rss-every", type=int, default=1000, help="also read the RSS every this many requests")
    p.add_argument("--max-seconds", type=float, help="stop sending new batches of requests after this long")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=48)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--max-waiting", type=int, help="the server's --max-waiting (default: its own)")
    p.add_argument("--vocab-size", type=int, default=512, help="with --url: prompt ids drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
    args = p.parse_args()

    proc, tmp = None, None
    if args.url:
        base, pid, vocab = args.url.rstrip("/"), args.server_pid, args.vocab_size
    else:
        tmp = tempfile.TemporaryDirectory(prefix="jdeep-soak-")
        vocab = write_model(args.config, tmp.name)
        t0 = time.perf_counter()
        proc, base = start_server(args, tmp.name)
        pid = proc.pid
        print(f"server up in {time.perf_counter() - t0:.1f} s (pid {pid})", file=sys.stderr, flush=True)
    plan = make_plan(args.num_requests, args.served_model_name, vocab, args.max_len, args.max_tokens,
                     args.max_prompt, args.seed)
    report = {"requests_planned": len(plan), "concurrency": args.concurrency, "config": args.config,
              "rss_mib": {"start": rss_mib(pid) if pid else None}, "rss_trace_mib": []}
    totals = {k: 0 for k in ("completed", "disconnected", "rejected", "bad", "unexpected")}
    examples: list[str] = []
    t_start, sent = time.perf_counter(), 0
    try:
        # batches: the warm-up, then --rss-every at a time (an RSS reading after each)
        edges = [0, min(args.warmup_requests, len(plan))]
        while edges[-1] < len(plan):
            edges.append(min(len(plan), edges[-1] + args.rss_every))
        for a, b in zip(edges, edges[1:]):
            if args.max_seconds and time.perf_counter() - t_start > args.max_seconds:
                break
            out = asyncio.run(drive(base + "/v1", plan[a:b], args.concurrency, backoff=args.backoff))
            sent = b
            for k, v in out["counts"].items():
                totals[k] += v
            examples += out["unexpected_examples"][:10 - len(examples)]
            rss = rss_mib(pid) if pid else None
            if a == 0:
                report["rss_mib"]["warm"] = rss
            report["rss_trace_mib"].append([b, rss])
            print(f"{b} requests, {time.perf_counter() - t_start:.0f} s: {totals}, RSS {rss} MiB", file=sys.stderr,
                  flush=True)
        time.sleep(1.0)
        report["rss_mib"]["end"] = rss_mib(pid) if pid else None
        report["server_metrics_end"] = server_metrics(base)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
        if tmp is not None:
            with open(os.path.join(tmp.name, "server.log"), errors="replace") as f:
                noisy = [ln.rstrip() for ln in f if any(w in ln for w in ("ERROR", "WARNING", "Traceback"))]
            report["server_log_errors_and_warnings"] = {"count": len(noisy), "first": noisy[:5]}
            tmp.cleanup()
    wall = time.perf_counter() - t_start
    rss = report["rss_mib"]
    report.update(requests_sent=sent, outcomes=totals, unexpected_examples=examples, wall_seconds=round(wall, 1),
                  requests_per_second=round(sent / wall, 1))
    if rss.get("warm") and rss.get("end"):
        report["rss_growth_after_warmup_pct"] = round(100 * (rss["end"] - rss["warm"]) / rss["warm"], 2)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if totals["unexpected"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
