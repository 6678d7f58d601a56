"""Greedy speculative decoding with DeepSeek-V4's MTP block as the drafter (model-spec.md §4.7).

Per row, an iteration starts from x (the last accepted token, at position p, not yet in the state), d1 (the
drafter's guess of the token at p + 1) and hm (the MTP block's output streams at p - 1); the backbone state holds
positions < p, the MTP window positions < p.

    draft    d2..dk: the MTP block chained on its own output streams, at positions p .. p+k-2 (as vLLM chains a
             single MTP layer for k > 1)
    verify   one backbone step over [x, d1..dk] at positions p .. p+k (all logits and the final streams);
             g_i = argmax of position p+i; a = the longest prefix with d_i == g_{i-1}; the tokens g_0..g_a are
             emitted (the accepted drafts and the correction, or the bonus token when all k are accepted)
    restore  the state entries positions p+a+1 .. p+k wrote are set back from an undo log saved before the step
             (undo.py), so the backbone state equals plain decoding's
    catch up one MTP step over positions p .. p+a with the backbone's streams and the tokens g_0..g_a (the MTP block's
             true inputs), whose last position gives the next iteration's d1; its window is restored likewise

One jitted program per (batch bucket, k) does all of it on the device; the host reads g and a per iteration.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..model.cache import PROGRAMS
from ..model.model import Model
from ..model.mtp import empty_mtp_state, mtp_step
from ..model.scan import model_step
from ..runtime.steps import batch_bucket, length_bucket
from . import undo

__all__ = ["mtp_greedy_generate", "check_mtp_model"]


def check_mtp_model(model: Model) -> None:
    """Clear errors for what the MTP drafter needs and this first version does not run."""
    if model.plan.mtp is None:
        raise ValueError("speculative decoding with method 'mtp' needs the checkpoint's MTP block loaded: "
                         "jdeep.load(path, mtp=True) (a checkpoint without mtp.* weights has none)")
    if model.compile_mode != "scan" or model.host_embed is not None or model.layout is not None:
        raise ValueError("MTP speculative decoding runs in the scan compile mode on one device so far (not the "
                         "regions mode, host embedding or a mesh)")
    if model.engram is not None:
        raise ValueError("MTP speculative decoding is for DeepSeek-V4 models (V4.1 drafts with DSpark)")


def _argmax(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _prefill_chunk(params, state, mstate, tokens, positions, next_tokens, *, config, plan, numerics):
    """A prompt chunk through the backbone, then the MTP block over the same positions. next_tokens int32 [B, S]:
    the token at t + 1 where it is a prompt token, else -1 (the row's last prompt position: its first generated
    token, the backbone's argmax here, goes in). Returns (backbone logits at each row's last real position [B, V],
    MTP logits there [B, V], MTP streams there [B, n, d], state, mstate)."""
    logits, state, X = model_step(params, state, tokens, positions, config=config, plan=plan, numerics=numerics,
                                  hidden=True)
    first = _argmax(logits)
    nxt = jnp.where(next_tokens >= 0, next_tokens, first[:, None])
    mlogits, XM, mstate = mtp_step(params, mstate, X, nxt, positions, config=config, plan=plan, numerics=numerics,
                                   all_logits=False)
    last = jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0)
    hm = jnp.take_along_axis(XM, last[:, None, None, None], axis=1)[:, 0]
    return logits, mlogits, hm, state, mstate


def _iteration(params, state, mstate, x, p, d1, hm, live, *, k, config, plan, numerics):
    """One draft-verify-restore-catch-up iteration (module docstring) for rows `live` (bool [B]). Returns
    (state, mstate, g int32 [B, k+1], a int32 [B], next d1 [B], next hm [B, n, d])."""
    mtp = functools.partial(mtp_step, params, config=config, plan=plan, numerics=numerics)
    offs = jnp.arange(k + 1, dtype=jnp.int32)
    pos = jnp.where(live[:, None], p[:, None] + offs[None, :], -1)                     # [B, k+1]
    m_index = undo.entry_index(mstate, None, pos, mtp=True)
    m_saved = undo.save(mstate, m_index)
    drafts, h = [d1], hm
    for i in range(1, k):
        lg, X, mstate = mtp(mstate, h[:, None], drafts[-1][:, None], pos[:, i - 1:i], all_logits=False)
        drafts.append(_argmax(lg))
        h = X[:, 0]
    tokens = jnp.stack([x] + drafts, axis=1)                                           # [B, k+1]
    b_index = undo.entry_index(state, plan, pos)
    b_saved = undo.save(state, b_index)
    logits, state, XB = model_step(params, state, tokens, pos, config=config, plan=plan, numerics=numerics,
                                   all_logits=True, hidden=True)
    g = _argmax(logits)                                                                # [B, k+1]
    a = jnp.sum(jnp.cumprod(tokens[:, 1:] == g[:, :-1], axis=1), axis=1).astype(jnp.int32)
    rejected = offs[None, :] > a[:, None]
    state = undo.restore(state, b_saved, b_index, rejected)
    lg, XM, mstate = mtp(mstate, XB, g, jnp.where(rejected, -1, pos), all_logits=False)
    mstate = undo.restore(mstate, m_saved, m_index, rejected)
    hm = jnp.take_along_axis(XM, a[:, None, None, None], axis=1)[:, 0]
    return state, mstate, g, a, _argmax(lg), hm


def _programs(model: Model, k: int):
    key = (model.config, model.plan, model.numerics)
    kw = dict(config=model.config, plan=model.plan, numerics=model.numerics)
    prefill = PROGRAMS.get(("mtp_prefill",) + key, lambda: jax.jit(functools.partial(_prefill_chunk, **kw),
                                                                    donate_argnums=(1, 2)))
    step = PROGRAMS.get(("mtp_iteration", k) + key, lambda: jax.jit(functools.partial(_iteration, k=k, **kw),
                                                                     donate_argnums=(1, 2)))
    return prefill, step


def mtp_greedy_generate(model: Model, prompts: list[np.ndarray], max_new: list[int], stop_ids: list[tuple[int, ...]],
                        k: int, prefill_chunk: int = 512) -> tuple[np.ndarray, dict]:
    """Greedy tokens of each prompt (int32 [B, max(max_new)], -1 after a request ended) with k MTP draft tokens per
    iteration, and stats {"iterations", "drafted", "accepted", "accepted_per_position" [k]}."""
    check_mtp_model(model)
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be at least 1, got {k}")
    prefill, step = _programs(model, k)
    B, Bb = len(prompts), batch_bucket(len(prompts))
    n_new = max(max_new)
    lens = np.array([len(p) for p in prompts] + [0] * (Bb - B))
    max_len = length_bucket(int(max(lens[b] + max_new[b] for b in range(B))) + k + 1, 256)
    state = model.init_state(Bb, max_len)
    mstate = empty_mtp_state(model.config, model.plan, Bb, max_len, model.dtype, model.numerics)
    first = d1 = hm = None
    for start in range(0, int(lens.max()), prefill_chunk):
        S = length_bucket(min(prefill_chunk, int(lens.max()) - start))
        toks = np.zeros((Bb, S), np.int32)
        pos = np.full((Bb, S), -1, np.int32)
        nxt = np.full((Bb, S), -1, np.int32)
        for b in range(B):
            n = int(np.clip(lens[b] - start, 0, S))
            toks[b, :n] = prompts[b][start:start + n]
            pos[b, :n] = np.arange(start, start + n)
            nxt[b, :n] = np.concatenate([prompts[b][start + 1:start + n + 1], [-1]])[:n] if n else []
        logits, mlogits, h, state, mstate = prefill(model.params, state, mstate, toks, pos, nxt)
        ends = jnp.asarray((lens > start) & (lens <= start + S))
        pick = lambda new, old: new if old is None else jnp.where(ends.reshape((-1,) + (1,) * (new.ndim - 1)), new,
                                                                  old)
        first, d1, hm = pick(_argmax(logits), first), pick(_argmax(mlogits), d1), pick(h, hm)
    x = np.array(first)
    out = np.full((Bb, n_new), -1, np.int32)
    count = np.zeros(Bb, int)
    live = np.zeros(Bb, bool)
    for b in range(B):
        out[b, 0], count[b] = x[b], 1
        live[b] = count[b] < max_new[b] and x[b] not in stop_ids[b]
    p = lens.astype(np.int32)
    stats = {"iterations": 0, "drafted": 0, "accepted": 0, "accepted_per_position": np.zeros(k, int)}
    while live.any():
        state, mstate, g, a, d1, hm = step(model.params, state, mstate, jnp.asarray(x), jnp.asarray(p), d1, hm,
                                           jnp.asarray(live))
        g, a = np.asarray(g), np.asarray(a)
        stats["iterations"] += 1
        for b in np.flatnonzero(live):
            stats["drafted"] += k
            stats["accepted"] += int(a[b])
            stats["accepted_per_position"][:a[b]] += 1
            for t in g[b, :a[b] + 1]:
                out[b, count[b]] = t
                count[b] += 1
                if count[b] >= max_new[b] or t in stop_ids[b]:
                    live[b] = False
                    break
            x[b], p[b] = g[b, a[b]], p[b] + a[b] + 1
    stats["accepted_per_position"] = stats["accepted_per_position"].tolist()
    return out[:B], stats
