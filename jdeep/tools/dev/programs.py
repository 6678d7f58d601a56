"""Every program jdeep compiles for a model, as (name, jitted function, abstract arguments): what
`jdeep check-graph` checks and `jdeep export` writes.

A step is lowered per batch-size bucket B: prefill (a chunk of `prefill_len` tokens, or one program per chunk length
of a sequence of them) and decode (one token), on a state of B slots and `max_len` tokens. What serving compiles
(`jdeep serve`, the Engine's warmup) is every power-of-two batch bucket up to its slots times every chunk-length
bucket up to its prefill chunk (`chunk_buckets`); `SERVING_BATCH_SIZES` and `SERVING_PREFILL_LEN` are the largest
serving configuration jdeep checks (`jdeep check-graph`'s defaults). In the scan mode a step is one program; in the
regions mode the step's distinct region programs (embed, attn.<kind>, ffn.<moe>, head). Arguments are
jax.ShapeDtypeStruct built from the config alone (no weights are read).
"""

from __future__ import annotations

from typing import Sequence

from ...model.cache import PROGRAMS, ProgramCache
from ...model.spec import ModelSpec
from ...runtime.inventory import ProgramSpec
from ...runtime.lowering import Program, step_inputs, step_programs
from ...runtime.lowering import inventory_programs as runtime_inventory_programs
from ...runtime.sampling import SamplingBatch, abstract_batch
from ...runtime.steps import length_bucket
from ...speculative.inventory import drafter_for_spec, drafter_programs

__all__ = ["Target", "Program", "model_programs", "step_programs", "inventory_programs", "speculative_programs",
           "chunk_buckets", "step_inputs", "sampling_inputs",
           "SERVING_BATCH_SIZES", "SERVING_PREFILL_LEN", "SERVING_PREFILL_TOKENS"]

SERVING_BATCH_SIZES: tuple[int, ...] = tuple(1 << i for i in range(9))    # 1, 2, 4, ..., 256 sequence slots
SERVING_PREFILL_LEN = 8192                                                 # the longest prefill chunk
SERVING_PREFILL_TOKENS = 8192   # the token budget of one prefill step (batch x chunk): larger steps are not served


Target = ModelSpec     # what to build programs for: a model's spec, from a loaded model or a config alone


def sampling_inputs(B: int) -> SamplingBatch:
    """Abstract per-row sampling parameters of B rows (what the speculative programs take; sampling.abstract_batch)."""
    return abstract_batch(B)


def chunk_buckets(longest: int) -> tuple[int, ...]:
    """The prefill chunk lengths serving runs for chunks of up to `longest` tokens, ascending: the length bucket
    of every take 1..longest (`runtime.steps.length_bucket`: powers of two from 16), as the Engine's warmup."""
    top, n, out = length_bucket(longest), length_bucket(1), []
    while n <= top:
        out.append(n)
        n *= 2
    return tuple(out)


def model_programs(t: Target, batch_sizes=(1,), prefill_len: int | Sequence[int] = 64, max_len: int = 256,
                   cache: ProgramCache = PROGRAMS, max_prefill_tokens: int | None = None,
                   pool: int | None = None) -> list[Program]:
    """The programs of prefill and decode steps for every batch bucket, in call order, without duplicates.
    prefill_len: one chunk length (programs "b{B}.prefill") or several ("b{B}.prefill{S}" each, then "b{B}.decode").
    max_prefill_tokens: leave out prefill programs of more tokens (batch x chunk) than one step's budget.
    pool: lower each batch bucket B < pool as the Engine runs it, a window of B slots (traced first slot) of a
    state of `pool` slots (models with Engram step the whole pool; their buckets stay whole states).
    `cache`: where the programs are taken from and kept (a fresh ProgramCache gives freshly jitted programs)."""
    several = not isinstance(prefill_len, int)
    lens = tuple(prefill_len) if several else (prefill_len,)
    out = []
    for B in batch_sizes:
        prefills = [("prefill", S) for S in lens if max_prefill_tokens is None or B * S <= max_prefill_tokens]
        for step, S in prefills + [("decode", 1)]:
            name = f"b{B}.{step}{S if several and step == 'prefill' else ''}"
            out += step_programs(t, name, step, B, S, max_len, pool, cache=cache)
    return out


def inventory_programs(t: Target, specs: Sequence[ProgramSpec], n_slots: int, state_len: int,
                       cache: ProgramCache = PROGRAMS, drafter=None) -> list[Program]:
    """An engine's inventory (runtime/inventory.py: Engine.programs, plan_inventory; speculative/inventory.py:
    plan_speculative_inventory, with its weightless `drafter`) lowered from the config alone, entry by entry under the
    inventory's names (runtime/lowering.inventory_programs; drafter entries through
    speculative.inventory.drafter_programs)."""
    def drafts(spec, params, state):
        return drafter_programs(drafter, spec, params if params is not None else drafter.spec.abstract_params(),
                                state, n_slots, state_len)
    return runtime_inventory_programs(t, specs, n_slots, state_len, cache, drafts if drafter is not None else None)


def speculative_programs(t: Target, batch_sizes: Sequence[int], k: int, prefill_lens: Sequence[int],
                         max_len: int) -> list[Program]:
    """The speculative engine's step programs for k drafts on a pool of B slots per batch bucket B, stepped whole:
    "b{B}.spec{k}.decode.{greedy|sampled}" and "b{B}.spec.prefill{S}.{greedy|sampled}" per chunk length S, lowered
    as the engine runs them (speculative/inventory.drafter_programs: one program per entry in the scan mode, or its
    parts "{name}.{part}": the regions mode's draft, region and finish programs, DSpark's draft and verify around the
    host's Engram gather). The method is the config's: DSpark for a V4.1 config with its drafter, else MTP."""
    method = "dspark" if t.config.dspark is not None else "mtp"
    out = []
    for B in batch_sizes:
        drafter = drafter_for_spec(t, method, k)
        entries = [ProgramSpec(f"b{B}.spec{k}.decode.{v}", "spec.decode", B, k + 1, v) for v in ("greedy", "sampled")]
        entries += [ProgramSpec(f"b{B}.spec.prefill{S}.{v}", "spec.prefill", B, S, v)
                    for S in prefill_lens for v in ("greedy", "sampled")]
        out += inventory_programs(drafter.spec, entries, B, max_len, drafter=drafter)
    return out
