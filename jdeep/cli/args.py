"""The command line's shared arguments: the `jdeep.load` flags, the sampling flags, the multi-process and
compile-cache flags, and turning parsed arguments into load keywords, SamplingParams and process setup."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from typing import Any

import jax
import ml_dtypes
import numpy as np

from ..io.tokenizer import Tokenizer
from ..model import compile_cache
from ..config.presets import PRESET_NAMES
from ..runtime.buckets import parse_buckets
from ..runtime.sampling import SamplingParams
from ..speculative.config import parse_speculative

DTYPES = ["float32", "bfloat16"]
BARE = {"help": None}   # a flag listed without help text (jdeep serve's numerics flags, check-graph's)
# The flags that become jdeep.load keywords (load_kwargs), in the order --help lists them
LOAD_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "dtype": ("--dtype", dict(choices=DTYPES, default="float32")),
    "quantize_activations": ("--quantize-activations", dict(
        action=argparse.BooleanOptionalAction, default=None,
        help="DeepSeek's numerics for quantized checkpoints (default: on for fp8/fp4 checkpoints)")),
    "fp8_max": ("--fp8-max", dict(type=float, help="448 (e4m3fn) or 240/224 for Trainium2's e4m3 (default: the "
                                                   "platform's, 240 on trn1/trn2, else 448)")),
    "packed_kv": ("--packed-kv", dict(action="store_true", help="keep the KV cache as uint8 fp8 records")),
    "weights": ("--weights", dict(choices=["codes", "decoded"],
                                  help="keep fp8/fp4 weights as uint8 codes decoded in each GEMM, or decoded once at load "
                                       "(exact; default: codes on Neuron, decoded on CPU/GPU where they fit)")),
    "compile_mode": ("--compile-mode", dict(
        choices=["scan", "regions"],
        help="scan: one program per step; regions: a host loop over layers, one program per layer kind's half "
             "(default $JDEEP_COMPILE_MODE, else regions on Neuron and scan elsewhere)")),
    "host_embedding": ("--host-embedding", dict(action="store_true",
                                                help="keep the token embedding table in host memory")),
    "mesh": ("--mesh", dict(help="shard the model over a device mesh, e.g. 'data=2,expert=4' or 'tensor=2,expert=4' "
                                 "(axes data, tensor, expert; the sizes multiply to the device count of all "
                                 "processes)")),
    "vision_placement": ("--vision-placement", dict(
        choices=["host", "device"], help="where a DeepSeek-V4.1 vision tower runs: the host CPU or the model's device "
                                         "(default: host on Neuron, else device)")),
}
RUNTIME = ("compile_mode", "host_embedding", "mesh", "vision_placement")


def add_load_args(p: argparse.ArgumentParser, *names: str, **overrides: dict[str, Any]) -> None:
    """Add the jdeep.load flags `names` (default: all of LOAD_FLAGS) to p; overrides: name -> argparse keywords
    that replace the shared ones for this command (another default or help)."""
    for name in names or LOAD_FLAGS:
        flag, kw = LOAD_FLAGS[name]
        p.add_argument(flag, **{**kw, **overrides.get(name, {})})


def load_kwargs(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """The jdeep.load keywords of the load flags this command has, plus `extra` (progress=True)."""
    return {**{name: getattr(args, name) for name in LOAD_FLAGS if hasattr(args, name)}, **extra}


def speculative_json(text: str) -> dict:
    """--speculative-config: vLLM's JSON spelling, e.g. '{"method": "mtp", "num_speculative_tokens": 2}'."""
    try:
        spec = json.loads(text)
        parse_speculative(spec)
    except (json.JSONDecodeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"--speculative-config: {e}") from None
    return spec


def add_speculative_arg(p: argparse.ArgumentParser, what: str = "") -> None:
    p.add_argument("--speculative-config", type=speculative_json, metavar="JSON",
                   help='speculative decoding, vLLM\'s spelling: \'{"method": "mtp", "num_speculative_tokens": 2}\' '
                        f"(loads the checkpoint's MTP block){what}")


