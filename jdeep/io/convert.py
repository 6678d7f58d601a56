"""Converted checkpoint folders (`jdeep convert`): the param tree saved with Orbax next to config.json and a marker
file naming the format and dtype, so `jdeep.load` restores the tree instead of converting safetensors again.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

from ..config import ConfigError, ModelConfig
from ..param_spec import abstract_params
from ..plan import LayerPlan

__all__ = ["is_converted", "save_converted", "restore_converted"]

_CONVERTED_MARKER = "jdeep_converted.json"
# v2: the output head is stored input-major ([d, V], param_spec.py)
_CONVERTED_FORMAT = "jdeep-orbax-v2"


def is_converted(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, _CONVERTED_MARKER))


def save_converted(folder: str, config: ModelConfig, params: dict, dtype: str) -> None:
    """Save the converted param tree with Orbax, plus config.json, so `jdeep.load` skips conversion."""
    if config.engram is not None:
        raise ValueError("models with Engram layers (DeepSeek-V4.1) cannot be converted yet: their tables stay "
                         "memory-mapped in the original safetensors; load the original checkpoint folder")
    folder = os.path.abspath(folder)
    os.makedirs(folder, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(folder, "params"), params, force=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config.to_dict(), f, indent=2)
    with open(os.path.join(folder, _CONVERTED_MARKER), "w", encoding="utf-8") as f:
        json.dump({"format": _CONVERTED_FORMAT, "dtype": dtype}, f)


def restore_converted(folder: str, config: ModelConfig, plan: LayerPlan, dtype: Any, target: Any = None) -> dict:
    """The converted param tree; `target` (abstract arrays, possibly with shardings) defaults to
    abstract_params on the default device."""
    folder = os.path.abspath(folder)
    with open(os.path.join(folder, _CONVERTED_MARKER), encoding="utf-8") as f:
        marker = json.load(f)
    if marker.get("format") != _CONVERTED_FORMAT:
        raise ConfigError(f"{folder} was converted by an older jdeep (format {marker.get('format')!r}, this jdeep reads "
                          f"{_CONVERTED_FORMAT!r}): convert the original checkpoint again with `jdeep convert`")
    saved_dtype = marker.get("dtype")
    if np.dtype(saved_dtype) != np.dtype(dtype):
        raise ConfigError(f"{folder} was converted with dtype {saved_dtype}; load it with dtype={saved_dtype!r}")
    if target is None:
        target = abstract_params(config, plan, dtype)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(os.path.join(folder, "params"), target)
