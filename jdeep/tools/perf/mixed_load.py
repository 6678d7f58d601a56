"""A mixed workload through the Engine: streams decoding while a long prompt arrives (`jdeep bench --mixed`).

For each prefill chunk length c (the token budget is the engine's default, slots + c): `n_streams` requests with
short prompts decode (ignore_eos, long enough to outlast the prefill); once each has its first token, a prompt of
`long_len` tokens arrives; the engine runs until that prompt has its first token. Measured:
    ttft_alone_s   the long prompt's time to first token in an otherwise idle engine
    ttft_s         its time to first token while the streams decode, and the ratio of the two
    itl_ms         the streams' inter-token gaps while the long prompt prefills (p50, p99, max)
    decode_step_ms an iteration of the streams alone (median); chunk_ms the long prompt's prefill chunks alone (mean,
                   max: a later chunk attends to more context); itl_bound_ms p50/p99 of decode_step_ms + chunk k alone
                   (what an iteration of both should cost); iteration_over_bound: each mixed iteration's time over
                   its bound (median, max)
    stalls         iterations in which a running stream got no token (0: no head-of-line blocking)
A rehearsal with a shorter long prompt runs first, so every program the measurement reaches is compiled.

JSON (the bench's "mixed" section): [{"streams", "long_len", "prefill_chunk", "max_num_batched_tokens",
"iterations", "stalls", "ttft_s", "ttft_alone_s", "ttft_ratio", "itl_ms": {"p50", "p99", "max"},
"decode_step_ms", "chunk_ms": {"mean", "max"}, "itl_bound_ms": {"p50", "p99"}, "iteration_over_bound": {"p50", "max"}}]
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from ...model.model import Model
from ...runtime.engine import Engine
from ...runtime.sampling import SamplingParams

__all__ = ["run_mixed", "format_mixed"]

STREAM_PROMPT = 32          # tokens in each stream's prompt


def _timed_step(eng: Engine) -> float:
    t0 = time.perf_counter()
    eng.step()
    return time.perf_counter() - t0


def _start_streams(eng: Engine, prompts: list[list[int]], max_new: int) -> list[str]:
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=max_new)) for p in prompts]
    while any(not eng.outputs[r].tokens for r in ids):
        eng.step()
    return ids


def _first_token_time(eng: Engine, prompt: list[int], streams: list[str]
                      ) -> tuple[float, list[dict], list[float]]:
    """Add `prompt` and step until it has a token: (seconds, per-iteration {stream: (tokens gained, time)}, each
    iteration's seconds)."""
    t0 = time.perf_counter()
    rid = eng.add_request(prompt, SamplingParams(max_new_tokens=1))
    log, times = [{r: (1, t0) for r in streams}], []     # the streams' last token came no later than the arrival
    while not eng.outputs[rid].tokens:
        before = {r: len(eng.outputs[r].tokens) for r in streams if not eng.outputs[r].finished}
        t = time.perf_counter()
        eng.step()
        now = time.perf_counter()
        times.append(now - t)
        log.append({r: (len(eng.outputs[r].tokens) - k, now) for r, k in before.items()})
    ttft = time.perf_counter() - t0
    eng.release(rid)
    return ttft, log, times


def run_mixed(model: Model, long_len: int = 16384, n_streams: int = 4, chunks: Sequence[int] = (256,),
              max_num_seqs: int = 8, seed: int = 0, progress: Callable[[dict], None] | None = None) -> list[dict]:
    """The mixed workload for each prefill chunk length (module docstring); a list of result dicts."""
    if long_len < 2 or n_streams < 1 or not chunks or min(chunks) < 1 or n_streams >= max_num_seqs:
        raise ValueError(f"need long_len >= 2, 1 <= n_streams < max_num_seqs and positive chunks, got {long_len}, "
                         f"{n_streams}, {max_num_seqs}, {list(chunks)}")
    rng = np.random.default_rng(seed)
    V = model.config.vocab_size
    long_prompt = rng.integers(2, V, size=long_len).tolist()
    stream_prompts = [rng.integers(2, V, size=STREAM_PROMPT).tolist() for _ in range(n_streams)]
    out = []
    for chunk in chunks:
        max_new = -(-long_len // chunk) + 64
        eng = Engine(model, max_num_seqs=max_num_seqs, max_len=max(long_len + 2, STREAM_PROMPT + max_new + 2),
                     prefill_chunk=chunk, ignore_eos=True, seed=seed)
        chunk = eng.chunk
        # rehearsal: every program below (decode windows, the full and the last chunk's prefill) compiles here
        streams = _start_streams(eng, stream_prompts, max_new)
        _first_token_time(eng, long_prompt[:chunk + long_len % chunk], streams)
        for r in streams:
            eng.release(r)
        ttft_alone, _, chunk_s = _first_token_time(eng, long_prompt, [])
        streams = _start_streams(eng, stream_prompts, max_new)
        decode_ms = 1e3 * float(np.median([_timed_step(eng) for _ in range(8)]))
        ttft, log, mixed_s = _first_token_time(eng, long_prompt, streams)
        gaps, last = [], {r: None for r in streams}
        stalls = 0
        for entry in log:
            for r, (gained, at) in entry.items():
                stalls += gained == 0
                if gained and last[r] is not None:
                    gaps.append((at - last[r]) * 1e3)
                if gained:
                    last[r] = at
        for r in streams:
            eng.release(r)
        # chunk k costs more the later it comes (it attends to the k chunks before it): the bound pairs each mixed
        # iteration with the same chunk alone
        bound = [decode_ms + 1e3 * c for c in chunk_s]
        r = {"streams": n_streams, "long_len": long_len, "prefill_chunk": chunk,
             "max_num_batched_tokens": eng.max_num_batched_tokens, "iterations": len(mixed_s), "stalls": stalls,
             "ttft_s": ttft, "ttft_alone_s": ttft_alone, "ttft_ratio": ttft / ttft_alone,
             "itl_ms": {"p50": float(np.percentile(gaps, 50)) if gaps else None,
                        "p99": float(np.percentile(gaps, 99)) if gaps else None,
                        "max": max(gaps) if gaps else None},
             "decode_step_ms": decode_ms, "chunk_ms": {"mean": 1e3 * float(np.mean(chunk_s)),
                                                       "max": 1e3 * max(chunk_s)},
             "itl_bound_ms": {"p50": float(np.percentile(bound, 50)), "p99": float(np.percentile(bound, 99))},
             "iteration_over_bound": {"p50": float(np.median(np.array(mixed_s) * 1e3 / np.array(bound)[:len(mixed_s)])),
                                      "max": float(np.max(np.array(mixed_s) * 1e3 / np.array(bound)[:len(mixed_s)]))}}
        if progress is not None:
            progress(r)
        out.append(r)
    return out


def format_mixed(rows: list[dict]) -> str:
    """The mixed-workload results as a table."""
    if not rows:
        return ""
    head = (f"mixed workload: {rows[0]['streams']} streams decoding, a {rows[0]['long_len']}-token prompt arrives\n"
            f"{'chunk':>6} {'budget':>7} {'stalls':>6} {'ITL p50':>9} {'ITL p99':>9} {'ITL max':>9} {'bound p50':>9} "
            f"{'bound p99':>9} {'TTFT':>8} {'alone':>8} {'ratio':>6}")
    lines = [head]
    for r in rows:
        itl = r["itl_ms"]
        fmt = (lambda v: f"{v:7.1f}ms" if v is not None else f"{'-':>9}")
        lines.append(f"{r['prefill_chunk']:>6} {r['max_num_batched_tokens']:>7} {r['stalls']:>6} {fmt(itl['p50'])} "
                     f"{fmt(itl['p99'])} {fmt(itl['max'])} {fmt(r['itl_bound_ms']['p50'])} {fmt(r['itl_bound_ms']['p99'])} "
                     f"{r['ttft_s']:7.2f}s "
                     f"{r['ttft_alone_s']:7.2f}s {r['ttft_ratio']:6.2f}")
    return "\n".join(lines)
