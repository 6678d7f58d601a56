"""How a loaded model keeps its quantized checkpoint weights: as the checkpoint's uint8 codes with ue8m0 scales,
decoded inside every GEMM that reads them ("codes"), or decoded once at load into the compute dtype ("decoded").

Decoding is exact (an e4m3 or e2m1 value times a power of two is a float32 and a bfloat16), and the GEMM then
multiplies the same values, so both forms give bit-identical logits. "codes" keeps 1 (fp8) or 0.5 (fp4) bytes per
weight resident and pays the decode at every step; "decoded" keeps 4 or 2 bytes and pays it once. The kernel
dispatch picks per platform (kernels.registry.weight_format): Neuron's NKI GEMMs decode codes on the fly, the
jnp references (CPU, GPU) run fastest on decoded weights. A decoded leaf stays a dict, {"decoded": array [..., N, K]},
so the layers still know the weight was quantized and act-quantize its input under DeepSeek's numerics.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ..kernels import codecs
from ..kernels.linear import dequant, is_quantized_leaf
from ..numerics import Numerics

__all__ = ["WEIGHT_FORMATS", "decode_weights", "weight_leaves", "is_decoded_leaf", "weight_bytes", "resident_bytes",
           "to_cpu_bf16", "from_cpu_bf16"]

WEIGHT_FORMATS = ("codes", "decoded")


def decode_weights(params: dict, numerics: Numerics, dtype: Any, layout=None) -> dict:
    """params with every quantized leaf ({"codes", "scale"} fp8 / {"packed", "scale"} fp4) replaced by
    {"decoded": its values in `dtype`}, one leaf at a time (the codes are freed as it goes), on the host (leaves
    spread over several processes: on their devices); on a mesh each decoded leaf takes its codes' sharding."""
    def walk(node: Any, path: tuple) -> Any:
        if is_quantized_leaf(node):
            return {"decoded": _decode(node, path, numerics, dtype, layout)}
        if isinstance(node, dict):
            return {k: walk(v, path + (k,)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v, path + (i,)) for i, v in enumerate(node))
        return node

    return walk(params, ())


def _decode(leaf: dict, path: tuple, numerics: Numerics, dtype: Any, layout) -> jax.Array:
    if not all(getattr(a, "is_fully_addressable", True) for a in leaf.values()):
        # a leaf spread over several processes: decoded where its shards live (one small program per leaf shape)
        shape = jax.eval_shape(lambda w: dequant(w, numerics, dtype), leaf).shape
        out = NamedSharding(layout.mesh, layout.param_spec(path + ("decoded",), shape))
        return jax.jit(lambda w: dequant(w, numerics, dtype), out_shardings=out)(leaf)
    values = _decode_on_host({k: np.asarray(v) for k, v in leaf.items()}, numerics, dtype)
    if layout is None:
        return jax.device_put(values, jax.devices()[0])
    return jax.device_put(values, NamedSharding(layout.mesh, layout.param_spec(path + ("decoded",), values.shape)))


def _decode_on_host(leaf: dict, numerics: Numerics, dtype: Any) -> np.ndarray:
    """The dequant_fp8 / dequant_fp4 references' arithmetic in numpy (no program to compile per leaf shape): the
    same exact products, so the same values."""
    if "codes" in leaf:
        codes, (bn, bk) = leaf["codes"], numerics.weight_block
        s = codecs.ue8m0_decode(np, leaf["scale"])
        s = np.repeat(np.repeat(s, bn, axis=-2), bk, axis=-1)[..., : codes.shape[-2], : codes.shape[-1]]
        w = codecs.e4m3_decode(np, codes, trn2=numerics.trn2_weights) * s
    else:
        w = codecs.e2m1_decode(np, codecs.unpack_e2m1(np, leaf["packed"]))
        w = w * np.repeat(codecs.ue8m0_decode(np, leaf["scale"]), numerics.fp4_block, axis=-1)
    return w.astype(np.dtype(dtype))


def to_cpu_bf16(params: dict) -> dict:
    """How a bfloat16 model's weights are kept for the scan mode on CPU (kernels.registry.bf16_weights_as_bits): every
    bf16 array of the layer stack ("segments": the scanned per-layer weights and the stacked experts, plain or
    decoded) as its uint16 bit patterns, which the layers bitcast back after slicing; the output head in float32 (its
    product runs in fp32 anyway, spec 6.3, and XLA:CPU's bf16 -> f32 convert fused into the [d, V] product is 30x
    slower than the fp32 product, docs/performance.md). One leaf at a time."""
    def bits(a: Any) -> Any:
        if getattr(a, "dtype", None) != jax.numpy.bfloat16:
            return a
        return jax.device_put(np.asarray(a).view(np.uint16), a.sharding)
    out = {**params, "segments": jax.tree_util.tree_map(bits, params["segments"])}
    if "head" in out:
        out["head"] = out["head"].astype(np.float32)
    return out


def from_cpu_bf16(params: Any, dtype: Any) -> Any:
    """The inverse of to_cpu_bf16 (uint16 leaves back to bfloat16, the head to the model's `dtype`), for what stores
    the weights."""
    def back(a: Any) -> Any:
        if getattr(a, "dtype", None) != np.uint16:
            return a
        return jax.device_put(np.asarray(a).view(jax.numpy.bfloat16), a.sharding)
    out = jax.tree_util.tree_map(back, params)
    if "head" in out:
        out["head"] = out["head"].astype(dtype)
    return out


def weight_leaves(params: Any) -> list:
    """The leaves of a param tree with each weight whole: a quantized leaf ({"codes"|"packed", "scale"}), a decoded
    one ({"decoded": values}) or a float array (or ShapeDtypeStruct)."""
    return jax.tree_util.tree_leaves(params, is_leaf=lambda n: is_quantized_leaf(n) or is_decoded_leaf(n))


def is_decoded_leaf(w: Any) -> bool:
    """Whether `w` is a quantized weight decoded at load: {"decoded": values}."""
    return isinstance(w, dict) and set(w) == {"decoded"}


def _nbytes(a: Any) -> int:
    return int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize


def weight_bytes(params: dict) -> dict[str, int]:
    """Resident bytes of a param tree by kind: "codes" (fp8/fp4 codes and their scales), "decoded" (quantized
    weights decoded at load) and "float" (everything else)."""
    out = {"codes": 0, "decoded": 0, "float": 0}
    for leaf in weight_leaves(params):
        kind = "codes" if is_quantized_leaf(leaf) else "decoded" if is_decoded_leaf(leaf) else "float"
        out[kind] += sum(map(_nbytes, leaf.values())) if isinstance(leaf, dict) else _nbytes(leaf)
    return out


def resident_bytes(params: Any, weights: str, dtype: Any) -> int:
    """Bytes a param tree in the checkpoint's form (arrays or ShapeDtypeStructs, quantized leaves as codes) holds on
    the device when its quantized weights are kept as `weights` ("codes" or "decoded" into `dtype`)."""
    total = 0
    for leaf in weight_leaves(params):
        if not is_quantized_leaf(leaf):
            total += _nbytes(leaf)
        elif weights == "codes":
            total += sum(map(_nbytes, leaf.values()))
        else:       # one value per code; two per packed fp4 byte
            n = int(np.prod(leaf["codes"].shape)) if "codes" in leaf else 2 * int(np.prod(leaf["packed"].shape))
            total += n * np.dtype(dtype).itemsize
    return total
