"""`jdeep bench --compare transformers`: the same measurements on transformers' DeepseekV4ForCausalLM.

The transformers model (torch, CPU, eager attention, `torch.inference_mode`, torch threads = os.cpu_count())
loads the very checkpoint jdeep benchmarked, in the same float dtype, and runs the same prompts the way
jdeep's bench does: the B prompts prefilled as one batch (TTFT = prefill up to the first greedy token),
then output_len - 1 greedy decode steps one token at a time with transformers' own KV cache, each step
timed (inter-token latency). Loading and a short untimed warm-up (first-call allocations) are reported
apart. The greedy tokens are returned so that the bench can report how far the two engines agree.

transformers reads DeepSeek's original tensor names itself; its config spelling is written from jdeep's
parsed ModelConfig (`hf_config`) into a temporary folder beside symlinks of the safetensors files, so
every config spelling jdeep reads is compared on the same architecture. Every checkpoint tensor must
load: missing, unexpected or mismatched keys raise. Only unquantized DeepSeek-V4 checkpoints (float32 /
bfloat16 tensors) can be compared: transformers would dequantize fp8/fp4 weights with its own numerics,
so a quantized checkpoint raises instead, as does DeepSeek-V4.1 (no transformers implementation).
"""

from __future__ import annotations

import contextlib
import glob
import inspect
import json
import os
import tempfile
import time
from typing import Any, Iterator, Sequence

import numpy as np

from ...config import ModelConfig

__all__ = ["require_transformers", "hf_config", "hf_folder", "load_transformers", "run_transformers_bench",
           "greedy_agreement", "compare_section", "PIP_HINT"]

PIP_HINT = "pip install 'jdeep[compare]'"
_CSA, _HCA, _SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def require_transformers() -> tuple[Any, Any]:
    """(torch, transformers), or ImportError naming the optional extra that provides them."""
    try:
        import torch  # lazy: the optional extra `compare` (torch + transformers)
        import transformers
    except ImportError as e:
        raise ImportError(f"--compare transformers needs torch and transformers ({PIP_HINT}): {e}") from None
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        raise ImportError(f"transformers {transformers.__version__} has no DeepseekV4ForCausalLM ({PIP_HINT})")
    return torch, transformers


def _check_comparable(config: ModelConfig) -> None:
    if config.is_v41:
        raise ValueError("--compare transformers: transformers has no DeepSeek-V4.1 model; compare a DeepSeek-V4 "
                         "checkpoint")
    if config.quantization is not None:
        raise ValueError("--compare transformers needs an unquantized checkpoint (float32/bfloat16 tensors); this one "
                         f"has quantization_config {config.quantization.to_hf()} — use --random-weights with a config "
                         "without quantization_config, or a dequantized copy")


def _layer_types(config: ModelConfig) -> tuple[list[str], dict[str, int]]:
    """transformers' per-layer attention names and its one compress rate per name (it has no other way)."""
    types, rates = [], {}
    for i, k in enumerate(config.attention_kinds):
        name = _SLIDING if k.ratio == 0 else (_CSA if k.overlap else _HCA)
        types.append(name)
        if k.ratio and rates.setdefault(name, k.ratio) != k.ratio:
            raise ValueError(f"--compare transformers: layer {i} is {name} with compress ratio {k.ratio}, another one "
                             f"has {rates[name]}; transformers allows one rate per layer type")
    defaults = {_CSA: 4, _HCA: 128}
    return types, {name: rates.get(name, defaults[name]) for name in (_CSA, _HCA)}


