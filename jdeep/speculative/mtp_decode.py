"""Speculative decoding with DeepSeek-V4's MTP block as the drafter (model-spec.md §4.7), greedy and sampled.

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

`iterations` runs n of them in one program (a scan with a fixed trip count; a row that ends feeds position -1 and
emits nothing), checking each row's stop ids and max_new_tokens on the device, so the host reads tokens once per
block. `mtp_generate` drives prefill and blocks for jdeep.generate; the Engine runs `iteration` over slot windows.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..model.cache import PROGRAMS
from ..model.model import Model
from ..model.mtp import init_mtp_state, mtp_step
from ..model.scan import model_step
from ..runtime.sampling import SamplingBatch, SamplingParams, batch_params, sample
from ..runtime.steps import batch_bucket, length_bucket
from . import undo
from .acceptance import accept, accept_greedy, argmax_ids, distribution, draw

__all__ = ["Carry", "mtp_generate", "check_mtp_model", "prefill_chunk", "iteration", "iterations", "SpecStats"]

_DRAFT_TAG, _ACCEPT_TAG = 1, 1000


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


def check_mtp_model(model: Model) -> None:
    """Clear errors for what the MTP drafter needs and this version does not run."""
    if model.engram is not None or model.config.dspark is not None or model.config.sharing is not None:
        raise ValueError("speculative method 'mtp' is for DeepSeek-V4 checkpoints; DeepSeek-V4.1 drafts with its "
                         "DSpark drafter: speculative={'method': 'dspark', 'num_speculative_tokens': k}")
    if model.plan.mtp is None:
        raise ValueError("speculative decoding with method 'mtp' needs the checkpoint's MTP block loaded: "
                         "jdeep.load(path, mtp=True) (a checkpoint without mtp.* weights has none)")
    if model.compile_mode != "scan" or model.host_embed is not None or model.layout is not None:
        raise ValueError("MTP speculative decoding runs in the scan compile mode on one device so far (not the "
                         "regions mode, host embedding or a mesh)")


def prefill_chunk(params, state, mstate, tokens, positions, next_tokens, sb, *, config, plan, numerics,
                  greedy: bool = False):
    """A prompt chunk through the backbone, then the MTP block over the same positions.

    tokens, positions int32 [B, S] (-1 = padding); next_tokens int32 [B, S]: the token at t + 1 where it is a prompt
    token, else -1 (the row's last prompt position: its first generated token goes in, drawn here from the backbone's
    logits exactly as plain decoding draws it, runtime/sampling.sample with step 0). Returns (first token int32 [B],
    MTP logits at each row's last real position fp32 [B, V], MTP streams there [B, n, d], state, mstate); the first
    token and MTP outputs mean something only for rows whose prompt ends in this chunk. greedy: every row is greedy
    (the argmax without the sampler's noise; the same token)."""
    logits, state, X = model_step(params, state, tokens, positions, config=config, plan=plan, numerics=numerics,
                                  hidden=True)
    first = argmax_ids(logits) if greedy else sample(logits, sb, jnp.zeros(tokens.shape[:1], jnp.int32))
    nxt = jnp.where(next_tokens >= 0, next_tokens, first[:, None])
    mlogits, XM, mstate = mtp_step(params, mstate, X, nxt, positions, config=config, plan=plan, numerics=numerics,
                                   all_logits=False)
    last = jnp.clip(jnp.sum(positions >= 0, axis=1) - 1, 0, positions.shape[1] - 1)
    hm = jnp.take_along_axis(XM, last[:, None, None, None], axis=1)[:, 0]
    return first, mlogits, hm, state, mstate


def iteration(params, state, mstate, carry: Carry, sb: SamplingBatch, stops, max_new, *, k, config, plan, numerics,
              greedy: bool = False):
    """One draft-verify-restore-catch-up iteration (module docstring). stops int32 [B, W] (-1 = unused), max_new
    int32 [B]. greedy: every row is greedy (a program variant that compares argmaxes and builds no distributions;
    the same tokens). Returns (state, mstate, carry, emitted int32 [B, k+1] (-1 past what the row emits), accepted int32 [B]
    (-1 for rows that were done))."""
    mtp = functools.partial(mtp_step, params, config=config, plan=plan, numerics=numerics)
    x, p, mlogits, hm, count, done = carry
    live = ~done
    offs = jnp.arange(k + 1, dtype=jnp.int32)
    pos = jnp.where(live[:, None], p[:, None] + offs[None, :], -1)                     # [B, k+1]
    m_index = undo.entry_index(mstate, None, pos, mtp=True)
    m_saved = undo.save(mstate, m_index)
    def propose(logits, i):
        """A draft token from the drafter's logits [B, V] (and its distribution, unless greedy)."""
        if greedy:
            return argmax_ids(logits), None
        q = distribution(logits[:, None], sb)[:, 0]
        return draw(q, sb, count, _DRAFT_TAG + i), q

    d, qi = propose(mlogits, 0)
    drafts, q, h = [d], [qi], hm
    for i in range(1, k):
        lg, X, mstate = mtp(mstate, h[:, None], drafts[-1][:, None], pos[:, i - 1:i], all_logits=False)
        d, qi = propose(lg, i)
        drafts.append(d)
        q.append(qi)
        h = X[:, 0]
    drafts = jnp.stack(drafts, axis=1)                                                 # [B, k]
    tokens = jnp.concatenate([x[:, None], drafts], axis=1)                             # [B, k+1]
    b_index = undo.entry_index(state, plan, pos)
    b_saved = undo.save(state, b_index)
    logits, state, XB = model_step(params, state, tokens, pos, config=config, plan=plan, numerics=numerics,
                                   all_logits=True, hidden=True)
    if greedy:
        g, a = accept_greedy(drafts, logits)
    else:
        g, a = accept(drafts, jnp.stack(q, axis=1), distribution(logits, sb), sb, count, _ACCEPT_TAG)
    # what each row emits: up to a + 1 tokens, cut after its first stop id and at max_new_tokens
    is_stop = jnp.any(g[:, :, None] == stops[:, None, :], axis=-1) & (offs[None, :] <= a[:, None])
    first_stop = jnp.min(jnp.where(is_stop, offs[None, :], k + 1), axis=1)
    n = jnp.minimum(jnp.minimum(a + 1, first_stop + 1), max_new - count)
    n = jnp.where(live, n, 0)
    # the state keeps positions p .. p+n-1 (x and the emitted tokens but the last), as plain decoding's would
    rejected = offs[None, :] >= n[:, None]
    state = undo.restore(state, b_saved, b_index, rejected)
    lg, XM, mstate = mtp(mstate, XB, g, jnp.where(rejected, -1, pos), all_logits=False)
    mstate = undo.restore(mstate, m_saved, m_index, rejected)
    a_ix = jnp.clip(a, 0, k)
    hm = jnp.take_along_axis(XM, a_ix[:, None, None, None], axis=1)[:, 0]
    emitted = jnp.where(offs[None, :] < n[:, None], g, -1)
    count = count + n
    done = done | (first_stop < n) | (count >= max_new)
    nxt = jnp.take_along_axis(g, a_ix[:, None], axis=1)[:, 0]
    carry = Carry(jnp.where(live, nxt, x), jnp.where(live, p + a + 1, p), jnp.where(live[:, None], lg, mlogits),
                  jnp.where(live[:, None, None], hm, carry.hm), count, done)
    return state, mstate, carry, emitted, jnp.where(live, a, -1)


def iterations(params, state, mstate, carry, sb, stops, max_new, *, n, k, config, plan, numerics, greedy=False):
    """n iterations as one scan: (state, mstate, carry, emitted int32 [n, B, k+1], accepted int32 [n, B])."""
    step = functools.partial(iteration, k=k, config=config, plan=plan, numerics=numerics, greedy=greedy)

    def body(c, _):
        state, mstate, carry = c
        state, mstate, carry, emitted, a = step(params, state, mstate, carry, sb, stops, max_new)
        return (state, mstate, carry), (emitted, a)

    (state, mstate, carry), (emitted, a) = jax.lax.scan(body, (state, mstate, carry), None, length=n)
    return state, mstate, carry, emitted, a


def _key(model: Model) -> tuple:
    return (model.config, model.plan, model.numerics)


def prefill_program(model: Model, greedy: bool):
    kw = dict(config=model.config, plan=model.plan, numerics=model.numerics, greedy=greedy)
    return PROGRAMS.get(("mtp_prefill", greedy) + _key(model),
                        lambda: jax.jit(functools.partial(prefill_chunk, **kw), donate_argnums=(1, 2)))


def iterations_program(model: Model, k: int, n: int, greedy: bool):
    kw = dict(config=model.config, plan=model.plan, numerics=model.numerics, greedy=greedy)
    return PROGRAMS.get(("mtp_iterations", k, n) + tuple(sorted(kw.items())),
                        lambda: jax.jit(functools.partial(iterations, n=n, k=k, **kw), donate_argnums=(1, 2, 3)))


class SpecStats:
    """Acceptance counters: iterations (row-iterations that ran), drafted and accepted draft tokens, and per draft
    position how often it was accepted."""

    def __init__(self, k: int):
        self.k, self.iterations, self.drafted, self.accepted = k, 0, 0, 0
        self.per_position = np.zeros(k, np.int64)

    def add(self, accepted: np.ndarray) -> None:
        """accepted int [...]: per row-iteration accepted drafts (-1 = the row did not run)."""
        a = accepted[accepted >= 0]
        self.iterations += a.size
        self.drafted += a.size * self.k
        self.accepted += int(a.sum())
        self.per_position += np.sum(a[:, None] > np.arange(self.k)[None, :], axis=0)

    def as_dict(self) -> dict:
        it = max(self.iterations, 1)
        return {"k": self.k, "iterations": self.iterations, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.accepted / max(self.drafted, 1),
                "acceptance_per_position": (self.per_position / it).tolist(),
                "mean_accepted_length": 1 + self.accepted / it}


def mtp_generate(model: Model, prompts: Sequence[np.ndarray], sampling: Sequence[SamplingParams],
                 stop_ids: Sequence[tuple[int, ...]], k: int, prefill_chunk_size: int = 512, default_seed: int = 0,
                 on_block: Callable[[list[list[int]]], Sequence[int]] | None = None,
                 block_iterations: int = 8) -> tuple[np.ndarray, dict]:
    """Tokens of each prompt (int32 [B, max max_new_tokens], -1 after a request ended) with k MTP draft tokens per
    iteration, sampled per request as `sampling` says (greedy rows: exactly plain greedy decoding's tokens), and the
    acceptance stats (SpecStats.as_dict). on_block(new tokens per row) runs after the first token and after every
    block of iterations; it returns the rows to end (stop strings). Blocks run `block_iterations` iterations, or one
    near the end."""
    out, stats, _ = run(model, prompts, sampling, stop_ids, k, prefill_chunk_size, default_seed, on_block,
                        block_iterations)
    return out, stats


def block_length(stats: SpecStats, done: np.ndarray, max_new: np.ndarray, count: np.ndarray,
                 block_iterations: int) -> int:
    """Iterations of the next block: a whole block while the longest running row needs that many at the acceptance
    seen so far, then single iterations (two compiled programs per k)."""
    per_iter = 1 + stats.accepted / max(stats.iterations, 1)
    need = int(np.ceil(np.max(np.where(done, 0, max_new - count)) / per_iter))
    return block_iterations if need >= block_iterations else 1


def take_block(emitted: np.ndarray, accepted: np.ndarray, out: np.ndarray, count: np.ndarray, stats: SpecStats,
               carry, on_block, B: int):
    """After a block (emitted int32 [n, Bb, k+1], accepted int32 [n, Bb]): count the acceptance, append each row's
    tokens to out at count (both updated in place), and end the rows on_block names (stop strings). Returns (carry,
    done bool [Bb])."""
    stats.add(accepted[:, :B])
    new = [[int(t) for t in emitted[:, b].reshape(-1) if t >= 0] for b in range(B)]
    for b in range(B):
        out[b, count[b]:count[b] + len(new[b])] = new[b]
        count[b] += len(new[b])
    done = np.asarray(carry.done).copy()
    stop_rows = [b for b in (on_block(new) if on_block else ()) if not done[b]]
    if stop_rows:
        done[stop_rows] = True
        carry = carry._replace(done=jnp.asarray(done))
    return carry, done


def state_len(prompt_lens: Sequence[int], max_new: Sequence[int], k: int) -> int:
    """The cache length a batch needs: its longest prompt + max_new_tokens, plus the k + 1 verified positions."""
    return length_bucket(max(int(n) + int(m) for n, m in zip(prompt_lens, max_new)) + k + 1, 256)


def run(model: Model, prompts, sampling, stop_ids, k: int, prefill_chunk_size: int = 512, default_seed: int = 0,
        on_block=None, block_iterations: int = 8) -> tuple[np.ndarray, dict, dict]:
    """mtp_generate, also returning the backbone state at the end (row b holds its prompt and every emitted token
    but the last, as plain decoding's state would)."""
    check_mtp_model(model)
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be at least 1, got {k}")
    B, Bb = len(prompts), batch_bucket(len(prompts))
    max_new = np.array([s.max_new_tokens for s in sampling] + [1] * (Bb - B), np.int32)
    lens = np.array([len(p) for p in prompts] + [0] * (Bb - B))
    max_len = state_len([len(p) for p in prompts], max_new[:B], k)
    state = model.init_state(Bb, max_len)
    mstate = init_mtp_state(model.config, model.plan, Bb, max_len, model.dtype, model.numerics)
    sb = batch_params(list(sampling), Bb, default_seed=default_seed)
    width = max(1, max(len(s) for s in stop_ids))
    stops = np.full((Bb, width), -1, np.int32)
    for b, s in enumerate(stop_ids):
        stops[b, :len(s)] = s
    greedy = all(s.temperature == 0 for s in sampling)
    prefill = prefill_program(model, greedy)
    first = mlogits = hm = None
    for start in range(0, int(lens.max()), prefill_chunk_size):
        S = length_bucket(min(prefill_chunk_size, int(lens.max()) - start))
        toks = np.zeros((Bb, S), np.int32)
        pos = np.full((Bb, S), -1, np.int32)
        nxt = np.full((Bb, S), -1, np.int32)
        for b in range(B):
            n = int(np.clip(lens[b] - start, 0, S))
            toks[b, :n] = prompts[b][start:start + n]
            pos[b, :n] = np.arange(start, start + n)
            nxt[b, :n] = np.concatenate([prompts[b][start + 1:start + n + 1], [-1]])[:n] if n else []
        f, ml, h, state, mstate = prefill(model.params, state, mstate, toks, pos, nxt, sb)
        ends = jnp.asarray((lens > start) & (lens <= start + S))
        pick = lambda new, old: new if old is None else jnp.where(ends.reshape((-1,) + (1,) * (new.ndim - 1)), new,
                                                                  old)
        first, mlogits, hm = pick(f, first), pick(ml, mlogits), pick(h, hm)
    x = np.asarray(first)
    out = np.full((Bb, int(max_new[:B].max())), -1, np.int32)
    out[:, 0] = x
    count = np.ones(Bb, np.int32)
    done = np.array([b >= B or max_new[b] <= 1 or x[b] in stop_ids[b] for b in range(Bb)])
    ended = set(on_block([[int(x[b])] for b in range(B)]) if on_block else ())
    done[list(ended)] = True
    carry = Carry(jnp.asarray(x), jnp.asarray(lens.astype(np.int32)), mlogits, hm, jnp.asarray(count),
                  jnp.asarray(done))
    stats = SpecStats(k)
    stops, max_new_d = jnp.asarray(stops), jnp.asarray(max_new)
    while not done.all():
        n = block_length(stats, done, max_new, count, block_iterations)
        state, mstate, carry, emitted, a = iterations_program(model, k, n, greedy)(
            model.params, state, mstate, carry, sb, stops, max_new_d)
        emitted, a = np.asarray(emitted), np.asarray(a)
        carry, done = take_block(emitted, a, out, count, stats, carry, on_block, B)
    return out[:B], stats.as_dict(), state
