"""The emulation refuses what NKI and neuronx-cc refuse (so a kernel that passes here is not passing by
leniency). Only meaningful for the emulation itself: with the real `nki` these checks are the toolchain's."""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(not getattr(nki, "EMULATED", False),
                                reason="checks the emulation; the real nki package is installed")


def _run(body, *args):
    return nki.simulate(body)(*args)


def test_refusals():
    x = np.zeros((4, 8), np.float32)

    def big_tile(a):
        return nl.ndarray((129, 8), nl.float32, buffer=nl.sbuf)
    with pytest.raises(nl.NKIError, match="partition dimension 129 exceeds maximum 128"):
        _run(big_tile, x)

    def private_output(a):
        out = nl.ndarray((4, 8), nl.float32, buffer=nl.hbm)
        t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a)
        nisa.dma_copy(dst=out, src=t)
        return out
    with pytest.raises(nl.NKIError, match="shared_hbm"):
        _run(private_output, x)

    def matmul_from_hbm(a):
        ps = nl.ndarray((8, 8), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=a, moving=a)
    with pytest.raises(nl.NKIError, match="SBUF"):
        _run(matmul_from_hbm, x)

    def dma_from_psum(a):
        ps = nl.zeros((4, 8), nl.float32, buffer=nl.psum)
        out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=ps)
        return out
    with pytest.raises(nl.NKIError, match="PSUM"):
        _run(dma_from_psum, x)

    def int_operand(a):
        t = nl.zeros((4, 8), nl.float32)
        s = nl.zeros((4, 1), nl.int32)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=s)
    with pytest.raises(nl.NKIError, match="must be float32"):
        _run(int_operand, x)

    def ocp_fp8_matmul(a):
        t = nl.zeros((4, 8), nl.uint8)
        ps = nl.ndarray((8, 8), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=t.view(nl.float8_e4m3fn), moving=t.view(nl.float8_e4m3fn))
    with pytest.raises(nl.NKIError, match="trn2"):
        _run(ocp_fp8_matmul, x)

    def wide_moving(a):
        s = nl.zeros((128, 4), nl.bfloat16)
        m = nl.zeros((128, 513), nl.bfloat16)
        ps = nl.ndarray((4, 513), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=s, moving=m)
    with pytest.raises(nl.NKIError, match="moving free <= 512"):
        _run(wide_moving, x)

    def write_input(a):
        t = nl.zeros((4, 8), nl.float32)
        nisa.dma_copy(dst=a, src=t)
    with pytest.raises(nl.NKIError, match="cannot be written"):
        _run(write_input, x)


def test_psum_accumulates_matmuls_and_reads_views():
    a = np.arange(16, dtype=np.float32).reshape(4, 4)

    def two_k_tiles(m):
        t = nl.ndarray((4, 4), nl.float32)
        nisa.dma_copy(dst=t, src=m)
        ps = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=t, moving=t)            # first write overwrites
        nisa.nc_matmul(dst=ps, stationary=t, moving=t)            # then accumulates
        out = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        s = nl.ndarray((4, 4), nl.float32)
        nisa.tensor_copy(dst=s, src=ps)
        nisa.dma_copy(dst=out, src=s)
        return out
    np.testing.assert_array_equal(_run(two_k_tiles, a), 2 * a.T @ a)


# ---------------------------------------------------------------- top-k primitives, gather, iota (helper INDEX)
def _sbuf(a, dtype=None):
    """An SBUF tile holding the numpy array a (inside a kernel)."""
    t = nl.ndarray(a.shape, dtype or a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    return t


def _out(t):
    o = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=o, src=t)
    return o


