"""The sort-free grouped expert op (`moe_experts_grouped_nosort`, decode programs) against a float64 numpy oracle and
the other routed-expert references, at every tokens x top-k vs expert-count regime; its layout equals the sorted
`expert_groups`' slot for slot; its lowering has no sort; `_routed_op` picks it exactly for decode with T*k >= E."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdeep import kernels
from jdeep.kernels import registry
from jdeep.config import ModelConfig
from jdeep.kernels.reference import (expert_groups, expert_groups_nosort, moe_experts_dense, moe_experts_gather,
                                     moe_experts_grouped, moe_experts_grouped_nosort)
from jdeep.layers.moe import _local_routed_op, _routed_op
from jdeep.numerics import Numerics
from jdeep.config.presets import preset
from jdeep.config.small_models import TINY_CONFIG
from jdeep.tools.dev.graphcheck import check_lowered

LIMIT = 2.5


def _swiglu(g, u):
    return np.minimum(g, LIMIT) / (1.0 + np.exp(-np.minimum(g, LIMIT))) * np.clip(u, -LIMIT, LIMIT)


def oracle(x, idx, weight, w1, w2, w3, layer):
    """float64: Σ_j weight[t, j] · W2[e] swiglu(W1[e] x_t, W3[e] x_t), e = idx[t, j] -> [T, d]."""
    x = np.asarray(x, np.float64)
    out = np.zeros((x.shape[0], w2.shape[2]))
    for t, j in np.ndindex(*idx.shape):
        W1, W2, W3 = (np.asarray(w[layer, idx[t, j]], np.float64) for w in (w1, w2, w3))
        out[t] += W2 @ (_swiglu(W1 @ x[t], W3 @ x[t]) * weight[t, j])
    return out


def _routing(rng, kind: str, T: int, k: int, E: int) -> np.ndarray:
    if kind == "distinct":                    # k different experts per token
        return np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int32)
    if kind == "repeated":                    # the same few experts across tokens (expert 1 in every token)
        return np.stack([np.concatenate([[1], rng.choice([0, 2], size=k - 1, replace=False)])
                         for _ in range(T)]).astype(np.int32)
    if kind == "one_expert":                  # every (token, slot) row on the last expert
        return np.full((T, k), E - 1, np.int32)
    raise ValueError(kind)


def _case(seed, T, k, E, R=2, I=12, d=16, kind="distinct"):
    rng = np.random.default_rng(seed)
    w1 = (rng.normal(size=(R, E, I, d)) * 3 / np.sqrt(d)).astype(np.float32)
    w3 = (rng.normal(size=(R, E, I, d)) * 3 / np.sqrt(d)).astype(np.float32)
    w2 = (rng.normal(size=(R, E, d, I)) / np.sqrt(I)).astype(np.float32)
    x = rng.normal(size=(T, d)).astype(np.float32)
    idx = _routing(rng, kind, T, k, E)
    weight = rng.uniform(0.1, 1.5, size=(T, k)).astype(np.float32)
    return x, idx, weight, w1, w2, w3


def _jit(op):
    """op compiled whole (the routing limit static): faster than op-by-op dispatch of its scans."""
    return jax.jit(op, static_argnums=(7,))


def _close(actual, expected, tol=2e-5):
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=tol, atol=tol * scale)


# (T, k, E, routing): T*k > E (decode at a large batch), T*k < E, T*k == E, a single token, repeated experts
# across tokens, every row on one expert (its group spans many tiles)
CASES = [(8, 2, 6, "distinct"), (3, 2, 6, "distinct"), (1, 6, 16, "distinct"),
         (40, 3, 6, "repeated"), (33, 2, 6, "one_expert"), (64, 6, 16, "distinct")]


@pytest.mark.parametrize("T,k,E,kind", CASES, ids=[f"T{c[0]}k{c[1]}E{c[2]}-{c[3]}" for c in CASES])
def test_nosort_matches_oracle_and_every_reference(T, k, E, kind):
    x, idx, weight, w1, w2, w3 = _case(T * 100 + E, T, k, E, kind=kind)
    layer = 1
    args = tuple(jnp.asarray(a) for a in (x, idx, weight, w1, w2, w3)) + (jnp.asarray(layer, jnp.int32), LIMIT)
    got = np.asarray(_jit(moe_experts_grouped_nosort)(*args))
    assert got.shape == (T, x.shape[1]) and got.dtype == np.float32
    _close(got, oracle(x, idx, weight, w1, w2, w3, layer))
    # the same padded layout as the sorted grouped op: bit for bit; the others up to fp32 summation order
    np.testing.assert_array_equal(got, np.asarray(_jit(moe_experts_grouped)(*args)))
    for other in (moe_experts_gather, moe_experts_dense):
        _close(got, _jit(other)(*args), tol=1e-5)


def test_nosort_layout_is_the_sorted_layout():
    """Every (token, slot) row lands in the padded slot the stable sort gives it; tiles keep their experts."""
    rng = np.random.default_rng(3)
    for T, k, E in ((8, 2, 6), (50, 6, 16), (256, 6, 256), (3, 2, 6)):
        idx = jnp.asarray(rng.integers(0, E, size=(T, k)), jnp.int32)
        s, n = expert_groups(idx, E), expert_groups_nosort(idx, E)
        assert (s.tile, s.n_tiles) == (n.tile, n.n_tiles) and n.n_tiles != E
        np.testing.assert_array_equal(n.tile_expert, s.tile_expert)
        slot_of_row = np.zeros(T * k, np.int64)
        slot_of_row[np.asarray(s.order)] = np.asarray(s.dest)            # sorted: via the permutation
        np.testing.assert_array_equal(np.asarray(n.dest), slot_of_row)
        # src inverts dest; padding slots point at row N
        src = np.asarray(n.src)
        np.testing.assert_array_equal(src[np.asarray(n.dest)], np.arange(T * k))
        assert np.sum(src == T * k) == n.n_tiles * n.tile - T * k


def test_nosort_quantized_experts_equal_the_sorted_op():
    """fp8 expert weights (decoded per tile) with DeepSeek's activation fp8 in bf16: bit-identical to the sorted op."""
    rng = np.random.default_rng(7)
    R, E, I, d, T, k = 1, 6, 32, 32, 8, 2
    numerics = Numerics(quantize_activations=True, weight_block=(32, 32), act_block=32, fp8_max=240.0)
    codes = [rng.integers(0, 0x7F, size=(R, E) + s, dtype=np.uint8) | (rng.integers(0, 2, size=(R, E) + s,
             dtype=np.uint8) << 7) for s in ((I, d), (d, I), (I, d))]
    ws = [{"codes": jnp.asarray(c), "scale": jnp.asarray(np.full((R, E, 1, 1), 120, np.uint8))} for c in codes]
    x = jnp.asarray(rng.normal(size=(T, d)), jnp.bfloat16)
    idx = jnp.asarray(_routing(rng, "distinct", T, k, E))
    weight = jnp.asarray(rng.uniform(0.1, 1.5, size=(T, k)), jnp.float32)
    args = (x, idx, weight, *ws, jnp.asarray(0, jnp.int32), LIMIT, numerics)
    got = np.asarray(moe_experts_grouped_nosort(*args))
    assert np.all(np.isfinite(got)) and np.max(np.abs(got)) > 0
    np.testing.assert_array_equal(got, np.asarray(moe_experts_grouped(*args)))


