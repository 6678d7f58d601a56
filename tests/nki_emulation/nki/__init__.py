"""Emulated `nki` (see ../README.md): `jit` wraps a kernel in a `Kernel`, launched at LNC=1 as `kernel(...)` or at a
chosen LNC as `kernel[lnc](...)`; `simulate` runs a kernel (or a `kernel[lnc]` launch: one program per logical core,
`nl.program_id` 0 .. lnc-1, sharing the kernel's shared-HBM outputs) on numpy arrays.

Before a kernel first runs or is traced, its source is checked against the Python the NKI compiler accepts
(`nki.subset`). Called with JAX arrays inside a trace, a kernel stands in for NKI's JAX lowering: it emits the custom
call jax-neuronx emits (`AwsNeuronCustomNativeKernel`, API_VERSION_STATUS_RETURNING, the kernel's array arguments then
an s8[128, 128] constant operand, a base64 JSON backend config whose `klir_binary.binary` is the absolute path of the
kernel's compiled artifact, written here as a JSON stand-in under ARTIFACT_DIR), records it in `RECORDED`, and checks
that the launch LNC matches NEURON_LOGICAL_NC_CONFIG (on hardware a mismatch is a runtime error). Output shapes come
from running the kernel on zeros; no numbers reach the graph. Inside `host_execution()` the call becomes a
`jax.pure_callback` that runs the kernel under `simulate` instead, so a whole model step on the neuron path can run
on CPU with every kernel emulated."""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import inspect
import json
import os
import tempfile
import threading

import numpy as np

from . import isa, language  # noqa: F401
from .language import NKIError, NkiTensor
from .subset import SubsetError, check_kernel

__all__ = ["jit", "simulate", "host_execution", "Kernel", "EMULATED", "RECORDED", "CUSTOM_CALL_TARGET",
           "ARTIFACT_DIR", "expected_lnc", "launch_stats", "SubsetError"]

EMULATED = True
CUSTOM_CALL_TARGET = "AwsNeuronCustomNativeKernel"
API_VERSION_STATUS_RETURNING = 2
MAX_LNC = 2                              # trn2 / trn3: two physical cores per logical core
RECORDED: list[dict] = []                # one entry per custom call emitted while tracing
ARTIFACT_DIR = os.path.join(tempfile.gettempdir(), "nki-emulation-artifacts")
_HOST_EXECUTION = False
_SIMULATING = threading.RLock()   # the emulation's launch bookkeeping is global: one kernel at a time (XLA may run
                                 # host callbacks on several threads)
_LAST_STATS: dict = {}


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


def expected_lnc(env=None) -> int:
    """The LNC the Neuron runtime runs kernels at: NEURON_LOGICAL_NC_CONFIG, else the target's default (2 on trn2 and
    trn3, 1 on trn1), the target from NEURON_PLATFORM_TARGET_OVERRIDE (default trn2)."""
    env = os.environ if env is None else env
    if env.get("NEURON_LOGICAL_NC_CONFIG"):
        return int(env["NEURON_LOGICAL_NC_CONFIG"])
    target = env.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2").lower()
    return 1 if target in ("trn1", "inf2", "gen2") else 2


class Kernel:
    """An `nki.jit` kernel; `kernel[lnc]` is the same kernel launched on `lnc` logical cores."""

    def __init__(self, fn, grid: int | None = None):
        self.fn, self.grid = fn, grid
        functools.update_wrapper(self, fn)

    @property
    def kernel(self):
        return self.fn

    @property
    def lnc(self) -> int:
        return self.grid or 1

    def __getitem__(self, lnc) -> "Kernel":
        if isinstance(lnc, bool) or not isinstance(lnc, (int, np.integer)) or not 1 <= int(lnc) <= MAX_LNC:
            raise NKIError(f"kernel[{lnc!r}]: the launch takes one LNC degree, 1..{MAX_LNC} on trn2")
        return Kernel(self.fn, int(lnc))

    def __call__(self, *args):
        import jax

        check_kernel(self.fn)
        if any(isinstance(a, (jax.Array, jax.core.Tracer)) for a in args):
            want = expected_lnc()
            if self.lnc != want:
                raise NKIError(f"{self.fn.__name__} launched at LNC={self.lnc} where NEURON_LOGICAL_NC_CONFIG is {want}:"
                               f" the Neuron runtime refuses the mismatch (nki.jit: call it as kernel[{want}](...))")
            return _custom_call(self, args)
        return simulate(self)(*args)


