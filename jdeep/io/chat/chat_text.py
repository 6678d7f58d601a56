"""A chat prompt's text that remembers which parts the encoder wrote and which came from the messages.

DeepSeek's role markers, `<think>`, the DSML tags and the image placeholder are special tokens. The chat encoder
writes them around the messages; the same strings typed inside a message (a user's text, a tool result, a tool's
schema) must stay text, or a user could forge a turn boundary or a tool result. `ChatText` is a `str` (the prompt
exactly as DeepSeek's encoders lay it out, so it compares, prints and measures as before) whose `parts` say, for
each stretch, whether it is markup (the encoder's: its special-token strings are the special tokens) or content
(the messages': its special-token strings are plain text). `Tokenizer.encode` reads the parts; for content
without special-token strings the ids are those of the joined string.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["ChatText", "markup", "content"]


class ChatText(str):
    """str(prompt) plus `parts`: ((text, is_markup), ...) in order, joining to the string."""

    parts: tuple[tuple[str, bool], ...]

    def __new__(cls, parts: Iterable[tuple[str, bool]] = ()):
        parts = tuple((t, bool(m)) for t, m in parts if t)
        obj = super().__new__(cls, "".join(t for t, _ in parts))
        obj.parts = parts
        return obj

    def __add__(self, other):
        """ChatText + ChatText keeps both parts; + a plain str is a plain str (say which kind it is first)."""
        if isinstance(other, ChatText):
            return ChatText(self.parts + other.parts)
        return str(self) + other

    def __radd__(self, other):
        if isinstance(other, ChatText):
            return ChatText(other.parts + self.parts)
        return other + str(self)

    def __getnewargs__(self):
        return (self.parts,)

    def split(self, marker: str, maxsplit: int = -1) -> list:   # type: ignore[override]
        """The prompt cut at each `marker` the encoder wrote (in markup parts; a marker inside content is text
        and does not cut), as ChatTexts."""
        if maxsplit != -1:
            raise ValueError("ChatText.split takes no maxsplit")
        pieces: list[list[tuple[str, bool]]] = [[]]
        for t, is_markup in self.parts:
            if not is_markup:
                pieces[-1].append((t, False))
                continue
            bits = t.split(marker)
            for k, bit in enumerate(bits):
                if k:
                    pieces.append([])
                pieces[-1].append((bit, True))
        return [ChatText(p) for p in pieces]


def markup(text: str) -> ChatText:
    """Text the encoder writes: its special-token strings are special tokens."""
    return ChatText([(text, True)])


def content(text: str) -> ChatText:
    """Text from a message: its special-token strings are text."""
    return ChatText([(text, False)])
