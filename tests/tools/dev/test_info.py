"""Deployment planning: `jdeep.tools.dev.info.device_footprint` / `jdeep info --mesh` (per-device parameter and state bytes).
No compiles, no devices: the layout runs over an AbstractMesh."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from conftest import golden_path

from jdeep.cli import main
from jdeep.config import ModelConfig
from jdeep.plan import build_plan
from jdeep.config.presets import preset
from jdeep.sharding import AXES
from jdeep.state import state_bytes
from jdeep.tools.dev.info import abstract_layout, device_footprint, mesh_summary, param_bytes_by_dtype

BF16 = ml_dtypes.bfloat16


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.from_file(str(golden_path("v4-tiny-hf") / "config.json"))


def _sharded_dims_divide(leaf, sizes) -> None:
    for n, entry in zip(leaf.shape, leaf.spec):
        axes = entry if isinstance(entry, tuple) else (entry,)
        k = math.prod(sizes[a] for a in axes if a is not None)
        assert n % k == 0, (leaf.key, leaf.shape, leaf.spec)


def _routed_expert_bytes(c: ModelConfig, n_experts: int) -> int:
    """Oracle: fp4 routed experts (2 codes per byte + one ue8m0 scale byte per 32 codes) in every layer."""
    per_matrix = c.moe_inter_dim * c.dim // 2 + c.moe_inter_dim * c.dim // 32   # w1, w3 [I, d]; w2 [d, I]
    return c.n_layers * n_experts * 3 * per_matrix


def _routed_expert_bytes_tiny(c: ModelConfig, n_experts: int) -> int:
    """The tiny golden model is unquantized: float32 routed experts w1, w2, w3 of I x d each, every layer."""
    return c.n_layers * n_experts * 3 * c.moe_inter_dim * c.dim * 4


def test_one_device_reproduces_the_unsharded_totals(tiny):
    for dtype in (np.float32, BF16):
        p = device_footprint(tiny, "data=1", dtype, batch=3, max_len=256)
        assert p.devices == 1 and p.pad_bytes == 0
        assert p.param_bytes_by_dtype == param_bytes_by_dtype(tiny, dtype)
        assert p.param_bytes == p.model_param_bytes == sum(param_bytes_by_dtype(tiny, dtype).values())
        assert p.state_bytes == state_bytes(tiny, build_plan(tiny), 3, 256, dtype)
        assert p.replicated_bytes == p.param_bytes


@pytest.mark.parametrize("mesh", ["data=2,tensor=2,expert=3", "tensor=4,expert=2", "expert=8", "data=4"])
def test_device_shares_add_up_to_the_model(tiny, mesh):
    p = device_footprint(tiny, mesh, np.float32, batch=4, max_len=128)
    sizes = p.mesh
    assert p.devices == math.prod(sizes[a] for a in AXES)
    E = tiny.n_routed_experts
    n_pad = -(-E // sizes["expert"]) * sizes["expert"]
    assert p.n_experts_padded == n_pad
    for leaf in p.params + p.state:
        _sharded_dims_divide(leaf, sizes)
        assert leaf.nbytes % leaf.split == 0
    # every device's share times the devices each leaf is split over: the model once, plus the zero experts
    total = sum(param_bytes_by_dtype(tiny, np.float32).values())
    pad = _routed_expert_bytes_tiny(tiny, n_pad - E)
    assert p.pad_bytes == pad
    assert sum(leaf.device_bytes * leaf.split for leaf in p.params) == total + pad
    assert p.model_param_bytes == total
    # replicated leaves are held once per device
    assert p.mesh_param_bytes == sum(leaf.device_bytes for leaf in p.params) * p.devices
    assert p.replicated_bytes == sum(leaf.nbytes for leaf in p.params if leaf.split == 1)
    # the state's batch axis splits over data when data divides it, and nothing else splits it
    full = state_bytes(tiny, build_plan(tiny), 4, 128, np.float32)
    assert p.state_bytes * (sizes["data"] if 4 % sizes["data"] == 0 else 1) == full


def test_state_stays_whole_when_data_does_not_divide_the_batch(tiny):
    p = device_footprint(tiny, "data=2", np.float32, batch=3, max_len=128)
    assert p.state_split == 1
    assert p.state_bytes == state_bytes(tiny, build_plan(tiny), 3, 128, np.float32)


def test_v4_flash_routed_experts_are_one_sixteenth_per_device():
    c = preset("v4-flash")
    whole = _routed_expert_bytes(c, c.n_routed_experts)
    assert whole == 43 * 256 * 3 * (2048 * 4096 // 2 + 2048 * 4096 // 32)
    p = device_footprint(c, "expert=16", BF16)
    assert p.n_experts_padded == 256 and p.pad_bytes == 0
    assert p.routed_expert_bytes * 16 == whole
    # with tensor=4 the experts' width (2048 = 4 x 512 columns, whole 128-blocks) also splits: 1/64 per device
    p = device_footprint(c, "data=1,tensor=4,expert=16", BF16)
    assert p.expert_inter
    assert p.routed_expert_bytes * 64 == whole
    # and the other leaves' per-device bytes do not depend on how the experts split
    q = device_footprint(c, "tensor=4", BF16)
    assert p.param_bytes - p.routed_expert_bytes == q.param_bytes - q.routed_expert_bytes


def test_expert_padding_when_the_expert_axis_does_not_divide():
    c = preset("v4-flash")
    p = device_footprint(c, "expert=12", BF16)
    assert p.n_experts_padded == 264
    assert p.pad_bytes == _routed_expert_bytes(c, 8)
    assert p.routed_expert_bytes * 12 == _routed_expert_bytes(c, 264)
    assert "256 routed experts padded to 264" in mesh_summary(p)


def test_abstract_layout_matches_the_real_layout_on_one_device(tiny):
    import jax

    from jdeep.sharding import Layout, make_mesh

    real = Layout.for_model(make_mesh("data=1", jax.devices()[:1]), tiny.moe_inter_dim)
    abstract = abstract_layout(tiny, "data=1")
    assert abstract.sizes == real.sizes and abstract.expert_inter == real.expert_inter


def test_bad_batch_is_a_value_error(tiny):
    with pytest.raises(ValueError, match="batch"):
        device_footprint(tiny, "data=1", batch=0)
    with pytest.raises(ValueError, match="max_len"):
        device_footprint(tiny, "data=1", max_len=-5)


def test_cli_prints_per_device_figures(capsys):
    assert main(["info", "--preset", "v4-flash", "--mesh", "data=1,tensor=4,expert=16", "--batch", "8",
                 "--max-len", "8192", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "6880 B/token" in out                                   # the summary is still there
    assert "mesh            data=1,tensor=4,expert=16 (64 devices" in out
    p = device_footprint(preset("v4-flash"), "data=1,tensor=4,expert=16", BF16, batch=8, max_len=8192)
    assert f"total {p.param_bytes / 2**30:.3f} GiB" in out
    assert f"state/device    {p.state_bytes / 2**30:.3f} GiB for batch 8 x max-len 8192" in out
    assert f"total/device    {p.total_bytes / 2**30:.3f} GiB" in out
    assert "fits            trn2 logical core (24 GiB, LNC=2): yes" in out
    assert "H200 (141 GB): yes" in out
    # bf16 KV per token (6880 B) x 8 x 8192 tokens + fixed per-sequence state, replicated over tensor x expert
    assert p.state_bytes == state_bytes(preset("v4-flash"), build_plan(preset("v4-flash")), 8, 8192, BF16)


def test_cli_packed_kv_and_data_split(capsys):
    assert main(["info", "--preset", "v41-flash", "--mesh", "data=2,expert=8", "--batch", "8", "--packed-kv",
                 "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "packed fp8 KV records; 4 sequences per device, batch split over data=2" in out


def test_cli_without_mesh_is_unchanged(capsys):
    assert main(["info", "--preset", "v4-flash", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "mesh " not in out and "per device" not in out


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "foo=3"], "mesh axis 'foo' is not one of data, tensor, expert"),
    (["--mesh", "data=two"], "cannot read"),
    (["--mesh", "tensor=0"], "positive integer size"),
    (["--mesh", "data=1", "--batch", "0"], "--batch must be a positive integer"),
    (["--mesh", "data=1", "--max-len", "-1"], "--max-len must be a positive integer"),
    (["--batch", "8"], "only apply with --mesh"),
])
def test_cli_rejects_bad_planning_arguments(capsys, argv, message):
    assert main(["info", "--preset", "v4-flash"] + argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""
