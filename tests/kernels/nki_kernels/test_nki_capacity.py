"""Every kernel fits a trn2 NeuronCore's on-chip memory at the released models' largest per-partition shapes: the
emulation counts SBUF per partition while each tile lives (224 KiB) and PSUM in 2 KiB banks (16 KiB) and refuses
a launch that exceeds either (tests/nki_emulation). What a kernel holds per partition depends on its widths (D,
the key list of one query, k, the expert matrices), not on how many tiles it runs, so each case is one row tile at
the widest width of V4-Flash, V4-Pro or V4.1-Flash (V4-Pro unless named): a decode query of a ratio-128 layer at
1M context (8321 keys), a CSA query with V4-Pro's top-1024, the top-k of V4.1's 2048 candidate blocks and of V4-Pro's
indexer over rows longer than one instruction's 16384 elements, V4-Pro's fp4 expert (7168 x 3072), V4-Pro's hidden
and mHC widths, the ratio-128 pooling. Inputs are zeros: only the allocations matter. `-s` prints the peaks (the
table in docs/kernels.md)."""

from __future__ import annotations

import ml_dtypes
import nki
import numpy as np
import pytest
from nki_testing import LNC

from jdeep.kernels.nki import attention, gemm, indexer, mhc, moe, norm, pool, topk

pytestmark = pytest.mark.skipif(not getattr(nki, "EMULATED", False), reason="the capacity count is the emulation's")

BF16 = ml_dtypes.bfloat16
SBUF, PSUM = 224 * 1024, 16 * 1024


def _z(*shape, dtype=np.float32):
    return np.zeros(shape, dtype)


CASES = {
    "attention HCA 1M": (attention.sparse_attention_shared_kernel,
                         (_z(1, 1, 128, 512, dtype=BF16), _z(1, 8321, 512, dtype=BF16), _z(1, 1, 8321, dtype=np.uint8),
                          _z(128), 0.044)),
    "attention CSA top-1024": (attention.sparse_attention_kernel,
                               (_z(1, 1, 128, 512, dtype=BF16), _z(1, 129, 512, dtype=BF16),
                                _z(1, 1, 129, dtype=np.uint8), _z(128), 0.044, _z(1, 1, 1024, 512, dtype=BF16),
                                _z(1, 1, 1024, dtype=np.uint8))),
    "index_scores": (indexer.index_scores_kernel,
                     (_z(1, 128, 64, 128, dtype=BF16), _z(1, 1024, 128, dtype=BF16), _z(1, 128, 64),
                      np.full((1, 128), 1024, np.int32))),
    "topk V4.1 blocks k=2048": (topk.topk_kernel, (np.arange(2 * 16384 + 100, dtype=np.float32)[None], 2048)),
    "topk V4-Pro k=1024": (topk.topk_kernel, (np.arange(2 * 16384 + 100, dtype=np.float32)[None], 1024)),
    "rms_norm": (norm.rmsnorm_kernel, (_z(128, 7168, dtype=BF16), _z(7168) + 1, 1e-6)),
    "fp8_linear": (gemm.fp8_linear_kernel, (_z(128, 7168, dtype=BF16), _z(1536, 7168, dtype=np.uint8),
                                            np.full((12, 56), 127, np.uint8), 128, 128)),
    "hc_mix_logits": (mhc.hc_mix_logits_kernel, (_z(128, 4 * 7168, dtype=BF16), _z(24, 4 * 7168), 1e-6)),
    "hc_sinkhorn": (mhc.hc_sinkhorn_kernel, (_z(128, 24), _z(3), _z(24), 4, 1e-6, 20)),
    "hc_collapse": (mhc.hc_collapse_kernel, (_z(128, 4, 7168, dtype=BF16), _z(128, 4))),
    "hc_expand": (mhc.hc_expand_kernel, (_z(128, 7168, dtype=BF16), _z(128, 4), _z(128, 16),
                                         _z(128, 4, 7168, dtype=BF16))),
    "softmax_pool ratio 128": (pool.softmax_pool_kernel, (_z(128, 128, 512), _z(128, 128, 512))),
    "expert gate/up fp4": (moe.expert_gate_up_kernel,
                           (_z(1, 7168, dtype=BF16), _z(1) + 1, np.zeros(1, np.int32), _z(1, 3072, 3584, dtype=np.uint8),
                            np.full((1, 3072, 224), 127, np.uint8), _z(1, 3072, 3584, dtype=np.uint8),
                            np.full((1, 3072, 224), 127, np.uint8), 10.0, 1, "fp4", (1, 32))),
    "expert down fp4": (moe.expert_down_kernel,
                        (_z(1, 3072, dtype=BF16), np.zeros(1, np.int32), _z(1, 7168, 1536, dtype=np.uint8),
                         np.full((1, 7168, 96), 127, np.uint8), 1, "fp4", (1, 32))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_released_widths_fit_sbuf_and_psum(case):
    body, args = CASES[case]
    nki.simulate(nki.jit(body)[LNC])(*args)          # refused inside if a program exceeds SBUF or PSUM
    stats = nki.launch_stats()
    print(f"{case:28s} SBUF {stats['sbuf_peak_bytes'] / 1024:6.1f} KiB  PSUM {stats['psum_peak_bytes'] / 1024:5.1f} KiB")
    assert 0 < stats["sbuf_peak_bytes"] <= SBUF and stats["psum_peak_bytes"] <= PSUM
