"""The Engine's runner: one iteration's step programs and sampling over the slot pool.

`decode(it)` runs the decode program over the iteration's decode window ([rows, 1]: each decoding request's last
token) and `prefill(it)` the prefill program over its prefill window ([rows, S]: the chunk the scheduler planned,
taken from the pool); each samples the next token of the slots that need one and returns them with their logprob
entries, for the output processor to deliver. Rows a program does not serve carry position -1 and write nothing.
Prompt logprobs come from the prefill step's all-positions variant (slot_sampling.chunk_prompt_logprobs); penalised
requests' token counts advance on the device (slot_sampling.SlotPenalties). `programs` lists every program the runner and its pool
run (inventory.py) and `warmup` runs each once (warmup.py). A speculative engine's runner (speculative/engine.SpeculativeRunner) replaces decode, prefill
and warmup with its drafter's programs.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from ..model.model import Model
from .inventory import ProgramSpec, serving_programs
from .lowering import Program, abstract_tree, inventory_programs, placed, sharded_tree
from .prefix_snapshot import snapshot_block_for, snapshot_prefills
from .scheduler import Iteration, Scheduler, Window
from .slot_pool import SlotPool
from .slot_sampling import chunk_prompt_logprobs, logprob_entries
from .slots import guarded
from .steps import run_step
from .warmup import WarmContext, warm_plain, warm_programs

__all__ = ["Runner", "Tokens"]

Tokens = tuple[dict[int, list[int]], dict[int, list]]   # (slot -> new tokens, slot -> their logprob entries)

SAMPLER_KINDS = ("sampler", "penalties")   # programs that run on the sampler's device (Model.to_sampler)


class Runner:
    """Runner(model, pool, scheduler). steps_per_bucket counts the step programs run at each window size (rows)."""

    def __init__(self, model: Model, pool: SlotPool, scheduler: Scheduler):
        self.model, self.pool, self.scheduler = model, pool, scheduler
        self.steps_per_bucket: dict[int, int] = {}
        self.precompiled = None      # warmup.Precompiled of the last warm-up

    def count_step(self, rows: int) -> None:
        self.steps_per_bucket[rows] = self.steps_per_bucket.get(rows, 0) + 1

    def run(self, toks: np.ndarray, pos: np.ndarray, window: Window, all_logits: bool = False,
            images=None) -> jax.Array:
        """One step program over `window` (toks, pos: int32 [window.rows, S]; images: its rows' image spans,
        steps.run_step); returns logits [window.rows, V] ([window.rows, S, V] with all_logits)."""
        self.count_step(window.rows)
        pool = self.pool
        part = {} if window.rows == pool.n_slots else {"rows": window.rows, "start": window.start}
        logits, pool.state = run_step(self.model, pool.state, toks, pos, pool.history, all_logits=all_logits,
                                      images=images, **part)
        return logits

    def sample(self, logits: jax.Array, window: Window, rows: list[int]) -> Tokens:
        """The next token of each slot in `rows` from the window's logits [window.rows, V], with logprob entries for
        the requests that asked (one sampler program per window size: slot_sampling.sample_window; the rows' token
        counts advance on the device)."""
        pool, lo = self.pool, window.start
        slots = pool.slots
        counts = np.array([len(s.out.tokens) if s is not None else 0 for s in slots[lo:lo + window.rows]], np.int32)
        want = [i for i in rows if slots[i].params.logprobs is not None]
        live = np.zeros(window.rows, bool)
        live[[i - lo for i in rows]] = True
        out = pool.penalties.sample(logits, pool.window_rows(window), counts, lo, live)
        tokens = out[0]
        nxt = self.model.fetch(tokens)
        entries = {}
        if want:    # (one request's failure is raised again on delivery, where that request alone fails)
            lp, ids, vals = (self.model.fetch(a) for a in out[1:])
            entries = {i: [guarded(logprob_entries, nxt[i - lo], lp[i - lo], ids[i - lo], vals[i - lo],
                                   slots[i].params.logprobs)] for i in want}
        return {i: [int(nxt[i - lo])] for i in rows}, entries

    def decode(self, it: Iteration) -> Tokens:
        """The iteration's decode step: one token for every slot in it.decode."""
        if not it.decode:
            return {}, {}
        w, slots = it.decode_window, self.pool.slots
        toks = np.zeros((w.rows, 1), np.int32)
        pos = np.full((w.rows, 1), -1, np.int32)
        for i in it.decode:
            s = slots[i]
            toks[i - w.start, 0] = self.pool.last[i]
            pos[i - w.start, 0] = len(s.out.prompt) + len(s.out.tokens) - 1
        return self.sample(self.run(toks, pos, w), w, it.decode)

    def prefill(self, it: Iteration) -> Tokens:
        """The iteration's prefill chunk; the first token of every slot whose prompt ends in it."""
        if not it.prefill:
            return {}, {}
        pool = self.pool
        w, scored = it.prefill_window, [i for i in it.prefill if pool.slots[i].params.prompt_logprobs is not None]
        first = {i: pool.slots[i].prefilled for i in scored}
        toks, pos, ended = pool.take_chunk(it)
        spans = [pool.slots[i].request.images if i in it.prefill else () for i in range(w.start, w.start + w.rows)]
        logits = self.run(toks, pos, w, all_logits=bool(scored), images=spans)   # [rows, S, V] for prompt logprobs
        snapshot_prefills(pool, it.prefill)
        if scored:
            ask = {i - w.start: (pool.slots[i].request.ids, first[i], pool.slots[i].params.prompt_logprobs)
                   for i in scored}
            logits, entries = chunk_prompt_logprobs(self.model, logits, pos, ask)
            for r, e in entries.items():
                pool.slots[w.start + r].out.prompt_logprobs += e
        return self.sample(logits, w, ended)

    def programs(self, max_len: int, prompt_logprobs: bool = True) -> list[ProgramSpec]:
        """Every program this runner and its pool run for prompts up to max_len tokens, in warm-up order
        (inventory.serving_programs); prompt_logprobs=False leaves out the all-positions prefill steps and the
        prompt-logprob programs only prompt logprobs need (listed with first_use: compiled when first asked)."""
        return serving_programs(self.scheduler, self.pool.n_slots, snapshot_block_for(self.pool.snapshot_block, max_len),
                                prompt_logprobs)

    def warm(self, spec: ProgramSpec, ctx: WarmContext) -> None:
        """Run one entry of `programs` on idle rows (warmup.py)."""
        warm_plain(self, spec, ctx)

    def lowered(self, specs: list[ProgramSpec], drafter_programs=None) -> list[Program]:
        """The programs the entries `specs` run, with the live parameters', state's and inputs' shapes and placement
        (lowering.inventory_programs): what warmup.precompile compiles. On a device mesh the parameters and the state
        keep their shardings and the other inputs are replicated (Model.put)."""
        model, pool = self.model, self.pool
        if model.layout is not None:
            programs = inventory_programs(model.spec, specs, pool.n_slots, pool.cache_len,
                                          drafter_programs=drafter_programs, params=sharded_tree(model.params),
                                          state=sharded_tree(pool.state))
            return [dataclasses.replace(p, args=placed(p.args, model.layout.replicated)) for p in programs]
        programs = inventory_programs(model.spec, specs, pool.n_slots, pool.cache_len,
                                      drafter_programs=drafter_programs, params=abstract_tree(model.params),
                                      state=abstract_tree(pool.state))
        device = SingleDeviceSharding(jax.devices()[0])
        sampler = SingleDeviceSharding(model.sampler_device) if model.sampler_device is not None else device
        return [dataclasses.replace(p, args=placed(p.args, sampler if p.bucket["step"] in SAMPLER_KINDS else device))
                for p in programs]

    def warmup(self, max_len: int, first_use: bool = False, workers: int | None = None, progress=None,
               before_run=None) -> int:
        """Compile, then run, every entry of `programs` once (warmup.warm_programs; with first_use also those
        otherwise compiled on first use); returns the number of compiled programs they hold. workers, progress: the
        compile's threads and progress callback (warmup.precompile); before_run: called between compiling and
        running."""
        return warm_programs(self, [s for s in self.programs(max_len) if first_use or not s.first_use], workers,
                             progress, before_run)