def test_topk_primitive_and_gather_refusals():
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    vals = np.array([[7, 6, 5, 4, 3, 2, 1, 0]] * 2, np.float32)

    def replace_wide(a, v):
        t = nl.zeros((2, 16385), nl.float32)
        nisa.nc_match_replace8(dst=t, data=t, vals=_sbuf(v), imm=-1.0)
    with pytest.raises(nl.NKIError, match="16385 elements per partition"):
        _run(replace_wide, x, vals)

    def replace_seven(a, v):
        t = _sbuf(a)
        nisa.nc_match_replace8(dst=t, data=t, vals=_sbuf(v)[:, 0:7], imm=-1.0)
    with pytest.raises(nl.NKIError, match="exactly 8 values"):
        _run(replace_seven, x, vals)

    def replace_float_idx(a, v):
        t = _sbuf(a)
        nisa.nc_match_replace8(dst=t, data=t, vals=_sbuf(v), imm=-1.0, dst_idx=nl.ndarray((2, 8), nl.float32))
    with pytest.raises(nl.NKIError, match="uint16/uint32"):
        _run(replace_float_idx, x, vals)

    def replace_absent(a, v):                 # row 1 holds 8..15: vals 0..7 are not there (undefined)
        t = _sbuf(a)
        nisa.nc_match_replace8(dst=t, data=t, vals=_sbuf(v), imm=-1.0)
    with pytest.raises(nl.NKIError, match="absent"):
        _run(replace_absent, np.concatenate([x[:1] - 8, x[1:]]), vals)

    def replace_other_shape(a, v):
        nisa.nc_match_replace8(dst=nl.ndarray((2, 9), nl.float32), data=_sbuf(a), vals=_sbuf(v), imm=-1.0)
    with pytest.raises(nl.NKIError, match="data's shape"):
        _run(replace_other_shape, x - 8 * np.arange(2, dtype=np.float32)[:, None], vals)

    def find_short(a, v):
        nisa.nc_find_index8(dst=nl.ndarray((2, 8), nl.uint32), data=_sbuf(a)[:, 0:7], vals=_sbuf(v))
    with pytest.raises(nl.NKIError, match="7 elements per partition"):
        _run(find_short, x, vals)

    def find_float_dst(a, v):
        nisa.nc_find_index8(dst=nl.ndarray((2, 8), nl.float32), data=_sbuf(a), vals=_sbuf(v))
    with pytest.raises(nl.NKIError, match="uint16/uint32"):
        _run(find_float_dst, x, vals)

    idx = np.zeros((2, 3), np.uint32)

    def gather_psum(a, i):
        nisa.nc_n_gather(dst=nl.ndarray((2, 3), nl.float32), data=nl.zeros((2, 8), nl.float32, buffer=nl.psum),
                         indices=_sbuf(i))
    with pytest.raises(nl.NKIError, match="cannot access PSUM"):
        _run(gather_psum, x, idx)

    def gather_int32_indices(a, i):
        nisa.nc_n_gather(dst=nl.ndarray((2, 3), nl.float32), data=_sbuf(a), indices=_sbuf(i, nl.int32))
    with pytest.raises(nl.NKIError, match="uint32"):
        _run(gather_int32_indices, x, idx)

    def gather_cast(a, i):
        nisa.nc_n_gather(dst=nl.ndarray((2, 3), nl.bfloat16), data=_sbuf(a), indices=_sbuf(i))
    with pytest.raises(nl.NKIError, match="data's dtype"):
        _run(gather_cast, x, idx)

    def gather_short_dst(a, i):
        nisa.nc_n_gather(dst=nl.ndarray((2, 2), nl.float32), data=_sbuf(a), indices=_sbuf(i))
    with pytest.raises(nl.NKIError, match="elements per partition"):
        _run(gather_short_dst, x, idx)

    def gather_out_of_range(a, i):
        nisa.nc_n_gather(dst=nl.ndarray((2, 3), nl.float32), data=_sbuf(a), indices=_sbuf(i))
    with pytest.raises(nl.NKIError, match="outside"):
        _run(gather_out_of_range, x, idx + 8)

    def iota_short_pattern(a):
        nisa.iota(dst=nl.ndarray((2, 8), nl.float32), pattern=[[1, 7]])
    with pytest.raises(nl.NKIError, match="does not cover"):
        _run(iota_short_pattern, x)


def test_duplicate_values_take_ascending_positions():
    """max8 keeps duplicates; match_replace8 (the docs' NumPy equivalent, values in turn against the data as replaced
    so far) gives equal values ascending positions in dst_idx; find_index8 does too (the rule jdeep assumes)."""
    x = np.array([[3, 1, 3, 2, 3, 0, 2, 1, 3, 5]], np.float32)

    def rounds(a):
        t = _sbuf(a)
        v = nl.ndarray((1, 8), nl.float32)
        found = nl.ndarray((1, 8), nl.uint32)
        pos = nl.ndarray((1, 8), nl.uint32)
        nisa.max8(dst=v, src=t)
        nisa.nc_find_index8(dst=found, data=t, vals=v)
        nisa.nc_match_replace8(dst=t, data=t, vals=v, imm=float("-inf"), dst_idx=pos)
        return _out(v), _out(found), _out(pos), _out(t)
    v, found, pos, t = _run(rounds, x)
    np.testing.assert_array_equal(v, [[5, 3, 3, 3, 3, 2, 2, 1]])
    np.testing.assert_array_equal(pos, [[9, 0, 2, 4, 8, 3, 6, 1]])
    np.testing.assert_array_equal(found, pos)
    np.testing.assert_array_equal(t, [[-np.inf] * 5 + [0, -np.inf, 1, -np.inf, -np.inf]])


def test_gather_within_partitions():
    data = np.arange(24, dtype=np.uint32).reshape(2, 12)
    idx = np.array([[11, 0, 5], [3, 3, 10]], np.uint32)

    def gather(a, i):
        d = nl.ndarray((2, 3), nl.uint32)
        nisa.nc_n_gather(dst=d, data=_sbuf(a).reshape((2, 3, 4)), indices=_sbuf(i))
        return _out(d)
    np.testing.assert_array_equal(_run(gather, data, idx), np.take_along_axis(data, idx.astype(np.int64), axis=1))


