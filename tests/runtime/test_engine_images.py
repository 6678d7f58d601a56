"""Prompts with images in the Engine (DeepSeek-V4.1 with a vision tower): the tokens jdeep.generate gives, with
chunks cutting the image span and a text request beside it; the prefix cache never reuses state past the first
image (the span's positions all hold image_token_id, whatever the image)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import jdeep
from jdeep import SamplingParams
from jdeep.config.small_models import tiny_v41_config
from jdeep.runtime.engine import Engine
from jdeep.runtime.images import IMAGE_PLACEHOLDER
from jdeep.tools.testing.random_weights import random_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v41_vision_engine"))
    random_checkpoint(tiny_v41_config(vision=True), path, seed=5)
    return jdeep.load(path)


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (30, 50, 3), dtype=np.uint8))


def _prompt(seed: int) -> dict:
    return {"text": f"tok7 tok8 tok9 {IMAGE_PLACEHOLDER} tok10", "images": [_image(seed)]}


def test_engine_matches_generate(model):
    # both in 16-token chunks: XLA:CPU's products round differently at other widths, and DeepSeek's fp8 activations
    # can turn that last-bit difference into another token on random weights (docs/performance.md)
    want = jdeep.generate(model, [_prompt(0), "tok7 tok8"], max_new_tokens=4, prefill_chunk=16).tokens
    engine = Engine(model, max_num_seqs=2, max_len=128, prefill_chunk=16)
    a = engine.add_request(_prompt(0), SamplingParams(max_new_tokens=4))
    b = engine.add_request("tok7 tok8", SamplingParams(max_new_tokens=4))
    out = engine.run()
    assert out[a].tokens == want[0].tolist() and out[b].tokens == want[1].tolist()
    assert out[a].prompt.count(model.config.image_token_id) == 20      # 30x50 px: a 3x5 grid, 3·6 + 2


def test_prefix_cache_stops_before_the_image(model):
    """Prompts of 150 tokens: without the cut the cache would snapshot at 128, past the image, and the second
    request (same ids, another image) would start from the first one's image."""
    def long(seed):
        text = f"tok7 tok8 {IMAGE_PLACEHOLDER} " + " ".join(f"tok{20 + i}" for i in range(128))
        return {"text": text, "images": [_image(seed)]}

    engine = Engine(model, max_num_seqs=1, max_len=256, prefill_chunk=64, prefix_cache_bytes=64 << 20)
    first = engine.add_request(long(0), SamplingParams(max_new_tokens=3))
    engine.run()
    second = engine.add_request(long(1), SamplingParams(max_new_tokens=3))
    out = engine.run()
    assert out[first].prompt == out[second].prompt and len(out[first].prompt) > 128
    want = jdeep.generate(model, [long(1)], max_new_tokens=3, prefill_chunk=64).tokens[0].tolist()
    assert out[second].tokens == want


def test_engines_without_image_steps_refuse_them(model):
    class NoImages(Engine):
        images_unsupported = True

    engine = NoImages(model, max_num_seqs=1, max_len=128, prefill_chunk=16)
    rid = engine.add_request(_prompt(0), SamplingParams(max_new_tokens=1))
    out = engine.run()[rid]
    assert out.finish_reason == "error" and "does not take prompts with images" in out.error
