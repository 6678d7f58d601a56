"""The vision tower's checkpoint tensors (DeepSeek-V4.1's names: `vision.*`, `aligner.*`, `image_start` /
`image_end` / `image_newline`, all bf16 in the release) and their param tree (vision.tower)."""

from __future__ import annotations

from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..io.safetensors import FLOAT_DTYPES, CheckpointError, CheckpointReader

__all__ = ["vision_tensors", "vision_tree", "load_vision_params", "random_vision_tensors"]

# (checkpoint suffix of a block tensor, param key in params["blocks"], shape from (dim, inter))
_BLOCK = (("norm1.weight", "norm1", lambda d, i: (d,)), ("norm2.weight", "norm2", lambda d, i: (d,)),
          ("attn.wqkv.weight", "wqkv", lambda d, i: (3 * d, d)), ("attn.wqkv.bias", "wqkv_bias", lambda d, i: (3 * d,)),
          ("attn.wo.weight", "wo", lambda d, i: (d, d)), ("attn.wo.bias", "wo_bias", lambda d, i: (d,)),
          ("mlp.w1.weight", "w1", lambda d, i: (2 * i, d)), ("mlp.w2.weight", "w2", lambda d, i: (d, i)))


def vision_tensors(config: ModelConfig) -> Iterator[tuple[str, tuple, tuple[int, ...]]]:
    """(checkpoint name, param path, shape) of every vision tensor of `config` (which has a vision tower);
    block tensors have a path (\"blocks\", key, layer)."""
    vc, D = config.vision, config.dim
    d, r = vc.dim, vc.downsample_ratio
    yield "vision.patch_embed.proj.weight", ("patch_embed", "weight"), (d, vc.patch_values)
    yield "vision.patch_embed.proj.bias", ("patch_embed", "bias"), (d,)
    for layer in range(vc.n_layers):
        for suffix, key, shape in _BLOCK:
            yield f"vision.blocks.{layer}.{suffix}", ("blocks", key, layer), shape(d, vc.inter_dim)
    yield "vision.norm.weight", ("norm",), (d,)
    yield "aligner.w1.weight", ("aligner", "w1"), (D, r * r * d)
    yield "aligner.w1.bias", ("aligner", "w1_bias"), (D,)
    yield "aligner.w2.weight", ("aligner", "w2"), (D, D)
    yield "aligner.w2.bias", ("aligner", "w2_bias"), (D,)
    for name in ("image_start", "image_end", "image_newline"):
        yield name, (name,), (D,)


def load_vision_params(folder: str, config: ModelConfig, dtype: Any, device: Any = None) -> dict:
    """The vision tower's params from a checkpoint folder, in `dtype` on `device` (default JAX's first); one
    CheckpointError names every missing, mis-shaped or non-float tensor."""
    reader = CheckpointReader(folder)
    present = set(reader.keys())
    problems = []
    for name, _, shape in vision_tensors(config):
        if name not in present:
            problems.append(f"missing tensor {name!r} (expected shape {list(shape)})")
            continue
        e = reader.entry(name)
        if tuple(e.shape) != shape:
            problems.append(f"tensor {name!r} has shape {list(e.shape)}, expected {list(shape)}")
        elif e.dtype not in FLOAT_DTYPES:
            problems.append(f"tensor {name!r} has dtype {e.dtype}, expected a float (F32/BF16/F16)")
    if problems:
        raise CheckpointError(f"checkpoint {folder}: the vision tower (config vision_config) does not match: "
                              + "; ".join(problems[:20]) + (f"; ... and {len(problems) - 20} more"
                                                            if len(problems) > 20 else ""))
    device = device if device is not None else jax.devices()[0]
    tree = vision_tree(config, {name: np.asarray(reader.get(name), np.float32) for name, _, _ in vision_tensors(config)})
    return jax.tree_util.tree_map(lambda a: jax.device_put(jnp.asarray(a, dtype), device), tree)


def vision_tree(config: ModelConfig, tensors: dict[str, np.ndarray]) -> dict:
    """The tower's param tree (vision.tower) from its tensors under their checkpoint names; blocks stacked [L, ...]."""
    out: dict = {}
    blocks: dict[str, list] = {}
    for name, path, _ in vision_tensors(config):
        if path[0] == "blocks":
            blocks.setdefault(path[1], []).append(tensors[name])
            continue
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = tensors[name]
    out["blocks"] = {k: np.stack(v) for k, v in blocks.items()}
    return out


def random_vision_tensors(rng: np.random.Generator, config: ModelConfig) -> dict[str, np.ndarray]:
    """Seeded float32 vision tensors under the checkpoint names, scaled to keep activations well-conditioned."""
    out = {}
    for name, _, shape in vision_tensors(config):
        if name.endswith("norm.weight") or ".norm1." in name or ".norm2." in name:
            out[name] = (1.0 + 0.1 * rng.normal(size=shape)).astype(np.float32)
        elif name.endswith(".bias"):
            out[name] = rng.normal(0, 0.02, shape).astype(np.float32)
        elif name.startswith("image_"):
            out[name] = rng.normal(0, 1, shape).astype(np.float32)
        else:
            out[name] = rng.normal(0, 1.0 / np.sqrt(shape[-1]), shape).astype(np.float32)
    return out
