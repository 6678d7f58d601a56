"""One program over decode and prefill rows, or two? Times both ways of running an iteration in which `--streams`
rows decode one token and one row prefills a chunk of S tokens:

    two programs  the decode step over a window of `streams` rows ([streams, 1]) and the prefill step over one row
                  ([1, S]), as jdeep's Engine runs them
    one program   a single step over a window holding all of them ([rows, S]: each decode row is one token and S - 1
                  positions of padding), the alternative

on the bench's default model (or --model DIR), state of --max-len tokens, each median of --repeats after a warm-up.

    python scripts/mixed_step_shapes.py --chunks 64,256,1024
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

import jdeep
from jdeep.config.small_models import BENCH_DEFAULT_CONFIG
from jdeep.runtime.steps import batch_bucket, run_step
from jdeep.tools.testing.random_weights import random_checkpoint


def _time(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: the bench's random default config)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--chunks", default="64,256,1024")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model
        if folder is None:
            random_checkpoint(BENCH_DEFAULT_CONFIG, tmp, seed=0, dtype="float32")
            folder = tmp
        model = jdeep.load(folder)
    n = args.streams
    pool = batch_bucket(n + 1)
    state = model.init_state(pool, args.max_len)
    ctx = args.max_len // 2           # every row sits at this many tokens of context (positions only: a random state)
    print(f"{n} decode rows + one prefill row at position {ctx}, pool {pool} slots; median ms of {args.repeats}")
    print(f"{'S':>6} {'decode [n,1]':>13} {'prefill [1,S]':>14} {'two programs':>13} {'one [pool,S]':>13} {'one/two':>8}")
    for S in (int(c) for c in args.chunks.split(",")):
        holder = {"state": state}

        def step(toks, pos, rows, start):
            logits, holder["state"] = run_step(model, holder["state"], toks, pos, rows=rows, start=start)
            logits.block_until_ready()

        dec_t, dec_p = np.ones((n, 1), np.int32), np.full((n, 1), ctx, np.int32)
        pre_t = np.ones((1, S), np.int32)
        pre_p = np.arange(ctx, ctx + S, dtype=np.int32)[None]
        one_t = np.ones((pool, S), np.int32)
        one_p = np.full((pool, S), -1, np.int32)
        one_p[:n, 0] = ctx
        one_p[n] = pre_p[0]
        decode = _time(lambda: step(dec_t, dec_p, n, 0), args.repeats)
        prefill = _time(lambda: step(pre_t, pre_p, 1, n), args.repeats)
        one = _time(lambda: step(one_t, one_p, None, None), args.repeats)
        state = holder["state"]
        print(f"{S:>6} {decode:>13.1f} {prefill:>14.1f} {decode + prefill:>13.1f} {one:>13.1f} "
              f"{one / (decode + prefill):>8.2f}")


if __name__ == "__main__":
    main()
