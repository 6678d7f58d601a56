"""Writing DeepSeek-format checkpoints from float weights: a float tree maps back to the checkpoint's tensors
exactly, and a checkpoint quantized by DeepSeek's recipe loads to the same logits as the float weights after that
quantisation (decoded in numpy, float64 oracles of the codecs)."""

from __future__ import annotations

import numpy as np
import pytest

import jdeep
from jdeep.io.safetensors import CheckpointReader
from jdeep.io.writer import float_config, named_tensors, quantize_weight, write_checkpoint
from jdeep.param_spec import FP4, FP4_BLOCK, FP8, FP8_DEQUANT, TensorSpec, expected_tensors
from jdeep.plan import build_plan
from jdeep.config.small_models import TINY_CONFIG
from jdeep.tools.quality.mtp_eval import window_logits
from jdeep.tools.testing.random_weights import random_checkpoint

QCFG = dict(TINY_CONFIG, head_dim=128, qk_rope_head_dim=64, index_head_dim=64, num_hidden_layers=2,
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention"], num_hash_layers=1,
            num_nextn_predict_layers=1,
            quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                 "weight_block_size": [32, 32], "expert_dtype": "fp4"})
PROMPT = [0, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]


def _e4m3(codes: np.ndarray) -> np.ndarray:
    """float64 values of OCP e4m3fn bytes (no NaN among the codes written here)."""
    c = codes.astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e, m = (c >> 3) & 0xF, c & 0x7
    return sign * np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))


def _e2m1(nibbles: np.ndarray) -> np.ndarray:
    c = nibbles.astype(np.int64)
    mag = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)[c & 0x7]
    return np.where(c & 0x8, -mag, mag)


def _dequantized(q: dict, spec: TensorSpec) -> np.ndarray:
    """What a quantized tensor's codes and ue8m0 scales stand for, float64 [N, K]."""
    scale = 2.0 ** (q[spec.scale_name].view(np.uint8).astype(np.int64) - 127)
    if spec.fmt == FP4:
        packed = q[spec.name].view(np.uint8)
        codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)   # low nibble first
        return _e2m1(codes) * np.repeat(scale, FP4_BLOCK, axis=1)
    N, K = spec.shape
    bn, bk = spec.block
    return _e4m3(q[spec.name].view(np.uint8)) * np.repeat(np.repeat(scale, bn, 0), bk, 1)[:N, :K]


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("f")
    random_checkpoint(float_config(jdeep.ModelConfig.from_dict(QCFG)).to_dict(), str(folder), seed=5)
    return folder, jdeep.load(folder, mtp=True)


def test_float_tree_maps_back_to_the_checkpoint_tensors(float_model):
    folder, model = float_model
    named = named_tensors(model.config, model.plan, model.params)
    reader = CheckpointReader(str(folder))
    assert set(named) == set(reader.keys())
    for name, value in named.items():
        np.testing.assert_array_equal(value, reader.get(name), err_msg=name)


def test_quantized_checkpoint_loads_to_the_logits_of_the_quantized_weights(float_model, tmp_path):
    _, model = float_model
    named = named_tensors(model.config, model.plan, model.params)
    qconfig = write_checkpoint(tmp_path / "q", QCFG, named)
    reference = dict(named)                       # the float weights after DeepSeek's quantisation, decoded
    n_quantized = 0
    for name, spec, _ in expected_tensors(qconfig, build_plan(qconfig, mtp=True)):
        if spec.fmt in (FP8, FP8_DEQUANT, FP4):
            full = TensorSpec(name, spec.path, spec.shape, spec.kind, spec.expert, spec.fmt, spec.block)
            reference[name] = _dequantized(quantize_weight(named[name], full), full).astype(np.float32)
            n_quantized += 1
    assert n_quantized > 10
    raw_float = float_config(qconfig).to_dict()
    write_checkpoint(tmp_path / "ref", raw_float, reference)
    q = jdeep.load(tmp_path / "q", quantize_activations=False, mtp=True)
    ref = jdeep.load(tmp_path / "ref", mtp=True)
    np.testing.assert_allclose(jdeep.forward(q, PROMPT), jdeep.forward(ref, PROMPT), rtol=0, atol=2e-5)
    for a, b in zip(window_logits(q, np.asarray(PROMPT)), window_logits(ref, np.asarray(PROMPT))):  # and MTP's
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)
    # and DeepSeek's numerics run on the written checkpoint
    assert np.isfinite(jdeep.forward(jdeep.load(tmp_path / "q"), PROMPT)).all()
    written = CheckpointReader(str(tmp_path / "q"))
    assert written.entry("layers.0.ffn.experts.0.w1.weight").dtype == "I8"            # packed fp4
    assert written.entry("layers.0.attn.wq_a.weight").dtype == "F8_E4M3"
    assert written.entry("layers.0.attn.wq_a.scale").dtype == "F8_E8M0"
    assert written.entry("mtp.0.e_proj.weight").dtype == "F8_E4M3" and written.entry("mtp.0.enorm.weight").dtype == "F32"
    assert written.entry("mtp.0.ffn.experts.0.w2.weight").dtype == "I8"
