"""Engine.warmup: run every program of the engine's inventory (inventory.py, Runner.programs) once before the first
request, so serving never pauses to compile. Each entry kind has its warmer here: the slot pool's reset, move and
snapshot copy-out / copy-in (slot 0 onto itself), the step programs (rows at position -1), the sampler variants on
the steps' own logits (placed as in serving), the penalty pool's programs, and the prompt-logprob program on an
all-positions step's logits. Nothing in the state, the drafter's state, the Engram history or the requests changes;
the penalty pool's state is left as it was (not allocated if no penalised request came yet)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .inventory import ProgramSpec, total_programs
from .sampling import SamplingParams, host_batch
from .scheduler import Window
from .slot_sampling import chunk_prompt_logprobs, sampler

__all__ = ["WarmContext", "warm_programs", "warm_plain"]


@dataclass
class WarmContext:
    """What one warm-up's entries hand to later ones: each window size's step logits, all-positions logits, penalty
    windows, sampled tokens, and snapshots awaiting their copy-in."""

    logits: dict = field(default_factory=dict)
    all_logits: dict = field(default_factory=dict)
    windows: dict = field(default_factory=dict)
    tokens: dict = field(default_factory=dict)
    snapshots: dict = field(default_factory=dict)


def warm_programs(runner, specs: Sequence[ProgramSpec]) -> int:
    """Run each entry of `specs` once through runner.warm (in order: later entries use earlier ones' outputs);
    returns the number of compiled programs they hold (inventory.total_programs)."""
    counts, pool = dict(runner.steps_per_bucket), runner.pool
    pen = pool.penalties
    kept, pen.state = pen.state, None
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
        pool.reset_slots(np.zeros(pool.n_slots, bool))
    elif spec.name == "slots.move":
        pool.move_state(zero, zero)
    elif spec.kind == "snapshot":
        if spec.name.endswith(".out"):
            ctx.snapshots[spec.seq] = pool.snapshot(0, spec.seq)[0]
        else:
            pool.restore(0, ctx.snapshots.pop(spec.seq))
    elif spec.kind == "step":
        S, all_logits = spec.seq, spec.variant == "all_logits"
        logits = runner.run(np.zeros((n, S), np.int32), np.full((n, S), -1, np.int32), Window(0, n), all_logits)
        (ctx.all_logits if all_logits else ctx.logits)[(n, S) if all_logits else n] = logits
    elif spec.name == "penalties.reset":
        pool.penalties.admit(0, np.zeros(1, np.int32))
    elif spec.name == "penalties.move":
        pool.penalties.move(0, 0)
    elif spec.name.endswith(".penalties.window"):
        ctx.windows[n] = pool.penalties.window(0, n)
    elif spec.name.endswith(".penalties.count"):
        pool.penalties.count(0, ctx.tokens[n], np.zeros(n, bool))
    elif spec.kind == "sampler":
        args = model.to_sampler((ctx.logits[n], host_batch([SamplingParams()] * n), np.zeros(n, np.int32)))
        want = "logprobs" in spec.variant
        out = sampler(want)(*args, ctx.windows[n] if "penalties" in spec.variant else None)
        ctx.tokens[n] = out[0] if want else out
    elif spec.kind == "prompt_logprobs":
        pos = np.full((n, spec.seq), -1, np.int32)
        chunk_prompt_logprobs(model, ctx.all_logits.pop((n, spec.seq)), pos, {})
    else:
        raise ValueError(f"no warm-up for program {spec.name!r} of kind {spec.kind!r}")
