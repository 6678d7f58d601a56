"""Run in a subprocess with 8 CPU devices by tests/tools/dev/test_collectives.py (JAX fixes its device count at import):

    python tests/tools/dev/collectives_worker.py OUT_DIR GOLDEN_DIR [RUN ...]

Writes into OUT_DIR the compiled HLO text of small programs with known collectives (oracles), of the golden model's
decode step and prefill chunk as jdeep.load(..., mesh=) runs them on each 8-device test mesh (and of a random
model with repeated layers on one of them), and the planner's
measurement (`jdeep.tools.dev.collectives.step_collectives`) of the same steps, as result.json. RUN names which
model runs to do (a mesh of MESHES, or "deep"); all of them when none is named (the oracles always run). Nothing here
decides pass or fail."""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jdeep  # noqa: E402
from jdeep.config import ModelConfig  # noqa: E402
from jdeep.config.small_models import deep_tiny_config  # noqa: E402
from jdeep.tools.testing.random_weights import random_checkpoint  # noqa: E402
from jdeep.tools.dev.collectives import result_to_json, step_collectives  # noqa: E402

MESHES = ("expert=8", "tensor=2,expert=4", "data=2,expert=4")
# the oracles' shapes (the test computes its expectations from these)
ORACLE = {"rows": 4, "cols": 8, "flat_steps": 5, "outer_steps": 3, "inner_steps": 4, "a": 2, "b": 4}
STEP = {"batch": 2, "max_len": 64, "prefill_len": 16}


def oracle_programs() -> dict[str, str]:
    """Compiled HLO of shard_map programs over a (a=2, b=4) mesh whose collectives run inside lax.scan. Every
    collective reads the loop carry, so XLA cannot hoist it out of the loop. Each device's block is
    f32 [rows, cols]."""
    o = ORACLE
    mesh = Mesh(np.array(jax.devices()).reshape(o["a"], o["b"]), ("a", "b"))
    ring = [(i, (i + 1) % o["b"]) for i in range(o["b"])]

    def flat(x):
        def body(c, _):
            r = jax.lax.psum(c, "b")                                         # all-reduce over b
            g = jax.lax.all_gather(c, "b", tiled=True)                       # all-gather [b*rows, cols]
            s = jax.lax.psum_scatter(g * 0.5, "b", tiled=True)               # reduce-scatter of [b*rows, cols]
            t = jax.lax.all_to_all(c, "b", 0, 0, tiled=True)                 # all-to-all
            p = jax.lax.ppermute(c, "b", ring)                               # collective-permute
            u, v = jax.lax.psum((c * 2.0, c[:2] * 3.0), "a")                 # one tuple all-reduce over a
            return jnp.tanh(r + s + t + p + u + v.sum(0)), None
        c, _ = jax.lax.scan(body, x, None, length=o["flat_steps"])
        return c

    def nested(x):
        def outer(c, _):
            def inner(c2, _):
                return jnp.tanh(jax.lax.psum(c2, "b")), None                  # outer x inner times
            c, _ = jax.lax.scan(inner, c, None, length=o["inner_steps"])
            g = jax.lax.all_gather(c, "a", tiled=True)                        # outer times
            return jnp.tanh(g.reshape(o["a"], o["rows"], o["cols"]).mean(0) + c), None
        c, _ = jax.lax.scan(outer, x, None, length=o["outer_steps"])
        return c + jax.lax.psum(c.sum(), ("a", "b"))                          # once, over all 8 devices

    spec = P("a", "b")
    x = jax.ShapeDtypeStruct((o["a"] * o["rows"], o["b"] * o["cols"]), jnp.float32,
                             sharding=NamedSharding(mesh, spec))
    out = {}
    for name, fn in (("flat", flat), ("nested", nested)):
        sm = jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
        out[name] = jax.jit(sm).lower(x).compile().as_text()
    return out


def golden_programs(folder: str, mesh: str) -> dict[str, str]:
    """The compiled decode step and prefill chunk of the checkpoint loaded on `mesh`, as generate runs them."""
    model = jdeep.load(folder, mesh=mesh)
    step = model.step_fn(all_logits=False)
    out = {}
    for name, seq in (("decode", 1), ("prefill", STEP["prefill_len"])):
        state = model.init_state(STEP["batch"], STEP["max_len"])
        zeros = model.put(np.zeros((STEP["batch"], seq), np.int32))
        out[name] = step.lower(model.params, state, zeros, zeros, None).compile().as_text()
    return out


def main() -> None:
    out_dir, golden = sys.argv[1:3]
    wanted = sys.argv[3:] or [*MESHES, "deep"]
    result = {"oracle": ORACLE, "step": STEP, "meshes": {}}
    for name, text in oracle_programs().items():
        with open(os.path.join(out_dir, f"oracle-{name}.hlo"), "w") as f:
            f.write(text)
    # the golden checkpoint on the three test meshes, and "deep": the tiny kinds with (HCA, CSA) repeated twice
    # (a layer scan of 2 reps), random weights, on tensor=2,expert=4
    deep = os.path.join(out_dir, "deep-checkpoint")
    if "deep" in wanted:
        random_checkpoint(deep_tiny_config(2), deep, seed=3)
    runs = [(m, os.path.join(golden, "v4-tiny-hf"), m) for m in MESHES] + [("deep", deep, "tensor=2,expert=4")]
    runs = [r for r in runs if r[0] in wanted]
    for name, folder, mesh in runs:
        for step, text in golden_programs(folder, mesh).items():
            with open(os.path.join(out_dir, f"{name}-{step}.hlo"), "w") as f:
                f.write(text)
        config = ModelConfig.from_file(folder)
        result["meshes"][name] = result_to_json(step_collectives(config, mesh, **STEP))
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
