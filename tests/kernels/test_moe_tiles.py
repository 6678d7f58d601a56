"""The grouped MoE kernels' tile loop over the used tiles only (Numerics.skip_padding_tiles, on CPU): the same values
bit for bit as the static loop over every tile, whatever the routing; `n_used` counts exactly the tiles holding a row;
the loop's trip is the routing's on CPU and static (check-graph S3) in programs built for Neuron."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdeep import kernels
from jdeep.config import ModelConfig
from jdeep.kernels.reference import (expert_groups, expert_groups_nosort, moe_experts_grouped,
                                     moe_experts_grouped_nosort)
from jdeep.numerics import Numerics
from jdeep.config.small_models import TINY_CONFIG
from jdeep.tools.dev.graphcheck import check_lowered

from test_moe_nosort import LIMIT, _case, oracle

STATIC, SKIP = Numerics(), Numerics(skip_padding_tiles=True)

# (T, k, E, routing): a prefill chunk's T*k >> E, rows on few experts, every row on one expert (one group spanning
# many tiles, the rest of the static count unused), T*k == E
CASES = [(64, 4, 8, "distinct"), (40, 3, 6, "repeated"), (33, 2, 6, "one_expert"), (3, 2, 6, "distinct")]


def _run(op, numerics, args):
    return np.asarray(jax.jit(lambda *a: op(*a, LIMIT, numerics))(*args))


@pytest.mark.parametrize("op", [moe_experts_grouped, moe_experts_grouped_nosort], ids=["sorted", "nosort"])
@pytest.mark.parametrize("T,k,E,kind", CASES, ids=[f"T{c[0]}k{c[1]}E{c[2]}-{c[3]}" for c in CASES])
def test_used_tiles_only_equals_every_tile(op, T, k, E, kind):
    x, idx, weight, w1, w2, w3 = _case(T * 7 + E, T, k, E, kind=kind)
    args = tuple(jnp.asarray(a) for a in (x, idx, weight, w1, w2, w3)) + (jnp.asarray(1, jnp.int32),)
    skipped = _run(op, SKIP, args)
    np.testing.assert_array_equal(skipped, _run(op, STATIC, args))
    want = oracle(x, idx, weight, w1, w2, w3, 1)
    np.testing.assert_allclose(skipped, want, rtol=2e-5, atol=2e-5 * max(1.0, float(np.max(np.abs(want)))))


def test_out_of_range_ids_are_clamped_the_same_way():
    """Ids outside [0, E) (S12: clamped into it) land in the same used tiles with and without the skip."""
    x, idx, weight, w1, w2, w3 = _case(5, 24, 2, 6)
    idx = idx.copy()
    idx[::5, 0], idx[1::7, 1] = 9, -3
    args = tuple(jnp.asarray(a) for a in (x, idx, weight, w1, w2, w3)) + (jnp.asarray(0, jnp.int32),)
    for op in (moe_experts_grouped, moe_experts_grouped_nosort):
        np.testing.assert_array_equal(_run(op, SKIP, args), _run(op, STATIC, args))


def test_n_used_counts_the_tiles_holding_rows():
    rng = np.random.default_rng(11)
    for T, k, E in ((256, 4, 32), (50, 6, 16), (8, 2, 6), (33, 2, 6)):
        for idx in (rng.integers(0, E, size=(T, k)), np.full((T, k), E - 1)):
            idx = jnp.asarray(idx, jnp.int32)
            for g in (expert_groups(idx, E), expert_groups_nosort(idx, E)):
                holding = (np.asarray(g.src) < T * k).reshape(g.n_tiles, g.tile).any(axis=1)
                n_used = int(g.n_used)
                assert holding[:n_used].all() and not holding[n_used:].any()
                assert n_used == int(np.sum(-(-np.bincount(np.asarray(idx).ravel(), minlength=E) // g.tile)))


def _lowered(numerics):
    T, k, E, R, I, d = 64, 4, 8, 2, 12, 16
    s = jax.ShapeDtypeStruct
    args = (s((T, d), jnp.float32), s((T, k), jnp.int32), s((T, k), jnp.float32), s((R, E, I, d), jnp.float32),
            s((R, E, d, I), jnp.float32), s((R, E, I, d), jnp.float32), s((), jnp.int32))
    return jax.jit(lambda *a: moe_experts_grouped(*a, LIMIT, numerics)).lower(*args), E


def test_trip_is_static_in_programs_built_for_neuron():
    """The platform the programs are built for decides, as for the other per-platform numerics: a Neuron program
    lowered on a CPU host keeps the static trip S3 asks for; a CPU program loops over the used tiles only."""
    cfg = ModelConfig.from_dict(TINY_CONFIG)
    assert kernels.skip_padding_tiles("cpu") and not kernels.skip_padding_tiles("neuron")
    assert not kernels.skip_padding_tiles("gpu")
    neuron, cpu = (Numerics.for_config(cfg, platform=p) for p in ("neuron", "cpu"))
    assert not neuron.skip_padding_tiles and cpu.skip_padding_tiles
    low, E = _lowered(neuron)
    assert check_lowered(low, name="grouped", n_experts=E).ok
    low, E = _lowered(cpu)
    rules = {v.rule for v in check_lowered(low, name="grouped", n_experts=E).violations}
    assert rules == {"S3"}                                    # the routing's trip; nothing else changes
    assert not dataclasses.replace(cpu, skip_padding_tiles=False).skip_padding_tiles
