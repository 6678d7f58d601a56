"""Size accounting: parameter bytes by dtype and decode-state bytes per token for a config."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from .checkpoint import _leaf_dtype, _leaf_plan
from .config import ModelConfig
from .numerics import Numerics
from .plan import build_plan, layer_kinds
from .state import state_bytes

__all__ = ["param_bytes_by_dtype", "kv_bytes_per_token", "summary"]


def param_bytes_by_dtype(config: ModelConfig, dtype: Any = np.float32) -> dict[str, int]:
    """Bytes of the device parameter tree per dtype name, as jdeep holds it: float weights in `dtype`,
    quantized weights as uint8 codes + uint8 exponents."""
    counts: Counter = Counter()
    for shape, cls in _leaf_plan(config, build_plan(config)).values():
        dt = _leaf_dtype(cls, dtype)
        counts[dt.name] += int(np.prod(shape)) * dt.itemsize
    return dict(counts)


def kv_bytes_per_token(config: ModelConfig, dtype: Any = np.float32, numerics: Numerics | None = None) -> float:
    """Growth of the decode state per token of context (compressed KV + indexer keys), in bytes."""
    plan = build_plan(config)
    a = state_bytes(config, plan, 1, 4096, dtype, numerics)
    b = state_bytes(config, plan, 1, 8192, dtype, numerics)
    return (b - a) / 4096


def summary(config: ModelConfig, dtype: Any = np.float32) -> str:
    plan = build_plan(config)
    kinds = Counter(k.name for k in layer_kinds(config))
    lines = [
        f"model_type      {config.model_type}",
        f"layers          {config.n_layers} ({', '.join(f'{n}x {k}' for k, n in kinds.items())})",
        f"hidden / heads  {config.dim} / {config.n_heads} x {config.head_dim} (rope {config.rope_head_dim})",
        f"experts         {config.n_routed_experts} routed, {config.n_activated_experts} active, 1 shared, width {config.moe_inter_dim}",
        f"vocab           {config.vocab_size}",
        "quantization    " + (", ".join(f"{k}={v}" for k, v in config.quantization.items()) if config.quantization else "none"),
        "scan segments   " + ", ".join(f"[{'+'.join(k.name for k in s.pattern)}]x{s.reps}" for s in plan.segments),
    ]
    pb = param_bytes_by_dtype(config, dtype)
    lines.append("param bytes     " + ", ".join(f"{k} {v / 2**30:.3f} GiB" for k, v in pb.items())
                 + f" (total {sum(pb.values()) / 2**30:.3f} GiB)")
    if config.engram is not None:
        e = config.engram
        host = sum(r * (e.head_dim + e.head_dim // 32) for r in e.num_embeddings)
        lines.append(f"engram tables   {host / 2**30:.3f} GiB on the host (memory-mapped, fp8 rows + e8m0 scales); "
                     f"{e.rows_per_token} rows x {e.head_dim + e.head_dim // 32} B gathered per token and Engram layer")
    name = np.dtype(dtype).name
    lines.append(f"state bytes     {kv_bytes_per_token(config, dtype):.0f} B/token + "
                 f"{state_bytes(config, plan, 1, 0, dtype) / 2**20:.2f} MiB fixed per sequence ({name} caches)")
    try:
        packed = Numerics.for_config(config, True, packed_kv=True)
    except ValueError:
        packed = None
    if packed is not None:
        lines.append(f"                {kv_bytes_per_token(config, dtype, packed):.0f} B/token + "
                     f"{state_bytes(config, plan, 1, 0, dtype, packed) / 2**20:.2f} MiB fixed per sequence "
                     f"(packed fp8 KV records, --packed-kv)")
    return "\n".join(lines)
