"""The parts of a model's configuration: RoPE and YaRN, an attention kind, V4.1's KV/index sharing, Engram,
DSpark, the vision tower and the weights' quantization — frozen dataclasses checked on construction (`ConfigError` names the field). The
whole model's config is model.py's ModelConfig.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["ConfigError", "YarnConfig", "RopeConfig", "AttentionKind", "SharingConfig", "EngramConfig", "DSparkConfig",
           "VisionConfig", "QuantizationConfig"]


class ConfigError(ValueError):
    """A config.json is malformed or inconsistent; the message names the field."""


@dataclass(frozen=True)
class YarnConfig:
    """YaRN frequency interpolation (model-spec.md §3.2). No attention-temperature factor."""

    factor: float
    original_seq_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    yarn: YarnConfig | None = None


# Which attention a layer runs. `ratio == 0`: sliding window only. `ratio > 0`: compressed KV with
# that ratio; `overlap` pools 2*ratio tokens per entry and implies a lightning indexer (V4's ratio-4
# "CSA" layers); without overlap all visible compressed entries are attended ("HCA").
@dataclass(frozen=True)
class AttentionKind:
    ratio: int
    overlap: bool = False

    @property
    def has_indexer(self) -> bool:
        return self.overlap

    @property
    def name(self) -> str:
        if self.ratio == 0:
            return "sliding"
        return f"{'csa' if self.overlap else 'hca'}{self.ratio}"


@dataclass(frozen=True)
class SharingConfig:
    """V4.1 cross-layer sharing (model-spec.md §5.4-§5.5). Layer ids are backbone layers.

    kv_sources own a compressor, the compressed KV and the index keys; every compressed layer reads the
    caches of the latest KV source at or before it. index_sources run an indexer (over their KV source's
    index keys) and publish its top-k; the other compressed layers reuse the latest published top-k.
    The candidate source also builds a block candidate mask that later index sources of the same KV
    source apply before their top-k.
    """

    kv_sources: tuple[int, ...]
    index_sources: tuple[int, ...]
    candidate_source: int | None = None
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8


@dataclass(frozen=True)
class EngramConfig:
    """V4.1 Engram conditional memory (model-spec.md §5.7)."""

    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]   # table rows per Engram layer
    max_ngram_size: int               # n-grams of order 2..max_ngram_size
    n_heads: int
    head_dim: int
    vocab_size: int                   # hash primes are the primes >= this
    pad_id: int                       # token id whose class pads the history
    compressed_vocab_size: int        # classes of the compressed token map

    @property
    def rows_per_token(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads


@dataclass(frozen=True)
class DSparkConfig:
    """V4.1 / V4-Flash-0731 DSpark drafter fields (model-spec.md §5.8); its tensors are loaded, not run."""

    n_layers: int
    block_size: int
    noise_token_id: int | None = None
    markov_rank: int | None = None
    n_routed_experts: int = 0
    n_activated_experts: int = 0
    target_layer_ids: tuple[int, ...] = ()


# HF vision_config key -> VisionConfig field; DeepSeek's ModelArgs spell them vision_<field> (config/formats.py strips
# the prefix), with max_n_token for max_image_tokens.
_VISION_KEYS = {"num_hidden_layers": "n_layers", "hidden_size": "dim", "num_attention_heads": "n_heads",
                "intermediate_size": "inter_dim", "patch_size": "patch_size", "rope_theta": "rope_theta",
                "downsample_ratio": "downsample_ratio", "max_image_tokens": "max_tokens", "min_pixels": "min_pixels",
                "max_wh_ratio": "max_wh_ratio", "max_n_token": "max_tokens"}


@dataclass(frozen=True)
class VisionConfig:
    """V4.1's vision tower (model-spec.md §5.9): a ViT of `n_layers` blocks over patch_size² RGB patches and a
    downsample_ratio² aligner into the text model. Defaults are DeepSeek's ModelArgs. An image span counts at most
    `max_tokens` positions (delimiters included); smaller images are scaled up to `min_pixels`; `max_wh_ratio`
    (None in V4.1) makes wider images stretch instead of pad. `norm_eps` is the ViT's RMSNorm epsilon (not in
    config.json)."""

    n_layers: int = 32
    dim: int = 1024
    n_heads: int = 16
    inter_dim: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_tokens: int = 1024
    min_pixels: int = 544 * 544
    max_wh_ratio: float | None = None
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("n_layers", "dim", "n_heads", "inter_dim", "patch_size", "downsample_ratio", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"vision_config.{name} must be a positive integer, got {v!r}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 4:
            raise ConfigError(f"vision_config: hidden_size {self.dim} over {self.n_heads} heads must give a head "
                              "size divisible by 4 (its 2-D RoPE splits it into row and column halves)")
        if self.max_tokens < 4:
            raise ConfigError(f"vision_config.max_image_tokens must be >= 4 (one image row), got {self.max_tokens}")
        if isinstance(self.min_pixels, bool) or not isinstance(self.min_pixels, int) or self.min_pixels < 0:
            raise ConfigError(f"vision_config.min_pixels must be an integer >= 0, got {self.min_pixels!r}")
        for name in ("rope_theta", "norm_eps") + (("max_wh_ratio",) if self.max_wh_ratio is not None else ()):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"vision_config.{name} must be a positive finite number, got {v!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def patch_values(self) -> int:
        """Values of one flattened patch: 3 channels x patch_size²."""
        return 3 * self.patch_size ** 2

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> "VisionConfig":
        """From an HF `vision_config` object or DeepSeek's ModelArgs fields without their `vision_` prefix."""
        names = {f.name for f in dataclasses.fields(cls)}
        args = {}
        for k, v in raw.items():
            key = _VISION_KEYS.get(k, k)
            if key in names and v is not None or key == "max_wh_ratio":
                args[key] = v
        return cls(**args)

    def to_hf(self) -> dict[str, Any]:
        """The HF `vision_config` object that from_mapping reads back to an equal config."""
        out = {"model_type": "deepseek_v41_vision"}
        out.update({hf: getattr(self, f) for hf, f in _VISION_KEYS.items() if hf != "max_n_token"})
        return out