def jit(fn=None, **kwargs):
    """`kernel(*numpy arrays)` runs it (as the real nki.jit runs NumPy arguments on the device); `kernel(*jax
    arrays)` under jax.jit lowers it to a custom call."""
    if fn is None:
        return functools.partial(jit, **kwargs)
    return Kernel(fn)


def launch_stats() -> dict:
    """Of the last simulated launch: the peak SBUF and PSUM bytes per partition of its busiest program."""
    return dict(_LAST_STATS)


def _arg_names(fn, n: int) -> list[str]:
    params = list(inspect.signature(fn).parameters)
    return [params[i] if i < len(params) else f"arg{i}" for i in range(n)]


def _artifact(kernel: Kernel, inputs, outputs, scalars) -> str:
    """Write the kernel's compiled-artifact stand-in (the real lowering writes BIR JSON under NKI's cache, in a
    folder named by a hash) and return its absolute path."""
    source = inspect.getsource(kernel.fn)
    record = {"func_name": f"{kernel.fn.__module__}.{kernel.fn.__name__}", "grid": kernel.lnc,
              "inputs": inputs, "outputs": outputs, "scalars": {k: repr(v) for k, v in scalars.items()},
              "source_sha256": hashlib.sha256(source.encode()).hexdigest(), "emulated": True}
    blob = json.dumps(record, sort_keys=True).encode()
    folder = os.path.join(ARTIFACT_DIR, hashlib.sha256(blob).hexdigest()[:16])
    path = os.path.join(folder, f"{kernel.fn.__name__}.json")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    return path


def backend_config(kernel: Kernel, arg_names: list[str], n_outputs: int, path: str) -> dict:
    """The JSON jax-neuronx puts (base64) in the custom call's backend_config (NKI 0.6, FrameworkConfig)."""
    target = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2").lower()
    return {"func_name": f"{kernel.fn.__module__}.{kernel.fn.__name__}", "platform_target": target,
            "kernel_format": "bir", "kernel_version": 1,
            "klir_binary": {"binary": path, "input_names": arg_names,
                            "output_names": [f"output{i}" for i in range(n_outputs)], "version_identifier": "",
                            "aliases": []},
            "grid": kernel.lnc, "has_collectives": False, "mac_count": 0}


def _custom_call(kernel: Kernel, args):
    import jax
    import jax.numpy as jnp

    fn = kernel.fn
    is_array = [hasattr(a, "shape") and hasattr(a, "dtype") for a in args]
    probe = [np.zeros(a.shape, a.dtype) if arr else a for a, arr in zip(args, is_array)]
    outs = simulate(kernel)(*probe)
    stats = launch_stats()
    single = not isinstance(outs, tuple)
    outs = (outs,) if single else outs
    result = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
    names = _arg_names(fn, len(args))
    scalars = {names[i]: a for i, (a, arr) in enumerate(zip(args, is_array)) if not arr}
    inputs = [(tuple(a.shape), str(a.dtype)) for a, arr in zip(args, is_array) if arr]
    outputs = [(tuple(o.shape), str(o.dtype)) for o in outs]
    record = {"kernel": fn.__name__, "inputs": inputs, "outputs": outputs, "scalars": scalars, "grid": kernel.lnc,
              "sbuf_peak_bytes": stats["sbuf_peak_bytes"], "psum_peak_bytes": stats["psum_peak_bytes"]}
    RECORDED.append(record)
    arrays = [a for a, arr in zip(args, is_array) if arr]
    if _HOST_EXECUTION:
        def host(*values):
            it = iter(values)
            outs = simulate(kernel)(*[np.asarray(next(it)) if arr else a for a, arr in zip(args, is_array)])
            return outs if isinstance(outs, tuple) else (outs,)

        res = jax.pure_callback(host, result, *arrays)
        return res[0] if single else tuple(res)
    path = _artifact(kernel, inputs, outputs, scalars)
    config = backend_config(kernel, [n for n, arr in zip(names, is_array) if arr], len(outs), path)
    record["backend_config"] = config
    encoded = base64.b64encode(json.dumps(config).encode()).decode()
    constant = jnp.asarray(np.eye(128, dtype=np.int8))         # the s8[128, 128] operand the lowering appends
    res = jax.ffi.ffi_call(CUSTOM_CALL_TARGET, result, custom_call_api_version=API_VERSION_STATUS_RETURNING,
                           legacy_backend_config=encoded)(*arrays, constant)
    return res[0] if single else tuple(res)


