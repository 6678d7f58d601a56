"""A bounded load test of a running OpenAI-compatible server through the official `openai` client.

`run_load` sends N concurrent streaming /v1/completions requests with random token-id prompts and lengths,
some sampled with a seed, some closing their stream early (a client that disconnects), and records every
request's tokens and latencies: time to first token, the gaps between tokens and end to end. `summarize`
gives their p50/p99. Used by tests/serve/test_server.py and `scripts/serve_load.py` (needs `pip install
openai`, part of jdeep's test extra).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

__all__ = ["LoadRequest", "LoadResult", "make_requests", "run_load", "summarize"]


@dataclass(frozen=True)
class LoadRequest:
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    disconnect_after: int | None = None   # close the stream after this many chunks


@dataclass
class LoadResult:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    disconnected: bool = False
    error: str | None = None


def make_requests(n: int, vocab_size: int, seed: int = 0, min_prompt: int = 2, max_prompt: int = 40,
                  max_tokens: int = 16, n_disconnect: int = 2, first_token: int | None = 0) -> list[LoadRequest]:
    """n requests with random prompts (lengths uniform in [min_prompt, max_prompt]) and max_tokens in
    [1, max_tokens]; every 4th one sampled (temperature 0.8, top_p 0.9, its own seed); `n_disconnect` of them
    (spread over the batch) close their stream after 2 chunks."""
    rng = np.random.default_rng(seed)
    quit_at = set(np.linspace(0, n - 1, n_disconnect + 2, dtype=int)[1:-1].tolist()) if n_disconnect else set()
    out = []
    for i in range(n):
        length = int(rng.integers(min_prompt, max_prompt + 1))
        prompt = rng.integers(2, vocab_size, size=length).tolist()
        if first_token is not None:
            prompt[0] = first_token
        sampled = i % 4 == 3
        out.append(LoadRequest(prompt, max_tokens if i in quit_at else int(rng.integers(1, max_tokens + 1)),
                               0.8 if sampled else 0.0, 0.9 if sampled else 1.0, 1000 + i if sampled else None,
                               2 if i in quit_at else None))
    return out


async def _one(client, model: str, req: LoadRequest, res: LoadResult) -> None:
    t0 = last = time.perf_counter()
    stream = await client.completions.create(
        model=model, prompt=req.prompt, max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
        seed=req.seed, stream=True, extra_body={"return_token_ids": True})
    chunks = 0
    try:
        async for chunk in stream:
            now = time.perf_counter()
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            ids = getattr(c, "token_ids", None) or []
            if ids:
                if res.ttft is None:
                    res.ttft = now - t0
                else:
                    res.itl += [(now - last) / len(ids)] * len(ids)
                last = now
                res.tokens += ids
            if c.finish_reason is not None:
                res.finish_reason = c.finish_reason
            chunks += 1
            if req.disconnect_after is not None and chunks >= req.disconnect_after:
                res.disconnected = True
                break
    finally:
        await stream.close()
    res.e2e = time.perf_counter() - t0


async def run_load(base_url: str, model: str, requests: list[LoadRequest], api_key: str = "none",
                   timeout: float = 600.0) -> list[LoadResult]:
    """Send every request at once (each its own streaming connection); results in request order."""
    import openai  # lazy: the official client is an optional dependency (the `test` extra)

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout)
    results = [LoadResult() for _ in requests]

    async def guarded(req, res):
        try:
            await _one(client, model, req, res)
        except Exception as e:      # reported per request; the others go on
            res.error = f"{type(e).__name__}: {e}"

    try:
        await asyncio.gather(*(guarded(q, r) for q, r in zip(requests, results)))
    finally:
        await client.close()
    return results


def summarize(results: list[LoadResult], wall: float | None = None) -> dict:
    """p50/p99 of TTFT, inter-token latency and end-to-end latency (seconds) of the completed requests."""
    done = [r for r in results if not r.disconnected and r.error is None]

    def pct(xs: list[float]) -> dict:
        return {"p50": float(np.percentile(xs, 50)), "p99": float(np.percentile(xs, 99))} if xs else {}

    out = {"requests": len(results), "completed": len(done), "disconnected": sum(r.disconnected for r in results),
           "errors": sum(r.error is not None for r in results), "tokens": sum(len(r.tokens) for r in done),
           "ttft_s": pct([r.ttft for r in done if r.ttft is not None]),
           "itl_s": pct([x for r in done for x in r.itl]), "e2e_s": pct([r.e2e for r in done])}
    if wall:
        out["wall_s"] = wall
        out["tokens_per_s"] = out["tokens"] / wall
    return out
