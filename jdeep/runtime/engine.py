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
an all-positions prefill step); penalised requests' token counts live on the device (slot_sampling.py).

The engine is four parts, each its own module, and the loop that drives them (`step`, in nano-vllm's spirit):
- the request table (request_table.py): every request's record, the waiting queue, abort and release;
- the slot pool (slot_pool.py): the slots, their device state and history, host sampling rows, penalty counts and
  prefix-cache snapshots; admission, compaction, slot moves, prefill chunks;
- the runner (runner.py): the step programs and sampling of one iteration, and their warm-up;
- the output processor (output_processor.py): delivery, stop strings, detokenising, one request's failure its own.
A speculative engine (speculative/engine.py) is this engine with a drafting pool and runner (`make_pool`,
`make_runner`)."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping, Sequence

from ..model.model import Model
from .images import ImagePrompt, split_images
from .inventory import ProgramSpec
from .output_processor import OutputProcessor, fail
from .prefix_cache import PrefixStats
from .request_table import RequestTable
from .requests import Request, RequestOutput, check_request
from .runner import Runner
from .sampling import SEED_MAX, SamplingParams
from .scheduler import Iteration, serving_scheduler
from .slot_pool import SlotPool
from .slot_sampling import refuse_unsupported
from .slots import IterationStats, default_batched_tokens
from .steps import batch_bucket, state_length

__all__ = ["Engine", "RequestOutput", "IterationStats", "default_batched_tokens"]


class Engine:
    """engine = Engine(model, max_num_seqs=8); engine.add_request(ids, SamplingParams(...)); engine.run()."""

    unsupported: tuple[tuple[str, object], ...] = ()    # SamplingParams fields this engine takes only "off"
    images_unsupported: bool = False                     # engines whose steps do not take image embeddings

    def __init__(self, model: Model, max_num_seqs: int = 8, max_len: int = 2048, prefill_chunk: int = 256,
                 seed: int = 0, ignore_eos: bool = False, tokenizer=None, max_num_batched_tokens: int | None = None,
                 decode_width: int = 1, prefix_cache_bytes: int | str = 0,
                 batch_buckets: Sequence[int] | None = None, chunk_buckets: Sequence[int] | None = None,
                 prefill_batch_buckets: Sequence[int] | None = None):
        """prefill_chunk: the longest prefill chunk (rounded down to a power of two). max_num_batched_tokens: token
        positions one iteration may compute, decode rows first (default_batched_tokens: a full decode window plus
        one longest chunk). tokenizer: for text prompts, stop strings and RequestOutput.text (default:
        model.tokenizer). decode_width: positions a decoding request computes per iteration (speculative engines:
        the state then holds decode_width positions past max_len). prefix_cache_bytes: device bytes of decode-state
        snapshots kept for prompts that share a prefix (0: off; "auto", `jdeep serve`'s default: a quarter of the
        decode state's bytes, prefix_snapshot.auto_budget; prefix_cache.py; not on a device mesh). batch_buckets /
        chunk_buckets: the window sizes and prefill chunk lengths programs are compiled for, prefill_batch_buckets the
        window sizes of prefill steps among them (buckets.py; default: the platform's, buckets.default_ladders: on
        CPU and GPU every power of two up to the slots; chunks: powers of four from 16 plus prefill_chunk)."""
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
        self.pool = self.make_pool(state_length(max_len, decode_width), prefix_cache_bytes)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = default_batched_tokens(self.n_slots * decode_width, prefill_chunk)
        self.scheduler = serving_scheduler(self.n_slots, max_num_batched_tokens, prefill_chunk,
                                           self.pool.window_mode, decode_width, batch_buckets, chunk_buckets,
                                           prefill_batch_buckets)
        self.chunk = self.scheduler.max_chunk
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos = None if ignore_eos else model.config.eos_token_id
        self.requests = RequestTable(seed)
        self.output = OutputProcessor(tokenizer if tokenizer is not None else model.tokenizer)
        self.runner = self.make_runner()
        self.on_iteration: Callable[[IterationStats], None] | None = None   # called after each iteration
        self.totals = {"iterations": 0, "decode_tokens": 0, "prefill_tokens": 0, "slot_moves": 0}

    def make_pool(self, cache_len: int, prefix_cache_bytes: int | str) -> SlotPool:
        """The slot pool (called once by __init__; a speculative engine's carries its drafter's state)."""
        return SlotPool(self.model, self.n_slots, cache_len, prefix_cache_bytes)

    def make_runner(self) -> Runner:
        """The runner (called once by __init__, after the pool and scheduler)."""
        return Runner(self.model, self.pool, self.scheduler)

    # ------------------------------------------------------------------ the parts' state, by their old names
    seed = property(lambda self: self.requests.seed)
    outputs = property(lambda self: self.requests.outputs, doc="RequestOutput by request id (until release)")
    waiting = property(lambda self: self.requests.waiting)
    slots = property(lambda self: self.pool.slots)
    history = property(lambda self: self.pool.history)
    prefix_cache = property(lambda self: self.pool.prefix_cache)

    @property
    def state(self):
        """The target model's decode state (the pool's)."""
        return self.pool.state

    @state.setter
    def state(self, value) -> None:
        self.pool.state = value

    @property
    def tokenizer(self):
        """The tokenizer of text prompts, stop strings and RequestOutput.text (the output processor's; None: ids)."""
        return self.output.tokenizer

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        self.output.tokenizer = value

    @property
    def steps_per_bucket(self) -> dict[int, int]:
        """Step programs run at each window size (rows)."""
        return self.runner.steps_per_bucket

    @steps_per_bucket.setter
    def steps_per_bucket(self, value: dict[int, int]) -> None:
        self.runner.steps_per_bucket = value

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
        return self.requests.add(prompt, sampling, request_id, self.check_request, self.output)

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> bool:
        """End a waiting or running request now (finish_reason `reason`, "abort" by default, with `error` as its
        message); its slot is free for the next step. Returns False if the request is unknown or already finished."""
        return self.requests.abort(request_id, self.pool, reason, error)

    def reset(self) -> None:
        """Abort every request and allocate a fresh decode state (after a failed step: donated state may be gone)."""
        self.requests.abort_all(self.pool)
        self.pool.new_state()

    def release(self, request_id: str) -> RequestOutput | None:
        """Forget a finished request's record (returns it); a request still in flight is aborted first."""
        self.abort(request_id)
        return self.outputs.pop(request_id, None)

    @property
    def n_running(self) -> int:
        """Requests holding a slot (prefilling or decoding)."""
        return self.pool.n_running

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
        free, waiting = self.pool.free_slots(), self.requests.waiting
        taken, failed, waited = [], [], []
        now = time.monotonic()
        while free and waiting:
            slot = waiting.popleft()
            try:
                self.pool.place(free[0], slot)
            except Exception as e:      # e.g. a seed no PRNG key holds: this request fails, the queue goes on
                fail(slot, "preparing its sampling parameters", e)
                failed.append(slot.out)
                continue
            taken.append(free.pop(0))
            slot.out.queue_time = now - slot.arrived
            waited.append(slot.out.queue_time)
        self.pool.start(taken)
        return failed, waited

    def step(self) -> list[RequestOutput]:
        """One engine iteration: admit waiting requests, then one decode step for every request past its prompt and
        prefill chunks for the others within the token budget (scheduler.py). Returns requests finished now."""
        failed, waited = self._admit()
        self.totals["slot_moves"] += self.pool.compact(self.scheduler.window_mode)
        it = self.schedule()
        done = failed + self.output.deliver(self.pool, *self.runner.decode(it))
        done += self.output.deliver(self.pool, *self.runner.prefill(it))
        self.totals["iterations"] += 1
        self.totals["decode_tokens"] += it.decode_tokens
        self.totals["prefill_tokens"] += it.prefill_tokens
        if self.on_iteration is not None:
            self.on_iteration(IterationStats(it.decode_tokens, it.prefill_tokens, it.cost, tuple(waited)))
        return done

    def schedule(self) -> Iteration:
        """The next iteration's plan for the slots as they are (scheduler.Scheduler.schedule; prefill chunks end at
        the prefix cache's snapshot points)."""
        return self.scheduler.schedule(self.pool.remaining_prompts(),
                                       [s.order if s is not None else 0 for s in self.slots])

    def programs(self, prompt_logprobs: bool = True) -> list[ProgramSpec]:
        """Every program this engine runs for its settings, as data (Runner.programs, inventory.py): what warmup
        compiles, and the rare variants compiled on first use (ProgramSpec.first_use: the programs only prompt
        logprobs need; prompt_logprobs=False leaves them out)."""
        return self.runner.programs(self.max_len, prompt_logprobs)

    def warmup(self, first_use: bool = False, workers: int | None = None, progress=None, before_run=None) -> int:
        """Compile every program of `programs` before the first request, side by side on `workers` threads (default:
        the CPU count), then run each once (Runner.warmup); with first_use also those otherwise compiled on first
        use; returns how many ran. progress(done, total, seconds): called as the compiles finish; before_run(): once
        everything is compiled, before anything runs (a multi-process server's barrier)."""
        return self.runner.warmup(self.max_len, first_use, workers, progress, before_run)

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
