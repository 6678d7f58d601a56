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


def _run(body, *args, lnc=None):
    """Run a test kernel (closures, lambdas: the instruction semantics are under test here, not the NKI subset)."""
    return nki.simulate(body if lnc is None else nki.jit(body)[lnc], check=False)(*args)


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


def test_duplicate_values_follow_the_documented_hardware_order():
    """max8 keeps duplicates; find_index8 pairs duplicate vals with ascending positions, match_replace8's dst_idx
    with descending ones (it processes vals 7 .. 0: the NKI 0.6 stub, whose own example is checked first); both
    replace / find the same set of positions, and a value absent from find_index8's data gives 0xFFFFFFFF."""
    stub = np.array([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]], np.float32)

    def stub_example(a):
        t = _sbuf(a)
        v = nl.ndarray((1, 8), nl.float32)
        nisa.memset(dst=v, value=8.0)
        nisa.memset(dst=v[:, 0:1], value=3.0)
        pos = nl.ndarray((1, 8), nl.uint32)
        nisa.nc_match_replace8(dst=t, data=t, vals=v, imm=0.0, dst_idx=pos)
        return _out(pos)
    np.testing.assert_array_equal(_run(stub_example, stub), [[2, 10, 9, 8, 7, 6, 5, 4]])

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
    np.testing.assert_array_equal(found, [[9, 0, 2, 4, 8, 3, 6, 1]])
    np.testing.assert_array_equal(pos, [[9, 8, 4, 2, 0, 6, 3, 1]])
    np.testing.assert_array_equal(t, [[-np.inf] * 5 + [0, -np.inf, 1, -np.inf, -np.inf]])

    def find_absent(a):
        t = _sbuf(a)
        v = nl.ndarray((1, 8), nl.float32)
        nisa.memset(dst=v, value=7.0)
        nisa.memset(dst=v[:, 0:1], value=5.0)
        found = nl.ndarray((1, 8), nl.uint32)
        nisa.nc_find_index8(dst=found, data=t, vals=v)
        return _out(found)
    np.testing.assert_array_equal(_run(find_absent, x), [[9] + [0xFFFFFFFF] * 7])


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
        nisa.dma_copy(dst=out[0], src=t)                          # (every output element must be written)
        nisa.dma_copy(dst=out[2], src=t)
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


# ---------------------------------------------------------------- launches at an LNC (kernel[lnc]) and their cores
def _halves(a):
    """Each program copies its half of the rows of a: the LNC guide's pattern (program_id picks the work)."""
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    n = a.shape[0] // nl.num_programs()
    i = nl.program_id(0)
    t = nl.ndarray((n, a.shape[1]), a.dtype)
    nisa.dma_copy(dst=t, src=a[i * n:(i + 1) * n])
    nisa.dma_copy(dst=out[i * n:(i + 1) * n], src=t)
    return out


def test_an_lnc_launch_runs_one_program_per_core_over_shared_outputs():
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    np.testing.assert_array_equal(_run(_halves, x, lnc=2), x)
    assert nki.launch_stats()["programs"] == 2
    np.testing.assert_array_equal(_run(_halves, x, lnc=1), x)
    np.testing.assert_array_equal(_run(_halves, x), x)            # no grid: num_programs() is 1, program_id() 0
    with pytest.raises(nl.NKIError, match="1..2"):
        nki.jit(_halves)[3]


def _halves_first(a):
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(a.shape, a.dtype)
    nisa.dma_copy(dst=t, src=a)
    if nl.program_id(0) == 0:
        nisa.dma_copy(dst=out[0:2], src=t[0:2])
    return out