def _rope(rope, partial: float) -> dict[str, Any]:
    d: dict[str, Any] = {"rope_type": "default", "rope_theta": rope.theta, "partial_rotary_factor": partial}
    if rope.yarn is not None:
        y = rope.yarn
        d.update(rope_type="yarn", factor=y.factor, original_max_position_embeddings=y.original_seq_len,
                 beta_fast=y.beta_fast, beta_slow=y.beta_slow, attention_factor=1.0)   # no YaRN temperature
    return d


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """transformers' DeepseekV4Config spelling of `config` (layer_types + compress_rates, mlp_layer_types,
    rope_parameters main/compress with partial_rotary_factor), as in shared/golden/v4-tiny-hf/config.json."""
    _check_comparable(config)
    partial = config.rope_head_dim / config.head_dim
    if int(config.head_dim * partial) != config.rope_head_dim:
        raise ValueError(f"--compare transformers: qk_rope_head_dim {config.rope_head_dim} / head_dim "
                         f"{config.head_dim} is not exact as a partial_rotary_factor")
    layer_types, rates = _layer_types(config)
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": config.vocab_size, "hidden_size": config.dim, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": 1, "head_dim": config.head_dim,
        "partial_rotary_factor": partial, "q_lora_rank": config.q_lora_rank, "o_groups": config.o_groups,
        "o_lora_rank": config.o_lora_rank, "sliding_window": config.window_size,
        "layer_types": layer_types, "compress_rates": rates,
        "mlp_layer_types": ["hash_moe" if h else "moe" for h in config.hash_moe],
        "index_n_heads": config.index_n_heads, "index_head_dim": config.index_head_dim,
        "index_topk": config.index_topk, "hc_mult": config.hc_mult, "hc_sinkhorn_iters": config.hc_sinkhorn_iters,
        "hc_eps": config.hc_eps, "n_routed_experts": config.n_routed_experts,
        "num_experts_per_tok": config.n_activated_experts, "n_shared_experts": config.n_shared_experts,
        "moe_intermediate_size": config.moe_inter_dim, "routed_scaling_factor": config.route_scale,
        "scoring_func": config.score_func, "norm_topk_prob": True, "swiglu_limit": config.swiglu_limit,
        "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_main.theta,
        "compress_rope_theta": config.rope_compress.theta,
        "rope_parameters": {"main": _rope(config.rope_main, partial), "compress": _rope(config.rope_compress, partial)},
        "max_position_embeddings": config.max_position_embeddings,
        "num_nextn_predict_layers": config.n_mtp_layers, "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id, "tie_word_embeddings": False, "hidden_act": "silu",
    }


@contextlib.contextmanager
def hf_folder(folder: str | os.PathLike) -> Iterator[str]:
    """A temporary folder transformers can load: hf_config(folder's config) as config.json next to symlinks
    of the folder's safetensors files (and their index)."""
    folder = os.path.abspath(os.fspath(folder))
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"--compare transformers needs a safetensors checkpoint folder; {folder} has none "
                         "(a `jdeep convert` folder cannot be compared)")
    cfg = hf_config(ModelConfig.from_file(folder))
    index = os.path.join(folder, "model.safetensors.index.json")
    with tempfile.TemporaryDirectory(prefix="jdeep-hf-") as tmp:
        for f in files + ([index] if os.path.exists(index) else []):
            os.symlink(f, os.path.join(tmp, os.path.basename(f)))
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)
        yield tmp


def _torch_dtype(torch: Any, dtype: str) -> Any:
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise ValueError(f"--compare transformers: dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    return dtypes[dtype]


def load_transformers(folder: str | os.PathLike, dtype: str = "float32") -> Any:
    """DeepseekV4ForCausalLM from a jdeep checkpoint folder, eager attention, in eval mode; raises ValueError
    unless every checkpoint tensor loads (no missing, unexpected or mismatched keys)."""
    torch, transformers = require_transformers()
    with hf_folder(folder) as tmp:
        model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
            tmp, dtype=_torch_dtype(torch, dtype), attn_implementation="eager", output_loading_info=True)
    bad = {k: sorted(v) for k, v in info.items() if v}
    if bad:
        raise ValueError(f"--compare transformers: {folder} does not load exactly into transformers' "
                         f"DeepseekV4ForCausalLM: {bad}")
    return model.eval()


def _cache_kwarg(model: Any) -> str:
    """transformers renamed `past_key_values` to `cache` (5.24)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _step(model: Any, torch: Any, cache: Any, key: str, ids: np.ndarray, start: int) -> np.ndarray:
    """One forward of ids int [B, S] at positions start.. with the cache; greedy next token int32 [B, 1]."""
    B, S = ids.shape
    pos = torch.arange(start, start + S, dtype=torch.long).expand(B, S)
    out = model(input_ids=torch.from_numpy(ids.astype(np.int64)), position_ids=pos, use_cache=True,
                logits_to_keep=1, **{key: cache})
    return out.logits[:, -1].argmax(-1, keepdim=True).numpy().astype(np.int32)


def _run_one(model: Any, torch: Any, ids: np.ndarray, output_len: int) -> tuple[dict, np.ndarray]:
    """jdeep's bench loop on transformers: (run fields, greedy tokens int32 [B, output_len])."""
    from transformers import DynamicCache  # lazy: the optional extra `compare`

    B, L = ids.shape
    key = _cache_kwarg(model)
    t = time.perf_counter()
    warm = DynamicCache(config=model.config)
    tok = _step(model, torch, warm, key, ids[:, :min(L, 16)], 0)
    _step(model, torch, warm, key, tok, min(L, 16))
    warmup = time.perf_counter() - t
    del warm

    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    tok = _step(model, torch, cache, key, ids, 0)
    ttft = time.perf_counter() - t0
    tokens, itl = [tok], []
    for i in range(output_len - 1):
        t = time.perf_counter()
        tok = _step(model, torch, cache, key, tok, L + i)
        itl.append(time.perf_counter() - t)
        tokens.append(tok)
    itl_s = np.asarray(itl) if itl else np.asarray([np.nan])
    mean = float(np.mean(itl_s))
    run = {"batch_size": B, "input_len": L, "output_len": output_len, "warmup_s": warmup,
           "ttft_s": ttft, "prefill_tok_s": B * L / ttft,
           "itl_ms": {"mean": mean * 1e3, "p50": float(np.percentile(itl_s, 50)) * 1e3,
                      "p99": float(np.percentile(itl_s, 99)) * 1e3},
           "decode_tok_s_per_seq": 1.0 / mean, "decode_tok_s": B / mean}
    return run, np.concatenate(tokens, axis=1)


