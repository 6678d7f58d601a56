"""V4.1's vision tower beside the text model: where it runs, one compiled program per image bucket, and the
prefill-chunk embeddings with image spans written in.

Placement "host": the tower's params and program live on the host CPU device and only the span rows go to the
model's device (jdeep's default on Neuron, as the seed port keeps the tower out of HBM); "device": on the model's
device. The text model sees an image span as positions carrying image_token_id (its MoE routes them with
bias_vl, Engram treats them as dead) whose input embeddings are the tower's rows instead of the token table's.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..vision.geometry import tower_inputs
from ..vision.params import load_vision_params
from ..vision.processor import ImagePatches, process_image
from ..vision.tower import span_rows, tower

__all__ = ["PLACEMENTS", "VisionTower", "ImageSpan", "chunk_embeds"]

PLACEMENTS = ("host", "device")

ImageSpan = tuple[int, np.ndarray]   # (first prompt position, rows [n_tokens, D] in the model's dtype)


class VisionTower:
    """The loaded tower: `encode(image)` -> its span rows (numpy [n_tokens, D], the model's dtype), `process(image)`
    -> the processed patches (the span length is known before the tower runs)."""

    def __init__(self, config: ModelConfig, params: dict, placement: str, device: Any):
        self.config, self.params, self.placement, self.device = config, params, placement, device
        self._marks = {k: np.asarray(params[k]) for k in ("image_start", "image_end", "image_newline")}
        self._program = jax.jit(functools.partial(tower, vc=config.vision))

    @classmethod
    def load(cls, folder: str, config: ModelConfig, dtype: Any, placement: str, model_device: Any
             ) -> "VisionTower":
        if placement not in PLACEMENTS:
            raise ValueError(f"vision_placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        device = jax.devices("cpu")[0] if placement == "host" else model_device
        return cls(config, load_vision_params(folder, config, dtype, device), placement, device)

    def process(self, image: Any) -> ImagePatches:
        return process_image(image, self.config.vision)

    def encode(self, image: Any | ImagePatches) -> np.ndarray:
        img = image if isinstance(image, ImagePatches) else self.process(image)
        t = tower_inputs(img, self.config.vision.downsample_ratio)
        aligned = self._program(self.params, *jax.device_put((t.patches, t.pos, t.valid, t.gather), self.device))
        return span_rows(np.asarray(aligned), t.types, self._marks)


def _merge(text: jax.Array, rows: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.where(mask[..., None], rows.astype(text.dtype), text)


_merge_jit = jax.jit(_merge)
_lookup = jax.jit(lambda table, tokens: table[jnp.clip(tokens, 0, table.shape[0] - 1)])


def chunk_embeds(model, tokens: np.ndarray, positions: np.ndarray, spans: Sequence[Sequence[ImageSpan]]
                 ) -> jax.Array | None:
    """The input embeddings [B, S, d] of a chunk (tokens / positions int32 [B, S], -1 = padding) whose rows b hold
    image spans spans[b] (prompt positions): the token table's rows with each span position's tower row written
    in; None when no span position is in the chunk (the step then looks tokens up itself)."""
    B, S = tokens.shape
    mask = np.zeros((B, S), bool)
    rows = None
    for b, row_spans in enumerate(spans):
        for start, span in row_spans:
            sel = (positions[b] >= start) & (positions[b] < start + len(span))
            if not sel.any():
                continue
            if rows is None:
                rows = np.zeros((B, S, span.shape[1]), span.dtype)
            rows[b, sel] = span[positions[b][sel] - start]
            mask[b, sel] = True
    if rows is None:
        return None
    if model.host_embed is not None:
        table = model.host_embed
        text = table[np.clip(tokens, 0, table.shape[0] - 1)]
        return jnp.asarray(np.where(mask[..., None], rows.astype(text.dtype), text))
    text = _lookup(model.params["embed"], model.put(tokens))
    return _merge_jit(text, model.put(rows), model.put(mask))
