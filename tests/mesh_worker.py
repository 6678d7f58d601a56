"""Run in a subprocess with 8 CPU devices by tests/test_sharding.py (JAX fixes its device count at import):

    python tests/mesh_worker.py OUT.json GOLDEN_DIR TMP_DIR [default|full]

Compares sharded models against the single-device run of the same checkpoint and writes what it measured
as JSON; the test asserts on it. Nothing here decides pass or fail. The last argument picks the test tier
(the pytest marker `full`): `default` (the default) runs the default run's one mesh shape, data=2 x expert=4
(DEFAULT_MESH); `full` runs the full tier's other shapes (expert=8 and tensor=2 x expert=4) and nothing of the
default set, so each tier's fixture pays only for its own runs."""

from __future__ import annotations

import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

import jdeep  # noqa: E402
from jdeep.io import safetensors  # noqa: E402
from jdeep.param_spec import padded_experts  # noqa: E402
from jdeep.config.small_models import one_layer_config  # noqa: E402
from jdeep.tools.testing.random_weights import random_checkpoint  # noqa: E402

PROMPTS = [[1, 5, 9, 33, 100, 7, 3, 250, 17], [4, 8, 15, 16, 23, 42]]
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "collective_permute")
DEFAULT_MESH = "data=2,expert=4"                    # the default run's one mesh shape
FULL_MESHES = ("expert=8", "tensor=2,expert=4")     # the full tier's other shapes
TIERS = ("default", "full")


def compare(folder: str, meshes: list[str], forward_on: tuple[str, ...] = (), generate: bool = True,
            regions: bool = False, n_new: int = 4) -> dict:
    """Single device vs each mesh: greedy generate (ragged batch of 2: chunked prefill + decode, logits per
    step) and, for the meshes in `forward_on`, a no-cache forward (every position's logits), also in the
    regions compile mode if `regions`."""
    ref = jdeep.load(folder)
    want = jdeep.generate(ref, PROMPTS, max_new_tokens=n_new, return_logits=True, prefill_chunk=8) if generate else None
    want_fwd = jdeep.forward(ref, PROMPTS[0]) if forward_on else None
    out = {}
    for mesh in meshes:
        model = jdeep.load(folder, mesh=mesh)
        r = {"expert_leaf_spec": str(_expert_leaf(model).sharding.spec),
             "n_experts_loaded": int(_expert_leaf(model).shape[1])}
        if generate:
            got = jdeep.generate(model, PROMPTS, max_new_tokens=n_new, return_logits=True, prefill_chunk=8)
            r.update(logits_max_abs_diff=float(np.nanmax(np.abs(got.logits - want.logits))),
                     tokens_equal=bool((got.tokens == want.tokens).all()), tokens=got.tokens.tolist())
        if mesh in forward_on:
            r["forward_max_abs_diff"] = float(np.abs(jdeep.forward(model, PROMPTS[0]) - want_fwd).max())
            if regions:
                in_regions = jdeep.load(folder, mesh=mesh, compile_mode="regions")
                r["regions_forward_max_abs_diff"] = float(np.abs(jdeep.forward(in_regions, PROMPTS[0]) - want_fwd).max())
        out[mesh] = r
    return out


def speculative(mesh: str) -> dict:
    """MTP speculative decoding (k = 2, the demo model with its MTP block, float numerics) on the mesh vs one device:
    a ragged batch with a sampled row beside greedy ones."""
    from jdeep import SamplingParams

    demo = os.path.join(os.path.dirname(jdeep.__file__), "demo_model")
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    # at most 7 new tokens: every block is a single iteration (speculative.generate.block_length), one program per run
    sp = [SamplingParams(max_new_tokens=7), SamplingParams(max_new_tokens=6, temperature=0.9, seed=3),
          SamplingParams(max_new_tokens=7)]
    prompts = [p + [11, 12] for p in PROMPTS] + [[40, 41, 42]]
    runs = [jdeep.generate(jdeep.load(demo, mtp=True, quantize_activations=False, mesh=m), prompts, sampling=sp,
                           ignore_eos=True, speculative=spec).tokens for m in (None, mesh)]
    return {"tokens_equal": bool((runs[0] == runs[1]).all()), "tokens": runs[1].tolist()}


def _local_ops(folder: str, mesh: str) -> dict:
    """The routed-expert kernel each expert shard runs, for this run's prefill and decode token counts."""
    from jdeep.config import ModelConfig
    from jdeep.kernels import pair_kernel_limit
    from jdeep.layers.moe import _local_routed_op
    from jdeep.sharding import parse_mesh

    cfg = ModelConfig.from_file(os.path.join(folder, "config.json"))
    sizes = parse_mesh(mesh)
    n_local = padded_experts(cfg.n_routed_experts, sizes["expert"]) // sizes["expert"]
    per_shard = len(PROMPTS) // sizes["data"]
    limit = pair_kernel_limit()      # what jdeep.load's Numerics take on this backend
    return {"prefill": _local_routed_op(cfg, per_shard * 16, n_local, False, limit),
            "decode": _local_routed_op(cfg, per_shard, n_local, True, limit)}


