"""DSpark speculative decoding in the regions compile mode (Neuron's mode for deep models, model/regions.py): the
pieces of dspark_iteration as separate programs around the regions step, which returns the DSpark taps itself (the
target layers' attention programs have a tap variant).

    prefill    the regions step over the chunk (taps), then `tail`: the first token and the append of every
               position to the drafter's windows
    iteration  `draft` (the drafter's block); `inputs` (the verified tokens and positions, per target step of
               dspark_iteration.verify_slices); per target step `save` (its undo log) and the regions step over its
               positions (all logits, taps); `finish` (acceptance, restore, append: dspark_iteration.finish)

The drafter's programs take only the parameters it reads (mtp_iteration.mtp_params: its stages, the embedding and
the head). Results equal the scan mode's: the same functions in the same order.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ..model.cache import PROGRAMS
from ..model.dspark import dspark_append
from ..model.spec import ModelSpec
from ..model.regions import regions_step
from ..runtime.sampling import sample
from .acceptance import greedy_ids, with_logprobs
from .dspark_iteration import Carry, draft, finish, save_undo, verify_inputs, verify_slices
from .mtp_iteration import mtp_params

__all__ = ["RegionsPrograms", "prefill_tail", "verify_chunks"]


def prefill_tail(params, dstate, logits, taps, positions, sb, *, greedy, config, plan, numerics):
    """The drafter's half of a prefill chunk after the regions step: (first token (acceptance.Emitted [B]), dstate)."""
    zero = jnp.zeros(positions.shape[:1], jnp.int32)
    first = greedy_ids(logits[:, None], sb, zero)[:, 0] if greedy else sample(logits, sb, zero)
    return with_logprobs(first, logits, keep_logits=True), dspark_append(params, dstate, taps, positions, config=config, plan=plan,
                                                       numerics=numerics)


def verify_chunks(carry: Carry, drafts, *, k, vocab_size, slices):
    """(tokens, positions) int32 [B, S_i] of each target step (slices: verify_slices)."""
    tokens, pos = verify_inputs(carry, drafts, k=k, vocab_size=vocab_size)
    return tuple((tokens[:, sl], pos[:, sl]) for sl in slices)