def test_registers_and_dynamic_offsets():
    """ap(scalar_offset=register, indirect_dim=d) starts at offset + value · (stride of dim d), for reads and writes;
    the value comes from register_load of a one-element integer tensor."""
    stack = np.arange(3 * 4 * 5, dtype=np.float32).reshape(3, 4, 5)
    ids = np.array([2, 0], np.int32)

    def pick(w, i):
        reg = nisa.register_alloc()
        nisa.register_load(reg, i[1:2])                            # from HBM: 0
        nisa.register_load(reg, i[0:1])                            # then 2
        t = nl.ndarray((4, 2), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=w.ap(pattern=[[5, 4], [1, 2]], offset=3, scalar_offset=reg, indirect_dim=0))
        out = nl.ndarray((3, 4, 2), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out.ap(pattern=[[2, 4], [1, 2]], offset=0, scalar_offset=nisa.register_alloc(1),
                                 indirect_dim=0), src=t)
        return out
    np.testing.assert_array_equal(_run(pick, stack, ids)[1], stack[2, :, 3:5])


def test_register_and_dynamic_offset_refusals():
    stack = np.zeros((3, 4, 5), np.float32)

    def read(reg, pattern=((5, 4), (1, 5)), offset=0, dim=0, **kw):
        def body(w):
            t = nl.ndarray((4, 5), nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=w.ap(pattern=[list(p) for p in pattern], offset=offset,
                                          scalar_offset=reg() if callable(reg) else reg, indirect_dim=dim, **kw))
        return body
    with pytest.raises(nl.NKIError, match="out of bounds for dim 0"):
        _run(read(lambda: nisa.register_alloc(3)), stack)          # expert 3 of 3 (oob_mode.error)
    with pytest.raises(nl.NKIError, match="out of bounds for dim 0"):
        _run(read(lambda: nisa.register_alloc(-1)), stack)
    with pytest.raises(nl.NKIError, match="access pattern out of bounds"):
        _run(read(lambda: nisa.register_alloc(2), offset=1), stack)   # a valid index, the pattern runs past the end
    with pytest.raises(nl.NKIError, match="never loaded"):
        _run(read(lambda: nisa.register_alloc()), stack)
    with pytest.raises(nl.NKIError, match="must be a register"):
        _run(read(2), stack)
    with pytest.raises(nl.NKIError, match="at most one"):
        _run(read(lambda: nisa.register_alloc(0), vector_offset=nl.zeros((4, 1), nl.int32)), stack)
    with pytest.raises(nl.NKIError, match="indirect_dim 3"):
        _run(read(lambda: nisa.register_alloc(0), dim=3), stack)

    def on_chip(w):
        t = nl.zeros((4, 5), nl.float32)
        t.ap(pattern=[[5, 4], [1, 5]], scalar_offset=nisa.register_alloc(0), indirect_dim=1)
    with pytest.raises(nl.NKIError, match="HBM tensors only"):
        _run(on_chip, stack)

    def load(src_fn):
        def body(w):
            nisa.register_load(nisa.register_alloc(), src_fn(w))
        return body
    with pytest.raises(nl.NKIError, match="exactly one element"):
        _run(load(lambda w: nl.zeros((1, 2), nl.int32)), stack)
    with pytest.raises(nl.NKIError, match="not PSUM"):
        _run(load(lambda w: nl.zeros((1, 1), nl.float32, buffer=nl.psum)), stack)
    with pytest.raises(nl.NKIError, match="32-bit integer"):
        _run(load(lambda w: w[0:1, 0, 0]), stack)                  # a float32 element


def test_bit_vector_ops_keep_one_integer_type():
    """Bit-vector ALU ops treat elements as bit patterns without casting (one integer dtype in and out), and
    scalar_tensor_tensor takes arithmetic operators only."""
    x = np.zeros((4, 8), np.float32)

    def mixed_scalar(a):
        nisa.tensor_scalar(dst=nl.zeros((4, 8), nl.uint32), data=nl.zeros((4, 8), nl.int32), op0=nl.left_shift,
                           operand0=1)
    with pytest.raises(nl.NKIError, match="share one integer dtype"):
        _run(mixed_scalar, x)

    def mixed_tensor(a):
        u = nl.zeros((4, 8), nl.uint32)
        nisa.tensor_tensor(dst=u, data1=u, data2=nl.zeros((4, 8), nl.int32), op=nl.bitwise_or)
    with pytest.raises(nl.NKIError, match="share one integer dtype"):
        _run(mixed_tensor, x)

    def bitvec_stt(a):
        t = nl.zeros((4, 8), nl.int32)
        nisa.scalar_tensor_tensor(dst=t, data=t, op0=nl.bitwise_and, operand0=1, op1=nl.bitwise_or, operand1=t)
    with pytest.raises(nl.NKIError, match="bit-vector"):
        _run(bitvec_stt, x)
