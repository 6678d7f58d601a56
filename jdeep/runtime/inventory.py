"""An engine's program inventory: every program it runs for its settings, as data.

Each engine's runner lists its programs (Runner.programs, Engine.programs) before running any: warm-up walks that
list and runs each entry once, so what warm-up compiles is exactly what the list says (warmup.py), and a deployment's
program set can be read, counted and compared without running a model. An entry is a `ProgramSpec`: a unique name,
the kind of program, the window rows and sequence length it runs at, its variant (sampler options, greedy or
sampled), and how many compiled programs running it takes (`programs`: one, except where one call runs several,
such as a drafter's draft and verify).

Names: "b{rows}.decode", "b{rows}.prefill{S}" (the step programs, as tools/dev/programs.model_programs names them),
"b{rows}.prefill{S}.all_logits" and "b{rows}.prompt_logprobs{S}" (prompt logprobs: compiled when a request first
asks, `first_use`), "b{rows}.sample" (slot_sampling.sample_window), "penalties.{reset,move}", "slots.{reset,move}",
"snapshot.{head,block}.{out,in}" (the prefix cache's copy-out / copy-in of a snapshot's head and of one block
of it: prefix_snapshot.SNAPSHOT_PROGRAMS), and a speculative
runner's "b{rows}.spec{k}.decode.{greedy,sampled}" and "b{rows}.spec.prefill{S}.{greedy,sampled}".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from ..model.cache import PROGRAMS
from ..state import move_slot, reset_slot
from .prefix_snapshot import SNAPSHOT_PROGRAMS, prefix_block, snapshot_block_for, snapshot_programs
from .sampling import PenaltyState, abstract_batch
from .scheduler import Scheduler, serving_scheduler
from .slot_pool import window_mode_for
from .slot_sampling import _move, _prompt_outputs, _reset_row, sample_window
from .slots import default_batched_tokens
from .steps import batch_bucket, state_length

__all__ = ["ProgramSpec", "serving_programs", "slot_programs", "total_programs", "plan_inventory",
           "abstract_program"]


@dataclass(frozen=True)
class ProgramSpec:
    """One program of an engine's inventory (see the module docstring)."""

    name: str
    kind: str                 # "slots" | "step" | "sampler" | "penalties" | "prompt_logprobs" | "snapshot" |
                              # "spec.decode" | "spec.prefill"
    rows: int = 0             # the window's rows (0: not per window)
    seq: int = 0              # positions per row (0: not a step)
    variant: str = ""
    programs: int = 1         # compiled programs one run of this entry takes
    first_use: bool = False   # compiled when a request first needs it, not in warm-up (a rare variant)


def slot_programs(sched: Scheduler, n_slots: int, snapshot_block: int | None) -> list[ProgramSpec]:
    """The slot pool's programs: the reset, the move (when slots can move), the prefix cache's snapshot copies of
    `snapshot_block`-token blocks (None: no snapshots; the entries' seq is the block)."""
    out = [ProgramSpec("slots.reset", "slots")]
    if sched.window_mode != "pool" and n_slots > 1:
        out.append(ProgramSpec("slots.move", "slots"))
    if snapshot_block is not None:
        out += [ProgramSpec(name, "snapshot", seq=snapshot_block) for name in SNAPSHOT_PROGRAMS]
    return out


def serving_programs(sched: Scheduler, n_slots: int, snapshot_block: int | None = None,
                     prompt_logprobs: bool = True) -> list[ProgramSpec]:
    """The plain Engine's inventory, in warm-up order: the slot programs, a decode step per window size and a
    prefill step per (window size, chunk bucket) the scheduler can choose, the sampler per window size, the penalty
    pool's reset and move (run only for requests with a presence, frequency or repetition penalty: compiled when the
    first one comes, `first_use`), and with prompt_logprobs each prefill step's all-positions variant and its
    prompt-logprob program (compiled on first use)."""
    decode, prefill = sched.decode_programs(), sched.prefill_programs()
    out = slot_programs(sched, n_slots, snapshot_block)
    out += [ProgramSpec(f"b{n}.decode", "step", n, 1) for n in decode]
    out += [ProgramSpec(f"b{n}.prefill{S}", "step", n, S) for n, S in prefill]
    out += [ProgramSpec(f"b{n}.sample", "sampler", n) for n in decode]
    out.append(ProgramSpec("penalties.reset", "penalties", first_use=True))
    if sched.window_mode != "pool" and n_slots > 1:
        out.append(ProgramSpec("penalties.move", "penalties", first_use=True))
    for n, S in prefill if prompt_logprobs else ():
        out += [ProgramSpec(f"b{n}.prefill{S}.all_logits", "step", n, S, "all_logits", first_use=True),
                ProgramSpec(f"b{n}.prompt_logprobs{S}", "prompt_logprobs", n, S, first_use=True)]
    return out


