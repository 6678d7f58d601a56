"""RMSNorm as an NKI kernel (twin: kernels/reference.py `rms_norm`).

Tokens on partitions, 128 rows per tile, the hidden dim on the free axis (fp32 in SBUF: 4·D bytes per partition,
28 KiB at D = 7168). Per tile: one DMA in (cast to fp32), sum of squares on the Scalar Engine (activation with an
add-reduce), rsqrt(mean + eps), a per-row scale and the weight product on the Vector Engine, one DMA out.
HBM traffic per call: T·D·(in + out itemsize) + 4·D per tile for the broadcast weight.
LNC: the tokens are split over the launch's programs, each core taking a contiguous run (in tiles of <= 128) and
loading the weight onto only the partitions it uses: decode batch 8 gives each core 4 rows, a prefill of 130 tokens
65 (a row's statistics need its whole D, so a single token runs on one core)."""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

from .launch import launch, program_share

__all__ = ["rmsnorm_kernel", "rms_norm"]


def rmsnorm_kernel(x, weight, eps: float):
    """x [T, D] (any float dtype), weight [D] -> w ⊙ x / sqrt(mean(x²) + eps) [T, D] in x's dtype."""
    T, D = x.shape
    out = nl.ndarray((T, D), x.dtype, buffer=nl.shared_hbm)
    P = nl.tile_size.pmax
    t_first, t_count = program_share(T)                  # this core's tokens
    lanes = max(1, min(P, t_count))                      # the partitions it uses
    w = nl.ndarray((P, D), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=w[0:lanes], src=weight.ap([[0, lanes], [1, D]]))   # the weight on each partition
    eps_t = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=eps_t, value=float(eps))
    for t0 in range(t_first, t_first + t_count, P):
        n = min(P, t_first + t_count - t0)
        xt = nl.ndarray((P, D), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt[0:n], src=x[t0:t0 + n, :])
        sq = nl.ndarray((P, D), nl.float32, buffer=nl.sbuf)
        ss = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(dst=sq[0:n], op=nl.square, data=xt[0:n], reduce_op=nl.add, reduce_res=ss[0:n])
        nisa.activation(dst=ss[0:n], op=nl.rsqrt, data=ss[0:n], scale=1.0 / D, bias=eps_t[0:n])
        nisa.tensor_scalar(dst=xt[0:n], data=xt[0:n], op0=nl.multiply, operand0=ss[0:n])
        yt = nl.ndarray((P, D), x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=yt[0:n], data1=xt[0:n], data2=w[0:n], op=nl.multiply)
        nisa.dma_copy(dst=out[t0:t0 + n, :], src=yt[0:n])
    return out


_rmsnorm = nki.jit(rmsnorm_kernel)


def rms_norm(x, weight, eps: float):
    """The JAX op (same signature as the reference): x [..., D] -> [..., D] in x's dtype."""
    shape = x.shape
    return launch(_rmsnorm)(x.reshape(-1, shape[-1]), weight, float(eps)).reshape(shape)
