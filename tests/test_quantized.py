"""Quantized checkpoints on seeded random fp8/fp4 models: packed KV records, the trn2 weight rescale,
size accounting and configuration errors (the goldens are checked in test_golden_v4_q.py)."""

from __future__ import annotations

import numpy as np
import pytest

import jdeep
from jdeep.config import ConfigError
from jdeep.io.trn2_rescale import halving_lut, trn2_rescale
from jdeep.kernels import codecs
from jdeep.kernels.linear import dequant
from jdeep.config.small_models import TINY_CONFIG
from jdeep.state import state_bytes
from jdeep.tools.testing.random_weights import random_checkpoint

# two layers (a ratio-4 layer with indexer, a ratio-16 one; hash routing on the first): every
# quantized code path, and small enough to compile quickly
QCFG = dict(TINY_CONFIG, head_dim=128, qk_rope_head_dim=64, index_head_dim=64, num_hidden_layers=2,
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention"], num_hash_layers=1,
            quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                 "weight_block_size": [32, 32], "expert_dtype": "fp4"})
PROMPTS = [[0, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [0, 9, 8]]


@pytest.fixture(scope="module")
def qfolder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("q")
    random_checkpoint(QCFG, str(folder), seed=3)
    return folder


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.full)])
def test_packed_kv_records_are_bit_identical(qfolder, dtype):
    """Packed KV records give the float caches' logits and tokens bit for bit (ragged batch: prefill, then decode),
    in a smaller state. The float32 variant is in the full tier.

    Full tier: tests/test_quantized.py::test_packed_kv_records_are_bit_identical[bfloat16] covers the packed-KV
    model path (records written and read in prefill and decode) and tests/test_quantized.py::test_kv_record_round_trip
    covers the float32 record format (fp32 rope bytes), in the default run."""
    flt = jdeep.load(qfolder, dtype=dtype)
    packed = jdeep.load(qfolder, dtype=dtype, packed_kv=True)
    a = jdeep.generate(flt, PROMPTS, max_new_tokens=12, return_logits=True)
    b = jdeep.generate(packed, PROMPTS, max_new_tokens=12, return_logits=True)
    np.testing.assert_array_equal(a.logits, b.logits)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    st = packed.init_state(1, 256)
    assert st["segments"][-1][0]["window"].dtype == np.uint8
    sizes = [state_bytes(m.config, m.plan, 1, 4096, m.dtype, m.numerics) for m in (flt, packed)]
    assert sizes[1] < sizes[0]
    print(f"{dtype}: state bytes for 1 x 4096 tokens: float cache {sizes[0]}, packed records {sizes[1]}")


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_kv_record_round_trip(dtype):
    """QAT'd K=V rows come back bit for bit from their uint8 records (fp32 and bf16 rope bytes)."""
    import jax.numpy as jnp

    from jdeep.kernels.kv_record import decode_kv_record, encode_kv_record, record_bytes
    from jdeep.kernels.quant import fp8_fake_quant

    rng = np.random.default_rng(1)
    x = rng.normal(0, 3, (5, 7, 128)) * np.exp(rng.normal(0, 4, (5, 7, 1)))
    x[0, 0] = 0.0
    x = jnp.asarray(x, dtype)
    kv = jnp.concatenate([fp8_fake_quant(x[..., :64], 64), x[..., 64:]], axis=-1)
    rec = encode_kv_record(kv, 64, 64)
    assert rec.shape[-1] == record_bytes(128, 64, 64, jnp.dtype(dtype).itemsize)
    assert int(rec.min()) >= 0 and int(rec.max()) <= 255
    back = decode_kv_record(rec.astype(jnp.uint8), 128, 64, 64, dtype)
    np.testing.assert_array_equal(np.asarray(back, np.float32), np.asarray(kv, np.float32))


def test_packed_kv_needs_kv_qat(qfolder):
    with pytest.raises(ValueError, match="packed_kv"):
        jdeep.load(qfolder, quantize_activations=False, packed_kv=True)


def test_v4_flash_record_is_584_bytes():
    from jdeep.kernels.kv_record import record_bytes

    assert record_bytes(512, 64, 64, 2) == 584   # 448 fp8 + 128 bf16 rope + 7 e8m0 + 1 pad