_EXPERT_DTYPES = ("fp8", "fp4")


@dataclass(frozen=True)
class QuantizationConfig:
    """A checkpoint's weight quantization (HF `quantization_config`, model-spec.md §2): DeepSeek's fp8 e4m3 weights
    in weight_block_size blocks with ue8m0 (power-of-two) scales, the routed experts in fp8 or fp4 (`expert_dtype`;
    V4 spells it at the top level of config.json). Another quant_method leaves the weights as stored (float).
    `raw`: the object as read (unknown keys included), written back by to_hf."""

    quant_method: str = "fp8"
    weight_block_size: tuple[int, int] = (128, 128)
    expert_dtype: str = "fp8"
    scale_fmt: str | None = None
    activation_scheme: str | None = None
    raw: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self):
        block = self.weight_block_size
        if len(block) != 2 or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in block):
            raise ConfigError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
        if self.expert_dtype not in _EXPERT_DTYPES:
            raise ConfigError(f"quantization_config.expert_dtype must be one of {_EXPERT_DTYPES}, got "
                              f"{self.expert_dtype!r}")

    @property
    def fp8(self) -> bool:
        """Whether the weights are DeepSeek's fp8 / fp4 codes (quant_method fp8)."""
        return self.quant_method == "fp8"

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> "QuantizationConfig | None":
        """The `quantization_config` object (None when empty: weights as stored)."""
        if not raw:
            return None
        block = raw.get("weight_block_size", (128, 128))
        if not isinstance(block, (list, tuple)):
            raise ConfigError(f"quantization_config.weight_block_size must be a list of two integers, got {block!r}")
        return cls(str(raw.get("quant_method", "fp8")), tuple(block), raw.get("expert_dtype") or "fp8",
                   raw.get("scale_fmt"), raw.get("activation_scheme"), dict(raw))

    def to_hf(self) -> dict[str, Any]:
        """The `quantization_config` object: as read, with the typed fields."""
        out = dict(self.raw)
        out.update({"quant_method": self.quant_method, "weight_block_size": list(self.weight_block_size),
                    "expert_dtype": self.expert_dtype})
        for name in ("scale_fmt", "activation_scheme"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

