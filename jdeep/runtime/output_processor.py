"""The Engine's output processor: each slot's new tokens become its request's output.

`deliver` pushes a slot's tokens in order — with their logprob entries for requests that asked — into its
RequestOutput, detokenises them incrementally and matches its stop strings (stops.StopMatcher: `text` grows by whole
characters and ends before a stop string), and finishes the request at the first stop id, max_new_tokens or stop
string (tokens past it are dropped) and frees its slot. All of it is host work for one request: an exception there
finishes that request alone with finish_reason "error" and a message, and the others are delivered as they would be.
"""

from __future__ import annotations

import logging
from typing import Sequence

from .requests import RequestOutput
from .slot_pool import SlotPool
from .slots import Slot, unless_failed
from .stops import StopMatcher

__all__ = ["OutputProcessor", "fail"]

log = logging.getLogger("jdeep.engine")


def fail(slot: Slot, where: str, e: Exception) -> None:
    """Finish one request with an error raised by its own host work (`where`: what it was doing); the caller frees
    its slot."""
    log.error("request %s failed while %s: %s: %s", slot.out.request_id, where, type(e).__name__, e)
    out = slot.out
    out.finished, out.finish_reason = True, "error"
    out.error = f"internal error while {where} for this request: {type(e).__name__}: {e}"


class OutputProcessor:
    """OutputProcessor(tokenizer): tokenizer None keeps outputs as token ids (no text, no stop strings)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def matcher(self, slot: Slot) -> StopMatcher | None:
        """The request's incremental detokenizer and stop-string matcher (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        return StopMatcher(self.tokenizer, slot.params.stop, slot.params.skip_special_tokens)

    def deliver(self, pool: SlotPool, new: dict[int, Sequence[int]], logprobs: dict[int, list] | None = None
                ) -> list[RequestOutput]:
        """Push each slot's new tokens (slot -> tokens, in order; logprobs: slot -> one entry per token, or the
        exception computing it raised, for requests that asked) until its request finishes; returns those that
        finished (their slots freed)."""
        done = []
        for i, tokens in new.items():
            s = pool.slots[i]
            finished = False
            for k, t in enumerate(tokens):
                pool.last[i] = t
                try:
                    if logprobs and i in logprobs and s.out.logprobs is not None:
                        s.out.logprobs.append(unless_failed(logprobs[i][k]))
                    finished = self.push_token(s, int(t))
                except Exception as e:      # this request's own host work failed: it ends alone
                    fail(s, "handling its output (logprobs, detokenising, stop strings)", e)
                    finished = True
                if finished:
                    break
            if finished:
                pool.slots[i] = None
                done.append(s.out)
        return done

    def push_token(self, s: Slot, t: int) -> bool:
        """Append token t to a request's output (text and stop strings through its matcher); returns whether it
        finished."""
        s.out.tokens.append(t)
        reason = ("stop" if t in s.request.stop_ids else
                  "length" if len(s.out.tokens) >= s.params.max_new_tokens else None)
        if s.matcher is not None:
            s.out.text += s.matcher.push([t])
            if s.matcher.stopped:
                reason = "stop"
        if reason:
            if s.matcher is not None:
                s.out.text += s.matcher.finish()
            s.out.finished, s.out.finish_reason = True, reason
        return reason is not None
