"""Load-test the OpenAI-compatible server: N concurrent streaming completions (random prompt lengths and
max_tokens, some sampled, some clients disconnecting early), then p50/p99 of time to first token,
inter-token latency and end-to-end latency, and the engine's slots afterwards.

    python scripts/serve_load.py --model ../shared/golden/v4-tiny-hf -n 64 --max-num-seqs 16
    python scripts/serve_load.py --url http://127.0.0.1:8000/v1 --served-model-name NAME -n 64

With --model the server runs in this process (warmed up first, as `jdeep serve` does); with --url it is a
running `jdeep serve`. Needs the `openai` package (pip install 'jdeep[test]').
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jdeep.tools.perf.loadgen import make_requests, run_load, summarize  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint folder: serve it in this process")
    src.add_argument("--url", help="base URL of a running server (…/v1)")
    p.add_argument("--served-model-name", default="model")
    p.add_argument("--api-key", default="none")
    p.add_argument("-n", "--num-requests", type=int, default=64)
    p.add_argument("--disconnect", type=int, default=2, help="clients that close their stream after 2 chunks")
    p.add_argument("--max-prompt", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=16)
    p.add_argument("--vocab-size", type=int, help="with --url: prompt ids drawn below this (default 512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args()

    if args.url:
        reqs = make_requests(args.num_requests, args.vocab_size or 512, args.seed, max_prompt=args.max_prompt,
                             max_tokens=args.max_tokens, n_disconnect=args.disconnect)
        t0 = time.perf_counter()
        results = asyncio.run(run_load(args.url, args.served_model_name, reqs, args.api_key))
        stats = summarize(results, time.perf_counter() - t0)
    else:
        import jdeep
        from jdeep.runtime.engine import Engine
        from jdeep.serve.server import ServerSettings, background_server

        model = jdeep.load(args.model)
        engine = Engine(model, max_num_seqs=args.max_num_seqs, max_len=args.max_len, prefill_chunk=args.prefill_chunk)
        t0 = time.perf_counter()
        n = engine.warmup()
        print(f"warmup: {n} programs in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        reqs = make_requests(args.num_requests, model.config.vocab_size, args.seed, max_prompt=args.max_prompt,
                             max_tokens=args.max_tokens, n_disconnect=args.disconnect)
        # a latency test: every request waits for a slot rather than getting 429 (jdeep serve's --max-waiting)
        settings = ServerSettings(args.served_model_name, max_waiting=args.num_requests)
        with background_server(engine, settings) as (url, _):
            t0 = time.perf_counter()
            results = asyncio.run(run_load(url, args.served_model_name, reqs))
            stats = summarize(results, time.perf_counter() - t0)
            t0 = time.time()
            while (engine.n_running or engine.n_waiting) and time.time() - t0 < 10:
                time.sleep(0.01)
            stats["slots_in_use_after"] = engine.n_running
            stats["engine_steps_per_bucket"] = {str(k): v for k, v in sorted(engine.steps_per_bucket.items())}
    print(json.dumps(stats, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(stats, f, indent=2)
    return 0 if stats["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
