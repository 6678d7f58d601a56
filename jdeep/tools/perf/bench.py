"""Benchmark harness: prefill and decode speed, latency percentiles, memory and a bandwidth roofline.

For each batch size B: B prompts of `input_len` tokens are prefilled in chunks of `prefill_chunk` tokens
(the engine's chunking: runtime.steps.pack_chunk, one step per chunk, so a long prompt needs the memory of
one chunk, not of the whole prompt), then `output_len` greedy decode steps run one compiled step at a time
(each waited for, so every inter-token latency is measured). Compilation is timed separately (ahead-of-time
lower + compile of every chunk-length program and of the decode program). The
achieved memory bandwidth of a decode step is the bytes it must read — the dense weights, the routed
experts B tokens can reach, the decode state up to the current length — over its latency; the roofline
fraction divides that by a streaming-read bandwidth measured on the same device right before.

JSON schema "jdeep.bench/1" (stable; fields only ever added):
    {"schema", "model": {"config", "dtype", "weight_bytes", "kv_bytes_per_token", "state_fixed_bytes",
                         "compile_mode", "host_embedding", "native_gemm_rows"},   # native_gemm_rows: added
     "machine": {"backend", "device", "measured_bandwidth_gbs"},
     "runs": [{"batch_size", "input_len", "output_len", "compile_s": {"prefill", "decode"}, "ttft_s",
               "prefill_tok_s", "itl_ms": {"mean", "p50", "p99"}, "decode_tok_s_per_seq", "decode_tok_s",
               "decode_step_bytes", "achieved_bandwidth_gbs", "roofline_fraction", "peak_rss_bytes",
               "prefill_chunk"}],                                    # prefill_chunk: added
     "compare": {"transformers": {...}},       # optional (added): only with compare_transformers / --compare
     "context_sweep": [{"context", "state_len", "prefill_len", "decode_steps", "prefill_chunk",
                        "compile_s": {"prefill", "decode"}, "prefill_s", "prefill_tok_s", "itl_ms": {"mean", "p50",
                        "p99"}, "state_bytes", "decode_step_bytes", "achieved_bandwidth_gbs", "peak_rss_bytes"}],
                                               # optional (added): run_context_sweep / --context-sweep ("runs" empty)
     "mixed": [...]}                           # optional (added): --mixed ("runs" empty), see tools/perf/mixed_load.py
run_context_sweep measures how decode cost grows with the context at B=1: for each context length c, a random
prompt of c - decode_steps tokens is prefilled in chunks into a state of state_len = c (rounded up to a power of
two >= 256) tokens, then decode_steps greedy steps are timed, so the last one attends to c - 1 earlier tokens.
state_bytes is that decode state's size (fixed part + kv_bytes_per_token * state_len); peak_rss_bytes is the
process's peak so far (the sweep runs in ascending order of context).
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

import inspect
import os
import resource
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ...config import ModelConfig
from ...model.model import Model
from ...runtime.engine import Engine
from ...runtime.steps import length_bucket, pack_chunk
from ...state import state_bytes
from .compare import compare_section, hf_config, require_transformers
from ..dev.info import kv_bytes_per_token
from .mixed_load import format_mixed
from .spec_bench import format_speculative

__all__ = ["run_bench", "run_context_sweep", "result_head", "bench_prompts", "measure_bandwidth", "format_report", "format_compare",
           "format_context_sweep", "plot_sweep", "SCHEMA", "PREFILL_CHUNK"]

SCHEMA = "jdeep.bench/1"
PREFILL_CHUNK: int = inspect.signature(Engine).parameters["prefill_chunk"].default   # the engine's (jdeep serve's)
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
              compare_transformers: str | os.PathLike | None = None, prefill_chunk: int = PREFILL_CHUNK) -> dict:
    """Run the benchmark; returns the schema above. `prompts` (token ids) replace the random ones (each is
    cut or tiled to input_len). `prefill_chunk`: prompt tokens per prefill step (default the engine's).
    `compare_transformers`: the checkpoint folder `model` was loaded from; the transformers model then runs
    from it on the same prompts and the result gets the "compare" section (needs torch and transformers:
    pip install 'jdeep[compare]')."""
    if input_len < 1 or output_len < 1 or prefill_chunk < 1 or not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"input_len, output_len, prefill_chunk and batch sizes must be positive, got {input_len}, "
                         f"{output_len}, {prefill_chunk}, {list(batch_sizes)}")
    cfg = model.config
    if input_len + output_len > cfg.max_position_embeddings:
        raise ValueError(f"input_len + output_len = {input_len + output_len} exceeds max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    if compare_transformers is not None:
        require_transformers()
        hf_config(cfg)                       # an incomparable checkpoint fails before the jdeep runs
    result = result_head(model, bandwidth_gbs)
    bw = result["machine"]["measured_bandwidth_gbs"]
    max_len = length_bucket(input_len + output_len, 256)
    prompt_sets = bench_prompts(cfg, input_len, batch_sizes, seed, prompts)
    runs, tokens = [], []
    for ids in prompt_sets:
        run, toks = _run_one(model, ids, output_len, max_len, bw, prefill_chunk)
        runs.append(run)
        tokens.append(toks)
    result["runs"] = runs
    if compare_transformers is not None:
        result["compare"] = compare_section(compare_transformers, prompt_sets, runs, tokens, output_len,
                                            result["model"]["dtype"])
    return result


def run_context_sweep(model: Model, contexts: Sequence[int], decode_steps: int = 32, seed: int = 0,
                      bandwidth_gbs: float | None = None, prefill_chunk: int = PREFILL_CHUNK,
                      progress: Callable[[dict], None] | None = None) -> dict:
    """Decode cost against the context length at B=1 (module docstring): the schema above with "runs" empty and
    one "context_sweep" entry per context, in ascending order; `progress(entry)` is called as each one is done
    (a long context prefills for minutes on a CPU)."""
    cfg = model.config
    contexts = sorted(set(int(c) for c in contexts))
    if decode_steps < 1 or prefill_chunk < 1 or not contexts or contexts[0] <= decode_steps:
        raise ValueError(f"contexts must exceed decode_steps ({decode_steps}) and decode_steps and prefill_chunk "
                         f"must be positive, got contexts {contexts}, prefill_chunk {prefill_chunk}")
    if contexts[-1] > cfg.max_position_embeddings:
        raise ValueError(f"context {contexts[-1]} exceeds max_position_embeddings {cfg.max_position_embeddings}")
    result = result_head(model, bandwidth_gbs)
    bw = result["machine"]["measured_bandwidth_gbs"]
    sweep = []
    for c in contexts:
        ids = bench_prompts(cfg, c - decode_steps, [1], seed)[0]
        state_len = length_bucket(c, 256)
        run, _ = _run_one(model, ids, decode_steps + 1, state_len, bw, prefill_chunk)
        sweep.append({
            "context": c, "state_len": state_len, "prefill_len": c - decode_steps, "decode_steps": decode_steps,
            "prefill_chunk": prefill_chunk, "compile_s": run["compile_s"], "prefill_s": run["ttft_s"],
            "prefill_tok_s": run["prefill_tok_s"], "itl_ms": run["itl_ms"],
            "state_bytes": state_bytes(cfg, model.plan, 1, state_len, model.dtype, model.numerics),
            "decode_step_bytes": run["decode_step_bytes"], "achieved_bandwidth_gbs": run["achieved_bandwidth_gbs"],
            "peak_rss_bytes": run["peak_rss_bytes"]})
        if progress is not None:
            progress(sweep[-1])
    result["runs"], result["context_sweep"] = [], sweep
    return result


def result_head(model: Model, bandwidth_gbs: float | None) -> dict:
    """The "schema", "model" and "machine" fields of a result (measuring the bandwidth unless given)."""
    cfg = model.config
    return {
        "schema": SCHEMA,
        "model": {"config": cfg.to_dict(), "dtype": np.dtype(model.dtype).name,
                  "weight_bytes": _weight_bytes(model.params)[0], "compile_mode": model.compile_mode,
                  "host_embedding": model.host_embed is not None,
                  "native_gemm_rows": model.numerics.native_gemm_rows,
                  "kv_bytes_per_token": kv_bytes_per_token(cfg, model.dtype, model.numerics),
                  "state_fixed_bytes": state_bytes(cfg, model.plan, 1, 0, model.dtype, model.numerics)},
        "machine": {"backend": jax.default_backend(), "device": str(jax.devices()[0]),
                    "measured_bandwidth_gbs": bandwidth_gbs or measure_bandwidth()},
    }


def _compile(model: Model, state, B: int, max_len: int, lengths: Sequence[int]
             ) -> tuple[dict[int, Callable], float, float]:
    """The step programs on `state` (B sequences of max_len tokens) for prefill chunks of each length in `lengths`
    (>= 16) and for decode steps ([B, 1]): ({length: program}, prefill compile s, decode compile s). Ahead of
    time for a jitted step, then each program run once on a throwaway state (the Engine's warmup; the compile
    seconds include that run), so the timed runs see what a served request sees."""
    step_fn = model.step_fn(all_logits=False)
    programs, seconds = {}, {}
    for S in [1, *sorted(set(lengths))]:
        toks = np.zeros((B, S), np.int32)
        eng = model.engram_inputs(model.new_history(B), toks, toks)
        t = time.perf_counter()
        if hasattr(step_fn, "lower"):
            programs[S] = step_fn.lower(model.params, state, model.put(toks), model.put(toks), eng).compile()
        else:
            programs[S] = step_fn
        # One run on a throwaway state, as the Engine's warmup does before serving: a program's first execution
        # pays one-time costs (XLA:CPU: about one extra run's time for a 256-token prefill chunk).
        jax.block_until_ready(programs[S](model.params, model.init_state(B, max_len), model.put(toks),
                                          model.put(toks), eng))
        seconds[S] = time.perf_counter() - t
    return programs, sum(v for S, v in seconds.items() if S != 1), seconds[1]


def _chunk_lengths(L: int, chunk: int) -> list[int]:
    """The step lengths (pack_chunk's buckets) of an L-token prompt prefilled `chunk` tokens at a time."""
    return sorted({length_bucket(min(chunk, L - start)) for start in range(0, L, chunk)})


def _prefill(model: Model, programs: dict[int, Callable], state, history, ids: np.ndarray, chunk: int):
    """ids int32 [B, L] through the model `chunk` tokens at a time (the engine's packing); returns (logits at
    the last prompt token [B, V], state)."""
    B, L = ids.shape
    rows = list(ids)
    for start in range(0, L, chunk):
        toks, pos, _ = pack_chunk(rows, [start] * B, B, chunk)
        eng = model.engram_inputs(history, toks, pos)
        logits, state = programs[toks.shape[1]](model.params, state, model.put(toks), model.put(pos), eng)
    return logits, state


def _run_one(model: Model, ids: np.ndarray, output_len: int, max_len: int, bw: float, chunk: int
             ) -> tuple[dict, np.ndarray]:
    """One batch ids int32 [B, L]: (run fields, greedy tokens int32 [B, output_len])."""
    cfg = model.config
    B, L = ids.shape
    state = model.init_state(B, max_len)
    programs, t_prefill, t_decode = _compile(model, state, B, max_len, _chunk_lengths(L, chunk))
    history = model.new_history(B)

    t0 = time.perf_counter()
    logits, state = _prefill(model, programs, state, history, ids, chunk)
    tok = model.fetch(jax.lax.top_k(logits, 1)[1])                   # waits for the prefill
    ttft = time.perf_counter() - t0
    decode = programs[1]
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
    total, expert_bytes = _weight_bytes(model.params)
    kv_tok = kv_bytes_per_token(cfg, model.dtype, model.numerics)
    reach = min(1.0, B * cfg.n_activated_experts / cfg.n_routed_experts)
    ctx = L + output_len / 2
    step_bytes = total - expert_bytes + reach * expert_bytes + B * (
        kv_tok * ctx + state_bytes(cfg, model.plan, 1, 0, model.dtype, model.numerics))
    achieved = step_bytes / mean / 1e9 if itl else float("nan")
    run = {
        "batch_size": B, "input_len": L, "output_len": output_len, "prefill_chunk": chunk,
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
    """A plain-text table of a run_bench result (or of a run_context_sweep result)."""
    m = result["model"]
    lines = [f"weights {m['weight_bytes'] / 2**20:.1f} MiB ({m['dtype']}), state {m['kv_bytes_per_token']:.0f} B/token "
             f"+ {m['state_fixed_bytes'] / 2**20:.2f} MiB per sequence; device {result['machine']['device']}, "
             f"measured read bandwidth {result['machine']['measured_bandwidth_gbs']:.1f} GB/s"
             + (f"; native CPU products of 2-{m['native_gemm_rows']} rows" if m.get("native_gemm_rows") else "")]
    if "context_sweep" in result:
        return "\n".join(lines + [format_context_sweep(result["context_sweep"])])
    if "mixed" in result:
        return "\n".join(lines + [format_mixed(result["mixed"])])
    if "speculative" in result:
        return "\n".join(lines + [format_speculative(result["speculative"])])
    lines += [f"{'B':>4} {'in':>6} {'out':>5} {'compile s':>10} {'TTFT ms':>9} {'prefill tok/s':>14} {'ITL p50 ms':>11} "
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


def format_context_sweep(sweep: list[dict]) -> str:
    """A plain-text table of a result's "context_sweep": per context, prefill time and speed, inter-token latency,
    its ratio to the shortest context's, decode-state MiB and peak RSS."""
    lines = [f"context sweep, batch 1, prefill chunk {sweep[0]['prefill_chunk']}, {sweep[0]['decode_steps']} decode "
             "steps timed at the end of each context",
             f"{'context':>8} {'compile s':>10} {'prefill s':>10} {'prefill tok/s':>14} {'ITL p50 ms':>11} "
             f"{'ITL p99 ms':>11} {'ITL x':>6} {'state MiB':>10} {'GB/s':>7} {'peak RSS MiB':>13}"]
    base = sweep[0]["itl_ms"]["p50"]
    for r in sweep:
        c = r["compile_s"]["prefill"] + r["compile_s"]["decode"]
        lines.append(f"{r['context']:>8} {c:>10.1f} {r['prefill_s']:>10.1f} {r['prefill_tok_s']:>14.0f} "
                     f"{r['itl_ms']['p50']:>11.2f} {r['itl_ms']['p99']:>11.2f} {r['itl_ms']['p50'] / base:>6.2f} "
                     f"{r['state_bytes'] / 2**20:>10.1f} {r['achieved_bandwidth_gbs']:>7.2f} "
                     f"{r['peak_rss_bytes'] / 2**20:>13.0f}")
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
    fraction against the batch size; of a run_context_sweep result: inter-token latency and decode-state bytes
    against the context length. ImportError without matplotlib (pip install 'jdeep[plot]')."""
    from matplotlib.figure import Figure  # optional extra `plot`: only `jdeep bench --plot` draws

    runs = result["runs"]
    fig = Figure(figsize=(9, 3.5))
    ax = fig.subplots(1, 2)
    if "context_sweep" in result:
        ctx = [r["context"] for r in result["context_sweep"]]
        ax[0].plot(ctx, [r["itl_ms"]["p50"] for r in result["context_sweep"]], "o-", label="p50")
        ax[0].plot(ctx, [r["itl_ms"]["p99"] for r in result["context_sweep"]], "s--", label="p99")
        ax[0].set(xlabel="context (tokens)", ylabel="inter-token latency (ms), batch 1", xscale="log")
        ax[0].legend()
        ax[1].plot(ctx, [r["state_bytes"] / 2**20 for r in result["context_sweep"]], "o-")
        ax[1].set(xlabel="context (tokens)", ylabel="decode state (MiB)", xscale="log", yscale="log")
        fig.tight_layout()
        fig.savefig(path)
        return
    bs = [r["batch_size"] for r in runs]
    ax[0].plot(bs, [r["decode_tok_s"] for r in runs], "o-", label="aggregate")
    ax[0].plot(bs, [r["decode_tok_s_per_seq"] for r in runs], "s--", label="per sequence")
    ax[0].set(xlabel="batch size", ylabel="decode tokens/s", xscale="log")
    ax[0].legend()
    ax[1].plot(bs, [r["roofline_fraction"] for r in runs], "o-")
    ax[1].set(xlabel="batch size", ylabel="fraction of measured bandwidth", xscale="log")
    fig.tight_layout()
    fig.savefig(path)
