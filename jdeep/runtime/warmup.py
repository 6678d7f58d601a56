"""Engine.warmup: compile every program of the engine's inventory (inventory.py, Runner.programs) ahead of running,
side by side on a pool of threads (`precompile`), then run each once before the first request, so serving never
pauses to compile. Each entry kind has its warmer here: the slot pool's reset, move and
snapshot copy-out / copy-in (slot 0 onto itself), the step programs (rows at position -1), the sampler variants on
the steps' own logits (placed as in serving), the penalty pool's programs, and (when asked: they are compiled on
first use in serving) the prompt-logprob program on an all-positions step's logits. Nothing in the state, the
drafter's state, the Engram history or the requests changes; the penalty pool's state is left as it was."""

from __future__ import annotations

import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..model.cache import CachedProgram
from ..model.executables import ExecutableStore
from .inventory import ProgramSpec, total_programs
from .prefix_snapshot import warm_snapshot
from .sampling import SamplingParams, host_batch
from .scheduler import Window
from .slot_sampling import chunk_prompt_logprobs

__all__ = ["WarmContext", "Precompiled", "precompile", "warm_programs", "warm_plain"]


@dataclass
class WarmContext:
    """What one warm-up's entries hand to later ones: each window size's step logits, all-positions logits, and
    snapshots awaiting their copy-in."""

    logits: dict = field(default_factory=dict)
    all_logits: dict = field(default_factory=dict)
    snapshots: dict = field(default_factory=dict)


@dataclass
class Precompiled:
    """What `precompile` did: programs compiled, seconds, and the programs it could not compile ahead of running
    ((name, error) pairs; they compile when warm-up runs them)."""

    programs: int = 0
    seconds: float = 0.0
    failed: list = field(default_factory=list)


def precompile(runner, specs: Sequence[ProgramSpec], workers: int | None = None,
               progress: Callable[[int, int, float], None] | None = None) -> Precompiled:
    """Lower and compile every program of `specs` (Runner.lowered: the programs the runner calls, over the live
    parameters' and state's shapes, placed as its calls place them) without running any, on `workers` threads
    (default: the CPU count; XLA compiles release the GIL, so compiles run side by side). progress(done, total,
    seconds so far) is called after each. The programs then run without compiling: each executable is installed
    in its CachedProgram (model/cache.py), and with the persistent compilation cache on, read from the executable
    store (model/executables.py: no tracing, no lowering) or written there after compiling. On a device mesh too
    (the parameters and the state keep their shardings; no store there: JAX's cache)."""
    out, t0 = Precompiled(), time.perf_counter()
    programs = runner.lowered(specs)
    if not programs:
        return out
    store = ExecutableStore.from_compile_cache() if runner.model.layout is None else None

    def build(prog):
        fn, static = (prog.fn.func, prog.fn.keywords) if isinstance(prog.fn, functools.partial) else (prog.fn, {})
        if isinstance(fn, CachedProgram) and store is not None:
            fn.prepare(prog.args, static, store)
        else:
            prog.lower().compile()
        return prog

    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        futures = {pool.submit(build, p): p for p in programs}
        for i, f in enumerate(as_completed(futures), 1):
            try:
                f.result()
                out.programs += 1
            except Exception as e:        # compiled again when warm-up runs it, where the error would show
                out.failed.append((futures[f].name, f"{type(e).__name__}: {e}"))
            if progress is not None:
                progress(i, len(programs), time.perf_counter() - t0)
    out.seconds = time.perf_counter() - t0
    return out


def warm_programs(runner, specs: Sequence[ProgramSpec], workers: int | None = None,
                  progress: Callable[[int, int, float], None] | None = None,
                  before_run: Callable[[], None] | None = None) -> int:
    """Compile every program of `specs` ahead of running (`precompile`: in parallel; runner.precompiled records what
    it did), call before_run() (a multi-process server's barrier: every process has compiled before the first
    collective), then run each entry once through runner.warm (in order: later entries use earlier ones' outputs);
    returns the number of compiled programs they hold (inventory.total_programs)."""
    runner.precompiled = precompile(runner, specs, workers, progress)
    if before_run is not None:
        before_run()
    counts, pool = dict(runner.steps_per_bucket), runner.pool
    pen = pool.penalties
    kept, pen.state = pen.state, pen.fresh()
    ctx = WarmContext()
    for spec in specs:
        runner.warm(spec, ctx)
    pool.block_until_ready()
    pen.state = kept
    runner.steps_per_bucket = counts
    return total_programs(specs)


def warm_plain(runner, spec: ProgramSpec, ctx: WarmContext) -> None:
    """Run one entry of the plain Engine's inventory (inventory.serving_programs)."""
    pool, model, n = runner.pool, runner.model, spec.rows
    zero = model.put(np.int32(0))
    if spec.name == "slots.reset":
        free = pool.free_slots()
        if free:            # a free slot is reset again when a request takes it: resetting it now changes nothing
            mask = np.zeros(pool.n_slots, bool)
            mask[free[-1]] = True
            pool.reset_slots(mask)
    elif spec.name == "slots.move":
        pool.move_state(zero, zero)
    elif spec.kind == "snapshot":
        warm_snapshot(pool, spec, ctx.snapshots)
    elif spec.kind == "step":
        S, all_logits = spec.seq, spec.variant == "all_logits"
        logits = runner.run(np.zeros((n, S), np.int32), np.full((n, S), -1, np.int32), Window(0, n), all_logits)
        (ctx.all_logits if all_logits else ctx.logits)[(n, S) if all_logits else n] = logits
    elif spec.name == "penalties.reset":
        pool.penalties.admit(0, np.zeros(1, np.int32))
    elif spec.name == "penalties.move":
        pool.penalties.move(0, 0)
    elif spec.kind == "sampler":
        pool.penalties.sample(ctx.logits[n], host_batch([SamplingParams()] * n), np.zeros(n, np.int32), 0,
                              np.zeros(n, bool))
    elif spec.kind == "prompt_logprobs":
        pos = np.full((n, spec.seq), -1, np.int32)
        chunk_prompt_logprobs(model, ctx.all_logits.pop((n, spec.seq)), pos, {})
    else:
        raise ValueError(f"no warm-up for program {spec.name!r} of kind {spec.kind!r}")
