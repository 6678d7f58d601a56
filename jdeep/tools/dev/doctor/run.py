"""The doctor's run: environment, then every program (rules, repeated compiles, reduction of failures), then numerics
and speed on a loaded checkpoint; the result is one JSON-able dict that report.py renders.

The programs are `model_programs`' (what `jdeep check-graph` and `jdeep export` build, from the config alone), lowered
with their source locations so that a reproducer can name the model stage it lies in. A program whose compiles
fail is reduced with the same compiler: a candidate "still fails" when any of `reduce_tries` compiles fails with the
error code the program failed with most often (a nondeterministic crash needs several tries to show)."""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Sequence

import jax
import numpy as np

from ....config import ModelConfig
from ....model.load import load
from ....platforms import neuron_generation
from ....config.presets import preset
from ..graphcheck import check_lowered
from ..programs import Target, chunk_buckets, model_programs
from . import numerics, speed
from .compiler import Compiler, ProgramCompile
from .environment import environment
from .reduce import reduce_failure

__all__ = ["DoctorOptions", "run_doctor", "STEPS"]

STEPS = ("rules", "compile", "reduce", "numerics", "speed")


@dataclass(frozen=True)
class DoctorOptions:
    """What to examine. `model` is a checkpoint folder (weights: numerics and speed run) or None with `preset`
    (config only: rules and compiles)."""
    model: str | None = None
    preset: str | None = None
    mode: str = "regions"
    batch_sizes: Sequence[int] = (1, 8)
    prefill_len: int = 128
    max_len: int = 1024
    dtype: str = "bfloat16"
    fp8_max: float = 240.0
    compiler_cmd: str | None = None
    repeat: int = 1
    timeout_s: float = 3600.0
    reduce_tries: int = 4
    max_reduce_tests: int = 300
    skip: frozenset = field(default_factory=frozenset)

    def __post_init__(self):
        if (self.model is None) == (self.preset is None):
            raise ValueError("the doctor examines either a checkpoint folder (--model) or a preset (--preset)")
        unknown = set(self.skip) - set(STEPS)
        if unknown:
            raise ValueError(f"--skip takes {', '.join(STEPS)}; got {', '.join(sorted(unknown))}")
        if self.repeat < 1 or self.reduce_tries < 1:
            raise ValueError(f"--repeat and the reduction's tries must be >= 1, got {self.repeat}, {self.reduce_tries}")


def _target(opts: DoctorOptions) -> Target:
    config = preset(opts.preset) if opts.preset else ModelConfig.from_file(opts.model)
    dtype = np.float32 if opts.dtype == "float32" else jax.numpy.bfloat16
    return Target.for_config(config, dtype, opts.mode, fp8_max=opts.fp8_max,
                             packed_params=opts.mode == "scan", platform="neuron")


def _safe(name: str) -> str:
    return re.sub(r"[^\w.\-]+", "_", name)


def _trivial_program() -> str:
    """A one-op module: a compiler that fails on it is broken (not installed, bad flags), not jdeep's graph."""
    return jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((8,), np.float32)).as_text()


def _dominant_code(result: ProgramCompile) -> str | None:
    codes = result.error_codes
    return max(codes, key=codes.get) if codes else None


def _program(prog, opts: DoctorOptions, compiler: Compiler, work: str, repro_dir: str, n_experts: int) -> dict:
    t0 = time.perf_counter()
    lowered = prog.lower()
    text = lowered.as_text(debug_info=True)
    entry: dict = {"name": prog.name, "bucket": prog.bucket, "lower_seconds": round(time.perf_counter() - t0, 3)}
    if "rules" not in opts.skip:
        report = check_lowered(lowered, name=prog.name, n_experts=n_experts, decode=prog.bucket["step"] == "decode")
        entry["rules"] = {"ok": report.ok, "violations": [dataclasses.asdict(v) for v in report.violations],
                          "n_args": report.stats.get("n_args"), "n_ops": report.stats.get("n_ops")}
    if "compile" in opts.skip:
        return entry
    result = compiler.compile_repeated(prog.name, text, opts.repeat, os.path.join(work, _safe(prog.name)))
    entry["compile"] = result.to_json()
    if result.failures == 0 or "reduce" in opts.skip:
        return entry
    code = _dominant_code(result)
    base = os.path.join(repro_dir, f"{_safe(prog.name)}.{_safe(code or 'failure')}")
    try:
        rep = reduce_failure(text, lambda t: compiler.fails(t, os.path.join(work, "reduce"), error_code=code,
                                                             tries=opts.reduce_tries),
                             max_tests=opts.max_reduce_tests)
    except (RuntimeError, ValueError) as e:          # e.g. the failure did not show again while reducing
        entry["reproducer"] = {"error": str(e)}
        return entry
    with open(base + ".mlir", "w") as f:
        f.write(rep.text)
    with open(base + ".sh", "w") as f:
        f.write(f"#!/bin/sh\n# {prog.name}: {code or 'failure'}, {rep.n_ops} ops"
                f"{' in stage ' + rep.stage if rep.stage else ''}; rerun a few times if the crash is intermittent\n"
                f'cd "$(dirname "$0")"\n{compiler.command_line(os.path.basename(base) + ".mlir")}\n')
    entry["reproducer"] = {"file": os.path.relpath(base + ".mlir", os.path.dirname(repro_dir)),
                           "command": os.path.relpath(base + ".sh", os.path.dirname(repro_dir)),
                           "error_code": code, "n_ops": rep.n_ops, "stage": rep.stage, "path": rep.path,
                           "tests": rep.tests}
    return entry