def test_halving_lut_is_exact_except_the_lowest_odd_codes():
    vals = codecs.e4m3_decode(np, np.arange(256)).astype(np.float64)
    halved = codecs.e4m3_decode(np, halving_lut(), trn2=True).astype(np.float64)
    ok = np.isnan(vals) | (halved == vals / 2)
    field, mant = (np.arange(256) >> 3) & 15, np.arange(256) & 7
    assert set(np.nonzero(~ok)[0]) == set(np.nonzero((field <= 1) & (mant % 2 == 1))[0])
    assert np.nanmax(np.abs(halved)) <= 240


def test_trn2_rescale_keeps_every_weight_value():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, size=(3, 96, 160)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x10                       # no NaN codes in a checkpoint
    codes[..., :64, :] &= 0xEF                                  # some blocks without |x| >= 256 codes ...
    codes[..., :64, :] = np.where((codes[..., :64, :] >> 3 & 15) == 15, 0x70, codes[..., :64, :])
    low_odd = ((codes >> 3 & 15) <= 1) & (codes & 1 == 1)
    codes[..., 64:, :] = np.where(low_odd[..., 64:, :], codes[..., 64:, :] ^ 1, codes[..., 64:, :])
    scale = rng.integers(100, 130, size=(3, 3, 5)).astype(np.uint8)
    new_codes, new_scale = trn2_rescale(codes, scale, (32, 32))
    before = codecs.e4m3_decode(np, codes) * np.repeat(np.repeat(codecs.ue8m0_decode(np, scale), 32, -2), 32, -1)
    after = codecs.e4m3_decode(np, new_codes, trn2=True) * \
        np.repeat(np.repeat(codecs.ue8m0_decode(np, new_scale), 32, -2), 32, -1)
    np.testing.assert_array_equal(after, before)
    assert not np.any((new_codes >> 3 & 15) == 15)
    assert np.array_equal(new_scale[:, :2], scale[:, :2])     # untouched where nothing exceeded 240
    assert np.any(new_scale != scale)


def test_fp8_max_240_load_decodes_to_the_same_weights(qfolder):
    a = jdeep.load(qfolder, weights="codes")
    b = jdeep.load(qfolder, fp8_max=240.0, weights="codes")
    assert b.numerics.trn2_weights and b.numerics.fp8_max == 240.0
    wa = a.params["segments"][-1][0]["attn"]["wq_b"]
    wb = b.params["segments"][-1][0]["attn"]["wq_b"]
    assert not np.any((np.asarray(wb["codes"]) >> 3 & 15) == 15)
    da = np.asarray(dequant(wa, a.numerics, np.float32))
    db = np.asarray(dequant(wb, b.numerics, np.float32))
    changed = da != db
    codes = np.asarray(wa["codes"])
    low_odd = ((codes >> 3 & 15) <= 1) & (codes & 1 == 1)
    assert np.all(low_odd[changed]), "only the documented lowest odd codes may round"
    assert changed.mean() < 1e-3
    la, lb = jdeep.forward(a, PROMPTS[0]), jdeep.forward(b, PROMPTS[0])
    assert np.isfinite(lb).all()
    cos = (la * lb).sum(-1) / np.linalg.norm(la, axis=-1) / np.linalg.norm(lb, axis=-1)
    assert cos.min() > 0.95   # different fp8 range for activations/KV (240), same weights


def test_param_bytes_stay_quantized():
    from jdeep.config.presets import preset
    from jdeep.tools.dev.info import param_bytes_by_dtype

    pb = param_bytes_by_dtype(preset("v4-flash"), "bfloat16")
    assert pb["uint8"] > 0.9 * sum(pb.values())


def test_block_sizes_must_tile_the_config(tmp_path):
    bad = dict(QCFG, head_dim=64, qk_rope_head_dim=16)       # 48 non-rope dims, KV QAT groups of 64
    random_checkpoint(bad, str(tmp_path), seed=1)
    with pytest.raises(ConfigError, match="quantisation block"):
        jdeep.load(tmp_path)
    assert jdeep.load(tmp_path, quantize_activations=False).numerics.quantize_activations is False
