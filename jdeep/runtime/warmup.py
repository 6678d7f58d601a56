"""Engine.warmup (Runner.warmup): compile every program serving can reach before the first request — the decode step of each
window size, each (window size, chunk bucket) prefill step the scheduler can choose, what sampling adds
(slot_sampling.warm_sampling: the sampler per window size in its four variants, with and without logprobs and
penalties, the penalty pool's programs, and each prefill step's all-positions variant for prompt logprobs), the slot
move, and with a prefix cache its snapshot copy-out / copy-in programs per prefix bucket. Rows carry position -1 and
copies go from slot 0 onto itself, so the state and the requests in it are untouched."""

from __future__ import annotations

import jax
import numpy as np

from .prefix_snapshot import warm_snapshots
from .scheduler import Window
from .slot_sampling import warm_sampling

__all__ = ["warm_programs"]


def warm_programs(runner, max_len: int, prompt_logprobs: bool = True) -> int:
    """Run every program of a runner.Runner once (see the module docstring; without the prompt-logprob programs
    unless prompt_logprobs; snapshots for prompts up to max_len tokens); returns the number of programs run."""
    counts, pool, sched = dict(runner.steps_per_bucket), runner.pool, runner.scheduler
    pool.reset_slots(np.zeros(pool.n_slots, bool))
    steps = [(n, 1) for n in sched.decode_programs()] + sched.prefill_programs()
    logits = {}
    for n, S in steps:
        logits[n] = runner.run(np.zeros((n, S), np.int32), np.full((n, S), -1, np.int32), Window(0, n))
    n = len(steps) + warm_sampling(runner, logits, prompt_logprobs)      # on the steps' own logits, placed as in serving
    zero = pool.model.put(np.int32(0))
    if sched.window_mode != "pool" and pool.n_slots > 1:     # (one slot never moves)
        pool.move_state(zero, zero)
        n += 1
    n += warm_snapshots(pool, max_len)
    jax.block_until_ready(pool.state)
    runner.steps_per_bucket = counts
    return n
