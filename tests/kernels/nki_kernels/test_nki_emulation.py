"""The emulation refuses what NKI and neuronx-cc refuse (so a kernel that passes here is not passing by
leniency). Only meaningful for the emulation itself: with the real `nki` these checks are the toolchain's."""

from __future__ import annotations

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl

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
