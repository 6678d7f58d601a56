"""V4.1 packed cache records decode to exactly the values of DeepSeek's QAT simulation (fp8 window entries,
fp4 compressed KV with e4m3 scales, fp4 index keys), in float32 and bfloat16, and have the sizes of
model-spec.md §6.5."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jdeep.kernels.kv_record_v41 import (ckv_record_bytes, decode_ckv, decode_ikey, decode_window, encode_ckv,
                                         encode_ikey, encode_window, ikey_record_bytes, window_record_bytes)
from jdeep.kernels.quant import fp4_fake_quant, fp4e4_fake_quant, fp8_fake_quant


def test_record_sizes_at_released_dims():
    assert window_record_bytes(512, 32) == 528
    assert ckv_record_bytes(512, 16) == 288
    assert ikey_record_bytes(128, 32) == 68


def _values(dtype, shape=(3, 5, 128)):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, shape[:-1] + (1,)))
    x[0, 0] = 0.0                                                      # all-zero entries (amax floors)
    x[0, 1, :16] = np.linspace(-1, 1, 16) * 5                          # quantiser ties
    x[0, 2, :32] = 1e-30                                               # far below every floor
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fp8_max", [448.0, 240.0])
def test_window_record_is_the_fp8_qat(dtype, fp8_max):
    kv = _values(dtype)
    rec = encode_window(kv, 32, fp8_max)
    assert rec.dtype == jnp.int32 and rec.shape[-1] == window_record_bytes(128, 32)
    assert int(rec.min()) >= 0 and int(rec.max()) <= 255
    got = decode_window(rec.astype(jnp.uint8), 128, 32, dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(fp8_fake_quant(kv, 32, fp8_max), np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ckv_record_is_the_fp4_e4m3_qat(dtype):
    kv = _values(dtype)
    rec = encode_ckv(kv, 16)
    assert rec.shape[-1] == ckv_record_bytes(128, 16) and int(rec.max()) <= 255 and int(rec.min()) >= 0
    got = decode_ckv(rec.astype(jnp.uint8), 128, 16, dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(fp4e4_fake_quant(kv, 16), np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ikey_record_is_the_fp4_qat(dtype):
    key = _values(dtype, (3, 4, 64))
    rec = encode_ikey(key, 32)
    assert rec.shape[-1] == ikey_record_bytes(64, 32) and int(rec.max()) <= 255 and int(rec.min()) >= 0
    got = decode_ikey(rec.astype(jnp.uint8), 64, 32, dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(fp4_fake_quant(key, 32), np.float32))