def total_programs(specs: Sequence[ProgramSpec]) -> int:
    """Compiled programs an inventory holds (each entry's `programs`)."""
    return sum(s.programs for s in specs)


def plan_inventory(config, max_num_seqs: int, max_len: int, prefill_chunk: int = 256,
                   max_num_batched_tokens: int | None = None, prompt_logprobs: bool = True,
                   prefix_cache: bool = True, batch_buckets: Sequence[int] | None = None,
                   chunk_buckets: Sequence[int] | None = None, prefill_batch_buckets: Sequence[int] | None = None,
                   platform: str | None = None) -> tuple[list[ProgramSpec], int, int]:
    """The plain Engine's inventory for these serving settings (Engine's arguments of the same names; prefix_cache:
    whether it keeps a prefix cache; platform: whose default ladders, default JAX's backend), from the config alone (no weights, no device state): what
    `Engine(model, ...).programs()` returns on one device. Returns (specs, n_slots, the state's length)."""
    n_slots = batch_bucket(max_num_seqs)
    budget = max_num_batched_tokens or default_batched_tokens(n_slots, prefill_chunk)
    sched = serving_scheduler(n_slots, budget, prefill_chunk, window_mode_for(config.engram is not None, mesh=False),
                              1, batch_buckets, chunk_buckets, prefill_batch_buckets, platform)
    block = snapshot_block_for(prefix_block(config) if prefix_cache else None, max_len)
    return serving_programs(sched, n_slots, block, prompt_logprobs), n_slots, state_length(max_len)


def abstract_program(spec: ProgramSpec, state: Any, vocab: int, n_slots: int, state_len: int
                     ) -> tuple[Callable, tuple, dict]:
    """(jitted function, abstract arguments, static keyword arguments) of an inventory entry that is not a model
    step — what the engine runs for it (slot_pool.py, slot_sampling.py, prefix_snapshot.py) — over an abstract
    decode state of n_slots slots and state_len tokens (jax.ShapeDtypeStruct leaves) and a vocabulary of `vocab`
    ids. ValueError for a step entry (tools/dev/programs.step_programs lowers those)."""
    def a(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt)

    i32, n = a((), jnp.int32), spec.rows
    pen = PenaltyState(a((n_slots, vocab), jnp.int32), a((n_slots, vocab), jnp.bool_))
    if spec.name == "slots.reset":
        return PROGRAMS.jit(reset_slot, donate_argnums=(0,)), (state, i32), {}
    if spec.name == "slots.move":
        return PROGRAMS.jit(move_slot, donate_argnums=(0,)), (state, i32, i32), {}
    if spec.kind == "snapshot":
        progs = snapshot_programs()
        if spec.name.startswith("snapshot.head"):
            head = jax.eval_shape(progs["snapshot.head.out"], state, i32)
            args = (state, i32) if spec.name.endswith(".out") else (state, head, i32)
            return progs[spec.name], args, {}
        static = {"block": spec.seq, "max_len": state_len}
        blk = jax.eval_shape(lambda s, i, k: progs["snapshot.block.out"](s, i, k, **static), state, i32, i32)
        args = (state, i32, i32) if spec.name.endswith(".out") else (state, blk, i32, i32)
        return progs[spec.name], args, static
    if spec.name == "penalties.reset":
        return PROGRAMS.jit(_reset_row, donate_argnums=(0,)), (pen, i32, a((vocab,), jnp.bool_)), {}
    if spec.name == "penalties.move":
        return PROGRAMS.jit(_move, donate_argnums=(0,)), (pen, i32, i32), {}
    if spec.kind == "sampler":
        return PROGRAMS.jit(sample_window, donate_argnums=(0,)), (pen, a((n, vocab), jnp.float32), abstract_batch(n),
                                                                 a((n,), jnp.int32), i32, a((n,), jnp.bool_)), {}
    if spec.kind == "prompt_logprobs":
        ids = a((n, spec.seq), jnp.int32)
        return PROGRAMS.jit(_prompt_outputs), (a((n, spec.seq, vocab), jnp.float32), ids, ids), {}
    raise ValueError(f"{spec.name!r} ({spec.kind}) is a model step or a drafter's program: tools/dev/programs lowers it")
