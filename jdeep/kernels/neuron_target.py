"""Which Neuron target jdeep's kernels run on: the Trainium generation and the logical-core (LNC) degree every NKI
kernel is launched at. Environment variables and the instance type only; nothing here imports the Neuron toolchain
(jdeep.platforms builds the platform defaults on these; kernels/nki/launch.py launches kernels at the LNC)."""

from __future__ import annotations

import os
from typing import MutableMapping

__all__ = ["neuron_generation", "default_lnc", "logical_nc_config"]


def neuron_generation(env: MutableMapping[str, str] | None = None, product_name: str | None = None) -> str:
    """trn1 / trn2 / trn3: from NEURON_PLATFORM_TARGET_OVERRIDE, else the EC2 instance type (DMI product
    name, e.g. "trn2.48xlarge"; inf2 is trn1-class), else trn2."""
    env = os.environ if env is None else env
    target = env.get("NEURON_PLATFORM_TARGET_OVERRIDE", "").lower()
    aliases = {"trn1": "trn1", "gen2": "trn1", "inf2": "trn1", "trn2": "trn2", "gen3": "trn2", "trn3": "trn3",
               "gen4": "trn3"}
    if target in aliases:
        return aliases[target]
    if product_name is None:
        try:
            with open("/sys/devices/virtual/dmi/id/product_name") as f:
                product_name = f.read()
        except OSError:
            product_name = ""
    family = product_name.strip().lower().split(".")[0]
    return aliases.get(family, "trn2")


def default_lnc(generation: str) -> int:
    """The Neuron runtime's default logical-core degree: 2 on trn2 and trn3 (two physical cores per logical core),
    1 on trn1 / inf2."""
    return 1 if generation == "trn1" else 2


def logical_nc_config(env: MutableMapping[str, str] | None = None) -> int:
    """The LNC the Neuron runtime runs at (NEURON_LOGICAL_NC_CONFIG, else the generation's default): every NKI
    kernel must be launched at it (`kernel[lnc](...)`), and the compiler's --logical-nc-config must match it.
    The one place jdeep reads it (kernels/nki/launch.py)."""
    env = os.environ if env is None else env
    raw = env.get("NEURON_LOGICAL_NC_CONFIG", "").strip()
    if not raw:
        return default_lnc(neuron_generation(env))
    if raw not in ("1", "2"):
        raise ValueError(f"NEURON_LOGICAL_NC_CONFIG must be 1 or 2 (logical NeuronCores per kernel launch), got {raw!r}")
    return int(raw)