def test_nosort_lowering_has_no_sort_and_passes_the_decode_rules():
    T, k, E, R, I, d = 64, 6, 16, 2, 12, 16
    f32 = jax.ShapeDtypeStruct
    args = (f32((T, d), jnp.float32), f32((T, k), jnp.int32), f32((T, k), jnp.float32), f32((R, E, I, d), jnp.float32),
            f32((R, E, d, I), jnp.float32), f32((R, E, I, d), jnp.float32), f32((), jnp.int32))
    low = jax.jit(moe_experts_grouped_nosort, static_argnums=(7,)).lower(*args, LIMIT)
    assert "stablehlo.sort" not in low.as_text()
    report = check_lowered(low, name="nosort", n_experts=E, decode=True)
    assert report.ok, report.format()
    sorted_ = check_lowered(jax.jit(moe_experts_grouped, static_argnums=(7,)).lower(*args, LIMIT), decode=True)
    assert [v.rule for v in sorted_.violations] == ["S6"]          # what the decode programs ran before


def test_registered_with_a_reference(monkeypatch):
    """One dispatch point: the reference on CPU/GPU, and on Neuron too (no NKI kernel for it: the registry falls
    back to the reference)."""
    assert "reference" in kernels.registered()["moe_experts_grouped_nosort"]
    if jax.default_backend() == "cpu":
        assert kernels.get("moe_experts_grouped_nosort") is moe_experts_grouped_nosort
    monkeypatch.setattr(registry, "_backend", lambda: "neuron")
    monkeypatch.setattr(registry, "_NEURON_LOADED", True)      # as after register_all (which imports nki)
    assert kernels.get("moe_experts_grouped_nosort") is moe_experts_grouped_nosort


