"""The compiled-program cache: every jitted step and region program jdeep builds, keyed by what it depends on
(architecture, numerics, logits mode, batch-size bucket, mesh layout), so that every Model with the same key
reuses one program. `PROGRAMS.clear()` drops them all (with jax.clear_caches(), their executables too).

Each jitted program is held as a `CachedProgram`: the jitted function, plus the executables warm-up installed for
it (runtime/warmup.precompile: compiled ahead of running, or read back from the executable store,
model/executables.py, without tracing); a call whose arguments match an installed executable runs it, any other
call goes through jax.jit as usual."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Iterator

import jax
import numpy as np

from .executables import ExecutableStore

__all__ = ["ProgramCache", "PROGRAMS", "CachedProgram", "call_key", "stable_name"]


def _arg_key(a: Any) -> Hashable:
    """What tells one argument's programs apart cheaply: an array's shape and dtype, a tree's leaf shapes (dtypes and
    structure are checked by the executable itself: it refuses other arguments with a TypeError)."""
    if a is None:
        return None
    shape = getattr(a, "shape", None)
    if shape is not None and not isinstance(a, (dict, tuple, list)):
        return tuple(shape), str(a.dtype)
    return tuple(tuple(getattr(leaf, "shape", ())) for leaf in jax.tree_util.tree_leaves(a))


def call_key(args: tuple, kwargs: dict) -> Hashable:
    """The installed-executable key of a call: per positional argument _arg_key, keyword arguments by value (they are
    the static ones) unless they are arrays."""
    return (tuple(_arg_key(a) for a in args),
            tuple(sorted((k, _arg_key(v) if hasattr(v, "shape") else v) for k, v in kwargs.items())))


def _abstract(a: Any) -> Any:
    """A call's argument leaf as the jax.ShapeDtypeStruct it is compiled for (None: one the store does not take)."""
    if isinstance(a, jax.core.Tracer):
        return None
    if isinstance(a, jax.Array):
        if len(a.sharding.device_set) > 1:     # a mesh: JAX's own cache
            return None
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding, weak_type=a.weak_type)
    if isinstance(a, (np.ndarray, np.generic)):
        return jax.ShapeDtypeStruct(a.shape, a.dtype)
    return None


class CachedProgram:
    """A jitted function and the executables installed for it (by call_key). Calls with installed arguments run the
    executable (no tracing); others, and any the executable refuses (a TypeError before it runs: other shapes, or
    tracers), run through jax.jit. Everything else (lower, trace, ...) is the jitted function's.

    With the executable store on (model/executables.py, in the persistent compilation cache's folder), the first call
    with new arguments (on one device, all of them arrays) reads its executable from the store, or compiles it there
    when tracing, lowering and compiling it took at least the cache's minimum compile time (the persistent cache's
    rule), and installs it: a later process calling the same program skips the trace."""

    __slots__ = ("jitted", "ident", "executables", "_unstored", "__weakref__")   # (jax.eval_shape keeps weakrefs)

    def __init__(self, jitted: Callable, ident: str | None):
        self.jitted, self.ident, self.executables, self._unstored = jitted, ident, {}, set()

    def __call__(self, *args, **kwargs):
        if self.executables or (self.ident is not None and jax.config.jax_compilation_cache_dir):
            key = call_key(args, kwargs)
            exe = self.executables.get(key)
            if exe is None and self.ident is not None and key not in self._unstored:
                exe = self._from_store(key, args, kwargs)
            if exe is not None:
                try:
                    return exe(*args)
                except TypeError:        # not its signature after all (checked before it runs: nothing donated)
                    pass
        return self.jitted(*args, **kwargs)

    def _from_store(self, key: Hashable, args: tuple, kwargs: dict) -> Any:
        store = ExecutableStore.from_compile_cache()
        leaves, tree = jax.tree_util.tree_flatten(args)
        abstract = [_abstract(a) for a in leaves]
        if store is None or any(a is None for a in abstract) or any(hasattr(v, "shape") for v in kwargs.values()):
            if not any(isinstance(a, jax.core.Tracer) for a in leaves):
                self._unstored.add(key)          # (a traced call says nothing about a concrete one)
            return None
        return self.prepare(jax.tree_util.tree_unflatten(tree, abstract), kwargs, store,
                            min_seconds=jax.config.jax_persistent_cache_min_compile_time_secs)

    def prepare(self, args: tuple, kwargs: dict | None = None, store: ExecutableStore | None = None,
                min_seconds: float = 0.0) -> Any:
        """The executable for abstract `args` (jax.ShapeDtypeStruct trees placed as the call's arguments will be)
        and static `kwargs`, ahead of the call: read from `store` (default: the compile cache's, when on and the
        program has a stable name), else compiled (and written there); installed, and returned."""
        kwargs = kwargs or {}
        key = call_key(args, kwargs)
        if key in self.executables:
            return self.executables[key]
        if store is None and self.ident is not None:
            store = ExecutableStore.from_compile_cache()
        lower = lambda: self.jitted.lower(*args, **kwargs)     # noqa: E731
        if store is None or self.ident is None:
            exe = lower().compile()
        else:
            name = f"{self.ident}{sorted(kwargs.items())!r}"
            exe = store.load(name, args) or store.compile(name, args, lower, min_seconds)
        self.install(key, exe)
        return exe

    def install(self, key: Hashable, executable: Any) -> None:
        self.executables[key] = executable

    def _cache_size(self) -> int:
        return self.jitted._cache_size() + len(self.executables)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.jitted, name)

    def __repr__(self) -> str:
        return f"CachedProgram({self.ident or self.jitted!r}, {len(self.executables)} installed)"


