"""state.snapshot_slot / restore_slot against numpy slicing of the same random state: a snapshot is one slot's rows
with the compressed pools cut to their first n_tokens // m entries and every ring whole; restoring it into another
slot of a reset state writes exactly those rows and leaves every other slot, and the pool entries past the
snapshot, as they were. For DeepSeek-V4 (per-layer caches, ratios 4 and 128) and V4.1 (shared per-ratio sources)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdeep.config import ModelConfig
from jdeep.plan import build_plan
from jdeep.config.small_models import TINY_CONFIG, tiny_v41_config
from jdeep.state import SNAPSHOT_POOLS, empty_state, restore_slot, snapshot_slot

MAX_LEN, BATCH = 512, 4


def _named(state: dict) -> list[tuple[str, object]]:
    """(leaf name, leaf) in one fixed order: segments' layer kinds, then the V4.1 sources."""
    out = [(k, v) for seg in state["segments"] for slot in seg for k, v in slot.items()]
    return out + [(k, v) for key in sorted(state["sources"]) for k, v in state["sources"][key].items()]


def _named_leaves(state: dict) -> list[tuple[str, np.ndarray]]:
    return [(k, np.asarray(v)) for k, v in _named(state)]


def _random_state(config: ModelConfig, seed: int) -> dict:
    """The empty state's layout with every leaf filled with random values of its dtype."""
    rng = np.random.default_rng(seed)

    def fill(a):
        if a.dtype == jnp.uint8:
            return jnp.asarray(rng.integers(0, 256, a.shape), a.dtype)
        return jnp.asarray(rng.standard_normal(a.shape), a.dtype)

    return jax.tree_util.tree_map(fill, empty_state(config, build_plan(config), BATCH, MAX_LEN, jnp.float32))


@pytest.mark.parametrize("config", [ModelConfig.from_dict(TINY_CONFIG), ModelConfig.from_dict(tiny_v41_config())],
                         ids=["v4", "v41"])
@pytest.mark.parametrize("n_tokens", [128, 256])
def test_snapshot_and_restore_against_numpy(config, n_tokens):
    state = _random_state(config, 0)
    src, dst = 2, 1
    snap = jax.jit(snapshot_slot, static_argnames=("n_tokens", "max_len"))(state, jnp.int32(src), n_tokens=n_tokens,
                                                                          max_len=MAX_LEN)
    pools = 0
    for (name, a), (_, s) in zip(_named_leaves(state), _named_leaves(snap)):
        if name in SNAPSHOT_POOLS:
            m = MAX_LEN // (a.shape[2] - 1)
            np.testing.assert_array_equal(s, a[:, src:src + 1, :n_tokens // m])
            pools += 1
        else:
            np.testing.assert_array_equal(s, a[:, src:src + 1])
    assert pools > 0

    target = _random_state(config, 1)
    before = _named_leaves(target)
    restored = jax.jit(restore_slot)(target, snap, jnp.int32(dst))
    for (name, b), (_, r), (_, a) in zip(before, _named_leaves(restored), _named_leaves(state)):
        want = b.copy()
        if name in SNAPSHOT_POOLS:
            n = n_tokens // (MAX_LEN // (a.shape[2] - 1))
            want[:, dst, :n] = a[:, src, :n]          # the entries past n keep the target slot's own values
        else:
            want[:, dst] = a[:, src]
        np.testing.assert_array_equal(r, want)


def test_pool_entries_follow_the_compress_ratio():
    """V4's ratio-4 and ratio-128 pools keep n_tokens / 4 and n_tokens / 128 entries; V4.1's ratio-1 source keeps one
    entry per token."""
    for config in (ModelConfig.from_dict(TINY_CONFIG), ModelConfig.from_dict(tiny_v41_config())):
        state = jax.eval_shape(lambda: empty_state(config, build_plan(config), BATCH, MAX_LEN, jnp.float32))
        snap = jax.eval_shape(lambda s: snapshot_slot(s, jnp.int32(0), n_tokens=256, max_len=MAX_LEN), state)
        got = {MAX_LEN // (a.shape[2] - 1): s.shape[2] for (k, a), (_, s) in zip(_named(state), _named(snap))
               if k in SNAPSHOT_POOLS}
        assert got == {m: 256 // m for m in got} and len(got) >= 2
