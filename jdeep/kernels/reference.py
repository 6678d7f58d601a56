"""Pure-jnp reference implementations of the hot ops (the spec; used on CPU and GPU)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .linear import dequant, from_bits, in_place, linear_f32, product, stack_dims
from .quant import dequant_fp8, gemm_input
from .registry import register

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


# ---------------------------------------------------------------- lightning indexer: scores, top-k
@register("index_scores")
def index_scores(q: jax.Array, keys: jax.Array, weights: jax.Array, visible_count: jax.Array) -> jax.Array:
    """Indexer scores (model-spec.md §4.4.5, §5.5): score[b, s, t] = Σ_h w[b, s, h] · relu(q[b, s, h] · keys[b, t])
    in fp32, -inf where t >= visible_count[b, s]. q [B, S, nI, DI], keys [B, T, DI] (activation dtype),
    weights fp32 [B, S, nI] (already scaled), visible_count int32 [B, S] -> fp32 [B, S, T]."""
    s = jnp.einsum("bshd,btd->bsht", q, keys, precision=HIGHEST, preferred_element_type=jnp.float32)
    score = jnp.einsum("bsht,bsh->bst", jax.nn.relu(s), weights, precision=HIGHEST)
    entry = jnp.arange(keys.shape[1], dtype=jnp.int32)
    return jnp.where(entry[None, None, :] < visible_count[..., None], score, -jnp.inf)


@register("topk")
def topk(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest entries of each row: x [..., T], k <= T (a Python int) -> (values [..., k] descending,
    indices int32 [..., k]); ties to the lower index, -inf entries last in ascending index order (lax.top_k)."""
    values, indices = jax.lax.top_k(x, k)
    return values, indices


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


# ---------------------------------------------------------------- mHC collapse / expand / mix logits, pooling
@register("hc_mix_logits")
def hc_mix_logits(X: jax.Array, fn: jax.Array, norm_eps: float) -> jax.Array:
    """The mHC mix logits (model-spec.md §4.2, §4.6): flat = X [..., n, d] as fp32 [..., n·d];
    mu = (flat · fnᵀ) · rsqrt(mean(flat²) + norm_eps) with fn [W, n·d] fp32 (W = (2+n)n, or n for the head)
    -> fp32 [..., W]."""
    flat = X.reshape(X.shape[:-2] + (-1,)).astype(jnp.float32)
    return linear_f32(flat, fn) * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)


@register("hc_collapse")
def hc_collapse(X: jax.Array, pre: jax.Array) -> jax.Array:
    """The mHC pre-mix: Σ_i pre_i X_i in fp32, cast to X's dtype: X [..., n, d], pre fp32 [..., n] -> [..., d]."""
    return jnp.sum(pre[..., None] * X.astype(jnp.float32), axis=-2).astype(X.dtype)


@register("hc_expand")
def hc_expand(y: jax.Array, post: jax.Array, comb: jax.Array, X: jax.Array) -> jax.Array:
    """The mHC post-mix: X'_k = post_k · y + Σ_j comb[j, k] · X_j in fp32 -> [..., n, d] in X's dtype.
    y [..., d], post fp32 [..., n], comb fp32 [..., n, n], X [..., n, d]."""
    mixed = jnp.einsum("...jk,...jd->...kd", comb, X.astype(jnp.float32), precision=HIGHEST)
    return (post[..., None] * y.astype(jnp.float32)[..., None, :] + mixed).astype(X.dtype)


@register("softmax_pool")
def softmax_pool(score: jax.Array, kv: jax.Array) -> jax.Array:
    """The compressor's softmax-gated pooling (model-spec.md §4.4.4, §5.4): score, kv fp32 [..., m, C] ->
    Σ_m softmax_m(score) · kv, fp32 [..., C] (softmax over the m slots, per channel). Slots with score -inf
    weigh 0; a channel whose m scores are all -inf gives NaN."""
    return jnp.sum(jax.nn.softmax(score, axis=-2) * kv, axis=-2)


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
    w = dequant_fp8(codes, scale, block, x.dtype, trn2)
    y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), precision=HIGHEST,
                            preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


