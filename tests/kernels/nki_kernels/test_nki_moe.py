"""The MoE expert GEMM kernels (jdeep/kernels/nki/moe.py) under nki.simulate against their jnp twins, and the four
NKI MoE ops against the reference ops (kernels/reference.py) on the same routing. Kernels run at trn2's LNC=2
(nki_testing.run): row tiles split over the two programs, left-over tiles split by output columns (one 1-row case
checks LNC=2 against LNC=1 and the split itself is checked per program).

Shapes: the tiny checkpoints' (d = 128, I = 64, E = 8, k = 2) and the released models' tile patterns kept cheap
(V4-Flash d = 4096 x I = 2048 fp4 on 2 experts, whose decode must keep every 32-bit lane exact in fp32: the emulation
refuses one that is not; the V4.1 shared expert d = 5120 x I = 2304 with 32 x 32 fp8 blocks: a partial 512-column
slab), partial 128-partition k and n tiles, full and partial 128-row tiles.

Tolerances (u = 2⁻²⁴; "exact" = float64 from the decoded weights, whose products are exact in float64; A = ACT_REL,
the Scalar Engine's activation error bound, nki_testing):
- every GEMM sum of K products in fp32 (the PE array's fp32 PSUM accumulation, the block-scale multiply by a power of
  two, the fp32 block and chunk sums; an fp32 x fp32 product rounds once more), in any order, is within
  γ = K·u·Σ|x||w| of the exact one; the kernel and the twin (XLA's dot) each meet it, so they agree to 2γ (kernel B,
  given the same input `a`: the down GEMM's bound exactly);
- kernel A's output a = silu(min(h1, L)) · clamp(h3, ±L) · w: h1, h3 within γ₁, γ₃ of exact and the clamps
  1-Lipschitz; silu is 1.1-Lipschitz and the Scalar Engine's silu is within A of the exact silu of its input (plus
  2⁻²¹ for an fp32 evaluation, the twin's), so s = silu(g) is off by at most Δs = 1.1γ₁ + (A + 2⁻²¹)(|s| + 1.1γ₁) and
  u by Δu = γ₃; the product s·u·w, two fp32 roundings (<= 2⁻²² relative together), is then within
  δ = |w|(|u|Δs + (|s| + Δs)Δu + 2⁻²²(|s| + Δs)(|u| + Δu)) of the exact a for kernel and twin, which agree to 2δ;
- the ops chain A, the cast of `a` to the activation dtype, DeepSeek's fp8 act-quant of `a` and B. The cast and the
  act-quant can flip a value at a rounding tie when the two fp32 `a` differ in their last bits, so the test does
  not assume identical quantized inputs: from the exact a ± δ (A included) it derives the interval each quantized
  element can land in (bf16 rounding of both ends; act-quant of both ends under the block scales of both amax
  envelopes). After a cast it is one value except within δ of a rounding boundary (fp32 without act-quant: width
  2δ); its width, through |W2|, plus both down GEMMs' γ and the fp32 sum over a token's k slots (k·u·Σ|y|), bounds
  |op - reference|. These are worst-case sums of |terms| (observed differences sit well inside); the test asserts
  the bound's median stays below 1 % of |y|, far below what a wrong expert, routing weight, k order or scale would
  cause (O(|y|)), so it is not vacuous.
The ops are JAX functions around the kernels; to run them with numbers on CPU the test swaps the `nki.jit` kernels
for stand-ins whose `[lnc]` launch runs the body under `nki.simulate` behind jax.pure_callback (the real path lowers
to NKI custom calls, checked here by tracing)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import nki
import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

from jdeep.kernels import codecs, reference
from jdeep.kernels.nki import moe, moe_tiles
from jdeep.kernels.quant import dequant_fp4, dequant_fp8
from jdeep.numerics import Numerics
from jdeep.platforms import logical_nc_config
from nki_testing import ACT_REL, LNC, run

BF16 = ml_dtypes.bfloat16
U = 2.0 ** -24
LIMIT = 10.0


# ---------------------------------------------------------------------------------------------- weights
def _trn2_codes(rng, shape) -> np.ndarray:
    """Random e4m3 codes trn2 reads as finite numbers (exponent field < 15: |w| <= 240)."""
    c = rng.integers(0, 256, size=shape).astype(np.uint8)
    return np.where((c & 0x78) == 0x78, c & 0xF7, c).astype(np.uint8)


def _decode(fmt: str, values: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    """Quantized weights [..., N, K] as float64, with the codecs the reference's dequant uses (numpy here)."""
    if fmt == "fp4":                 # the codec on the 16 codes, then a table look-up (the V4 shapes' 50M codes)
        w = np.asarray(codecs.e2m1_decode(np, np.arange(16)), np.float64)[codecs.unpack_e2m1(np, values)]
        return w * np.repeat(codecs.ue8m0_decode(np, scale), 32, axis=-1)
    s = np.repeat(np.repeat(codecs.ue8m0_decode(np, scale), block[0], axis=-2), block[1], axis=-1)
    return codecs.e4m3_decode(np, values, trn2=True).astype(np.float64) * s[..., :values.shape[-2], :values.shape[-1]]


