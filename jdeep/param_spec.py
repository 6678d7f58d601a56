"""The expected tensors of a DeepSeek-V4 checkpoint: names, shapes, dtypes and where they live in
jdeep's parameter tree. The loader, the random-weight writer and `jdeep info` all read this table.

Parameter tree (all leaves of one layer kind stacked layer-major, see plan.py):

    {"embed": [V, d], "head": [d, V], "norm": [d], "hc_head_fn": [n, n*d] f32, "hc_head_base": [n] f32,
     "hc_head_scale": [1] f32,
     "segments": [ [ {layer tree of slot 0, leaves [reps, ...]}, ... ], ... ],
     "drafter": {MTP block tree, leaves [depths, ...]}}      # only with a plan that runs the MTP blocks

A V4.1 plan with DSpark stages (plan.dspark) holds the DSpark drafter there instead (model/dspark.py):

    "drafter": {"stages": {layer tree of the stages, leaves [stages, ...], experts [stages, E_dspark, ...]},
            "input":  {"main_proj": [d, n_taps*d] (fp8 codes), "main_norm": [d]},           # stage 0's extras
            "output": {"norm": [d], "markov_embed": [V, r], "markov_head": [r, V] (input-major), # the last stage's
                       "confidence": [1, d + r]}}                                           # extras, float

The output head is the one leaf stored input-major ([d, V], the checkpoint's [V, d] transposed at load): XLA:CPU's
GEMM for a few rows times a PyTorch-layout [N, K] matrix is 5x slower than with [K, N] at 2..8 rows, and the
vocab-sized head dominated batched decode steps.

A layer tree mirrors the checkpoint names without the `.weight` suffix; routed experts are stacked
on an expert axis: `ffn.w1` [E, I, d], `ffn.w2` [E, d, I], `ffn.w3` [E, I, d].

Quantized checkpoints (a `quantization_config`, model-spec.md §6.2) keep their weights as uint8 codes:
an fp8 linear becomes {"codes": uint8 [N, K], "scale": uint8 [ceil(N/bn), ceil(K/bk)]} (e4m3 codes,
ue8m0 exponent bytes), an fp4 linear {"packed": uint8 [N, K/2], "scale": uint8 [N, K/32]} (two e2m1
codes per byte, low nibble first). `wo_a` is the exception: dequantised at load, as DeepSeek's converter does.

The second half builds the tree's layout from these specs: every leaf's stacked shape and dtype (`leaf_plan`),
its path (`tree_path`), abstract trees (`abstract_params`) and the expert padding of a mesh (`padded_experts`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import jax
import numpy as np

from .config import ModelConfig
from .plan import REUSE, LayerKind, LayerPlan, dspark_kind, dspark_stage_config, mtp_kind

__all__ = ["TensorSpec", "layer_specs", "mtp_specs", "dspark_stage_specs", "dspark_extra_specs", "top_specs", "tree_leaves", "engram_table_specs", "F32", "WEIGHT", "INDEX",
           "FLOAT", "FP8", "FP4", "FP8_DEQUANT", "FP4_BLOCK", "abstract_params", "tree_path", "padded_experts"]

WEIGHT = "weight"  # stored in the model dtype (float32 or bfloat16)
F32 = "f32"        # kept float32 whatever the model dtype (mHC, sinks, position bias, gate bias)
INDEX = "index"    # integer table, stored int32 on the device

# storage formats of a WEIGHT tensor
FLOAT = "float"              # float in the checkpoint and in the tree
FP8 = "fp8"                  # e4m3 codes + ue8m0 block scales, kept as codes
FP4 = "fp4"                  # packed e2m1 codes + ue8m0 per-32 scales, kept as codes
FP8_DEQUANT = "fp8_dequant"  # fp8 in the checkpoint, dequantised to bf16 values at load (wo_a)
FP4_BLOCK = 32


@dataclass(frozen=True)
class TensorSpec:
    name: str                 # checkpoint name relative to the layer ("attn.wq_a.weight") or global
    path: tuple[str, ...]     # position in the (layer) parameter tree
    shape: tuple[int, ...]    # logical shape ([N, K] for a linear)
    kind: str                 # WEIGHT, F32 or INDEX
    expert: int | None = None  # routed-expert index: stacked on the tree leaf's axis 0
    fmt: str = FLOAT
    block: tuple[int, int] = (128, 128)  # fp8 weight block (rows, cols)
    input_major: bool = False  # float [N, K] weight kept transposed ([K, N]) in the tree

    @property
    def scale_name(self) -> str:
        return self.name[: -len(".weight")] + ".scale"

    @property
    def scale_shape(self) -> tuple[int, int]:
        N, K = self.shape
        if self.fmt == FP4:
            return (N, K // FP4_BLOCK)
        bn, bk = self.block
        return (-(-N // bn), -(-K // bk))

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """Shape of the weight tensor in the checkpoint (fp4: two codes per byte)."""
        return (self.shape[0], self.shape[1] // 2) if self.fmt == FP4 else self.shape


def tree_leaves(spec: TensorSpec) -> list[tuple[tuple[str, ...], tuple[int, ...], str]]:
    """(tree path, per-layer leaf shape, dtype class) of the leaves `spec` fills.

    dtype class: "model" (model dtype), "f32", "i32" or "u8". Shapes are one layer's, without the expert
    axis: callers stack routed experts (spec.expert) on a leading [E] axis and layers on [reps]."""
    if spec.kind == F32:
        return [(spec.path, spec.shape, "f32")]
    if spec.kind == INDEX:
        return [(spec.path, spec.shape, "i32")]
    if spec.fmt == FP8:
        return [(spec.path + ("codes",), spec.shape, "u8"), (spec.path + ("scale",), spec.scale_shape, "u8")]
    if spec.fmt == FP4:
        return [(spec.path + ("packed",), spec.stored_shape, "u8"), (spec.path + ("scale",), spec.scale_shape, "u8")]
    return [(spec.path, spec.shape[::-1] if spec.input_major else spec.shape, "model")]


def top_specs(c: ModelConfig) -> list[TensorSpec]:
    n, d = c.hc_mult, c.dim
    specs = [
        TensorSpec("embed.weight", ("embed",), (c.vocab_size, d), WEIGHT),
        TensorSpec("head.weight", ("head",), (c.vocab_size, d), WEIGHT, input_major=True),
        TensorSpec("norm.weight", ("norm",), (d,), WEIGHT),
    ]
    if c.is_v41:   # V4.1 collapses the streams with the last layer's delayed pre-mix: no head mixer
        return specs
    return specs + [
        TensorSpec("hc_head_fn", ("hc_head_fn",), (n, n * d), F32),
        TensorSpec("hc_head_base", ("hc_head_base",), (n,), F32),
        TensorSpec("hc_head_scale", ("hc_head_scale",), (1,), F32),
    ]


def weight_formats(c: ModelConfig) -> tuple[str, str, tuple[int, int]]:
    """(dense fp8 format, routed-expert format, fp8 weight block) for a config's checkpoint."""
    q = c.quantization
    if q is None or not q.fp8:
        return FLOAT, FLOAT, (128, 128)
    return FP8, FP4 if q.expert_dtype == "fp4" else FP8, q.weight_block_size


