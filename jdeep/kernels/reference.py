"""Pure-jnp reference implementations of the hot ops (the spec; used on CPU and GPU)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import register

HIGHEST = jax.lax.Precision.HIGHEST


@register("sparse_attention")
def sparse_attention(q: jax.Array, k_shared: jax.Array, mask_shared: jax.Array, k_sel: jax.Array | None,
                     mask_sel: jax.Array | None, sink: jax.Array, scale: float) -> jax.Array:
    """Single-head K=V attention with a per-head sink (model-spec.md §4.4.6).

    q [B, S, H, D]; k_shared [B, T, D] keys seen by every query, mask_shared bool [B, S, T];
    k_sel [B, S, K, D] per-query selected keys, mask_sel bool [B, S, K] (or None); sink [H] fp32.
    Keys are also the values. Softmax in fp32; the sink only enters the denominator.
    Returns [B, S, H, D] in q's dtype.
    """
    l_sh = jnp.einsum("bshd,btd->bsht", q, k_shared, precision=HIGHEST, preferred_element_type=jnp.float32) * scale
    l_sh = jnp.where(mask_shared[:, :, None, :], l_sh, -jnp.inf)
    parts = [l_sh]
    if k_sel is not None:
        l_sel = jnp.einsum("bshd,bskd->bshk", q, k_sel, precision=HIGHEST, preferred_element_type=jnp.float32) * scale
        parts.append(jnp.where(mask_sel[:, :, None, :], l_sel, -jnp.inf))
    sink = sink.astype(jnp.float32)[None, None, :]
    mx = jnp.maximum(functools.reduce(jnp.maximum, [jnp.max(p, axis=-1) for p in parts]), sink)
    exps = [jnp.exp(p - mx[..., None]) for p in parts]
    denom = sum(jnp.sum(e, axis=-1) for e in exps) + jnp.exp(sink - mx)
    vt = q.dtype
    out = jnp.einsum("bsht,btd->bshd", (exps[0] / denom[..., None]).astype(vt), k_shared,
                     precision=HIGHEST, preferred_element_type=jnp.float32)
    if k_sel is not None:
        out = out + jnp.einsum("bshk,bskd->bshd", (exps[1] / denom[..., None]).astype(vt), k_sel,
                               precision=HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def _swiglu(g: jax.Array, u: jax.Array, limit: float) -> jax.Array:
    """silu(min(g, limit)) * clamp(u, ±limit), fp32."""
    g = jnp.minimum(g.astype(jnp.float32), limit)
    u = jnp.clip(u.astype(jnp.float32), -limit, limit)
    return jax.nn.silu(g) * u


@register("moe_experts_gather")
def moe_experts_gather(x: jax.Array, idx: jax.Array, weight: jax.Array, w1: jax.Array, w2: jax.Array,
                       w3: jax.Array, layer: jax.Array, limit: float) -> jax.Array:
    """Routed experts by gathering each token's k expert matrices (small token counts: decode).

    x [T, d]; idx int32 [T, k]; weight fp32 [T, k]; w1, w3 [R, E, I, d], w2 [R, E, d, I] (all layers,
    `layer` picks one). The routing weight multiplies the activation before w2. Returns fp32 [T, d].
    """
    W1, W3, W2 = w1[layer, idx], w3[layer, idx], w2[layer, idx]          # [T, k, I, d] / [T, k, d, I]
    h1 = jnp.einsum("td,tkid->tki", x, W1, precision=HIGHEST, preferred_element_type=jnp.float32)
    h3 = jnp.einsum("td,tkid->tki", x, W3, precision=HIGHEST, preferred_element_type=jnp.float32)
    a = (_swiglu(h1, h3, limit) * weight[..., None]).astype(x.dtype)
    y = jnp.einsum("tki,tkdi->tkd", a, W2, precision=HIGHEST, preferred_element_type=jnp.float32)
    return jnp.sum(y, axis=1)


@register("moe_experts_grouped")
def moe_experts_grouped(x: jax.Array, idx: jax.Array, weight: jax.Array, w1: jax.Array, w2: jax.Array,
                        w3: jax.Array, layer: jax.Array, limit: float) -> jax.Array:
    """Routed experts as grouped matmuls over tokens sorted by expert (large token counts: prefill).

    Same contract as `moe_experts_gather`. Static shapes: T*k rows, group sizes per expert.
    """
    T, k = idx.shape
    E = w1.shape[1]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    inverse = jnp.argsort(order, stable=True)
    xs = x[order // k]
    sizes = jnp.sum(jax.nn.one_hot(flat, E, dtype=jnp.int32), axis=0)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])

    def gmm(lhs, rhs):
        return jax.lax.ragged_dot_general(lhs, rhs, sizes, dims, precision=HIGHEST,
                                          preferred_element_type=jnp.float32)

    h1, h3 = gmm(xs, w1[layer]), gmm(xs, w3[layer])
    a = (_swiglu(h1, h3, limit) * weight.reshape(-1)[order][:, None]).astype(x.dtype)
    y = gmm(a, w2[layer])                                                 # [T*k, d] fp32
    return jnp.sum(y[inverse].reshape(T, k, -1), axis=1)


@register("shared_expert")
def shared_expert(x: jax.Array, w1: jax.Array, w2: jax.Array, w3: jax.Array, limit: float) -> jax.Array:
    """The always-on SwiGLU expert: x [..., d] -> fp32 [..., d]."""
    h1 = jnp.einsum("...d,id->...i", x, w1, precision=HIGHEST, preferred_element_type=jnp.float32)
    h3 = jnp.einsum("...d,id->...i", x, w3, precision=HIGHEST, preferred_element_type=jnp.float32)
    a = _swiglu(h1, h3, limit).astype(x.dtype)
    return jnp.einsum("...i,di->...d", a, w2, precision=HIGHEST, preferred_element_type=jnp.float32)
