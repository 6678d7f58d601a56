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


@register("swiglu")
def swiglu(g: jax.Array, u: jax.Array, limit: float) -> jax.Array:
    """silu(min(g, limit)) * clamp(u, ±limit): g, u [..., F] -> fp32 [..., F]."""
    g = jnp.minimum(g.astype(jnp.float32), limit)
    u = jnp.clip(u.astype(jnp.float32), -limit, limit)
    return jax.nn.silu(g) * u


_swiglu = swiglu


@register("hc_split_sinkhorn")
def hc_split_sinkhorn(mu: jax.Array, scale: jax.Array, base: jax.Array, *, n: int, hc_eps: float,
                      sinkhorn_iters: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Mixes mu [..., (2+n)n] -> pre [..., n], post [..., n], comb [..., n, n] (fp32): sigmoid gates and
    the Sinkhorn-normalised combination matrix (softmax rows, then alternating column/row sums)."""
    pre = jax.nn.sigmoid(scale[0] * mu[..., :n] + base[:n]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(scale[1] * mu[..., n:2 * n] + base[n:2 * n])
    c = (scale[2] * mu[..., 2 * n:] + base[2 * n:]).reshape(mu.shape[:-1] + (n, n))
    c = jax.nn.softmax(c, axis=-1) + hc_eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + hc_eps)

    def row_col(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + hc_eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + hc_eps)

    # a loop with a static trip count keeps the program small (compile time); same arithmetic
    c = jax.lax.fori_loop(0, sinkhorn_iters - 1, row_col, c)
    return pre, post, c


@register("rms_norm")
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """weight ⊙ x / sqrt(mean(x²) + eps) over the last axis, statistics in fp32: x [..., D], weight [D] -> x's dtype."""
    x32 = x.astype(jnp.float32)
    r = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * r).astype(x.dtype)


@register("fp8_linear")
def fp8_linear(x: jax.Array, codes: jax.Array, scale: jax.Array, block: tuple[int, int], trn2: bool = True
               ) -> jax.Array:
    """x [..., K] · Wᵀ for fp8 codes W [N, K] with ue8m0 block scales [ceil(N/bn), ceil(K/bk)]: W decoded to x's
    dtype (exact), fp32 accumulation, result [..., N] in x's dtype."""
    from .quant import dequant_fp8

    w = dequant_fp8(codes, scale, block, x.dtype, trn2)
    y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), precision=HIGHEST,
                            preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def _act(x: jax.Array, numerics, quantized: bool) -> jax.Array:
    """The GEMM input as DeepSeek's numerics see it: fp8 act_quant before a quantized weight."""
    from .quant import fp8_fake_quant

    if quantized and numerics is not None and numerics.quantize_activations:
        return fp8_fake_quant(x, numerics.act_block, numerics.fp8_max)
    return x


def _weights(w, select, numerics, dtype) -> jax.Array:
    """Float expert weights, or quantized ones ({"codes"|"packed", "scale"}) decoded after `select`
    picks the wanted rows (only the chosen experts are decoded)."""
    if not isinstance(w, dict):
        return select(w)
    from ..layers.linear import dequant

    return dequant({k: select(v) for k, v in w.items()}, numerics, dtype)


def stacked_experts(w1) -> int:
    """The expert axis length of a stacked [R, E, ...] expert weight (float array or quantized leaves)."""
    return (w1["scale"] if isinstance(w1, dict) else w1).shape[1]


def _expert(a: jax.Array, layer: jax.Array, e: jax.Array) -> jax.Array:
    """a[layer, e] of a stacked [R, E, ...] array, as one dynamic slice (a contiguous copy, not a gather)."""
    start = (layer, e) + (0,) * (a.ndim - 2)
    return jax.lax.dynamic_slice(a, start, (1, 1) + a.shape[2:])[0, 0]