def test_lnc_races_and_holes_are_refused():
    x = np.ones((4, 8), np.float32)

    def both_write_everything(a):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(a.shape, a.dtype)
        nisa.dma_copy(dst=t, src=a)
        nisa.dma_copy(dst=out, src=t)
        return out
    np.testing.assert_array_equal(_run(both_write_everything, x, lnc=1), x)
    with pytest.raises(nl.NKIError, match="program 1 touches 32 elements .* program 0 wrote"):
        _run(both_write_everything, x, lnc=2)
    with pytest.raises(nl.NKIError, match="16 elements no program wrote"):
        _run(_halves_first, x, lnc=2)

    def reads_the_other_core(a):                    # program 1 reads rows program 0 wrote: no ordering between cores
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((2, 8), a.dtype)
        i = nl.program_id(0)
        nisa.dma_copy(dst=t, src=a[2 * i:2 * i + 2])
        nisa.dma_copy(dst=out[2 * i:2 * i + 2], src=t)
        if i == 1:
            nisa.dma_copy(dst=t, src=out[0:2])
        return out
    with pytest.raises(nl.NKIError, match="program 1 touches"):
        _run(reads_the_other_core, x, lnc=2)


def test_a_traced_call_must_launch_at_the_runtime_lnc(monkeypatch):
    """nki.jit: "The LNC value must match the NEURON_LOGICAL_NC_CONFIG environment variable ... Mismatching the two
    will cause a runtime error": the emulation raises at trace time."""
    import jax
    import jax.numpy as jnp

    kernel = nki.jit(_halves)
    x = jnp.ones((4, 8), jnp.float32)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    with pytest.raises(nl.NKIError, match="launched at LNC=1 where NEURON_LOGICAL_NC_CONFIG is 2"):
        jax.jit(lambda a: kernel(a)).lower(x)
    assert "AwsNeuronCustomNativeKernel" in jax.jit(lambda a: kernel[2](a)).lower(x).as_text()
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    with pytest.raises(nl.NKIError, match="launched at LNC=2"):
        jax.jit(lambda a: kernel[2](a)).lower(x)


def test_the_custom_call_carries_jax_neuronxs_payload(monkeypatch):
    """The emitted call: API_VERSION_STATUS_RETURNING, the array arguments then an s8[128, 128] constant, and a
    backend config naming the kernel, its launch grid and the absolute path of its compiled artifact (which
    exists)."""
    import base64
    import json
    import os
    import re

    import jax
    import jax.numpy as jnp

    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    text = jax.jit(lambda a: nki.jit(_halves)[2](a)).lower(jnp.ones((4, 8), jnp.float32)).as_text()
    call = re.search(r"stablehlo\.custom_call @AwsNeuronCustomNativeKernel\((.*?)\) \{(.*?)\} : \((.*?)\) ->", text)
    assert call, text
    assert "api_version = 2" in call.group(2)
    assert call.group(3).split(", ")[-1] == "tensor<128x128xi8>" and len(call.group(3).split(", ")) == 2
    config = json.loads(base64.b64decode(re.search(r'backend_config = "([^"]+)"', call.group(2)).group(1)))
    assert config["func_name"].endswith("._halves") and config["grid"] == 2 and config["kernel_format"] == "bir"
    klir = config["klir_binary"]
    assert os.path.isabs(klir["binary"]) and os.path.exists(klir["binary"])
    assert klir["input_names"] == ["a"] and klir["output_names"] == ["output0"]


# ---------------------------------------------------------------- numerics the hardware has and numpy does not
def test_32_bit_integer_lanes_must_be_exact_in_fp32():
    """Bit ops on 32-bit words the engines would round through fp32 are refused; 16-bit lanes and exact 32-bit values
    (a ue8m0 byte shifted into an fp32 exponent) pass."""
    words = np.full((2, 4), 0x12345678, np.uint32)

    def mask32(a):
        t = _sbuf(a)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.bitwise_and, operand0=0xF0F0F0F0)
    with pytest.raises(nl.NKIError, match="not exact in fp32"):
        _run(mask32, words)

    def mask16(a):
        t = _sbuf(a).view(nl.uint16)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.bitwise_and, operand0=0xF0F0, op1=nl.right_shift, operand1=4)
        return _out(t)
    np.testing.assert_array_equal(_run(mask16, words), (words.view(np.uint16) & 0xF0F0) >> 4)

    def exponent(a):
        t = nl.ndarray((2, 4), nl.int32)
        nisa.tensor_copy(dst=t, src=_sbuf(a))
        nisa.tensor_scalar(dst=t, data=t, op0=nl.left_shift, operand0=23)
        return _out(t.view(nl.float32))
    b = np.array([[1, 127, 128, 254]] * 2, np.uint8)
    np.testing.assert_array_equal(_run(exponent, b), np.exp2(b.astype(np.float64) - 127).astype(np.float32))


