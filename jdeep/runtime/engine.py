"""Continuous batching over a fixed pool of sequence slots, with chunked prefill mixed into decode.

The decode state is allocated once for `max_num_seqs` slots (a power of two) and `max_len` tokens. Requests wait in
a queue, take the lowest free slot (its state rows reset, nothing reallocated), prefill in chunks and decode one token
per iteration until their length, a stop token, EOS or a stop string. Each iteration (`step`, scheduler.py): one
decode program over the window of slots holding the decoding requests ([rows, 1]), then the rest of the token budget
(`max_num_batched_tokens`) as prefill chunks, oldest first, in one prefill program over their window ([rows, S]), so
a long prompt never stops the running streams. Windows are aligned power-of-two blocks of slots, one compiled program
per size (the first slot is traced): a decode program per rows bucket and a prefill program per (rows, chunk bucket)
(`warmup` compiles them all). Rows a program does not serve carry position -1 and write nothing, so a request's tokens
do not depend on its company. When requests leave, the highest slots move down (`move_slot`) so long-lived requests
do not keep a large window alive. (Models with Engram step the whole pool: their n-gram histories are per pool row.
On a device mesh windows start at slot 0, whose batch axis is sharded.)

Bad requests (invalid sampling values, out-of-vocabulary ids, prompts that do not fit) finish at once with
finish_reason "error" and a message. `check_request` validates (requests.py) without queueing and returns a Request
`add_request` takes as it is (a server answers 400, validating nothing twice); `abort` ends a request and frees its
slot; `release` drops a finished request's record. Host work for one request (its sampling row and PRNG key, stop
matcher, detokenising) runs per request: an exception there ends that request alone ("error", with a message) while
the others get exactly the tokens they would have; a failed device program raises out of `step`, and `reset` then
readies the engine for the next request.

With a tokenizer the engine owns the text: each request's tokens are detokenised incrementally and matched against
its stop strings once, as they arrive; RequestOutput.text grows by whole characters (a stop string's possible
beginning is held back) and ends before the stop string. Logprobs come from the sampler program (prompt logprobs from
an all-positions prefill step); penalised requests' token counts live on the device (slot_sampling.py)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from typing import Callable, Mapping, Sequence

import jax
import numpy as np

from ..model.cache import PROGRAMS
from ..model.model import Model
from ..state import move_slot, reset_slots
from .images import ImagePrompt, split_images
from .prefix_cache import PrefixStats
from .prefix_snapshot import (admit_cached, cut_at_targets, prefix_cache_for, restore_snapshot, snapshot_prefills,
                              take_snapshot)
from .requests import Request, RequestError, RequestOutput, check_request
from .sampling import SEED_MAX, SamplingBatch, SamplingParams, batch_params
from .scheduler import Iteration, Scheduler, Window
from .slot_sampling import SlotPenalties, chunk_prompt_logprobs, logprob_entries, refuse_unsupported, sampler
from .slots import IterationStats, Slot, as_ids, default_batched_tokens, guarded, unless_failed
from .steps import batch_bucket, length_bucket, pack_chunk, run_step
from .stops import StopMatcher
from .warmup import warm_programs

__all__ = ["Engine", "RequestOutput", "IterationStats", "default_batched_tokens"]

log = logging.getLogger("jdeep.engine")


class Engine:
    """engine = Engine(model, max_num_seqs=8); engine.add_request(ids, SamplingParams(...)); engine.run()."""

    unsupported: tuple[tuple[str, object], ...] = ()    # SamplingParams fields this engine takes only "off"
    images_unsupported: bool = False                     # engines whose steps do not take image embeddings

    def __init__(self, model: Model, max_num_seqs: int = 8, max_len: int = 2048, prefill_chunk: int = 256,
                 seed: int = 0, ignore_eos: bool = False, tokenizer=None, max_num_batched_tokens: int | None = None,
                 decode_width: int = 1, prefix_cache_bytes: int = 0):
        """prefill_chunk: the longest prefill chunk (rounded down to a power of two). max_num_batched_tokens: token
        positions one iteration may compute, decode rows first (default_batched_tokens: a full decode window plus
        one longest chunk). tokenizer: for text prompts, stop strings and RequestOutput.text (default:
        model.tokenizer). decode_width: positions a decoding request computes per iteration (speculative engines).
        prefix_cache_bytes: device bytes of decode-state snapshots kept for prompts that share a prefix (0: off;
        prefix_cache.py, prefix_snapshot.py; not on a device mesh)."""
        if max_num_seqs < 1 or max_len < 2 or prefill_chunk < 1:
            raise ValueError(f"max_num_seqs, max_len and prefill_chunk must be positive, got {max_num_seqs}, "
                             f"{max_len}, {prefill_chunk}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
            raise ValueError(f"seed must be an integer in [0, {SEED_MAX}], got {seed!r}")
        if max_len > model.config.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds max_position_embeddings {model.config.max_position_embeddings}")
        self.model = model
        self.n_slots = batch_bucket(max_num_seqs)
        self.max_len = max_len
        if max_num_batched_tokens is None:
            max_num_batched_tokens = default_batched_tokens(self.n_slots * decode_width, prefill_chunk)
        self.scheduler = Scheduler(self.n_slots, max_num_batched_tokens, prefill_chunk, self._window_mode(model),
                                   decode_width)
        self.chunk = self.scheduler.max_chunk
        self.max_num_batched_tokens = max_num_batched_tokens
        self.seed = seed
        self.eos = None if ignore_eos else model.config.eos_token_id
        self.state = model.init_state(self.n_slots, self._cache_len())
        self.history = model.new_history(self.n_slots)
        self.slots: list[Slot | None] = [None] * self.n_slots
        self.waiting: deque[Slot] = deque()
        self.outputs: dict[str, RequestOutput] = {}
        self._ids = itertools.count()
        self._n_added = 0                             # requests ever added (default seeds)
        # each slot's sampling row on the host (written when a request takes the slot; idle rows are never read)
        self._rows = SamplingBatch(*(np.array(a) for a in batch_params([SamplingParams()] * self.n_slots)))
        self._last = np.zeros(self.n_slots, np.int32)
        self._pen = SlotPenalties(self.n_slots, model.config.vocab_size, model.to_sampler)
        self.prefix_cache = prefix_cache_for(model, prefix_cache_bytes, self._cache_len())
        self.tokenizer = tokenizer if tokenizer is not None else model.tokenizer
        self.steps_per_bucket: dict[int, int] = {}    # step programs run at each window size (rows)
        self.on_iteration: Callable[[IterationStats], None] | None = None   # called after each iteration
        self.totals = {"iterations": 0, "decode_tokens": 0, "prefill_tokens": 0, "slot_moves": 0}

    # ------------------------------------------------------------------ requests
    def check_request(self, prompt: Sequence[int] | str | Mapping | ImagePrompt,
                      sampling: SamplingParams | None = None) -> Request:
        """Validate a request without queueing it (requests.check_request against this engine's max_len): the
        Request, or RequestError naming the problem. A {"text", "images"} prompt runs the vision tower here
        (runtime.images). Reads only the model's config, tokenizer and tower: safe to call from another thread."""
        prompt, images = split_images(self.model, prompt, self.tokenizer, self.images_unsupported and type(self).__name__)
        request = check_request(prompt, sampling, vocab_size=self.model.config.vocab_size, max_len=self.max_len,
                                tokenizer=self.tokenizer, eos=self.eos, limit_name="the engine's max_len")
        refuse_unsupported(request.params, self.unsupported, type(self).__name__)
        return dataclasses.replace(request, images=images) if images else request

    def add_request(self, prompt: Sequence[int] | str | Mapping | Request, sampling: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (token ids, text with a tokenizer, or a Request from check_request, taken as validated);
        returns its id. An invalid request is finished at once with an error. A request_id already in use is a
        ValueError."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.outputs:
            raise ValueError(f"request id {rid!r} is already in use")
        out = RequestOutput(rid, as_ids(prompt.ids if isinstance(prompt, (Request, ImagePrompt)) else prompt))
        self.outputs[rid] = out
        self._n_added += 1
        try:
            request = prompt if isinstance(prompt, Request) else self.check_request(prompt, sampling)
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
                request.params, seed=(self.seed + self._n_added - 1) % (SEED_MAX + 1)))
        slot = Slot(out, request, order=self._n_added, arrived=time.monotonic())
        try:
            if self.tokenizer is not None:
                out.text = ""
                slot.matcher = self._matcher(slot)
        except Exception as e:          # a request the host cannot take (e.g. stop strings its tokenizer rejects)
            self._fail(slot, "preparing its stop strings", e)
            return rid
        self.waiting.append(slot)
        return rid

    def _matcher(self, slot: Slot) -> StopMatcher:
        """The request's incremental detokenizer and stop-string matcher (host work for one request)."""
        return StopMatcher(self.tokenizer, slot.params.stop, slot.params.skip_special_tokens)

    def _fail(self, slot: Slot, where: str, e: Exception) -> None:
        """Finish one request with an error raised by its own host work; the caller frees its slot."""
        log.error("request %s failed while %s: %s: %s", slot.out.request_id, where, type(e).__name__, e)
        out = slot.out
        out.finished, out.finish_reason = True, "error"
        out.error = f"internal error while {where} for this request: {type(e).__name__}: {e}"

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> bool:
        """End a waiting or running request now (finish_reason `reason`, "abort" by default, with `error` as its
        message); its slot is free for the next step. Returns False if the request is unknown or already finished."""
        out = self.outputs.get(request_id)
        if out is None or out.finished:
            return False
        for s in self.waiting:
            if s.out is out:
                self.waiting.remove(s)
                break
        else:
            for i, s in enumerate(self.slots):
                if s is not None and s.out is out:
                    self.slots[i] = None
                    break
        out.finished, out.finish_reason, out.error = True, reason, error
        return True

    def reset(self) -> None:
        """Abort every request and allocate a fresh decode state (after a failed step: donated state may be gone)."""
        for s in list(self.waiting) + [s for s in self.slots if s is not None]:
            self.abort(s.out.request_id)
        self.state, self._pen.state = self.model.init_state(self.n_slots, self._cache_len()), None
        self.history = self.model.new_history(self.n_slots)

    def release(self, request_id: str) -> RequestOutput | None:
        """Forget a finished request's record (returns it); a request still in flight is aborted first."""
        self.abort(request_id)
        return self.outputs.pop(request_id, None)

    @property
    def n_running(self) -> int:
        """Requests holding a slot (prefilling or decoding)."""
        return sum(s is not None for s in self.slots)

    @property
    def prefix_cache_stats(self) -> PrefixStats | None:
        """A copy of the prefix cache's counters (None when the cache is off)."""
        return None if self.prefix_cache is None else dataclasses.replace(self.prefix_cache.stats)

    @property
    def n_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self.n_running > 0

    # ------------------------------------------------------------------ stepping
    def _admit(self) -> tuple[list[RequestOutput], list[float]]:
        """Move waiting requests into the lowest free slots; returns those that failed on the way and the queue
        times of those admitted."""
        free = [i for i, s in enumerate(self.slots) if s is None]
        taken, failed, waited = [], [], []
        now = time.monotonic()
        while free and self.waiting:
            slot = self.waiting.popleft()
            try:
                row = self._sampling_row(slot)
                if slot.params.penalized:
                    self._pen.admit(free[0], slot.request.ids)
            except Exception as e:      # e.g. a seed no PRNG key holds: this request fails, the queue goes on
                self._fail(slot, "preparing its sampling parameters", e)
                failed.append(slot.out)
                continue
            i = free.pop(0)
            self.slots[i] = slot
            slot.out.queue_time = now - slot.arrived
            waited.append(slot.out.queue_time)
            for dst, src in zip(self._rows, row):
                dst[i] = src[0]
            taken.append(i)
        if taken:
            mask = np.zeros(self.n_slots, bool)
            mask[taken] = True
            self._reset_slots(mask)
            if self.history is not None:
                self.history.reset(taken)
            admit_cached(self, taken)          # (prefix_snapshot.py's hooks do nothing with the cache off)
        return failed, waited

    def _compact(self) -> None:
        """Move requests from the highest slots into free lower ones until they fit the smallest window that can
        hold them all (a copy of each moved slot's state rows; not for whole-pool models)."""
        if self.scheduler.window_mode == "pool":
            return
        used = [i for i, s in enumerate(self.slots) if s is not None]
        target = batch_bucket(len(used)) if used else 1
        free = [i for i in range(target) if self.slots[i] is None]
        for src in sorted((i for i in used if i >= target), reverse=True):
            dst = free.pop(0)
            self._move_slot(self.model.put(np.int32(src)), self.model.put(np.int32(dst)))
            self.slots[dst], self.slots[src] = self.slots[src], None
            for a in self._rows:
                a[dst] = a[src]
            if self.slots[dst].params.penalized:
                self._pen.move(src, dst)
            self._last[dst] = self._last[src]
            self.totals["slot_moves"] += 1

    def _window_mode(self, model: Model) -> str:
        """How the scheduler picks the slots a program steps (scheduler.py): the whole pool for models with Engram
        (their host-side histories are per pool row), windows starting at slot 0 on a mesh, else aligned windows."""
        return "pool" if model.engram is not None else "prefix" if model.layout is not None else "aligned"

    def _cache_len(self) -> int:
        """The decode state's length: max_len rounded up to a bucket."""
        return length_bucket(self.max_len, 256)

    def _reset_slots(self, mask: np.ndarray) -> None:
        """Empty the device state of the slots where mask [n_slots] is True (one program; the state donated)."""
        self.state = PROGRAMS.jit(reset_slots, donate_argnums=(0,))(self.state, self.model.put(mask))

    def _move_slot(self, src, dst) -> None:
        """Copy slot src's device state over slot dst (int32 scalars placed on the device; the state donated)."""
        self.state = PROGRAMS.jit(move_slot, donate_argnums=(0,))(self.state, src, dst)

    def snapshot_slot(self, i: int, p: int) -> tuple[object, int]:
        """(snapshot, device bytes) of slot i's device state after p prompt tokens (prefix_snapshot.py)."""
        return take_snapshot(self.prefix_cache, self.state, self.model.put(np.int32(i)), p)

    def restore_slot(self, i: int, snap) -> None:     # (a snapshot_slot snapshot over slot i's device state)
        self.state = restore_snapshot(self.state, snap, self.model.put(np.int32(i)))

    def _sampling_row(self, slot: Slot) -> SamplingBatch:
        """One request's sampling values and PRNG key as a 1-row host batch (host work for one request)."""
        return self._host_batch([slot.params], [slot.request.stop_ids])

    def _host_batch(self, params: list[SamplingParams], stop_ids=None) -> SamplingBatch:
        """Sampling values on the host: a bucket's rows are a numpy slice, not a device program."""
        return SamplingBatch(*(np.asarray(a) for a in batch_params(params, len(params), stop_ids=stop_ids)))

    def _run(self, toks: np.ndarray, pos: np.ndarray, window: Window, all_logits: bool = False, images=None) -> jax.Array:
        """One step program over `window` (toks, pos: int32 [window.rows, S]; images: its rows' image spans, run_step);
        returns logits [window.rows, V] ([window.rows, S, V] with all_logits)."""
        self.steps_per_bucket[window.rows] = self.steps_per_bucket.get(window.rows, 0) + 1
        part = {} if window.rows == self.n_slots else {"rows": window.rows, "start": window.start}
        logits, self.state = run_step(self.model, self.state, toks, pos, self.history, all_logits=all_logits,
                                      images=images, **part)
        return logits

    def _window_rows(self, w: Window) -> SamplingBatch:     # the window's sampling rows (host arrays)
        return SamplingBatch(*(a[w.start:w.start + w.rows] for a in self._rows))

    def _emit(self, logits: jax.Array, window: Window, rows: list[int]) -> list[RequestOutput]:
        """Sample the next token of each slot in `rows` from the window's logits [window.rows, V]; push it (with
        its logprobs for requests that asked; penalised requests' counts advance on the device)."""
        lo, hi = window.start, window.start + window.rows
        counts = np.array([len(s.out.tokens) if s is not None else 0 for s in self.slots[lo:hi]], np.int32)
        want = [i for i in rows if self.slots[i].params.logprobs is not None]
        penalised = [i for i in rows if self.slots[i].params.penalized]
        pen = self._pen.window(lo, window.rows) if penalised else None
        out = sampler(bool(want))(*self.model.to_sampler((logits, self._window_rows(window), counts)), pen)
        tokens = out[0] if want else out
        if penalised:
            live = np.zeros(window.rows, bool)
            live[[i - lo for i in penalised]] = True
            self._pen.count(lo, tokens, live)
        nxt = self.model.fetch(tokens)
        entries = {}
        if want:    # (one request's failure is raised again in _deliver, where that request alone fails)
            lp, ids, vals = (self.model.fetch(a) for a in out[1:])
            entries = {i: [guarded(logprob_entries, nxt[i - lo], lp[i - lo], ids[i - lo], vals[i - lo],
                                   self.slots[i].params.logprobs)] for i in want}
        return self._deliver({i: [int(nxt[i - lo])] for i in rows}, entries)

    def _deliver(self, new: dict[int, Sequence[int]], logprobs: dict[int, list] | None = None) -> list[RequestOutput]:
        """Push each slot's new tokens (slot -> tokens, in order; logprobs: slot -> one entry per token, for
        requests that asked) until its request finishes; returns those that finished (their slots freed)."""
        done = []
        for i, tokens in new.items():
            s = self.slots[i]
            finished = False
            for k, t in enumerate(tokens):
                self._last[i] = t
                try:
                    if logprobs and i in logprobs and s.out.logprobs is not None:
                        s.out.logprobs.append(unless_failed(logprobs[i][k]))
                    finished = self._push_token(s, int(t))
                except Exception as e:      # this request's own host work failed: it ends alone
                    self._fail(s, "handling its output (logprobs, detokenising, stop strings)", e)
                    finished = True
                if finished:
                    break
            if finished:
                self.slots[i] = None
                done.append(s.out)
        return done

    def _push_token(self, s: Slot, t: int) -> bool:
        """Append token t to a request's output (text and stop strings through its matcher); returns whether it
        finished (host work for one request)."""
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

    def step(self) -> list[RequestOutput]:
        """One engine iteration: admit waiting requests, then one decode step for every request past its prompt and
        prefill chunks for the others within the token budget (scheduler.py). Returns requests finished now."""
        failed, waited = self._admit()
        self._compact()
        it = self.schedule()
        done = failed + self._decode(it) + self._prefill(it)
        self.totals["iterations"] += 1
        self.totals["decode_tokens"] += it.decode_tokens
        self.totals["prefill_tokens"] += it.prefill_tokens
        if self.on_iteration is not None:
            self.on_iteration(IterationStats(it.decode_tokens, it.prefill_tokens, it.cost, tuple(waited)))
        return done

    def schedule(self) -> Iteration:
        """The next iteration's plan for the slots as they are (scheduler.Scheduler.schedule)."""
        remaining = [None if s is None else len(s.out.prompt) - s.prefilled for s in self.slots]
        remaining = cut_at_targets(self, remaining)     # chunks end at the prefix cache's snapshot points
        return self.scheduler.schedule(remaining, [s.order if s is not None else 0 for s in self.slots])

    def _decode(self, it: Iteration) -> list[RequestOutput]:
        if not it.decode:
            return []
        w = it.decode_window
        toks = np.zeros((w.rows, 1), np.int32)
        pos = np.full((w.rows, 1), -1, np.int32)
        for i in it.decode:
            s = self.slots[i]
            toks[i - w.start, 0] = self._last[i]
            pos[i - w.start, 0] = len(s.out.prompt) + len(s.out.tokens) - 1
        return self._emit(self._run(toks, pos, w), w, it.decode)

    def _prefill(self, it: Iteration) -> list[RequestOutput]:
        if not it.prefill:
            return []
        w, scored = it.prefill_window, [i for i in it.prefill if self.slots[i].params.prompt_logprobs is not None]
        first = {i: self.slots[i].prefilled for i in scored}
        toks, pos, ended = self._take_chunk(it)
        spans = [self.slots[i].request.images if i in it.prefill else () for i in range(w.start, w.start + w.rows)]
        logits = self._run(toks, pos, w, all_logits=bool(scored), images=spans)   # [rows, S, V] for prompt logprobs
        snapshot_prefills(self, it.prefill)
        if not scored:
            return self._emit(logits, w, ended)
        ask = {i - w.start: (self.slots[i].request.ids, first[i], self.slots[i].params.prompt_logprobs) for i in scored}
        last, entries = chunk_prompt_logprobs(self.model, logits, pos, ask)
        for r, e in entries.items():
            self.slots[w.start + r].out.prompt_logprobs += e
        return self._emit(last, w, ended)

    def _take_chunk(self, it: Iteration) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """The iteration's prefill chunk over its window (tokens, positions int32 [rows, S]), counted as prefilled;
        and the slots whose prompt ends in it (sorted)."""
        w = it.prefill_window
        prompts = [self.slots[i].request.ids[:self.slots[i].prefilled + it.prefill[i]] if i in it.prefill else None
                   for i in range(w.start, w.start + w.rows)]
        done = [self.slots[i].prefilled if i in it.prefill else 0 for i in range(w.start, w.start + w.rows)]
        toks, pos, taken = pack_chunk(prompts, done, w.rows, it.chunk)
        assert toks.shape[1] == it.chunk and all(taken[i - w.start] == n for i, n in it.prefill.items())
        for i, n in it.prefill.items():
            self.slots[i].prefilled += n
        return toks, pos, sorted(i for i in it.prefill if self.slots[i].prefilled == len(self.slots[i].out.prompt))

    def warmup(self, prompt_logprobs: bool = True) -> int:
        """Compile every program serving can reach before the first request (warmup.py); returns how many ran.
        prompt_logprobs=False leaves out the all-positions prefill steps that only prompt logprobs need."""
        return warm_programs(self, prompt_logprobs)

    def run(self, on_finish: Callable[[RequestOutput], None] | None = None) -> dict[str, RequestOutput]:
        """Step until every queued request has finished; returns all outputs by request id."""
        for out in self.outputs.values():
            if out.finished and on_finish is not None:
                on_finish(out)
        while self.has_work:
            for out in self.step():
                if on_finish is not None:
                    on_finish(out)
        return self.outputs
