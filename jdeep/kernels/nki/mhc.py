"""mHC mixes as an NKI kernel (twin: kernels/reference.py `hc_split_sinkhorn`): sigmoid gates and the
Sinkhorn-normalised n x n combination matrix per token.

Tokens on partitions (128 per tile), the (2+n)·n mixes on the free axis (24 fp32 for n = 4): every step is a
small Vector/Scalar Engine op over [P, n, n] (row sums with tensor_reduce over the last axis, column sums as n - 1
adds of row slices, reciprocals, broadcast multiplies), the Sinkhorn iterations unrolled at trace time
(~10 instructions each). Traffic: T·(2+n)·n·4 bytes in, T·(2n + n²)·4 out: launch- and latency-bound."""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

__all__ = ["hc_sinkhorn_kernel", "hc_split_sinkhorn"]


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
    s = nl.ndarray((P, 3), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=s, src=scale.ap([[0, P], [1, 3]]))            # the three scales on every partition
    b = nl.ndarray((P, W), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=b, src=base.ap([[0, P], [1, W]]))
    for t0 in range(0, T, P):
        p = min(P, T - t0)
        z = nl.ndarray((P, W), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=z[0:p], src=mu[t0:t0 + p, :])
        for k, (c0, c1) in enumerate(((0, n), (n, 2 * n), (2 * n, W))):     # scale_k · mu + base
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
    pre, post, comb = _hc_sinkhorn(mu.reshape(-1, mu.shape[-1]), scale, base, int(n), float(hc_eps),
                                   int(sinkhorn_iters))
    return pre.reshape(lead + (n,)), post.reshape(lead + (n,)), comb.reshape(lead + (n, n))
