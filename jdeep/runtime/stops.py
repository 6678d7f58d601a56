"""Stop strings: end a request when its generated text contains one of them (text level, on the host).

The text is rebuilt token by token through the incremental detokenizer, so a stop string split across
tokens is found and the token that completes it is known. The text shown never includes the stop string:
`push` holds back the last (longest stop string - 1) characters until they can no longer start one.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from ..io.tokenizer import Tokenizer

__all__ = ["StopMatcher"]


class StopMatcher:
    """matcher = StopMatcher(tokenizer, ["\\n\\n"]); new_text = matcher.push(ids); matcher.stopped.

    After a stop: `text` is the generated text before the stop string and `n_tokens` the number of tokens
    kept (up to and including the token that completed the stop string)."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], skip_special_tokens: bool = True):
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stops)!r}")
        self.stops = tuple(stops)
        self._detok = tokenizer.detokenizer(skip_special_tokens)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.n_tokens = 0
        self.stopped = False
        self._shown = 0

    def push(self, ids: Iterable[int]) -> str:
        """Feed generated ids (those after a stop are ignored); returns the text that became safe to show."""
        for t in ids:
            if self.stopped:
                break
            self.n_tokens += 1
            self._append(self._detok.push([int(t)]))
        return self._release(final=self.stopped)

    def finish(self) -> str:
        """The request ended without a stop: returns the rest of the text."""
        if not self.stopped:
            self._append(self._detok.flush())
        return self._release(final=True)

    def _append(self, new: str) -> None:
        if not new:
            return
        start = max(0, len(self.text) - self._hold)   # a stop may begin in the held-back tail
        self.text += new
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else max(self._shown, len(self.text) - self._hold)
        new = self.text[self._shown:end]
        self._shown = end
        return new
