"""Build jdeep's CPU kernels (rows_gemm.cc) once per machine and register them with XLA as FFI targets.

The source ships with the package and is compiled at first use with the system's C++ compiler (`$CXX`, else
`c++`/`g++`/`clang++`) against the FFI headers of the installed jaxlib, for this CPU (`-march=native`). The shared
library is cached under `$JDEEP_CACHE_DIR` (default `~/.cache/jdeep`), keyed by the source, the jaxlib version,
the compiler and the CPU, so a later process loads it in milliseconds. Where no compiler is found, or it fails,
`load()` returns None and the jnp reference runs instead (`jdeep info` says which); `JDEEP_NATIVE_CPU=0` switches
the kernels off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

__all__ = ["load", "status", "SOURCE", "TARGETS"]

SOURCE = Path(__file__).with_name("rows_gemm.cc")
# FFI target name -> the handler symbol in the library
TARGETS = {"jdeep_rows_gemm_f32": "JdeepRowsGemmF32", "jdeep_rows_gemm_bf16": "JdeepRowsGemmBF16"}
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")

_log = logging.getLogger("jdeep")
_status = {"state": "not loaded", "path": None, "reason": None}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and feature flags (Linux), else the machine name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(sorted(set(keep)))


def _cache_dir() -> Path:
    return Path(os.environ.get("JDEEP_CACHE_DIR") or Path.home() / ".cache" / "jdeep") / "cpu_kernels"


def _build(compiler: str) -> Path:
    """The cached library for this source, jaxlib, compiler and CPU; compiled (into a temporary file, then renamed,
    so concurrent processes never load a half-written library) when missing."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), jaxlib.__version__, compiler, version, _cpu_id(),
                                    " ".join(_FLAGS)]).encode()).hexdigest()[:20]
    out = _cache_dir() / f"rows_gemm-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.lru_cache(maxsize=None)
def load() -> ctypes.CDLL | None:
    """The kernels' library, built if needed and its targets registered for the CPU platform; None where they
    cannot be had (no compiler, a failed build, JDEEP_NATIVE_CPU=0). Once per process."""
    if os.environ.get("JDEEP_NATIVE_CPU", "1") == "0":
        _status.update(state="off", reason="JDEEP_NATIVE_CPU=0")
        return None
    compiler = _compiler()
    if compiler is None:
        _status.update(state="unavailable", reason="no C++ compiler ($CXX, c++, g++, clang++)")
        _log.info("jdeep: no C++ compiler found; CPU products with few rows use XLA's GEMM")
        return None
    try:
        path = _build(compiler)
        lib = ctypes.CDLL(str(path))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        _status.update(state="unavailable", reason=str(e))
        _log.info("jdeep: the CPU kernels could not be built (%s); XLA's GEMM is used", e)
        return None
    _status.update(state="loaded", path=str(path))
    return lib


def status() -> dict:
    """{"state": "not loaded" | "loaded" | "off" | "unavailable", "path": the library, "reason": why not}."""
    return dict(_status)
