"""The DeepSeek-V4 forward step and the loaded-model handle.

`model_step(params, state, tokens, positions)` runs one chunk of S tokens for B sequences through the
whole stack and returns logits plus the updated state: prefill is a chunk of S > 1 (any number of
chunks in a row), decode is S = 1. Each plan segment runs as one `lax.scan` over its repetitions, with
the state passed as whole stacked arrays and the repetition index as a traced scalar, so the compiled
program holds one body per segment whatever the depth and caches are updated in place (donated).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .layers.block import block
from .layers.chunk import make_chunk
from .layers.linear import linear_f32
from .layers.mhc import hc_head_collapse
from .layers.norm import rms_norm
from .layers.rope import inv_freq
from .numerics import Numerics
from .plan import LayerPlan, Segment
from .state import init_state

__all__ = ["Model", "model_step", "DTYPES"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_EXPERT_KEYS = ("w1", "w2", "w3")


def _split_experts(slot_params: dict) -> tuple[dict, dict]:
    ffn = slot_params["ffn"]
    rest = {**slot_params, "ffn": {k: v for k, v in ffn.items() if k not in _EXPERT_KEYS}}
    return rest, {k: ffn[k] for k in _EXPERT_KEYS}


def _run_segment(seg: Segment, seg_params: list, seg_state: list, X: jax.Array, chunk, config: ModelConfig,
                 numerics: Numerics):
    split = [_split_experts(sp) for sp in seg_params]
    per_layer = [s[0] for s in split]
    experts = [s[1] for s in split]
    freqs = [inv_freq(config.rope_for(kind.attn), config.rope_head_dim) for kind in seg.pattern]

    def body(carry, p_slots):
        X, st, r = carry
        st = list(st)
        for j, kind in enumerate(seg.pattern):
            X, st[j] = block(p_slots[j], experts[j], st[j], r, X, chunk, config=config, numerics=numerics,
                             kind=kind, freqs=freqs[j])
        return (X, st, r + 1), None

    (X, seg_state, _), _ = jax.lax.scan(body, (X, list(seg_state), jnp.int32(0)), per_layer)
    return X, seg_state


def model_step(params: dict, state: list, tokens: jax.Array, positions: jax.Array, *, config: ModelConfig,
               plan: LayerPlan, numerics: Numerics = Numerics(), all_logits: bool = False) -> tuple[jax.Array, list]:
    """One chunk through the model.

    tokens int32 [B, S]; positions int32 [B, S] (absolute, consecutive per row, -1 = padding after the
    real tokens). Returns (logits, state): fp32 [B, S, V] if all_logits, else [B, V] at each row's last
    real token (rows without real tokens get meaningless logits).
    """
    chunk = make_chunk(tokens, positions, config.vocab_size)
    x = params["embed"][chunk.tokens]                                   # [B, S, d]
    X = jnp.broadcast_to(x[:, :, None, :], x.shape[:2] + (config.hc_mult, x.shape[-1]))
    new_state = []
    for s, seg in enumerate(plan.segments):
        X, seg_state = _run_segment(seg, params["segments"][s], state[s], X, chunk, config, numerics)
        new_state.append(seg_state)
    if not all_logits:
        last = jnp.clip(chunk.n_valid - 1, 0, X.shape[1] - 1)
        X = jnp.take_along_axis(X, last[:, None, None, None], axis=1)[:, 0]
    h = hc_head_collapse(X, params["hc_head_fn"], params["hc_head_base"], params["hc_head_scale"],
                         norm_eps=config.norm_eps, hc_eps=config.hc_eps)
    h = rms_norm(h, params["norm"], config.norm_eps)
    return linear_f32(h, params["head"]), new_state


@functools.lru_cache(maxsize=None)
def compiled_step(config: ModelConfig, plan: LayerPlan, numerics: Numerics, all_logits: bool) -> Callable:
    """One jitted step per (architecture, numerics, logits mode), shared by every Model that has them."""
    fn = functools.partial(model_step, config=config, plan=plan, numerics=numerics, all_logits=all_logits)
    return jax.jit(fn, donate_argnums=(1,))


@dataclass
class Model:
    """A loaded model: config, layer plan, device params and the compiled step functions."""

    config: ModelConfig
    plan: LayerPlan
    params: dict
    dtype: Any
    numerics: Numerics = Numerics()

    def step_fn(self, all_logits: bool) -> Callable:
        """jit-compiled `model_step(params, state, tokens, positions)`, state donated."""
        return compiled_step(self.config, self.plan, self.numerics, all_logits)

    def init_state(self, batch: int, max_len: int) -> list:
        """Empty decode state for `batch` sequences of up to `max_len` tokens (see state.py)."""
        return init_state(self.config, self.plan, batch, max_len, self.dtype, self.numerics)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size


def as_jax_dtype(dtype: Any) -> Any:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    return jnp.dtype(dtype).type