@register("moe_experts_gather")
def moe_experts_gather(x: jax.Array, idx: jax.Array, weight: jax.Array, w1, w2, w3, layer: jax.Array,
                       limit: float, numerics=None) -> jax.Array:
    """Routed experts for small token counts (decode): one (token, expert) pair at a time.

    x [T, d]; idx int32 [T, k]; weight fp32 [T, k]; w1, w3 [R, E, I, d], w2 [R, E, d, I] (all layers,
    `layer` picks one; float arrays or quantized leaves). A scan over the T*k pairs slices the chosen
    expert's matrices out of the stack (only those bytes are read or decoded) and applies them to its token:
    XLA's gather of whole expert matrices is far slower than dynamic slices on CPU once T > 1. The routing
    weight multiplies the activation before w2 (which is then act-quantised under DeepSeek's numerics).
    Returns fp32 [T, d].
    """
    T, k = idx.shape
    q = isinstance(w1, dict)
    rows = jnp.repeat(_act(x, numerics, q), k, axis=0)                  # [T*k, d]
    experts, wts = idx.reshape(-1), weight.reshape(-1)

    def pair(_, i):
        def pick(a):
            return _expert(a, layer, experts[i])

        W1, W3, W2 = (_weights(w, pick, numerics, x.dtype) for w in (w1, w3, w2))   # [I, d], [I, d], [d, I]
        xi = rows[i][None]
        h1 = jnp.einsum("td,id->ti", xi, W1, precision=HIGHEST, preferred_element_type=jnp.float32)
        h3 = jnp.einsum("td,id->ti", xi, W3, precision=HIGHEST, preferred_element_type=jnp.float32)
        a = _act((_swiglu(h1, h3, limit) * wts[i]).astype(x.dtype), numerics, q)
        return None, jnp.einsum("ti,di->td", a, W2, precision=HIGHEST, preferred_element_type=jnp.float32)[0]

    _, y = jax.lax.scan(pair, None, jnp.arange(T * k))                 # [T*k, d] fp32
    return jnp.sum(y.reshape(T, k, -1), axis=1)


