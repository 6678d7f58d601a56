"""The expected tensors of a DeepSeek-V4 checkpoint: names, shapes, dtypes and where they live in
jdeep's parameter tree. The loader, the random-weight writer and `jdeep info` all read this table.

Parameter tree (all leaves of one layer kind stacked layer-major, see plan.py):

    {"embed": [V, d], "head": [V, d], "norm": [d], "hc_head_fn": [n, n*d] f32, "hc_head_base": [n] f32,
     "hc_head_scale": [1] f32,
     "segments": [ [ {layer tree of slot 0, leaves [reps, ...]}, ... ], ... ]}

A layer tree mirrors the checkpoint names without the `.weight` suffix; routed experts are stacked
on an expert axis: `ffn.w1` [E, I, d], `ffn.w2` [E, d, I], `ffn.w3` [E, I, d].
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig
from .plan import LayerKind

__all__ = ["TensorSpec", "layer_specs", "top_specs", "F32", "WEIGHT", "INDEX"]

WEIGHT = "weight"  # stored in the model dtype (float32 or bfloat16)
F32 = "f32"        # kept float32 whatever the model dtype (mHC, sinks, position bias, gate bias)
INDEX = "index"    # integer table, stored int32 on the device


@dataclass(frozen=True)
class TensorSpec:
    name: str                 # checkpoint name relative to the layer ("attn.wq_a.weight") or global
    path: tuple[str, ...]     # position in the (layer) parameter tree
    shape: tuple[int, ...]    # shape in the checkpoint
    kind: str                 # WEIGHT, F32 or INDEX
    expert: int | None = None  # routed-expert index: stacked on the tree leaf's axis 0


def top_specs(c: ModelConfig) -> list[TensorSpec]:
    n, d = c.hc_mult, c.dim
    return [
        TensorSpec("embed.weight", ("embed",), (c.vocab_size, d), WEIGHT),
        TensorSpec("head.weight", ("head",), (c.vocab_size, d), WEIGHT),
        TensorSpec("norm.weight", ("norm",), (d,), WEIGHT),
        TensorSpec("hc_head_fn", ("hc_head_fn",), (n, n * d), F32),
        TensorSpec("hc_head_base", ("hc_head_base",), (n,), F32),
        TensorSpec("hc_head_scale", ("hc_head_scale",), (1,), F32),
    ]


def layer_specs(c: ModelConfig, kind: LayerKind) -> list[TensorSpec]:
    d, n, D, H = c.dim, c.hc_mult, c.head_dim, c.n_heads
    mix = (2 + n) * n
    specs = [
        TensorSpec("attn_norm.weight", ("attn_norm",), (d,), WEIGHT),
        TensorSpec("ffn_norm.weight", ("ffn_norm",), (d,), WEIGHT),
    ]
    for part in ("attn", "ffn"):
        specs += [
            TensorSpec(f"hc_{part}_fn", (f"hc_{part}_fn",), (mix, n * d), F32),
            TensorSpec(f"hc_{part}_base", (f"hc_{part}_base",), (mix,), F32),
            TensorSpec(f"hc_{part}_scale", (f"hc_{part}_scale",), (3,), F32),
        ]

    def w(name: str, shape: tuple[int, ...], k: str = WEIGHT) -> TensorSpec:
        path = tuple(p for p in name.split(".") if p != "weight")
        return TensorSpec(name, path, shape, k)

    G = c.o_groups
    specs += [
        w("attn.wq_a.weight", (c.q_lora_rank, d)),
        w("attn.q_norm.weight", (c.q_lora_rank,)),
        w("attn.wq_b.weight", (H * D, c.q_lora_rank)),
        w("attn.wkv.weight", (D, d)),
        w("attn.kv_norm.weight", (D,)),
        w("attn.wo_a.weight", (G * c.o_lora_rank, H * D // G)),
        w("attn.wo_b.weight", (d, G * c.o_lora_rank)),
        w("attn.attn_sink", (H,), F32),
    ]
    m = kind.attn.ratio
    if m > 0:
        cw = 2 if kind.attn.overlap else 1
        specs += [
            w("attn.compressor.wkv.weight", (cw * D, d)),
            w("attn.compressor.wgate.weight", (cw * D, d)),
            w("attn.compressor.ape", (m, cw * D), F32),
            w("attn.compressor.norm.weight", (D,)),
        ]
    if kind.attn.has_indexer:
        DI, nI = c.index_head_dim, c.index_n_heads
        specs += [
            w("attn.indexer.wq_b.weight", (nI * DI, c.q_lora_rank)),
            w("attn.indexer.weights_proj.weight", (nI, d)),
            w("attn.indexer.compressor.wkv.weight", (2 * DI, d)),
            w("attn.indexer.compressor.wgate.weight", (2 * DI, d)),
            w("attn.indexer.compressor.ape", (m, 2 * DI), F32),
            w("attn.indexer.compressor.norm.weight", (DI,)),
        ]
    E, I, k = c.n_routed_experts, c.moe_inter_dim, c.n_activated_experts
    specs.append(TensorSpec("ffn.gate.weight", ("ffn", "gate", "weight"), (E, d), WEIGHT))
    if kind.hash_moe:
        specs.append(TensorSpec("ffn.gate.tid2eid", ("ffn", "gate", "tid2eid"), (c.vocab_size, k), INDEX))
    else:
        specs.append(TensorSpec("ffn.gate.bias", ("ffn", "gate", "bias"), (E,), F32))
    for e in range(E):
        for name, shape in (("w1", (I, d)), ("w2", (d, I)), ("w3", (I, d))):
            specs.append(TensorSpec(f"ffn.experts.{e}.{name}.weight", ("ffn", name), shape, WEIGHT, expert=e))
    specs += [
        w("ffn.shared_experts.w1.weight", (I, d)),
        w("ffn.shared_experts.w2.weight", (d, I)),
        w("ffn.shared_experts.w3.weight", (I, d)),
    ]
    return specs


def leaf_shape(spec: TensorSpec, c: ModelConfig) -> tuple[int, ...]:
    """Shape of the tree leaf (per layer) that `spec` fills."""
    if spec.expert is not None:
        return (c.n_routed_experts,) + spec.shape
    return spec.shape