def simulate(kernel, check: bool = True):
    """simulate(kernel)(*args), simulate(kernel[lnc])(*args): numpy arrays become HBM tensors (read-only copies),
    other arguments pass through; each program of the launch runs in turn (program_id 0 .. lnc-1). The returned
    tensors must be shared-HBM outputs, written in full, each element by one program; they come back as numpy
    arrays. check=False (emulation only) skips the NKI subset check, for tests of single instructions written as
    closures."""
    if not isinstance(kernel, Kernel):
        kernel = Kernel(kernel)

    @functools.wraps(kernel.fn)
    def run(*args, **kwargs):
        if check:
            check_kernel(kernel.fn)
        with _SIMULATING:
            return _run(kernel, *args, **kwargs)

    return run


def _run(kernel: Kernel, *args, **kwargs):
    language._MATMUL_WRITTEN.clear()
    language._WRITER.clear()
    grid = kernel.grid
    programs = grid or 1
    shared: list = []
    peak = {"sbuf": 0, "psum": 0}
    result = None
    for pid in range(programs):
        launch = language._Launch(ndim=0 if grid is None else 1, num=programs, pid=pid, shared=shared)
        language._LAUNCH = launch
        try:
            # each array argument gets storage of its own (a copy), as a kernel input is its own HBM tensor: access
            # patterns address a tensor's storage, and a numpy view of a larger array would expose its base's
            wrapped = [NkiTensor(np.array(a, order="C"), language.hbm, f"arg{i}", writable=False)
                       if isinstance(a, np.ndarray) else a for i, a in enumerate(args)]
            out = kernel.fn(*wrapped, **kwargs)
        finally:
            language._LAUNCH = language._Launch()
        outs = out if isinstance(out, tuple) else (out,)
        for t in outs:
            if not isinstance(t, NkiTensor) or t.buffer is not language.shared_hbm:
                raise NKIError("kernel outputs must be tensors allocated with buffer=nl.shared_hbm and returned, got "
                               f"{t!r}")
        if result is None:
            result = out
        elif tuple(id(t.data) for t in outs) != tuple(id(t.data) for t in (result if isinstance(result, tuple)
                                                                          else (result,))):
            raise NKIError(f"program {pid} returns other tensors than program 0: an LNC launch returns one set of "
                           "shared outputs")
        for k in peak:
            peak[k] = max(peak[k], launch.peak[k])
    outs = result if isinstance(result, tuple) else (result,)
    for i, t in enumerate(outs):
        flags = language.writer(t)
        if flags is not None and (flags < 0).any():
            raise NKIError(f"{kernel.fn.__name__}: output {i} {t.shape} has {int((flags < 0).sum())} elements no program"
                           " wrote (uninitialised HBM on hardware)")
    _LAST_STATS.clear()
    _LAST_STATS.update({"sbuf_peak_bytes": peak["sbuf"], "psum_peak_bytes": peak["psum"], "programs": programs})
    res = tuple(np.array(t.data) for t in outs)
    return res if isinstance(result, tuple) else res[0]
