"""How long jdeep takes to start, with a cold and a warm persistent compilation cache (issue: start in seconds).

    python scripts/bench_startup.py [--model DIR] [--serve-args "..."] [--only warmup,serve,demo]

For each part a fresh temporary cache directory is used for the cold run and kept for the warm one:
- warmup: in a subprocess, the Engine `jdeep serve` builds (its flags, default 8 slots, max-len 4096) and its
  warm-up, with where the time goes (JAX's own monitoring events: tracing, lowering to MLIR, XLA compiles, cache
  hits and misses) and the inventory's count;
- serve: `jdeep serve` in a subprocess, wall clock from launch until /health answers 200;
- demo: `jdeep demo` (the shipped model), the time each prompt's completion reports.
Numbers go to docs/performance.md; nothing here is a test (timings vary with the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "jdeep", "demo_model")

WARMUP_CHILD = r"""
import json, sys, time, collections
import jax
from jdeep.cli import build_parser
from jdeep.cli.args import setup_compile_cache
args = build_parser().parse_args(["serve", "--model", sys.argv[1], *sys.argv[2:]])
setup_compile_cache(args)
secs, counts = collections.Counter(), collections.Counter()
def on_duration(event, duration, **kw):
    secs[event.rsplit("/", 1)[-1]] += duration
    counts[event.rsplit("/", 1)[-1]] += 1
def on_event(event, **kw):
    counts[event.rsplit("/", 1)[-1]] += 1
jax.monitoring.register_event_duration_secs_listener(on_duration)
jax.monitoring.register_event_listener(on_event)
from jdeep.cli.serve import make_engine
from jdeep.cli.args import load_kwargs
from jdeep import load
t0 = time.perf_counter()
model = load(args.model, **load_kwargs(args))
eng = make_engine(model, args.speculative_config, max_num_seqs=args.max_num_seqs, max_len=args.max_len,
                  prefill_chunk=args.prefill_chunk, max_num_batched_tokens=args.max_num_batched_tokens,
                  prefix_cache_bytes=args.prefix_cache_bytes, batch_buckets=args.batch_buckets,
                  chunk_buckets=args.chunk_buckets, prefill_batch_buckets=args.prefill_batch_buckets)
t1 = time.perf_counter()
secs.clear(); counts.clear()
n = eng.warmup()
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "warmup_s": t2 - t1, "programs": n,
                  "trace_s": secs["jaxpr_trace_duration"], "lower_s": secs["jaxpr_to_mlir_module_duration"],
                  "compile_s": secs["backend_compile_duration"], "compiles": counts["backend_compile_duration"],
                  "cache_hits": counts["cache_hits"], "cache_misses": counts["cache_misses"],
                  "cache_read_s": secs["cache_retrieval_time_sec"]}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cache: str) -> dict:
    return dict(os.environ, JDEEP_COMPILE_CACHE=cache)


def bench_warmup(model: str, serve_args: list[str], cache: str) -> dict:
    out = subprocess.run([sys.executable, "-c", WARMUP_CHILD, model, *serve_args], env=_env(cache),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_serve(model: str, serve_args: list[str], cache: str, timeout: float = 1200) -> dict:
    port = _free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "jdeep.cli", "serve", "--model", model, "--port", str(port),
                             *serve_args], env=_env(cache), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"jdeep serve exited: {proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return {"healthy_s": time.perf_counter() - t0}
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError("jdeep serve did not become healthy in time")
    finally:
        proc.terminate()
        proc.wait(30)


def bench_demo(cache: str) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "jdeep.cli", "demo"], env=_env(cache), capture_output=True,
                         text=True, check=True).stdout
    total = time.perf_counter() - t0
    prompts = [float(s) for s in re.findall(r"tokens in ([0-9.]+) s", out)]
    return {"total_s": total, "per_prompt_s": prompts}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEMO)
    p.add_argument("--serve-args", default="", help="extra `jdeep serve` flags, e.g. \"--max-num-seqs 4\"")
    p.add_argument("--only", default="warmup,serve,demo")
    args = p.parse_args()
    serve_args = shlex.split(args.serve_args)
    parts = args.only.split(",")
    results = {}
    for part in ("warmup", "serve", "demo"):
        if part not in parts:
            continue
        with tempfile.TemporaryDirectory() as cache:
            for temp in ("cold", "warm"):
                if part == "warmup":
                    r = bench_warmup(args.model, serve_args, cache)
                elif part == "serve":
                    r = bench_serve(args.model, serve_args, cache)
                else:
                    r = bench_demo(cache)
                results[f"{part}.{temp}"] = r
                print(f"{part:7s} {temp} cache: " + ", ".join(
                    f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()), flush=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
