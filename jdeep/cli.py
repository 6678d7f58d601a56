"""The `jdeep` command line: demo, generate, chat, serve, bench, info, convert, check-graph, export. Commands that compile keep a persistent JAX
compilation cache (--compile-cache DIR, $JDEEP_COMPILE_CACHE; --no-compile-cache or $JDEEP_NO_COMPILE_CACHE
to disable)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time


def _parse_ids(text: str) -> list[int]:
    return _parse_ints(text, "--prompt-ids")


def cmd_demo(args: argparse.Namespace) -> int:
    import jdeep
    from .tools.random_weights import TINY_CONFIG, random_checkpoint, tiny_v41_config

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        random_checkpoint(TINY_CONFIG if args.arch == "v4" else tiny_v41_config(), tmp, seed=args.seed)
        model = jdeep.load(tmp, dtype=args.dtype, compile_mode=args.compile_mode, host_embedding=args.host_embedding,
                           mesh=args.mesh)
        name = "DeepSeek-V4" if args.arch == "v4" else "DeepSeek-V4.1 (fp8/fp4, Engram)"
        print(f"built and loaded a seeded random tiny {name} ({model.config.n_layers} layers, "
              f"{len(model.plan.segments)} scan segments) in {time.perf_counter() - t0:.1f} s")
        prompts = [[0, 17, 42, 99], [0, 5, 9, 230, 77, 301, 12, 8, 401, 66]]
        t0 = time.perf_counter()
        out = jdeep.generate(model, prompts, max_new_tokens=args.max_new_tokens)
        t1 = time.perf_counter()
        out = jdeep.generate(model, prompts, max_new_tokens=args.max_new_tokens)
        t2 = time.perf_counter()
        for p, toks in zip(prompts, out.tokens):
            print(f"prompt {p} -> {toks.tolist()}")
        n = out.tokens.size
        print(f"first call (with compilation) {t1 - t0:.1f} s; second call {t2 - t1:.3f} s "
              f"= {n / (t2 - t1):.0f} tokens/s for batch {len(prompts)}")
    return 0


def _sampling_from(args: argparse.Namespace, line: dict | None = None, index: int = 0):
    """Command-line sampling values, overridden by a prompts-file line's own (line i seeded seed + i)."""
    from .serve import SamplingParams

    line = line or {}
    return SamplingParams(
        temperature=line.get("temperature", args.temperature), top_k=line.get("top_k", args.top_k),
        top_p=line.get("top_p", args.top_p), min_p=line.get("min_p", args.min_p),
        seed=line.get("seed", args.seed + index),
        max_new_tokens=line.get("max_new_tokens", args.max_new_tokens),
        stop_token_ids=tuple(line.get("stop_token_ids", ())))


def _tokenizer(folder: str):
    from .serve import Tokenizer

    try:
        return Tokenizer(folder)
    except FileNotFoundError:
        return None


def cmd_generate(args: argparse.Namespace) -> int:
    import jdeep

    given = [a for a in (args.prompt_ids, args.prompt, args.prompts_file) if a is not None]
    if len(given) != 1:
        raise SystemExit("jdeep generate: give exactly one of --prompt-ids, --prompt or --prompts-file")
    model = jdeep.load(args.model, dtype=args.dtype, quantize_activations=args.quantize_activations,
                       fp8_max=args.fp8_max, packed_kv=args.packed_kv, progress=True,
                       compile_mode=args.compile_mode, host_embedding=args.host_embedding, mesh=args.mesh)
    tok = _tokenizer(args.model)
    if args.prompts_file is not None:
        return _generate_file(args, model, tok)
    if args.prompt is not None:
        if tok is None:
            raise SystemExit(f"jdeep generate: --prompt needs {args.model}/tokenizer.json (or use --prompt-ids)")
        ids = tok.encode(args.prompt)
    else:
        ids = _parse_ids(args.prompt_ids)
    try:
        out = jdeep.generate(model, [ids], sampling=_sampling_from(args), ignore_eos=args.ignore_eos)
    except ValueError as e:
        raise SystemExit(f"jdeep generate: {e}") from None
    tokens = out.tokens[0, :out.lengths[0]].tolist()
    result = {"tokens": tokens}
    if tok is not None:
        result["text"] = tok.decode(tokens)
    print(json.dumps(result, ensure_ascii=False))
    return 0