def add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int, temperature: float, top_p: float) -> None:
    """The sampling flags (sampling_params) with this command's defaults."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=top_p)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)


def sampling_params(args: argparse.Namespace, line: dict | None = None, index: int = 0) -> SamplingParams:
    """Command-line sampling values, overridden by a prompts-file line's own (line i seeded seed + i)."""
    line = line or {}
    return SamplingParams(
        temperature=line.get("temperature", args.temperature), top_k=line.get("top_k", args.top_k),
        top_p=line.get("top_p", args.top_p), min_p=line.get("min_p", args.min_p),
        seed=line.get("seed", args.seed + index),
        max_new_tokens=line.get("max_new_tokens", args.max_new_tokens),
        stop_token_ids=tuple(line.get("stop_token_ids", ())))


def add_process_args(p: argparse.ArgumentParser) -> None:
    """Process setup main() does before the command: multi-process (jax.distributed) and the compilation cache."""
    p.add_argument("--coordinator", default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
                   help="HOST:PORT of process 0 for a multi-process run (jax.distributed; default "
                        "$JAX_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=int, default=env_int("JAX_NUM_PROCESSES"),
                   help="processes in a multi-process run (default $JAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=env_int("JAX_PROCESS_ID"),
                   help="this process's index, 0 .. num-processes-1 (default $JAX_PROCESS_ID)")
    p.add_argument("--compile-cache", help="persistent compilation cache directory (default ~/.cache/jdeep/jax, "
                                           "or $JDEEP_COMPILE_CACHE)")
    p.add_argument("--no-compile-cache", action="store_true", help="do not keep compiled programs across runs")


def add_graph_args(p: argparse.ArgumentParser) -> None:
    """check-graph and export: the model and the programs to build (no weights are read)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint folder (only config.json is read)")
    src.add_argument("--preset", choices=PRESET_NAMES, help="a released model's config")
    p.add_argument("--mode", choices=["scan", "regions"], default="regions", help="compile mode (default regions, "
                                                                                 "Neuron's)")
    p.add_argument("--batch-sizes", default="1,2,4,8", help="batch-size buckets")
    p.add_argument("--prefill-len", type=int, default=128, help="prefill chunk length")
    p.add_argument("--max-len", type=int, default=1024, help="state length (tokens per sequence)")
    add_load_args(p, "dtype", "quantize_activations", "fp8_max", "packed_kv", "host_embedding",
                  dtype={"default": "bfloat16"}, quantize_activations=BARE, packed_kv=BARE,
                  fp8_max={"default": 240.0, "help": "fp8 range (default 240, trn2's e4m3)"},
                  host_embedding={"help": "token embedding gathered on the host"})
    p.add_argument("--no-pack-params", action="store_true", help="scan mode: one argument per parameter tensor "
                                                                  "(default: arenas, as jdeep runs on Neuron)")
    p.add_argument("--platform", choices=["neuron", "cpu", "gpu"], default="neuron",
                   help="the platform the programs are for: its kernel choices (default neuron)")
    inv = p.add_argument_group("a deployment's programs", "with --max-num-seqs: exactly the programs `jdeep serve` "
                               "with these settings compiles in warm-up, under their inventory names "
                               "(Engine.programs; --max-len is then the longest request, as serve's), instead of "
                               "the --batch-sizes x --prefill-len grid")
    inv.add_argument("--max-num-seqs", type=int, help="engine slots")
    inv.add_argument("--prefill-chunk", type=int, default=256, help="longest prefill chunk (default 256)")
    inv.add_argument("--max-num-batched-tokens", type=int, help="token positions one iteration may compute")
    inv.add_argument("--prefix-cache-bytes", type=lambda t: "auto" if t.strip() == "auto" else parse_bytes(t),
                     default="auto", help="0: no prefix cache (its snapshot programs left out; default auto: on)")
    add_bucket_args(inv)


def env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def np_dtype(name: str) -> Any:
    return np.float32 if name == "float32" else ml_dtypes.bfloat16


def parse_bytes(text: str) -> int:
    """A byte count: an integer with an optional K / M / G suffix (powers of 1024; "G", "GB" and "GiB" alike)."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if mult > 1 else t
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"expected a byte count such as 1073741824 or 1G, got {text!r}")
    return int(digits) * mult


