"""Time DeepSeek-V4.1-Flash's vision tower at its released size on this machine (not a timed test).

Seeded random weights of the released ViT (32 blocks of width 1024) and aligner (into d = 5120) are made on the
device in the chosen dtype (no checkpoint), and images of several sizes go through VisionTower.encode as a request
would: processing, the tower program of their bucket (its first call compiles it), the span rows on the host.

    python scripts/bench_vision_tower.py [--dtype bfloat16] [--sizes 544x544,1024x768,1920x1080] [--repeats 2]
"""

from __future__ import annotations

import argparse
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from jdeep.model.vision import VisionTower
from jdeep.config.presets import preset
from jdeep.vision.geometry import bucket
from jdeep.vision.params import vision_tensors


def random_params(config, dtype) -> dict:
    key = jax.random.PRNGKey(0)
    out: dict = {}
    for i, (name, path, shape) in enumerate(vision_tensors(config)):
        if path[0] == "blocks":
            if path[2] != 0:
                continue
            shape, path = (config.vision.n_layers,) + shape, path[:2]
        scale = 0.02 if name.endswith(".bias") else 1.0 / np.sqrt(shape[-1])
        value = jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) * scale
        if "norm" in name:
            value = jnp.ones(shape, jnp.float32)
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value.astype(dtype)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--sizes", default="544x544,1024x768,1920x1080")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    config = preset("v41-flash")
    dtype = jnp.dtype(args.dtype)
    tower = VisionTower(config, random_params(config, dtype), "device", jax.devices()[0])
    print(f"{jax.devices()[0].device_kind}, {args.dtype}; columns: image, patches (bucket), span tokens, "
          "first call s (compile + run), later calls s")
    for size in args.sizes.split(","):
        w, h = (int(v) for v in size.split("x"))
        image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8))
        img = tower.process(image)
        n = img.n_vit_h * img.n_vit_w
        t = time.perf_counter()
        rows = tower.encode(img)
        first = time.perf_counter() - t
        later = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            tower.encode(img)
            later.append(time.perf_counter() - t)
        print(f"{size:>10} {n:>6} ({bucket(n)}) {len(rows):>5} {first:8.2f} {min(later):8.2f}")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB")


if __name__ == "__main__":
    main()
