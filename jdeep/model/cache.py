"""The compiled-program cache: every jitted step and region program jdeep builds, keyed by what it depends on
(architecture, numerics, logits mode, batch-size bucket, mesh layout), so that every Model with the same key
reuses one program. `PROGRAMS.clear()` drops them all (with jax.clear_caches(), their executables too)."""

from __future__ import annotations

from typing import Callable, Hashable, Iterator

import jax

__all__ = ["ProgramCache", "PROGRAMS"]


class ProgramCache:
    """programs.get(key, make) -> the program under `key`, built by `make()` on first use."""

    def __init__(self):
        self._programs: dict[Hashable, Callable] = {}

    def get(self, key: Hashable, make: Callable[[], Callable]) -> Callable:
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = make()
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
        """Executables compiled so far by the cached jitted programs (all shapes)."""
        return sum(p._cache_size() for p in self._programs.values() if hasattr(p, "_cache_size"))

    def items(self) -> Iterator[tuple[Hashable, Callable]]:
        return iter(list(self._programs.items()))

    def clear(self) -> None:
        """Forget every program (a later call builds and compiles it again)."""
        self._programs.clear()

    def __len__(self) -> int:
        return len(self._programs)


PROGRAMS = ProgramCache()
