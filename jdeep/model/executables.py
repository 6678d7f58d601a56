"""The executable store: compiled programs serialized to disk by what they are, so a later process loads them without
tracing or lowering (warm-up with a filled store costs a read per program; with JAX's persistent compilation cache
alone it still traces and lowers every program, ~2 s each for the demo model's steps).

A program is named by what builds it and what it is given: its ProgramCache key as stable text (cache.stable_name:
the model spec, the logits mode, the window rows, ...), its static options and its abstract arguments (tree
structure, shapes, dtypes, shardings), together with everything else a trace depends on: a digest of jdeep's own
source files, the jax and jaxlib versions, the backend and its devices, XLA_FLAGS, NEURON_CC_FLAGS and every JDEEP_*
variable, and the JAX flags that change traced values. Any change there names another file. The store lives in the
persistent compilation cache's folder (`jdeep-executables/`); it is on where that cache is on (compile_cache.py) and
for programs on one device (a device mesh compiles through JAX's cache).

Files (zlib-compressed: a CPU executable shrinks about sixfold) are written whole (a temporary file renamed into place) and a file that cannot be read is ignored and written
again. Only executables this process compiled are written: one JAX read back from its own persistent cache (the same
program under another name, or one compiled by a process without the store) does not serialize whole (running it
after a reload fails with "Function ... not found"), so `compile` tells the two apart (JAX's cache-hit event, in the
compiling thread)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import pickle
import threading
import time
import zlib
from typing import Any

import jax
import jaxlib
from jax.experimental import serialize_executable

__all__ = ["ExecutableStore", "source_digest"]

FOLDER = "jdeep-executables"
log = logging.getLogger(__name__)       # DEBUG: each read and write (JAX_DEBUG_LOG_MODULES=jdeep.model.executables)
_TRACE_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion", "jax_default_prng_impl")


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of jdeep's Python sources (every .py file under the package, by relative path and content)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _environment() -> str:
    devices = jax.devices()
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith("JDEEP_") or k in ("XLA_FLAGS", "NEURON_CC_FLAGS", "JAX_PLATFORMS"))
    flags = [(f, str(getattr(jax.config, f, None))) for f in _TRACE_FLAGS]
    return repr((source_digest(), jax.__version__, jaxlib.__version__, devices[0].platform,
                 getattr(devices[0].client, "platform_version", ""), [d.device_kind for d in devices], env, flags))


_hits = threading.local()


def _on_event(event: str, **kwargs: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _hits.n = getattr(_hits, "n", 0) + 1


jax.monitoring.register_event_listener(_on_event)


def _signature(args: tuple) -> str:
    leaves, tree = jax.tree_util.tree_flatten(args)
    return repr((str(tree), [(tuple(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False)),
                              repr(getattr(a, "sharding", None))) for a in leaves]))


class ExecutableStore:
    """store.load(name, args) -> the executable or None; store.save(name, args, compiled)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = pathlib.Path(folder)

    @classmethod
    def from_compile_cache(cls) -> "ExecutableStore | None":
        """The store inside JAX's persistent compilation cache folder, or None when that cache is off."""
        folder = jax.config.jax_compilation_cache_dir
        return cls(os.path.join(folder, FOLDER)) if folder else None

    def path(self, name: str, args: tuple) -> pathlib.Path:
        h = hashlib.sha256("\0".join((_environment(), name, _signature(args))).encode()).hexdigest()
        return self.folder / f"{h}.bin"

    def load(self, name: str, args: tuple) -> Any | None:
        """The executable stored for program `name` over abstract `args`, loaded onto the default device; None if
        there is none (or it cannot be read)."""
        path = self.path(name, args)
        try:
            payload, in_tree, out_tree = pickle.loads(zlib.decompress(path.read_bytes()))
            exe = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
            log.debug("read %s from the executable store (%s)", name[:80], path.name)
            return exe
        except FileNotFoundError:
            return None
        except Exception:                # noqa: BLE001 (a torn or foreign file: compile again and overwrite it)
            return None

    def compile(self, name: str, args: tuple, lower, min_seconds: float = 0.0) -> Any:
        """lower().compile(), written to the store unless JAX read it from its persistent cache or it took less than
        min_seconds (tracing, lowering and compiling)."""
        before, t0 = getattr(_hits, "n", 0), time.perf_counter()
        compiled = lower().compile()
        if getattr(_hits, "n", 0) == before and time.perf_counter() - t0 >= min_seconds:
            self.save(name, args, compiled)
        return compiled

    def save(self, name: str, args: tuple, compiled: Any) -> None:
        """Write the executable (quietly skipped if it cannot be serialized or written: it is only a cache)."""
        path = self.path(name, args)
        try:
            blob = zlib.compress(pickle.dumps(serialize_executable.serialize(compiled)), 1)
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(blob)
            os.replace(tmp, path)
            log.debug("wrote %s to the executable store (%s)", name[:80], path.name)
        except Exception:                # noqa: BLE001
            pass
