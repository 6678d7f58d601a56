"""The shipped demo model (jdeep/demo_model, scripts/train_demo_model.py): a DeepSeek-format quantized checkpoint
with DeepSeek-V4's special tokens that has learned its data — on a held-out stdlib file its perplexity is more
than ten times below that of the unigram model of its tokenizer over the training split — and `jdeep demo`
completes Python prompts as streamed text."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from tokenizers import Tokenizer

import jdeep
from jdeep.cli import main
from jdeep.cli.commands import DEMO_MODEL, DEMO_PROMPTS
from jdeep.io.chat.formats import BOS, EOS
from jdeep.param_spec import weight_formats
from jdeep.tools.quality.evaluate import TokenStats, score_text
from jdeep.tools.quality.stdlib_corpus import read_text, stdlib_files


@pytest.fixture(scope="module")
def model():
    return jdeep.load(DEMO_MODEL)


def test_published_format_and_special_tokens(model):
    assert weight_formats(model.config)[:2] == ("fp8", "fp4") and model.numerics.quantize_activations
    tok = model.tokenizer
    assert tok.encode(BOS) == [model.config.bos_token_id] and tok.encode(EOS) == [model.config.eos_token_id]
    ids = tok.chat([{"role": "user", "content": "print('hi')"}])
    assert ids[0] == model.config.bos_token_id and tok.decode(ids) == "print('hi')"


def test_held_out_perplexity_is_far_below_the_unigram_model(model):
    train, val = stdlib_files()
    text = next(t for t in map(read_text, val) if len(t) > 8000)                    # the first long held-out file
    ids = np.asarray([0] + model.tokenizer.encode(text), np.int32)[:1025]
    stats = TokenStats()
    score_text(model, ids, stats, context=256, stride=128, chunk=256)
    tok = Tokenizer.from_file(os.path.join(DEMO_MODEL, "tokenizer.json"))
    counts = np.ones(model.config.vocab_size)                                      # add-one smoothed
    for enc in tok.encode_batch([read_text(f) for f in train], add_special_tokens=False):
        counts += np.bincount(enc.ids, minlength=len(counts))
    unigram = math.exp(-np.mean(np.log(counts[ids[1:]] / counts.sum())))
    assert stats.summary()["ppl"] < unigram / 10, (stats.summary()["ppl"], unigram)


def test_demo_streams_completions(capsys):
    assert main(["demo", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert all(p in out for p in DEMO_PROMPTS) and out.count("tokens/s") == len(DEMO_PROMPTS)