# ---------------------------------------------------------------- MoE: routed experts, shared expert
def moe_input(x: jax.Array, numerics, quantized: bool) -> jax.Array:
    """The GEMM input as DeepSeek's numerics see it: fp8 act_quant before a quantized weight."""
    return gemm_input(x, numerics) if quantized else x


def _weights(w, select, numerics, dtype) -> jax.Array:
    """Float expert weights, or quantized ones ({"codes"|"packed", "scale"}) decoded after `select`
    picks the wanted rows (only the chosen experts are decoded); bf16 weights carried as bits bitcast back after it."""
    if not isinstance(w, dict):
        return from_bits(select(w))
    return dequant({k: select(v) for k, v in w.items()}, numerics, dtype)


def _expert_matrices(ws, layer: jax.Array, e: jax.Array, numerics, dtype, x: jax.Array) -> tuple:
    """Expert e's matrices of layer `layer` from the [R, E, ...] stacks ws, for a product with x's rows: read in
    place by the native CPU kernel where it runs (kernels.linear.in_place), else sliced out (and decoded)."""
    def one(w):
        m = in_place(w, (layer, e), x, numerics, dtype)
        return m if m is not None else _weights(w, lambda a: _expert(a, layer, e), numerics, dtype)

    return tuple(one(w) for w in ws)


def stacked_experts(w1) -> int:
    """The expert axis length of a stacked [R, E, ...] expert weight (float array or quantized leaves)."""
    return stack_dims(w1, 2)[1]


def _expert(a: jax.Array, layer: jax.Array, e: jax.Array) -> jax.Array:
    """a[layer, e] of a stacked [R, E, ...] array, as one dynamic slice (a contiguous copy, not a gather)."""
    start = (layer, e) + (0,) * (a.ndim - 2)
    return jax.lax.dynamic_slice(a, start, (1, 1) + a.shape[2:])[0, 0]


def expert_gate_up(x: jax.Array, W1: jax.Array, W3: jax.Array, limit: float, weight=None) -> jax.Array:
    """An expert's first half on its rows: swiglu(x W1ᵀ, x W3ᵀ) (· weight, broadcast against [..., I]) in fp32.
    x [..., d], W1, W3 [I, d] (decoded, or linear.InPlace) -> fp32 [..., I]: the `a` before its cast and act-quant."""
    h1, h3 = product(x, W1), product(x, W3)
    a = _swiglu(h1, h3, limit)
    return a if weight is None else a * weight


def expert_down(a: jax.Array, W2: jax.Array) -> jax.Array:
    """An expert's second half: a [..., I] (cast and act-quantised) · W2ᵀ, W2 [d, I] -> fp32 [..., d]."""
    return product(a, W2)


class ExpertGroups(NamedTuple):
    """The (token, slot) rows of a routing grouped by expert, each expert's group padded to whole tiles.
    order [N]: row -> flat (token, slot) row (the sort's permutation; None for `expert_groups_nosort`, whose rows
    stay in (token, slot) order);
    dest [N]: row -> padded slot; src [n_tiles·tile]: padded slot -> row (N for a padding slot);
    tile_expert int32 [n_tiles]: the one expert of each tile; n_used int32 []: the tiles holding any row (the
    first n_used; the rest are padding only)."""
    tile: int
    n_tiles: int
    order: jax.Array | None
    dest: jax.Array
    src: jax.Array
    tile_expert: jax.Array
    n_used: jax.Array


