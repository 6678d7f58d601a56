"""Per-request sampling against numpy oracles: determinism per seed, the greedy limits, and empirical
token frequencies under top-k / top-p / min-p (chi-square against the renormalised distribution)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdeep.runtime.sampling import SamplingParams, batch_params, filtered_logits, sample

V = 40


def _logits(seed=0, batch=1):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(0, 2, (batch, V)), jnp.float32)


def _draw(logits, params, n):
    """n samples of row 0 with params, one per step index (fresh noise each)."""
    sb = batch_params([params])
    f = jax.jit(jax.vmap(lambda s: sample(logits, sb, s)[0]))
    return np.asarray(f(jnp.arange(n, dtype=jnp.int32)))


def _oracle(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """transformers' warper order in float64: temperature, top-k, top-p (smallest prefix with mass >= p), min-p."""
    x = np.asarray(logits, np.float64) / temperature
    if top_k:
        x = np.where(x < np.sort(x)[::-1][top_k - 1], -np.inf, x)
    p = np.exp(x - x.max()); p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        keep = np.cumsum(p[order]) - p[order] < top_p         # tokens before the prefix reached top_p
        x = np.where(np.isin(np.arange(len(x)), order[keep]), x, -np.inf)
        p = np.exp(x - x.max()); p /= p.sum()
    if min_p:
        x = np.where(p < min_p * p.max(), -np.inf, x)
    p = np.exp(x - x.max())
    return p / p.sum()


def _chi2_ok(samples, probs):
    """Pearson chi-square over the supported tokens; no sample outside the support."""
    counts = np.bincount(samples, minlength=len(probs))
    assert counts[probs == 0].sum() == 0, "sampled a token the filters removed"
    sup = probs > 0
    n = len(samples)
    expected = n * probs[sup]
    stat = ((counts[sup] - expected) ** 2 / expected).sum()
    dof = sup.sum() - 1
    # 99.9% quantile of chi-square(dof) by the Wilson-Hilferty approximation
    z = 3.09
    crit = dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3 if dof > 0 else 0.0
    assert stat <= crit, (stat, crit, dof)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=1.3, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.8, min_p=0.05),
])
def test_frequencies_match_renormalised_distribution(params):
    logits = _logits(1)
    samples = _draw(logits, params, 20000)
    probs = _oracle(np.asarray(logits[0]), params.temperature, params.top_k, params.top_p, params.min_p)
    _chi2_ok(samples, probs)


def test_filters_match_oracle_support():
    logits = _logits(2)
    for tp in (0.05, 0.3, 0.5, 0.9, 0.999):
        sb = batch_params([SamplingParams(temperature=1.0, top_p=tp)])
        kept = np.isfinite(np.asarray(filtered_logits(logits, sb))[0])
        np.testing.assert_array_equal(kept, _oracle(np.asarray(logits[0]), top_p=tp) > 0, err_msg=f"top_p {tp}")


def test_same_seed_same_tokens_and_batch_independence():
    logits = _logits(3, batch=4)
    ps = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0.5, top_k=3, seed=8),
          SamplingParams(), SamplingParams(temperature=2.0, top_p=0.9, seed=9)]
    a = np.asarray(sample(logits, batch_params(ps), jnp.int32(5)))
    b = np.asarray(sample(logits, batch_params(ps), jnp.int32(5)))
    np.testing.assert_array_equal(a, b)
    # row 3 alone (same seed, same step) draws the same token as inside the batch
    alone = np.asarray(sample(logits[3:4], batch_params([ps[3]]), jnp.int32(5)))
    assert alone[0] == a[3]
    # another step index gives other draws somewhere
    draws = {tuple(np.asarray(sample(logits, batch_params(ps), jnp.int32(s)))) for s in range(20)}
    assert len(draws) > 1


def test_greedy_limits():
    logits = _logits(4, batch=3)
    greedy = np.argmax(np.asarray(logits), axis=-1)
    for p in (SamplingParams(), SamplingParams(temperature=1e-6, seed=1), SamplingParams(temperature=1.5, top_k=1, seed=2),
              SamplingParams(temperature=1.0, min_p=1.0, seed=3)):
        for s in range(5):
            got = np.asarray(sample(logits, batch_params([p] * 3), jnp.int32(s)))
            np.testing.assert_array_equal(got, greedy, err_msg=str(p))


def test_greedy_ties_pick_lowest_id():
    logits = jnp.zeros((1, V), jnp.float32).at[0, 7].set(3.0).at[0, 3].set(3.0)
    assert int(sample(logits, batch_params([SamplingParams()]), jnp.int32(0))[0]) == 3


@pytest.mark.parametrize("bad, field", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(min_p=-0.1), "min_p"),
    (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(seed=-3), "seed"), (dict(stop_token_ids=(V,)), "stop_token_ids"), (dict(stop="x"), "stop"),
    (dict(temperature="hot"), "temperature"),
])
def test_bad_values_are_named(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad).validate(V)
