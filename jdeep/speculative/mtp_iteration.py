"""One iteration of speculative decoding with DeepSeek-V4's MTP block as the drafter (model-spec.md §4.7), as pure
functions of the params, the states and the per-row Carry, greedy and sampled.

Per row, an iteration starts from x (the last accepted token, at position p, not yet in the state), the drafter's
logits for the token at p + 1 (`mlogits`) and hm (the MTP block's output streams at p - 1); the backbone state
holds positions < p, the MTP window positions < p.

    draft    d1 from mlogits; d2..dk: the MTP block chained on its own output streams at positions p .. p+k-2 (as
             vLLM chains a single MTP layer for k > 1); each d_i drawn from the row's transform of the drafter's
             logits (acceptance.py: argmax for greedy rows)
    verify   one backbone step over [x, d1..dk] at positions p .. p+k (all logits and the final streams), then the
             acceptance rule (acceptance.py): a accepted drafts, the tokens g_0..g_a emitted (the accepted drafts and
             the residual draw, or the bonus token when all k are accepted); greedy rows: exactly plain greedy decoding
    restore  the state entries positions p+a+1 .. p+k wrote are set back from an undo log saved before the step
             (undo.py), so the backbone state equals plain decoding's (also where a stop id or max_new_tokens cuts
             the accepted tokens short)
    catch up one MTP step over positions p .. p+a with the backbone's streams and the tokens g_0..g_a (the MTP block's
             true inputs), whose last position gives the next iteration's mlogits and hm; its window is restored too

`iteration` is `draft`, the backbone's verify step and `finish`: the scan compile mode runs the three in one
program, the regions mode (mtp_decode.RegionsPrograms) the draft and the finish as programs around the regions step.
`iterations` runs n of them in one program (a scan with a fixed trip count; a row that ends feeds position -1 and
emits nothing), checking each row's stop ids and max_new_tokens on the device, so the host reads tokens once per
block. mtp_decode drives prefill and blocks for jdeep.generate; the Engine runs `iteration` over slot windows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..model.mtp import mtp_step
from ..model.scan import model_step
from ..runtime.sampling import SamplingBatch, sample
from . import undo
from .acceptance import accept, accept_greedy, distribution, draw, emit, greedy_ids, with_logprobs

__all__ = ["Carry", "Drafted", "prefill_chunk", "prefill_tail", "iteration", "draft", "finish", "iterations",
           "mtp_params"]

_DRAFT_TAG, _ACCEPT_TAG = 1, 1000


def mtp_params(params: dict) -> dict:
    """The parameters the MTP block reads (its own, the embedding and the shared head): what the regions mode's draft,
    finish and prefill_tail programs take instead of the whole tree (fewer program arguments)."""
    return {k: params[k] for k in ("drafter", "embed", "head")}


class Carry(NamedTuple):
    """Per-row speculative decoding state besides the caches: x int32 [B] (last accepted token, at position p, not in
    the state), p int32 [B], mlogits fp32 [B, V] (the drafter's logits for the token at p + 1), hm [B, n, d] (the MTP
    block's output streams at p - 1), count int32 [B] (tokens generated), done bool [B]."""

    x: jax.Array
    p: jax.Array
    mlogits: jax.Array
    hm: jax.Array
    count: jax.Array
    done: jax.Array


def prefill_chunk(params, state, mstate, tokens, positions, next_tokens, sb, *, config, plan, numerics,
                  greedy: bool = False, layout=None):
    """A prompt chunk through the backbone, then the MTP block over the same positions (prefill_tail).

    tokens, positions int32 [B, S] (-1 = padding); next_tokens int32 [B, S]: the token at t + 1 where it is a prompt
    token, else -1. Returns (first token (acceptance.Emitted [B]: with its logprobs), MTP logits at each row's last
    real position fp32 [B, V], MTP streams there [B, n, d], state, mstate); the first token and MTP outputs mean
    something only for rows whose prompt ends in this chunk. layout: the mesh's (sharding.Layout; None on one
    device), as model_step takes it."""
    out = model_step(params, state, tokens, positions, config=config, plan=plan, numerics=numerics, hidden=True,
                     layout=layout)
    logits, state, X = out.logits, out.state, out.hidden
    first, mlogits, hm, mstate = prefill_tail(params, mstate, logits, X, positions, next_tokens, sb, config=config,
                                              plan=plan, numerics=numerics, greedy=greedy)
    return first, mlogits, hm, state, mstate


def prefill_tail(params, mstate, logits, X, positions, next_tokens, sb, *, config, plan, numerics,
                 greedy: bool = False):
    """The MTP half of prefill_chunk, after the backbone gave logits fp32 [B, V] (each row's last real position) and
    its final streams X [B, S, n, d]: the first generated token (drawn from the logits exactly as plain decoding
    draws it, runtime/sampling.sample with step 0; greedy: every row is greedy, the argmax without the sampler's
    noise: the same token) goes in at each row's last prompt position. Returns (first (acceptance.Emitted [B]),
    mlogits fp32 [B, V], hm [B, n, d], mstate)."""
    zero = jnp.zeros(positions.shape[:1], jnp.int32)
    first = greedy_ids(logits[:, None], sb, zero)[:, 0] if greedy else sample(logits, sb, zero)
    nxt = jnp.where(next_tokens >= 0, next_tokens, first[:, None])
    mlogits, XM, mstate = mtp_step(params, mstate, X, nxt, positions, config=config, plan=plan, numerics=numerics,
                                   all_logits=False)
    last = jnp.clip(jnp.sum(positions >= 0, axis=1) - 1, 0, positions.shape[1] - 1)
    hm = jnp.take_along_axis(XM, last[:, None, None, None], axis=1)[:, 0]
    return with_logprobs(first, logits, keep_logits=True), mlogits, hm, mstate


class Drafted(NamedTuple):
    """What the draft half of an iteration hands the verify and the finish: tokens int32 [B, k+1] ([x, d_1..d_k]),
    pos int32 [B, k+1] (p .. p+k; -1 for rows that are done), q fp32 [B, k, V] (the drafts' distributions; None
    for the greedy variant), and the undo logs of the MTP state (before the draft chain) and of the backbone state
    (before the verify)."""

    tokens: jax.Array
    pos: jax.Array
    q: jax.Array | None
    m_saved: dict
    b_saved: dict


def iteration(params, state, mstate, carry: Carry, sb: SamplingBatch, stops, max_new, *, k, config, plan, numerics,
              greedy: bool = False, layout=None, keep_logits: bool = False):
    """One draft-verify-restore-catch-up iteration (module docstring): draft, the backbone's verify step, finish.
    stops int32 [B, W] (-1 = unused), max_new int32 [B]. greedy: every row is greedy (a program variant that
    compares argmaxes and builds no distributions; the same tokens). layout: the mesh's, for the verify step (the
    draft and finish are left to the partitioner). Returns (state, mstate, carry, emitted (acceptance.Emitted
    [B, k+1]: tokens -1 past what the row emits), accepted int32 [B] (-1 for rows that were done))."""
    kw = dict(k=k, config=config, plan=plan, numerics=numerics, greedy=greedy)
    mstate, dr = draft(params, state, mstate, carry, sb, **kw)
    out = model_step(params, state, dr.tokens, dr.pos, config=config, plan=plan, numerics=numerics, all_logits=True,
                     hidden=True, layout=layout)
    logits, state, XB = out.logits, out.state, out.hidden
    return finish(params, state, mstate, carry, dr, logits, XB, sb, stops, max_new, keep_logits=keep_logits, **kw)


def draft(params, state, mstate, carry: Carry, sb: SamplingBatch, *, k, config, plan, numerics,
          greedy: bool = False) -> tuple[dict, Drafted]:
    """The k drafts of each row (d1 from carry.mlogits, then the MTP block chained on its own streams) and the undo
    logs; `state` (the backbone's) is only read. Returns (mstate, Drafted)."""
    mtp = functools.partial(mtp_step, params, config=config, plan=plan, numerics=numerics)
    x, p, mlogits, hm, count, done = carry
    offs = jnp.arange(k + 1, dtype=jnp.int32)
    pos = jnp.where(~done[:, None], p[:, None] + offs[None, :], -1)                   # [B, k+1]
    m_saved = undo.save(mstate, undo.entry_index(mstate, None, pos, mtp=True))

    def propose(logits, i):
        """A draft token from the drafter's logits [B, V] (and its distribution, unless greedy)."""
        if greedy:
            return greedy_ids(logits[:, None], sb, count + i)[:, 0], None
        q = distribution(logits[:, None], sb, count + i)[:, 0]
        return draw(q, sb, count, _DRAFT_TAG + i), q

    d, qi = propose(mlogits, 0)
    drafts, q, h = [d], [qi], hm
    for i in range(1, k):
        lg, X, mstate = mtp(mstate, h[:, None], drafts[-1][:, None], pos[:, i - 1:i], all_logits=False)
        d, qi = propose(lg, i)
        drafts.append(d)
        q.append(qi)
        h = X[:, 0]
    tokens = jnp.concatenate([x[:, None], jnp.stack(drafts, axis=1)], axis=1)           # [B, k+1]
    b_saved = undo.save(state, undo.entry_index(state, plan, pos))
    return mstate, Drafted(tokens, pos, None if greedy else jnp.stack(q, axis=1), m_saved, b_saved)


def finish(params, state, mstate, carry: Carry, dr: Drafted, logits, XB, sb: SamplingBatch, stops, max_new, *, k,
           config, plan, numerics, greedy: bool = False, keep_logits: bool = False):
    """After the verify step (logits fp32 [B, k+1, V], the backbone's final streams XB [B, k+1, n, d], state with
    all k + 1 positions written): acceptance, the emitted tokens cut at stops and max_new, the restore of rejected
    positions and the MTP catch-up (module docstring). Returns what `iteration` returns."""
    mtp = functools.partial(mtp_step, params, config=config, plan=plan, numerics=numerics)
    x, p, mlogits, hm, count, done = carry
    live = ~done
    pos = dr.pos
    drafts = jnp.clip(dr.tokens[:, 1:], 0, logits.shape[-1] - 1)     # (indices from an input: Neuron's S12)
    if greedy:
        g, a = accept_greedy(drafts, logits, sb, count)
    else:
        g, a = accept(drafts, dr.q, distribution(logits, sb, count), sb, count, _ACCEPT_TAG)
    n, rejected, emitted, count, ended = emit(g, a, stops, max_new, count, live)
    # the state keeps positions p .. p+n-1 (x and the emitted tokens but the last), as plain decoding's would
    state = undo.restore(state, dr.b_saved, undo.entry_index(state, plan, pos), rejected)
    m_index = undo.entry_index(mstate, None, pos, mtp=True)
    lg, XM, mstate = mtp(mstate, XB, g, jnp.where(rejected, -1, pos), all_logits=False)
    mstate = undo.restore(mstate, dr.m_saved, m_index, rejected)
    a_ix = jnp.clip(a, 0, k)
    hm = jnp.take_along_axis(XM, a_ix[:, None, None, None], axis=1)[:, 0]
    done = done | ended
    nxt = jnp.take_along_axis(g, a_ix[:, None], axis=1)[:, 0]
    carry = Carry(jnp.where(live, nxt, x), jnp.where(live, p + a + 1, p), jnp.where(live[:, None], lg, mlogits),
                  jnp.where(live[:, None, None], hm, carry.hm), count, done)
    return state, mstate, carry, with_logprobs(emitted, logits, keep_logits), jnp.where(live, a, -1)


def iterations(params, state, mstate, carry, sb, stops, max_new, *, n, k, config, plan, numerics, greedy=False,
               layout=None, keep_logits: bool = False):
    """n iterations as one scan: (state, mstate, carry, emitted (Emitted [n, B, k+1]), accepted int32 [n, B])."""
    step = functools.partial(iteration, k=k, config=config, plan=plan, numerics=numerics, greedy=greedy,
                             layout=layout, keep_logits=keep_logits)

    def body(c, _):
        state, mstate, carry = c
        state, mstate, carry, emitted, a = step(params, state, mstate, carry, sb, stops, max_new)
        return (state, mstate, carry), (emitted, a)

    (state, mstate, carry), (emitted, a) = jax.lax.scan(body, (state, mstate, carry), None, length=n)
    if layout is not None:      # placed as Model.commit places the first call's carry: one program for every call
        carry = layout.constrain_batch(carry)
    return state, mstate, carry, emitted, a
