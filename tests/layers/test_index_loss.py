"""The indexer's training objective against a float64 numpy oracle: the KL from the heads' mean attention over the
visible compressed entries to the softmax of the indexer's scores, summed over the real queries that see an entry;
its gradient reaches the scores only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jdeep.layers.index_loss import index_kl


def _oracle(q, entries, score, count, valid, scale):
    total, n = 0.0, 0
    B, S, H, _ = q.shape
    for b in range(B):
        for s in range(S):
            c = count[b, s]
            if not valid[b, s] or c == 0:
                continue
            logits = np.einsum("hd,td->ht", q[b, s], entries[b, :c]) * scale
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p = (p / p.sum(-1, keepdims=True)).mean(0)
            z = score[b, s, :c] - score[b, s, :c].max()
            log_q = z - np.log(np.exp(z).sum())
            total += float(np.sum(p * (np.log(p) - log_q)))
            n += 1
    return total, n


def _inputs(seed=0, B=2, S=9, H=3, D=16, T=5):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, S, H, D))
    entries = rng.normal(size=(B, T, D))
    count = np.minimum((np.arange(S)[None, :] + 1 + np.array([[0], [3]])) // 2, T).astype(np.int32)
    score = rng.normal(size=(B, S, T)) * 2
    score = np.where(np.arange(T)[None, None, :] < count[..., None], score, -np.inf)   # as index_scores gives them
    valid = np.ones((B, S), bool)
    valid[1, -2:] = False
    return q, entries, score, count, valid


def test_matches_float64_oracle():
    q, entries, score, count, valid = _inputs()
    got = np.asarray(index_kl(jnp.asarray(q, jnp.float32), jnp.asarray(entries, jnp.float32),
                              jnp.asarray(score, jnp.float32), jnp.asarray(count), jnp.asarray(valid), 0.25))
    total, n = _oracle(q, entries, np.where(np.isinf(score), 0, score), count, valid, 0.25)
    assert got[1] == n and n > 0 and total > 0
    np.testing.assert_allclose(got[0], total, rtol=1e-5)


def test_zero_when_the_indexer_ranks_like_the_heads_and_gradient_reaches_only_the_scores():
    q, entries, score, count, valid = (jnp.asarray(a) for a in _inputs(seed=1))
    q, entries = q.astype(jnp.float32), entries.astype(jnp.float32)
    # scores equal to the log of the heads' mean distribution: KL 0
    logits = jnp.einsum("bshd,btd->bsht", q, entries) * 0.25
    vis = jnp.arange(entries.shape[1])[None, None, :] < count[..., None]
    p = jnp.mean(jax.nn.softmax(jnp.where(vis[:, :, None], logits, -1e30), -1), axis=2)
    matched = jnp.where(vis, jnp.log(jnp.maximum(p, 1e-30)), -jnp.inf)
    np.testing.assert_allclose(index_kl(q, entries, matched, count, valid, 0.25)[0], 0.0, atol=1e-5)
    gq, ge, gs = jax.grad(lambda a, b, c: index_kl(a, b, c, count, valid, 0.25)[0], argnums=(0, 1, 2))(
        q, entries, score.astype(jnp.float32))
    assert not np.asarray(gq).any() and not np.asarray(ge).any()
    assert np.isfinite(np.asarray(gs)).all() and np.asarray(gs).any()
    assert not np.asarray(gs)[~np.asarray(vis)].any()
