"""Image + text chat through `jdeep serve` on a tiny random DeepSeek-V4.1 checkpoint with vision weights (the
official `openai` client): image_url parts as data: URLs give the reply jdeep.generate gives for the same prompt
and images; other URLs and undecodable images get a 400 naming the part."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

import jdeep
from jdeep.io.chat import FORMATS, encode_chat
from jdeep.runtime.engine import Engine
from jdeep.config.small_models import tiny_v41_config
from jdeep.serve.server import ServerSettings, background_server
from jdeep.tools.testing.random_weights import random_checkpoint, write_word_tokenizer


def _data_url(h: int, w: int, seed: int) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("v41_vision_serve"))
    config = random_checkpoint(tiny_v41_config(vision=True), folder, seed=4)
    write_word_tokenizer(f"{folder}/tokenizer.json", config.vocab_size, chat_markers=True)
    model = jdeep.load(folder)
    engine = Engine(model, max_num_seqs=2, max_len=256, prefill_chunk=32)
    with background_server(engine, ServerSettings("tiny-v41-vision", chat_format="v41")) as (url, _):
        yield model, openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=300)


def test_image_chat_replies_as_generate_does(srv):
    model, client = srv
    url = _data_url(30, 50, 0)
    messages = [{"role": "user", "content": [{"type": "text", "text": "tok7 tok8"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    r = client.chat.completions.create(model="tiny-v41-vision", messages=messages, max_tokens=4, temperature=0)
    prompt = encode_chat(FORMATS["v41"], messages)
    want = jdeep.generate(model, [{"text": prompt, "images": [url]}], max_new_tokens=4)
    assert r.choices[0].message.content == want.texts[0]
    n_span = 3 * (5 + 1) + 2        # 30x50 px: 8x13 patches of 4 px, a 3x5 token grid (processor formula)
    assert r.usage.prompt_tokens == len(model.tokenizer.encode(prompt.replace("<｜deepseek_image｜>", ""))) + n_span


def test_two_images_and_plain_text_in_one_server(srv):
    _, client = srv
    content = [{"type": "image_url", "image_url": {"url": _data_url(24, 24, 1)}}, {"type": "text", "text": "tok9"},
               {"type": "image_url", "image_url": _data_url(60, 20, 2)}]
    r = client.chat.completions.create(model="tiny-v41-vision", messages=[{"role": "user", "content": content}],
                                       max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    plain = client.chat.completions.create(model="tiny-v41-vision", messages=[{"role": "user", "content": "tok9"}],
                                           max_tokens=2, temperature=0)
    assert plain.usage.prompt_tokens < r.usage.prompt_tokens


@pytest.mark.parametrize("url, message", [("https://example.com/cat.png", "not fetched"),
                                          ("data:image/png;base64,AAAA", "cannot decode image"),
                                          ("/etc/hostname", "not fetched")])
def test_bad_image_parts_get_400(srv, url, message):
    _, client = srv
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model="tiny-v41-vision", messages=messages, max_tokens=2)
