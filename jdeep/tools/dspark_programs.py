"""The programs speculative decoding with DeepSeek-V4.1's DSpark drafter compiles (speculative/dspark_decode.py), as
tools/programs.Program, from the config alone (no weights are read): per batch bucket B

    b{B}.dspark.prefill{S}.{variant}  a prompt chunk through the target with the DSpark taps, into the drafter's windows
    b{B}.dspark.draft.{variant}     the drafter's block after each row's last token (the Markov loop, the confidence head)
    b{B}.dspark{k}.verify.{variant} the target over the k + 1 positions (the Engram rows of the drafts gathered on the
                                    host between the two), acceptance, the restore, the drafter's window append
    b{B}.dspark{k}.iteration.{variant}  draft and verify as one program (models without Engram layers)

variant: greedy, or sampled (the threefry PRNG: Neuron's rules S10/S13/S18 leave it to the host sampler). Scan compile
mode only: the DSpark programs have no regions split yet (their target steps collect the taps inside the scan)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from ..model.dspark import empty_dspark_state
from ..plan import build_plan
from ..speculative.dspark_decode import Carry, draft, iteration, prefill_chunk, verify
from .programs import Program, Target, sampling_inputs, step_inputs

__all__ = ["dspark_programs"]


def dspark_programs(t: Target, batch_sizes: Sequence[int], k: int, prefill_lens: Sequence[int],
                    max_len: int) -> list[Program]:
    c = t.config
    if c.dspark is None:
        raise ValueError("DSpark programs need a DeepSeek-V4.1 config with the DSpark drafter (dspark_* fields)")
    if not 1 <= k <= c.dspark.block_size:
        raise ValueError(f"num_speculative_tokens must be in [1, {c.dspark.block_size}] (dspark_block_size), got {k}")
    if t.compile_mode != "scan":
        raise ValueError("the DSpark speculative programs run in the scan compile mode so far (no regions split)")
    t = dataclasses.replace(t, plan=build_plan(c, mtp=True))
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
