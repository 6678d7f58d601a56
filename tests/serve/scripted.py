"""A scripted model for server tests: an Engine whose requests, when a script recognises their prompt, emit the
script's reply tokens instead of the model's (the real model still runs every step; only the choice of token
is replaced, after sampling). Everything else — the server, chat encoding, detokenisation, stop handling, the
reply parser — runs as in serving. Used to test tool calls and thinking replies, which random weights never
produce."""

from __future__ import annotations

from typing import Callable, Sequence

from jdeep.runtime.engine import Engine
from jdeep.runtime.output_processor import OutputProcessor

__all__ = ["ScriptedEngine", "continuation"]


class ScriptedEngine(Engine):
    """Engine(model, ...) plus script(prompt ids) -> the reply's token ids (None: the model's own tokens).
    `prompts` records every scripted request's prompt ids, in arrival order."""

    def __init__(self, *args, script: Callable[[list[int]], Sequence[int] | None], **kwargs):
        super().__init__(*args, **kwargs)
        self.output = ScriptedOutput(self.output.tokenizer, script)

    @property
    def prompts(self) -> list[list[int]]:
        return self.output.prompts


class ScriptedOutput(OutputProcessor):
    """The output processor that swaps a scripted request's tokens for its script's reply before delivering them."""

    def __init__(self, tokenizer, script: Callable[[list[int]], Sequence[int] | None]):
        super().__init__(tokenizer)
        self.script = script
        self.prompts: list[list[int]] = []

    def deliver(self, pool, new, logprobs=None):
        for i, tokens in list(new.items()):
            s = pool.slots[i]
            reply = self.script(s.out.prompt)
            if reply is None:
                continue
            k = len(s.out.tokens)
            if k == 0:
                self.prompts.append(list(s.out.prompt))
            new[i] = list(reply[k:k + len(tokens)])
        return super().deliver(pool, new, logprobs)


def continuation(prompt_text: str, reply: str) -> str:
    """What is left of `reply` when the prompt already ends with its beginning (a forced reply opening)."""
    for k in range(len(reply), 0, -1):
        if prompt_text.endswith(reply[:k]):
            return reply[k:]
    return reply
