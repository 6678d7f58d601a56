"""Every NKI kernel has a jnp twin registered under the same op name, with the same signature; the neuron
platform's dispatch picks the kernels, every other platform the references."""

from __future__ import annotations

import inspect

import jax

from jdeep import kernels
from jdeep.kernels import nki as nki_kernels


def _params(fn) -> list[tuple]:
    """Names, kinds and defaults (annotations are documentation)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_every_kernel_has_a_twin_with_its_signature():
    nki_kernels.register_all()
    impls = kernels.registered()
    assert set(nki_kernels.KERNELS) <= set(impls)
    for op in nki_kernels.KERNELS:
        assert "reference" in impls[op] and "neuron" in impls[op], op
        ours, twin = kernels.implementation(op, "neuron"), kernels.implementation(op, "reference")
        assert _params(ours) == _params(twin), op
        assert callable(getattr(nki_kernels.module(op), nki_kernels.KERNELS[op][2]))
    assert jax.default_backend() != "neuron"
    for op in nki_kernels.KERNELS:          # not on Neuron: the references
        assert kernels.get(op) is kernels.implementation(op, "reference")
