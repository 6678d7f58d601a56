"""`jdeep doctor`: the parser of the bring-up command and its body (jdeep/tools/dev/doctor)."""

from __future__ import annotations

import argparse

from ..config.presets import PRESET_NAMES
from ..tools.dev.doctor.report import summary, write_report
from ..tools.dev.doctor.run import STEPS, DoctorOptions, run_doctor
from .args import parse_ints

__all__ = ["add_doctor_parser", "cmd_doctor"]


def add_doctor_parser(sub) -> None:
    d = sub.add_parser(
        "doctor", help="Trainium bring-up: environment, every program compiled (crash rates), minimal reproducers "
                       "of failures, goldens and kernels on the device, speed; report.md / report.json / repro/",
        description="Lower every program jdeep compiles for a checkpoint or a preset, check the compile-safety rules, "
                    "compile each with --compiler-cmd (neuronx-cc on a Neuron host, XLA:CPU elsewhere; it gets the "
                    "StableHLO file as its last argument) --repeat times, reduce every failure to the smallest "
                    "failing sub-program, and with a checkpoint run the numerics and speed checks. Writes "
                    "report.md, report.json and repro/*.mlir into --out (docs/neuron.md, Bring-up).")
    src = d.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint folder (weights: numerics and speed run too)")
    src.add_argument("--preset", choices=PRESET_NAMES, help="a released model's config (compile only)")
    d.add_argument("--out", required=True, help="folder for report.md, report.json and repro/")
    d.add_argument("--mode", choices=["scan", "regions"], default="regions", help="compile mode (default regions)")
    d.add_argument("--batch-sizes", default="1,8", help="batch-size buckets (default 1,8)")
    d.add_argument("--prefill-len", type=int, default=128, help="longest prefill chunk (buckets 16, 32, ... up to it)")
    d.add_argument("--max-len", type=int, default=1024, help="state length (tokens per sequence)")
    d.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    d.add_argument("--fp8-max", type=float, default=240.0, help="fp8 range (default 240, trn2's e4m3)")
    d.add_argument("--compiler-cmd", help="compiler command; the StableHLO file path is appended (default: "
                                          "python -m jdeep.tools.dev.doctor.neuron_cc on Neuron, .xla_cpu_cc elsewhere)")
    d.add_argument("--repeat", type=int, default=1, help="compiles per program, to measure crash rates (default 1)")
    d.add_argument("--timeout", type=float, default=3600.0, help="seconds per compile before it counts as a failure")
    d.add_argument("--reduce-tries", type=int, default=4,
                   help="compiles per candidate while reducing (an intermittent crash must show in one of them)")
    d.add_argument("--max-reduce-tests", type=int, default=300, help="compiles a reduction may spend")
    d.add_argument("--skip", default="", help=f"comma-separated steps to leave out: {', '.join(STEPS)}")
    d.set_defaults(fn=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    opts = DoctorOptions(model=args.model, preset=args.preset, mode=args.mode,
                         batch_sizes=tuple(parse_ints(args.batch_sizes, "--batch-sizes")),
                         prefill_len=args.prefill_len, max_len=args.max_len, dtype=args.dtype, fp8_max=args.fp8_max,
                         compiler_cmd=args.compiler_cmd, repeat=args.repeat, timeout_s=args.timeout,
                         reduce_tries=args.reduce_tries, max_reduce_tests=args.max_reduce_tests,
                         skip=frozenset(s for s in args.skip.replace(" ", "").split(",") if s))
    result = run_doctor(opts, args.out)
    js, md = write_report(result, args.out)
    s = summary(result)
    print(f"wrote {md}, {js} ({s['programs']} programs, {s['compile_failed']} failed to compile, "
          f"{s['reproducers']} reproducers, {s['checks_failed']} failed checks)")
    return 0