def layer_specs(c: ModelConfig, kind: LayerKind) -> list[TensorSpec]:
    d, n, D, H = c.dim, c.hc_mult, c.head_dim, c.n_heads
    dense_fmt, expert_fmt, block = weight_formats(c)
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

    def w(name: str, shape: tuple[int, ...], k: str = WEIGHT, fmt: str = FLOAT) -> TensorSpec:
        path = tuple(p for p in name.split(".") if p != "weight")
        return TensorSpec(name, path, shape, k, fmt=fmt, block=block)

    def q8(name: str, shape: tuple[int, int]) -> TensorSpec:
        return w(name, shape, fmt=dense_fmt)

    G = c.o_groups
    specs += [
        q8("attn.wq_a.weight", (c.q_lora_rank, d)),
        w("attn.q_norm.weight", (c.q_lora_rank,)),
        q8("attn.wq_b.weight", (H * D, c.q_lora_rank)),
        q8("attn.wkv.weight", (D, d)),
        w("attn.kv_norm.weight", (D,)),
        w("attn.wo_a.weight", (G * c.o_lora_rank, H * D // G), fmt=FP8_DEQUANT if dense_fmt == FP8 else FLOAT),
        q8("attn.wo_b.weight", (d, G * c.o_lora_rank)),
        w("attn.attn_sink", (H,), F32),
    ]
    m = kind.attn.ratio
    DI, nI = c.index_head_dim, c.index_n_heads
    if kind.shared_kv:
        specs += _v41_attention_specs(c, kind, w, q8)
    elif m > 0:
        cw = 2 if kind.attn.overlap else 1
        specs += [
            w("attn.compressor.wkv.weight", (cw * D, d)),
            w("attn.compressor.wgate.weight", (cw * D, d)),
            w("attn.compressor.ape", (m, cw * D), F32),
            w("attn.compressor.norm.weight", (D,)),
        ]
    if kind.attn.has_indexer and not kind.shared_kv:
        specs += [
            q8("attn.indexer.wq_b.weight", (nI * DI, c.q_lora_rank)),
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
    if c.is_v41 and c.vision is not None:
        specs.append(TensorSpec("ffn.gate.bias_vl", ("ffn", "gate", "bias_vl"), (E,), F32))
    for e in range(E):
        for name, shape in (("w1", (I, d)), ("w2", (d, I)), ("w3", (I, d))):
            specs.append(TensorSpec(f"ffn.experts.{e}.{name}.weight", ("ffn", name), shape, WEIGHT, expert=e,
                                    fmt=expert_fmt, block=block))
    specs += [
        q8("ffn.shared_experts.w1.weight", (I, d)),
        q8("ffn.shared_experts.w2.weight", (d, I)),
        q8("ffn.shared_experts.w3.weight", (I, d)),
    ]
    if kind.engram:
        e = c.engram
        specs += [
            q8("engram.wkv.weight", ((n + 1) * d, e.rows_per_token * e.head_dim)),
            w("engram.q_weight", (n, d)),
            w("engram.k_weight", (n, d)),
        ]
    return specs


def _v41_attention_specs(c: ModelConfig, kind: LayerKind, w, q8) -> list[TensorSpec]:
    """V4.1 (model-spec.md §7.4): compressor and index-key projection only at KV sources, the indexer's
    query side only at index sources; no ape, no indexer compressor."""
    role, D, DI, nI, d = kind.shared, c.head_dim, c.index_head_dim, c.index_n_heads, c.dim
    if role is None:
        return []
    specs = []
    if role.kv_source:
        specs.append(w("attn.compressor.wkv.weight", (D, d)))
        if kind.attn.ratio > 1:
            specs.append(w("attn.compressor.wgate.weight", (D, d)))
        specs += [
            w("attn.compressor.norm.weight", (D,)),
            w("attn.indexer.wk.weight", (DI, D)),
            w("attn.indexer.k_norm.weight", (DI,)),
        ]
    if role.index != REUSE:
        specs += [
            q8("attn.indexer.wq_b.weight", (nI * DI, c.q_lora_rank)),
            w("attn.indexer.weights_proj.weight", (nI, d)),
        ]
    return specs


def mtp_specs(c: ModelConfig) -> list[TensorSpec]:
    """One MTP block `mtp.k` (model-spec.md §4.7): a sliding-window layer plus the input projections of the token
    embedding (e_proj after enorm) and of the backbone's streams (h_proj after hnorm), and its own head mixer and
    final norm (the embedding and the vocabulary head are the backbone's)."""
    d, n = c.dim, c.hc_mult
    dense_fmt, _, block = weight_formats(c)
    return layer_specs(c, mtp_kind(c)) + [
        TensorSpec("e_proj.weight", ("e_proj",), (d, d), WEIGHT, fmt=dense_fmt, block=block),
        TensorSpec("h_proj.weight", ("h_proj",), (d, d), WEIGHT, fmt=dense_fmt, block=block),
        TensorSpec("enorm.weight", ("enorm",), (d,), WEIGHT),
        TensorSpec("hnorm.weight", ("hnorm",), (d,), WEIGHT),
        TensorSpec("norm.weight", ("norm",), (d,), WEIGHT),
        TensorSpec("hc_head_fn", ("hc_head_fn",), (n, n * d), F32),
        TensorSpec("hc_head_base", ("hc_head_base",), (n,), F32),
        TensorSpec("hc_head_scale", ("hc_head_scale",), (1,), F32),
    ]


def dspark_stage_specs(c: ModelConfig) -> list[TensorSpec]:
    """What every DSpark stage `mtp.k` holds (model-spec.md §5.8): a V4.1 sliding-window layer whose MoE has the
    dspark expert counts, placed under "stages" in params["drafter"] (stacked over the stages). The image routing bias
    is left out: DeepSeek's stages always route with `bias` (drafts are text)."""
    return [dataclasses.replace(s, path=("stages",) + s.path) for s in layer_specs(dspark_stage_config(c), dspark_kind(c))
            if s.name != "ffn.gate.bias_vl"]


def dspark_extra_specs(c: ModelConfig) -> list[tuple[int, TensorSpec]]:
    """(stage, spec) of the tensors only one DSpark stage has, unstacked in params["drafter"]: stage 0's projection of
    the target hiddens (main_proj, fp8 like the block's linears, then main_norm) and the last stage's final norm,
    Markov head (embed [V, rank]; head [V, rank], kept input-major like the vocabulary head) and confidence head
    ([1, d + rank]; bf16 in the checkpoint, float here)."""
    d, taps, r = c.dim, len(c.dspark.target_layer_ids), c.dspark.markov_rank
    dense_fmt, _, block = weight_formats(c)
    last = c.dspark.n_layers - 1
    return [
        (0, TensorSpec("main_proj.weight", ("input", "main_proj"), (d, taps * d), WEIGHT, fmt=dense_fmt, block=block)),
        (0, TensorSpec("main_norm.weight", ("input", "main_norm"), (d,), WEIGHT)),
        (last, TensorSpec("norm.weight", ("output", "norm"), (d,), WEIGHT)),
        (last, TensorSpec("markov_head.embed.weight", ("output", "markov_embed"), (c.vocab_size, r), WEIGHT)),
        (last, TensorSpec("markov_head.head.weight", ("output", "markov_head"), (c.vocab_size, r), WEIGHT,
                          input_major=True)),
        (last, TensorSpec("confidence_head.proj.weight", ("output", "confidence"), (1, d + r), WEIGHT)),
    ]


def expected_tensors(config: ModelConfig, plan: LayerPlan) -> Iterator[tuple[str, TensorSpec, tuple]]:
    """(checkpoint name, spec, destination) for every tensor the model needs.

    destination: ("top",), ("seg", segment, slot, rep) or ("drafter", depth) (a plan with MTP blocks or DSpark stages),
    ("drafter",) for a DSpark tensor only one stage has (unstacked)."""
    for spec in top_specs(config):
        yield spec.name, spec, ("top",)
    for s, seg in enumerate(plan.segments):
        for rep in range(seg.reps):
            for slot, kind in enumerate(seg.pattern):
                layer = seg.layer(rep, slot)
                for spec in layer_specs(config, kind):
                    yield f"layers.{layer}.{spec.name}", spec, ("seg", s, slot, rep)
    if plan.mtp is not None:
        for depth in range(plan.mtp.reps):
            for spec in mtp_specs(config):
                yield f"mtp.{depth}.{spec.name}", spec, ("drafter", depth)
    if plan.dspark is not None:
        for stage in range(plan.dspark.reps):
            for spec in dspark_stage_specs(config):
                yield f"mtp.{stage}.{spec.name}", spec, ("drafter", stage)
        for stage, spec in dspark_extra_specs(config):
            yield f"mtp.{stage}.{spec.name}", spec, ("drafter",)


def engram_table_specs(c: ModelConfig) -> list[tuple[str, tuple[int, int], tuple[int, int]]]:
    """(table name, code shape [rows, head_dim], scale shape [rows, head_dim/32]) per Engram layer.
    The tables stay on the host (memory-mapped), they are not part of the device param tree."""
    if c.engram is None:
        return []
    e = c.engram
    return [(f"layers.{layer}.engram.embed", (rows, e.head_dim), (rows, e.head_dim // 32))
            for layer, rows in zip(e.layer_ids, e.num_embeddings)]


# ---------------------------------------------------------------------------- the param tree's layout
_LEAF_DTYPES = {"f32": np.dtype(np.float32), "i32": np.dtype(np.int32), "u8": np.dtype(np.uint8)}


def leaf_dtype(cls: str, dtype: Any) -> np.dtype:
    """The numpy dtype of a leaf of dtype class `cls` (tree_leaves) in a model of float dtype `dtype`."""
    return _LEAF_DTYPES.get(cls, np.dtype(dtype))


def _set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def leaf_plan(config: ModelConfig, plan: LayerPlan) -> dict[tuple, tuple[tuple[int, ...], str]]:
    """Every tree leaf: key (("top",) | ("seg", s, slot) | ("drafter",)) + path -> (full shape, dtype class)."""
    leaves: dict[tuple, tuple[tuple[int, ...], str]] = {}
    for spec in top_specs(config):
        for path, shape, cls in tree_leaves(spec):
            leaves[("top",) + path] = (shape, cls)

    def stacked(key: tuple, specs: list[TensorSpec], reps: int, n_experts: int = config.n_routed_experts) -> None:
        for spec in specs:
            if spec.expert not in (None, 0):
                continue
            extra = (n_experts,) if spec.expert is not None else ()
            for path, shape, cls in tree_leaves(spec):
                leaves[key + path] = ((reps,) + extra + shape, cls)

    for s, seg in enumerate(plan.segments):
        for slot, kind in enumerate(seg.pattern):
            stacked(("seg", s, slot), layer_specs(config, kind), seg.reps)
    if plan.mtp is not None:
        stacked(("drafter",), mtp_specs(config), plan.mtp.reps)
    if plan.dspark is not None:
        stacked(("drafter",), dspark_stage_specs(config), plan.dspark.reps, dspark_stage_config(config).n_routed_experts)
        for _, spec in dspark_extra_specs(config):
            for path, shape, cls in tree_leaves(spec):
                leaves[("drafter",) + path] = (shape, cls)
    return leaves


def empty_tree(plan: LayerPlan) -> dict:
    """The param tree's skeleton: one empty layer tree per segment slot (and one for the MTP blocks)."""
    tree: dict = {"segments": [[{} for _ in seg.pattern] for seg in plan.segments]}
    if plan.mtp is not None or plan.dspark is not None:
        tree["drafter"] = {}
    return tree


def put_leaf(params: dict, key: tuple, value: Any) -> None:
    """Set the leaf of `leaf_plan` key `key` in the param tree."""
    if key[0] == "top":
        _set_path(params, key[1:], value)
    elif key[0] == "drafter":
        _set_path(params["drafter"], key[1:], value)
    else:
        _set_path(params["segments"][key[1]][key[2]], key[3:], value)


def _build_tree(config: ModelConfig, plan: LayerPlan, dtype: Any, make: Callable[[tuple, np.dtype], Any]) -> dict:
    params = empty_tree(plan)
    for key, (shape, cls) in leaf_plan(config, plan).items():
        put_leaf(params, key, make(shape, leaf_dtype(cls, dtype)))
    return params


def abstract_params(config: ModelConfig, plan: LayerPlan, dtype: Any) -> dict:
    """The param tree as jax.ShapeDtypeStruct leaves (for restore targets and lowering)."""
    return _build_tree(config, plan, dtype, lambda shape, dt: jax.ShapeDtypeStruct(shape, dt))


def tree_path(key: tuple) -> tuple:
    """A leaf key of `leaf_plan` as its path in the param tree (("embed",), ("segments", s, slot, ...), ("drafter", ...))."""
    if key[0] == "top":
        return key[1:]
    return key if key[0] == "drafter" else ("segments",) + key[1:]


def padded_experts(n_experts: int, expert_axis: int) -> int:
    """The routed-expert count rounded up to a multiple of the mesh's expert axis (zero experts pad it)."""
    return -(-n_experts // expert_axis) * expert_axis
