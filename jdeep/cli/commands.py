"""The `jdeep` commands: demo, generate (one prompt or a prompts file through the engine), bench, info, eval and
convert, each `cmd_<name>(args) -> exit code` (chat.py: chat, doctor.py: doctor, serve.py: serve and compile,
programs.py: check-graph, export and info --programs)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import jax
from tqdm import tqdm

from .. import generate, load
from ..config import ModelConfig
from ..io.convert import save_converted
from ..io.tokenizer import Tokenizer
from ..model.weights import from_cpu_bf16
from ..param_spec import weight_formats
from ..config.presets import preset
from ..config.small_models import BENCH_DEFAULT_CONFIG, TINY_CONFIG, tiny_v41_config
from ..runtime.sampling import SamplingParams
from ..sharding import parse_mesh
from ..speculative.config import parse_speculative
from ..speculative.engine import make_engine
from ..tools.perf.bench import bench_prompts, format_report, plot_sweep, result_head, run_bench, run_context_sweep
from ..tools.dev.collectives import DEFAULT_LINK_GBPS, DEFAULT_PREFILL_LEN, collectives_table, measure
from ..tools.perf.compare import hf_config, require_transformers  # imports torch only when called
from ..tools.quality.evaluate import NUMERICS_MODES, compare, format_table, load_modes, read_texts
from ..tools.dev.info import device_footprint, mesh_summary, summary
from ..tools.perf.mixed_load import run_mixed
from ..tools.quality.mtp_eval import format_mtp_table, mtp_accuracy
from ..tools.testing.random_weights import random_checkpoint
from ..tools.perf.spec_bench import run_speculative
from .args import folder_tokenizer, load_kwargs, np_dtype, parse_ints, sampling_params
from .programs import info_programs


# the small DeepSeek-V4 trained on the Python standard library (scripts/train_demo_model.py; its model card)
DEMO_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo_model")
DEMO_PROMPTS = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', "import os\n\n\ndef read_lines(path):\n",
                "class Stack:\n    def __init__(self):\n"]


def cmd_demo(args: argparse.Namespace) -> int:
    if args.random or args.arch == "v41":
        return _random_demo(args)
    t0 = time.perf_counter()
    model = load(DEMO_MODEL, **load_kwargs(args))
    c = model.config
    print(f"loaded the shipped demo DeepSeek-V4 ({c.n_layers} layers, hidden {c.dim}, {c.n_routed_experts} routed "
          f"experts, fp8/fp4 weights; trained on the Python standard library) in {time.perf_counter() - t0:.1f} s")
    for i, prompt in enumerate(DEMO_PROMPTS):
        detok = model.tokenizer.detokenizer()
        detok.push(model.tokenizer.encode(prompt))
        print("\n" + "-" * 72 + "\n" + prompt, end="", flush=True)

        def show(new: list[list[int]]) -> None:
            print(detok.push(new[0]), end="", flush=True)

        t0 = time.perf_counter()
        out = generate(model, [prompt], sampling=SamplingParams(temperature=0.7, top_p=0.95, seed=args.seed + i,
                                                                max_new_tokens=args.max_new_tokens),
                       stream=show, stream_every=4)
        dt = time.perf_counter() - t0
        print(detok.flush())
        note = " (the first call includes compiling)" if i == 0 else ""
        print(f"[{int(out.lengths[0])} tokens in {dt:.2f} s = {out.lengths[0] / dt:.0f} tokens/s{note}]")
    return 0


def _random_demo(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        random_checkpoint(TINY_CONFIG if args.arch == "v4" else tiny_v41_config(), tmp, seed=args.seed)
        model = load(tmp, **load_kwargs(args))
        name = "DeepSeek-V4" if args.arch == "v4" else "DeepSeek-V4.1 (fp8/fp4, Engram)"
        print(f"built and loaded a seeded random tiny {name} ({model.config.n_layers} layers, "
              f"{len(model.plan.segments)} scan segments) in {time.perf_counter() - t0:.1f} s")
        prompts = [[0, 17, 42, 99], [0, 5, 9, 230, 77, 301, 12, 8, 401, 66]]
        t0 = time.perf_counter()
        out = generate(model, prompts, max_new_tokens=args.max_new_tokens)
        t1 = time.perf_counter()
        out = generate(model, prompts, max_new_tokens=args.max_new_tokens)
        t2 = time.perf_counter()
        for p, toks in zip(prompts, out.tokens):
            print(f"prompt {p} -> {toks.tolist()}")
        n = out.tokens.size
        print(f"first call (with compilation) {t1 - t0:.1f} s; second call {t2 - t1:.3f} s "
              f"= {n / (t2 - t1):.0f} tokens/s for batch {len(prompts)}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    given = [a for a in (args.prompt_ids, args.prompt, args.prompts_file) if a is not None]
    if len(given) != 1:
        raise SystemExit("jdeep generate: give exactly one of --prompt-ids, --prompt or --prompts-file")
    spec = args.speculative_config
    model = load(args.model, **load_kwargs(args, progress=True, mtp=spec is not None))
    tok = folder_tokenizer(args.model)
    if args.prompts_file is not None:
        return _generate_file(args, model, tok)
    if args.prompt is not None:
        if tok is None:
            raise SystemExit(f"jdeep generate: --prompt needs {args.model}/tokenizer.json (or use --prompt-ids)")
        ids = tok.encode(args.prompt)
    else:
        ids = parse_ints(args.prompt_ids, "--prompt-ids")
    try:
        out = generate(model, [ids], sampling=sampling_params(args), ignore_eos=args.ignore_eos, speculative=spec)
    except ValueError as e:
        raise SystemExit(f"jdeep generate: {e}") from None
    tokens = out.tokens[0, :out.lengths[0]].tolist()
    result = {"tokens": tokens}
    if tok is not None:
        result["text"] = tok.decode(tokens)
    print(json.dumps(result, ensure_ascii=False))
    return 0


def _generate_file(args: argparse.Namespace, model, tok: Tokenizer | None) -> int:
    """Offline batch: one JSON object per line ({"prompt_ids": [...]} or {"prompt": "..."}, optional "id" and
    sampling fields), through the continuous-batching engine; one JSON line per request out, in input order."""
    with open(args.prompts_file, encoding="utf-8") as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    eng = make_engine(model, args.speculative_config, max_num_seqs=args.max_num_seqs, max_len=args.max_len,
                      ignore_eos=args.ignore_eos)
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
            order.append(eng.add_request(ids, sampling_params(args, item, n), request_id=rid))
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


def cmd_bench(args: argparse.Namespace) -> int:
    if args.compare:
        try:
            require_transformers()
        except ImportError as e:
            raise SystemExit(f"jdeep bench: {e}") from None
    try:
        sizes = [int(b) for b in args.batch_size.split(",") if b]
    except ValueError:
        raise SystemExit(f"jdeep bench: --batch-size must be comma-separated integers, got {args.batch_size!r}") from None
    contexts = parse_ints(args.context_sweep, "--context-sweep") if args.context_sweep else None
    if contexts is not None and (args.compare or args.prompts_file):
        raise SystemExit("jdeep bench: --context-sweep runs random prompts at batch 1; it takes neither --compare nor "
                         "--prompts-file")
    mixed_chunks = parse_ints(args.mixed_chunks, "--mixed-chunks") if args.mixed is not None else None
    spec = args.speculative_config
    if spec is not None and (args.mixed is not None or contexts is not None or args.compare):
        raise SystemExit("jdeep bench: --speculative-config runs the batch-size sweep; it takes none of --mixed, "
                         "--context-sweep, --compare")
    if args.mixed is not None and (contexts is not None or args.compare or args.prompts_file):
        raise SystemExit("jdeep bench: --mixed runs random prompts through the engine; it takes none of "
                         "--context-sweep, --compare, --prompts-file")
    if args.dtype is None:
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
            hf_config(ModelConfig.from_file(folder))     # an incomparable checkpoint fails before loading
        model = load(folder, **load_kwargs(args, progress=True, mtp=spec is not None))
        prompts = None
        if args.prompts_file:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts = [json.loads(ln)["prompt_ids"] for ln in f if ln.strip()]
        if spec is not None:
            result = result_head(model, None)
            result["runs"] = []
            sets = bench_prompts(model.config, args.input_len, sizes, args.seed, prompts)
            method, k = parse_speculative(spec)
            result["speculative"] = run_speculative(model, sets, args.output_len, range(1, k + 1),
                                                    progress=_spec_progress, method=method)
        elif mixed_chunks is not None:
            result = result_head(model, None)
            result["runs"] = []
            result["mixed"] = run_mixed(model, args.mixed, args.mixed_streams, mixed_chunks, seed=args.seed,
                                        progress=_mixed_progress)
        elif contexts is not None:
            result = run_context_sweep(model, contexts, args.output_len, seed=args.seed,
                                       prefill_chunk=args.prefill_chunk, progress=_sweep_progress)
        else:
            result = run_bench(model, args.input_len, args.output_len, sizes, seed=args.seed, prompts=prompts,
                               compare_transformers=folder if args.compare else None,
                               prefill_chunk=args.prefill_chunk)
    print(format_report(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        try:
            plot_sweep(result, args.plot)
        except ImportError:
            raise SystemExit("jdeep bench: --plot needs matplotlib (pip install matplotlib)") from None
    return 0


def _spec_progress(batch_size: int, e: dict) -> None:
    print(f"batch {batch_size}, k {e['k']}: {e['decode_tok_s']:.1f} decode tok/s ({e['speedup']:.2f} x plain), "
          f"{e['mean_accepted_length'] - 1:.2f} drafts accepted per iteration", file=sys.stderr, flush=True)


def _mixed_progress(r: dict) -> None:
    print(f"chunk {r['prefill_chunk']}: {r['stalls']} stalls, streams' ITL p99 {r['itl_ms']['p99']:.1f} ms, TTFT "
          f"{r['ttft_s']:.2f} s ({r['ttft_ratio']:.2f} x alone)", file=sys.stderr, flush=True)


def _sweep_progress(r: dict) -> None:
    print(f"context {r['context']}: prefill {r['prefill_s']:.1f} s ({r['prefill_tok_s']:.0f} tok/s), inter-token "
          f"{r['itl_ms']['p50']:.1f} ms, state {r['state_bytes'] / 2**20:.1f} MiB", file=sys.stderr, flush=True)


def cmd_eval(args: argparse.Namespace) -> int:
    """Perplexity of the model over text files in each numerics mode, and against a base distribution."""
    kwargs = load_kwargs(args)
    quantized = weight_formats(ModelConfig.from_file(args.model))[0] != "float"
    mtp_kwargs = {"mtp": True} if args.mtp else {}
    names = args.numerics.split(",") if args.numerics else (list(NUMERICS_MODES) if quantized else ["float"])
    base = None
    if args.base_model:
        base = load(args.base_model, **kwargs)
    elif args.base_numerics:
        names = [args.base_numerics] + [n for n in names if n != args.base_numerics]
    models = load_modes(args.model, names, **kwargs, **mtp_kwargs)
    if args.base_numerics:
        base = models[args.base_numerics]
    elif base is not None:
        models = {"base": base, **models}
    texts = read_texts(args.text_file, next(iter(models.values())).tokenizer, models[names[0]].config.bos_token_id)

    bar = None

    def progress(total: int):
        nonlocal bar
        bar = tqdm(total=total, desc="eval", unit="window", leave=False, disable=not args.progress)
        return lambda: bar.update(1)

    try:
        result = compare(models, texts, base=base, context=args.context, stride=args.stride, chunk=args.prefill_chunk,
                         progress=progress)
    finally:
        if bar is not None:
            bar.close()
    result["model"] = args.model
    result["base"] = args.base_model or (f"{args.model} ({args.base_numerics})" if args.base_numerics else None)
    result["files"] = [{"path": p, "tokens": int(len(ids))} for p, ids in texts]
    print(format_table(result))
    if args.mtp:
        result["mtp"] = {name: mtp_accuracy(models[name], [ids for _, ids in texts], args.context) for name in names}
        print()
        print(format_mtp_table(result["mtp"], args.context))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": "jdeep.eval/1", **result}, f, indent=1)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    if args.programs:
        return info_programs(args)
    planning = [f for f, v in (("--batch", args.batch), ("--max-len", args.max_len), ("--packed-kv", args.packed_kv),
                               ("--collectives", args.collectives), ("--link-gbps", args.link_gbps),
                               ("--prefill-len", args.prefill_len)) if v not in (None, False)]
    if args.mesh is None and planning:
        raise ValueError(f"{', '.join(planning)} only apply with --mesh (they size the decode state and the "
                         "collectives per device): add --mesh (--mesh data=1 for a single device)")
    for flag, v in (("--batch", args.batch), ("--max-len", args.max_len), ("--prefill-len", args.prefill_len)):
        if v is not None and v < 1:
            raise ValueError(f"{flag} must be a positive integer, got {v}")
    if args.link_gbps is not None and not args.link_gbps > 0:
        raise ValueError(f"--link-gbps must be a positive number of GB/s, got {args.link_gbps}")
    prefill_len = args.prefill_len or DEFAULT_PREFILL_LEN
    if prefill_len > (args.max_len or 8192):
        raise ValueError(f"--prefill-len {prefill_len} is longer than --max-len {args.max_len or 8192}")
    if args.mesh is not None:
        mesh = parse_mesh(args.mesh)   # a bad mesh fails before any work
    config = preset(args.preset) if args.preset else ModelConfig.from_file(args.model)
    dtype = np_dtype(args.dtype)
    print(summary(config, dtype))
    if args.mesh is not None:
        print()
        print(mesh_summary(device_footprint(config, mesh, dtype, batch=args.batch or 1,
                                            max_len=args.max_len or 8192, packed_kv=args.packed_kv)))
        if args.collectives or args.link_gbps is not None or args.prefill_len is not None:
            print()
            sys.stdout.flush()     # the memory lines show while the programs compile
            print(collectives_table(measure(config, mesh, args.batch or 1, args.max_len or 8192, prefill_len, dtype,
                                            args.packed_kv), args.link_gbps or DEFAULT_LINK_GBPS))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    if ModelConfig.from_file(args.model).engram is not None:
        raise SystemExit("jdeep convert: models with Engram layers (DeepSeek-V4.1) cannot be converted yet; "
                         "their tables stay memory-mapped in the original safetensors — use the original folder")
    model = load(args.model, **load_kwargs(args))
    save_converted(args.out, model.config, from_cpu_bf16(model.params, model.dtype), args.dtype)
    for name in ("tokenizer.json", "tokenizer_config.json"):   # text prompts keep working on the converted folder
        if os.path.isfile(os.path.join(args.model, name)):
            shutil.copy(os.path.join(args.model, name), os.path.join(args.out, name))
    print(f"wrote {args.out}")
    return 0


# ---------------------------------------------------------------------- parser and main
