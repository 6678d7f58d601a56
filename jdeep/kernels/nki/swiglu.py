"""SwiGLU with DeepSeek's clamp as an NKI kernel (twin: kernels/reference.py `swiglu`).

silu(min(g, limit)) · clamp(u, -limit, limit) in fp32. Tokens on partitions, the intermediate dim on the free axis
in chunks of up to 2048 columns (three fp32 tiles of 8 KiB per partition). Per chunk: two DMAs in, the clamps on the
Vector Engine, silu on the Scalar Engine, one product, one DMA out. Elementwise: HBM-bound, 12 bytes per element.
LNC: the columns are split over the launch's programs, each core taking a contiguous run of F for every token tile,
so both cores move half of the bytes at any T (decode T = 1 included): F = 2048 gives each core 1024 columns."""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

from .launch import launch, program_share

__all__ = ["swiglu_kernel", "swiglu", "swiglu_tile"]

_CHUNK = 2048


def swiglu_tile(dst, g, u, u_out, limit: float) -> None:
    """dst = silu(min(g, limit)) · clamp(u, ±limit) on one tile (fp32 math): g, u SBUF or PSUM tiles, dst and the
    scratch u_out SBUF fp32 tiles of their shape (either may be g / u themselves). Also the MoE GEMMs' epilogue."""
    nisa.tensor_scalar(dst=dst, data=g, op0=nl.minimum, operand0=float(limit))
    nisa.tensor_scalar(dst=u_out, data=u, op0=nl.minimum, operand0=float(limit), op1=nl.maximum,
                       operand1=-float(limit))
    nisa.activation(dst=dst, op=nl.silu, data=dst)
    nisa.tensor_tensor(dst=dst, data1=dst, data2=u_out, op=nl.multiply)


def swiglu_kernel(g, u, limit: float):
    """g, u [T, F] -> fp32 [T, F]."""
    T, F = g.shape
    out = nl.ndarray((T, F), nl.float32, buffer=nl.shared_hbm)
    P = nl.tile_size.pmax
    f_first, f_count = program_share(F)                  # this core's columns
    for t0 in range(0, T, P):
        n = min(P, T - t0)
        for f0 in range(f_first, f_first + f_count, _CHUNK):
            m = min(_CHUNK, f_first + f_count - f0)
            gt = nl.ndarray((P, m), nl.float32, buffer=nl.sbuf)
            ut = nl.ndarray((P, m), nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=gt[0:n], src=g[t0:t0 + n, f0:f0 + m])
            nisa.dma_copy(dst=ut[0:n], src=u[t0:t0 + n, f0:f0 + m])
            swiglu_tile(gt[0:n], gt[0:n], ut[0:n], ut[0:n], limit)
            nisa.dma_copy(dst=out[t0:t0 + n, f0:f0 + m], src=gt[0:n])
    return out


_swiglu = nki.jit(swiglu_kernel)


def swiglu(g, u, limit: float):
    """The JAX op: g, u [..., F] -> fp32 [..., F]."""
    shape = g.shape
    return launch(_swiglu)(g.reshape(-1, shape[-1]), u.reshape(-1, shape[-1]), float(limit)).reshape(shape)