def parse_ints(text: str, flag: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise SystemExit(f"jdeep: {flag} must be comma-separated integers, got {text!r}") from None


def batch_sizes(text: str) -> list[int]:
    sizes = parse_ints(text, "--batch-sizes")
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"jdeep: --batch-sizes must be positive integers, got {text!r}")
    return sizes


def folder_tokenizer(folder: str) -> Tokenizer | None:
    try:
        return Tokenizer(folder)
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------------- commands

def setup_compile_cache(args: argparse.Namespace) -> None:
    """The persistent JAX compilation cache (on by default; jdeep/model/compile_cache.py): compiled programs survive across
    runs. Called before JAX initialises its backends."""
    if not getattr(args, "no_compile_cache", True):
        compile_cache.enable(args.compile_cache)


def init_distributed(args: argparse.Namespace) -> None:
    """jax.distributed.initialize for --coordinator/--num-processes/--process-id (before any device is touched).
    CPU processes use JAX's CPU collectives (gloo, JAX's default). Processes other than 0 print nothing on stdout."""
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
    if getattr(args, "command", None) == "serve":
        # the coordination service would otherwise end every process once one stops sending heartbeats; a server's
        # process 0 answers 503 instead (serve/lockstep.py)
        jax.config.update("jax_enable_recoverability", True)
    with _native_stderr_without(RECOVERABLE_NOTICE):
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=n, process_id=pid)
    # Results go to Python's stdout on process 0 only; native libraries (gloo's connection messages) that
    # write to file descriptor 1 are sent to stderr, so stdout stays machine-readable.
    sys.stdout.flush()
    sys.stdout = os.fdopen(os.dup(1), "w") if pid == 0 else open(os.devnull, "w")
    os.dup2(2, 1)


RECOVERABLE_NOTICE = "Using experimental recoverable task feature"   # the service's WARNING line for the option above


@contextlib.contextmanager
def _native_stderr_without(notice: str):
    """Native code's stderr (file descriptor 2) in the block, written back without the lines holding `notice`: the
    coordination service logs a WARNING for an option jdeep sets on purpose, which is not the user's to act on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [ln for ln in captured.read().decode(errors="replace").splitlines(True) if notice not in ln]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


def _bucket_list(what: str):
    def parse(text: str) -> tuple[int, ...]:
        try:
            return parse_buckets(text, what)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def add_bucket_args(p) -> None:
    """--batch-buckets, --prefill-batch-buckets, --chunk-buckets: the deployment's bucket ladders
    (runtime/buckets.py)."""
    p.add_argument("--batch-buckets", type=_bucket_list("--batch-buckets"), metavar="N,N,...",
                   help="window sizes (slot rows) step programs are compiled for: powers of two up to the slots, which "
                        "are always one (default: every power of two; on Neuron powers of 8)")
    p.add_argument("--prefill-batch-buckets", type=_bucket_list("--prefill-batch-buckets"), metavar="N,N,...",
                   help="the window sizes among --batch-buckets that prefill steps use (default: all of them; on "
                        "Neuron those up to 8)")
    p.add_argument("--chunk-buckets", type=_bucket_list("--chunk-buckets"), metavar="S,S,...",
                   help="prefill chunk lengths step programs are compiled for: powers of two from 16 up to "
                        "--prefill-chunk (default: powers of four from 16, and --prefill-chunk)")
