"""ModelSpec: everything a model's compiled programs depend on besides the weights' values, frozen and hashable.

It is what the program cache keys a model's programs by (Model.spec: models with equal specs share every program)
and what `jdeep check-graph` / `jdeep export` build programs for from a config alone (tools/dev/programs.Target is this
class): the config, the layer plan, the numerics, the parameter dtype, the compile mode ("scan" or "regions"),
whether the token embedding is gathered on the host, whether the scan mode's per-layer tensors are packed in arenas
(arenas.py), and the device-mesh layout (sharding.Layout, None on one device). Packed KV records are a numerics
setting (Numerics.packed_kv).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..arenas import is_packed
from ..config import ModelConfig
from ..numerics import Numerics
from ..plan import LayerPlan, build_plan

__all__ = ["ModelSpec"]


@dataclass(frozen=True)
class ModelSpec:
    config: ModelConfig
    plan: LayerPlan
    numerics: Numerics
    dtype: Any
    compile_mode: str = "scan"
    host_embedding: bool = False
    packed_params: bool = False      # scan mode: per-layer tensors in arenas (arenas.py)
    layout: Any = None               # sharding.Layout on a device mesh

    @classmethod
    def of(cls, model) -> "ModelSpec":
        """A loaded model's spec (Model.spec)."""
        return cls(model.config, model.plan, model.numerics, model.dtype, model.compile_mode,
                   model.host_embed is not None, is_packed(model.params), model.layout)

    @classmethod
    def for_config(cls, config: ModelConfig, dtype: Any, compile_mode: str = "scan", host_embedding: bool = False,
                   quantize_activations: bool | None = None, fp8_max: float | None = None, packed_kv: bool = False,
                   packed_params: bool = False, platform: str | None = None) -> "ModelSpec":
        """From a config alone (no weights): the layer plan and numerics jdeep.load would build for it on
        `platform` (default: JAX's backend; "neuron" where the programs are checked or exported for Neuron)."""
        numerics = Numerics.for_config(config, quantize_activations, fp8_max, packed_kv, platform)
        return cls(config, build_plan(config), numerics, dtype, compile_mode, host_embedding, packed_params)
