"""`jdeep bench --speculative-config`: decode speed with speculative decoding against plain decoding in the same run.

For each batch size, the same prompts are decoded greedily `output_len` tokens plainly (jdeep.generate) and with
each k in `ks` (MTP or DSpark drafts: speculative.generate.speculative_generate), each after a warm-up call so
compiling is not timed. Decode
time is the whole call less the prefill (the same call with one output token), so decode tok/s =
B x (output_len - 1) / decode time. With greedy decoding both produce the same tokens ("tokens_equal").

Result: {"speculative": {"method", "output_len", "runs": [{"batch_size", "plain_decode_tok_s", "k": [{"k",
"decode_tok_s", "speedup", "acceptance_rate", "acceptance_per_position", "mean_accepted_length", "tokens_equal"}]}]}}
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ...model.model import Model
from ...runtime.generate import generate
from ...runtime.sampling import SamplingParams
from ...speculative.generate import speculative_generate

__all__ = ["run_speculative", "format_speculative"]


def _timed(fn):
    fn()                                   # warm-up: compiles every program the timed call runs
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def run_speculative(model: Model, prompt_sets: Sequence[np.ndarray], output_len: int, ks: Sequence[int],
                    progress=None, method: str = "mtp") -> dict:
    """prompt_sets: one int32 [B, L] batch per batch size (tools/perf/bench.bench_prompts); method "mtp" or "dspark"."""
    if output_len < 2:
        raise ValueError(f"the speculative bench needs output_len >= 2, got {output_len}")
    runs = []
    for ids in prompt_sets:
        B = len(ids)
        prompts = [row.tolist() for row in ids]
        _, prefill = _timed(lambda: generate(model, prompts, max_new_tokens=1, ignore_eos=True))
        plain, total = _timed(lambda: generate(model, prompts, max_new_tokens=output_len, ignore_eos=True))
        plain_tok_s = B * (output_len - 1) / max(total - prefill, 1e-9)
        run = {"batch_size": B, "plain_decode_tok_s": plain_tok_s, "k": []}
        rows = [np.asarray(r, np.int32) for r in ids]
        for k in ks:
            def spec(n):
                return lambda: speculative_generate(model, rows, [SamplingParams(max_new_tokens=n)] * B, [()] * B, method,
                                                   k)
            _, spec_prefill = _timed(spec(1))
            (tokens, stats, _, _), spec_total = _timed(spec(output_len))
            tok_s = B * (output_len - 1) / max(spec_total - spec_prefill, 1e-9)
            entry = {"k": k, "decode_tok_s": tok_s, "speedup": tok_s / plain_tok_s,
                     "acceptance_rate": stats["acceptance_rate"],
                     "acceptance_per_position": stats["acceptance_per_position"],
                     "mean_accepted_length": stats["mean_accepted_length"],
                     "tokens_equal": bool(np.array_equal(tokens, plain.tokens))}
            run["k"].append(entry)
            if progress is not None:
                progress(B, entry)
        runs.append(run)
    return {"method": method, "output_len": output_len, "runs": runs}


def format_speculative(spec: dict) -> str:
    lines = [f"speculative decoding ({spec['method']}, greedy, {spec['output_len']} tokens): decode tok/s vs plain",
             f"{'B':>4} {'k':>2} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} {'accepted/iter':>14} "
             f"{'accept rate':>12}  per position   same tokens"]
    for r in spec["runs"]:
        for e in r["k"]:
            per = " ".join(f"{a:.2f}" for a in e["acceptance_per_position"])
            lines.append(f"{r['batch_size']:>4} {e['k']:>2} {r['plain_decode_tok_s']:>12.1f} {e['decode_tok_s']:>11.1f} "
                         f"{e['speedup']:>7.2f}x {e['mean_accepted_length'] - 1:>14.2f} {e['acceptance_rate']:>12.2f}  "
                         f"{per:<14} {'yes' if e['tokens_equal'] else 'NO'}")
    return "\n".join(lines)
