"""What the engine thread hands to its callers (serve/async_engine.py): a request's Delta per step, its
RequestHandle to iterate them, and QueueFull when too many requests wait for a slot."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

__all__ = ["Delta", "QueueFull", "RequestHandle"]


@dataclass
class Delta:
    """What one engine step gave a request: its new tokens, the text they completed (given a tokenizer), and
    whether it has finished. time: time.monotonic() when the step ended."""

    request_id: str
    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None    # "stop", "length", "abort", "error" or "timeout"
    error: str | None = None
    time: float = 0.0
    text: str = ""
    logprobs: list | None = None          # the new tokens' (id, logprob, top) when the request asked for them
    prompt_logprobs: list | None = None   # with a request's first Delta, when it asked for them


class QueueFull(RuntimeError):
    """submit refused: the requests would take the number waiting for a slot past `limit`."""

    def __init__(self, waiting: int, asked: int, limit: int):
        super().__init__(f"{waiting} requests are waiting for a slot (the limit is {limit}); "
                         f"{asked} more cannot be queued now")
        self.waiting, self.asked, self.limit = waiting, asked, limit


class RequestHandle:
    """A submitted request: `async for delta in handle` until delta.finished; `abort()` ends it early."""

    def __init__(self, engine: Any, request_id: str, queue: asyncio.Queue):
        self.engine, self.request_id, self.queue = engine, request_id, queue
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self.finished:
            raise StopAsyncIteration
        d = await self.queue.get()
        self.finished = d.finished
        return d

    def abort(self) -> None:
        """End the request (no-op once finished): its slot is free after the engine's current step."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)
