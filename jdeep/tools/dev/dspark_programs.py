"""The programs speculative decoding with DeepSeek-V4.1's DSpark drafter compiles (speculative/dspark_decode.py), as
tools/dev/programs.Program, from the config alone (no weights are read): per batch bucket B

    b{B}.dspark.prefill{S}.{variant}  a prompt chunk through the target with the DSpark taps, into the drafter's windows
    b{B}.dspark.draft.{variant}     the drafter's block after each row's last token (the Markov loop, the confidence head)
    b{B}.dspark{k}.verify.{variant} the target over the k + 1 positions (the Engram rows of the drafts gathered on the
                                    host between the two), acceptance, the restore, the drafter's window append
    b{B}.dspark{k}.iteration.{variant}  draft and verify as one program (models without Engram layers)

variant: greedy, or sampled (the threefry PRNG: Neuron's rules S10/S13/S18 leave it to the host sampler). In the
regions compile mode (speculative/dspark_regions.py): the region programs of the prefill step and of each verify
target step (with the taps), and b{B}.dspark.prefill{S}.tail, b{B}.dspark.draft, b{B}.dspark{k}.chunks (the verified
positions per target step), b{B}.dspark{k}.save{S} (a target step's undo log) and b{B}.dspark{k}.finish."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from ...model.cache import ProgramCache
from ...model.dspark import empty_dspark_state
from ...model.regions import regions_step
from ...plan import build_plan, dspark_tap_layers
from ...speculative.dspark_iteration import (Carry, draft, finish, iteration, prefill_chunk, save_undo, verify,
                                           verify_slices)
from ...speculative.dspark_regions import prefill_tail, verify_chunks
from ...speculative.mtp_iteration import mtp_params
from .programs import Program, Target, sampling_inputs, step_inputs

__all__ = ["dspark_programs"]


def dspark_programs(t: Target, batch_sizes: Sequence[int], k: int, prefill_lens: Sequence[int],
                    max_len: int) -> list[Program]:
    c = t.config
    if c.dspark is None:
        raise ValueError("DSpark programs need a DeepSeek-V4.1 config with the DSpark drafter (dspark_* fields)")
    if not 1 <= k <= c.dspark.block_size:
        raise ValueError(f"num_speculative_tokens must be in [1, {c.dspark.block_size}] (dspark_block_size), got {k}")
    t = dataclasses.replace(t, plan=build_plan(c, mtp=True))
    if t.compile_mode == "regions":
        return [p for B in batch_sizes for p in _regions_programs(t, B, k, prefill_lens, max_len)]
    kw = dict(config=c, plan=t.plan, numerics=t.numerics)
    variants = {"greedy": True, "sampled": False}
    out = []
    for B in batch_sizes:
        dstate = jax.eval_shape(lambda: empty_dspark_state(c, t.plan, B, max_len, t.dtype, t.numerics))
        i32, sb = jax.ShapeDtypeStruct((B,), jnp.int32), sampling_inputs(B)
        carry = Carry(i32, i32, i32, jax.ShapeDtypeStruct((B,), jnp.bool_))
        stops = jax.ShapeDtypeStruct((B, 1), jnp.int32)
        for S in prefill_lens:
            params, state, ids, pos, engram, _ = step_inputs(t, B, S, max_len)
            for name, greedy in variants.items():
                out.append(Program(f"b{B}.dspark.prefill{S}.{name}",
                                   jax.jit(functools.partial(prefill_chunk, greedy=greedy, **kw)),
                                   (params, state, dstate, ids, pos, engram, sb),
                                   {"batch": B, "seq": S, "step": "prefill", "max_len": max_len}))
        params, state, _, _, engram, _ = step_inputs(t, B, k + 1, max_len)
        bucket = {"batch": B, "seq": k + 1, "step": "decode", "max_len": max_len}
        for name, greedy in variants.items():
            draft_fn = functools.partial(draft, greedy=greedy, **kw)
            drafts, q = jax.eval_shape(draft_fn, params, dstate, carry, sb)
            out.append(Program(f"b{B}.dspark.draft.{name}", jax.jit(draft_fn), (params, dstate, carry, sb), bucket))
            out.append(Program(f"b{B}.dspark{k}.verify.{name}",
                               jax.jit(functools.partial(verify, k=k, greedy=greedy, **kw)),
                               (params, state, dstate, carry, drafts, q, sb, stops, i32, engram), bucket))
            if c.engram is None:
                out.append(Program(f"b{B}.dspark{k}.iteration.{name}",
                                   jax.jit(functools.partial(iteration, k=k, greedy=greedy, **kw)),
                                   (params, state, dstate, carry, sb, stops, i32), bucket))
    return out


def _regions_programs(t: Target, B: int, k: int, prefill_lens: Sequence[int], max_len: int) -> list[Program]:
    c, out = t.config, []
    kw = dict(config=c, plan=t.plan, numerics=t.numerics)
    variants = {"greedy": True, "sampled": False}
    dstate = jax.eval_shape(lambda: empty_dspark_state(c, t.plan, B, max_len, t.dtype, t.numerics))
    i32, sb = jax.ShapeDtypeStruct((B,), jnp.int32), sampling_inputs(B)
    carry = Carry(i32, i32, i32, jax.ShapeDtypeStruct((B,), jnp.bool_))
    n_taps = len(dspark_tap_layers(c))

    def outputs(S):
        return (jax.ShapeDtypeStruct((B, S, c.vocab_size), jnp.float32),
                jax.ShapeDtypeStruct((B, S, n_taps * c.dim), t.dtype))

    for S in prefill_lens:
        params, state, ids, pos, engram, _ = step_inputs(t, B, S, max_len)
        bucket = {"batch": B, "seq": S, "step": "prefill", "max_len": max_len}
        rs = regions_step(c, t.plan, t.numerics, False, cache=ProgramCache(), taps=True)
        out += [Program(f"b{B}.dspark.prefill{S}.{n}", fn, a, bucket)
                for n, fn, a in rs.programs(params, state, ids, pos, engram)]
        logits = jax.ShapeDtypeStruct((B, c.vocab_size), jnp.float32)
        for name, greedy in variants.items():
            out.append(Program(f"b{B}.dspark.prefill{S}.tail.{name}",
                               jax.jit(functools.partial(prefill_tail, greedy=greedy, **kw)),
                               (mtp_params(params), dstate, logits, outputs(S)[1], pos, sb), bucket))
    params, state, _, _, _, _ = step_inputs(t, B, k + 1, max_len)
    mp = mtp_params(params)
    bucket = {"batch": B, "seq": k + 1, "step": "decode", "max_len": max_len}
    slices = verify_slices(state, k)
    chunks_fn = functools.partial(verify_chunks, k=k, vocab_size=c.vocab_size, slices=slices)
    drafts = jax.ShapeDtypeStruct((B, c.dspark.block_size), jnp.int32)
    out.append(Program(f"b{B}.dspark{k}.chunks", jax.jit(chunks_fn), (carry, drafts), bucket))
    logs, logits, taps = [], [], []
    for S in sorted({sl.stop - sl.start for sl in slices}, reverse=True):
        _, _, ids, pos, engram, _ = step_inputs(t, B, S, max_len)
        rs = regions_step(c, t.plan, t.numerics, True, cache=ProgramCache(), taps=True)
        out += [Program(f"b{B}.dspark{k}.verify{S}.{n}", fn, a, bucket)
                for n, fn, a in rs.programs(params, state, ids, pos, engram)]
        save_fn = functools.partial(save_undo, plan=t.plan)
        out.append(Program(f"b{B}.dspark{k}.save{S}", jax.jit(save_fn), (state, pos), bucket))
    for sl in slices:
        pos = jax.ShapeDtypeStruct((B, sl.stop - sl.start), jnp.int32)
        logs.append(jax.eval_shape(functools.partial(save_undo, plan=t.plan), state, pos))
        lg, tp = outputs(sl.stop - sl.start)
        logits.append(lg)
        taps.append(tp)
    for name, greedy in variants.items():
        draft_fn = functools.partial(draft, greedy=greedy, **kw)
        drafts, q = jax.eval_shape(draft_fn, mp, dstate, carry, sb)
        out.append(Program(f"b{B}.dspark.draft.{name}", jax.jit(draft_fn), (mp, dstate, carry, sb), bucket))
        out.append(Program(f"b{B}.dspark{k}.finish.{name}",
                           jax.jit(functools.partial(finish, k=k, greedy=greedy, **kw)),
                           (mp, state, dstate, carry, drafts, q, logs, logits, taps, sb, _stops(B), i32), bucket))
    return out


def _stops(B: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((B, 1), jnp.int32)
