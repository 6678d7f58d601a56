"""The NKI kernels a lowered program calls, and the compiled kernel files the Neuron compiler needs beside the graph.

jax-neuronx lowers each NKI kernel call to `stablehlo.custom_call @AwsNeuronCustomNativeKernel` with a base64 JSON
backend config; its `klir_binary.binary` is the absolute path of the kernel compiled at trace time (under NKI's
cache). neuronx-cc looks for that file at the absolute path, else at `<its working directory>/<last folder of the
path>/<file name>`, and fails with NCC_EVRF059 when neither exists (compiler/error-codes/EVRF059.rst). A graph
traced on one host therefore compiles on another only with those files copied beside it: `jdeep export` does that
(`copy_artifacts`), and `unresolved` applies the compiler's lookup rule to tell, before compiling, what is missing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass

__all__ = ["KernelRef", "kernel_refs", "relative_location", "copy_artifacts", "unresolved", "NKI_TARGET"]

NKI_TARGET = "AwsNeuronCustomNativeKernel"
_CALL = re.compile(rf"custom_call @{NKI_TARGET}\(.*?\)\s*\{{(.*?)\}}\s*:", re.S)
_CONFIG = re.compile(r'backend_config\s*=\s*"([^"]*)"')


@dataclass(frozen=True)
class KernelRef:
    """One NKI kernel as a custom call names it."""
    func_name: str
    binary: str                 # the compiled kernel's path as traced (absolute)
    grid: int                   # the launch's logical-core count
    platform_target: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]


def _decode(config: str, where: str) -> dict:
    try:
        data = json.loads(base64.b64decode(config, validate=True))
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}: an {NKI_TARGET} backend_config that is not base64 JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("klir_binary"), dict) or \
            not isinstance(data["klir_binary"].get("binary"), str):
        raise ValueError(f"{where}: an {NKI_TARGET} backend_config without klir_binary.binary: {data!r}")
    return data


def kernel_refs(text: str, where: str = "program") -> list[KernelRef]:
    """The distinct NKI kernels the StableHLO `text` calls, in order of first call."""
    refs: dict[str, KernelRef] = {}
    for call in _CALL.finditer(text):
        m = _CONFIG.search(call.group(1))
        if m is None:
            raise ValueError(f"{where}: an {NKI_TARGET} call without a backend_config")
        data = _decode(m.group(1), where)
        klir = data["klir_binary"]
        ref = KernelRef(str(data.get("func_name", "")), klir["binary"], int(data.get("grid", 1)),
                        str(data.get("platform_target", "")), tuple(klir.get("input_names", ())),
                        tuple(klir.get("output_names", ())))
        refs.setdefault(ref.binary, ref)
    return list(refs.values())


def relative_location(binary: str) -> str:
    """Where neuronx-cc looks for a kernel file relative to its working directory: <last folder>/<file name>."""
    return os.path.join(os.path.basename(os.path.dirname(binary)), os.path.basename(binary))


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def copy_artifacts(refs: list[KernelRef], out_dir: str) -> list[dict]:
    """Copy each kernel's compiled file to out_dir/<relative_location>; return the manifest entries. A file that is
    gone (a cleaned NKI cache) is an error naming the kernel: the export would not compile anywhere."""
    entries = []
    for ref in refs:
        if not os.path.isfile(ref.binary):
            raise FileNotFoundError(f"NKI kernel {ref.func_name}: its compiled file {ref.binary} is gone (a cleaned NKI "
                                    "cache?): trace the programs again on this host, then export")
        rel = relative_location(ref.binary)
        dst = os.path.join(out_dir, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.abspath(dst) != os.path.abspath(ref.binary):
            shutil.copyfile(ref.binary, dst)
        entries.append({"func_name": ref.func_name, "file": rel, "traced_path": ref.binary, "grid": ref.grid,
                        "platform_target": ref.platform_target, "input_names": list(ref.input_names),
                        "output_names": list(ref.output_names), "sha256": _sha256(dst)})
    return entries


def unresolved(refs: list[KernelRef], cwd: str) -> list[KernelRef]:
    """The kernels neuronx-cc launched from `cwd` would not find (NCC_EVRF059): neither at the traced absolute path
    nor at cwd/<last folder>/<file name>."""
    return [r for r in refs if not os.path.isfile(r.binary)
            and not os.path.isfile(os.path.join(cwd, relative_location(r.binary)))]