def _stack(rng, fmt: str, RE: int, N: int, K: int, block=(32, 32), dtype=np.float32):
    """A random weight stack [RE, N, K] as the kernels take it -> (values, scale or None, decoded float64)."""
    if fmt == "float":
        w = (rng.normal(size=(RE, N, K)) * 0.1).astype(dtype)
        return w, None, w.astype(np.float64)
    if fmt == "fp4":
        values = rng.integers(0, 256, size=(RE, N, K // 2)).astype(np.uint8)
        scale = rng.integers(119, 125, size=(RE, N, K // 32)).astype(np.uint8)
    else:
        values = _trn2_codes(rng, (RE, N, K))
        scale = rng.integers(112, 118, size=(RE, -(-N // block[0]), -(-K // block[1]))).astype(np.uint8)
    return values, scale, _decode(fmt, values, scale, block)


def test_decode_matches_the_reference_dequant():
    rng = np.random.default_rng(3)
    for fmt, block, deq in (("fp4", (1, 32), jax.jit(lambda v, s: dequant_fp4(v, s, jnp.float32))),
                            ("fp8", (32, 32), jax.jit(lambda v, s: dequant_fp8(v, s, (32, 32), jnp.float32, True)))):
        v, s, dec = _stack(rng, fmt, 2, 64, 128, block)
        np.testing.assert_array_equal(np.asarray(deq(jnp.asarray(v), jnp.asarray(s))), dec)


def _mm(x, W):
    """x [..., K] · W [..., N, K]ᵀ -> [..., N] (W one matrix, or one per leading row)."""
    return (W @ x[..., None])[..., 0]


def _gamma(x64: np.ndarray, W64: np.ndarray) -> np.ndarray:
    """The fp32 K-term sum bound of x · Wᵀ."""
    return x64.shape[-1] * U * _mm(np.abs(x64), np.abs(W64))


def _silu(g):
    return g / (1 + np.exp(-g))


def _gate_up_exact(x64, W1, W3, w, limit=LIMIT):
    """Exact a [M, I] of rows x64 [M, d] with routing weights w [M] and its bound δ (module docstring)."""
    h1, h3 = _mm(x64, W1), _mm(x64, W3)
    g, u = np.minimum(h1, limit), np.clip(h3, -limit, limit)
    s = _silu(g)
    a = s * u * w[:, None]
    s_abs, u_abs = np.abs(s), np.abs(u)
    g1 = 1.1 * _gamma(x64, W1)
    d_s = g1 + (ACT_REL + 2.0 ** -21) * (s_abs + g1)
    d_u = _gamma(x64, W3)
    delta = np.abs(w)[:, None] * (u_abs * d_s + (s_abs + d_s) * d_u + 2.0 ** -22 * (s_abs + d_s) * (u_abs + d_u))
    return a, delta


def _run(body, *args, lnc=LNC):
    with np.errstate(over="ignore"):        # a simulator's silu may overflow exp(-g) to inf for g << 0 (silu -> -0)
        return run(body, *args, lnc=lnc)


# ---------------------------------------------------------------------------------------------- fp4 decode
def _decode_kernel(pk, scale):
    """The kernel's fp4 decode of packed bytes pk [1, N, 64] (K = 128): the slab's codes [128 k, N] as bytes, each
    program decoding its 128-column tiles."""
    N = pk.shape[1]
    s = moe_tiles.Stack(pk, scale, "fp4", (1, 32), nl.bfloat16)
    reg = nisa.register_alloc(0)
    first, count = moe.program_share(N // 128)
    out = nl.ndarray((128, N), nl.uint8, buffer=nl.shared_hbm)
    slab = moe_tiles.load_slab(pk, reg, first * 128, count * 128, s, moe_tiles.fp4_lanes())
    nisa.dma_copy(dst=out[:, first * 128:(first + count) * 128], src=slab.view(nl.uint8)[:, 0, :])
    return out


def test_fp4_nibble_trick_on_all_codes():
    """The e2m1 -> e4m3 byte map is exact for all 16 codes (value · 2⁻⁶), and the kernel's in-SBUF decode (on uint16
    lanes of 2 bytes, at a slab offset on program 1) of all 256 packed bytes, in both bytes of a lane, puts each
    nibble's code on its partition: 32j + 16h + q holds k = 32j + 2q + h."""
    c = np.arange(16)
    byte = (((c & 7) << 2) | ((c & 8) << 4)).astype(np.uint8)
    np.testing.assert_array_equal(byte.view(ml_dtypes.float8_e4m3).astype(np.float64),
                                  np.asarray(codecs.e2m1_decode(np, c), np.float64) * 2.0 ** -6)
    N, K = 256, 128
    packed = ((np.arange(N)[:, None] * 3 + np.arange(K // 2)[None, :] * 37) % 256).astype(np.uint8)[None]
    for lane_byte in (0, 1):                       # even n: a lane's low byte, odd n: its high byte
        assert len(np.unique(packed[0, lane_byte::2])) == 256
    got = _run(_decode_kernel, packed, np.zeros((1, N, K // 32), np.uint8))      # [partition, n]
    p = np.arange(128)
    k = 32 * (p // 32) + 2 * (p % 16) + (p % 32) // 16
    nib = np.where(k % 2 == 0, packed[0][:, k // 2] & 15, packed[0][:, k // 2] >> 4).T
    np.testing.assert_array_equal(got, byte[nib])


def _share_kernel(n_tiles: int, n_cols: int):
    """Each program's moe._share(n_tiles, n_cols), int32 [programs, 5], row = program id."""
    programs = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    out = nl.ndarray((programs, 5), nl.int32, buffer=nl.shared_hbm)
    share = moe._share(n_tiles, n_cols)
    t = nl.ndarray((1, 5), nl.int32, buffer=nl.sbuf)
    for i in range(5):
        nisa.memset(dst=t[0:1, i:i + 1], value=share[i])
    nisa.dma_copy(dst=out[pid:pid + 1, :], src=t)
    return out


@pytest.mark.parametrize("n_tiles,n_cols", [(1, 2048), (1, 5120), (3, 2304), (6, 4096), (2, 64), (1, 64)])
def test_share_gives_each_output_one_writer(n_tiles, n_cols):
    """The split of a launch's work: every (row tile, 128-column tile) has exactly one program; at decode shapes
    (the shared expert's one tile, an odd gather count, V4 / V4.1 widths) every program reads weights."""
    got = _run(_share_kernel, n_tiles, n_cols)
    cols = -(-n_cols // 128)
    writers = np.zeros((n_tiles, cols), np.int64)
    work = []
    for first, count, split, c_lo, c_hi in got:
        assert split == n_tiles - n_tiles % LNC and c_lo % 128 == 0
        writers[first:first + count] += 1
        writers[split:, c_lo // 128:-(-c_hi // 128)] += 1
        work.append(count * cols + (n_tiles - split) * max(0, -(-c_hi // 128) - c_lo // 128))
    np.testing.assert_array_equal(writers, 1)
    if cols >= LNC:
        assert min(work) > 0 and max(work) - min(work) <= n_tiles, work


# ---------------------------------------------------------------------------------------------- kernels
_twin_gate_up = jax.jit(reference.expert_gate_up, static_argnums=3)
_twin_down = jax.jit(reference.expert_down)
GATE_UP = [   # fmt, block, dtype, RE, d, I, N rows, rows per tile
    ("fp4", (1, 32), np.float32, 16, 128, 64, 5, 2),        # tiny checkpoints (R=2 x E=8), pairs of rows
    ("fp4", (1, 32), BF16, 3, 192, 192, 130, 128),          # partial k tile (2 blocks), partial n tile, 128 + 2 rows
    ("fp8", (128, 128), BF16, 3, 256, 640, 3, 1),           # V4 128-blocks, a 512 + 128 column split
    ("fp8", (32, 32), np.float32, 4, 128, 64, 4, 2),
    ("float", None, np.float32, 4, 128, 64, 4, 2),
    ("float", None, BF16, 4, 192, 192, 3, 3),
    ("fp4", (1, 32), BF16, 2, 4096, 2048, 2, 2),            # V4-Flash routed experts: 2 rows of expert 0 or 1 (no
                                                            # decode lane fp32 cannot hold: the emulation checks)
    ("fp8", (32, 32), BF16, 1, 5120, 2304, 2, 2),           # V4.1 shared expert: partial 512-column slab
]


def _ids(param):
    return "-".join(str(v if not isinstance(v, type) else np.dtype(v).name) for v in param)


@pytest.mark.parametrize("fmt,block,dtype,RE,d,I,N,rows", GATE_UP, ids=[_ids(p) for p in GATE_UP])
def test_gate_up_kernel(fmt, block, dtype, RE, d, I, N, rows):
    rng = np.random.default_rng(d + I + N)
    x = (rng.normal(size=(N, d)) * 4).astype(dtype)
    wt = rng.uniform(0.1, 1.5, size=N).astype(np.float32)
    tiles = rng.integers(0, RE, size=-(-N // rows)).astype(np.int32)
    (w1, s1, W1), (w3, s3, W3) = (_stack(rng, fmt, RE, I, d, block, dtype) for _ in range(2))
    got = _run(moe.expert_gate_up_kernel, x, wt, tiles, w1, s1, w3, s3, LIMIT, rows, fmt, block)
    assert got.shape == (N, I) and got.dtype == np.float32
    x64 = x.astype(np.float64)
    for t, e in enumerate(tiles):
        r = slice(t * rows, (t + 1) * rows)
        Wt1, Wt3 = (jnp.asarray(W[e], jnp.dtype(dtype)) for W in (W1, W3))       # the reference's decoded weights
        want = np.asarray(_twin_gate_up(jnp.asarray(x[r]), Wt1, Wt3, LIMIT, jnp.asarray(wt[r])[:, None]))
        exact, delta = _gate_up_exact(x64[r], W1[e], W3[e], wt[r].astype(np.float64))
        assert (np.abs(got[r] - exact) <= delta).all(), np.max(np.abs(got[r] - exact) / (delta + 1e-30))
        assert (np.abs(want - exact) <= delta).all()
        assert (np.abs(got[r] - want) <= 2 * delta).all()
    assert any((np.abs(x64 @ W1[e].T) > LIMIT).any() for e in tiles)          # the clamps are exercised


DOWN = [   # fmt, block, dtype, RE, I, d, N rows, rows per tile
    ("fp4", (1, 32), np.float32, 16, 64, 128, 5, 2),        # K = 64: a partial k tile
    ("fp4", (1, 32), BF16, 3, 192, 192, 130, 128),
    ("fp8", (128, 128), BF16, 3, 256, 640, 3, 1),
    ("fp8", (32, 32), np.float32, 4, 64, 128, 4, 2),
    ("float", None, np.float32, 4, 64, 128, 4, 2),
    ("float", None, BF16, 4, 192, 192, 3, 3),
    ("fp4", (1, 32), BF16, 2, 2048, 4096, 2, 2),            # V4-Flash w2
    ("fp8", (32, 32), BF16, 1, 2304, 5120, 2, 2),           # V4.1 shared w2: K = 2304 (18 k tiles), N = 5120
]


@pytest.mark.parametrize("fmt,block,dtype,RE,I,d,N,rows", DOWN, ids=[_ids(p) for p in DOWN])
def test_down_kernel(fmt, block, dtype, RE, I, d, N, rows):
    rng = np.random.default_rng(d + I + N + 1)
    a = (rng.normal(size=(N, I)) * 4).astype(dtype)
    tiles = rng.integers(0, RE, size=-(-N // rows)).astype(np.int32)
    w2, s2, W2 = _stack(rng, fmt, RE, d, I, block, dtype)
    got = _run(moe.expert_down_kernel, a, tiles, w2, s2, rows, fmt, block)
    assert got.shape == (N, d) and got.dtype == np.float32
    a64 = a.astype(np.float64)
    for t, e in enumerate(tiles):
        r = slice(t * rows, (t + 1) * rows)
        want = np.asarray(_twin_down(jnp.asarray(a[r]), jnp.asarray(W2[e], jnp.dtype(dtype))))
        exact, gamma = a64[r] @ W2[e].T, _gamma(a64[r], W2[e])
        assert (np.abs(got[r] - exact) <= gamma).all(), np.max(np.abs(got[r] - exact) / (gamma + 1e-30))
        assert (np.abs(want - exact) <= gamma).all()
        assert (np.abs(got[r] - want) <= 2 * gamma).all()


def test_shared_expert_decode_tile_runs_on_both_cores():
    """The shared expert at decode: one row tile of one row, V4's 128 x 128 fp8 blocks. At LNC=2 the output columns
    are split (gate-up: I = 384, 2 + 1 column tiles; down: d = 512, 2 + 2), every element written once (the
    simulation refuses a second writer and an unwritten element), and the result is LNC=1's bit for bit: each
    output tile is computed by the same instructions on either core."""
    rng = np.random.default_rng(11)
    d, I, block = 512, 384, (128, 128)
    x = (rng.normal(size=(1, d)) * 4).astype(BF16)
    (w1, s1, W1), (w3, s3, W3), (w2, s2, W2) = (_stack(rng, "fp8", 1, N, K, block, BF16)
                                                 for N, K in ((I, d), (I, d), (d, I)))
    one, zero = np.ones(1, np.float32), np.zeros(1, np.int32)
    a = {lnc: _run(moe.expert_gate_up_kernel, x, one, zero, w1, s1, w3, s3, LIMIT, 1, "fp8", block, lnc=lnc)
         for lnc in (LNC, 1)}
    np.testing.assert_array_equal(a[LNC], a[1])
    exact, delta = _gate_up_exact(x.astype(np.float64), W1[0], W3[0], np.ones(1))
    assert (np.abs(a[LNC] - exact) <= delta).all()
    ab = a[LNC].astype(BF16)
    y = {lnc: _run(moe.expert_down_kernel, ab, zero, w2, s2, 1, "fp8", block, lnc=lnc) for lnc in (LNC, 1)}
    np.testing.assert_array_equal(y[LNC], y[1])
    a64 = ab.astype(np.float64)
    assert (np.abs(y[LNC] - a64 @ W2[0].T) <= _gamma(a64, W2[0])).all()


@pytest.mark.skipif(not getattr(nki, "EMULATED", False), reason="the emulation's error; the real simulator's differs")
def test_kernel_refuses_an_out_of_range_expert():
    """A tile id past the stack is a DMA out of bounds (oob_mode.error), not a silent read of other memory."""
    rng = np.random.default_rng(0)
    w2, s2, _ = _stack(rng, "fp4", 2, 128, 64)
    with pytest.raises(nl.NKIError, match="out of bounds"):
        _run(moe.expert_down_kernel, np.ones((1, 64), np.float32), np.array([2], np.int32), w2, s2, 1, "fp4",
             (1, 32))


# ---------------------------------------------------------------------------------------------- the ops
def _host(arrays):
    return [None if a is None else np.asarray(a) for a in arrays]


class _HostKernel:
    """Stands in for moe._gate_up / moe._down in the ops: kernel[lnc](*args) runs the body under nki.simulate at
    that LNC on the arrays' values, through jax.pure_callback (the emulated nki.jit lowers to a custom call that
    cannot run on CPU), so the ops jit as a whole; the launch widths used are recorded."""

    def __init__(self, body, n_arrays: int, weight: int, lncs: list, lnc=None):
        self.body, self.n_arrays, self.weight, self.lncs, self.lnc = body, n_arrays, weight, lncs, lnc

    def __getitem__(self, lnc):
        return _HostKernel(self.body, self.n_arrays, self.weight, self.lncs, lnc)

    def __call__(self, *args):
        assert self.lnc is not None, "the ops launch their kernels at an LNC (launch(kernel))"
        self.lncs.append(self.lnc)
        arrays, static = args[:self.n_arrays], args[self.n_arrays:]

        def host(*values):
            return _run(self.body, *_host(values), *static, lnc=self.lnc)
        out = jax.ShapeDtypeStruct((arrays[0].shape[0], arrays[self.weight].shape[1]), jnp.float32)
        return jax.pure_callback(host, out, *arrays)


def _simulated(monkeypatch) -> list:
    """Swap the ops' kernels for _HostKernel stand-ins; returns the list of launch widths they record."""
    lncs = []
    monkeypatch.setattr(moe, "_gate_up", _HostKernel(moe.expert_gate_up_kernel, 7, 3, lncs))
    monkeypatch.setattr(moe, "_down", _HostKernel(moe.expert_down_kernel, 4, 2, lncs))
    return lncs


def _q_interval(lo, hi, numerics, dtype, quantized):
    """The interval [L, H] a quantized element can land in when the fp32 `a` lies in [lo, hi]: the cast to the
    activation dtype, then (DeepSeek's numerics) the fp8 act-quant under either block scale the amax allows."""
    lo = np.nextafter(lo.astype(np.float32), np.float32(-np.inf)).astype(np.float64)    # fp32 ends, outward
    hi = np.nextafter(hi.astype(np.float32), np.float32(np.inf)).astype(np.float64)
    if dtype == BF16:
        lo, hi = (v.astype(np.float32).astype(BF16).astype(np.float64) for v in (lo, hi))
    if not (quantized and numerics is not None and numerics.quantize_activations):
        return lo, hi
    blk, fmax = numerics.act_block, numerics.fp8_max
    shp = lo.shape[:-1] + (lo.shape[-1] // blk, blk)
    lo_b, hi_b = lo.reshape(shp), hi.reshape(shp)
    inner = np.where(lo_b * hi_b > 0, np.minimum(np.abs(lo_b), np.abs(hi_b)), 0.0).max(axis=-1)
    outer = np.maximum(np.abs(lo_b), np.abs(hi_b)).max(axis=-1)

    def scale(amax):
        r = (np.maximum(amax, 1e-4) / fmax).astype(np.float32)
        return np.asarray(codecs.pow2(np, codecs.ceil_log2(np, r)), np.float64)[..., None]

    def q(v, s):
        return np.asarray(codecs.e4m3_round(np, (v / s).astype(np.float32), fmax), np.float64) * s

    cands_lo = [q(lo_b, scale(a)) for a in (inner, outer)]
    cands_hi = [q(hi_b, scale(a)) for a in (inner, outer)]
    return np.minimum(*cands_lo).reshape(lo.shape), np.maximum(*cands_hi).reshape(hi.shape)


_act = jax.jit(reference.moe_input, static_argnums=(1, 2))


def _bound(x, idx, weight, W1, W2, W3, layer, numerics, dtype, quantized) -> np.ndarray:
    """|op - reference| bound [T, d] over each token's k (expert, weight) pairs (module docstring). W* decoded
    float64 [R, E, ...]."""
    xa = np.asarray(_act(jnp.asarray(x), numerics, quantized), np.float64)
    E, k = W1.shape[1], idx.shape[1]
    out, ys = 0.0, 0.0
    for s in range(k):
        e = np.clip(idx[:, s], 0, E - 1)
        w2 = W2[layer][e]                                              # [T, d, I]
        a, delta = _gate_up_exact(xa, W1[layer][e], W3[layer][e], weight[:, s].astype(np.float64))
        lo, hi = _q_interval(a - delta, a + delta, numerics, dtype, quantized)
        amax = np.maximum(np.abs(lo), np.abs(hi))
        out = out + _mm(hi - lo, np.abs(w2)) + 2 * _gamma(amax, w2)
        ys = ys + _mm(amax, np.abs(w2))
    return out + 2 * k * U * ys


def _experts(rng, fmt, R, E, I, d, dtype):
    """Stacks [R, E, ...] (the last expert all zero, as padding at load makes it) -> (weights for the op, decoded)."""
    ws, decs = [], []
    for N, K in ((I, d), (d, I), (I, d)):
        v, s, dec = _stack(rng, fmt, R * E, N, K, (32, 32), dtype)
        v = v.reshape((R, E) + v.shape[1:])
        dec = dec.reshape((R, E) + dec.shape[1:])
        v[:, -1] = 0
        dec[:, -1] = 0
        if s is None:
            ws.append(jnp.asarray(v))
        else:
            s = s.reshape((R, E) + s.shape[1:])
            s[:, -1] = 0
            ws.append({"packed" if fmt == "fp4" else "codes": jnp.asarray(v), "scale": jnp.asarray(s)})
        decs.append(dec)
    return ws, decs


DEEPSEEK = Numerics(quantize_activations=True, weight_block=(32, 32), act_block=32, fp8_max=240.0,
                    trn2_weights=True)
TRANSFORMERS = Numerics(quantize_activations=False, weight_block=(32, 32), act_block=32, fp8_max=240.0,
                        trn2_weights=True)
OPS = [   # op, expert format, numerics, activation dtype, tokens
    ("moe_experts_gather", "fp4", DEEPSEEK, BF16, 3),
    ("moe_experts_grouped", "fp4", DEEPSEEK, BF16, 7),
    ("moe_experts_dense", "fp4", DEEPSEEK, BF16, 3),
    ("moe_experts_gather", "fp4", TRANSFORMERS, np.float32, 2),
    ("moe_experts_grouped", "fp8", DEEPSEEK, np.float32, 5),
    ("moe_experts_dense", "float", None, np.float32, 4),
    ("moe_experts_grouped", "float", None, BF16, 5),
]


def _op_id(o) -> str:
    quant = "ds" if o[2] is not None and o[2].quantize_activations else "f"
    return f"{o[0][len('moe_experts_'):]}-{o[1]}-{quant}-{np.dtype(o[3]).name}"


@pytest.mark.parametrize("op,fmt,numerics,dtype,T", OPS, ids=[_op_id(o) for o in OPS])
def test_routed_op_matches_reference(monkeypatch, op, fmt, numerics, dtype, T):
    """Routing as expert parallelism leaves it: some slots point at other experts with weight 0 (one of them the
    zero padded expert, one an id past the stack, clamped as the references clamp)."""
    R, E, I, d, k = 2, 8, 64, 128, 2
    rng = np.random.default_rng(T + len(fmt))
    (w1, w2, w3), (W1, W2, W3) = _experts(rng, fmt, R, E, I, d, np.float32 if fmt != "float" else dtype)
    x = jnp.asarray(rng.normal(size=(T, d)) * 2, dtype)
    idx = np.stack([rng.permutation(E - 1)[:k] for _ in range(T)]).astype(np.int32)
    weight = rng.uniform(0.2, 1.2, size=(T, k)).astype(np.float32)
    idx[0, 1], weight[0, 1] = E - 1, 0.0              # the zero padded expert
    idx[-1, 0], weight[-1, 0] = E + 3, 0.0            # a local id past the stack (weight 0 elsewhere's expert)
    weight[1 % T, 0] = 0.0                            # a real expert with weight 0
    layer = jnp.asarray(1, jnp.int32)
    args = (x, jnp.asarray(idx), jnp.asarray(weight), w1, w2, w3, layer, LIMIT, numerics)
    want = np.asarray(jax.jit(getattr(reference, op), static_argnums=(7, 8))(*args))
    lncs = _simulated(monkeypatch)
    got = np.asarray(jax.jit(getattr(moe, op), static_argnums=(7, 8))(*args))
    assert lncs == [logical_nc_config()] * 2
    assert got.shape == want.shape == (T, d) and got.dtype == np.float32
    bound = _bound(np.asarray(x), idx, weight, W1, W2, W3, 1, numerics, dtype, fmt != "float")
    assert (np.abs(got - want) <= bound).all(), np.max(np.abs(got - want) / bound)
    assert np.median(bound / (np.abs(want) + 1e-30)) < 1e-2


SHARED = [   # format, block, numerics, dtype, tokens
    ("fp8", (32, 32), DEEPSEEK, BF16, 130),           # V4.1's blocks; a full and a partial 128-row tile
    ("fp8", (128, 128), Numerics(quantize_activations=True, weight_block=(128, 128), act_block=128, fp8_max=240.0,
                                 trn2_weights=True), np.float32, 3),
    ("float", None, None, BF16, 4),
]


@pytest.mark.parametrize("fmt,block,numerics,dtype,T", SHARED, ids=["fp8-32-ds-bf16", "fp8-128-ds-f32", "float-bf16"])
def test_shared_expert_matches_reference(monkeypatch, fmt, block, numerics, dtype, T):
    I, d = 128, 256
    rng = np.random.default_rng(T)
    ws, decs = [], []
    for N, K in ((I, d), (d, I), (I, d)):
        v, s, dec = _stack(rng, fmt, 1, N, K, block, dtype)
        ws.append(jnp.asarray(v[0]) if s is None else {"codes": jnp.asarray(v[0]), "scale": jnp.asarray(s[0])})
        decs.append(dec[None])
    x = jnp.asarray(rng.normal(size=(T, d)), dtype)
    args = (x.reshape(1, T, d), *ws, LIMIT, numerics)            # [..., d] inputs keep their leading dims
    want = np.asarray(jax.jit(reference.shared_expert, static_argnums=(4, 5))(*args))
    lncs = _simulated(monkeypatch)
    got = np.asarray(jax.jit(moe.shared_expert, static_argnums=(4, 5))(*args))
    assert lncs == [logical_nc_config()] * 2
    assert got.shape == want.shape == (1, T, d)
    W1, W2, W3 = decs
    bound = _bound(np.asarray(x), np.zeros((T, 1), np.int32), np.ones((T, 1), np.float32), W1, W2, W3, 0, numerics,
                   dtype, fmt != "float")
    assert (np.abs(got[0] - want[0]) <= bound).all(), np.max(np.abs(got[0] - want[0]) / bound)
    assert np.median(bound / (np.abs(want[0]) + 1e-30)) < 1e-2


def test_fp8_needs_trn2_codes():
    rng = np.random.default_rng(0)
    ws = [{"codes": jnp.asarray(_trn2_codes(rng, (64, 128))), "scale": jnp.ones((2, 4), jnp.uint8)}] * 3
    nx = Numerics(weight_block=(32, 32), act_block=32)                                  # e4m3fn codes
    with pytest.raises(ValueError, match="fp8_max=240"):
        moe.shared_expert(jnp.ones((1, 128)), *ws, LIMIT, nx)


@pytest.mark.skipif(not getattr(nki, "EMULATED", False), reason="the recording stand-in is the emulation's")
def test_ops_lower_to_two_custom_calls_with_raw_codes():
    """Under jit the ops emit NKI's custom calls (kernel A, then B): the fp4 bytes and scales go in as uint8."""
    rng = np.random.default_rng(1)
    (w1, w2, w3), _ = _experts(rng, "fp4", 2, 8, 64, 128, np.float32)
    args = (jnp.ones((2, 128), jnp.bfloat16), jnp.zeros((2, 2), jnp.int32), jnp.ones((2, 2), jnp.float32), w1, w2,
            w3, jnp.asarray(0, jnp.int32))
    for op in ("moe_experts_gather", "moe_experts_grouped", "moe_experts_dense"):
        nki.RECORDED.clear()
        text = jax.jit(getattr(moe, op), static_argnums=(7, 8)).lower(*args, LIMIT, DEEPSEEK).as_text()
        assert text.count(nki.CUSTOM_CALL_TARGET) == 2, op
        gate_up, down = nki.RECORDED
        assert (gate_up["kernel"], down["kernel"]) == ("expert_gate_up_kernel", "expert_down_kernel")
        assert gate_up["grid"] == down["grid"] == logical_nc_config()
        assert [dt for _, dt in gate_up["inputs"][3:]] == ["uint8"] * 4     # w1 packed, scale, w3 packed, scale
        assert [dt for _, dt in down["inputs"][2:]] == ["uint8"] * 2
