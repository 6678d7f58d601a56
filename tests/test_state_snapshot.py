"""state.snapshot_head / snapshot_block and their restores against numpy slicing of the same random state: a
snapshot is one slot's rows of every ring (its head) and its compressed pools' entries block by block (block // m
entries of a pool of ratio m per block); restoring head and blocks into another slot writes exactly those rows and
leaves every other slot, and the pool entries past the snapshot's blocks, as they were. For DeepSeek-V4 (per-layer
caches, ratios 4 and 128) and V4.1 (shared per-ratio sources)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdeep.config import ModelConfig
from jdeep.plan import build_plan
from jdeep.config.small_models import TINY_CONFIG, tiny_v41_config
from jdeep.state import SNAPSHOT_POOLS, empty_state, restore_block, restore_head, snapshot_block, snapshot_head

MAX_LEN, BATCH, BLOCK = 512, 4, 128
STATIC = ("block", "max_len")


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


def _snapshot(state, slot: int, n_blocks: int):
    head = jax.jit(snapshot_head)(state, jnp.int32(slot))
    take = jax.jit(snapshot_block, static_argnames=STATIC)
    return head, [take(state, jnp.int32(slot), jnp.int32(k), block=BLOCK, max_len=MAX_LEN) for k in range(n_blocks)]


def _restore(state, head, blocks, slot: int):
    state = jax.jit(restore_head)(state, head, jnp.int32(slot))
    put = jax.jit(restore_block, static_argnames=STATIC)
    for k, blk in enumerate(blocks):
        state = put(state, blk, jnp.int32(slot), jnp.int32(k), block=BLOCK, max_len=MAX_LEN)
    return state


@pytest.mark.parametrize("config", [ModelConfig.from_dict(TINY_CONFIG), ModelConfig.from_dict(tiny_v41_config())],
                         ids=["v4", "v41"])
@pytest.mark.parametrize("n_tokens", [128, 384])
def test_snapshot_and_restore_against_numpy(config, n_tokens):
    state = _random_state(config, 0)
    src, dst = 2, 1
    head, blocks = _snapshot(state, src, n_tokens // BLOCK)
    named, head_leaves = _named_leaves(state), dict(enumerate(np.asarray(v) for _, v in _named(head)))
    rings = [(k, a) for k, a in named if k not in SNAPSHOT_POOLS]
    pools = [(k, a) for k, a in named if k in SNAPSHOT_POOLS]
    assert len(head_leaves) == len(rings) and pools
    for i, (_, a) in enumerate(rings):
        np.testing.assert_array_equal(head_leaves[i], a[:, src:src + 1])
    for k, blk in enumerate(blocks):
        got = [np.asarray(v) for _, v in _named(blk)]
        assert len(got) == len(pools)
        for g, (_, a) in zip(got, pools):
            n = BLOCK // (MAX_LEN // (a.shape[2] - 1))          # block // m entries
            np.testing.assert_array_equal(g, a[:, src:src + 1, k * n:(k + 1) * n])

    target = _random_state(config, 1)
    before = _named_leaves(target)
    restored = _restore(target, head, blocks, dst)
    for (name, b), (_, r), (_, a) in zip(before, _named_leaves(restored), named):
        want = b.copy()
        if name in SNAPSHOT_POOLS:
            n = n_tokens // (MAX_LEN // (a.shape[2] - 1))
            want[:, dst, :n] = a[:, src, :n]          # the entries past n keep the target slot's own values
        else:
            want[:, dst] = a[:, src]
        np.testing.assert_array_equal(r, want)


def test_block_entries_follow_the_compress_ratio():
    """A 128-token block of V4's ratio-4 and ratio-128 pools holds 32 and 1 entries; of V4.1's ratio-1 source, one
    entry per token. The block index is clamped into the state's blocks (no out-of-range slice)."""
    for config in (ModelConfig.from_dict(TINY_CONFIG), ModelConfig.from_dict(tiny_v41_config())):
        state = jax.eval_shape(lambda: empty_state(config, build_plan(config), BATCH, MAX_LEN, jnp.float32))
        blk = jax.eval_shape(lambda s: snapshot_block(s, jnp.int32(0), jnp.int32(0), block=BLOCK, max_len=MAX_LEN),
                             state)
        pools = [(k, a) for k, a in _named(state) if k in SNAPSHOT_POOLS]
        got = {MAX_LEN // (a.shape[2] - 1): b.shape[2] for (_, a), (_, b) in zip(pools, _named(blk))}
        assert got == {m: BLOCK // m for m in got} and len(got) >= 2
    state = _random_state(ModelConfig.from_dict(TINY_CONFIG), 2)
    last = jax.jit(snapshot_block, static_argnames=STATIC)
    far, end = (last(state, jnp.int32(0), jnp.int32(k), block=BLOCK, max_len=MAX_LEN) for k in (99, MAX_LEN // BLOCK - 1))
    for a, b in zip(jax.tree_util.tree_leaves(far), jax.tree_util.tree_leaves(end)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_reset_slot_empties_one_slot_in_place():
    """state.reset_slot writes the fill values (0; -inf for the gate scores) over one slot's rows of every leaf and
    leaves the other slots as they were; the index is clamped into the slots."""
    from jdeep.state import reset_slot
    config = ModelConfig.from_dict(tiny_v41_config())
    state = _random_state(config, 3)
    before = _named_leaves(state)
    after = _named_leaves(jax.jit(reset_slot, donate_argnums=(0,))(state, jnp.int32(2)))
    for (name, b), (_, a) in zip(before, after):
        want = b.copy()
        want[:, 2] = -np.inf if name.endswith("score") else 0
        np.testing.assert_array_equal(a, want)
    last = _named_leaves(jax.jit(reset_slot)(_random_state(config, 3), jnp.int32(99)))
    assert all(np.all(a[:, BATCH - 1] == (-np.inf if n.endswith("score") else 0)) for n, a in last)
