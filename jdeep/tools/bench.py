"""Benchmark harness: prefill and decode speed, latency percentiles, memory and a bandwidth roofline.

For each batch size B: B prompts of `input_len` tokens are prefilled as one chunk, then `output_len`
greedy decode steps run one compiled step at a time (each waited for, so every inter-token latency is
measured). Compilation is timed separately (ahead-of-time lower + compile of both programs). The
achieved memory bandwidth of a decode step is the bytes it must read — the dense weights, the routed
experts B tokens can reach, the decode state up to the current length — over its latency; the roofline
fraction divides that by a streaming-read bandwidth measured on the same device right before.

JSON schema "jdeep.bench/1" (stable; fields only ever added):
    {"schema", "model": {"config", "dtype", "weight_bytes", "kv_bytes_per_token", "state_fixed_bytes",
                         "compile_mode", "host_embedding"},
     "machine": {"backend", "device", "measured_bandwidth_gbs"},
     "runs": [{"batch_size", "input_len", "output_len", "compile_s": {"prefill", "decode"}, "ttft_s",
               "prefill_tok_s", "itl_ms": {"mean", "p50", "p99"}, "decode_tok_s_per_seq", "decode_tok_s",
               "decode_step_bytes", "achieved_bandwidth_gbs", "roofline_fraction", "peak_rss_bytes"}],
     "compare": {"transformers": {...}}}       # optional (added): only with compare_transformers / --compare
The optional "compare" section (jdeep/serve/compare.py) holds transformers' DeepseekV4ForCausalLM on the same
checkpoint, dtype and prompts:
    {"transformers_version", "torch_version", "dtype", "attn_implementation", "threads", "load_s",
     "runs": [{"batch_size", "input_len", "output_len", "warmup_s", "ttft_s", "prefill_tok_s",
               "itl_ms": {"mean", "p50", "p99"}, "decode_tok_s_per_seq", "decode_tok_s"}],
     "ratios": [{"batch_size", "ttft", "prefill_tok_s", "decode_tok_s", "itl_p50"}],
     "agreement": [{"batch_size", "tokens", "rows_equal", "first_divergence", "row_first_divergence",
                    "mean_agreeing_prefix"}]}
Ratios are jdeep / transformers: for the throughputs (prefill_tok_s, decode_tok_s) > 1 means jdeep is faster,
for the latencies (ttft, itl_p50) < 1 means jdeep is faster. "agreement" compares the greedy tokens row by row
(the first position where the engines differ; random weights can have near-ties, so it informs, never fails).
"""

from __future__ import annotations

import os
import resource
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..model.model import Model
from ..runtime.steps import length_bucket
from ..state import state_bytes
from .compare import compare_section, hf_config, require_transformers
from .info import kv_bytes_per_token

__all__ = ["run_bench", "bench_prompts", "measure_bandwidth", "format_report", "format_compare", "plot_sweep",
           "SCHEMA"]

SCHEMA = "jdeep.bench/1"
_EXPERT_KEYS = ("w1", "w2", "w3")


