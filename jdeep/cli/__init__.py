"""The `jdeep` command line: the parser of every command (commands.py holds their bodies, args.py the shared
flags) and `main`."""

from __future__ import annotations

import argparse
import os
import sys

from ..io.chat import FORMATS
from ..config.presets import PRESET_NAMES
from ..serve.lockstep import PEER_TIMEOUT_S
from ..tools.perf.bench import PREFILL_CHUNK
from ..tools.dev.programs import SERVING_BATCH_SIZES, SERVING_PREFILL_LEN, SERVING_PREFILL_TOKENS
from .args import (BARE, RUNTIME, add_bucket_args, add_graph_args, add_load_args, add_process_args, add_sampling_args,
                   add_speculative_arg, init_distributed, parse_bytes, setup_compile_cache)
from .chat import cmd_chat
from .commands import cmd_bench, cmd_convert, cmd_demo, cmd_eval, cmd_generate, cmd_info
from .programs import cmd_check_graph, cmd_export
from .doctor import add_doctor_parser
from .serve import cmd_compile, cmd_serve

__all__ = ["main", "build_parser"]


def _engine_args(p: argparse.ArgumentParser) -> None:
    """The serving engine's shape (serve, compile): slots, lengths, buckets, prefix cache, speculation."""
    p.add_argument("--max-num-seqs", type=int, default=8, help="engine slots (requests decoded together)")
    p.add_argument("--max-len", type=int, default=4096, help="longest prompt + completion, in tokens")
    p.add_argument("--prefill-chunk", type=int, default=256, help="longest prefill chunk, in tokens (a power of two)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="token positions one engine iteration may compute: every running request decodes, prompts "
                        "prefill in what is left, oldest first (default: max-num-seqs + prefill-chunk; smaller "
                        "lowers the streams' inter-token latency while long prompts prefill, at their TTFT's cost)")
    add_bucket_args(p)
    p.add_argument("--prefix-cache-bytes", type=lambda t: "auto" if t.strip() == "auto" else parse_bytes(t),
                   default="auto",
                   help="device memory for prefix caching: snapshots of the decode state at 128-token prefix "
                        "boundaries that later prompts sharing the prefix start from (e.g. 2G; 0: off; default "
                        "auto: a quarter of the decode state's bytes, at most an eighth of the device's memory; off "
                        "on a device mesh)")
    add_speculative_arg(p, "; every request drafts k tokens per iteration")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jdeep", description="DeepSeek-V4 inference in JAX")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="complete Python prompts with the shipped small DeepSeek-V4 (no download); "
                                    "--random: a seeded random tiny model")
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.add_argument("--seed", type=int, default=0)
    add_load_args(d, "dtype")
    d.add_argument("--random", action="store_true", help="a seeded random tiny model instead (token ids in and out)")
    d.add_argument("--arch", choices=["v4", "v41"], default="v4",
                   help="the random tiny model's architecture (v41 implies --random)")
    add_load_args(d, *RUNTIME)
    add_process_args(d)
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
    add_sampling_args(g, max_new_tokens=16, temperature=0.0, top_p=1.0)
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS token")
    add_speculative_arg(g)
    add_load_args(g)
    add_process_args(g)
    g.set_defaults(fn=cmd_generate)

    ch = sub.add_parser("chat", help="interactive chat with streaming replies (needs tokenizer.json)")
    ch.add_argument("--model", required=True)
    ch.add_argument("--system", help="system prompt")
    ch.add_argument("--thinking", action="store_true", help="open each reply in thinking mode (<think>)")
    ch.add_argument("--chat-format", choices=sorted(FORMATS), help="DeepSeek chat layout (default: from the config)")
    ch.add_argument("--image", action="append", default=[], metavar="PATH",
                    help="an image for the first message (DeepSeek-V4.1 with a vision tower; repeatable); in the "
                         "chat, '/image PATH' attaches one to the next message")
    add_sampling_args(ch, max_new_tokens=512, temperature=0.7, top_p=0.95)
    add_speculative_arg(ch)
    add_load_args(ch, "dtype", *RUNTIME)
    add_process_args(ch)
    ch.set_defaults(fn=cmd_chat)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions "
                                      "(streaming), /v1/models, /health, /metrics")
    sv.add_argument("--model", required=True, help="checkpoint folder (config.json + safetensors [+ tokenizer.json])")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=os.environ.get("JDEEP_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1/* (default: $JDEEP_API_KEY, which unlike this "
                         "flag does not show in the process list; none: open)")
    sv.add_argument("--served-model-name", help="the model id clients send (default: the folder's name)")
    sv.add_argument("--tokenizer", help="a tokenizer.json to use instead of the checkpoint folder's")
    sv.add_argument("--chat-format", choices=sorted(FORMATS),
                    help="chat layout, reasoning and tool-call parser: v4 or v41 (default: the config's model_type)")
    _engine_args(sv)
    sv.add_argument("--seed", type=int, default=0, help="base seed of requests sent without one")
    sv.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="compile every batch-size and prefill-length bucket before serving (default on: no compile "
                         "pauses under traffic)")
    sv.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    sv.add_argument("--max-waiting", type=int,
                    help="requests that may wait for a slot; beyond them new requests get 429 with Retry-After "
                         "(default 4 x the engine's slots)")
    sv.add_argument("--request-timeout", type=float,
                    help="seconds a request may take from arrival; then it is cancelled (504, or an error event when "
                         "streaming) and its slot freed (default: no limit)")
    sv.add_argument("--request-read-timeout", type=float, default=30.0,
                    help="seconds a client has to send a request's headers, and then its whole body; a connection "
                         "that has not is closed (a body: 408), so slow or silent clients cannot hold connections "
                         "(default 30)")
    sv.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="on SIGINT/SIGTERM, seconds requests in flight may take to finish before they are cancelled")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_load_args(sv, quantize_activations=BARE, fp8_max=BARE, packed_kv=BARE)
    add_process_args(sv)
    sv.add_argument("--peer-timeout", type=float, default=PEER_TIMEOUT_S,
                    help="multi-process: seconds without a heartbeat after which a process counts as dead; process 0 "
                         f"then answers 503 and the others exit (default {PEER_TIMEOUT_S:g})")
    sv.add_argument("--warmup-timeout", type=float, default=3600.0,
                    help="multi-process: seconds a process that finished compiling waits for the others before the "
                         "first collective (default 3600; a process slower to compile never times out another's "
                         "collective)")
    sv.set_defaults(fn=cmd_serve)
    cp = sub.add_parser("compile", help="compile every program `jdeep serve` with these flags runs (its inventory, the "
                                        "first-use variants included) into the persistent compilation cache, then exit")
    cp.add_argument("--model", required=True, help="checkpoint folder (config.json + safetensors [+ tokenizer.json])")
    _engine_args(cp)
    add_load_args(cp, quantize_activations=BARE, fp8_max=BARE, packed_kv=BARE)
    add_process_args(cp)
    cp.set_defaults(fn=cmd_compile)

    b = sub.add_parser("bench", help="prefill/decode speed, latency percentiles, memory and bandwidth roofline")
    bsrc = b.add_mutually_exclusive_group()
    bsrc.add_argument("--model", help="checkpoint folder")
    bsrc.add_argument("--random-weights", help="config.json to build a seeded random checkpoint from "
                                               "(default: a built-in small DeepSeek-V4)")
    b.add_argument("--input-len", type=int, default=512)
    b.add_argument("--output-len", type=int, default=32)
    b.add_argument("--batch-size", default="1,8", help="comma-separated batch sizes (a sweep)")
    b.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                   help=f"prompt tokens per prefill step, as the engine chunks prompts (default {PREFILL_CHUNK}, the "
                        "engine's)")
    b.add_argument("--context-sweep", help="comma-separated context lengths, e.g. 512,4096,16384,65536: instead of the "
                                           "batch-size sweep, inter-token latency and decode-state bytes against the "
                                           "context at batch 1 (each context prefilled in chunks, then --output-len "
                                           "decode steps timed at its end)")
    b.add_argument("--mixed", type=int, metavar="LONG_LEN",
                   help="instead of the batch-size sweep, the engine under a mixed load: --mixed-streams requests "
                        "decode while a LONG_LEN-token prompt arrives; the streams' inter-token latency, stalls and "
                        "the prompt's TTFT (alone and mixed) per --mixed-chunks")
    b.add_argument("--mixed-streams", type=int, default=4, help="streams decoding in --mixed (default 4)")
    b.add_argument("--mixed-chunks", default=str(PREFILL_CHUNK),
                   help="comma-separated prefill chunk lengths for --mixed; each runs with the engine's default "
                        f"token budget, slots + chunk (default {PREFILL_CHUNK})")
    b.add_argument("--prompts-file", help="JSONL with prompt_ids per line instead of random prompts")
    add_speculative_arg(b, "; the bench then compares greedy decode tok/s with k = 1 .. num_speculative_tokens "
                           "against plain decoding on the same prompts, with the acceptance per draft position")
    b.add_argument("--seed", type=int, default=0)
    add_load_args(b, "dtype", dtype={"default": None, "help": "default: float32 on CPU (the spec's exact numerics; "
                                     "bfloat16 runs there too, weights as bits: docs/performance.md), bfloat16 on "
                                     "accelerators"})
    b.add_argument("--json", help="write the full result (schema jdeep.bench/1, see jdeep/tools/perf/bench.py)")
    b.add_argument("--plot", help="write a PNG of the sweep (needs matplotlib)")
    b.add_argument("--compare", choices=["transformers"],
                   help="also run transformers' DeepseekV4ForCausalLM on the same checkpoint, dtype and prompts and "
                        "print jdeep/transformers ratios (unquantized DeepSeek-V4 only; pip install 'jdeep[compare]')")
    add_load_args(b, "weights", *RUNTIME)
    add_process_args(b)
    b.set_defaults(fn=cmd_bench)

    ev = sub.add_parser("eval", help="perplexity over text files per numerics mode; KL / top-1 agreement to a base")
    ev.add_argument("--model", required=True, help="checkpoint folder (with tokenizer.json)")
    ev.add_argument("--text-file", action="append", required=True, help="a UTF-8 text file to score (repeatable)")
    ev.add_argument("--numerics", help="comma-separated numerics modes: float, deepseek, packed-kv, trn2-240, trn2-224 "
                                       "(default: all for a quantized checkpoint, float otherwise)")
    base = ev.add_mutually_exclusive_group()
    base.add_argument("--base-model", help="a checkpoint whose distribution the modes are compared with (e.g. the "
                                           "float weights the quantized checkpoint was made from)")
    base.add_argument("--base-numerics", choices=["float"], help="compare with this numerics mode of --model")
    ev.add_argument("--context", type=int, default=512, help="tokens of context per window (default 512)")
    ev.add_argument("--stride", type=int, help="tokens between window starts (default context / 2)")
    ev.add_argument("--prefill-chunk", type=int, default=256)
    ev.add_argument("--json", help="write the result (schema jdeep.eval/1)")
    ev.add_argument("--mtp", action="store_true", help="also load the MTP block and report its next-next-token "
                                                        "accuracy per numerics mode (DeepSeek-V4 checkpoints)")
    ev.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                    help="a progress bar over the scored windows (on stderr)")
    add_load_args(ev, "dtype", *RUNTIME)
    ev.set_defaults(fn=cmd_eval)

    i = sub.add_parser("info", help="config summary, parameter bytes by dtype, state bytes per token")
    src = i.add_mutually_exclusive_group(required=True)
    src.add_argument("--model")
    src.add_argument("--preset", choices=PRESET_NAMES)
    add_load_args(i, "dtype")
    i.add_argument("--mesh", help="deployment planning: also print parameter and decode-state bytes per device of this "
                                  "mesh, e.g. data=1,tensor=4,expert=16 (sharded as jdeep.load(..., mesh=) shards)")
    i.add_argument("--batch", type=int, help="with --mesh: sequence slots of the decode state (default 1)")
    i.add_argument("--max-len", type=int, help="with --mesh: tokens per sequence of the decode state (default 8192); "
                                               "with --programs: the longest request, as serve's (default 4096)")
    i.add_argument("--packed-kv", action="store_true", help="with --mesh: the KV caches as uint8 fp8 records")
    i.add_argument("--collectives", action="store_true",
                   help="with --mesh: also compile one decode step and one prefill chunk for the mesh (in a CPU "
                        "subprocess with that many host devices when this process has fewer) and print per collective "
                        "kind the runs, bytes per device and time at --link-gbps (V4-Flash on "
                        "data=1,tensor=4,expert=16: ~20 s on 2 CPU cores)")
    i.add_argument("--link-gbps", type=float, help="with --mesh: GB/s per device link the collectives' time assumes "
                                                   "(implies --collectives; default 100, a placeholder: pass your link's)")
    i.add_argument("--prefill-len", type=int, help="with --mesh: tokens of the prefill chunk whose collectives are "
                                                   "measured (implies --collectives; default 256)")
    pr = i.add_argument_group("the programs a deployment compiles", "--programs: count, from the config alone, the "
                              "programs `jdeep serve` with these settings compiles (its inventory), per kind; in the "
                              "regions mode (Neuron's) one per region of each model step")
    pr.add_argument("--programs", action="store_true", help="print the serving inventory's program count")
    pr.add_argument("--mode", choices=["scan", "regions"], help="compile mode (default: the platform's)")
    pr.add_argument("--platform", choices=["neuron", "cpu", "gpu"], help="whose kernel choices (default: JAX's "
                                                                          "backend)")
    pr.add_argument("--max-num-seqs", type=int, default=8, help="engine slots (default 8, as serve's)")
    pr.add_argument("--prefill-chunk", type=int, default=256, help="longest prefill chunk (default 256)")
    pr.add_argument("--max-num-batched-tokens", type=int, help="token positions one iteration may compute")
    pr.add_argument("--prefix-cache-bytes", type=lambda t: "auto" if t.strip() == "auto" else parse_bytes(t),
                    default="auto", help="0: no prefix cache (default auto: on)")
    add_bucket_args(pr)
    pr.add_argument("--speculative-tokens", type=int, metavar="K", help="the speculative engine's inventory (MTP for "
                                                                       "V4, DSpark for V4.1) with K drafts")
    i.set_defaults(fn=cmd_info)

    c = sub.add_parser("convert", help="load a checkpoint and save the converted tree with Orbax")
    c.add_argument("--model", required=True)
    c.add_argument("--out", required=True)
    add_load_args(c, "dtype")
    c.set_defaults(fn=cmd_convert)

    cg = sub.add_parser("check-graph", help="lower every program jdeep compiles for a model and check it against the "
                                            "Neuron compile-safety rules (jdeep/graphcheck)",
                        description="Lower every program serving compiles (no weights are read) and check each "
                                    "against the Neuron compile-safety rules: for every --batch-sizes bucket, a "
                                    "prefill program per chunk-length bucket up to --prefill-len (16, 32, ..., "
                                    "powers of two, as the engine's warmup) and the decode program. Defaults: the "
                                    "largest serving configuration, batches 1..256 and chunks up to 8192 on a state "
                                    "of 8192 tokens, prefill steps of at most --max-prefill-tokens (minutes per "
                                    "model and mode; narrow with the flags).")
    add_graph_args(cg)
    cg.set_defaults(batch_sizes=",".join(map(str, SERVING_BATCH_SIZES)), prefill_len=SERVING_PREFILL_LEN,
                    max_len=SERVING_PREFILL_LEN)
    cg.add_argument("--max-args", type=int, default=128, help="bound on a program's flattened arguments (S19)")
    cg.add_argument("--max-prefill-tokens", type=int, default=SERVING_PREFILL_TOKENS,
                    help="the token budget of one prefill step (batch x chunk); larger prefill programs are not "
                         f"checked (default {SERVING_PREFILL_TOKENS})")
    _speculative_tokens_arg(cg)
    cg.add_argument("--verbose", "-v", action="store_true", help="print every program's report")
    cg.set_defaults(fn=cmd_check_graph)

    e = sub.add_parser("export", help="write the StableHLO (text, bytecode, jax.export) of every program jdeep "
                                      "compiles for a model, with a JSON manifest")
    add_graph_args(e)
    e.add_argument("--out", required=True)
    _speculative_tokens_arg(e)
    e.set_defaults(fn=cmd_export)
    add_doctor_parser(sub)
    return p


def _speculative_tokens_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-tokens", type=int, metavar="K",
                   help="also the MTP speculative-decoding programs for K drafts (DeepSeek-V4 models; both compile "
                        "modes): per batch bucket the prefill chunks with the MTP block and the iteration (greedy, "
                        "sampled; in the regions mode its draft and finish programs and the region programs)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_compile_cache(args)
    try:
        init_distributed(args)
        return args.fn(args)
    except (FileNotFoundError, ValueError) as e:  # ConfigError / CheckpointError are ValueErrors
        print(f"jdeep {args.command}: {e}", file=sys.stderr)
        return 2
