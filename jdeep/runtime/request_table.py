"""The Engine's request table: every request's record from add_request to release.

`outputs` maps each request id to its RequestOutput (kept after the request finishes, until `release`); `waiting`
holds the admitted-but-not-yet-placed requests in arrival order. Adding a request that fails validation records it
finished at once with finish_reason "error" and the message; a request without a seed gets the engine's seed plus
its arrival index, so a run's sampled tokens do not depend on what else is queued.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from typing import Callable, Mapping, Sequence

from .images import ImagePrompt
from .output_processor import OutputProcessor, fail
from .requests import Request, RequestError, RequestOutput
from .sampling import SEED_MAX, SamplingParams
from .slot_pool import SlotPool
from .slots import Slot, as_ids

__all__ = ["RequestTable"]

Prompt = Sequence[int] | str | Mapping | ImagePrompt


class RequestTable:
    """RequestTable(seed): outputs by id, the waiting queue, ids and default seeds."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.outputs: dict[str, RequestOutput] = {}
        self.waiting: deque[Slot] = deque()
        self._ids = itertools.count()
        self.n_added = 0                             # requests ever added (default seeds, arrival order)

    def add(self, prompt: Prompt | Request, sampling: SamplingParams | None, request_id: str | None,
            check: Callable[[Prompt, SamplingParams | None], Request], output: OutputProcessor) -> str:
        """Record and queue a request (a Request is taken as validated, anything else goes through `check`);
        returns its id. An invalid request, or one whose host preparation (its stop matcher) fails, is finished at
        once with an error. A request_id already in use is a ValueError."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.outputs:
            raise ValueError(f"request id {rid!r} is already in use")
        out = RequestOutput(rid, as_ids(prompt.ids if isinstance(prompt, (Request, ImagePrompt)) else prompt))
        self.outputs[rid] = out
        self.n_added += 1
        try:
            request = prompt if isinstance(prompt, Request) else check(prompt, sampling)
        except RequestError as e:
            out.finished, out.finish_reason, out.error = True, "error", str(e)
            return rid
        out.prompt = request.ids.tolist()
        if request.params.logprobs is not None:
            out.logprobs = []
        if request.params.prompt_logprobs is not None:
            out.prompt_logprobs = [None]
        if request.params.seed is None:
            request = dataclasses.replace(request, params=dataclasses.replace(
                request.params, seed=(self.seed + self.n_added - 1) % (SEED_MAX + 1)))
        slot = Slot(out, request, order=self.n_added, arrived=time.monotonic())
        try:
            if output.tokenizer is not None:
                out.text = ""
                slot.matcher = output.matcher(slot)
        except Exception as e:          # a request the host cannot take (e.g. stop strings its tokenizer rejects)
            fail(slot, "preparing its stop strings", e)
            return rid
        self.waiting.append(slot)
        return rid

    def abort(self, request_id: str, pool: SlotPool, reason: str = "abort", error: str | None = None) -> bool:
        """End a waiting or running request now (its slot in `pool` freed); False if it is unknown or finished."""
        out = self.outputs.get(request_id)
        if out is None or out.finished:
            return False
        for s in self.waiting:
            if s.out is out:
                self.waiting.remove(s)
                break
        else:
            i = pool.find(out)
            if i is not None:
                pool.slots[i] = None
        out.finished, out.finish_reason, out.error = True, reason, error
        return True

    def abort_all(self, pool: SlotPool) -> None:
        """Abort every waiting and running request."""
        for s in list(self.waiting) + [s for s in pool.slots if s is not None]:
            self.abort(s.out.request_id, pool)
