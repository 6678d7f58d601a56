"""Peak host memory while loading a quantized checkpoint (not a timed test).

Builds a seeded random DeepSeek-V4 checkpoint in DeepSeek's released format (fp8 e4m3 dense weights with
128x128 ue8m0 scales, fp4 experts packed two per byte with per-32 scales, bf16 embeddings and norms) of
about --target-gb, then loads it with jdeep in a fresh process and reports the peak resident set size
(VmHWM) against the file size. Target: peak RSS <= 1.3x the checkpoint size.

    python scripts/bench_load_rss.py --target-gb 1.0 [--dir /tmp/jdeep-rss] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, resource, sys, time
import jax, jax.numpy as jnp
jnp.zeros(1).block_until_ready()          # start the runtime before measuring the baseline
import jdeep
from jdeep.tools.perf.memory import status_bytes
base = status_bytes("VmRSS")
t0 = time.perf_counter()
model = jdeep.load(sys.argv[1], dtype=sys.argv[2])
jax.block_until_ready(jax.tree_util.tree_leaves(model.params))
dt = time.perf_counter() - t0
leaves = jax.tree_util.tree_leaves(model.params)
print(json.dumps({"baseline_rss": base, "peak_rss": status_bytes("VmHWM"), "final_rss": status_bytes("VmRSS"), "load_seconds": dt,
                  "param_bytes": sum(x.nbytes for x in leaves)}))
"""


def bench_config(target_gb: float) -> dict:
    """A V4-shaped config (head_dim 512, rope 64, fp8 128x128 blocks, fp4 experts) scaled to ~target_gb."""
    from jdeep.config.small_models import TINY_CONFIG

    layers = max(2, round(3 * target_gb))
    return dict(TINY_CONFIG, vocab_size=32768, hidden_size=2048, num_hidden_layers=layers,
                layer_types=None, compress_ratios=[0, 4] + [4, 128] * layers, num_hash_layers=1,
                num_attention_heads=16, head_dim=512, qk_rope_head_dim=64, q_lora_rank=512, o_groups=4,
                o_lora_rank=512, sliding_window=128, index_n_heads=16, index_head_dim=128, index_topk=64,
                n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1024,
                quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "weight_block_size": [128, 128], "activation_scheme": "dynamic",
                                     "expert_dtype": "fp4"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-gb", type=float, default=1.0)
    ap.add_argument("--dir", default="/tmp/jdeep-rss-bench")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--json")
    args = ap.parse_args()

    from jdeep.tools.testing.random_weights import random_checkpoint

    raw = bench_config(args.target_gb)
    raw.pop("layer_types")
    raw.pop("compress_rates", None)
    if not os.path.exists(os.path.join(args.dir, "config.json")):
        t0 = time.perf_counter()
        random_checkpoint(raw, args.dir, seed=0, dtype="bfloat16", n_shards=4)
        print(f"wrote {args.dir} in {time.perf_counter() - t0:.0f} s")
    size = sum(os.path.getsize(os.path.join(args.dir, f)) for f in os.listdir(args.dir) if f.endswith(".safetensors"))
    out = subprocess.run([sys.executable, "-c", CHILD, args.dir, args.dtype], capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res.update(file_bytes=size, dtype=args.dtype,
               peak_over_file=res["peak_rss"] / size,
               peak_minus_baseline_over_file=(res["peak_rss"] - res["baseline_rss"]) / size)
    print(f"checkpoint {size / 1e9:.3f} GB; baseline RSS (python + jax + jdeep) {res['baseline_rss'] / 1e9:.3f} GB; "
          f"peak RSS {res['peak_rss'] / 1e9:.3f} GB = {res['peak_over_file']:.2f}x the file "
          f"({res['peak_minus_baseline_over_file']:.2f}x above the baseline); params on device "
          f"{res['param_bytes'] / 1e9:.3f} GB; load {res['load_seconds']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
