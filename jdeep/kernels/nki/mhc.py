"""mHC (model-spec.md §4.2, §4.6, §5.2) as NKI kernels; twins in kernels/reference.py under the same op names.

`hc_split_sinkhorn` (hc_sinkhorn_kernel): sigmoid gates and the Sinkhorn-normalised n x n combination matrix per
token. Tokens on partitions (128 per tile), the (2+n)·n mixes on the free axis (24 fp32 for n = 4): every step is a
small Vector/Scalar Engine op over [P, n, n] (row sums with tensor_reduce over the last axis, column sums as n - 1
adds of row slices, reciprocals, broadcast multiplies), the Sinkhorn iterations unrolled at trace time
(~10 instructions each). Traffic: T·(2+n)·n·4 bytes in, T·(2n + n²)·4 out: launch- and latency-bound. LNC: the
tokens are split over the launch's programs (contiguous runs, each in tiles of <= 128; decode batch 8: 4 tokens per
core, batch 1: one core works, the other only loads the scales).

`hc_mix_logits` (hc_mix_logits_kernel): mu [T, W] = (x · fnᵀ) · rsqrt(mean(x²) + eps), x = X [T, n·d] as fp32,
fn [W, n·d] fp32 (W = (2+n)n = 24, or n for the head). An fp32 GEMM with K = n·d on partitions: partition p
holds the K/128 consecutive elements k = p·K/128 + j (any assignment of k to partitions gives the same sum), so
both operands load as contiguous runs (x: runs of up to K/128 elements per token; fn: W runs of K/128 fp32 per
partition) instead of element-strided transposing reads. fnᵀ stays in SBUF for the call ([128, W, K/128] fp32:
12 KiB per partition at V4-Flash, 21 KiB at V4-Pro). Per token tile (<= 128 tokens), per chunk of k columns: x
widened to fp32 in SBUF (an fp32 operand needs an fp32 partner), one nc_matmul per k column (stationary xᵀ
[128, tokens], moving fnᵀ [128, W], accumulated in one PSUM tile [tokens, W]), and the squares summed over the
chunk on the free axis. The 128 per-partition sums of squares meet in one more matmul against a ones column
([tokens, 1], tokens on partitions), then rsqrt(· / K + eps) on the Scalar Engine and one per-token scale of the
PSUM tile. Stationary = xᵀ: PE time per k column is ~max(tokens, W) columns either way round (T = 1-8 at decode,
128 per tile at prefill, against W = 24), and [tokens, W] puts the per-token scale on a [P, 1] operand and makes
the store contiguous. Traffic: T·n·d·(2|4) + W·n·d·4 + T·W·4 bytes; fn dominates at decode (1.5 MiB, V4-Flash).
LNC: the larger of the two reads is split over the launch's programs. While x is no larger than fn (T·itemsize <=
4·W: decode, a single token tile; T <= 48 in bf16 at W = 24) the W mixes are: each core loads its rows of fn (12
of 24), reads all of x, computes the (duplicated, cheap) sums of squares and writes its mu columns. Beyond that
the tokens are: each core takes a contiguous run of tokens, in tiles of <= 128, with all of fn.

`hc_collapse` (hc_collapse_kernel): Σ_i pre_i X_i and `hc_expand` (hc_expand_kernel): X'_k = post_k y +
Σ_j comb[j, k] X_j, fp32 accumulation, one rounding to X's dtype. Tokens on partitions (128 per tile; with few
tokens, each token's d columns split over several partitions: kernels/nki/rows.py), [n, d chunk] on the
free axis (chunks of 2048: 16-32 KiB per stream tile). Each sum is a chain of scalar_tensor_tensor multiply-adds
with per-partition [P, 1] fp32 weights (pre_i, comb[j, k], post_k, broadcast to a token's partitions by stride-0
DMAs), in the twins' order (left to right; for expand the mix Σ_j first, post_k y last), the last one writing the
output tile in X's dtype. Traffic (bf16): collapse T·d·(2n + 2), expand T·d·(4n + 2) bytes: HBM- and
latency-bound elementwise work. LNC: the (token, column block) partition-rows are split over the launch's programs
(rows.py; decode batch 1 at d = 4096 bf16: 128 partition-rows of 32 columns, 64 per core; prefill: each core a
contiguous run of tokens), each core writing its own output runs."""

from __future__ import annotations

import jax.numpy as jnp
import nki
import nki.isa as nisa
import nki.language as nl

from .launch import launch, program_share
from .rows import programs, row_views, splits

