"""Emulated `nki` (see ../README.md): `simulate` runs a kernel on numpy arrays; `jit` does too, and called with
JAX arrays inside a trace it stands in for the real lowering: it emits the custom call NKI emits
(`AwsNeuronCustomNativeKernel`, a base64 JSON backend config naming the kernel) and records it in `RECORDED`.
The output shapes come from running the kernel on zeros; no numbers reach the graph (the call cannot run on CPU).
Inside `host_execution()` the call becomes a `jax.pure_callback` that runs the kernel under `simulate` instead, so
a whole model step on the neuron path can run on CPU with every kernel emulated (tests compare it to the jnp path)."""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import threading

import numpy as np

from . import isa, language  # noqa: F401
from .language import NKIError, NkiTensor

__all__ = ["jit", "simulate", "host_execution", "EMULATED", "RECORDED", "CUSTOM_CALL_TARGET"]

EMULATED = True
CUSTOM_CALL_TARGET = "AwsNeuronCustomNativeKernel"
RECORDED: list[dict] = []    # one entry per custom call emitted while tracing
_HOST_EXECUTION = False
_SIMULATING = threading.RLock()   # the emulation's PSUM bookkeeping is global: one kernel at a time (XLA may run
                                 # host callbacks on several threads)


@contextlib.contextmanager
def host_execution():
    """Kernels called inside a trace run on the host under `simulate` (a pure_callback) instead of lowering to the
    custom call. Emulation only: the real nki.jit has no such mode."""
    global _HOST_EXECUTION
    before, _HOST_EXECUTION = _HOST_EXECUTION, True
    try:
        yield
    finally:
        _HOST_EXECUTION = before


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
    arrays = [a for a, arr in zip(args, is_array) if arr]
    if _HOST_EXECUTION:
        def host(*values):
            it = iter(values)
            outs = simulate(fn)(*[np.asarray(next(it)) if arr else a for a, arr in zip(args, is_array)])
            return outs if isinstance(outs, tuple) else (outs,)

        res = jax.pure_callback(host, result, *arrays)
        return res[0] if single else tuple(res)
    config = base64.b64encode(json.dumps({"function_name": fn.__name__, "scalars": scalars}).encode()).decode()
    res = jax.ffi.ffi_call(CUSTOM_CALL_TARGET, result, custom_call_api_version=2, legacy_backend_config=config)(
        *arrays)
    return res[0] if single else tuple(res)


def simulate(kernel):
    """simulate(kernel)(*args): numpy arrays become HBM tensors (read-only copies), other
    arguments pass through; the returned tensors must be shared-HBM outputs and come back as numpy arrays."""

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        with _SIMULATING:
            return _run(*args, **kwargs)

    def _run(*args, **kwargs):
        language._MATMUL_WRITTEN.clear()
        # each array argument gets storage of its own (a copy), as a kernel input is its own HBM tensor: access
        # patterns address a tensor's storage, and a numpy view of a larger array would expose its base's
        wrapped = [NkiTensor(np.array(a, order="C"), language.hbm, f"arg{i}", writable=False)
                   if isinstance(a, np.ndarray) else a for i, a in enumerate(args)]
        out = kernel(*wrapped, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        for t in outs:
            if not isinstance(t, NkiTensor) or t.buffer is not language.shared_hbm:
                raise NKIError("kernel outputs must be tensors allocated with buffer=nl.shared_hbm and returned, got "
                               f"{t!r}")
        res = tuple(np.array(t.data) for t in outs)
        return res if isinstance(out, tuple) else res[0]

    return run
