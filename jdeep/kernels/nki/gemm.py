"""Block-quantized fp8 GEMM as an NKI kernel (twin: kernels/reference.py `fp8_linear`).

y [T, N] = x [T, K] · Wᵀ with W given as trn2 e4m3 codes (uint8 [N, K], the checkpoint's layout, rescaled to
|w| <= 240 at load) and ue8m0 scales per (bn x bk) block (uint8 [ceil(N/bn), ceil(K/bk)]).

Tiling (PE array: contraction on partitions, stationary free <= 128, moving free <= 512):
- stationary = xᵀ tile [bk, <=128 tokens] (bf16/fp32 as given), moving = Wᵀ tile [bk, <=512 outputs] read straight
  from the uint8 codes and reinterpreted as float8_e4m3 in SBUF: with bf16 activations the weights are never decoded
  or widened, so a decode-shape call reads each weight byte once (HBM-bound: N·K bytes + scales). fp32 activations
  need an fp32 partner on the PE array: the tile is widened on the Vector Engine first (exact, slower).
- one nc_matmul per (k block, 512-column tile) overwriting one of two PSUM tiles (fp32, used in turn), evacuated
  with the block's power-of-two scale and added into an fp32 SBUF accumulator by one scalar_tensor_tensor per n
  block: (psum · s) + acc. This is DeepSeek's own order (per-block fp32 partial sums times the block scale).
- the ue8m0 scales are decoded in-kernel by integer ops: (uint8 byte as int32) << 23 is the float32 bit pattern of
  2^(b-127), reinterpreted (exact for b in 1..254; b = 0 gives 0 instead of 2^-127).
The Wᵀ tile is a transposing access pattern over W's rows (K contiguous per row): a strided DMA; storing the codes
transposed at load would make it contiguous (noted in docs/kernels.md).
LNC: the output columns are split over the launch's programs in whole n blocks (bn columns: the scale granularity),
each core taking a contiguous run of blocks, tiled in 512 columns, for every token tile. Decode is weight-read-bound,
so each core reads half of W (and of the scales) and all of x: a [1024, 4096] projection with 128-blocks gives each
core one 512-column tile; 640 columns, 3 and 2 blocks."""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

from .launch import launch, program_share

__all__ = ["fp8_linear_kernel", "fp8_linear"]


def fp8_linear_kernel(x, codes, scale, bn: int, bk: int):
    """x [T, K] float, codes uint8 [N, K], scale uint8 [ceil(N/bn), ceil(K/bk)] -> y [T, N] in x's dtype."""
    T, K = x.shape
    N, K2 = codes.shape
    NB, KB = scale.shape
    assert K == K2 and NB == -(-N // bn) and KB == -(-K // bk) and bk <= 128 and 512 % bn == 0
    out = nl.ndarray((T, N), x.dtype, buffer=nl.shared_hbm)
    P, NT = nl.tile_size.pmax, nl.tile_size.gemm_moving_fmax
    b_first, b_count = program_share(NB)                # this core's n blocks
    n_lo = b_first * bn
    n_hi = min(N, (b_first + b_count) * bn)
    # two PSUM tiles in turn: the PE array fills one while the Vector Engine evacuates the other
    ps_pair = [nl.ndarray((P, NT), nl.float32, buffer=nl.psum), nl.ndarray((P, NT), nl.float32, buffer=nl.psum)]
    for t0 in range(0, T, P):
        n_tok = min(P, T - t0)
        for n0 in range(n_lo, n_hi, NT):
            nn = min(NT, n_hi - n0)
            nb0, nnb = n0 // bn, -(-nn // bn)
            # this tile's block scales on every token partition: [n_tok, nnb, KB] bytes -> float32
            s8 = nl.ndarray((P, nnb, KB), nl.uint8, buffer=nl.sbuf)
            nisa.dma_copy(dst=s8[0:n_tok], src=scale.ap([[0, n_tok], [KB, nnb], [1, KB]], offset=nb0 * KB))
            s32 = nl.ndarray((P, nnb, KB), nl.int32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=s32[0:n_tok], src=s8[0:n_tok])
            nisa.tensor_scalar(dst=s32[0:n_tok], data=s32[0:n_tok], op0=nl.left_shift, operand0=23)
            s = s32.view(nl.float32)
            acc = nl.ndarray((P, nn), nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=acc[0:n_tok], value=0.0)
            for kb in range(KB):
                k0 = kb * bk
                kk = min(bk, K - k0)
                xt = nl.ndarray((kk, P), x.dtype, buffer=nl.sbuf)              # xᵀ: K on partitions
                nisa.dma_copy(dst=xt[:, 0:n_tok], src=x.ap([[1, kk], [K, n_tok]], offset=t0 * K + k0))
                w8 = nl.ndarray((kk, nn), nl.uint8, buffer=nl.sbuf)            # Wᵀ codes: K on partitions
                nisa.dma_copy(dst=w8, src=codes.ap([[1, kk], [K, nn]], offset=n0 * K + k0))
                moving = w8.view(nl.float8_e4m3)
                if x.dtype == nl.float32:       # fp32 needs an fp32 partner: widen the codes (exact)
                    moving = nl.ndarray((kk, nn), nl.float32, buffer=nl.sbuf)
                    nisa.tensor_copy(dst=moving, src=w8.view(nl.float8_e4m3))
                ps = ps_pair[kb % 2][:, 0:nn]
                nisa.nc_matmul(dst=ps[0:n_tok], stationary=xt[:, 0:n_tok], moving=moving, accumulate=False)
                for j in range(nnb):
                    c0, c1 = j * bn, min((j + 1) * bn, nn)
                    nisa.scalar_tensor_tensor(dst=acc[0:n_tok, c0:c1], data=ps[0:n_tok, c0:c1], op0=nl.multiply,
                                              operand0=s[0:n_tok, j, kb:kb + 1], op1=nl.add,
                                              operand1=acc[0:n_tok, c0:c1])
            y = nl.ndarray((P, nn), x.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=y[0:n_tok], src=acc[0:n_tok])
            nisa.dma_copy(dst=out[t0:t0 + n_tok, n0:n0 + nn], src=y[0:n_tok])
    return out


_fp8_linear = nki.jit(fp8_linear_kernel)


def fp8_linear(x, codes, scale, block, trn2: bool = True):
    """The JAX op (the reference's signature): x [..., K] -> [..., N] in x's dtype. Needs trn2 codes (|w| <= 240,
    as jdeep.load writes them for Neuron): the kernel feeds them to the PE array as float8_e4m3."""
    if not trn2:
        raise ValueError("the NKI fp8 GEMM reads trn2 e4m3 codes: load the checkpoint with fp8_max=240")
    shape = x.shape
    y = launch(_fp8_linear)(x.reshape(-1, shape[-1]), codes, scale, int(block[0]), int(block[1]))
    return y.reshape(shape[:-1] + (codes.shape[0],))
