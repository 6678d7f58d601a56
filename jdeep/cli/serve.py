"""`jdeep serve`: the OpenAI-compatible server, from one process or from several (multi-controller JAX).

Across processes (`--coordinator/--num-processes/--process-id` with a `--mesh` over all their devices) every process
loads its shards and builds the same engine; process 0 runs the HTTP server and the scheduler, the others replay its
engine commands step by step (serve/lockstep.py). Stop the server by signalling process 0: it stops the others."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback

import jax

from .. import __version__, load
from ..io.tokenizer import Tokenizer
from ..runtime.engine import Engine
from ..runtime.buckets import batch_ladder, chunk_ladder, prefill_ladder
from ..runtime.scheduler import floor_pow2
from ..runtime.steps import MIN_BUCKET, batch_bucket
from ..serve.lockstep import DistributedStore, Lockstep, MeshFailure, follow
from ..serve.server import ServerSettings, serve
from ..speculative.engine import make_engine
from .args import load_kwargs

__all__ = ["cmd_serve", "cmd_compile", "serving_engine", "engine_settings"]


def _check_flags(args: argparse.Namespace) -> None:
    if args.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes must be at least 1024, got {args.max_body_bytes}")
    if args.max_waiting is not None and args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < MIN_BUCKET:
        raise ValueError(f"--max-num-batched-tokens must be at least {MIN_BUCKET} (one minimum prefill chunk), got "
                         f"{args.max_num_batched_tokens}")
    if not args.request_read_timeout > 0:
        raise ValueError(f"--request-read-timeout must be a positive number of seconds, got {args.request_read_timeout}")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be a positive number of seconds, got {args.request_timeout}")
    if not os.path.isdir(args.model):
        raise FileNotFoundError(f"--model {args.model} is not a folder")
    if jax.process_count() > 1 and args.mesh is None:
        raise ValueError(f"a server of {jax.process_count()} processes needs --mesh over the devices of all of them "
                         f"({jax.device_count()} here), e.g. --mesh expert={jax.device_count()}")
    if not args.warmup_timeout > 0:
        raise ValueError(f"--warmup-timeout must be a positive number of seconds, got {args.warmup_timeout}")
    if not args.peer_timeout > 0:
        raise ValueError(f"--peer-timeout must be a positive number of seconds, got {args.peer_timeout}")


def engine_settings(engine: Engine, args: argparse.Namespace) -> dict:
    """What every process of a multi-process server must agree on before it runs a program: the jdeep version, the
    model (its config), the engine's shape and the flags that change which programs run (JSON values)."""
    model = engine.model
    config = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()
    return {"jdeep": __version__, "config": config, "engine": type(engine).__name__, "slots": engine.n_slots,
            "max_len": engine.max_len, "prefill_chunk": engine.chunk,
            "batch_buckets": list(engine.scheduler.batch_buckets), "chunk_buckets": list(engine.scheduler.chunk_buckets),
            "prefill_batch_buckets": list(engine.scheduler.prefill_buckets),
            "max_num_batched_tokens": engine.max_num_batched_tokens, "seed": engine.seed, "eos": engine.eos,
            "mesh": model.layout.describe() if model.layout is not None else None, "dtype": str(model.dtype),
            "compile_mode": model.compile_mode, "warmup": bool(args.warmup),
            "tokenizer": engine.tokenizer is not None, "speculative": args.speculative_config}


def cmd_serve(args: argparse.Namespace) -> int:
    """The OpenAI-compatible HTTP server (jdeep/serve/server.py) until SIGINT/SIGTERM; on processes other than 0 of a
    multi-process run, the engine's replay until process 0 stops (or the mesh fails: exit status 1)."""
    _check_flags(args)
    lockstep = None
    if jax.process_count() > 1:       # heartbeats from now on: a process that dies while loading is noticed
        lockstep = Lockstep(DistributedStore(), jax.process_index(), jax.process_count(), peer_timeout=args.peer_timeout)
        # until the server takes over failures (process 0's AsyncEngine), a failed mesh ends the process
        lockstep.on_failure = lambda reason: _leave(lockstep, f"jdeep serve (process {jax.process_index()}): {reason}")
        lockstep.start()
    try:
        return _serve(args, lockstep)
    except MeshFailure as e:
        _leave(lockstep, f"jdeep serve (process {jax.process_index()}): {e}")
    except (ValueError, FileNotFoundError) as e:
        if lockstep is None:
            raise
        _leave(lockstep, f"jdeep serve (process {jax.process_index()}): {e}", status=2)
    except Exception:
        if lockstep is None:
            raise
        traceback.print_exc()
        _leave(lockstep, f"jdeep serve (process {jax.process_index()}): failed (the traceback above)")
    return 1


def _compile_progress(who: str = "jdeep serve"):
    """A warm-up progress line on a terminal: programs compiled of all, and the time left at this pace."""
    def show(done: int, total: int, secs: float) -> None:
        left = secs / done * (total - done)
        end = "\n" if done == total else ""
        print(f"\r{who}: compiling programs {done}/{total}, about {left:.0f} s left ", end=end, file=sys.stderr,
              flush=True)
    return show


def _compiled(n: int, total: int, secs: float) -> None:
    print(f"jdeep serve: compiled {n} programs (every batch and prefill bucket) in {secs:.1f} s; ready", file=sys.stderr,
          flush=True)


