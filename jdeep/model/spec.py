"""ModelSpec: everything a model's compiled programs depend on besides the weights' values, frozen and hashable.

It is what the program cache keys a model's programs by (Model.spec: models with equal specs share every program)
and what `jdeep check-graph` / `jdeep export` build programs for from a config alone (tools/dev/programs.Target is this
class): the config, the layer plan, the numerics, the parameter dtype, the compile mode ("scan" or "regions"),
whether the token embedding is gathered on the host, whether the scan mode's per-layer tensors are packed in arenas
(arenas.py), and the device-mesh layout (sharding.Layout, None on one device). Packed KV records are a numerics
setting (Numerics.packed_kv).

Its abstract_* methods give a program's inputs as jax.ShapeDtypeStruct trees from the spec alone (no weights), for
lowering (tools/dev/programs.py, the drafters' inventory programs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from ..arenas import is_packed, pack_params
from ..config import ModelConfig
from ..numerics import Numerics
from ..param_spec import abstract_params
from ..plan import LayerPlan, build_plan
from ..platforms import platform_for
from ..state import init_state

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
        `platform` (default: JAX's backend; "neuron" where the programs are checked or exported for Neuron);
        fp8_max None: the platform's."""
        if fp8_max is None:
            fp8_max = platform_for(platform or jax.default_backend()).fp8_max
        numerics = Numerics.for_config(config, quantize_activations, fp8_max, packed_kv, platform)
        return cls(config, build_plan(config), numerics, dtype, compile_mode, host_embedding, packed_params)

    def abstract_params(self) -> dict:
        """The parameter tree a loaded model of this spec holds (without the device embedding when it is gathered on
        the host; packed in arenas when the spec packs them), as jax.ShapeDtypeStruct leaves."""
        params = abstract_params(self.config, self.plan, self.dtype)
        if self.host_embedding:
            params = {k: v for k, v in params.items() if k != "embed"}
        return pack_params(params) if self.packed_params else params

    def abstract_state(self, batch: int, max_len: int) -> dict:
        """The decode state of `batch` slots and `max_len` tokens (state.init_state) as jax.ShapeDtypeStruct leaves."""
        return jax.eval_shape(lambda: init_state(self.config, self.plan, batch, max_len, self.dtype, self.numerics))

    def abstract_engram(self, batch: int, length: int) -> tuple | None:
        """The Engram rows a step over [batch, length] tokens takes (codes, ue8m0 scales: uint8 [engram layers, batch,
        length, rows per token, head_dim | head_dim / 32]); None for models without Engram layers."""
        e = self.config.engram
        if e is None:
            return None
        lead = (len(e.layer_ids), batch, length, e.rows_per_token)
        return (jax.ShapeDtypeStruct(lead + (e.head_dim,), jnp.uint8),
                jax.ShapeDtypeStruct(lead + (e.head_dim // 32,), jnp.uint8))