def run_transformers_bench(folder: str | os.PathLike, prompts: np.ndarray | Sequence[np.ndarray], output_len: int,
                           dtype: str = "float32") -> dict:
    """Load transformers' model from `folder` once, then per prompt batch (int32 [B, L], one or a list) run
    prefill + output_len - 1 timed greedy decode steps.

    Returns {"transformers_version", "torch_version", "dtype", "attn_implementation", "threads", "load_s",
    "runs": [run fields as in jdeep's bench, plus "warmup_s"], "tokens": [greedy int32 [B, output_len] per run]}
    ("tokens" are numpy arrays, not JSON)."""
    torch, transformers = require_transformers()
    batches = [prompts] if isinstance(prompts, np.ndarray) else list(prompts)
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    t = time.perf_counter()
    model = load_transformers(folder, dtype)
    load_s = time.perf_counter() - t
    runs, tokens = [], []
    with torch.inference_mode():
        for ids in batches:
            run, toks = _run_one(model, torch, np.asarray(ids, np.int32), output_len)
            runs.append(run)
            tokens.append(toks)
    return {"transformers_version": transformers.__version__, "torch_version": torch.__version__, "dtype": dtype,
            "attn_implementation": "eager", "threads": threads, "load_s": load_s, "runs": runs, "tokens": tokens}


def greedy_agreement(a: np.ndarray, b: np.ndarray) -> dict:
    """How far two greedy continuations int [B, k] agree: the fraction of rows whose k tokens are all equal,
    each row's first differing step (0 = the first generated token; None where equal), the earliest of those
    and the mean agreeing prefix length.
    Random weights can have near-tied logits, so a divergence is information, not a failure."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise ValueError(f"greedy tokens of different shapes {a.shape} and {b.shape}")
    B, k = a.shape
    diff = a != b
    rows = [int(np.argmax(d)) if d.any() else None for d in diff]
    diverged = [r for r in rows if r is not None]
    return {"batch_size": B, "tokens": k, "rows_equal": float(np.mean([r is None for r in rows])),
            "first_divergence": min(diverged) if diverged else None, "row_first_divergence": rows,
            "mean_agreeing_prefix": float(np.mean([k if r is None else r for r in rows]))}


def _ratios(jdeep_run: dict, hf_run: dict) -> dict:
    return {"batch_size": jdeep_run["batch_size"], "ttft": jdeep_run["ttft_s"] / hf_run["ttft_s"],
            "prefill_tok_s": jdeep_run["prefill_tok_s"] / hf_run["prefill_tok_s"],
            "decode_tok_s": jdeep_run["decode_tok_s"] / hf_run["decode_tok_s"],
            "itl_p50": jdeep_run["itl_ms"]["p50"] / hf_run["itl_ms"]["p50"]}


def compare_section(folder: str | os.PathLike, prompt_sets: Sequence[np.ndarray], jdeep_runs: Sequence[dict],
                    jdeep_tokens: Sequence[np.ndarray], output_len: int, dtype: str) -> dict:
    """The bench result's "compare": {"transformers": ...} value: transformers' runs on the same prompts,
    jdeep/transformers ratios per batch size (ttft and itl_p50 are latencies: < 1 means jdeep is faster;
    prefill_tok_s and decode_tok_s are throughputs: > 1 means jdeep is faster) and greedy agreement."""
    hf = run_transformers_bench(folder, prompt_sets, output_len, dtype)
    tokens = hf.pop("tokens")
    hf["ratios"] = [_ratios(j, h) for j, h in zip(jdeep_runs, hf["runs"])]
    hf["agreement"] = [greedy_agreement(j, t) for j, t in zip(jdeep_tokens, tokens)]
    return {"transformers": hf}
