"""Hot ops: one dispatch point choosing the implementation of each op per platform.

The pure-jnp reference of every op lives in `reference.py`; it is the spec and the CPU/GPU path.
NKI kernels (Neuron) register under the same names and are chosen only when JAX's default backend
is `neuron`; nothing here imports the Neuron toolchain.
"""

from __future__ import annotations

from typing import Callable

import jax

__all__ = ["register", "get", "registered"]

_IMPLS: dict[str, dict[str, Callable]] = {}


def register(name: str, platform: str = "reference") -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        _IMPLS.setdefault(name, {})[platform] = fn
        return fn

    return deco


def get(name: str) -> Callable:
    """The implementation of op `name` for the current backend (falls back to the reference)."""
    impls = _IMPLS[name]
    return impls.get(jax.default_backend(), impls["reference"])


def registered() -> dict[str, tuple[str, ...]]:
    return {k: tuple(v) for k, v in _IMPLS.items()}


from . import kv_record, kv_record_v41, quant, reference  # noqa: E402,F401  (register the reference ops)
