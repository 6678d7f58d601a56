"""XLA:CPU as the doctor's stand-in compiler: `python -m jdeep.tools.dev.doctor.xla_cpu_cc FILE.mlir` compiles a StableHLO
module for one CPU device and writes the serialized executable beside it (FILE.xla); a compile error goes to stderr
with exit status 1. Off a Neuron host it lets the whole bring-up run (and be tested) on any machine."""

from __future__ import annotations

import sys

import jax
import jax.extend
from jax._src.lib import xla_client

__all__ = ["compile_file", "main"]


def compile_file(path: str) -> str:
    """Compile path's StableHLO; returns the path of the serialized executable."""
    with open(path) as f:
        text = f.read()
    backend = jax.extend.backend.get_backend("cpu")
    devices = xla_client.DeviceList(tuple(backend.devices()[:1]))
    executable = backend.compile_and_load(text, devices, xla_client.CompileOptions())
    out = path.rsplit(".", 1)[0] + ".xla"
    with open(out, "wb") as f:
        f.write(executable.serialize())
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m jdeep.tools.dev.doctor.xla_cpu_cc FILE.mlir", file=sys.stderr)
        return 2
    try:
        compile_file(argv[0])
    except Exception as e:  # noqa: BLE001 - any compiler error is this command's failure, reported as such
        print(f"error: XLA:CPU could not compile {argv[0]}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
