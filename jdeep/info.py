"""Size accounting: parameter bytes by dtype and decode-state bytes per token for a config."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from .config import ModelConfig
from .param_spec import F32, INDEX, layer_specs, leaf_shape, top_specs
from .plan import build_plan, layer_kinds
from .state import state_bytes

__all__ = ["param_bytes_by_dtype", "kv_bytes_per_token", "summary"]


def param_bytes_by_dtype(config: ModelConfig, dtype: Any = np.float32) -> dict[str, int]:
    """Bytes of the device parameter tree per dtype name, as jdeep holds it (float weights in `dtype`)."""
    counts: Counter = Counter()

    def add(spec, n):
        dt = np.dtype(np.float32) if spec.kind == F32 else np.dtype(np.int32) if spec.kind == INDEX else np.dtype(dtype)
        counts[dt.name] += n * dt.itemsize

    for spec in top_specs(config):
        add(spec, int(np.prod(spec.shape)))
    for kind in layer_kinds(config):
        for spec in layer_specs(config, kind):
            if spec.expert in (None, 0):
                add(spec, int(np.prod(leaf_shape(spec, config))))
    return dict(counts)


def kv_bytes_per_token(config: ModelConfig, dtype: Any = np.float32) -> float:
    """Growth of the decode state per token of context (compressed KV + indexer keys), in bytes."""
    plan = build_plan(config)
    a = state_bytes(config, plan, 1, 4096, dtype)
    b = state_bytes(config, plan, 1, 8192, dtype)
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
        "scan segments   " + ", ".join(f"[{'+'.join(k.name for k in s.pattern)}]x{s.reps}" for s in plan.segments),
    ]
    pb = param_bytes_by_dtype(config, dtype)
    lines.append("param bytes     " + ", ".join(f"{k} {v / 2**30:.3f} GiB" for k, v in pb.items())
                 + f" (total {sum(pb.values()) / 2**30:.3f} GiB)")
    lines.append(f"state bytes     {kv_bytes_per_token(config, dtype):.0f} B/token + "
                 f"{state_bytes(config, plan, 1, 0, dtype) / 2**20:.2f} MiB fixed per sequence ({np.dtype(dtype).name})")
    return "\n".join(lines)
