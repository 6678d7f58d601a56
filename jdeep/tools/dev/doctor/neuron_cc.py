"""neuronx-cc as the doctor's compiler: `python -m jdeep.tools.dev.doctor.neuron_cc [--target trn2] [--neuronx-cc PATH]
FILE.mlir` turns the StableHLO module into the HLO proto the compiler's XLA frontend reads (FILE.hlo.pb, what
libneuronxla hands it) and runs `neuronx-cc compile FILE.hlo.pb --framework XLA --target T --logical-nc-config N
--output FILE.neff` with the flags jdeep's programs are compiled with under the plugin (NEURON_CC_FLAGS as
jdeep.platforms.configure_neuron sets them, less libneuronxla's own --cache_dir). The compiler's exit status and
log are this command's, so its NCC_* error codes reach the doctor unchanged."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

from jax._src.lib import xla_client

from ....kernels.neuron_target import logical_nc_config, neuron_generation
from ....platforms import neuron_cc_flags

__all__ = ["hlo_proto", "compiler_argv", "main"]


def hlo_proto(stablehlo_text: str) -> bytes:
    """A StableHLO module (text) as a serialized HloModuleProto."""
    computation = xla_client._xla.mlir.mlir_module_to_xla_computation(stablehlo_text, use_tuple_args=False,
                                                                      return_tuple=False)
    return computation.as_serialized_hlo_module_proto()


def compiler_argv(hlo_path: str, target: str, lnc: int, env_flags: str, executable: str = "neuronx-cc") -> list[str]:
    """The neuronx-cc command line for one HLO proto."""
    flags = [f for f in shlex.split(neuron_cc_flags(env_flags, target, None)) if not f.startswith("--cache_dir")]
    argv = [executable, "compile", hlo_path, "--framework", "XLA", "--target", target]
    if target != "trn1" and not any(f in ("--logical-nc-config", "-lnc") or f.startswith("--logical-nc-config=")
                                    for f in flags):
        argv += ["--logical-nc-config", str(lnc)]
    return argv + flags + ["--output", hlo_path.rsplit(".hlo.pb", 1)[0] + ".neff"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jdeep.tools.dev.doctor.neuron_cc", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="trn1 | trn2 | trn3 (default: this instance's generation)")
    p.add_argument("--neuronx-cc", default="neuronx-cc", help="the compiler executable")
    p.add_argument("file", help="StableHLO module (text)")
    args = p.parse_args(argv)
    target = args.target or neuron_generation()
    with open(args.file) as f:
        text = f.read()
    try:
        proto = hlo_proto(text)
    except Exception as e:  # noqa: BLE001 - a module XLA cannot read fails here, before neuronx-cc
        print(f"error: cannot convert {args.file} to an HLO proto: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    hlo_path = args.file.rsplit(".", 1)[0] + ".hlo.pb"
    with open(hlo_path, "wb") as f:
        f.write(proto)
    lnc = logical_nc_config({**os.environ, "NEURON_PLATFORM_TARGET_OVERRIDE": target})   # the target's default LNC
    cmd = compiler_argv(hlo_path, target, lnc, os.environ.get("NEURON_CC_FLAGS", ""), args.neuronx_cc)
    print("+ " + shlex.join(cmd), flush=True)
    try:
        return subprocess.run(cmd).returncode
    except OSError as e:
        print(f"error: cannot run {cmd[0]!r} ({e}); install the Neuron compiler: pip install neuronx-cc==2.* "
              "--extra-index-url=https://pip.repos.neuron.amazonaws.com", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
