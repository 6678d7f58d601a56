"""The OpenAI API's response bodies from what the engine produced: one Choice per generated sequence (tokens, text,
logprobs and, for chat, the parsed reasoning / content / tool calls), best_of ranking, and the JSON of answers,
stream chunks and usage.

Logprobs are the model's raw log-softmax (before logit_bias, penalties, temperature and filtering; vLLM's default
`raw_logprobs`). Token strings are each token decoded alone with special tokens kept; `bytes` are their UTF-8
bytes. finish_reason: "stop" (EOS, a stop token or string), "length", or "tool_calls" when a chat reply that
ended by itself made calls.
"""

from __future__ import annotations

import uuid
from typing import Any

from ..io.chat import ReplyParser
from .openai_protocol import GenerationRequest

__all__ = ["Choice", "usage", "pick_best", "completion_response", "chat_response", "completion_chunk", "chat_chunk",
           "usage_chunk", "chat_role_chunk"]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Choice:
    """One generated sequence as the engine's Deltas arrive (the engine cut the text before a stop string).
    For chat, the text goes through the reply parser: `push` returns the OpenAI delta of what became known."""

    def __init__(self, req: GenerationRequest, tokenizer: Any, prompt: int):
        self.req, self.tok, self.prompt = req, tokenizer, prompt
        self.tokens: list[int] = []
        self.text = ""
        self.logprobs: list = []          # (token id, logprob, [(id, logprob), ...]) per token
        self.prompt_logprobs: list | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        plan = req.chat
        self.parser = ReplyParser(plan.fmt, plan.thinking, plan.prefix) if plan is not None else None
        self.content, self.reasoning = "", ""
        self.calls: list[dict] = []

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp for _, lp, _ in self.logprobs)

    def push(self, d) -> dict:
        """Take one Delta; returns the chat delta it makes ({} if nothing became known) or {"text": ...}."""
        self.tokens += d.tokens
        self.text += d.text
        self.logprobs += d.logprobs or []
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.finished:
            self.finish_reason, self.error = d.finish_reason, d.error
        if self.parser is None:
            return {"text": d.text}
        events = self.parser.push(d.text) + (self.parser.finish() if d.finished else [])
        return self._delta(events)

    def _delta(self, events: list[tuple]) -> dict:
        delta: dict = {}
        calls: dict[int, dict] = {}
        plan = self.req.chat
        for ev in events:
            kind = ev[0]
            if kind in ("reasoning", "content"):
                key = "reasoning_content" if kind == "reasoning" else "content"
                delta[key] = delta.get(key, "") + ev[1]
                if kind == "reasoning":
                    self.reasoning += ev[1]
                else:
                    self.content += ev[1]
                continue
            k = ev[1]
            if not plan.report_calls or (k > 0 and not plan.parallel):
                continue
            if kind == "call":
                self.calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                   "function": {"name": ev[2], "arguments": ""}})
                calls[k] = {"index": k, "id": self.calls[k]["id"], "type": "function",
                            "function": {"name": ev[2], "arguments": ""}}
            else:
                self.calls[k]["function"]["arguments"] += ev[2]
                c = calls.setdefault(k, {"index": k, "function": {"arguments": ""}})
                c["function"]["arguments"] += ev[2]
        if calls:
            delta["tool_calls"] = [calls[k] for k in sorted(calls)]
        return delta

    @property
    def reason(self) -> str | None:
        """The OpenAI finish_reason."""
        r = self.finish_reason
        if r is None:
            return None
        if r == "length":
            return "length"
        return "tool_calls" if self.calls else "stop"

    # ------------------------------------------------------------------ logprobs
    def _token(self, t: int) -> str:
        return self.tok.decode([t], skip_special_tokens=False) if self.tok is not None else f"<{t}>"

    def _item(self, t: int, lp: float) -> dict:
        s = self._token(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    def _entry(self, t: int, lp: float, top: list) -> dict:
        return {**self._item(t, lp), "top_logprobs": [self._item(a, b) for a, b in top]}

    def chat_logprobs(self, start: int = 0) -> dict | None:
        """OpenAI's chat logprobs of tokens[start:] ({"content": [...]}), or None when not asked for."""
        if self.req.chat is None or not self.req.chat.logprobs:
            return None
        return {"content": [self._entry(t, lp, top) for t, lp, top in self.logprobs[start:]]}

    def completion_logprobs(self, start: int = 0, offset: int = 0, echo: bool = False) -> dict | None:
        """The completions API's logprobs of tokens[start:] (the prompt's first with echo); offset: characters of
        text before the first token (text_offset)."""
        if self.req.logprobs is None:
            return None
        rows = []
        if echo:
            plps = self.prompt_logprobs or [None] * len(self.req.prompts[self.prompt])
            rows += [(t, None if e is None else e[1], None if e is None else e[2])
                     for t, e in zip(self.req.prompts[self.prompt], plps)]
        rows += [(t, lp, top) for t, lp, top in self.logprobs[start:]]
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in rows:
            s = self._token(t)
            out["tokens"].append(s)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(None if top is None else {self._token(a): b for a, b in top})
            out["text_offset"].append(offset)
            offset += len(s)
        return out

    def message(self) -> dict:
        """The chat answer's message."""
        m: dict = {"role": "assistant", "content": self.content if (self.content or not self.calls) else None}
        if self.req.chat.thinking or self.reasoning:
            m["reasoning_content"] = self.reasoning
        if self.calls:
            m["tool_calls"] = self.calls
        return m


def pick_best(req: GenerationRequest, choices: list[Choice]) -> list[Choice]:
    """The returned choices: per prompt, its n samples with the highest cumulative logprob (all when best_of == n),
    in prompt order."""
    if req.best_of == req.n:
        return choices
    out = []
    for p in range(len(req.prompts)):
        group = choices[p * req.best_of:(p + 1) * req.best_of]
        out += sorted(group, key=lambda c: -c.cumulative_logprob)[:req.n]
    return out


def _ids(req: GenerationRequest, c: Choice, body: dict, prompt: bool = True) -> dict:
    if req.return_token_ids:
        body["token_ids"] = c.tokens
        if prompt:
            body["prompt_token_ids"] = req.prompts[c.prompt]
    return body


def completion_response(req: GenerationRequest, choices: list[Choice], usage_: dict) -> dict:
    out = []
    for i, c in enumerate(choices):
        prefix = req_prompt_text(req, c) if req.echo else ""
        out.append(_ids(req, c, {"index": i, "text": prefix + c.text, "finish_reason": c.reason,
                                 "logprobs": c.completion_logprobs(echo=req.echo)}))
    return {"id": req.id, "object": "text_completion", "created": req.created, "model": req.model,
            "choices": out, "usage": usage_}


def req_prompt_text(req: GenerationRequest, c: Choice) -> str:
    """The prompt's text as echo returns it."""
    return c.tok.decode(req.prompts[c.prompt], skip_special_tokens=False) if c.tok is not None else ""


def chat_response(req: GenerationRequest, choices: list[Choice], usage_: dict) -> dict:
    out = [_ids(req, c, {"index": i, "message": c.message(), "logprobs": c.chat_logprobs(),
                         "finish_reason": c.reason}) for i, c in enumerate(choices)]
    return {"id": req.id, "object": "chat.completion", "created": req.created, "model": req.model,
            "choices": out, "usage": usage_}


def completion_chunk(req: GenerationRequest, index: int, c: Choice, text: str, n_new: int, echo: bool = False) -> dict:
    """A stream chunk of choice `index`: its new text and the logprobs of its n_new new tokens (echo: the choice's
    first chunk, which starts with the prompt)."""
    lp = None
    if req.logprobs is not None:
        lp = c.completion_logprobs(len(c.tokens) - n_new, 0 if echo else len(c.text) - len(text), echo=echo)
    body = {"index": index, "text": text, "logprobs": lp, "finish_reason": c.reason}
    if req.return_token_ids:
        body["token_ids"] = c.tokens[len(c.tokens) - n_new:]
    return {"id": req.id, "object": "text_completion", "created": req.created, "model": req.model,
            "choices": [body]}


def chat_chunk(req: GenerationRequest, index: int, c: Choice, delta: dict, n_new: int) -> dict:
    body = {"index": index, "delta": delta, "logprobs": c.chat_logprobs(len(c.tokens) - n_new),
            "finish_reason": c.reason}
    if req.return_token_ids:
        body["token_ids"] = c.tokens[len(c.tokens) - n_new:]
    return {"id": req.id, "object": "chat.completion.chunk", "created": req.created, "model": req.model,
            "choices": [body]}


def chat_role_chunk(req: GenerationRequest, index: int) -> dict:
    """The first chunk of a streamed chat choice."""
    return {"id": req.id, "object": "chat.completion.chunk", "created": req.created, "model": req.model,
            "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]}


def usage_chunk(req: GenerationRequest, usage_: dict) -> dict:
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": [], "usage": usage_}