def stable_name(key: Any) -> str | None:
    """The cache key as text that names the same program in every process (functions by module and qualified name),
    or None when it cannot (a closure, a lambda, an object printed with its address): such a program is never read
    from the executable store."""
    def text(k: Any) -> str:
        if isinstance(k, tuple):
            return "(" + ",".join(text(x) for x in k) + ")"
        if callable(k) and hasattr(k, "__qualname__") and not dataclasses.is_dataclass(k):
            if "<locals>" in k.__qualname__ or "<lambda>" in k.__qualname__:
                raise ValueError
            return f"{k.__module__}.{k.__qualname__}"
        return repr(k)

    try:
        out = text(key)
    except ValueError:
        return None
    return None if " at 0x" in out else out


class ProgramCache:
    """programs.get(key, make) -> the program under `key`, built by `make()` on first use (a jitted one held as a
    CachedProgram)."""

    def __init__(self):
        self._programs: dict[Hashable, Callable] = {}

    def get(self, key: Hashable, make: Callable[[], Callable]) -> Callable:
        program = self._programs.get(key)
        if program is None:
            program = make()
            if hasattr(program, "lower") and hasattr(program, "_cache_size"):      # a jitted function
                program = CachedProgram(program, stable_name(key))
            self._programs[key] = program
        return program

    def keyed(self, name: str, spec: Hashable, make: Callable[[], Callable], **options) -> Callable:
        """The program `name` of a model spec (model/spec.ModelSpec: what its programs depend on) with static
        `options`, built by make() on first use: every program of a model is keyed this one way."""
        return self.get((name, spec, tuple(sorted(options.items()))), make)

    def jit(self, fn: Callable, **jit_kwargs) -> Callable:
        """jax.jit(fn, **jit_kwargs), one per (fn, options): the small host-driven programs (sampling, state resets)."""
        key = ("jit", fn, tuple(sorted(jit_kwargs.items())))
        return self.get(key, lambda: jax.jit(fn, **jit_kwargs))

    def n_compiled(self) -> int:
        """Executables compiled (or installed) so far for the cached jitted programs (all shapes)."""
        return sum(p._cache_size() for p in self._programs.values() if hasattr(p, "_cache_size"))

    def items(self) -> Iterator[tuple[Hashable, Callable]]:
        return iter(list(self._programs.items()))

    def clear(self) -> None:
        """Forget every program (a later call builds and compiles it again)."""
        self._programs.clear()

    def __len__(self) -> int:
        return len(self._programs)


PROGRAMS = ProgramCache()