def _numerics(opts: DoctorOptions) -> list[dict]:
    checks = numerics.golden_checks(opts.model, "float32") + [numerics.regions_vs_scan(opts.model, "float32")]
    checks += numerics.kernels_vs_twins()
    return [dataclasses.asdict(c) for c in checks]


def _speed(opts: DoctorOptions) -> dict:
    model = load(opts.model, dtype=opts.dtype, compile_mode="regions")
    buckets = list(opts.batch_sizes)
    dispatch = speed.dispatch_cost(model, buckets)
    latency = speed.latency(model, buckets, prompt_len=min(opts.prefill_len, 64), new_tokens=16)
    for row in latency:
        row["dispatch_share_of_itl"] = round(dispatch["dispatch_ms_per_step"] / row["itl_ms_p50"], 3)
    return {"dispatch": dispatch, "latency": latency, "sampler_transfer": speed.sampler_transfer(model, buckets)}


def run_doctor(opts: DoctorOptions, out_dir: str, log=print) -> dict:
    """Run every step not in opts.skip; reproducers go to out_dir/repro. Returns the report's data."""
    t0 = time.perf_counter()
    platform = jax.default_backend()
    target = _target(opts)
    compiler = Compiler.from_string(opts.compiler_cmd, platform, neuron_generation())
    compiler.timeout_s = opts.timeout_s
    result: dict = {"options": {k: (sorted(v) if isinstance(v, frozenset) else list(v) if isinstance(v, tuple) else v)
                                for k, v in dataclasses.asdict(opts).items()},
                    "environment": environment(compiler), "programs": [], "numerics": None, "speed": None}
    repro_dir = os.path.join(out_dir, "repro")
    os.makedirs(repro_dir, exist_ok=True)
    programs = model_programs(target, tuple(opts.batch_sizes), chunk_buckets(opts.prefill_len), opts.max_len)
    log(f"doctor: {len(programs)} programs ({opts.mode} mode, {opts.dtype}), compiler: {compiler.command_line('FILE')}")
    with tempfile.TemporaryDirectory(prefix="jdeep-doctor-") as work:
        if "compile" not in opts.skip:
            check = compiler.compile(_trivial_program(), os.path.join(work, "check"))
            result["compiler_check"] = dataclasses.asdict(check)
            if not check.ok:
                log(f"doctor: the compiler fails on a one-op program ({check.error_code}: "
                    f"{' / '.join(check.log_head[:2])}); programs are lowered and checked, not compiled")
                opts = dataclasses.replace(opts, skip=opts.skip | {"compile", "reduce"})
        for i, prog in enumerate(programs):
            entry = _program(prog, opts, compiler, work, repro_dir, target.config.n_routed_experts)
            result["programs"].append(entry)
            comp = entry.get("compile")
            state = "lowered" if comp is None else f"{comp['passes']}/{len(comp['attempts'])} compiled"
            log(f"  [{i + 1}/{len(programs)}] {prog.name}: {state}"
                f"{'' if entry.get('rules', {}).get('ok', True) else ', rules FAIL'}"
                f"{', reproducer ' + entry['reproducer'].get('file', 'failed') if 'reproducer' in entry else ''}")
    if opts.model is not None and "numerics" not in opts.skip:
        result["numerics"] = _numerics(opts)
    if opts.model is not None and "speed" not in opts.skip:
        result["speed"] = _speed(opts)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result