def _generate_file(args: argparse.Namespace, model, tok) -> int:
    """Offline batch: one JSON object per line ({"prompt_ids": [...]} or {"prompt": "..."}, optional "id" and
    sampling fields), through the continuous-batching engine; one JSON line per request out, in input order."""
    from .runtime.engine import Engine

    with open(args.prompts_file, encoding="utf-8") as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    eng = Engine(model, max_num_seqs=args.max_num_seqs, max_len=args.max_len, ignore_eos=args.ignore_eos)
    order = []
    for n, ln in enumerate(lines):
        rid = f"line-{n}"
        try:
            item = json.loads(ln)
            if not isinstance(item, dict):
                raise ValueError("each line must be a JSON object")
            rid = str(item.get("id", rid))
            if "prompt_ids" in item:
                ids = item["prompt_ids"]
            elif "prompt" in item:
                if tok is None:
                    raise ValueError("text prompts need the checkpoint's tokenizer.json")
                ids = tok.encode(item["prompt"])
            else:
                raise ValueError('a line needs "prompt_ids" or "prompt"')
            order.append(eng.add_request(ids, _sampling_from(args, item, n), request_id=rid))
        except (ValueError, TypeError) as e:   # a bad line fails alone
            order.append(eng.add_request([], None, request_id=rid))
            eng.outputs[rid].error = f"line {n + 1}: {e}"
    outs = eng.run()
    sink = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    try:
        for rid in order:
            o = outs[rid]
            rec = {"id": rid, "tokens": o.tokens, "finish_reason": o.finish_reason}
            if o.error:
                rec["error"] = o.error
            if tok is not None and not o.error:
                rec["text"] = tok.decode(o.tokens)
            sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
    finally:
        if sink is not sys.stdout:
            sink.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat on stdin/stdout: each reply streams as it is generated (whole UTF-8 characters)."""
    import jdeep

    tok = _tokenizer(args.model)
    if tok is None:
        raise SystemExit(f"jdeep chat: {args.model} has no tokenizer.json")
    model = jdeep.load(args.model, dtype=args.dtype, progress=True, compile_mode=args.compile_mode,
                       host_embedding=args.host_embedding, mesh=args.mesh)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        detok = tok.detokenizer()

        def show(new: list[list[int]]) -> None:
            print(detok.push(new[0]), end="", flush=True)

        out = jdeep.generate(model, [tok.chat(messages, thinking=args.thinking)], sampling=_sampling_from(args),
                             stream=show, stream_every=4)
        print(detok.flush(), flush=True)
        reply = out.tokens[0, :out.lengths[0]].tolist()
        messages.append({"role": "assistant", "content": tok.decode(reply)})


def cmd_serve(args: argparse.Namespace) -> int:
    """The OpenAI-compatible HTTP server (jdeep/serve/server.py) until SIGINT/SIGTERM."""
    import jdeep
    from .runtime.engine import Engine
    from .serve.server import ServerSettings, serve
    from .io.tokenizer import Tokenizer

    if args.num_processes not in (None, 1):
        raise ValueError("jdeep serve runs in one process (use --mesh over its local devices); multi-process "
                         "serving is not supported yet")
    if args.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes must be at least 1024, got {args.max_body_bytes}")
    if not os.path.isdir(args.model):
        raise FileNotFoundError(f"--model {args.model} is not a folder")
    model = jdeep.load(args.model, dtype=args.dtype, quantize_activations=args.quantize_activations,
                       fp8_max=args.fp8_max, packed_kv=args.packed_kv, progress=True,
                       compile_mode=args.compile_mode, host_embedding=args.host_embedding, mesh=args.mesh)
    tokenizer = Tokenizer(args.tokenizer) if args.tokenizer else model.tokenizer
    engine = Engine(model, max_num_seqs=args.max_num_seqs, max_len=args.max_len, prefill_chunk=args.prefill_chunk,
                    seed=args.seed, tokenizer=tokenizer)
    if args.warmup:
        t0 = time.perf_counter()
        n = engine.warmup()
        print(f"jdeep serve: compiled {n} programs (every batch and prefill bucket) in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    created = int(os.path.getmtime(os.path.join(args.model, "config.json")))
    print(f"jdeep serve: {name} on http://{args.host}:{args.port}/v1 ({engine.n_slots} slots, max_len {args.max_len}"
          f"{', API key required' if args.api_key else ''}{'' if tokenizer else ', no tokenizer: token-id prompts only'})",
          file=sys.stderr, flush=True)
    serve(engine, ServerSettings(name, args.api_key, args.max_body_bytes, created), host=args.host, port=args.port,
          shutdown_timeout=args.shutdown_timeout, log_level=args.log_level)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import jdeep
    from .tools.random_weights import random_checkpoint
    from .tools.bench import format_report, run_bench

    if args.compare:
        from .tools.compare import require_transformers

        try:
            require_transformers()
        except ImportError as e:
            raise SystemExit(f"jdeep bench: {e}") from None
    try:
        sizes = [int(b) for b in args.batch_size.split(",") if b]
    except ValueError:
        raise SystemExit(f"jdeep bench: --batch-size must be comma-separated integers, got {args.batch_size!r}") from None
    if args.dtype is None:
        import jax

        args.dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model
        if folder is None:
            raw = BENCH_DEFAULT_CONFIG
            if args.random_weights:
                with open(args.random_weights, encoding="utf-8") as f:
                    raw = json.load(f)
            random_checkpoint(raw, tmp, seed=args.seed, dtype=args.dtype)
            folder = tmp
        if args.compare:
            from .config import ModelConfig
            from .tools.compare import hf_config

            hf_config(ModelConfig.from_file(folder))     # an incomparable checkpoint fails before loading
        model = jdeep.load(folder, dtype=args.dtype, progress=True, compile_mode=args.compile_mode,
                           host_embedding=args.host_embedding, mesh=args.mesh)
        prompts = None
        if args.prompts_file:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts = [json.loads(ln)["prompt_ids"] for ln in f if ln.strip()]
        result = run_bench(model, args.input_len, args.output_len, sizes, seed=args.seed, prompts=prompts,
                           compare_transformers=folder if args.compare else None)
    print(format_report(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise SystemExit("jdeep bench: --plot needs matplotlib (pip install matplotlib)") from None
        runs = result["runs"]
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
        bs = [r["batch_size"] for r in runs]
        ax[0].plot(bs, [r["decode_tok_s"] for r in runs], "o-", label="aggregate")
        ax[0].plot(bs, [r["decode_tok_s_per_seq"] for r in runs], "s--", label="per sequence")
        ax[0].set(xlabel="batch size", ylabel="decode tokens/s", xscale="log")
        ax[0].legend()
        ax[1].plot(bs, [r["roofline_fraction"] for r in runs], "o-")
        ax[1].set(xlabel="batch size", ylabel="fraction of measured bandwidth", xscale="log")
        fig.tight_layout()
        fig.savefig(args.plot)
    return 0


# `jdeep bench` with no model: a small DeepSeek-V4 (every layer kind) with seeded random weights
BENCH_DEFAULT_CONFIG = {
    "model_type": "deepseek_v4", "vocab_size": 32768, "hidden_size": 1024, "num_hidden_layers": 8,
    "num_attention_heads": 8, "head_dim": 256, "qk_rope_head_dim": 64, "q_lora_rank": 256, "o_groups": 4,
    "o_lora_rank": 256, "n_routed_experts": 32, "num_experts_per_tok": 4, "n_shared_experts": 1,
    "moe_intermediate_size": 512, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_hash_layers": 2,
    "compress_ratios": [0, 4, 128, 4, 128, 4, 128, 0], "sliding_window": 128, "index_n_heads": 16,
    "index_head_dim": 64, "index_topk": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "rope_scaling": {"type": "yarn", "factor": 16.0,
                                                       "original_max_position_embeddings": 4096,
                                                       "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 65536, "bos_token_id": 0, "eos_token_id": 1,
}


def cmd_info(args: argparse.Namespace) -> int:
    import numpy as np

    from .config import ModelConfig, preset
    from .tools.info import summary

    planning = [f for f, v in (("--batch", args.batch), ("--max-len", args.max_len), ("--packed-kv", args.packed_kv))
                if v not in (None, False)]
    if args.mesh is None and planning:
        raise ValueError(f"{', '.join(planning)} only apply with --mesh (they size the decode state per device): "
                         "add --mesh (--mesh data=1 for a single device)")
    for flag, v in (("--batch", args.batch), ("--max-len", args.max_len)):
        if v is not None and v < 1:
            raise ValueError(f"{flag} must be a positive integer, got {v}")
    if args.mesh is not None:
        from .sharding import parse_mesh

        mesh = parse_mesh(args.mesh)   # a bad mesh fails before any work
    config = preset(args.preset) if args.preset else ModelConfig.from_file(args.model)
    import ml_dtypes

    dtype = np.float32 if args.dtype == "float32" else ml_dtypes.bfloat16
    print(summary(config, dtype))
    if args.mesh is not None:
        from .tools.info import device_plan, mesh_summary

        print()
        print(mesh_summary(device_plan(config, mesh, dtype, batch=args.batch or 1, max_len=args.max_len or 8192,
                                       packed_kv=args.packed_kv)))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    import jdeep
    from .io.checkpoint import save_converted
    from .config import ModelConfig

    if ModelConfig.from_file(args.model).engram is not None:
        raise SystemExit("jdeep convert: models with Engram layers (DeepSeek-V4.1) cannot be converted yet; "
                         "their tables stay memory-mapped in the original safetensors — use the original folder")
    model = jdeep.load(args.model, dtype=args.dtype)
    save_converted(args.out, model.config, model.params, args.dtype)
    for name in ("tokenizer.json", "tokenizer_config.json"):   # text prompts keep working on the converted folder
        if os.path.isfile(os.path.join(args.model, name)):
            shutil.copy(os.path.join(args.model, name), os.path.join(args.out, name))
    print(f"wrote {args.out}")
    return 0


def _graph_target(args: argparse.Namespace):
    """A graphs.Target from a checkpoint folder's config.json alone (no weights are read)."""
    import ml_dtypes
    import numpy as np

    from .config import ModelConfig, preset
    from .tools.programs import Target
    from .numerics import Numerics
    from .plan import build_plan

    config = preset(args.preset) if args.preset else ModelConfig.from_file(args.model)
    numerics = Numerics.for_config(config, args.quantize_activations, args.fp8_max, args.packed_kv)
    dtype = np.float32 if args.dtype == "float32" else ml_dtypes.bfloat16
    return Target(config, build_plan(config), numerics, dtype, args.mode, args.host_embedding,
                  packed_params=args.mode == "scan" and not args.no_pack_params)


