"""Hot ops: one dispatch point choosing the implementation of each op per platform.

The pure-jnp reference of every op lives in `reference.py`; it is the spec and the CPU/GPU path.
NKI kernels (kernels/nki, Neuron) register under the same names when `get` is first called with JAX's
default backend `neuron`; nothing else imports the Neuron toolchain.
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


_NEURON_LOADED = False


def _backend() -> str:
    return jax.default_backend()


def get(name: str) -> Callable:
    """The implementation of op `name` for the current backend (falls back to the reference). On the neuron
    platform the NKI kernels (kernels/nki, which import the `nki` package) are registered at the first call."""
    global _NEURON_LOADED
    backend = _backend()
    if backend == "neuron" and not _NEURON_LOADED:
        from .nki import register_all

        register_all()
        _NEURON_LOADED = True
    impls = _IMPLS[name]
    return impls.get(backend, impls["reference"])


def registered() -> dict[str, tuple[str, ...]]:
    return {k: tuple(v) for k, v in _IMPLS.items()}


from . import kv_record, kv_record_v41, quant, reference  # noqa: E402,F401  (register the reference ops)
