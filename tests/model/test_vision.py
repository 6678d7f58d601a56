"""A tiny random DeepSeek-V4.1 checkpoint with vision weights through the real loader: images in prompts
(jdeep.generate), span lengths against the processor's formula, chunking and placement invariance, the chunk
embeddings, and named errors."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import jdeep
from jdeep.model.vision import chunk_embeds
from jdeep.config.small_models import tiny_v41_config
from jdeep.runtime.generate import prefill
from jdeep.runtime.images import IMAGE_PLACEHOLDER, expand_image_prompt
from jdeep.runtime.requests import RequestError
from jdeep.runtime.steps import pack_chunk
from jdeep.tools.testing.random_weights import random_checkpoint
from jdeep.vision.processor import num_image_tokens, plan_image_grid


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v41_vision"))
    random_checkpoint(tiny_v41_config(vision=True), path, seed=3)
    return path


@pytest.fixture(scope="module")
def model(folder):
    return jdeep.load(folder)


def _image(h: int, w: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def test_loader_reads_the_tower(model):
    assert model.vision is not None and model.vision.placement == "device"
    assert model.vision.params["blocks"]["wqkv"].shape == (2, 96, 32)
    assert all("bias_vl" in slot["ffn"]["gate"] for seg in model.params["segments"] for slot in seg)


@pytest.mark.parametrize("size", [(30, 50), (50, 30), (24, 24), (5, 5), (12, 200), (200, 12), (60, 60)])
def test_span_length_is_the_processor_formula(model, size):
    h, w = size
    ip = expand_image_prompt(model, {"text": f"tok7 {IMAGE_PLACEHOLDER} tok8", "images": [_image(h, w)]},
                             model.tokenizer)
    ids, spans = list(ip.ids), ip.spans
    assert len(ip) == len(ids)
    n_h, n_w, _, _ = plan_image_grid(w, h, model.config.vision)
    n = num_image_tokens(n_h, n_w)
    assert n <= model.config.vision.max_tokens
    assert ids.count(model.config.image_token_id) == n == len(spans[0][1])
    assert ids[:1] == model.tokenizer.encode("tok7") and ids[-1:] == model.tokenizer.encode("tok8")
    assert spans[0][0] == 1 and all(t == model.config.image_token_id for t in ids[1:1 + n])


def test_chunk_embeds_write_the_tower_rows(model):
    ip = expand_image_prompt(model, {"text": "tok9", "images": [_image(30, 50)]}, model.tokenizer)
    ids, spans = list(ip.ids), ip.spans
    toks, pos, _ = pack_chunk([np.asarray(ids, np.int32)], [0], 2, 32)
    emb = np.asarray(chunk_embeds(model, toks, pos, [spans, []]))
    start, rows = spans[0]
    table = np.asarray(model.params["embed"])
    np.testing.assert_array_equal(emb[0, start:start + len(rows)], rows)
    np.testing.assert_array_equal(emb[0, len(rows)], table[ids[len(rows)]])          # the text token after it
    np.testing.assert_array_equal(emb[1, 0], table[toks[1, 0]])                       # a row without images


def test_image_changes_the_answer_and_chunking_does_not(model):
    prompt = {"text": f"tok7 tok8 {IMAGE_PLACEHOLDER} tok9", "images": [_image(30, 50)]}
    other = {"text": f"tok7 tok8 {IMAGE_PLACEHOLDER} tok9", "images": [_image(30, 50, seed=1)]}
    whole = jdeep.generate(model, [prompt, other], max_new_tokens=3, return_logits=True)
    chunked = jdeep.generate(model, [prompt], max_new_tokens=3, return_logits=True, prefill_chunk=8)
    np.testing.assert_allclose(chunked.logits[0], whole.logits[0], rtol=1e-5, atol=1e-5)
    assert not np.allclose(whole.logits[0, 0], whole.logits[1, 0], atol=1e-3)


def test_host_and_device_towers_give_the_same_logits(folder, model):
    host = jdeep.load(folder, vision_placement="host")
    assert host.vision.placement == "host" and host.vision.device.platform == "cpu"
    prompt = [{"text": "tok5", "images": [_image(40, 33)]}]
    a = jdeep.generate(model, prompt, max_new_tokens=2, return_logits=True).logits
    b = jdeep.generate(host, prompt, max_new_tokens=2, return_logits=True).logits
    np.testing.assert_array_equal(a, b)


def test_host_embedding_model_takes_image_rows(folder, model):
    he = jdeep.load(folder, host_embedding=True)
    prompt = [{"text": "tok5", "images": [_image(40, 33)]}]
    a = jdeep.generate(model, prompt, max_new_tokens=2, return_logits=True).logits
    b = jdeep.generate(he, prompt, max_new_tokens=2, return_logits=True).logits
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_prefill_with_two_images(model):
    ip = expand_image_prompt(model, {"text": f"{IMAGE_PLACEHOLDER} tok3 {IMAGE_PLACEHOLDER}",
                                     "images": [_image(24, 24), _image(30, 60)]}, model.tokenizer)
    ids, spans = list(ip.ids), ip.spans
    assert len(spans) == 2 and spans[1][0] == len(spans[0][1]) + 1
    state = model.init_state(1, 256)
    logits, _ = prefill(model, state, [np.asarray(ids, np.int32)], 16, model.new_history(1), images=[spans])
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("prompt, message", [
    ({"text": f"{IMAGE_PLACEHOLDER} {IMAGE_PLACEHOLDER}", "images": [None]}, "2 image placeholders"),
    ({"text": "tok1", "images": [b"not an image"]}, "image 0: cannot decode image"),
    ({"text": "tok1", "images": "cat.png"}, "images must be a list"),
    ({"text": "tok1", "image": []}, "unknown keys"),
    ({"text": "tok1", "images": ["https://example.com/x.png"]}, "not fetched"),
    ({"text": "tok1", "images": [b"x"] * 17}, "17 images; at most 16"),
])
def test_bad_image_prompts_are_named(model, prompt, message):
    with pytest.raises(RequestError, match=message):
        jdeep.generate(model, [prompt], max_new_tokens=1)


def test_model_without_a_tower_refuses_images(tmp_path):
    random_checkpoint(tiny_v41_config(), str(tmp_path), seed=0)
    m = jdeep.load(str(tmp_path))
    assert m.vision is None
    with pytest.raises(RequestError, match="no vision tower"):
        jdeep.generate(m, [{"text": "tok1", "images": [_image(10, 10)]}], max_new_tokens=1)
