"""Step 5 of the doctor: what a step costs on this platform, for a loaded model (regions mode on Neuron).

- dispatch: the host's cost of one program call (a trivial jitted program, called and waited for), times the calls
  one regions-mode decode step makes (per layer its attention half and MoE half, plus embed and head), next to the
  measured decode step: the share of a step the host's dispatch takes.
- latency: TTFT and ITL per batch bucket (`jdeep bench`'s run, greedy, random prompts).
- sampler_transfer: moving one step's logits [B, V] to the sampler's device and the tokens back (on Neuron the
  sampler runs on the host CPU backend: Model.sampler_device)."""

from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ....model.model import Model
from ...perf.bench import run_bench

__all__ = ["dispatch_cost", "latency", "sampler_transfer"]


def _timed(fn, repeats: int) -> float:
    """Median seconds of fn() over repeats (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def latency(model: Model, batch_sizes: Sequence[int], prompt_len: int = 64, new_tokens: int = 16) -> list[dict]:
    result = run_bench(model, input_len=prompt_len, output_len=new_tokens, batch_sizes=tuple(batch_sizes))
    return [{"batch": r["batch_size"], "prompt": r["input_len"], "ttft_ms": round(r["ttft_s"] * 1e3, 2),
             "itl_ms_p50": round(r["itl_ms"]["p50"], 3), "itl_ms_p99": round(r["itl_ms"]["p99"], 3),
             "decode_tok_s": round(r["decode_tok_s"], 1)} for r in result["runs"]]


def dispatch_cost(model: Model, batch_sizes: Sequence[int], repeats: int = 200) -> dict:
    """Per-call host cost (a trivial program, called and waited for) times the calls of one decode step."""
    device = jax.devices()[0]
    x = jax.device_put(jnp.zeros((max(batch_sizes), 1), jnp.int32), device)
    trivial = jax.jit(lambda a: a + 1)
    per_call = _timed(lambda: trivial(x).block_until_ready(), repeats)
    calls = 2 * model.config.n_layers + 2 if model.compile_mode == "regions" else 1
    return {"per_call_us": round(per_call * 1e6, 2), "calls_per_decode_step": calls,
            "dispatch_ms_per_step": round(per_call * calls * 1e3, 3), "compile_mode": model.compile_mode}


def sampler_transfer(model: Model, batch_sizes: Sequence[int], repeats: int = 50) -> list[dict]:
    """Logits [B, V] (model dtype) to the sampler's device and int32 tokens [B, 1] back to the model's."""
    model_device = jax.devices()[0]
    out = []
    for B in batch_sizes:
        logits = jax.device_put(jnp.zeros((B, model.config.vocab_size), jnp.float32), model_device)
        to = _timed(lambda: jax.block_until_ready(model.to_sampler(logits)), repeats)
        tokens = np.zeros((B, 1), np.int32)
        back = _timed(lambda: jax.block_until_ready(model.put(tokens)), repeats)
        out.append({"batch": B, "sampler_device": str(model.sampler_device or model_device),
                    "logits_to_sampler_us": round(to * 1e6, 1), "tokens_back_us": round(back * 1e6, 1),
                    "logits_bytes": B * model.config.vocab_size * 4})
    return out