def test_routed_op_choice_on_cpu():
    """XLA:CPU's decode steps slice one expert per (token, expert) pair while T*k < 8 E (its small-row GEMMs are
    slow), then the sort-free grouped op; prefill keeps the rule of every platform (gather only while T*k < E).
    The limit rides in the Numerics of the platform the programs are built for, not the one that traces them."""
    small = ModelConfig.from_dict(dict(TINY_CONFIG, n_routed_experts=6, num_experts_per_tok=2))
    cpu, neuron = (Numerics.for_config(small, platform=p).pair_kernel_limit for p in ("cpu", "neuron"))
    assert (cpu, neuron) == (8, 1) and kernels.pair_kernel_limit("gpu") == 1
    assert [_routed_op(small, T, True, cpu) for T in (1, 3, 23, 24, 40)] == \
        ["moe_experts_gather"] * 3 + ["moe_experts_grouped_nosort"] * 2
    assert [_routed_op(small, T, False, cpu) for T in (2, 3, 8)] == ["moe_experts_gather"] + ["moe_experts_grouped"] * 2


def test_gather_with_as_many_pairs_as_experts_pads_its_loop():
    """At T*k == E the per-pair loop runs one padding pair (its trip is not the expert count, S5) that adds
    nothing: equal to the grouped kernel's result."""
    rng = np.random.default_rng(3)
    T, k, E, d, I = 4, 2, 8, 16, 8
    x = jnp.asarray(rng.standard_normal((T, d)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]), jnp.int32)
    w = jnp.asarray(rng.random((T, k)), jnp.float32)
    w1, w3 = (jnp.asarray(rng.standard_normal((1, E, I, d)), jnp.float32) for _ in range(2))
    w2 = jnp.asarray(rng.standard_normal((1, E, d, I)), jnp.float32)
    got = moe_experts_gather(x, idx, w, w1, w2, w3, jnp.int32(0), 10.0)
    want = moe_experts_grouped(x, idx, w, w1, w2, w3, jnp.int32(0), 10.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    low = jax.jit(moe_experts_gather, static_argnums=(7,)).lower(x, idx, w, w1, w2, w3, jnp.int32(0), 10.0)
    report = check_lowered(low, name="gather", n_experts=E, decode=True)
    assert report.ok, report.format()


def test_routed_op_choice():
    """On Neuron (and GPU; pair limit 1) decode (S == 1 per row) never sorts: gather while T*k < E, the sort-free
    grouped op from T*k == E on; prefill keeps the sorted grouped op. The expert-parallel choice follows the same
    rule per shard."""
    small = ModelConfig.from_dict(dict(TINY_CONFIG, n_routed_experts=6, num_experts_per_tok=2))
    assert [_routed_op(small, T, decode=True) for T in (1, 2, 3, 4, 8)] == \
        ["moe_experts_gather"] * 2 + ["moe_experts_grouped_nosort"] * 3
    assert [_routed_op(small, T) for T in (2, 3, 8)] == ["moe_experts_gather"] + ["moe_experts_grouped"] * 2
    for name in ("v4-flash", "v4-pro", "v41-flash"):
        c = preset(name)
        for B in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            op = _routed_op(c, B, decode=True)
            assert op != "moe_experts_grouped"
            assert (op == "moe_experts_gather") == (B * c.n_activated_experts < c.n_routed_experts)
    # expert parallel, 3 experts per shard (> k): the per-pair kernels, sort-free in decode
    assert _local_routed_op(small, 8, 3, decode=True) == "moe_experts_grouped_nosort"
    assert _local_routed_op(small, 8, 3) == "moe_experts_grouped"
    assert _local_routed_op(small, 8, 2, decode=True) == "moe_experts_dense"
