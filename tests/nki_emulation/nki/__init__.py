"""Emulated `nki` (see ../README.md): `simulate` runs a kernel on numpy arrays; `jit` does too, and called with
JAX arrays inside a trace it stands in for the real lowering: it emits the custom call NKI emits
(`AwsNeuronCustomNativeKernel`, a base64 JSON backend config naming the kernel) and records it in `RECORDED`.
The output shapes come from running the kernel on zeros; no numbers reach the graph (the call cannot run on CPU)."""

from __future__ import annotations

import base64
import functools
import json

import numpy as np

from . import isa, language  # noqa: F401
from .language import NKIError, NkiTensor

__all__ = ["jit", "simulate", "EMULATED", "RECORDED", "CUSTOM_CALL_TARGET"]

EMULATED = True
CUSTOM_CALL_TARGET = "AwsNeuronCustomNativeKernel"
RECORDED: list[dict] = []    # one entry per custom call emitted while tracing


def jit(fn=None, **kwargs):
    """`kernel(*numpy arrays)` runs it (as the real nki.jit runs NumPy arguments on the device); `kernel(*jax
    arrays)` under jax.jit lowers it to a custom call."""
    if fn is None:
        return functools.partial(jit, **kwargs)

    @functools.wraps(fn)
    def call(*args):
        import jax

        if any(isinstance(a, (jax.Array, jax.core.Tracer)) for a in args):
            return _custom_call(fn, args)
        return simulate(fn)(*args)

    call.kernel = fn
    return call


def _custom_call(fn, args):
    import jax

    is_array = [hasattr(a, "shape") and hasattr(a, "dtype") for a in args]
    probe = [np.zeros(a.shape, a.dtype) if arr else a for a, arr in zip(args, is_array)]
    outs = simulate(fn)(*probe)
    single = not isinstance(outs, tuple)
    outs = (outs,) if single else outs
    result = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
    scalars = {f"arg{i}": a for i, (a, arr) in enumerate(zip(args, is_array)) if not arr}
    record = {"kernel": fn.__name__, "inputs": [(tuple(a.shape), str(a.dtype)) for a, arr in zip(args, is_array) if arr],
              "outputs": [(tuple(o.shape), str(o.dtype)) for o in outs], "scalars": scalars}
    RECORDED.append(record)
    config = base64.b64encode(json.dumps({"function_name": fn.__name__, "scalars": scalars}).encode()).decode()
    res = jax.ffi.ffi_call(CUSTOM_CALL_TARGET, result, custom_call_api_version=2, legacy_backend_config=config)(
        *[a for a, arr in zip(args, is_array) if arr])
    return res[0] if single else tuple(res)


def simulate(kernel):
    """simulate(kernel)(*args): numpy arrays become HBM tensors (written back if the kernel modifies them), other
    arguments pass through; the returned tensors must be shared-HBM outputs and come back as numpy arrays."""

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        language._MATMUL_WRITTEN.clear()
        wrapped = [NkiTensor(a, language.hbm, f"arg{i}", writable=False) if isinstance(a, np.ndarray) else a
                   for i, a in enumerate(args)]
        out = kernel(*wrapped, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        for t in outs:
            if not isinstance(t, NkiTensor) or t.buffer is not language.shared_hbm:
                raise NKIError("kernel outputs must be tensors allocated with buffer=nl.shared_hbm and returned, got "
                               f"{t!r}")
        res = tuple(np.array(t.data) for t in outs)
        return res if isinstance(out, tuple) else res[0]

    return run