class RegionsPrograms:
    """The DSpark programs of one model spec, k and variant (greedy: every row greedy) in the regions mode; put: how
    host arrays reach the device (Model.put; None: programs listed for lowering only)."""

    def __init__(self, spec: ModelSpec, k: int, greedy: bool, keep_logits: bool = False,
                 put: Callable | None = None):
        self.spec, self.k, self.greedy, self.put = spec, k, greedy, put
        c, plan, num = spec.config, spec.plan, spec.numerics
        kw = dict(config=c, plan=plan, numerics=num)
        self.draft = PROGRAMS.keyed("dspark_regions_draft", spec,
                                    lambda: jax.jit(functools.partial(draft, greedy=greedy, **kw)), greedy=greedy)
        self.save = PROGRAMS.keyed("dspark_regions_save", spec,
                                   lambda: jax.jit(functools.partial(save_undo, plan=plan)))
        self.finish = PROGRAMS.keyed("dspark_regions_finish", spec, lambda: jax.jit(
            functools.partial(finish, k=k, greedy=greedy, keep_logits=keep_logits, **kw), donate_argnums=(1, 2)),
            k=k, greedy=greedy, keep_logits=keep_logits)
        self.tail = PROGRAMS.keyed("dspark_regions_tail", spec, lambda: jax.jit(
            functools.partial(prefill_tail, greedy=greedy, **kw), donate_argnums=(1,)), greedy=greedy)
        self.verify_step = regions_step(c, plan, num, True, taps=True)
        self.prefill_step = regions_step(c, plan, num, False, taps=True)

    def prefill(self, params, state, dstate, tokens, positions, engram, sb):
        """A prompt chunk (dspark_iteration.prefill_chunk). Returns (first token (acceptance.Emitted [B]), state,
        dstate)."""
        (logits, taps), state = self.prefill_step(params, state, tokens, positions, engram)
        first, dstate = self.tail(mtp_params(params), dstate, logits, taps, self.put(positions), sb)
        return first, state, dstate

    def drafts(self, params, dstate, carry: Carry, sb):
        """The drafter's block (dspark_iteration.draft): (drafts int32 [B, block], q or None)."""
        return self.draft(mtp_params(params), dstate, carry, sb)

    def slices(self, state: dict) -> list[slice]:
        return verify_slices(state, self.k)

    def inputs(self, slices: list[slice]) -> Callable:
        """(carry, drafts) -> each target step's (tokens, positions) (verify_chunks)."""
        return PROGRAMS.get(("dspark_regions_inputs", self.k, tuple((s.start, s.stop) for s in slices),
                             self.spec.config.vocab_size), lambda: jax.jit(functools.partial(
                                 verify_chunks, k=self.k, vocab_size=self.spec.config.vocab_size, slices=slices)))

    def verify(self, params, state, dstate, carry: Carry, drafts, q, sb, stops, max_new, engram_slices=None):
        """dspark_iteration.verify as programs; engram_slices: the Engram rows of each target step's positions (models
        with Engram; one tuple per verify_slices entry). Returns what dspark_iteration.verify returns."""
        logs, logits, taps = [], [], []
        for i, (tokens, pos) in enumerate(self.inputs(self.slices(state))(carry, drafts)):
            logs.append(self.save(state, pos))
            (lg, tp), state = self.verify_step(params, state, tokens, pos,
                                               None if engram_slices is None else engram_slices[i])
            logits.append(lg)
            taps.append(tp)
        return self.finish(mtp_params(params), state, dstate, carry, drafts, q, logs, logits, taps, sb, stops,
                           max_new)

    def programs(self, name: str, params, state, dstate, sb, seq: int | None = None
                 ) -> list[tuple[str, Callable, tuple]]:
        """[(name.part, jitted program, abstract args)] a prefill chunk of `seq` tokens (seq given) or an iteration
        runs, over abstract params, state, dstate and sampling rows of the whole pool (for lowering)."""
        t, B = self.spec, sb.temperature.shape[0]
        mp = mtp_params(params)
        if seq is not None:
            ids = jax.ShapeDtypeStruct((B, seq), jnp.int32)
            engram = t.abstract_engram(B, seq)
            (logits, taps), _ = jax.eval_shape(self.prefill_step, params, state, ids, ids, engram)
            return ([(f"{name}.{n}", fn, a) for n, fn, a in self.prefill_step.programs(params, state, ids, ids, engram)]
                    + [(f"{name}.tail", self.tail, (mp, dstate, logits, taps, ids, sb))])
        i32, b = jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.bool_)
        carry = Carry(i32, i32, i32, b)
        drafts, q = jax.eval_shape(self.draft, mp, dstate, carry, sb)
        slices = self.slices(state)
        inputs = self.inputs(slices)
        out = [(f"{name}.draft", self.draft, (mp, dstate, carry, sb)), (f"{name}.chunks", inputs, (carry, drafts))]
        logs, logits, taps, lengths = [], [], [], set()
        for tokens, pos in jax.eval_shape(inputs, carry, drafts):
            S = tokens.shape[1]
            engram = t.abstract_engram(B, S)
            logs.append(jax.eval_shape(self.save, state, pos))
            (lg, tp), _ = jax.eval_shape(self.verify_step, params, state, tokens, pos, engram)
            logits.append(lg)
            taps.append(tp)
            if S not in lengths:       # one save and one regions step per distinct length
                lengths.add(S)
                out.append((f"{name}.save{S}", self.save, (state, pos)))
                out += [(f"{name}.verify{S}.{n}", fn, a)
                        for n, fn, a in self.verify_step.programs(params, state, tokens, pos, engram)]
        stops, max_new = jax.ShapeDtypeStruct((B, 1), jnp.int32), i32
        out.append((f"{name}.finish", self.finish,
                    (mp, state, dstate, carry, drafts, q, logs, logits, taps, sb, stops, max_new)))
        return out