def _batch_sizes(text: str) -> list[int]:
    sizes = _parse_ints(text, "--batch-sizes")
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"jdeep: --batch-sizes must be positive integers, got {text!r}")
    return sizes


def _parse_ints(text: str, flag: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise SystemExit(f"jdeep: {flag} must be comma-separated integers, got {text!r}") from None


def cmd_check_graph(args: argparse.Namespace) -> int:
    from .tools.graphcheck import Limits, check_lowered
    from .tools.programs import model_programs

    target = _graph_target(args)
    limits = Limits(max_args=args.max_args)
    failed = 0
    programs = model_programs(target, _batch_sizes(args.batch_sizes), args.prefill_len, args.max_len)
    for prog in programs:
        report = check_lowered(prog.lower(), name=prog.name, n_experts=target.config.n_routed_experts,
                               decode=prog.bucket["step"] == "decode", limits=limits)
        failed += not report.ok
        if args.verbose or not report.ok:
            print(report.format())
        else:
            print(f"ok    {prog.name}  ({report.stats.get('n_args')} args, {report.stats.get('n_ops')} ops)")
    print(f"{len(programs) - failed}/{len(programs)} programs pass the compile-safety rules "
          f"({args.mode} mode, {args.dtype}, fp8 max {args.fp8_max:g})")
    return 1 if failed else 0


def cmd_export(args: argparse.Namespace) -> int:
    from .tools.export import export_programs, model_info
    from .tools.programs import model_programs

    target = _graph_target(args)
    programs = model_programs(target, _batch_sizes(args.batch_sizes), args.prefill_len, args.max_len)
    manifest = export_programs(programs, args.out, model_info(target))
    print(f"wrote {len(manifest['programs'])} programs and manifest.json to {args.out}")
    return 0


def _graph_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint folder (only config.json is read)")
    src.add_argument("--preset", choices=["v4-flash", "v4-pro", "v41-flash"], help="a released model's config")
    p.add_argument("--mode", choices=["scan", "regions"], default="regions", help="compile mode (default regions, "
                                                                                 "Neuron's)")
    p.add_argument("--batch-sizes", default="1,2,4,8", help="batch-size buckets")
    p.add_argument("--prefill-len", type=int, default=128, help="prefill chunk length")
    p.add_argument("--max-len", type=int, default=1024, help="state length (tokens per sequence)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--quantize-activations", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--fp8-max", type=float, default=240.0, help="fp8 range (default 240, trn2's e4m3)")
    p.add_argument("--packed-kv", action="store_true")
    p.add_argument("--host-embedding", action="store_true", help="token embedding gathered on the host")
    p.add_argument("--no-pack-params", action="store_true", help="scan mode: one argument per parameter tensor "
                                                                  "(default: arenas, as jdeep runs on Neuron)")


def _runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile-mode", choices=["scan", "regions"],
                   help="scan: one program per step; regions: a host loop over layers, one program per layer kind's "
                        "half (default $JDEEP_COMPILE_MODE, else regions on Neuron and scan elsewhere)")
    p.add_argument("--host-embedding", action="store_true", help="keep the token embedding table in host memory")
    p.add_argument("--mesh", help="shard the model over a device mesh, e.g. 'data=2,expert=4' or "
                                  "'tensor=2,expert=4' (axes data, tensor, expert; the sizes multiply to the device "
                                  "count of all processes)")
    p.add_argument("--coordinator", default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
                   help="HOST:PORT of process 0 for a multi-process run (jax.distributed; default "
                        "$JAX_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=int, default=_env_int("JAX_NUM_PROCESSES"),
                   help="processes in a multi-process run (default $JAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=_env_int("JAX_PROCESS_ID"),
                   help="this process's index, 0 .. num-processes-1 (default $JAX_PROCESS_ID)")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def _init_distributed(args: argparse.Namespace) -> None:
    """jax.distributed.initialize for --coordinator/--num-processes/--process-id (before any device is touched).
    CPU processes use JAX's CPU collectives (gloo). Processes other than 0 print nothing on stdout."""
    given = [getattr(args, k, None) for k in ("coordinator", "num_processes", "process_id")]
    if all(v is None for v in given):
        return
    coordinator, n, pid = given
    if None in given:
        raise ValueError("a multi-process run needs --coordinator HOST:PORT, --num-processes N and --process-id I "
                         "(or $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID)")
    if n < 1 or not 0 <= pid < n:
        raise ValueError(f"--process-id must be in [0, {n}) and --num-processes positive, got {pid} of {n}")
    if ":" not in coordinator:
        raise ValueError(f"--coordinator must be HOST:PORT, got {coordinator!r}")
    import jax

    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):   # JAX < 0.5 had no CPU default
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=n, process_id=pid)
    # Results go to Python's stdout on process 0 only; native libraries (gloo's connection messages) that
    # write to file descriptor 1 are sent to stderr, so stdout stays machine-readable.
    sys.stdout.flush()
    sys.stdout = os.fdopen(os.dup(1), "w") if pid == 0 else open(os.devnull, "w")
    os.dup2(2, 1)


