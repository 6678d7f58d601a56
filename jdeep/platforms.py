"""Which platform jdeep runs on and what that platform needs (see docs/neuron.md).

    cpu / gpu   XLA's own backends: OCP e4m3fn fp8 (max 448), layers under lax.scan.
    neuron      AWS Trainium/Inferentia through the libneuronxla PJRT plugin. trn1/trn2 have only the
                IEEE-style e4m3 (max 240): activations and KV are quantized to that range and checkpoint
                fp8 weights are rescaled into it at load (io/trn2_rescale.py). The compiler gets the
                options below; the default compile mode is `regions` (neuronx-cc unrolls while loops, so a
                scan over 43-61 layers would be compiled layer by layer anyway).

Nothing here imports the Neuron toolchain; `configure_neuron` only edits environment variables, which
libneuronxla reads when it compiles.
"""

from __future__ import annotations

import os
import platform as _platform
from dataclasses import dataclass
from typing import MutableMapping

import jax

from .kernels.codecs import E4M3_TRN2_MAX, E4M3FN_MAX
from .kernels.neuron_target import default_lnc, logical_nc_config, neuron_generation

__all__ = ["Platform", "device_memory", "current", "platform_for", "neuron_generation", "neuron_cc_flags", "configure_neuron",
           "compile_mode", "COMPILE_MODES", "cache_xla_flags", "logical_nc_config", "default_lnc"]

COMPILE_MODES = ("scan", "regions")

# Lets neuronx-cc accept OCP float8_e4m3fn by reading its bytes as trn2's e4m3 (only values <= 240 survive).
# jdeep keeps fp8 codes as uint8 (graphcheck S13), so this is a guard for NKI kernels and user code; it must
# not be passed on trn3, where it clashes with kernels that emit OCP fp8 (NCC_EOCP001).
FP8_REINTERPRET_FLAG = "--internal-hlo2tensorizer-options=--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"

# XLA:CPU (jaxlib <= 0.10) appends the LLVM tuning attributes +prefer-no-gather/+prefer-no-scatter to the target
# features of every program it compiles for an AVX-512 host; its AOT loader then takes them for ISA features the
# host lacks and logs an ERROR for each program read back from the persistent cache (openxla/xla#44565,
# jax-ml/jax#38445). Capping XLA's own code generation at AVX2 leaves only real ISA features in the record, so the
# check passes on the machine that compiled it and still fires for a cache copied from a wider machine.
CACHE_MAX_ISA_FLAG = "--xla_cpu_max_isa=AVX2"


@dataclass(frozen=True)
class Platform:
    name: str            # "cpu", "gpu" or "neuron"
    generation: str      # "trn1", "trn2", "trn3" on neuron, else ""
    fp8_max: float       # largest fp8 magnitude for activations, KV and weight codes
    compile_mode: str    # default compile mode
    host_loop: bool      # whether jdeep.generate must drive decode steps from the host

    @property
    def is_neuron(self) -> bool:
        return self.name == "neuron"


def platform_for(name: str, generation: str = "trn2") -> Platform:
    """The defaults of a platform by name ("cpu", "gpu"/"cuda"/"rocm", "neuron")."""
    name = {"cuda": "gpu", "rocm": "gpu"}.get(name, name)
    if name == "neuron":
        fp8 = E4M3FN_MAX if generation == "trn3" else E4M3_TRN2_MAX
        return Platform("neuron", generation, fp8, "regions", host_loop=True)
    return Platform(name, "", E4M3FN_MAX, "scan", host_loop=False)


def current() -> Platform:
    """The platform of JAX's default backend (initialises JAX's backends)."""
    name = jax.default_backend()
    return platform_for(name, neuron_generation() if name == "neuron" else "")


def neuron_cc_flags(existing: str, generation: str, cache_dir: str | None) -> str:
    """NEURON_CC_FLAGS with what jdeep needs added to the user's own flags (which win where they overlap)."""
    flags = existing.split()
    if generation in ("trn1", "trn2") and FP8_REINTERPRET_FLAG not in flags:
        flags.append(FP8_REINTERPRET_FLAG)
    if cache_dir and not any(f.startswith("--cache_dir") for f in flags):
        flags.append(f"--cache_dir={cache_dir}")
    return " ".join(flags)


def configure_neuron(env: MutableMapping[str, str] | None = None, generation: str | None = None,
                     cache_dir: str | None = None) -> dict[str, str]:
    """Set the environment libneuronxla compiles with; returns the variables it changed.

    NEURON_CC_FLAGS gains the fp8 reinterpret flag (trn1/trn2) and a NEFF cache directory
    (`cache_dir`, default $JDEEP_NEURON_CACHE or ~/.cache/jdeep/neuron); NEURON_LOGICAL_NC_CONFIG
    defaults to 2 (trn2's default LNC). Call before the first compilation."""
    env = os.environ if env is None else env
    generation = generation or neuron_generation(env)
    cache_dir = cache_dir or env.get("JDEEP_NEURON_CACHE") or os.path.join(
        env.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jdeep", "neuron")
    changed = {"NEURON_CC_FLAGS": neuron_cc_flags(env.get("NEURON_CC_FLAGS", ""), generation, cache_dir)}
    if generation in ("trn2", "trn3") and "NEURON_LOGICAL_NC_CONFIG" not in env:
        changed["NEURON_LOGICAL_NC_CONFIG"] = str(default_lnc(generation))
    changed = {k: v for k, v in changed.items() if env.get(k) != v}
    env.update(changed)
    return changed


def compile_mode(requested: str | None, platform: Platform) -> str:
    """The compile mode of a run: the argument, else $JDEEP_COMPILE_MODE, else the platform's default."""
    mode = requested or os.environ.get("JDEEP_COMPILE_MODE") or platform.compile_mode
    if mode not in COMPILE_MODES:
        source = "compile_mode" if requested else "JDEEP_COMPILE_MODE"
        raise ValueError(f"{source} must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    return mode


def cache_xla_flags(existing: str, machine: str | None = None) -> str:
    """XLA_FLAGS for a process that keeps XLA:CPU programs in the persistent compilation cache: on x86-64, the user's
    flags plus CACHE_MAX_ISA_FLAG (unless they set --xla_cpu_max_isa themselves); elsewhere unchanged. Takes effect
    only if set before JAX initialises its backends."""
    flags = existing.split()
    if ((machine or _platform.machine()).lower() not in ("x86_64", "amd64")
            or any(f.startswith("--xla_cpu_max_isa") for f in flags)):
        return existing
    return " ".join(flags + [CACHE_MAX_ISA_FLAG])


def device_memory() -> int:
    """Bytes of memory of the default device: its allocator's limit (GPU), else the host's RAM (CPU)."""
    stats = None
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 (backends without memory stats raise various errors)
        pass
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
