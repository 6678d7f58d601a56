"""The programs speculative decoding with the MTP drafter compiles, as tools/dev/programs.Program: per batch bucket B the
prefill chunk (backbone + MTP block, per chunk length) and the draft-verify-restore-catch-up iteration for k drafts
(greedy and sampled variants) — what `jdeep check-graph --speculative-tokens K` checks. The sampled variants draw
with the threefry PRNG (runtime/sampling.py), which Neuron's rules leave to the host sampler (S10/S13/S18); the
greedy ones sample nothing. From the config alone (no weights are read). In the regions compile mode the programs
are mtp_decode.RegionsPrograms': per B the region programs of the prefill chunk (with the final streams) and of the
verify step (k + 1 positions, all logits), the MTP half of the prefill, the draft and the finish."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from ...arenas import pack_params
from ...model.mtp import empty_mtp_state
from ...param_spec import abstract_params
from ...plan import build_plan
from ...model.cache import ProgramCache
from ...model.regions import regions_step
from ...speculative.mtp_iteration import Carry, draft, finish, iteration, mtp_params, prefill_chunk, prefill_tail
from ...state import init_state
from .dspark_programs import dspark_programs
from .programs import Program, Target, sampling_inputs

__all__ = ["speculative_programs"]


def _variant(greedy: bool) -> str:
    return "greedy" if greedy else "sampled"


def speculative_programs(t: Target, batch_sizes: Sequence[int], k: int, prefill_lens: Sequence[int],
                         max_len: int) -> list[Program]:
    """Programs "b{B}.spec.prefill{S}.{greedy|sampled}" and "b{B}.spec{k}.iteration.{greedy|sampled}" for a V4 model
    with MTP (params packed in arenas when the target packs them, as on Neuron); for a V4.1 model with the DSpark
    drafter, tools/dev/dspark_programs.py's."""
    c = t.config
    if c.dspark is not None:
        return dspark_programs(t, batch_sizes, k, prefill_lens, max_len)
    plan = build_plan(c, mtp=True)
    if plan.mtp is None:
        raise ValueError("speculative programs need a DeepSeek-V4 model with an MTP block")
    kw = dict(config=c, plan=plan, numerics=t.numerics)
    params = abstract_params(c, plan, t.dtype)
    if t.packed_params:
        params = pack_params(params)
    out = []
    for B in batch_sizes:
        state = jax.eval_shape(lambda: init_state(c, plan, B, max_len, t.dtype, t.numerics))
        mstate = jax.eval_shape(lambda: empty_mtp_state(c, plan, B, max_len, t.dtype, t.numerics))
        i32 = jax.ShapeDtypeStruct((B,), jnp.int32)
        sb = sampling_inputs(B)
        carry = Carry(i32, i32, jax.ShapeDtypeStruct((B, c.vocab_size), jnp.float32),
                      jax.ShapeDtypeStruct((B, c.hc_mult, c.dim), t.dtype), i32,
                      jax.ShapeDtypeStruct((B,), jnp.bool_))
        stops = jax.ShapeDtypeStruct((B, 1), jnp.int32)
        bucket = {"batch": B, "seq": k + 1, "step": "decode", "max_len": max_len}
        if t.compile_mode == "regions":
            out += _regions_programs(t, plan, params, state, mstate, carry, sb, stops, B, k, prefill_lens, max_len)
            continue
        for S in prefill_lens:
            ids = jax.ShapeDtypeStruct((B, S), jnp.int32)
            for greedy in (True, False):
                out.append(Program(f"b{B}.spec.prefill{S}.{_variant(greedy)}",
                                   jax.jit(functools.partial(prefill_chunk, greedy=greedy, **kw)),
                                   (params, state, mstate, ids, ids, ids, sb),
                                   {"batch": B, "seq": S, "step": "prefill", "max_len": max_len}))
        for greedy in (True, False):
            fn = jax.jit(functools.partial(iteration, k=k, greedy=greedy, **kw))
            out.append(Program(f"b{B}.spec{k}.iteration.{_variant(greedy)}", fn,
                               (params, state, mstate, carry, sb, stops, i32), bucket))
    return out


def _regions_programs(t: Target, plan, params, state, mstate, carry, sb, stops, B: int, k: int,
                      prefill_lens: Sequence[int], max_len: int) -> list[Program]:
    c, out = t.config, []
    kw = dict(config=c, plan=plan, numerics=t.numerics)
    mp = mtp_params(params)
    f32, i32 = jnp.float32, jax.ShapeDtypeStruct((B,), jnp.int32)
    for S in prefill_lens:
        ids = jax.ShapeDtypeStruct((B, S), jnp.int32)
        bucket = {"batch": B, "seq": S, "step": "prefill", "max_len": max_len}
        rs = regions_step(c, plan, t.numerics, False, cache=ProgramCache(), hidden=True)
        out += [Program(f"b{B}.spec.prefill{S}.{n}", fn, a, bucket) for n, fn, a in rs.programs(params, state, ids, ids)]
        logits, X = jax.ShapeDtypeStruct((B, c.vocab_size), f32), jax.ShapeDtypeStruct((B, S, c.hc_mult, c.dim), t.dtype)
        for greedy in (True, False):
            out.append(Program(f"b{B}.spec.prefill{S}.tail.{_variant(greedy)}",
                               jax.jit(functools.partial(prefill_tail, greedy=greedy, **kw)),
                               (mp, mstate, logits, X, ids, ids, sb), bucket))
    bucket = {"batch": B, "seq": k + 1, "step": "decode", "max_len": max_len}
    ids = jax.ShapeDtypeStruct((B, k + 1), jnp.int32)
    rs = regions_step(c, plan, t.numerics, True, cache=ProgramCache(), hidden=True)
    out += [Program(f"b{B}.spec{k}.verify.{n}", fn, a, bucket) for n, fn, a in rs.programs(params, state, ids, ids)]
    logits = jax.ShapeDtypeStruct((B, k + 1, c.vocab_size), f32)
    XB = jax.ShapeDtypeStruct((B, k + 1, c.hc_mult, c.dim), t.dtype)
    for greedy in (True, False):
        draft_fn = functools.partial(draft, k=k, greedy=greedy, **kw)
        dr = jax.eval_shape(draft_fn, mp, state, mstate, carry, sb)[1]
        out.append(Program(f"b{B}.spec{k}.draft.{_variant(greedy)}", jax.jit(draft_fn),
                           (mp, state, mstate, carry, sb), bucket))
        out.append(Program(f"b{B}.spec{k}.finish.{_variant(greedy)}",
                           jax.jit(functools.partial(finish, k=k, greedy=greedy, **kw)),
                           (mp, state, mstate, carry, dr, logits, XB, sb, stops, i32), bucket))
    return out
