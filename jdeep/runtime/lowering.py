"""An engine's programs as (name, jitted function, abstract arguments): what warm-up compiles ahead of running
(warmup.precompile), `jdeep check-graph` checks and `jdeep export` writes (tools/dev/programs.py builds its grids on
this module).

`step_programs` gives the program(s) of one model step, as the Engine runs it (a window of a larger pool's slots,
traced first slot; in the regions mode one program per region); `inventory_programs` an inventory's entries
(inventory.py), each as the engine runs it. Arguments are jax.ShapeDtypeStruct trees built from a ModelSpec alone
(no weights), or from the live parameters and state where they are given (`params`, `state`); `placed` gives every
argument the sharding a live call's arguments have, so that a program compiled ahead of time is the one the live
call finds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from ..model.cache import PROGRAMS, ProgramCache
from ..model.model import compiled_rows_step, compiled_step
from ..model.regions import regions_step
from ..model.spec import ModelSpec
from .inventory import ProgramSpec, abstract_program

__all__ = ["Program", "step_inputs", "step_programs", "inventory_programs", "abstract_tree", "sharded_tree",
           "placed"]

DRAFTER_KINDS = ("drafter", "spec.decode", "spec.prefill")


@dataclass(frozen=True)
class Program:
    name: str            # e.g. "b4.decode" (scan) or "b4.decode.attn.csa.r2" (regions)
    fn: Callable         # the jitted function, or functools.partial of one binding its static keyword arguments
    args: tuple          # abstract arguments (pytrees of jax.ShapeDtypeStruct)
    bucket: dict         # {"batch": B, "seq": S, "step": "prefill" | "decode" | kind, "max_len": max_len}

    def lower(self) -> jax.stages.Lowered:
        if isinstance(self.fn, functools.partial):
            return self.fn.func.lower(*self.args, **self.fn.keywords)
        return self.fn.lower(*self.args)


def abstract_tree(tree: Any) -> Any:
    """Arrays (or ShapeDtypeStructs) as jax.ShapeDtypeStruct leaves of the same shapes and dtypes."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def sharded_tree(tree: Any) -> Any:
    """Live arrays as jax.ShapeDtypeStruct leaves that keep each array's sharding (a model on a device mesh)."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def placed(tree: Any, sharding) -> Any:
    """Every jax.ShapeDtypeStruct leaf of `tree` with `sharding` unless it has one (sharded_tree's) — a live call's
    arguments: on one device, every input committed or not runs as if placed there; on a mesh, what Model.put
    places is replicated."""
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None) or sharding), tree)


def step_inputs(t: ModelSpec, B: int, S: int, max_len: int) -> tuple:
    """Abstract (params, state, tokens, positions, engram, embeds) of a step over B slots and S tokens."""
    ids = jax.ShapeDtypeStruct((B, S), jnp.int32)
    embeds = jax.ShapeDtypeStruct((B, S, t.config.dim), t.dtype) if t.host_embedding else None
    return t.abstract_params(), t.abstract_state(B, max_len), ids, ids, t.abstract_engram(B, S), embeds


def step_programs(t: ModelSpec, name: str, step: str, B: int, S: int, max_len: int, pool: int | None = None,
                  all_logits: bool = False, cache: ProgramCache = PROGRAMS, params=None, state=None
                  ) -> list[Program]:
    """The program(s) of one model step over B rows of S tokens on a state of `max_len` tokens, named `name` (in the
    regions mode one per region, "{name}.{region}"); step: "prefill" or "decode" (its bucket's label). pool: B < pool
    rows run as the Engine runs them, a window (traced first slot) of a `pool`-slot state (not models with Engram,
    which step the whole pool). all_logits: every position's logits (the prompt-logprob variant). params, state:
    abstract trees to use instead of the spec's (the live model's; state: the whole pool's)."""
    window = pool is not None and B < pool and t.config.engram is None
    bucket = {"batch": B, "seq": S, "step": step, "max_len": max_len}
    args = step_inputs(t, B, S, max_len)
    if not window and args[5] is None:
        args = args[:5]           # as runtime.steps.run_step calls a step (the same argument structure)
    if window:
        bucket["pool"] = pool
        pool_state = state if state is not None else t.abstract_state(pool, max_len)
        args = (args[0], pool_state) + args[2:] + (jax.ShapeDtypeStruct((), jnp.int32),)
    elif state is not None:
        args = (args[0], state) + args[2:]
    if params is not None:
        args = (params,) + args[1:]
    if t.compile_mode == "scan":
        fn = (compiled_rows_step(t.config, t.plan, t.numerics, all_logits, B, t.layout, cache=cache) if window else
              compiled_step(t.config, t.plan, t.numerics, all_logits, t.layout, cache=cache))
        return [Program(name, fn, args, bucket)]
    rs = regions_step(t.config, t.plan, t.numerics, all_logits, rows=B if window else None, layout=t.layout,
                      cache=cache)
    return [Program(f"{name}.{n}", fn, a, bucket) for n, fn, a in rs.programs(*args)]


def inventory_programs(t: ModelSpec, specs: Sequence[ProgramSpec], n_slots: int, state_len: int,
                       cache: ProgramCache = PROGRAMS, drafter_programs: Callable | None = None, params=None,
                       state=None) -> list[Program]:
    """An engine's inventory (Engine.programs, inventory.plan_inventory) as programs, entry by entry under the
    inventory's names (a step in the regions mode: one program per region, "{name}.{region}"; a drafter entry that
    runs several programs: one each, "{name}.{part}"): model steps as step_programs builds them over an n_slots-slot
    state of state_len tokens, the rest as the engine runs them (inventory.abstract_program; a speculative engine's
    drafter entries through `drafter_programs(entry, params, state)` -> [(name, fn, args)]). params, state: the live
    model's and pool's abstract trees (default: the spec's)."""
    out = []
    if state is None and any(s.kind != "step" for s in specs):
        state = t.abstract_state(n_slots, state_len)
    for spec in specs:
        bucket = {"batch": spec.rows, "seq": spec.seq, "step": spec.kind, "max_len": state_len}
        if spec.kind == "step":
            step = "decode" if spec.name.endswith(".decode") else "prefill"
            out += step_programs(t, spec.name, step, spec.rows, spec.seq, state_len, n_slots,
                                 all_logits=spec.variant == "all_logits", cache=cache, params=params, state=state)
        elif spec.kind in DRAFTER_KINDS:
            if spec.kind == "spec.decode":
                bucket["step"] = "decode"
            out += [Program(name, fn, args, bucket) for name, fn, args in drafter_programs(spec, params, state)]
        else:
            fn, args, static = abstract_program(spec, state, t.config.vocab_size, n_slots, state_len)
            out.append(Program(spec.name, functools.partial(fn, **static) if static else fn, args, bucket))
    return out