def _tiling(N: int, E: int, used_only: bool = False) -> tuple[int, int]:
    """(tile, n_tiles) for N rows over E experts: tiles of 8..128 rows, a static count enough for any routing
    (N/tile + E). The tile is the mean group rounded up to a power of two; where the loop runs the used tiles only
    (`used_only`, Numerics.skip_padding_tiles) the static count costs nothing, and the tile is 1.5x the mean group
    rounded up to a multiple of 8, so most groups fit one tile (XLA:CPU, a 256-token chunk of 32 experts: tiles of
    48 rows 10% faster than 32 or 64, docs/performance.md). Never exactly E tiles (at N == E it would be): one
    more, all padding, so the tile loop's trip is not the expert count (S5's "loop over experts" lint)."""
    if used_only:
        tile = int(min(128, max(8, -(-3 * N // (2 * E * 8)) * 8)))
    else:
        tile = int(min(128, max(8, 1 << max(0, N // E - 1).bit_length())))
    n_tiles = -(-(N + E * (tile - 1)) // tile)
    return tile, n_tiles + (n_tiles == E)


def expert_groups(idx: jax.Array, n_experts: int, used_only: bool = False) -> ExpertGroups:
    """Group the T·k rows of idx [T, k] by expert in tiles of 8..128 rows, with a static tile count enough for any
    routing (`_tiling`; `used_only`: the tile for a loop over the used tiles only). Ids outside [0, E) are
    clamped into it (S12)."""
    T, k = idx.shape
    N, E = T * k, n_experts
    tile, n_tiles = _tiling(N, E, used_only)
    flat = jnp.clip(idx.reshape(-1), 0, E - 1)
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
    return ExpertGroups(tile, n_tiles, order, dest, src, tile_expert, ends[-1] // tile)


def expert_groups_nosort(idx: jax.Array, n_experts: int, used_only: bool = False) -> ExpertGroups:
    """`expert_groups` without a sort (decode programs: neuron-notes S6), the same padded layout for ids in [0, E).

    A (token, slot) row's rank inside its expert is the count of earlier rows routed to the same expert (an
    int32 sum over a bool [T·k, T·k] compare: exact, one fused op; 1536² at batch 256, top-6); its padded slot is
    its expert's group start (exclusive cumsum of the per-expert counts, padded to tiles) plus its rank. The stable
    sort of `expert_groups` puts every row at that same slot (rows of one expert keep their (token, slot) order),
    so tiles, their rows and their experts are identical. Rows stay in (token, slot) order (order None), src maps
    a padded slot to a (token, slot) row. Ids outside [0, E) are clamped into it (S12). idx int32 [T, k].
    (A cumsum over a one-hot [T·k, E] gives the same ranks, but XLA lowers it to a reduce_window: (T·k)²·E adds.)"""
    T, k = idx.shape
    N, E = T * k, n_experts
    tile, n_tiles = _tiling(N, E, used_only)
    flat = jnp.clip(idx.reshape(-1), 0, E - 1)
    row = jnp.arange(N, dtype=jnp.int32)
    earlier = (flat[None, :] == flat[:, None]) & (row[None, :] < row[:, None])    # bool [N, N]
    rank = jnp.sum(earlier, axis=1, dtype=jnp.int32)                              # [N]
    hot = flat[:, None] == jnp.arange(E, dtype=jnp.int32)[None, :]                # bool [N, E]
    sizes = jnp.sum(hot, axis=0, dtype=jnp.int32)                                 # [E]
    padded = (sizes + tile - 1) // tile * tile
    ends = jnp.cumsum(padded)
    dest = jnp.sum(jnp.where(hot, (ends - padded)[None, :], 0), axis=1) + rank    # [N] padded slot
    dest = jnp.clip(dest, 0, n_tiles * tile - 1)
    src = jnp.full((n_tiles * tile,), N, jnp.int32).at[dest].set(row)
    tile_expert = jnp.minimum(jnp.sum(ends[None, :] <= (jnp.arange(n_tiles) * tile)[:, None], axis=1), E - 1)
    return ExpertGroups(tile, n_tiles, None, dest, src, tile_expert, ends[-1] // tile)


def group_rows(xa: jax.Array, weight: jax.Array, g: ExpertGroups) -> tuple[jax.Array, jax.Array]:
    """The grouped rows: xa [T, d] (act-quantised), weight [T, k] -> rows [n_tiles·tile, d] (padding rows 0) and
    their routing weights [n_tiles·tile] (padding 0)."""
    k = weight.shape[1]
    per_row = jnp.repeat(xa, k, axis=0) if g.order is None else xa[g.order // k]
    w = weight.reshape(-1) if g.order is None else weight.reshape(-1)[g.order]
    rows = jnp.concatenate([per_row, jnp.zeros((1, xa.shape[1]), xa.dtype)])[g.src]
    wts = jnp.concatenate([w, jnp.zeros((1,), weight.dtype)])[g.src]
    return rows, wts


def ungroup_rows(y: jax.Array, g: ExpertGroups, T: int, k: int) -> jax.Array:
    """Per-row outputs y [n_tiles·tile, d] (fp32) back to the tokens: the sum over each token's k slots [T, d]."""
    y = y[g.dest]                                                        # grouped order
    if g.order is not None:
        y = jnp.zeros_like(y).at[g.order].set(y)                         # back to (token, slot) rows
    return jnp.sum(y.reshape(T, k, -1), axis=1)


def dense_weight(idx: jax.Array, weight: jax.Array, e) -> jax.Array:
    """Each token's routing weight for expert e (0 where not routed there): idx, weight [T, k] -> fp32 [T]."""
    return jnp.sum(jnp.where(idx == e, weight, 0.0), axis=-1)


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
    rows = jnp.repeat(moe_input(x, numerics, q), k, axis=0)                  # [T*k, d]
    experts, wts = idx.reshape(-1), weight.reshape(-1)
    n = T * k + (T * k == stacked_experts(w1))      # a trip of exactly E would read as a loop over experts (S5)
    if n > T * k:                                   # so one padding pair: weight 0 on a zero row, expert 0
        rows = jnp.concatenate([rows, jnp.zeros_like(rows[:1])])
        experts, wts = jnp.concatenate([experts, experts[:1] * 0]), jnp.concatenate([wts, wts[:1] * 0])

    def pair(_, i):
        def pick(a):
            return _expert(a, layer, experts[i])

        W1, W3, W2 = (_weights(w, pick, numerics, x.dtype) for w in (w1, w3, w2))   # [I, d], [I, d], [d, I]
        a = moe_input(expert_gate_up(rows[i][None], W1, W3, limit, wts[i]).astype(x.dtype), numerics, q)
        return None, expert_down(a, W2)[0]

    _, y = jax.lax.scan(pair, None, jnp.arange(n))                     # [n, d] fp32
    return jnp.sum(y[:T * k].reshape(T, k, -1), axis=1)


@register("moe_experts_grouped")
def moe_experts_grouped(x: jax.Array, idx: jax.Array, weight: jax.Array, w1, w2, w3, layer: jax.Array,
                        limit: float, numerics=None) -> jax.Array:
    """Routed experts as a tiled grouped matmul over rows sorted by expert (large token counts: prefill).

    Same contract as `moe_experts_gather`. The T*k (token, expert) rows are sorted by expert and each
    expert's group is padded to a multiple of a tile (`expert_groups`); a scan over the tiles (a static count,
    enough for any routing: T*k/tile + E) applies the one expert each tile belongs to, sliced out of the stack.
    Work is at most ~2x the routed rows, whatever the routing (XLA:CPU lowers `ragged_dot` to one full-size
    matmul per expert, E times the work).
    """
    return _through_groups(expert_groups(idx, stacked_experts(w1), _used_only(numerics)), x, weight, w1, w2, w3,
                           layer, limit, numerics)


def _through_groups(g: ExpertGroups, x: jax.Array, weight: jax.Array, w1, w2, w3, layer: jax.Array, limit: float,
                    numerics) -> jax.Array:
    """The grouped kernels' body once the rows' layout g is known: rows grouped, the tile scan, the rows summed back
    per token (fp32 [T, d])."""
    T, k = weight.shape
    q = isinstance(w1, dict)
    rows, wts = group_rows(moe_input(x, numerics, q), weight, g)
    y = _grouped_tiles(rows, wts, g, x.dtype, w1, w2, w3, layer, limit, numerics, q)
    return ungroup_rows(y, g, T, k)


def _grouped_tiles(rows: jax.Array, wts: jax.Array, g: ExpertGroups, x_dtype, w1, w2, w3, layer: jax.Array,
                   limit: float, numerics, q: bool) -> jax.Array:
    """The tile scan of the grouped kernels: rows [n_tiles·tile, d] (act-quantised), wts [n_tiles·tile] ->
    fp32 [n_tiles·tile, d]; each tile's expert g.tile_expert sliced out of the [R, E, ...] stacks at `layer`."""
    rows = rows.reshape(g.n_tiles, g.tile, -1)
    wts = wts.reshape(g.n_tiles, g.tile)

    def one_tile(xt, wt, e):
        W1, W3, W2 = _expert_matrices((w1, w3, w2), layer, e, numerics, x_dtype, xt)   # [I, d], [I, d], [d, I]
        a = moe_input(expert_gate_up(xt, W1, W3, limit, wt[:, None]).astype(x_dtype), numerics, q)
        return expert_down(a, W2)

    if _used_only(numerics):
        # only the used tiles (a routing-dependent trip); the others stay 0, which is what padding rows give
        def used_tile(t, y):
            return y.at[t].set(one_tile(rows[t], wts[t], g.tile_expert[t]))

        y = jax.lax.fori_loop(0, g.n_used, used_tile, jnp.zeros(rows.shape, jnp.float32))
    else:
        _, y = jax.lax.scan(lambda _, t: (None, one_tile(*t)), None, (rows, wts, g.tile_expert))
    return y.reshape(g.n_tiles * g.tile, -1)                             # [n_tiles·tile, d] fp32


@register("moe_experts_grouped_nosort")
def moe_experts_grouped_nosort(x: jax.Array, idx: jax.Array, weight: jax.Array, w1, w2, w3, layer: jax.Array,
                               limit: float, numerics=None) -> jax.Array:
    """`moe_experts_grouped` without a sort, for decode programs at any T·k (neuron-notes S6: no sort in decode).

    Same contract as `moe_experts_gather` (x [T, d], idx int32 [T, k], weight fp32 [T, k], stacks [R, E, ...]
    -> fp32 [T, d]). The rows are laid out by `expert_groups_nosort` (ranks from a count of earlier rows), which
    is `expert_groups`' padded layout, then the same tile scan: for ids in [0, E) the result equals
    `moe_experts_grouped` bit for bit, and no (token, expert) pair is dropped whatever the routing. The
    ranks cost a [T·k, T·k] compare (1536² at batch 256, top-6), so it suits decode sizes; prefill sorts.
    """
    return _through_groups(expert_groups_nosort(idx, stacked_experts(w1), _used_only(numerics)), x, weight, w1, w2,
                           w3, layer, limit, numerics)


def _used_only(numerics) -> bool:
    """Whether the tile loop runs the used tiles only (Numerics.skip_padding_tiles; the platform's)."""
    return numerics is not None and numerics.skip_padding_tiles


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
    xa = moe_input(x, numerics, q)

    def one_expert(acc, e):
        W1, W3, W2 = _expert_matrices((w1, w3, w2), layer, e, numerics, x.dtype, xa)   # [I, d], [I, d], [d, I]
        a = moe_input(expert_gate_up(xa, W1, W3, limit, dense_weight(idx, weight, e)[:, None]).astype(x.dtype),
                 numerics, q)
        return acc + expert_down(a, W2), None

    y, _ = jax.lax.scan(one_expert, jnp.zeros(x.shape, jnp.float32), jnp.arange(E))
    return y


@register("shared_expert")
def shared_expert(x: jax.Array, w1, w2, w3, limit: float, numerics=None) -> jax.Array:
    """The always-on SwiGLU expert: x [..., d] -> fp32 [..., d] (float or quantized weights)."""
    xa = moe_input(x, numerics, isinstance(w1, dict))
    W1, W3, W2 = (in_place(w, (), xa, numerics, x.dtype) or _weights(w, lambda a: a, numerics, x.dtype)
                  for w in (w1, w3, w2))
    a = expert_gate_up(xa, W1, W3, limit).astype(x.dtype)
    a = moe_input(a, numerics, isinstance(w2, dict))
    return expert_down(a, W2)
