"""The speculative engine's program inventory (runtime/inventory.py describes inventories): what
SpeculativeRunner.programs lists and warm-up runs, what `plan_speculative_inventory` computes from a config alone, and
each drafter entry's programs over abstract inputs (`drafter_programs`) for `jdeep check-graph` / `jdeep export`.

Entries besides the plain engine's slot programs (inventory.slot_programs, without "slots.move": the drafter's move
copies both states in one program):

    drafter.reset, drafter.move          the drafter's per-slot state emptied; a slot moved in both states
    drafter.snapshot.{out,in}            the drafter's part of a prefix-cache snapshot (one size: its windows)
    b{rows}.spec{k}.decode.{greedy,sampled}   draft k, verify, finish (Drafter.programs_per_decode programs)
    b{rows}.spec.prefill{S}.{greedy,sampled}  a prompt chunk through the target and into the drafter
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from ..model.spec import ModelSpec
from ..plan import build_plan
from ..runtime.inventory import ProgramSpec, slot_programs
from ..runtime.prefix_snapshot import prefix_block, snapshot_block_for
from ..runtime.scheduler import Scheduler, serving_scheduler
from ..runtime.slot_pool import window_mode_for
from ..runtime.slots import default_batched_tokens
from ..runtime.steps import batch_bucket, state_length
from .drafter import Drafter
from .dspark_drafter import DSparkDrafter
from .mtp_drafter import MtpDrafter

__all__ = ["DRAFTERS", "drafting_programs", "plan_speculative_inventory", "drafter_programs", "drafter_for_spec"]


DRAFTERS = {"mtp": MtpDrafter, "dspark": DSparkDrafter}    # speculative method -> its drafter class


def drafting_programs(sched: Scheduler, n_slots: int, snapshot_block: int | None, drafter: Drafter
                      ) -> list[ProgramSpec]:
    """The speculative engine's inventory, in warm-up order (module docstring); snapshot_block: the prefix cache's
    block (None: no snapshots; prefix_snapshot.snapshot_block_for)."""
    k = drafter.k
    out = [s for s in slot_programs(sched, n_slots, snapshot_block) if s.name != "slots.move"]
    out.append(ProgramSpec("drafter.reset", "drafter"))
    if sched.window_mode != "pool" and n_slots > 1:
        out.append(ProgramSpec("drafter.move", "drafter"))
    if snapshot_block is not None:
        out += [ProgramSpec("drafter.snapshot.out", "drafter"), ProgramSpec("drafter.snapshot.in", "drafter")]
    for n in sched.decode_programs():
        out += [ProgramSpec(f"b{n}.spec{k}.decode.{v}", "spec.decode", n, k + 1, v, drafter.programs_per_decode)
                for v in ("greedy", "sampled")]
    for n, S in sched.prefill_programs():
        out += [ProgramSpec(f"b{n}.spec.prefill{S}.{v}", "spec.prefill", n, S, v) for v in ("greedy", "sampled")]
    return out


def drafter_for_spec(spec: ModelSpec, method: str, k: int) -> Drafter:
    """The drafter of `method` for a model of `spec` without weights (its programs only); the spec's plan gets the
    drafter's layers when it has none."""
    if spec.plan.mtp is None and spec.plan.dspark is None:
        spec = dataclasses.replace(spec, plan=build_plan(spec.config, mtp=True))
    return DRAFTERS[method].for_spec(spec, k)


def plan_speculative_inventory(spec: ModelSpec, method: str, k: int, max_num_seqs: int, max_len: int,
                               prefill_chunk: int = 256, max_num_batched_tokens: int | None = None,
                               prefix_cache: bool = True, batch_buckets: Sequence[int] | None = None,
                               chunk_buckets: Sequence[int] | None = None,
                               prefill_batch_buckets: Sequence[int] | None = None, platform: str | None = None
                               ) -> tuple[list[ProgramSpec], int, int, Drafter]:
    """The SpeculativeEngine's inventory for these serving settings from the spec alone (runtime.inventory's
    plan_inventory for speculation: what `make_engine(model, {"method": method, "num_speculative_tokens": k},
    ...).programs()` returns on one device). Returns (specs, n_slots, the state's length, the weightless drafter)."""
    drafter = drafter_for_spec(spec, method, k)
    width = k + 1
    n_slots = batch_bucket(max_num_seqs)
    budget = max_num_batched_tokens or default_batched_tokens(n_slots * width, prefill_chunk)
    mode = drafter.window_mode(window_mode_for(spec.config.engram is not None, mesh=False))
    sched = serving_scheduler(n_slots, budget, prefill_chunk, mode, width, batch_buckets, chunk_buckets,
                              prefill_batch_buckets, platform)
    state_len = state_length(max_len, width)
    block = snapshot_block_for(prefix_block(spec.config) if prefix_cache else None, max_len)
    return drafting_programs(sched, n_slots, block, drafter), n_slots, state_len, drafter


def drafter_programs(drafter: Drafter, entry: ProgramSpec, params, state, n_slots: int, state_len: int
                     ) -> list[tuple[str, Callable, tuple]]:
    """[(name, jitted program, abstract arguments)] of a drafter entry ("drafter.*", "spec.decode", "spec.prefill")
    over abstract params and a target state of n_slots slots and state_len tokens: the programs the speculative
    engine runs for it."""
    dstate = jax.eval_shape(lambda: drafter.empty_state(n_slots, state_len))
    if entry.kind != "drafter":
        return drafter.step_programs(entry, params, state, dstate)
    slot = jax.ShapeDtypeStruct((), jnp.int32)
    what = entry.name.removeprefix("drafter.")
    fn = drafter.slot_program(what.removesuffix(".out").replace("snapshot.in", "restore"))
    if what == "reset":
        return [(entry.name, fn, (dstate, jax.ShapeDtypeStruct((n_slots,), jnp.bool_)))]
    if what == "move":
        return [(entry.name, fn, (state, dstate, slot, slot))]
    if what == "snapshot.out":
        return [(entry.name, fn, (dstate, slot))]
    snap = jax.eval_shape(drafter.slot_program("snapshot"), dstate, slot)
    return [(entry.name, fn, (dstate, snap, slot))]
