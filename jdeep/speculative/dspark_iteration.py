"""One iteration of speculative decoding with DeepSeek-V4.1's DSpark drafter (model/dspark.py), as pure functions of
the params, the target state, the drafter's windows and the per-row Carry, greedy and sampled; dspark_decode.py
drives them (jdeep.generate), dspark_drafter.py runs them over the engine's slot windows, dspark_regions.py as
regions programs.
The protocol (draft, verify, restore, append) is described in dspark_decode.py.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ..model.dspark import dspark_append, dspark_draft
from ..model.scan import model_step
from ..runtime.sampling import SamplingBatch, sample
from . import undo
from .drafter import RowCarry as Carry     # (x, p, count, done): the per-row values besides the caches
from .acceptance import accept, accept_greedy, distribution, draw, emit, greedy_ids, with_logprobs

__all__ = ["Carry", "ring_entries", "prefill_chunk", "draft", "verify_inputs", "verify_slices", "save_undo", "verify",
           "finish", "iteration", "iterations"]

_DRAFT_TAG, _ACCEPT_TAG = 1, 1000


def ring_entries(state: dict) -> int:
    """The shortest ring of a target state (entries less the scratch row): how many consecutive positions one
    target step may run and still be undone (undo.py)."""
    sizes = []

    def visit(d):
        sizes.extend(v.shape[2] - 1 for name, v in d.items() if name in undo.RINGS)

    for seg in state["segments"]:
        for slot in seg:
            visit(slot)
    for d in state["sources"].values():
        visit(d)
    return min(sizes)


def prefill_chunk(params, state, dstate, tokens, positions, engram, sb, *, config, plan, numerics,
                  greedy: bool = False):
    """A prompt chunk through the target with the DSpark taps, then every position into the drafter's windows.
    tokens, positions int32 [B, S] (-1 = padding). Returns (first token (acceptance.Emitted [B], with its logprobs),
    drawn from the logits at each row's last real position exactly as plain decoding draws it
    (runtime/sampling.sample, step 0), state, dstate);
    the first token means something only for rows whose prompt ends in this chunk. greedy: every row is greedy (the
    argmax without the sampler's noise: the same token, and no PRNG in the program)."""
    out = model_step(params, state, tokens, positions, engram, config=config, plan=plan, numerics=numerics, taps=True)
    logits, state, taps = out.logits, out.state, out.taps
    zero = jnp.zeros(tokens.shape[:1], jnp.int32)
    first = greedy_ids(logits[:, None], sb, zero)[:, 0] if greedy else sample(logits, sb, zero)
    dstate = dspark_append(params, dstate, taps, positions, config=config, plan=plan, numerics=numerics)
    return with_logprobs(first, logits, keep_logits=True), state, dstate


def draft(params, dstate, carry: Carry, sb: SamplingBatch, *, config, plan, numerics, greedy: bool = False):
    """The drafter's block after each row's x: (drafts int32 [B, block], q fp32 [B, block, V] the distribution each
    draft was drawn from; None for a greedy program). Draft j is drawn with key (count, _DRAFT_TAG + j)."""
    x, p, count, _ = carry
    if greedy:      # (DeepSeek's greedy_choice, the argmax, where a row sets no logit_bias or min_tokens)
        def choose(logits, j):
            return greedy_ids(logits[:, None], sb, count + j)[:, 0]
    else:
        def choose(logits, j):
            return draw(distribution(logits[:, None], sb, count + j)[:, 0], sb, count, _DRAFT_TAG + j)
    ids, logits, _ = dspark_draft(params, dstate, x, p, config=config, plan=plan, numerics=numerics, choose=choose)
    return ids, (None if greedy else distribution(logits, sb, count))


def verify_inputs(carry: Carry, drafts, *, k: int, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """The verified chunk: tokens [x, d_1..d_k] and positions p .. p+k (-1 for done rows), int32 [B, k+1] each."""
    x, p, _, done = carry
    drafts = jnp.clip(drafts[:, :k], 0, vocab_size - 1)               # (indices from an input: Neuron's S12)
    offs = jnp.arange(k + 1, dtype=jnp.int32)
    pos = jnp.where(~done[:, None], p[:, None] + offs[None, :], -1)
    return jnp.concatenate([x[:, None], drafts], axis=1), pos


def verify_slices(state: dict, k: int) -> list[slice]:
    """The consecutive target steps the k + 1 verified positions run as: one step when every ring of the state holds
    k + 1 entries, else steps of at most the shortest ring's length (module docstring)."""
    split = min(ring_entries(state), k + 1)
    return [slice(s0, min(s0 + split, k + 1)) for s0 in range(0, k + 1, split)]


def save_undo(state: dict, positions, *, plan) -> tuple[Any, Any]:
    """The undo log of one target step over positions int32 [B, S]: (entry index, saved entries) (undo.py)."""
    index = undo.entry_index(state, plan, positions)
    return index, undo.save(state, index)


def verify(params, state, dstate, carry: Carry, drafts, q, sb: SamplingBatch, stops, max_new, engram=None, *, k,
           config, plan, numerics, greedy: bool = False, keep_logits: bool = False):
    """Verify the first k drafts (drafts int32 [B, >=k], q fp32 [B, >=k, V] or None for greedy), emit, restore the
    target state, append the kept positions to the drafter's windows. engram: the rows of [x, d_1..d_k] at
    p .. p+k ([n_eng, B, k+1, ...], models with Engram). stops int32 [B, W] (-1 = unused), max_new int32 [B].
    Returns (state, dstate, carry, emitted (acceptance.Emitted [B, k+1]: tokens -1 past what the row emits),
    accepted int32 [B] (-1 for rows that were done), kept int32 [B] (positions p .. p+kept-1 entered the state: 0
    for done rows)). The target steps, then `finish`; the regions mode (dspark_regions.py) runs the same pieces as
    programs."""
    tokens, pos = verify_inputs(carry, drafts, k=k, vocab_size=config.vocab_size)
    logs, logits, taps = [], [], []
    for sl in verify_slices(state, k):
        logs.append(save_undo(state, pos[:, sl], plan=plan))
        eg = None if engram is None else tuple(e[:, :, sl] for e in engram)
        out = model_step(params, state, tokens[:, sl], pos[:, sl], eg, config=config, plan=plan, numerics=numerics,
                         all_logits=True, taps=True)
        lg, state, tp = out.logits, out.state, out.taps
        logits.append(lg)
        taps.append(tp)
    return finish(params, state, dstate, carry, drafts, q, logs, logits, taps, sb, stops, max_new, k=k, config=config,
                  plan=plan, numerics=numerics, greedy=greedy, keep_logits=keep_logits)


def finish(params, state, dstate, carry: Carry, drafts, q, logs, logits, taps, sb: SamplingBatch, stops, max_new, *,
           k, config, plan, numerics, greedy: bool = False, keep_logits: bool = False):
    """After the target steps of verify_slices (their undo logs, logits fp32 [B, S_i, V] and taps [B, S_i, ...] as
    lists): the acceptance rule, the emitted tokens, the restore of rejected positions (in reverse step order) and the
    append of the kept ones to the drafter's windows. Returns what `verify` returns."""
    x, p, count, done = carry
    live = ~done
    _, pos = verify_inputs(carry, drafts, k=k, vocab_size=config.vocab_size)
    drafts = jnp.clip(drafts[:, :k], 0, config.vocab_size - 1)       # (indices from an input: Neuron's S12)
    logits, taps = jnp.concatenate(logits, axis=1), jnp.concatenate(taps, axis=1)
    if greedy:
        g, a = accept_greedy(drafts, logits, sb, count)
    else:
        g, a = accept(drafts, q[:, :k], distribution(logits, sb, count), sb, count, _ACCEPT_TAG)
    n, rejected, emitted, count, ended = emit(g, a, stops, max_new, count, live)
    # the state keeps positions p .. p+n-1 (x and the emitted tokens but the last), as plain decoding's would
    for sl, (index, saved) in reversed(list(zip(verify_slices(state, k), logs))):
        state = undo.restore(state, saved, index, rejected[:, sl])
    dstate = dspark_append(params, dstate, taps, jnp.where(rejected, -1, pos), config=config, plan=plan,
                           numerics=numerics)
    done = done | ended
    nxt = jnp.take_along_axis(g, jnp.clip(a, 0, k)[:, None], axis=1)[:, 0]          # (clamped index: S12)
    carry = Carry(jnp.where(live, nxt, x), jnp.where(live, p + a + 1, p), count, done)
    return state, dstate, carry, with_logprobs(emitted, logits, keep_logits), jnp.where(live, a, -1), n


def iteration(params, state, dstate, carry, sb, stops, max_new, *, k, config, plan, numerics, greedy=False,
              keep_logits: bool = False):
    """draft then verify in one program (models without Engram layers)."""
    kw = dict(config=config, plan=plan, numerics=numerics, greedy=greedy)
    drafts, q = draft(params, dstate, carry, sb, **kw)
    return verify(params, state, dstate, carry, drafts, q, sb, stops, max_new, None, k=k, keep_logits=keep_logits, **kw)


def iterations(params, state, dstate, carry, sb, stops, max_new, *, n, k, config, plan, numerics, greedy=False,
               keep_logits: bool = False):
    """n iterations as one scan (no Engram): (state, dstate, carry, emitted (Emitted [n, B, k+1]), accepted
    [n, B])."""
    step = functools.partial(iteration, k=k, config=config, plan=plan, numerics=numerics, greedy=greedy,
                             keep_logits=keep_logits)

    def body(c, _):
        state, dstate, carry = c
        state, dstate, carry, emitted, a, _ = step(params, state, dstate, carry, sb, stops, max_new)
        return (state, dstate, carry), (emitted, a)

    (state, dstate, carry), (emitted, a) = jax.lax.scan(body, (state, dstate, carry), None, length=n)
    return state, dstate, carry, emitted, a
