"""Writing a checkpoint folder in DeepSeek's published format from float weights: config.json plus safetensors
under DeepSeek's names, with every tensor the config declares quantized turned into DeepSeek's codes (fp8 e4m3
with ue8m0 block scales, fp4 e2m1 routed experts with 1 x 32 ue8m0 scales; model-spec.md §6.2) by its recipe:
the scale is the power of two 2^ceil(log2(amax / format max)) of each block, the codes round to nearest even.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import ml_dtypes
import numpy as np

from ..config import ModelConfig
from ..kernels import codecs
from ..param_spec import F32, FLOAT, FP4, FP4_BLOCK, FP8, FP8_DEQUANT, INDEX, TensorSpec, expected_tensors
from ..plan import LayerPlan, build_plan
from .safetensors import write_safetensors

__all__ = ["quantize_weight", "float_config", "named_tensors", "checkpoint_tensors", "write_checkpoint"]


def quantize_weight(w: np.ndarray, spec: TensorSpec) -> dict[str, np.ndarray]:
    """float32 [N, K] -> the checkpoint tensors DeepSeek ships for it: {spec.name: codes, spec.scale_name: scales}
    (fp8 e4m3 codes with e8m0 block scales, or fp4 codes packed two per int8 with e8m0 per-32 scales)."""
    N, K = w.shape
    if spec.fmt == FP4:
        blocks = w.reshape(N, K // FP4_BLOCK, FP4_BLOCK)
        amax = np.maximum(np.abs(blocks).max(-1), 6.0 * 2.0 ** -126)
        e = codecs.ceil_log2(np, (amax / 6.0).astype(np.float32))
        codes = codecs.e2m1_encode(np, (blocks / codecs.pow2(np, e)[..., None]).reshape(N, K).astype(np.float32))
        packed = codecs.pack_e2m1(np, codes).astype(np.uint8).view(np.int8)
        return {spec.name: packed, spec.scale_name: (e + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)}
    bn, bk = spec.block
    gn, gk = -(-N // bn), -(-K // bk)
    pad = np.zeros((gn * bn, gk * bk), np.float32)
    pad[:N, :K] = w
    amax = np.maximum(np.abs(pad.reshape(gn, bn, gk, bk)).max(axis=(1, 3)), 1e-30)
    e = codecs.ceil_log2(np, (amax / 448.0).astype(np.float32))
    scale = np.repeat(np.repeat(codecs.pow2(np, e), bn, 0), bk, 1)[:N, :K]
    codes = codecs.e4m3_encode(np, (w / scale).astype(np.float32)).astype(np.uint8)
    return {spec.name: codes.view(ml_dtypes.float8_e4m3fn),
            spec.scale_name: (e + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)}


def float_config(config: ModelConfig) -> ModelConfig:
    """The same architecture with float weights (no quantization_config): the layout a model trains in."""
    raw = config.to_dict()
    raw.pop("quantization_config", None)
    return ModelConfig.from_dict(raw)


def named_tensors(config: ModelConfig, plan: LayerPlan, params: dict) -> dict[str, np.ndarray]:
    """A float parameter tree (the layout jdeep.load gives a float checkpoint of `config`, with the MTP blocks when
    the plan holds them) as checkpoint tensors under DeepSeek's names: float32 [N, K] weights (input-major leaves transposed back), int64 expert-id tables."""
    out = {}
    for name, spec, dest in expected_tensors(config, plan):
        if spec.fmt != FLOAT:
            raise ValueError(f"{name}: named_tensors reads float trees; quantized leaves ({spec.fmt}) are not float")
        expert = (spec.expert,) if spec.expert is not None else ()
        if dest[0] == "top":
            tree, idx = params, ()
        elif dest[0] == "drafter":
            tree, idx = params["drafter"], dest[1:] + expert
        else:
            tree, idx = params["segments"][dest[1]][dest[2]], dest[3:] + expert
        for p in spec.path:
            tree = tree[p]
        leaf = tree[idx] if idx else tree
        value = np.asarray(leaf)
        if spec.input_major:
            value = value.T
        out[name] = value.astype(np.int64 if spec.kind == INDEX else np.float32)
    return out


def checkpoint_tensors(config: ModelConfig, tensors: dict[str, np.ndarray], dtype: str = "float32"
                       ) -> dict[str, np.ndarray]:
    """Float tensors by checkpoint name -> what a checkpoint of `config` stores: quantized codes and scales for
    the tensors its quantization_config makes fp8 / fp4, the rest float32 (or bfloat16 weights)."""
    out = {}
    plan = build_plan(config, mtp=any(name.startswith("mtp.") for name in tensors))
    for name, spec, _ in expected_tensors(config, plan):
        t = tensors[name]
        if spec.fmt in (FP8, FP8_DEQUANT, FP4):
            out.update(quantize_weight(np.asarray(t, np.float32), dataclasses.replace(spec, name=name)))
        elif dtype == "bfloat16" and spec.kind not in (F32, INDEX):
            out[name] = np.asarray(t, np.float32).astype(ml_dtypes.bfloat16)
        else:
            out[name] = t
    return out


def write_checkpoint(folder: str | os.PathLike, raw_config: dict[str, Any], tensors: dict[str, np.ndarray],
                     dtype: str = "float32") -> ModelConfig:
    """Write config.json (`raw_config`, as given) and model.safetensors (checkpoint_tensors of `tensors`) to
    `folder`. Returns the parsed config."""
    config = ModelConfig.from_dict(raw_config)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(raw_config, f, indent=2)
    write_safetensors(os.path.join(folder, "model.safetensors"), checkpoint_tensors(config, tensors, dtype))
    return config
