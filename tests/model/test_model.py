"""Self-consistency of the cached model for any compress ratio: the logits of chunked prefill and of
step-by-step decode equal a single no-cache forward over the same tokens."""

from __future__ import annotations

import numpy as np
import pytest

import jdeep
from jdeep.config.small_models import TINY_CONFIG
from jdeep.tools.testing.random_weights import random_checkpoint

CONFIGS = {
    # DeepSeek spelling: ratio 4 overlaps and has an indexer, other ratios pool plainly.
    "ratios_1_3_4_7": {"compress_ratios": [1, 3, 4, 7, 0, 0], "num_hidden_layers": 5, "num_hash_layers": 1},
    # transformers spelling: an overlapping indexed ratio-2 layer kind and a ratio-1 layer kind.
    "csa2_hca1": {"layer_types": ["compressed_sparse_attention", "heavily_compressed_attention",
                                  "sliding_attention", "compressed_sparse_attention"],
                  "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 1},
                  "num_hidden_layers": 4, "num_hash_layers": 0},
}


@pytest.fixture(scope="module", params=["ratios_1_3_4_7", pytest.param("csa2_hca1", marks=pytest.mark.full)])
def model(request, tmp_path_factory):
    """A random model per config, loaded.

    Full tier (the csa2_hca1 config): tests/model/test_model.py::test_decode_and_chunked_prefill_equal_forward
    [ratios_1_3_4_7] covers the model's decode and chunked prefill against its forward at ratios 1, 3, 4 and 7 in the
    default run; tests/layers/test_compressor.py::test_chunked_prefill_and_decode_match covers overlapping and plain
    pooling at several ratios, and tests/test_config.py::test_any_compress_ratio_via_layer_types the transformers
    spelling of any ratio."""
    raw = {k: v for k, v in TINY_CONFIG.items() if k not in ("layer_types", "compress_rates")}
    raw.update(CONFIGS[request.param])
    raw["index_topk"] = 3
    folder = tmp_path_factory.mktemp(request.param)
    random_checkpoint(raw, str(folder), seed=5)
    return jdeep.load(folder)


def test_decode_and_chunked_prefill_equal_forward(model):
    """Chunked prefill (chunks of 8) and step-by-step decode give the logits of one no-cache forward. The csa2_hca1
    config is in the full tier.

    Full tier: tests/model/test_model.py::test_decode_and_chunked_prefill_equal_forward[ratios_1_3_4_7] covers the
    cached model's overlapping (ratio 4, indexed) and plain (ratios 1, 3, 7) compressor layers end to end in the
    default run, and tests/layers/test_compressor.py the pooling at several ratios."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 512, size=n).tolist() for n in (37, 5)]
    out = jdeep.generate(model, prompts, max_new_tokens=12, return_logits=True, prefill_chunk=8)
    for b, prompt in enumerate(prompts):
        seq = prompt + out.tokens[b, :-1].tolist()
        full = jdeep.forward(model, seq)
        rows = full[len(prompt) - 1:]
        np.testing.assert_allclose(out.logits[b], rows, atol=2e-5, rtol=0)
        # the greedy choice is the forward's argmax (up to exact ties)
        np.testing.assert_array_equal(out.tokens[b], np.argmax(rows, axis=-1))


def test_invalid_inputs_are_rejected(model):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        jdeep.generate(model, [[0, 1, model.config.vocab_size]])
    with pytest.raises(ValueError, match="non-empty"):
        jdeep.generate(model, [[]])
    with pytest.raises(ValueError, match="max_new_tokens"):
        jdeep.generate(model, [[0, 1]], max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        jdeep.generate(model, [[0, 1]], temperature=-1.0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        jdeep.generate(model, [[0, 1]], max_new_tokens=model.config.max_position_embeddings)
