"""KV compressor (model-spec.md §4.4.4) against a float64 NumPy oracle written from the spec.

The oracle pools every complete group of the whole token sequence at once; jdeep's
`compress_chunk` sees the tokens chunk by chunk (prefill chunks of any size, single-token decode,
padded and ragged batch rows) and must fill the same cache entries.

Tolerances: float32 activations/weights of O(1), fp32 in jdeep, float64 in the oracle:
rtol = 2e-5, atol = 2e-5 x max|oracle| (softmax + RMSNorm + RoPE chain). Cache rows that must not
be written are compared exactly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdeep.layers.chunk import make_chunk
from jdeep.layers.compressor import compress_chunk

D_MODEL, DC, ROPE = 12, 16, 8
EPS = 1e-6
R, LAYER = 2, 1                       # two stacked layers; we drive layer 1 and layer 0 must stay untouched
FREQS = (160000.0 ** (-2.0 * np.arange(ROPE // 2) / ROPE)).astype(np.float32)
FREQS[-1] /= 7.0                      # any per-pair table works; keep it not a plain geometric series

# (ratio, overlap, number of tokens, max_len)
CONFIGS = {
    "m4-overlap": (4, True, 37, 48),
    "m16": (16, False, 50, 64),
    "m3": (3, False, 37, 48),
}


def close(actual, expected, rtol=2e-5, atol=2e-5):
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.max(np.abs(expected)))) if expected.size else 1.0
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol * scale)


# ------------------------------------------------------------------------------------------ oracle
def rope_np(v, t, f):
    v = np.asarray(v, np.float64).copy()
    r = 2 * len(f)
    D = v.shape[-1]
    ang = (np.float32(t) * np.asarray(f, np.float32)).astype(np.float64)
    a, b = v[D - r::2].copy(), v[D - r + 1::2].copy()
    v[D - r::2] = a * np.cos(ang) - b * np.sin(ang)
    v[D - r + 1::2] = a * np.sin(ang) + b * np.cos(ang)
    return v


def compress_np(x, p, m, overlap, freqs, eps):
    """x [T, d] (positions 0..T-1) -> entries [T // m, Dc] of all complete groups (spec §4.4.4)."""
    x = np.asarray(x, np.float64)
    wkv, wg, ape, nw = (np.asarray(p[k], np.float64) for k in ("wkv", "wgate", "ape", "norm"))
    T = x.shape[0]
    Dc = nw.shape[0]
    a = x @ wkv.T                                           # [T, c*Dc]
    z = x @ wg.T + ape[np.arange(T) % m]                    # [T, c*Dc]
    out = []
    for j in range(T // m):
        cur = slice(j * m, (j + 1) * m)
        if overlap:
            if j == 0:
                prev_a, prev_z = np.zeros((m, Dc)), np.full((m, Dc), -np.inf)
            else:
                prev = slice((j - 1) * m, j * m)
                prev_a, prev_z = a[prev, :Dc], z[prev, :Dc]        # previous group, first-half channels
            A = np.concatenate([prev_a, a[cur, Dc:]], axis=0)      # current group, second-half channels
            Z = np.concatenate([prev_z, z[cur, Dc:]], axis=0)      # [2m, Dc]
        else:
            A, Z = a[cur], z[cur]                                  # [m, Dc]
        w = np.exp(Z - Z.max(axis=0, keepdims=True))
        w = w / w.sum(axis=0, keepdims=True)                       # softmax over the slots, per channel
        pooled = (w * A).sum(axis=0)
        e = nw * pooled / np.sqrt(np.mean(pooled ** 2) + eps)      # RMSNorm
        out.append(rope_np(e, j * m, freqs))                       # RoPE at the group's first token
    return np.array(out).reshape(-1, Dc)


# --------------------------------------------------------------------------------------- helpers
def make_params(rng, m, overlap):
    c = 2 if overlap else 1
    return {
        "wkv": (rng.normal(size=(c * DC, D_MODEL)) / np.sqrt(D_MODEL)).astype(np.float32),
        "wgate": (rng.normal(size=(c * DC, D_MODEL)) * 2.0 / np.sqrt(D_MODEL)).astype(np.float32),
        "ape": rng.normal(size=(m, c * DC)).astype(np.float32),
        "norm": rng.uniform(0.5, 1.5, size=(DC,)).astype(np.float32),
    }


def init_state(B, m, overlap, max_len):
    c = 2 if overlap else 1
    rc, tc = c * m, max_len // m
    return (jnp.zeros((R, B, tc + 1, DC), jnp.float32),               # state.py: ckv [R, B, Tc+1, D]
            jnp.zeros((R, B, rc + 1, c * DC), jnp.float32),           # cbuf_kv [R, B, Rc+1, c*D]
            jnp.full((R, B, rc + 1, c * DC), -jnp.inf, jnp.float32))  # cbuf_score (starts at -inf)


@functools.lru_cache(maxsize=None)
def stepper(m, overlap):
    @jax.jit
    def step(x, p, cache, bkv, bsc, tokens, positions):
        chunk = make_chunk(tokens, positions, 1000)
        return compress_chunk(x, p, cache, bkv, bsc, jnp.asarray(LAYER, jnp.int32), chunk,
                              ratio=m, overlap=overlap, freqs=FREQS, norm_eps=EPS)
    return step


def run_schedule(xs, p, m, overlap, max_len, schedule, S=None, garbage_rng=None):
    """xs: list (per batch row) of [T_b, d] token inputs. schedule: list of steps, each a list of
    per-row token counts. Row b consumes its tokens in order; padding columns get position -1 and
    (when garbage_rng is given) large random inputs. Returns the final (cache, buf_kv, buf_score)."""
    B = len(xs)
    state = init_state(B, m, overlap, max_len)
    step = stepper(m, overlap)
    pj = {k: jnp.asarray(v) for k, v in p.items()}
    done = [0] * B
    for counts in schedule:
        width = S if S is not None else max(counts)
        x = np.zeros((B, width, D_MODEL), np.float32)
        if garbage_rng is not None:
            x[:] = garbage_rng.normal(size=x.shape) * 100.0
        pos = np.full((B, width), -1, np.int32)
        for b, n in enumerate(counts):
            x[b, :n] = xs[b][done[b]:done[b] + n]
            pos[b, :n] = np.arange(done[b], done[b] + n)
            done[b] += n
        state = step(jnp.asarray(x), pj, *state, jnp.zeros((B, width), jnp.int32), jnp.asarray(pos))
    assert done == [len(v) for v in xs]
    return state


def check_cache(state, xs, p, m, overlap, max_len):
    cache, bkv, bsc = (np.asarray(a) for a in state)
    tc = max_len // m
    for b, xb in enumerate(xs):
        expect = compress_np(xb, p, m, overlap, FREQS, EPS)[:tc]
        G = expect.shape[0]
        assert G > 0
        close(cache[LAYER, b, :G], expect)
        np.testing.assert_array_equal(cache[LAYER, b, G:tc], 0.0)        # incomplete groups: nothing written
    # the other stacked layer is untouched (including its scratch rows)
    np.testing.assert_array_equal(cache[1 - LAYER], 0.0)
    np.testing.assert_array_equal(bkv[1 - LAYER], 0.0)
    assert np.all(np.isneginf(bsc[1 - LAYER]))
    return cache


def inputs(rng, n_rows, T):
    return [rng.normal(size=(T, D_MODEL)).astype(np.float32) for _ in range(n_rows)]


def split(total, sizes):
    out, left, i = [], total, 0
    while left > 0:
        n = min(sizes[i % len(sizes)], left)
        out.append(n)
        left -= n
        i += 1
    return out


# ------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_chunk_matches_oracle(name):
    m, overlap, T, max_len = CONFIGS[name]
    rng = np.random.default_rng(20)
    p = make_params(rng, m, overlap)
    xs = inputs(rng, 1, T)
    state = run_schedule(xs, p, m, overlap, max_len, [[T]])
    check_cache(state, xs, p, m, overlap, max_len)


def test_overlap_is_observable():
    """Sanity of the oracle: dropping the previous-group half changes the ratio-4 entries j >= 1."""
    m, overlap, T, max_len = CONFIGS["m4-overlap"]
    rng = np.random.default_rng(21)
    p = make_params(rng, m, overlap)
    xs = inputs(rng, 1, T)
    cache = np.asarray(run_schedule(xs, p, m, overlap, max_len, [[T]])[0])
    no_prev = dict(p, wkv=p["wkv"].copy())
    no_prev["wkv"][:DC] = 0.0                     # previous half contributes a = 0 ...
    alt = compress_np(xs[0], no_prev, m, True, FREQS, EPS)
    assert np.max(np.abs(cache[LAYER, 0, 1:9] - alt[1:])) > 1e-2
    close(cache[LAYER, 0, 0], alt[0])             # ... which is exactly the situation of group 0


def test_cache_capacity_limits_entries():
    # max_len smaller than the sequence: only the first Tc entries exist; later groups go to scratch
    m, overlap, T = 4, True, 37
    rng = np.random.default_rng(22)
    p = make_params(rng, m, overlap)
    xs = inputs(rng, 1, T)
    state = run_schedule(xs, p, m, overlap, 24, [[T]])
    check_cache(state, xs, p, m, overlap, 24)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunked_prefill_and_decode_match(name):
    m, overlap, T, max_len = CONFIGS[name]
    rng = np.random.default_rng(23)
    p = make_params(rng, m, overlap)
    xs = inputs(rng, 1, T)
    one = np.asarray(run_schedule(xs, p, m, overlap, max_len, [[T]])[0])
    sizes = split(T, [5, 3, 1, 1, 7, 2, 9, 4])
    assert len(set(sizes)) > 4 and sum(sizes) == T
    chunked = check_cache(run_schedule(xs, p, m, overlap, max_len, [[n] for n in sizes]), xs, p, m, overlap, max_len)
    decode = check_cache(run_schedule(xs, p, m, overlap, max_len, [[1]] * T), xs, p, m, overlap, max_len)
    # prefill half, then decode the rest
    half = check_cache(run_schedule(xs, p, m, overlap, max_len, [[T // 2 + 1]] + [[1]] * (T - T // 2 - 1)),
                       xs, p, m, overlap, max_len)
    tc = max_len // m
    for other in (chunked, decode, half):
        close(other[LAYER, 0, :tc], one[LAYER, 0, :tc], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["m4-overlap", "m16"])
def test_padding_writes_nothing_visible(name):
    m, overlap, T, max_len = CONFIGS[name]
    rng = np.random.default_rng(24)
    p = make_params(rng, m, overlap)
    xs = inputs(rng, 2, T)
    S = 8
    # row 0: chunks of at most S tokens padded to S with huge garbage inputs; row 1: idle (all padding)
    sizes = split(T, [8, 3, 5, 1, 6, 8, 2])
    sched = [[n, 0] for n in sizes] + [[0, n] for n in split(T, [7, 8, 1])]
    st = run_schedule(xs, p, m, overlap, max_len, sched, S=S, garbage_rng=np.random.default_rng(7))
    check_cache(st, xs, p, m, overlap, max_len)

    # a fully padded row in the middle of a sequence leaves its cache and rings untouched
    half = T // 2 + 3
    mid = run_schedule([xs[0][:half], xs[1][:half]], p, m, overlap, max_len, [[half, half]])
    step = stepper(m, overlap)
    x = jnp.asarray(np.random.default_rng(8).normal(size=(2, S, D_MODEL)).astype(np.float32) * 100)
    pos = np.full((2, S), -1, np.int32)
    pos[0, :4] = np.arange(half, half + 4)
    after = step(x, {k: jnp.asarray(v) for k, v in p.items()}, *mid, jnp.zeros((2, S), jnp.int32), jnp.asarray(pos))
    rc = (2 if overlap else 1) * m
    tc = max_len // m
    np.testing.assert_array_equal(np.asarray(after[0])[:, 1, :tc], np.asarray(mid[0])[:, 1, :tc])
    np.testing.assert_array_equal(np.asarray(after[1])[:, 1, :rc], np.asarray(mid[1])[:, 1, :rc])
    np.testing.assert_array_equal(np.asarray(after[2])[:, 1, :rc], np.asarray(mid[2])[:, 1, :rc])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ragged_batch_rows(name):
    m, overlap, T, max_len = CONFIGS[name]
    rng = np.random.default_rng(25)
    p = make_params(rng, m, overlap)
    lengths = [T, T - 9, T - 3]
    xs = [rng.normal(size=(n, D_MODEL)).astype(np.float32) for n in lengths]
    S = 9
    plans = [split(lengths[0], [9, 2, 5]),
             [0, 0] + split(lengths[1], [1, 7, 3, 9]),        # starts two steps later
             split(lengths[2], [4, 9, 1, 1, 6])]
    steps = max(len(q) for q in plans)
    sched = [[q[i] if i < len(q) else 0 for q in plans] for i in range(steps)]
    # every step mixes rows at different pos0
    st = run_schedule(xs, p, m, overlap, max_len, sched, S=S, garbage_rng=np.random.default_rng(9))
    check_cache(st, xs, p, m, overlap, max_len)
