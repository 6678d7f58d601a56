"""Text in and out: a checkpoint's tokenizer.json through the `tokenizers` library, chat prompts in DeepSeek's
format (io/chat), and incremental detokenisation that only ever emits complete UTF-8 text."""

from __future__ import annotations

import os
import re
import threading
from typing import Iterable, Sequence

from tokenizers import Tokenizer as _Tok

from .chat import V4, ChatFormat, encode_chat
from .chat.chat_text import ChatText

__all__ = ["Tokenizer", "IncrementalDetokenizer"]


class Tokenizer:
    """A tokenizer.json (Hugging Face `tokenizers`) with DeepSeek's chat format."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer.json at {path}: text prompts need the checkpoint's tokenizer")
        self.path = path
        self._tok = _Tok.from_file(path)
        self._plain: _Tok | None = None           # special-token strings as text (built at first use)
        self._lock = threading.Lock()
        specials = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special and t.content]
        self._specials = {c: self._tok.token_to_id(c) for c in specials}
        self._special_re = (re.compile("|".join(re.escape(c) for c in sorted(specials, key=len, reverse=True)))
                            if specials else None)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Text -> ids. A plain str is read as written: special-token strings (the chat markers) become their ids.
        A ChatText (io/chat: a chat prompt) makes them ids only where the chat encoder wrote them; inside the
        messages' text they are text. The encoding itself runs without the GIL (a long prompt does not stall the
        process's other threads)."""
        if isinstance(text, ChatText):
            return self._encode_chat_text(text)
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def _plain_tokenizer(self) -> _Tok:
        with self._lock:
            if self._plain is None:
                plain = _Tok.from_file(self.path)
                plain.encode_special_tokens = True
                self._plain = plain
        return self._plain

    def _encode_chat_text(self, text: ChatText) -> list[int]:
        """Markup's special tokens as ids; every stretch between them (content and the rest of the markup) encoded
        with special-token strings as text. A tokenizer splits its input at special tokens before anything else,
        so for content without special-token strings this is the encoding of the joined string."""
        pieces: list[str | int] = [""]
        for part, is_markup in text.parts:
            at = 0
            for m in (self._special_re.finditer(part) if is_markup and self._special_re is not None else ()):
                pieces[-1] += part[at:m.start()]
                pieces += [self._specials[m.group()], ""]
                at = m.end()
            pieces[-1] += part[at:]
        texts = [p for p in pieces if isinstance(p, str) and p]
        encoded = iter(self._plain_tokenizer().encode_batch(texts, add_special_tokens=False) if texts else ())
        ids: list[int] = []
        for p in pieces:
            if isinstance(p, int):
                ids.append(p)
            elif p:
                ids += next(encoded).ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def chat(self, messages: Sequence[dict], thinking: bool = False, fmt: ChatFormat = V4, **options) -> list[int]:
        """Token ids of a chat prompt in DeepSeek's format `fmt` (io/chat: V4 or V41), ending where the assistant's
        reply begins; options: encode_chat's reasoning_effort, tools, drop_thinking."""
        return self.encode(encode_chat(fmt, messages, thinking=thinking, **options))

    def detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens)


class IncrementalDetokenizer:
    """Streams the text of a growing id sequence. `push(ids)` returns the new text since the last call,
    holding back while the tail decodes to an incomplete UTF-8 sequence (U+FFFD), so multi-byte
    characters split across tokens are emitted whole. `flush()` returns whatever is left."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0     # ids before this index are context only (their text was emitted)
        self.read = 0       # text of ids[prefix:read] has been emitted

    def _text(self, a: int, b: int) -> str:
        return self.tok.decode(self.ids[a:b], self.skip)

    def push(self, ids: Iterable[int]) -> str:
        self.ids.extend(int(i) for i in ids)
        prefix_text = self._text(self.prefix, self.read)
        full = self._text(self.prefix, len(self.ids))
        if len(full) <= len(prefix_text) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix_text):]
        # keep a few ids of context: decoders strip or merge at the start of a sequence
        self.prefix, self.read = max(self.read - 4, 0), len(self.ids)
        return new

    def flush(self) -> str:
        prefix_text = self._text(self.prefix, self.read)
        full = self._text(self.prefix, len(self.ids))
        self.prefix = self.read = len(self.ids)
        return full[len(prefix_text):]
