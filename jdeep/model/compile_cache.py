"""JAX's persistent compilation cache for jdeep: compiled programs survive across runs (on by default in the `jdeep`
commands, `jdeep.load(..., compile_cache=True)` in a notebook; `jdeep compile` fills it ahead of a deployment).

XLA:CPU needs its code generation capped at AVX2 on AVX-512 hosts for its cache loader to read the programs back
without an ERROR line each (platforms.cache_xla_flags); that flag only takes effect if it is set before JAX
initialises its backends, so `enable` refuses (with a warning naming the fix) to turn the cache on afterwards where
the flag would be missing.

The folder holds one subfolder per jdeep source (`jdeep-<digest>`, model/executables.source_digest): JAX's cache and
jdeep's executable store (model/executables.py) inside it start empty for another jdeep, so the store only ever
receives executables compiled afresh (one JAX read back from its cache cannot be serialized again whole). Folders
of other versions are left alone (delete them to reclaim the space).
"""

from __future__ import annotations

import os
import warnings

import jax
from jax._src import xla_bridge

from ..platforms import CACHE_MAX_ISA_FLAG, cache_xla_flags
from .executables import source_digest

__all__ = ["default_path", "enable", "MIN_COMPILE_SECONDS"]

# programs compiled faster than this are not written (reading one back costs about as much as compiling it)
MIN_COMPILE_SECONDS = 0.5


def default_path() -> str:
    """$JDEEP_COMPILE_CACHE, else $XDG_CACHE_HOME/jdeep/jax (~/.cache/jdeep/jax)."""
    return os.environ.get("JDEEP_COMPILE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jdeep", "jax")


def enable(path: str | os.PathLike | None = None) -> str | None:
    """Turn the persistent compilation cache on at `path` (default: default_path()); returns the folder JAX writes
    (this jdeep's subfolder of it), or None
    when it stays off: $JDEEP_NO_COMPILE_CACHE is set, or JAX's CPU backend already started without the flag its
    cache loader needs (a warning says to enable the cache first)."""
    if os.environ.get("JDEEP_NO_COMPILE_CACHE"):
        return None
    flags = cache_xla_flags(os.environ.get("XLA_FLAGS", ""))
    if xla_bridge.backends_are_initialized():
        if flags != os.environ.get("XLA_FLAGS", "") and jax.default_backend() == "cpu":
            warnings.warn("compile_cache: JAX's CPU backend started before the cache was enabled, without "
                          f"{CACHE_MAX_ISA_FLAG} (its cache loader would log an ERROR per program read back); the cache "
                          "stays off. Pass compile_cache to the first jdeep.load, or set XLA_FLAGS="
                          f"{CACHE_MAX_ISA_FLAG} before importing jax.", stacklevel=3)
            return None
    else:
        os.environ["XLA_FLAGS"] = flags
    folder = os.fspath(path) if path is not None else default_path()
    versioned = os.path.join(folder, f"jdeep-{source_digest()[:16]}")
    os.makedirs(versioned, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", versioned)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return folder
