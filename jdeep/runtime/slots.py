"""What the Engine keeps per request while it runs (a slot's record) and per iteration (IterationStats), the
engine's default token budget, and the capture of one request's failure in work done for many (guarded)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .requests import Request, RequestOutput
from .sampling import SamplingParams
from .scheduler import floor_pow2
from .steps import MIN_BUCKET
from .stops import StopMatcher

__all__ = ["IterationStats", "Slot", "default_batched_tokens", "as_ids", "guarded", "unless_failed"]


@dataclass(frozen=True)
class IterationStats:
    """What one engine iteration scheduled: tokens decoded and prompt tokens prefilled, the token positions its
    programs computed (padding included; bounded by the budget), and the queue times of the requests it admitted."""

    decode_tokens: int
    prefill_tokens: int
    cost: int
    queue_times: tuple[float, ...] = ()


@dataclass
class Slot:
    out: RequestOutput
    request: Request
    matcher: StopMatcher | None = None   # the text: incremental detokenisation and stop strings
    prefilled: int = 0                   # prompt tokens already in the state
    order: int = 0                       # arrival rank (the scheduler serves older prompts first)
    arrived: float = 0.0                 # time.monotonic() at add_request

    @property
    def params(self) -> SamplingParams:
        return self.request.params


def default_batched_tokens(n_slots: int, prefill_chunk: int) -> int:
    """The default token budget of one iteration: a full decode window plus one longest prefill chunk, so a long
    prompt prefills at full chunk length while every slot decodes (the streams' inter-token latency is then about
    one decode step plus one chunk; a smaller --max-num-batched-tokens trades the prompt's TTFT for it)."""
    return n_slots + max(MIN_BUCKET, floor_pow2(prefill_chunk))


def as_ids(prompt) -> list[int]:
    """The prompt as a list of ints for the output record ([] if it is not one; validation reports why)."""
    try:
        return [int(t) for t in prompt] if not isinstance(prompt, (str, bytes)) else []
    except (TypeError, ValueError):
        return []


def guarded(fn: Callable, *args) -> Any:
    """fn(*args), or the exception it raised: one request's host work done for a whole window, whose failure is
    raised again (unless_failed) where that request alone is handled (OutputProcessor.deliver)."""
    try:
        return fn(*args)
    except Exception as e:      # noqa: BLE001
        return e


def unless_failed(value: Any) -> Any:
    """A value from `guarded`, or its exception raised."""
    if isinstance(value, Exception):
        raise value
    return value
