"""DeepSeek-V4.1's vision tower in jnp (model-spec.md §5.9): the ViT and the aligner, and an image span's rows.

Shapes are static per bucket: an image's patches are padded to N rows (padding keys masked out of attention) and its
aligner output to T rows; the geometry (patch positions, the aligner's 3x3 gathers) is computed on the host
(vision.geometry) and passed in as int32 arrays. Attention over more than ATTENTION_BLOCK patches runs one block
of queries at a time (logits [heads, block, N], not [heads, N, N]: 17 GB at DeepSeek's largest image).

params (vision.params.vision_specs; L blocks stacked on a leading axis, run under lax.scan):
  patch_embed {weight [dim, 3p²], bias [dim]}; blocks {norm1, norm2 [L, dim], wqkv [L, 3dim, dim], wqkv_bias
  [L, 3dim], wo [L, dim, dim], wo_bias [L, dim], w1 [L, 2·inter, dim], w2 [L, dim, inter]}; norm [dim];
  aligner {w1 [D, r²·dim], w1_bias [D], w2 [D, D], w2_bias [D]}; image_start, image_end, image_newline [D]
  (read by span_rows on the host).
Activations are in the weights' dtype with fp32 accumulation; norms, RoPE and the softmax in fp32 (DeepSeek runs
the tower in bf16 with the same fp32 places).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..config import VisionConfig
from ..kernels.linear import linear
from ..layers.norm import rms
from .processor import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START

__all__ = ["ATTENTION_BLOCK", "vit", "aligner", "span_rows", "tower"]

ATTENTION_BLOCK = 1024


def _norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    return (rms(x, eps) * w.astype(jnp.float32)).astype(x.dtype)


def _affine(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    y = linear(x, w)
    return y if b is None else (y.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def _rope_angles(pos: jax.Array, vc: VisionConfig) -> jax.Array:
    """pos int32 [N, 2] (patch row, column) -> fp32 [N, head_dim/2]: the row angles at frequencies
    theta^(-j/(head_dim/4)), j < head_dim/4, then the column angles at the same frequencies."""
    r = vc.head_dim // 2
    inv = 1.0 / (vc.rope_theta ** (jnp.arange(0, r, 2, dtype=jnp.float32) / r))       # [head_dim/4]
    p = pos.astype(jnp.float32)
    return jnp.concatenate([p[:, :1] * inv, p[:, 1:] * inv], axis=-1)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Half-split rotation of x [N, H, hd]: dim d pairs with d + hd/2, by the angle of column d; fp32 math."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def _block(x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, key_ok: jax.Array, vc: VisionConfig) -> jax.Array:
    """One pre-norm ViT block on x [N, dim]: bidirectional attention over the valid patches, then SwiGLU."""
    N, H, hd = x.shape[0], vc.n_heads, vc.head_dim
    q, k, v = jnp.split(_affine(_norm(x, p["norm1"], vc.norm_eps), p["wqkv"], p["wqkv_bias"]), 3, axis=-1)
    q, k, v = (t.reshape(N, H, hd) for t in (q, k, v))
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)

    def attend(qb):                                                      # qb [n, H, hd] -> [n, H, hd]
        logits = jnp.einsum("nhd,mhd->hnm", qb, k, precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32) * hd ** -0.5
        probs = jax.nn.softmax(jnp.where(key_ok[None, None, :], logits, -jnp.inf), axis=-1)
        return jnp.einsum("hnm,mhd->nhd", probs.astype(v.dtype), v, precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32).astype(x.dtype)

    if N > ATTENTION_BLOCK:      # bucket sizes past the block are multiples of it (vision.geometry.bucket)
        o = jax.lax.map(attend, q.reshape(N // ATTENTION_BLOCK, ATTENTION_BLOCK, H, hd)).reshape(N, H, hd)
    else:
        o = attend(q)
    x = x + _affine(o.reshape(N, H * hd), p["wo"], p["wo_bias"])
    gate, up = jnp.split(linear(_norm(x, p["norm2"], vc.norm_eps), p["w1"]), 2, axis=-1)
    a = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
    return x + linear(a, p["w2"])


def vit(params: dict, patches: jax.Array, pos: jax.Array, valid: jax.Array, vc: VisionConfig) -> jax.Array:
    """patches [N, 3p²] (bf16-exact values), pos int32 [N, 2], valid bool [N] -> features [N, dim] in the weights'
    dtype, after the final norm (rows of invalid patches are meaningless)."""
    dtype = params["norm"].dtype
    x = _affine(patches.astype(dtype), params["patch_embed"]["weight"], params["patch_embed"]["bias"])
    ang = _rope_angles(pos, vc)
    cos, sin = jnp.cos(ang), jnp.sin(ang)

    def body(x, p):
        return _block(x, p, cos, sin, valid, vc), None

    x, _ = jax.lax.scan(body, x, params["blocks"])
    return _norm(x, params["norm"], vc.norm_eps)


def aligner(params: dict, features: jax.Array, gather: jax.Array) -> jax.Array:
    """features [N, dim]; gather int32 [T, r²]: per text position, its r x r patches in row-major order (N: a zero
    row, the padding right and below the grid) -> [T, D]. Each position's input is channel-major, c·r² + k; then
    Linear, exact GELU, Linear."""
    p = params["aligner"]
    padded = jnp.concatenate([features, jnp.zeros_like(features[:1])], axis=0)
    x = padded[jnp.clip(gather, 0, features.shape[0])]                 # [T, r², dim] (clamped: S12)
    x = jnp.swapaxes(x, 1, 2).reshape(gather.shape[0], -1)               # [T, dim·r²], channel-major
    h = _affine(x, p["w1"], p["w1_bias"])
    h = jax.nn.gelu(h.astype(jnp.float32), approximate=False).astype(h.dtype)
    return _affine(h, p["w2"], p["w2_bias"])


def span_rows(aligned: np.ndarray, types: np.ndarray, marks: dict) -> np.ndarray:
    """An image span's embedding rows on the host: aligned [>= T, D] (the aligner's rows in reading order), types
    [S] (processor.span_types), marks {"image_start", "image_end", "image_newline": [D]} -> [S, D]: the k-th
    IMAGE position takes aligned row k, the delimiters their learned vectors."""
    out = np.empty((len(types), aligned.shape[1]), aligned.dtype)
    image = types == IMAGE
    out[image] = aligned[:int(image.sum())]
    for kind, name in ((IMAGE_START, "image_start"), (IMAGE_END, "image_end"), (IMAGE_NEW_LINE, "image_newline")):
        out[types == kind] = marks[name]
    return out


def tower(params: dict, patches: jax.Array, pos: jax.Array, valid: jax.Array, gather: jax.Array, *,
          vc: VisionConfig) -> jax.Array:
    """One image through the ViT and the aligner: its aligned rows [T, D] (see vision.geometry for the inputs)."""
    return aligner(params, vit(params, patches, pos, valid, vc), gather)