def measure_bandwidth(n_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Streaming-read bandwidth of the default device in GB/s: the best of `repeats` full reductions of an
    n_bytes float32 array (every byte read once)."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda a: jnp.sum(a))
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return n_bytes / best / 1e9


def _weight_bytes(params: dict) -> tuple[int, int]:
    """(total, routed-expert) bytes of the device param tree."""
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    expert = 0
    for seg in params["segments"]:
        for slot in seg:
            for k in _EXPERT_KEYS:
                expert += sum(x.nbytes for x in jax.tree_util.tree_leaves(slot["ffn"][k]))
    return total, expert


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bench_prompts(config: ModelConfig, input_len: int, batch_sizes: Sequence[int], seed: int = 0,
                  prompts: Sequence[Sequence[int]] | None = None) -> list[np.ndarray]:
    """The bench's prompt batch for each batch size: int32 [B, input_len]. Random ids in [2, vocab) after the
    BOS token (one generator seeded `seed`, drawn batch after batch), or `prompts` cut or tiled to input_len
    and repeated over the rows."""
    rng = np.random.default_rng(seed)
    out = []
    for B in batch_sizes:
        if prompts:
            base = [np.resize(np.asarray(p, np.int32), input_len) for p in prompts]
            ids = np.stack([base[i % len(base)] for i in range(B)])
        else:
            ids = rng.integers(2, config.vocab_size, size=(B, input_len)).astype(np.int32)
            ids[:, 0] = config.bos_token_id or 0
        out.append(ids)
    return out


def run_bench(model: Model, input_len: int = 512, output_len: int = 32, batch_sizes: Sequence[int] = (1, 8),
              seed: int = 0, prompts: Sequence[Sequence[int]] | None = None, bandwidth_gbs: float | None = None,
              compare_transformers: str | os.PathLike | None = None) -> dict:
    """Run the benchmark; returns the schema above. `prompts` (token ids) replace the random ones (each is
    cut or tiled to input_len). `compare_transformers`: the checkpoint folder `model` was loaded from; the
    transformers model then runs from it on the same prompts and the result gets the "compare" section
    (needs torch and transformers: pip install 'jdeep[compare]')."""
    if input_len < 1 or output_len < 1 or not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"input_len, output_len and batch sizes must be positive, got {input_len}, {output_len}, "
                         f"{list(batch_sizes)}")
    cfg = model.config
    if input_len + output_len > cfg.max_position_embeddings:
        raise ValueError(f"input_len + output_len = {input_len + output_len} exceeds max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    if compare_transformers is not None:
        require_transformers()
        hf_config(cfg)                       # an incomparable checkpoint fails before the jdeep runs
    bw = bandwidth_gbs or measure_bandwidth()
    total, expert_bytes = _weight_bytes(model.params)
    dense_bytes = total - expert_bytes
    kv_tok = kv_bytes_per_token(cfg, model.dtype, model.numerics)
    max_len = length_bucket(input_len + output_len, 256)
    prompt_sets = bench_prompts(cfg, input_len, batch_sizes, seed, prompts)
    runs, tokens = [], []
    for ids in prompt_sets:
        run, toks = _run_one(model, ids, output_len, max_len, bw, dense_bytes, expert_bytes, kv_tok)
        runs.append(run)
        tokens.append(toks)
    result = {
        "schema": SCHEMA,
        "model": {"config": cfg.to_dict(), "dtype": np.dtype(model.dtype).name, "weight_bytes": total,
                  "compile_mode": model.compile_mode, "host_embedding": model.host_embed is not None,
                  "kv_bytes_per_token": kv_tok,
                  "state_fixed_bytes": state_bytes(cfg, model.plan, 1, 0, model.dtype, model.numerics)},
        "machine": {"backend": jax.default_backend(), "device": str(jax.devices()[0]),
                    "measured_bandwidth_gbs": bw},
        "runs": runs,
    }
    if compare_transformers is not None:
        result["compare"] = compare_section(compare_transformers, prompt_sets, runs, tokens, output_len,
                                            result["model"]["dtype"])
    return result


def _run_one(model: Model, ids: np.ndarray, output_len: int, max_len: int, bw: float, dense_bytes: int,
             expert_bytes: int, kv_tok: float) -> tuple[dict, np.ndarray]:
    """One batch ids int32 [B, L]: (run fields, greedy tokens int32 [B, output_len])."""
    cfg = model.config
    B, L = ids.shape
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy()
    state = model.init_state(B, max_len)
    history = model.new_history(B)
    step_fn = model.step_fn(all_logits=False)

    # compilation timed apart from the runs: ahead of time for a jitted step; for a host-driven step
    # (regions mode, host embedding) a first call on a throwaway state (its compile time includes one run)
    tok1 = np.zeros((B, 1), np.int32)
    compiled = []
    for toks, p in ((ids, pos), (tok1, tok1)):
        eng = model.engram_inputs(model.new_history(B), toks, p)
        t = time.perf_counter()
        if hasattr(step_fn, "lower"):
            compiled.append(step_fn.lower(model.params, state, model.put(toks), model.put(p), eng).compile())
        else:
            jax.block_until_ready(step_fn(model.params, model.init_state(B, max_len), model.put(toks),
                                          model.put(p), eng))
            compiled.append(step_fn)
        compiled.append(time.perf_counter() - t)
    prefill, t_prefill, decode, t_decode = compiled

    t0 = time.perf_counter()
    eng = model.engram_inputs(history, ids, pos)
    logits, state = prefill(model.params, state, model.put(ids), model.put(pos), eng)
    tok = model.fetch(jax.lax.top_k(logits, 1)[1])                   # waits for the prefill
    ttft = time.perf_counter() - t0
    itl, tokens = [], [tok]
    for i in range(output_len - 1):
        t = time.perf_counter()
        p = np.full((B, 1), L + i, np.int32)
        eng = model.engram_inputs(history, tok, p)
        logits, state = decode(model.params, state, model.put(tok.astype(np.int32)), model.put(p), eng)
        tok = model.fetch(jax.lax.top_k(logits, 1)[1])
        itl.append(time.perf_counter() - t)
        tokens.append(tok)
    itl_s = np.asarray(itl) if itl else np.asarray([np.nan])
    mean = float(np.mean(itl_s))
    # bytes one decode step reads: dense weights, the experts B tokens can reach, the state at mid length
    reach = min(1.0, B * cfg.n_activated_experts / cfg.n_routed_experts)
    ctx = L + output_len / 2
    step_bytes = dense_bytes + reach * expert_bytes + B * (kv_tok * ctx + state_bytes(cfg, model.plan, 1, 0,
                                                                                       model.dtype, model.numerics))
    achieved = step_bytes / mean / 1e9 if itl else float("nan")
    run = {
        "batch_size": B, "input_len": L, "output_len": output_len,
        "compile_s": {"prefill": t_prefill, "decode": t_decode},
        "ttft_s": ttft, "prefill_tok_s": B * L / ttft,
        "itl_ms": {"mean": mean * 1e3, "p50": float(np.percentile(itl_s, 50)) * 1e3,
                   "p99": float(np.percentile(itl_s, 99)) * 1e3},
        "decode_tok_s_per_seq": 1.0 / mean, "decode_tok_s": B / mean,
        "decode_step_bytes": step_bytes, "achieved_bandwidth_gbs": achieved, "roofline_fraction": achieved / bw,
        "peak_rss_bytes": _peak_rss(),
    }
    return run, np.concatenate(tokens, axis=1).astype(np.int32)


def format_report(result: dict) -> str:
    """A plain-text table of a run_bench result."""
    m = result["model"]
    lines = [f"weights {m['weight_bytes'] / 2**20:.1f} MiB ({m['dtype']}), state {m['kv_bytes_per_token']:.0f} B/token "
             f"+ {m['state_fixed_bytes'] / 2**20:.2f} MiB per sequence; device {result['machine']['device']}, "
             f"measured read bandwidth {result['machine']['measured_bandwidth_gbs']:.1f} GB/s",
             f"{'B':>4} {'in':>6} {'out':>5} {'compile s':>10} {'TTFT ms':>9} {'prefill tok/s':>14} {'ITL p50 ms':>11} "
             f"{'ITL p99 ms':>11} {'tok/s/seq':>10} {'tok/s':>9} {'GB/s':>7} {'roofline':>9} {'peak RSS MiB':>13}"]
    for r in result["runs"]:
        c = r["compile_s"]["prefill"] + r["compile_s"]["decode"]
        lines.append(f"{r['batch_size']:>4} {r['input_len']:>6} {r['output_len']:>5} {c:>10.1f} {r['ttft_s'] * 1e3:>9.1f} "
                     f"{r['prefill_tok_s']:>14.0f} {r['itl_ms']['p50']:>11.2f} {r['itl_ms']['p99']:>11.2f} "
                     f"{r['decode_tok_s_per_seq']:>10.1f} {r['decode_tok_s']:>9.1f} "
                     f"{r['achieved_bandwidth_gbs']:>7.2f} {r['roofline_fraction']:>9.3f} {r['peak_rss_bytes'] / 2**20:>13.0f}")
    if "transformers" in result.get("compare", {}):
        lines += ["", format_compare(result["compare"]["transformers"])]
    return "\n".join(lines)


def _divergence(a: dict) -> str:
    return "-" if a["first_divergence"] is None else str(a["first_divergence"])


def format_compare(hf: dict) -> str:
    """Plain-text tables of a result's "compare"/"transformers" section: transformers' numbers, then the
    jdeep/transformers ratios and the greedy agreement."""
    lines = [f"transformers {hf['transformers_version']} (torch {hf['torch_version']}, {hf['dtype']}, "
             f"{hf['attn_implementation']} attention, {hf['threads']} threads), same checkpoint and prompts; "
             f"loaded in {hf['load_s']:.1f} s",
             f"{'B':>4} {'in':>6} {'out':>5} {'warm-up s':>10} {'TTFT ms':>9} {'prefill tok/s':>14} {'ITL p50 ms':>11} "
             f"{'ITL p99 ms':>11} {'tok/s/seq':>10} {'tok/s':>9}"]
    for r in hf["runs"]:
        lines.append(f"{r['batch_size']:>4} {r['input_len']:>6} {r['output_len']:>5} {r['warmup_s']:>10.1f} "
                     f"{r['ttft_s'] * 1e3:>9.1f} {r['prefill_tok_s']:>14.0f} {r['itl_ms']['p50']:>11.2f} "
                     f"{r['itl_ms']['p99']:>11.2f} {r['decode_tok_s_per_seq']:>10.1f} {r['decode_tok_s']:>9.1f}")
    lines += ["jdeep / transformers (throughput: > 1 = jdeep faster; latency: < 1 = jdeep faster); greedy tokens: "
              "rows equal, first differing step",
              f"{'B':>4} {'TTFT':>8} {'prefill tok/s':>14} {'decode tok/s':>13} {'ITL p50':>9} {'rows equal':>11} "
              f"{'diverge at':>11}"]
    for q, a in zip(hf["ratios"], hf["agreement"]):
        lines.append(f"{q['batch_size']:>4} {q['ttft']:>8.2f} {q['prefill_tok_s']:>14.2f} {q['decode_tok_s']:>13.2f} "
                     f"{q['itl_p50']:>9.2f} {a['rows_equal']:>11.2f} {_divergence(a):>11}")
    return "\n".join(lines)


def plot_sweep(result: dict, path: str | os.PathLike) -> None:
    """A PNG of a run_bench sweep at `path`: decode tokens/s (aggregate and per sequence) and the roofline
    fraction against the batch size. ImportError without matplotlib (pip install 'jdeep[plot]')."""
    from matplotlib.figure import Figure  # optional extra `plot`: only `jdeep bench --plot` draws

    runs = result["runs"]
    fig = Figure(figsize=(9, 3.5))
    ax = fig.subplots(1, 2)
    bs = [r["batch_size"] for r in runs]
    ax[0].plot(bs, [r["decode_tok_s"] for r in runs], "o-", label="aggregate")
    ax[0].plot(bs, [r["decode_tok_s_per_seq"] for r in runs], "s--", label="per sequence")
    ax[0].set(xlabel="batch size", ylabel="decode tokens/s", xscale="log")
    ax[0].legend()
    ax[1].plot(bs, [r["roofline_fraction"] for r in runs], "o-")
    ax[1].set(xlabel="batch size", ylabel="fraction of measured bandwidth", xscale="log")
    fig.tight_layout()
    fig.savefig(path)
