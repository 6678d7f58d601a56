"""The programs speculative decoding with the MTP drafter compiles, as tools/programs.Program: per batch bucket B the
prefill chunk (backbone + MTP block, per chunk length) and the draft-verify-restore-catch-up iteration for k drafts
(greedy and sampled variants) — what `jdeep check-graph --speculative-tokens K` checks. The sampled variants draw
with the threefry PRNG (runtime/sampling.py), which Neuron's rules leave to the host sampler (S10/S13/S18); the
greedy ones sample nothing. Scan compile mode, from the
config alone (no weights are read)."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from ..arenas import pack_params
from ..model.mtp import empty_mtp_state
from ..param_spec import abstract_params
from ..plan import build_plan
from ..runtime.sampling import SamplingBatch
from ..speculative.mtp_decode import Carry, iteration, prefill_chunk
from ..state import init_state
from .programs import Program, Target

__all__ = ["speculative_programs"]


def _sampling(B: int) -> SamplingBatch:
    f, i = jax.ShapeDtypeStruct((B,), jnp.float32), jax.ShapeDtypeStruct((B,), jnp.int32)
    return SamplingBatch(f, i, f, f, jax.ShapeDtypeStruct((B, 2), jnp.uint32))


def _variant(greedy: bool) -> str:
    return "greedy" if greedy else "sampled"


def speculative_programs(t: Target, batch_sizes: Sequence[int], k: int, prefill_lens: Sequence[int],
                         max_len: int) -> list[Program]:
    """Programs "b{B}.spec.prefill{S}.{greedy|sampled}" and "b{B}.spec{k}.iteration.{greedy|sampled}" for a V4 model
    with MTP (params packed in arenas when the target packs them, as on Neuron)."""
    if t.compile_mode != "scan":
        raise ValueError("speculative decoding runs in the scan compile mode (no regions programs to check)")
    c = t.config
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
        sb = _sampling(B)
        for S in prefill_lens:
            ids = jax.ShapeDtypeStruct((B, S), jnp.int32)
            for greedy in (True, False):
                out.append(Program(f"b{B}.spec.prefill{S}.{_variant(greedy)}",
                                   jax.jit(functools.partial(prefill_chunk, greedy=greedy, **kw)),
                                   (params, state, mstate, ids, ids, ids, sb),
                                   {"batch": B, "seq": S, "step": "prefill", "max_len": max_len}))
        carry = Carry(i32, i32, jax.ShapeDtypeStruct((B, c.vocab_size), jnp.float32),
                      jax.ShapeDtypeStruct((B, c.hc_mult, c.dim), t.dtype), i32,
                      jax.ShapeDtypeStruct((B,), jnp.bool_))
        for greedy in (True, False):
            fn = jax.jit(functools.partial(iteration, k=k, greedy=greedy, **kw))
            out.append(Program(f"b{B}.spec{k}.iteration.{_variant(greedy)}", fn,
                               (params, state, mstate, carry, sb, jax.ShapeDtypeStruct((B, 1), jnp.int32), i32),
                               {"batch": B, "seq": k + 1, "step": "decode", "max_len": max_len}))
    return out