@register("moe_experts_grouped")
def moe_experts_grouped(x: jax.Array, idx: jax.Array, weight: jax.Array, w1, w2, w3, layer: jax.Array,
                        limit: float, numerics=None) -> jax.Array:
    """Routed experts as a tiled grouped matmul over rows sorted by expert (large token counts: prefill).

    Same contract as `moe_experts_gather`. The T*k (token, expert) rows are sorted by expert and each
    expert's group is padded to a multiple of a tile; a scan over the tiles (a static count, enough for any
    routing: T*k/tile + E) applies the one expert each tile belongs to, sliced out of the stack. Work is at
    most ~2x the routed rows, whatever the routing (XLA:CPU lowers `ragged_dot` to one full-size matmul per
    expert, E times the work).
    """
    T, k = idx.shape
    N = T * k
    E = stacked_experts(w1)
    tile = int(min(128, max(8, 1 << max(0, N // E - 1).bit_length())))
    n_tiles = -(-(N + E * (tile - 1)) // tile)
    q = isinstance(w1, dict)

    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)                               # sorted row -> (token, slot) row
    expert_of = jnp.clip(flat[order], 0, E - 1)                          # [N], ascending (clamped: S12)
    sizes = jnp.sum(jax.nn.one_hot(flat, E, dtype=jnp.int32), axis=0)    # [E]
    padded = (sizes + tile - 1) // tile * tile
    ends = jnp.cumsum(padded)
    starts = jnp.cumsum(sizes) - sizes
    dest = (ends - padded)[expert_of] + jnp.arange(N, dtype=jnp.int32) - starts[expert_of]   # [N] padded slot
    dest = jnp.clip(dest, 0, n_tiles * tile - 1)
    src = jnp.full((n_tiles * tile,), N, jnp.int32).at[dest].set(jnp.arange(N, dtype=jnp.int32))
    tile_expert = jnp.minimum(jnp.sum(ends[None, :] <= (jnp.arange(n_tiles) * tile)[:, None], axis=1), E - 1)

    xa = _act(x, numerics, q)
    rows = jnp.concatenate([xa[order // k], jnp.zeros((1, x.shape[1]), xa.dtype)])[src]   # [P, d], pad rows 0
    wts = jnp.concatenate([weight.reshape(-1)[order], jnp.zeros((1,), weight.dtype)])[src]
    rows = rows.reshape(n_tiles, tile, -1)
    wts = wts.reshape(n_tiles, tile)

    def one_tile(_, t):
        xt, wt, e = t

        def pick(a):
            return _expert(a, layer, e)

        W1, W3, W2 = (_weights(w, pick, numerics, x.dtype) for w in (w1, w3, w2))   # [I, d], [I, d], [d, I]
        h1 = jnp.einsum("td,id->ti", xt, W1, precision=HIGHEST, preferred_element_type=jnp.float32)
        h3 = jnp.einsum("td,id->ti", xt, W3, precision=HIGHEST, preferred_element_type=jnp.float32)
        a = _act((_swiglu(h1, h3, limit) * wt[:, None]).astype(x.dtype), numerics, q)
        return None, jnp.einsum("ti,di->td", a, W2, precision=HIGHEST, preferred_element_type=jnp.float32)

    _, y = jax.lax.scan(one_tile, None, (rows, wts, tile_expert))        # [n_tiles, tile, d] fp32
    y = y.reshape(n_tiles * tile, -1)[dest]                              # sorted rows
    y = jnp.zeros_like(y).at[order].set(y)                               # back to (token, slot) rows
    return jnp.sum(y.reshape(T, k, -1), axis=1)


@register("moe_experts_dense")
def moe_experts_dense(x: jax.Array, idx: jax.Array, weight: jax.Array, w1, w2, w3, layer: jax.Array,
                      limit: float, numerics=None) -> jax.Array:
    """Routed experts applied densely: every expert of the stack to every token, weighted by the token's routing
    weight for it (0 when not routed there). Same contract as `moe_experts_gather`.

    A scan over the E experts of the stack ([R, E, ...] at `layer`): expert e's matrices are sliced once and
    applied to all T tokens as one GEMM. It reads each expert once per call, against T*k expert slices for the
    per-pair kernel, so it is the cheaper choice when E <= T*k (the expert-parallel decode, where each shard
    holds E/ep experts). Per token the ops equal the per-pair kernel's; only the fp32 order of the sum over a
    token's experts differs. Returns fp32 [T, d].
    """
    E = stacked_experts(w1)
    q = isinstance(w1, dict)
    xa = _act(x, numerics, q)

    def one_expert(acc, e):
        def pick(a):
            return _expert(a, layer, e)

        W1, W3, W2 = (_weights(w, pick, numerics, x.dtype) for w in (w1, w3, w2))   # [I, d], [I, d], [d, I]
        w_e = jnp.sum(jnp.where(idx == e, weight, 0.0), axis=-1)                  # [T] fp32
        h1 = jnp.einsum("td,id->ti", xa, W1, precision=HIGHEST, preferred_element_type=jnp.float32)
        h3 = jnp.einsum("td,id->ti", xa, W3, precision=HIGHEST, preferred_element_type=jnp.float32)
        a = _act((_swiglu(h1, h3, limit) * w_e[:, None]).astype(x.dtype), numerics, q)
        return acc + jnp.einsum("ti,di->td", a, W2, precision=HIGHEST, preferred_element_type=jnp.float32), None

    y, _ = jax.lax.scan(one_expert, jnp.zeros(x.shape, jnp.float32), jnp.arange(E))
    return y


@register("shared_expert")
def shared_expert(x: jax.Array, w1, w2, w3, limit: float, numerics=None) -> jax.Array:
    """The always-on SwiGLU expert: x [..., d] -> fp32 [..., d] (float or quantized weights)."""
    W1, W3, W2 = (_weights(w, lambda a: a, numerics, x.dtype) for w in (w1, w3, w2))
    xa = _act(x, numerics, isinstance(w1, dict))
    h1 = jnp.einsum("...d,id->...i", xa, W1, precision=HIGHEST, preferred_element_type=jnp.float32)
    h3 = jnp.einsum("...d,id->...i", xa, W3, precision=HIGHEST, preferred_element_type=jnp.float32)
    a = _swiglu(h1, h3, limit).astype(x.dtype)
    a = _act(a, numerics, isinstance(w2, dict))
    return jnp.einsum("...i,di->...d", a, W2, precision=HIGHEST, preferred_element_type=jnp.float32)