def _expert_leaf(model):
    w1 = model.params["segments"][0][0]["ffn"]["w1"]
    return (w1["decoded"] if "decoded" in w1 else w1["scale"]) if isinstance(w1, dict) else w1


def lowered_collectives(folder: str, mesh: str) -> dict:
    """Collective ops and dynamic dims in the lowered (StableHLO) decode and prefill steps."""
    model = jdeep.load(folder, mesh=mesh)
    step = model.step_fn(all_logits=False)
    out = {}
    for name, B, S in (("decode_b1", 1, 1), ("decode_b8", 8, 1), ("prefill_b2", 2, 16)):
        state = model.init_state(B, 256)
        zeros = model.put(np.zeros((B, S), np.int32))
        text = step.lower(model.params, state, zeros, zeros, None).as_text()
        out[name] = {op: len(re.findall(rf"stablehlo\.{op}\b", text)) for op in COLLECTIVES}
        out[name]["dynamic_dims"] = len(re.findall(r"tensor<[^>]*\?", text))
        out[name]["shard_map"] = len(re.findall(r"sdy\.manual_computation", text))
    return out


def bytes_read(folder: str, mesh: str) -> dict:
    """Bytes each checkpoint tensor is read while loading sharded (positioned reads and memory-map copies)."""
    reads: dict[str, int] = {}
    orig_range, orig_view = safetensors.SafetensorsFile.read_range, safetensors.SafetensorsFile.view

    def read_range(self, name, start, stop):
        reads[name] = reads.get(name, 0) + (stop - start)
        return orig_range(self, name, start, stop)

    def view(self, name, random_access=False):
        arr = orig_view(self, name, random_access)
        return _CountingView(arr, name, reads)

    safetensors.SafetensorsFile.read_range, safetensors.SafetensorsFile.view = read_range, view
    try:
        jdeep.load(folder, mesh=mesh)
    finally:
        safetensors.SafetensorsFile.read_range, safetensors.SafetensorsFile.view = orig_range, orig_view
    reader = safetensors.CheckpointReader(folder)
    sizes = {n: reader.entry(n).end - reader.entry(n).start for n in reader.keys()}
    return {"read": reads, "sizes": sizes}


class _CountingView:
    """A memory-mapped tensor whose sliced copies are counted."""

    def __init__(self, arr, name, reads):
        self.arr, self.name, self.reads = arr, name, reads

    def __getitem__(self, sl):
        part = self.arr[sl]
        self.reads[self.name] = self.reads.get(self.name, 0) + part.nbytes
        return part


def main() -> None:
    out_path, golden, tmp = sys.argv[1:4]
    tier = sys.argv[4] if len(sys.argv) > 4 else "default"
    if tier not in TIERS:
        raise SystemExit(f"mesh_worker: the tier must be one of {TIERS}, not {tier!r}")
    hf = os.path.join(golden, "v4-tiny-hf")
    if tier == "full":
        tq = FULL_MESHES[1]
        result = {
            "v4-tiny-hf": compare(hf, list(FULL_MESHES)),
            "v4-tiny-q": compare(os.path.join(golden, "v4-tiny-q"), [tq], generate=False, forward_on=(tq,)),
            "reads": {tq: bytes_read(hf, tq)},
            "v41-tiny-q": compare(os.path.join(golden, "v41-tiny-q"), [tq]),
        }
        with open(out_path, "w") as f:
            json.dump(result, f)
        return
    result = {
        "v4-tiny-hf": compare(hf, [DEFAULT_MESH]),
        "lowered": lowered_collectives(hf, DEFAULT_MESH),
        "reads": {DEFAULT_MESH: bytes_read(hf, DEFAULT_MESH)},
    }
    # a one-layer model (CSA with indexer, top-k MoE: cheap to compile) with 10 routed experts over expert=4:
    # padded to 12 with zero experts; 3 per shard (more than the 2 a token picks) runs the per-pair kernels on
    # each shard (grouped for the prefill, gather for the decode); also its forward in the regions mode
    odd = os.path.join(tmp, "ten-experts")
    random_checkpoint(one_layer_config(n_routed_experts=10), odd, seed=21)
    result["padded"] = compare(odd, ["expert=4,data=2"], forward_on=("expert=4,data=2",), regions=True)
    result["local_ops"] = {name: _local_ops(path, mesh) for name, path, mesh in (
        ("v4-tiny-hf", hf, DEFAULT_MESH), ("padded", odd, "expert=4,data=2"))}
    result["speculative"] = speculative(DEFAULT_MESH)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
