"""tokenizer.json through `tokenizers`: text round trip, DeepSeek's chat layout, and incremental
detokenisation that emits whole UTF-8 characters only (v41-tiny-q's byte-level BPE splits them)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import golden_path

from jdeep.io.chat import V4, V41, encode_chat
from jdeep.io.tokenizer import Tokenizer

TEXT = "Grüße, 世界! Ünïcödé ✓ 🙂 and plain ascii\nnew line"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(golden_path("v41-tiny-q"))


def test_round_trip(tok):
    ids = tok.encode(TEXT)
    assert len(ids) > 10 and max(ids) < tok.vocab_size
    assert tok.decode(ids) == TEXT


def test_incremental_detokenizer_emits_whole_characters(tok):
    ids = tok.encode(TEXT)
    for step in (1, 2, 3):
        d = tok.detokenizer()
        chunks = [d.push(ids[i:i + step]) for i in range(0, len(ids), step)]
        chunks.append(d.flush())
        assert "".join(chunks) == TEXT
        assert not any(c.endswith("\ufffd") for c in chunks if c)
    # multi-byte characters really are split across tokens in this tokenizer (the test has teeth)
    assert any("\ufffd" in tok.decode(ids[:k]) for k in range(1, len(ids)))


def test_incremental_matches_full_decode_on_random_ids(tok):
    rng = np.random.default_rng(0)
    ids = rng.integers(3, tok.vocab_size, size=200).tolist()
    d = tok.detokenizer()
    text = "".join(d.push([i]) for i in ids) + d.flush()
    assert text == tok.decode(ids)


def test_chat_is_the_encoded_chat_prompt(tok):
    """Tokenizer.chat encodes io/chat's prompt (its layout is tested against DeepSeek's encoders in tests/io/chat)."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "1+1?"}]
    for fmt in (V4, V41):
        for thinking in (False, True):
            text = encode_chat(fmt, msgs, thinking=thinking)
            assert tok.chat(msgs, thinking=thinking, fmt=fmt) == tok.encode(text)
            assert tok.decode(tok.chat(msgs, thinking=thinking, fmt=fmt), skip_special_tokens=False) == text
    with pytest.raises(ValueError, match="last message"):
        tok.chat(msgs[:3])


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(tmp_path)
