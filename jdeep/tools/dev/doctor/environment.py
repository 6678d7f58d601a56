"""Step 1 of the doctor: where it runs. Platform, devices, the versions of JAX and the Neuron stack against the
versions jdeep's `neuron` extra pins (SDK 2.32), the Trainium generation, fp8 range, LNC and the compiler flags
jdeep's programs are compiled with, the compiler command; and what is missing, each with the line that installs it."""

from __future__ import annotations

import importlib.metadata
import os
import re

import jax

from ....platforms import current, default_lnc, logical_nc_config, neuron_cc_flags, neuron_generation, platform_for
from .compiler import Compiler

__all__ = ["environment", "NEURON_INDEX", "PACKAGES"]

NEURON_INDEX = "https://pip.repos.neuron.amazonaws.com"
PACKAGES = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes", "jax-neuronx", "libneuronxla", "neuronx-cc", "nki")
_NEURON_ONLY = ("jax-neuronx", "libneuronxla", "neuronx-cc", "nki")


def _installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _pinned() -> dict[str, str]:
    """package -> version the `neuron` extra pins (from jdeep's own metadata)."""
    out = {}
    try:
        requires = importlib.metadata.requires("jdeep") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    for req in requires:
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^;\s]+)\s*;\s*extra\s*==\s*\"neuron\"", req)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def environment(compiler: Compiler, env: dict | None = None) -> dict:
    """The report's environment section (JSON-able)."""
    env = dict(os.environ if env is None else env)
    platform = current()
    generation = neuron_generation(env)
    neuron_target = platform.is_neuron or "neuron_cc" in " ".join(compiler.argv)
    target = platform if platform.is_neuron else platform_for("neuron", generation)
    pinned = _pinned()
    versions = {p: _installed(p) for p in PACKAGES}
    missing = []
    for package in PACKAGES:
        wanted = pinned.get(package)
        found = versions[package]
        if package in _NEURON_ONLY and not neuron_target:
            continue                     # compiling with XLA:CPU: the Neuron stack is not needed
        if wanted is None or found == wanted:    # only the pinned packages are compared (PyPI's stubs differ too)
            continue
        index = f" --extra-index-url={NEURON_INDEX}" if package in _NEURON_ONLY else ""
        missing.append({"package": package, "found": found, "wanted": wanted,
                        "install": f"pip install '{package}=={wanted}'{index}"})
    try:
        lnc = logical_nc_config(env)
    except ValueError as e:
        lnc = f"invalid: {e}"
    devices = jax.devices()
    return {
        "platform": platform.name,
        "devices": f"{len(devices)} x {devices[0].device_kind}" if devices else "none",
        "neuron generation": generation if neuron_target else "",
        f"fp8 range on {generation} (activations, KV, codes)": target.fp8_max,
        "compile mode on Neuron": target.compile_mode,
        "logical NC config": lnc if neuron_target else "",
        "default LNC of the generation": default_lnc(generation) if neuron_target else "",
        "NEURON_CC_FLAGS jdeep compiles with": neuron_cc_flags(env.get("NEURON_CC_FLAGS", ""), generation, None)
        if neuron_target else "",
        "compiler": compiler.command_line("FILE.mlir"),
        "versions": versions,
        "expected": {p: pinned.get(p, "") for p in PACKAGES},
        "missing": missing,
    }