def _warmup_report():
    """on_compiled for a warm-up on the server's engine thread: the progress line on a terminal, then one line
    when it is done."""
    bar = _compile_progress() if sys.stderr.isatty() else None

    def report(done: int, total: int, secs: float, finished: bool) -> None:
        if finished:
            _compiled(done, total, secs)
        elif bar is not None:
            bar(done, total, secs)
    return report


def _check_ladders(args: argparse.Namespace) -> None:
    """The declared bucket ladders checked against the slots and the longest chunk before the model loads (a large
    checkpoint takes minutes to load; a flag error should not wait for it). ValueError naming the bucket."""
    if args.max_num_seqs < 1 or args.prefill_chunk < 1:
        return                      # (the Engine names these)
    batch = batch_ladder(batch_bucket(args.max_num_seqs), args.batch_buckets)
    prefill_ladder(batch, args.prefill_batch_buckets)
    chunk_ladder(max(MIN_BUCKET, floor_pow2(args.prefill_chunk)), args.chunk_buckets)


def serving_engine(args: argparse.Namespace) -> Engine:
    """The engine `jdeep serve` (and `jdeep compile`) builds from its flags: the model loaded, its tokenizer."""
    _check_ladders(args)
    model = load(args.model, **load_kwargs(args, progress=True, mtp=args.speculative_config is not None))
    tokenizer = Tokenizer(args.tokenizer) if getattr(args, "tokenizer", None) else model.tokenizer
    return make_engine(model, args.speculative_config, max_num_seqs=args.max_num_seqs, max_len=args.max_len,
                       prefill_chunk=args.prefill_chunk, seed=getattr(args, "seed", 0), tokenizer=tokenizer,
                       max_num_batched_tokens=args.max_num_batched_tokens, prefix_cache_bytes=args.prefix_cache_bytes,
                       batch_buckets=args.batch_buckets, chunk_buckets=args.chunk_buckets,
                       prefill_batch_buckets=args.prefill_batch_buckets)


def cmd_compile(args: argparse.Namespace) -> int:
    """`jdeep compile`: the engine `jdeep serve` with the same flags builds, every program of its inventory compiled
    (the first-use variants too) and run once, so the persistent compilation cache holds them; then exit. A later
    `jdeep serve` with these flags reads them back instead of compiling."""
    if not os.path.isdir(args.model):
        raise FileNotFoundError(f"--model {args.model} is not a folder")
    if args.no_compile_cache or os.environ.get("JDEEP_NO_COMPILE_CACHE"):
        raise ValueError("jdeep compile fills the persistent compilation cache: drop --no-compile-cache "
                         "($JDEEP_NO_COMPILE_CACHE)")
    engine = serving_engine(args)
    t0 = time.perf_counter()
    n = engine.warmup(first_use=True, progress=_compile_progress("jdeep compile") if sys.stderr.isatty() else None)
    print(f"jdeep compile: {n} programs compiled in {time.perf_counter() - t0:.1f} s into "
          f"{jax.config.jax_compilation_cache_dir} ({engine.n_slots} slots, max_len {engine.max_len}, batch buckets "
          f"{list(engine.scheduler.batch_buckets)} (prefill {list(engine.scheduler.prefill_buckets)}), chunk buckets "
          f"{list(engine.scheduler.chunk_buckets)})")
    return 0


def _serve(args: argparse.Namespace, lockstep: Lockstep | None) -> int:
    engine = serving_engine(args)
    tokenizer = engine.tokenizer
    if lockstep is not None:
        lockstep.handshake(engine_settings(engine, args))
    if args.warmup and lockstep is not None:     # every process compiles, then they meet, then the first collective
        t0 = time.perf_counter()
        n = engine.warmup(progress=_compile_progress() if sys.stderr.isatty() else None,
                          before_run=lambda: lockstep.meet("warmup", args.warmup_timeout))
        _compiled(n, n, time.perf_counter() - t0)
    if lockstep is not None and not lockstep.leader:
        follow(engine, lockstep)
        lockstep.close()
        return 0
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    created = int(os.path.getmtime(os.path.join(args.model, "config.json")))
    procs = f", {lockstep.n_processes} processes" if lockstep is not None else ""
    print(f"jdeep serve: {name} on http://{args.host}:{args.port}/v1 ({engine.n_slots} slots, max_len {args.max_len}, "
          f"{engine.max_num_batched_tokens} tokens per iteration{procs}"
          f"{', API key required' if args.api_key else ''}{'' if tokenizer else ', no tokenizer: token-id prompts only'})",
          file=sys.stderr, flush=True)
    settings = ServerSettings(name, args.api_key, args.max_body_bytes, created, max_waiting=args.max_waiting,
                              request_timeout=args.request_timeout, chat_format=args.chat_format,
                              read_timeout=args.request_read_timeout,
                              warmup=bool(args.warmup) and lockstep is None, on_compiled=_warmup_report())
    serve(engine, settings, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout,
          log_level=args.log_level, lockstep=lockstep)
    if lockstep is not None and lockstep.failure is not None:    # (a signal ends the process before this line)
        _leave(lockstep, f"jdeep serve: stopped after the mesh failed: {lockstep.failure}")
    return 0


def _leave(lockstep: Lockstep | None, message: str, status: int = 1) -> None:
    """End a multi-process server's process now: jax.distributed's exit handler would wait for a lost process (and
    an engine thread may be blocked in a collective that never completes)."""
    print(message, file=sys.stderr, flush=True)
    if lockstep is None:
        raise SystemExit(status)
    lockstep.stop()
    sys.stdout.flush()
    os._exit(status)