__all__ = ["hc_sinkhorn_kernel", "hc_split_sinkhorn", "hc_mix_logits_kernel", "hc_mix_logits", "hc_collapse_kernel",
           "hc_collapse", "hc_expand_kernel", "hc_expand"]


def _recip_eps(dst, data, eps: float):
    """dst = 1 / (data + eps)."""
    nisa.tensor_scalar(dst=dst, data=data, op0=nl.add, operand0=eps)
    nisa.reciprocal(dst=dst, data=dst)


def _normalise_cols(c, cs, n: int, eps: float):
    """c [p, n, n] /= (Σ_j c[:, j, :] + eps), in place; cs: a [p, 1, n] scratch tile."""
    nisa.tensor_copy(dst=cs, src=c[:, 0:1, :])
    for j in range(1, n):
        nisa.tensor_tensor(dst=cs, data1=cs, data2=c[:, j:j + 1, :], op=nl.add)
    _recip_eps(cs, cs, eps)
    nisa.tensor_tensor(dst=c, data1=c, data2=cs.broadcast(1, n), op=nl.multiply)


def _normalise_rows(c, rs, n: int, eps: float):
    """c [p, n, n] /= (Σ_k c[:, :, k] + eps), in place; rs: a [p, n, 1] scratch tile."""
    nisa.tensor_reduce(dst=rs, op=nl.add, data=c, axis=2, keepdims=True)
    _recip_eps(rs, rs, eps)
    nisa.tensor_tensor(dst=c, data1=c, data2=rs.broadcast(2, n), op=nl.multiply)


def hc_sinkhorn_kernel(mu, scale, base, n: int, hc_eps: float, sinkhorn_iters: int):
    """mu [T, (2+n)n] fp32, scale [3], base [(2+n)n] -> pre [T, n], post [T, n], comb [T, n·n] (fp32)."""
    T, W = mu.shape
    assert W == (2 + n) * n
    pre_o = nl.ndarray((T, n), nl.float32, buffer=nl.shared_hbm)
    post_o = nl.ndarray((T, n), nl.float32, buffer=nl.shared_hbm)
    comb_o = nl.ndarray((T, n * n), nl.float32, buffer=nl.shared_hbm)
    P = nl.tile_size.pmax
    t_first, t_count = program_share(T)                  # this core's tokens
    lanes = max(1, min(P, t_count))                      # the partitions this core uses
    s = nl.ndarray((P, 3), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=s[0:lanes], src=scale.ap([[0, lanes], [1, 3]]))         # the three scales on every partition
    b = nl.ndarray((P, W), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=b[0:lanes], src=base.ap([[0, lanes], [1, W]]))
    for t0 in range(t_first, t_first + t_count, P):
        p = min(P, t_first + t_count - t0)
        z = nl.ndarray((P, W), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=z[0:p], src=mu[t0:t0 + p, :])
        for k in range(3):                               # scale_k · mu + base over pre, post, comb's columns
            c0 = k * n
            c1 = W if k == 2 else (k + 1) * n
            nisa.scalar_tensor_tensor(dst=z[0:p, c0:c1], data=z[0:p, c0:c1], op0=nl.multiply,
                                      operand0=s[0:p, k:k + 1], op1=nl.add, operand1=b[0:p, c0:c1])
        g = nl.ndarray((P, 2 * n), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=g[0:p], op=nl.sigmoid, data=z[0:p, 0:2 * n])
        nisa.tensor_scalar(dst=g[0:p, 0:n], data=g[0:p, 0:n], op0=nl.add, operand0=hc_eps)        # pre
        nisa.tensor_scalar(dst=g[0:p, n:2 * n], data=g[0:p, n:2 * n], op0=nl.multiply, operand0=2.0)  # post
        c = z[0:p, 2 * n:W].reshape((p, n, n))
        rs = nl.ndarray((P, n, 1), nl.float32, buffer=nl.sbuf)
        cs = nl.ndarray((P, 1, n), nl.float32, buffer=nl.sbuf)
        # softmax over each row, + eps
        nisa.tensor_reduce(dst=rs[0:p], op=nl.maximum, data=c, axis=2, keepdims=True)
        nisa.tensor_tensor(dst=c, data1=c, data2=rs[0:p].broadcast(2, n), op=nl.subtract)
        nisa.activation(dst=c, op=nl.exp, data=c)
        nisa.tensor_reduce(dst=rs[0:p], op=nl.add, data=c, axis=2, keepdims=True)
        nisa.reciprocal(dst=rs[0:p], data=rs[0:p])
        nisa.tensor_tensor(dst=c, data1=c, data2=rs[0:p].broadcast(2, n), op=nl.multiply)
        nisa.tensor_scalar(dst=c, data=c, op0=nl.add, operand0=hc_eps)
        _normalise_cols(c, cs[0:p], n, hc_eps)
        for _ in range(sinkhorn_iters - 1):
            _normalise_rows(c, rs[0:p], n, hc_eps)
            _normalise_cols(c, cs[0:p], n, hc_eps)
        nisa.dma_copy(dst=pre_o[t0:t0 + p, :], src=g[0:p, 0:n])
        nisa.dma_copy(dst=post_o[t0:t0 + p, :], src=g[0:p, n:2 * n])
        nisa.dma_copy(dst=comb_o[t0:t0 + p, :], src=z[0:p, 2 * n:W])
    return pre_o, post_o, comb_o