def test_activations_are_approximate_and_range_checked():
    x = np.linspace(-20, 20, 4096, dtype=np.float32).reshape(32, 128)

    def act(op):
        def body(a):
            t = _sbuf(a)
            nisa.activation(dst=t, op=op, data=t)
            return _out(t)
        return body
    got = _run(act(nl.exp), x)
    exact = np.exp(x.astype(np.float64))
    rel = np.abs(got / exact - 1)
    assert rel.max() <= nisa.ACTIVATION_REL_ERROR * 1.01 and rel.max() > nisa.ACTIVATION_REL_ERROR / 4
    np.testing.assert_array_equal(_run(act(nl.exp), x), got)                   # deterministic
    np.testing.assert_array_equal(_run(act(nl.relu), x), np.maximum(x, 0))      # exact
    tiny = _run(act(nl.exp), np.full((1, 8), -100, np.float32))
    assert (tiny >= 0).all() and (tiny <= 2.0 ** -126).all() and (tiny > 0).any()   # not exactly 0
    with pytest.raises(nl.NKIError, match="valid range"):
        _run(act(nl.rsqrt), np.zeros((1, 8), np.float32))


def test_psum_accumulates_in_fp32():
    """Three products 1 + 2^-11 + 2^-24 each: fp32 products round to 1 + 2^-11 and sum exactly to 3 + 3·2^-11, where
    a float64 sum rounded once would give one ulp more."""
    a = np.full((3, 1), 1 + 2.0 ** -12, np.float32)

    def dot(m):
        t = _sbuf(m)
        ps = nl.ndarray((1, 1), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=t, moving=t)
        s = nl.ndarray((1, 1), nl.float32)
        nisa.tensor_copy(dst=s, src=ps)
        return _out(s)
    assert _run(dot, a)[0, 0] == np.float32(3 + 3 * 2.0 ** -11)


def test_on_chip_memory_is_bounded_per_partition():
    """SBUF: 224 KiB per partition on trn2, counted while a tile's storage lives (a rebound tile frees its bytes);
    PSUM: 8 banks of 2 KiB, a tile taking whole banks."""
    x = np.zeros((2, 8), np.float32)

    def too_much(a):
        keep = nl.ndarray((128, 40000), nl.float32)                          # 160000 B
        more = nl.ndarray((128, 20000), nl.float32)                          # + 80000 B > 229376
        return keep, more
    with pytest.raises(nl.NKIError, match="sbuf over capacity"):
        _run(too_much, x)

    def reuse(a):
        for _ in range(10):
            t = nl.ndarray((128, 20000), nl.float32)                         # one live at a time (plus the next)
        out = nl.ndarray((2, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=a)
        return out
    _run(reuse, x)
    assert nki.launch_stats()["sbuf_peak_bytes"] == 2 * 80000

    def nine_banks(a):
        banks = []
        for _ in range(9):
            banks.append(nl.ndarray((128, 4), nl.float32, buffer=nl.psum))   # 16 B each, one bank each
    with pytest.raises(nl.NKIError, match="psum over capacity"):
        _run(nine_banks, x)


def test_psum_banks_are_freed_with_their_tiles():
    """Twenty PSUM tiles written by matmuls one after another: each bank is free again once its tile is gone."""
    a = np.ones((4, 4), np.float32)

    def loop(m):
        t = _sbuf(m)
        s = nl.ndarray((4, 4), nl.float32)
        for _ in range(20):
            ps = nl.ndarray((4, 512), nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=ps[:, 0:4], stationary=t, moving=t)
            nisa.tensor_copy(dst=s, src=ps[:, 0:4])
        return _out(s)
    np.testing.assert_array_equal(_run(loop, a), a.T @ a)
    assert nki.launch_stats()["psum_peak_bytes"] == 2 * 2048
