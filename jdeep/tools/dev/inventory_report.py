"""`jdeep info --programs`: a deployment's program inventory counted from the config alone — what `jdeep serve` with
the same settings compiles in warm-up (runtime/inventory.py, speculative/inventory.py), per kind, and in the regions
compile mode (Neuron's) the region programs each model step is made of, i.e. the programs a Neuron deployment
compiles with neuronx-cc."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import jax

from ...model.spec import ModelSpec
from ...runtime.inventory import ProgramSpec, plan_inventory
from ...runtime.lowering import inventory_programs
from ...speculative.inventory import drafter_programs, plan_speculative_inventory

__all__ = ["InventoryCount", "count_inventory", "format_inventory"]

@dataclass
class InventoryCount:
    """specs: the inventory's entries; programs: compiled programs per entry in the spec's compile mode (a regions-mode
    step is one program per region); first_use: entries compiled when first needed rather than in warm-up."""

    spec: ModelSpec
    specs: list[ProgramSpec]
    programs: list[int]
    settings: dict

    @property
    def warmup_programs(self) -> int:
        return sum(n for s, n in zip(self.specs, self.programs) if not s.first_use)

    @property
    def first_use_programs(self) -> int:
        return sum(n for s, n in zip(self.specs, self.programs) if s.first_use)


def _program_key(prog) -> tuple:
    """What makes two listed programs one compiled program: the same jitted function (with the same static keyword
    arguments) over the same argument shapes and dtypes."""
    fn = prog.fn
    fn_key = (fn.func, tuple(sorted(fn.keywords.items()))) if isinstance(fn, functools.partial) else fn
    leaves, tree = jax.tree_util.tree_flatten(prog.args)
    return fn_key, tree, tuple((tuple(a.shape), str(a.dtype)) for a in leaves)


def _programs_per_entry(t: ModelSpec, specs: Sequence[ProgramSpec], n_slots: int, state_len: int, drafter
                        ) -> list[int]:
    """Distinct compiled programs each entry adds (tools/dev/programs.inventory_programs lists them, nothing is
    lowered): a regions-mode step is one program per region; entries sharing a program (the greedy and sampled
    speculative verify's region programs) count it once."""
    seen: set = set()
    out = []
    target = t if drafter is None else drafter.spec
    state = target.abstract_state(n_slots, state_len)       # once, not per entry
    drafts = None if drafter is None else (lambda spec, params, st: drafter_programs(
        drafter, spec, params if params is not None else drafter.spec.abstract_params(), st, n_slots, state_len))
    for s in specs:
        new = 0
        for prog in inventory_programs(target, [s], n_slots, state_len, drafter_programs=drafts, state=state):
            key = _program_key(prog)
            new += key not in seen
            seen.add(key)
        out.append(new)
    return out


def count_inventory(t: ModelSpec, max_num_seqs: int, max_len: int, prefill_chunk: int = 256,
                    max_num_batched_tokens: int | None = None, prefix_cache: bool = True,
                    speculative_tokens: int | None = None, batch_buckets: Sequence[int] | None = None,
                    chunk_buckets: Sequence[int] | None = None, prefill_batch_buckets: Sequence[int] | None = None,
                    platform: str | None = None) -> InventoryCount:
    """The inventory `jdeep serve` with these settings runs for a model of spec `t` on `platform` (its default
    ladders; default JAX's backend), counted (no weights, nothing compiled)."""
    drafter = None
    if speculative_tokens is None:
        specs, n_slots, state_len = plan_inventory(t.config, max_num_seqs, max_len, prefill_chunk,
                                                   max_num_batched_tokens, prefix_cache=prefix_cache,
                                                   batch_buckets=batch_buckets, chunk_buckets=chunk_buckets,
                                                   prefill_batch_buckets=prefill_batch_buckets, platform=platform)
    else:
        method = "dspark" if t.config.dspark is not None else "mtp"
        specs, n_slots, state_len, drafter = plan_speculative_inventory(
            t, method, speculative_tokens, max_num_seqs, max_len, prefill_chunk, max_num_batched_tokens, prefix_cache,
            batch_buckets, chunk_buckets, prefill_batch_buckets, platform)
    settings = {"slots": n_slots, "max_len": max_len, "state_len": state_len, "prefill_chunk": prefill_chunk,
                "prefix_cache": prefix_cache, "speculative_tokens": speculative_tokens}
    return InventoryCount(t, specs, _programs_per_entry(t, specs, n_slots, state_len, drafter), settings)


def format_inventory(c: InventoryCount) -> str:
    """The count per kind, with a few names of each, and the totals."""
    s = c.settings
    spec = f", {s['speculative_tokens']} speculative tokens" if s["speculative_tokens"] else ""
    lines = [f"programs of `jdeep serve` ({c.spec.compile_mode} mode; {s['slots']} slots, max-len {s['max_len']} "
             f"(state {s['state_len']}), prefill chunk {s['prefill_chunk']}, prefix cache "
             f"{'on' if s['prefix_cache'] else 'off'}{spec}):",
             ]
    entries, programs = Counter(), Counter()
    names: dict[str, list[str]] = {}
    for sp, n in zip(c.specs, c.programs):
        kind = sp.kind + (" (first use)" if sp.first_use else "")
        entries[kind] += 1
        programs[kind] += n
        names.setdefault(kind, []).append(sp.name)
    width = max(map(len, entries)) + 2
    lines.append(f"  {'kind':<{width}}{'entries':>8}{'programs':>10}  names")
    for kind in entries:
        shown = ", ".join(names[kind][:3]) + (", ..." if len(names[kind]) > 3 else "")
        lines.append(f"  {kind:<{width}}{entries[kind]:>8}{programs[kind]:>10}  {shown}")
    lines.append(f"  warm-up compiles {c.warmup_programs} programs; {c.first_use_programs} more compile on first use")
    if c.spec.compile_mode == "regions":
        lines.append("  (regions mode: each model step is one program per region: embed, each layer kind's attention "
                     "and MoE halves, head)")
    return "\n".join(lines)
