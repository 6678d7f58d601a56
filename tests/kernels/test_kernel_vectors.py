"""jdeep's ops reproduce DeepSeek's kernels on the fixed vectors of ../shared/golden/v4-tiny-q/kernel_vectors.npz
(act_quant incl. the amax floor, exact power-of-two amax and e4m3 ties; fp4 quant incl. e2m1 ties; Hadamard;
mHC split + Sinkhorn; sparse attention with -1 indices; fp8 and fp4 GEMMs)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import golden_path

from jdeep.kernels import codecs, quant
from jdeep.kernels.reference import sparse_attention
from jdeep.layers.mhc import hc_split_sinkhorn


@pytest.fixture(scope="module")
def kv():
    return np.load(golden_path("v4-tiny-q") / "kernel_vectors.npz")


@pytest.mark.parametrize("block", [128, 64])
def test_act_quant_bit_exact(kv, block):
    x = jnp.asarray(kv["act_quant_x"])
    q, s = quant.act_quant(x, block)
    np.testing.assert_array_equal(np.asarray(q), kv[f"act_quant_b{block}_q"])
    np.testing.assert_array_equal(np.asarray(s), kv[f"act_quant_b{block}_s"])
    np.testing.assert_array_equal(np.asarray(quant.fp8_fake_quant(x, block)), kv[f"act_quant_b{block}_inplace"])


def test_fp4_quant_bit_exact(kv):
    x = jnp.asarray(kv["fp4_quant_x"])
    np.testing.assert_array_equal(np.asarray(quant.fp4_fake_quant(x, 32)), kv["fp4_quant_b32_inplace"])
    # the codes and scales behind it, as the packed checkpoint format stores them
    s = kv["fp4_quant_b32_s"]
    xb = kv["fp4_quant_x"].reshape(16, 4, 32) / s[..., None]
    codes = codecs.e2m1_encode(np, xb.reshape(16, 128).astype(np.float32))
    np.testing.assert_array_equal(codecs.pack_e2m1(np, codes), kv["fp4_quant_b32_codes"])


@pytest.mark.parametrize("n", [64, 128])
def test_hadamard_bit_exact(kv, n):
    np.testing.assert_array_equal(np.asarray(quant.hadamard(jnp.asarray(kv[f"hadamard_{n}_x"]))), kv[f"hadamard_{n}_y"])


def test_hc_split_sinkhorn(kv):
    pre, post, comb = hc_split_sinkhorn(jnp.asarray(kv["hc_mixes"]), jnp.asarray(kv["hc_scale"]),
                                        jnp.asarray(kv["hc_base"]), n=4, hc_eps=1e-6, sinkhorn_iters=20)
    np.testing.assert_allclose(np.asarray(pre), kv["hc_pre"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(post), kv["hc_post"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(comb), kv["hc_comb"], rtol=0, atol=1e-6)


def test_sparse_attention_with_minus_one_indices(kv):
    q, keys, idx = kv["attn_q"], kv["attn_kv"], kv["attn_idx"]
    assert (idx < 0).any()
    sel = np.take_along_axis(keys[:, None], np.clip(idx, 0, None)[..., None], axis=2)     # [1, S, K, D]
    shared = keys[:, :1]
    out = sparse_attention(jnp.asarray(q), jnp.asarray(shared), jnp.zeros((1, q.shape[1], 1), bool),
                           jnp.asarray(sel), jnp.asarray(idx >= 0), jnp.asarray(kv["attn_sink"]),
                           float(kv["attn_scale"]))
    np.testing.assert_allclose(np.asarray(out), kv["attn_o"], rtol=0, atol=2e-6)


def _dequant_act(kv):
    q, s = kv["gemm_a_q"], kv["gemm_a_s"]
    return (q.reshape(3, -1, 128) * s[..., None]).reshape(3, -1)


def test_fp8_gemm(kv):
    """Block-scaled fp8 x fp8 GEMM: jdeep decodes the uint8 codes and ue8m0 exponents in the graph and
    multiplies the exact values with fp32 accumulation (a different summation order than the tiled kernel)."""
    from jdeep.layers.linear import dense
    from jdeep.numerics import Numerics

    w = kv["fp8_gemm_w"]
    codes = codecs.e4m3_encode(np, w.astype(np.float32)).astype(np.uint8)
    np.testing.assert_array_equal(codecs.e4m3_decode(np, codes), w)             # the weights are fp8 values
    scale = codecs.ue8m0_encode(np, kv["fp8_gemm_ws"]).astype(np.uint8)
    y = dense(jnp.asarray(kv["gemm_a"]), {"codes": jnp.asarray(codes), "scale": jnp.asarray(scale)},
              Numerics(quantize_activations=True))
    ref = kv["fp8_gemm_out"]
    np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(ref).max())


def test_fp4_gemm(kv):
    from jdeep.layers.linear import dense
    from jdeep.numerics import Numerics

    scale = codecs.ue8m0_encode(np, kv["fp4_gemm_ws"]).astype(np.uint8)
    y = dense(jnp.asarray(kv["gemm_a"]), {"packed": jnp.asarray(kv["fp4_gemm_w_packed"]), "scale": jnp.asarray(scale)},
              Numerics(quantize_activations=True))
    ref = kv["fp4_gemm_out"]
    np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(ref).max())
    # the input really was act-quantised first: the product of the unquantised input differs
    raw = dense(jnp.asarray(kv["gemm_a"]), {"packed": jnp.asarray(kv["fp4_gemm_w_packed"]), "scale": jnp.asarray(scale)},
                Numerics(quantize_activations=False))
    assert np.abs(np.asarray(raw) - ref).max() > 1e-3
