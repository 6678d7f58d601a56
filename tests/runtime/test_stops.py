"""Stop strings over a byte-level BPE (v41-tiny-q's tokenizer.json): found when split across tokens, the
stop string and what follows never shown, streamed text = final text, hold-back released at the end."""

from __future__ import annotations

import pytest
from conftest import golden_path

from jdeep.io.tokenizer import Tokenizer
from jdeep.runtime.stops import StopMatcher

TEXT = "Grüße, 世界! The answer is 42.\n\nUser: more? Ünïcödé ✓"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(golden_path("v41-tiny-q"))


@pytest.mark.parametrize("stop", ["\n\nUser:", "42", "世界", "r is 4", "✓"])
def test_stop_found_across_tokens_and_cut(tok, stop):
    ids = tok.encode(TEXT)
    m = StopMatcher(tok, ["never-there", stop])
    shown = "".join(m.push([t]) for t in ids)
    assert m.stopped and m.text == TEXT[:TEXT.index(stop)] and shown == m.text
    # n_tokens is the first prefix of the ids whose text contains the stop string
    assert stop in tok.decode(ids[:m.n_tokens]) and stop not in tok.decode(ids[:m.n_tokens - 1])
    assert m.push(ids[:3]) == "" and m.finish() == ""           # nothing after a stop


def test_no_stop_streams_everything(tok):
    ids = tok.encode(TEXT)
    for step in (1, 3):
        m = StopMatcher(tok, ["zzz-not-in-text"])
        shown = "".join(m.push(ids[i:i + step]) for i in range(0, len(ids), step))
        assert not m.stopped and len(shown) <= len(TEXT) - len("zzz-not-in-text") + 1   # the tail is held back
        assert shown + m.finish() == TEXT and m.n_tokens == len(ids)


def test_a_stop_string_prefix_is_never_shown_early(tok):
    m = StopMatcher(tok, ["42.\n\nUser"])
    shown = ""
    for t in tok.encode(TEXT):
        shown += m.push([t])
        assert "42" not in shown
    assert m.stopped and shown == TEXT[:TEXT.index("42")]


def test_bad_stop_strings_rejected(tok):
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(tok, [""])
