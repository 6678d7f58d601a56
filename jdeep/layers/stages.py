"""Model stages named in the lowered program's source locations: a function decorated with `stage(name)` traces
under `jax.named_scope(name)` (debug info only: the StableHLO ops are the same). `jdeep doctor` reduces a failing
program stage by stage (STAGES) before it bisects op ranges; the hot ops add their own names (kernels/registry)."""

from __future__ import annotations

import functools
from typing import Callable

import jax

__all__ = ["STAGES", "stage", "scope"]

STAGES = ("projection", "attention_core", "compressor", "indexer", "moe.router", "moe.experts", "moe.shared", "mhc",
          "norm")


def scope(name: str):
    """The named scope of stage `name` (a context manager)."""
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    return jax.named_scope(name)


def stage(name: str) -> Callable[[Callable], Callable]:
    """Decorator: fn traced under scope(name)."""
    scope(name)

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def scoped(*args, **kwargs):
            with scope(name):
                return fn(*args, **kwargs)
        return scoped
    return deco