def _cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile-cache", help="persistent compilation cache directory (default ~/.cache/jdeep/jax, "
                                           "or $JDEEP_COMPILE_CACHE)")
    p.add_argument("--no-compile-cache", action="store_true", help="do not keep compiled programs across runs")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jdeep", description="DeepSeek-V4 inference in JAX")
    sub = p.add_subparsers(dest="command", required=True)
    dtype = dict(choices=["float32", "bfloat16"], default="float32")

    d = sub.add_parser("demo", help="generate with a built-in seeded random tiny model (no download)")
    d.add_argument("--max-new-tokens", type=int, default=16)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--dtype", **dtype)
    d.add_argument("--arch", choices=["v4", "v41"], default="v4", help="the tiny model's architecture")
    _runtime_args(d)
    _cache_args(d)
    d.set_defaults(fn=cmd_demo)

    g = sub.add_parser("generate", help="continue one prompt, or a file of prompts through the batching engine")
    g.add_argument("--model", required=True, help="checkpoint folder (config.json + safetensors)")
    g.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--prompt", help="text (needs the checkpoint's tokenizer.json)")
    g.add_argument("--prompts-file", help="JSONL: {\"prompt_ids\": [...]} or {\"prompt\": \"...\"} per line, optional "
                                          "\"id\" and sampling fields; JSONL results in input order")
    g.add_argument("--output", help="where --prompts-file results go (default: stdout)")
    g.add_argument("--max-num-seqs", type=int, default=8, help="engine slots for --prompts-file")
    g.add_argument("--max-len", type=int, default=2048, help="longest prompt + output for --prompts-file")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS token")
    g.add_argument("--dtype", **dtype)
    g.add_argument("--quantize-activations", action=argparse.BooleanOptionalAction, default=None,
                   help="DeepSeek's numerics for quantized checkpoints (default: on for fp8/fp4 checkpoints)")
    g.add_argument("--fp8-max", type=float, help="448 (e4m3fn) or 240/224 for Trainium2's e4m3 (default: the "
                                                 "platform's, 240 on trn1/trn2, else 448)")
    g.add_argument("--packed-kv", action="store_true", help="keep the KV cache as uint8 fp8 records")
    _runtime_args(g)
    _cache_args(g)
    g.set_defaults(fn=cmd_generate)

    ch = sub.add_parser("chat", help="interactive chat with streaming replies (needs tokenizer.json)")
    ch.add_argument("--model", required=True)
    ch.add_argument("--system", help="system prompt")
    ch.add_argument("--thinking", action="store_true", help="open each reply in thinking mode (<think>)")
    ch.add_argument("--max-new-tokens", type=int, default=512)
    ch.add_argument("--temperature", type=float, default=0.7)
    ch.add_argument("--top-k", type=int, default=0)
    ch.add_argument("--top-p", type=float, default=0.95)
    ch.add_argument("--min-p", type=float, default=0.0)
    ch.add_argument("--seed", type=int, default=0)
    ch.add_argument("--dtype", **dtype)
    _runtime_args(ch)
    _cache_args(ch)
    ch.set_defaults(fn=cmd_chat)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions "
                                      "(streaming), /v1/models, /health, /metrics")
    sv.add_argument("--model", required=True, help="checkpoint folder (config.json + safetensors [+ tokenizer.json])")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=os.environ.get("JDEEP_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1/* (default $JDEEP_API_KEY; none: open)")
    sv.add_argument("--served-model-name", help="the model id clients send (default: the folder's name)")
    sv.add_argument("--tokenizer", help="a tokenizer.json to use instead of the checkpoint folder's")
    sv.add_argument("--max-num-seqs", type=int, default=8, help="engine slots (requests decoded together)")
    sv.add_argument("--max-len", type=int, default=4096, help="longest prompt + completion, in tokens")
    sv.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per prefill step")
    sv.add_argument("--seed", type=int, default=0, help="base seed of requests sent without one")
    sv.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="compile every batch-size and prefill-length bucket before serving (default on: no compile "
                         "pauses under traffic)")
    sv.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    sv.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="on SIGINT/SIGTERM, seconds requests in flight may take to finish before they are cancelled")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    sv.add_argument("--dtype", **dtype)
    sv.add_argument("--quantize-activations", action=argparse.BooleanOptionalAction, default=None)
    sv.add_argument("--fp8-max", type=float)
    sv.add_argument("--packed-kv", action="store_true")
    _runtime_args(sv)
    _cache_args(sv)
    sv.set_defaults(fn=cmd_serve)

    b = sub.add_parser("bench", help="prefill/decode speed, latency percentiles, memory and bandwidth roofline")
    bsrc = b.add_mutually_exclusive_group()
    bsrc.add_argument("--model", help="checkpoint folder")
    bsrc.add_argument("--random-weights", help="config.json to build a seeded random checkpoint from "
                                               "(default: a built-in small DeepSeek-V4)")
    b.add_argument("--input-len", type=int, default=512)
    b.add_argument("--output-len", type=int, default=32)
    b.add_argument("--batch-size", default="1,8", help="comma-separated batch sizes (a sweep)")
    b.add_argument("--prompts-file", help="JSONL with prompt_ids per line instead of random prompts")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="default: float32 on CPU (XLA:CPU emulates bfloat16 matmuls, several times slower), "
                        "bfloat16 on accelerators")
    b.add_argument("--json", help="write the full result (schema jdeep.bench/1, see jdeep/serve/bench.py)")
    b.add_argument("--plot", help="write a PNG of the sweep (needs matplotlib)")
    b.add_argument("--compare", choices=["transformers"],
                   help="also run transformers' DeepseekV4ForCausalLM on the same checkpoint, dtype and prompts and "
                        "print jdeep/transformers ratios (unquantized DeepSeek-V4 only; pip install 'jdeep[compare]')")
    _runtime_args(b)
    _cache_args(b)
    b.set_defaults(fn=cmd_bench)

    i = sub.add_parser("info", help="config summary, parameter bytes by dtype, state bytes per token")
    src = i.add_mutually_exclusive_group(required=True)
    src.add_argument("--model")
    src.add_argument("--preset", choices=["v4-flash", "v4-pro", "v41-flash"])
    i.add_argument("--dtype", **dtype)
    i.add_argument("--mesh", help="deployment planning: also print parameter and decode-state bytes per device of this "
                                  "mesh, e.g. data=1,tensor=4,expert=16 (sharded as jdeep.load(..., mesh=) shards)")
    i.add_argument("--batch", type=int, help="with --mesh: sequence slots of the decode state (default 1)")
    i.add_argument("--max-len", type=int, help="with --mesh: tokens per sequence of the decode state (default 8192)")
    i.add_argument("--packed-kv", action="store_true", help="with --mesh: the KV caches as uint8 fp8 records")
    i.set_defaults(fn=cmd_info)

    c = sub.add_parser("convert", help="load a checkpoint and save the converted tree with Orbax")
    c.add_argument("--model", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--dtype", **dtype)
    c.set_defaults(fn=cmd_convert)

    cg = sub.add_parser("check-graph", help="lower every program jdeep compiles for a model and check it against the "
                                            "Neuron compile-safety rules (jdeep/graphcheck)")
    _graph_args(cg)
    cg.add_argument("--max-args", type=int, default=128, help="bound on a program's flattened arguments (S19)")
    cg.add_argument("--verbose", "-v", action="store_true", help="print every program's report")
    cg.set_defaults(fn=cmd_check_graph)

    e = sub.add_parser("export", help="write the StableHLO (text, bytecode, jax.export) of every program jdeep "
                                      "compiles for a model, with a JSON manifest")
    _graph_args(e)
    e.add_argument("--out", required=True)
    e.set_defaults(fn=cmd_export)
    return p


def _compile_cache(args: argparse.Namespace) -> None:
    """Persistent JAX compilation cache (on by default): compiled programs survive across runs."""
    import os

    if getattr(args, "no_compile_cache", True) or os.environ.get("JDEEP_NO_COMPILE_CACHE"):
        return
    import jax

    path = args.compile_cache or os.environ.get("JDEEP_COMPILE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jdeep", "jax")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _compile_cache(args)
    try:
        _init_distributed(args)
        return args.fn(args)
    except (FileNotFoundError, ValueError) as e:  # ConfigError / CheckpointError are ValueErrors
        print(f"jdeep {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
