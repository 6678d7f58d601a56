"""Time to first token of prompts sharing a long system prompt, with and without the prefix cache.

    python scripts/bench_prefix_cache.py                       # jdeep bench's default model (seeded random weights)
    python scripts/bench_prefix_cache.py --model DIR --shared 4096 --suffix 32 --requests 4

Each request is [BOS] + the shared system-prompt tokens + its own user suffix, sent one at a time to an Engine
that is warmed up first (no compile time in any TTFT). Without the cache every request prefills everything;
with it the first one (a miss) does, taking snapshots on the way (runtime/prefix_cache.py: at 128 x 2^k tokens and
its last block boundary), and the later ones start from the longest snapshot that is a prefix of their prompt and
prefill only the rest. A shared prompt of another length (e.g. --shared 3000 --suffix 200) shows the branch point:
the second request hits 2048 and leaves a snapshot at the longest block boundary it shares with the first (2944),
which the third one starts from. Prints TTFT and the tokens served from snapshots per request, and the ratio of
the hits' median TTFT to the miss's (the target: at most 1/4).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

import jdeep
from jdeep.config.small_models import BENCH_DEFAULT_CONFIG
from jdeep.runtime.engine import Engine
from jdeep.runtime.sampling import SamplingParams
from jdeep.tools.testing.random_weights import random_checkpoint


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """(seconds from add_request to the request's first token, prompt tokens served from a snapshot)."""
    before = engine.prefix_cache_stats
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=2))
    out = engine.outputs[rid]
    while not out.tokens:
        engine.step()
    dt = time.perf_counter() - t0
    engine.run()
    engine.release(rid)
    after = engine.prefix_cache_stats
    return dt, (after.hit_tokens - before.hit_tokens if after is not None else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: jdeep bench's default config, random weights)")
    ap.add_argument("--shared", type=int, default=4096, help="shared system-prompt tokens")
    ap.add_argument("--suffix", type=int, default=32, help="each request's own tokens after it")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--cache-bytes", type=int, default=4 << 30)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model
        if folder is None:
            random_checkpoint(BENCH_DEFAULT_CONFIG, tmp, seed=0, dtype=args.dtype)
            folder = tmp
        model = jdeep.load(folder, dtype=args.dtype)
        rng = np.random.default_rng(0)
        V = model.config.vocab_size
        shared = [0] + rng.integers(2, V, args.shared).tolist()
        prompts = [shared + rng.integers(2, V, args.suffix).tolist() for _ in range(args.requests)]
        max_len = len(prompts[0]) + 16
        results = {}
        for label, budget in (("without cache", 0), ("with cache", args.cache_bytes)):
            engine = Engine(model, max_num_seqs=1, max_len=max_len, prefill_chunk=args.prefill_chunk,
                            prefix_cache_bytes=budget)
            t0 = time.perf_counter()
            n = engine.warmup()
            print(f"{label:>14}: warmup {n} programs {time.perf_counter() - t0:.1f} s", flush=True)
            runs = [ttft(engine, p) for p in prompts]
            results[label] = [t for t, _ in runs]
            extra = ""
            st = engine.prefix_cache_stats
            if st is not None:
                extra = f"  (hits {st.hits}, misses {st.misses}, {st.entries} snapshots, {st.bytes / 2 ** 20:.1f} MiB)"
            print(f"{label:>14}: TTFT " + ", ".join(f"{t * 1e3:.0f} ms ({h} cached)" for t, h in runs) + extra,
                  flush=True)
        cold = statistics.median(results["without cache"])
        miss, hit = results["with cache"][0], statistics.median(results["with cache"][1:])
        print(f"prompt {len(prompts[0])} tokens ({args.shared} shared): median TTFT uncached {cold * 1e3:.0f} ms; "
              f"with the cache: miss {miss * 1e3:.0f} ms, median hit {hit * 1e3:.0f} ms = {hit / miss:.3f} of the "
              f"miss ({miss / hit:.1f}x faster; target <= 0.25)")


if __name__ == "__main__":
    main()