_hc_sinkhorn = nki.jit(hc_sinkhorn_kernel)


def hc_split_sinkhorn(mu, scale, base, *, n: int, hc_eps: float, sinkhorn_iters: int):
    """The JAX op: mu [..., (2+n)n] -> pre [..., n], post [..., n], comb [..., n, n] (fp32)."""
    lead = mu.shape[:-1]
    pre, post, comb = launch(_hc_sinkhorn)(mu.reshape(-1, mu.shape[-1]), scale, base, int(n), float(hc_eps),
                                   int(sinkhorn_iters))
    return pre.reshape(lead + (n,)), post.reshape(lead + (n,)), comb.reshape(lead + (n, n))


# ------------------------------------------------------------------------------------------------ mix logits
_FREE_X = 4096           # x elements per partition per k chunk (bf16 8 KiB + fp32 widened + squares: 40 KiB)


def hc_mix_logits_kernel(x, fn, norm_eps: float):
    """x [T, K] (any float dtype), fn [W, K] fp32 -> mu [T, W] fp32 = (x · fnᵀ) · rsqrt(mean(x²) + norm_eps)."""
    T, K = x.shape
    W, K2 = fn.shape
    assert K == K2 and W <= nl.tile_size.gemm_moving_fmax
    out = nl.ndarray((T, W), nl.float32, buffer=nl.shared_hbm)
    P = nl.tile_size.pmax
    KT, kr = K // P, K % P               # k columns per partition; a rest of kr < 128 elements (k >= P·KT)
    assert KT * W <= 16384, "fnᵀ is kept in SBUF: at most 64 KiB per partition"
    itemsize = 4 if x.dtype == nl.float32 else 2
    if W > 1 and T * itemsize <= 4 * W:  # x no larger than fn (decode): each core reads half of fn, all of x
        w0, nw = program_share(W)
        t_first, t_count = 0, T
    else:                                # prefill: each core takes its tokens, all of fn
        w0, nw = 0, W
        t_first, t_count = program_share(T)
    if KT:
        fn_t = nl.ndarray((P, nw, KT), nl.float32, buffer=nl.sbuf)     # fn_t[p, w, j] = fn[w0 + w, p·KT + j]
        nisa.dma_copy(dst=fn_t, src=fn.ap([[KT, P], [K, nw], [1, KT]], offset=w0 * K))
    if kr:
        fn_r = nl.ndarray((kr, nw), nl.float32, buffer=nl.sbuf)        # fn_r[p, w] = fn[w0 + w, P·KT + p]
        nisa.dma_copy(dst=fn_r, src=fn.ap([[1, kr], [K, nw]], offset=w0 * K + P * KT))
    ones = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    eps_t = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=eps_t, value=float(norm_eps))
    ps = nl.ndarray((P, nw), nl.float32, buffer=nl.psum)              # x · fnᵀ, accumulated over k
    pss = nl.ndarray((P, 1), nl.float32, buffer=nl.psum)              # Σ x² over partitions
    for t0 in range(t_first, t_first + t_count, P):
        p = min(P, t_first + t_count - t0)
        ss = nl.ndarray((P, p), nl.float32, buffer=nl.sbuf)           # per-partition sums of squares
        nisa.memset(dst=ss, value=0.0)
        kc = max(1, min(KT, _FREE_X // p))
        chunks = []                                                    # (first k column, columns); -1: the rest
        for j0 in range(0, KT, kc):
            chunks.append((j0, min(kc, KT - j0)))
        if kr:
            chunks.append((-1, 1))
        done = 0                                                       # k columns in ps so far
        for j0, nj in chunks:
            kk = P if j0 >= 0 else kr
            xr = nl.ndarray((kk, p, nj), x.dtype, buffer=nl.sbuf)       # xr[q, t, j] = x[t0 + t, q·KT + j0 + j]
            if j0 >= 0:
                nisa.dma_copy(dst=xr, src=x.ap([[KT, P], [K, p], [1, nj]], offset=t0 * K + j0))
            else:
                nisa.dma_copy(dst=xr, src=x.ap([[1, kr], [K, p], [1, 1]], offset=t0 * K + P * KT))
            x32 = xr
            if x.dtype != nl.float32:       # fn is fp32: the PE array needs an fp32 partner
                x32 = nl.ndarray((kk, p, nj), nl.float32, buffer=nl.sbuf)
                nisa.tensor_copy(dst=x32, src=xr)
            for j in range(nj):
                moving = fn_t[:, :, j0 + j] if j0 >= 0 else fn_r
                nisa.nc_matmul(dst=ps[0:p], stationary=x32[:, :, j], moving=moving, accumulate=done > 0)
                done += 1
            sq = nl.ndarray((kk, p, nj), nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=sq, data1=x32, data2=x32, op=nl.multiply)
            part = nl.ndarray((kk, p), nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=part, op=nl.add, data=sq, axis=2)
            nisa.tensor_tensor(dst=ss[0:kk], data1=ss[0:kk], data2=part, op=nl.add)
        nisa.nc_matmul(dst=pss[0:p], stationary=ss, moving=ones, accumulate=False)    # [tokens, 1]
        r = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=r[0:p], op=nl.rsqrt, data=pss[0:p], scale=1.0 / K, bias=eps_t[0:p])
        mu = nl.ndarray((P, nw), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=mu[0:p], data=ps[0:p], op0=nl.multiply, operand0=r[0:p])
        nisa.dma_copy(dst=out[t0:t0 + p, w0:w0 + nw], src=mu[0:p])
    return out


_hc_mix_logits = nki.jit(hc_mix_logits_kernel)


def hc_mix_logits(X, fn, norm_eps: float):
    """The JAX op: X [..., n, d], fn [W, n·d] fp32 -> mu [..., W] fp32."""
    lead, (n, d) = X.shape[:-2], X.shape[-2:]
    return launch(_hc_mix_logits)(X.reshape(-1, n * d), fn, float(norm_eps)).reshape(lead + (fn.shape[0],))


# ------------------------------------------------------------------------------------------ collapse / expand
_CHUNK = 2048            # d columns per tile


def _weighted_sum(dst, xs: list, ws: list, acc):
    """dst = Σ_i ws[i] · xs[i], left to right in fp32: xs [p, c] tiles, ws their [p, 1] fp32 weights; acc an fp32
    [p, c] scratch; the last multiply-add writes dst (cast to its dtype)."""
    last = len(xs) - 1
    nisa.tensor_scalar(dst=acc if last > 0 else dst, data=xs[0], op0=nl.multiply, operand0=ws[0])
    for i in range(1, last + 1):
        nisa.scalar_tensor_tensor(dst=dst if i == last else acc, data=xs[i], op0=nl.multiply, operand0=ws[i],
                                  op1=nl.add, operand1=acc)


def _load_weights(src, q0: int, nq: int, s: int, width: int):
    """Per-token fp32 weights src [T, width] -> [P, width] for partition-rows q0 .. q0+nq-1: each token's row on
    its partitions."""
    wt = nl.ndarray((nl.tile_size.pmax, width), nl.float32, buffer=nl.sbuf)
    for r, k, view in row_views(src, q0, nq, s, width, 0, [], 0, width):
        nisa.dma_copy(dst=wt[r:r + k], src=view)
    return wt


def hc_collapse_kernel(x, pre):
    """x [T, n, d] (any float dtype), pre fp32 [T, n] -> Σ_i pre_i x_i [T, d] in x's dtype (fp32 accumulation)."""
    T, n, d = x.shape
    out = nl.ndarray((T, d), x.dtype, buffer=nl.shared_hbm)
    P = nl.tile_size.pmax
    s = splits(T, d, 4 if x.dtype == nl.float32 else 2, P * programs())
    db = d // s                                         # columns per partition-row
    q_first, q_count = program_share(T * s)             # this core's partition-rows (token t, block b) = t·s + b
    for q0 in range(q_first, q_first + q_count, P):
        rows = min(P, q_first + q_count - q0)
        pr = _load_weights(pre, q0, rows, s, n)
        for c0 in range(0, db, _CHUNK):
            w = min(_CHUNK, db - c0)
            xt = nl.ndarray((P, n, w), x.dtype, buffer=nl.sbuf)
            for r, k, view in row_views(x, q0, rows, s, n * d, db, [[d, n]], c0, w):
                nisa.dma_copy(dst=xt[r:r + k], src=view)
            acc = nl.ndarray((P, w), nl.float32, buffer=nl.sbuf)
            yt = nl.ndarray((P, w), x.dtype, buffer=nl.sbuf)
            xs = []
            ws = []
            for i in range(n):
                xs.append(xt[0:rows, i, :])
                ws.append(pr[0:rows, i:i + 1])
            _weighted_sum(yt[0:rows], xs, ws, acc[0:rows])
            for r, k, view in row_views(out, q0, rows, 1, db, db, [], c0, w):    # rows of db: contiguous
                nisa.dma_copy(dst=view, src=yt[r:r + k])
    return out


def hc_expand_kernel(y, post, comb, x):
    """y [T, d], post fp32 [T, n], comb fp32 [T, n·n] (row-major comb[j, k]), x [T, n, d] ->
    X' [T, n, d] in x's dtype: X'_k = post_k · y + Σ_j comb[j, k] · x_j (fp32)."""
    T, n, d = x.shape
    out = nl.ndarray((T, n, d), x.dtype, buffer=nl.shared_hbm)
    P = nl.tile_size.pmax
    s = splits(T, d, 4 if x.dtype == nl.float32 else 2, P * programs())
    db = d // s
    q_first, q_count = program_share(T * s)
    for q0 in range(q_first, q_first + q_count, P):
        rows = min(P, q_first + q_count - q0)
        po = _load_weights(post, q0, rows, s, n)
        cb = _load_weights(comb, q0, rows, s, n * n)
        for c0 in range(0, db, _CHUNK):
            w = min(_CHUNK, db - c0)
            xt = nl.ndarray((P, n, w), x.dtype, buffer=nl.sbuf)
            for r, k, view in row_views(x, q0, rows, s, n * d, db, [[d, n]], c0, w):
                nisa.dma_copy(dst=xt[r:r + k], src=view)
            yt = nl.ndarray((P, w), y.dtype, buffer=nl.sbuf)
            for r, k, view in row_views(y, q0, rows, s, d, db, [], c0, w):
                nisa.dma_copy(dst=yt[r:r + k], src=view)
            acc = nl.ndarray((P, w), nl.float32, buffer=nl.sbuf)
            ot = nl.ndarray((P, n, w), x.dtype, buffer=nl.sbuf)
            for k_ in range(n):
                xs = []
                ws = []
                for j in range(n):
                    xs.append(xt[0:rows, j, :])
                    ws.append(cb[0:rows, j * n + k_:j * n + k_ + 1])
                xs.append(yt[0:rows])
                ws.append(po[0:rows, k_:k_ + 1])
                _weighted_sum(ot[0:rows, k_, :], xs, ws, acc[0:rows])
            for r, k, view in row_views(out, q0, rows, s, n * d, db, [[d, n]], c0, w):
                nisa.dma_copy(dst=view, src=ot[r:r + k])
    return out


_hc_collapse = nki.jit(hc_collapse_kernel)
_hc_expand = nki.jit(hc_expand_kernel)


def _like(a, shape):
    """a broadcast to `shape` (the twins broadcast their per-token operands; the kernels take one row per token)."""
    if tuple(a.shape) == tuple(shape):
        return a
    return jnp.broadcast_to(a, shape)


def hc_collapse(X, pre):
    """The JAX op: X [..., n, d], pre fp32 [..., n] -> [..., d] in X's dtype."""
    lead, (n, d) = X.shape[:-2], X.shape[-2:]
    pre = _like(pre, lead + (n,))
    return launch(_hc_collapse)(X.reshape(-1, n, d), pre.reshape(-1, n)).reshape(lead + (d,))


def hc_expand(y, post, comb, X):
    """The JAX op: y [..., d], post [..., n], comb [..., n, n] (fp32), X [..., n, d] -> [..., n, d] in X's dtype."""
    lead, (n, d) = X.shape[:-2], X.shape[-2:]
    y, post, comb = _like(y, lead + (d,)), _like(post, lead + (n,)), _like(comb, lead + (n, n))
    out = launch(_hc_expand)(y.reshape(-1, d), post.reshape(-1, n), comb.reshape(-1, n * n), X.reshape(-1, n, d))
    return out.reshape(lead + (n, d))
