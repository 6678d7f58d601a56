"""The `jdeep` command line: demo, generate, info, convert."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise SystemExit(f"jdeep: --prompt-ids must be comma-separated integers, got {text!r}") from None


def cmd_demo(args: argparse.Namespace) -> int:
    import jdeep
    from jdeep.random_weights import TINY_CONFIG, random_checkpoint, tiny_v41_config

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        random_checkpoint(TINY_CONFIG if args.arch == "v4" else tiny_v41_config(), tmp, seed=args.seed)
        model = jdeep.load(tmp, dtype=args.dtype)
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


def cmd_generate(args: argparse.Namespace) -> int:
    import jdeep

    model = jdeep.load(args.model, dtype=args.dtype, quantize_activations=args.quantize_activations,
                       fp8_max=args.fp8_max, packed_kv=args.packed_kv)
    if args.prompt_ids is None:
        raise SystemExit("jdeep generate: give --prompt-ids (text prompts need the tokenizer, not supported yet)")
    try:
        out = jdeep.generate(model, [_parse_ids(args.prompt_ids)], max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, seed=args.seed)
    except ValueError as e:
        raise SystemExit(f"jdeep generate: {e}") from None
    print(json.dumps({"tokens": out.tokens[0].tolist()}))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import numpy as np

    from jdeep.config import ModelConfig, preset
    from jdeep.info import summary

    config = preset(args.preset) if args.preset else ModelConfig.from_file(args.model)
    import ml_dtypes

    print(summary(config, np.float32 if args.dtype == "float32" else ml_dtypes.bfloat16))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    import jdeep
    from jdeep.checkpoint import save_converted
    from jdeep.config import ModelConfig

    if ModelConfig.from_file(args.model).engram is not None:
        raise SystemExit("jdeep convert: models with Engram layers (DeepSeek-V4.1) cannot be converted yet; "
                         "their tables stay memory-mapped in the original safetensors — use the original folder")
    model = jdeep.load(args.model, dtype=args.dtype)
    save_converted(args.out, model.config, model.params, args.dtype)
    print(f"wrote {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jdeep", description="DeepSeek-V4 inference in JAX")
    sub = p.add_subparsers(dest="command", required=True)
    dtype = dict(choices=["float32", "bfloat16"], default="float32")

    d = sub.add_parser("demo", help="generate with a built-in seeded random tiny model (no download)")
    d.add_argument("--max-new-tokens", type=int, default=16)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--dtype", **dtype)
    d.add_argument("--arch", choices=["v4", "v41"], default="v4", help="the tiny model's architecture")
    d.set_defaults(fn=cmd_demo)

    g = sub.add_parser("generate", help="greedy or sampled continuation of one prompt")
    g.add_argument("--model", required=True, help="checkpoint folder (config.json + safetensors)")
    g.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", **dtype)
    g.add_argument("--quantize-activations", action=argparse.BooleanOptionalAction, default=None,
                   help="DeepSeek's numerics for quantized checkpoints (default: on for fp8/fp4 checkpoints)")
    g.add_argument("--fp8-max", type=float, default=448.0, help="448 (e4m3fn) or 240/224 for Trainium2's e4m3")
    g.add_argument("--packed-kv", action="store_true", help="keep the KV cache as uint8 fp8 records")
    g.set_defaults(fn=cmd_generate)

    i = sub.add_parser("info", help="config summary, parameter bytes by dtype, state bytes per token")
    src = i.add_mutually_exclusive_group(required=True)
    src.add_argument("--model")
    src.add_argument("--preset", choices=["v4-flash", "v4-pro", "v41-flash"])
    i.add_argument("--dtype", **dtype)
    i.set_defaults(fn=cmd_info)

    c = sub.add_parser("convert", help="load a checkpoint and save the converted tree with Orbax")
    c.add_argument("--model", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--dtype", **dtype)
    c.set_defaults(fn=cmd_convert)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (FileNotFoundError, ValueError) as e:  # ConfigError / CheckpointError are ValueErrors
        print(f"jdeep {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
