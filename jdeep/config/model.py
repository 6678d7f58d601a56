"""Typed, validated model configuration for the DeepSeek-V4 family: the frozen dataclasses that describe one
model's architecture, checked on construction (`ConfigError` names the offending field).

Reading and writing config.json (`ModelConfig.from_file`, `from_dict`, `to_dict`) is config/formats.py; the
released models' sizes are config/presets.py, the small random-weight models' config/small_models.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .formats import config_fields, config_to_dict, read_config_json
from .parts import (AttentionKind, ConfigError, DSparkConfig, EngramConfig, QuantizationConfig, RopeConfig, SharingConfig,
                    VisionConfig, YarnConfig)

__all__ = ["ConfigError", "YarnConfig", "RopeConfig", "AttentionKind", "SharingConfig", "EngramConfig", "DSparkConfig",
           "VisionConfig", "QuantizationConfig", "ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """One DeepSeek-V4 model's architecture. Sizes are per backbone layer unless stated.

    `attention_kinds[i]` and `hash_moe[i]` describe backbone layer i (MTP blocks are not run).
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    attention_kinds: tuple[AttentionKind, ...]
    hash_moe: tuple[bool, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    n_activated_experts: int
    n_shared_experts: int
    moe_inter_dim: int
    route_scale: float
    swiglu_limit: float
    norm_eps: float
    rope_main: RopeConfig
    rope_compress: RopeConfig
    score_func: str = "sqrtsoftplus"
    n_mtp_layers: int = 0
    max_position_embeddings: int = 1 << 20
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    model_type: str = "deepseek_v4"
    quantization: QuantizationConfig | None = field(default=None, compare=False)
    # DeepSeek-V4.1 only (model_type "deepseek_v41")
    sharing: SharingConfig | None = None
    engram: EngramConfig | None = None
    dspark: DSparkConfig | None = None
    gate_temp: float = 1.0
    image_token_id: int | None = None
    vision: VisionConfig | None = field(default=None, compare=False)   # the text programs do not depend on it

    def __post_init__(self) -> None:
        self._validate()
        if self.is_v41:
            self._validate_v41()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        def positive(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")

        for name in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "q_lora_rank",
                     "o_groups", "o_lora_rank", "window_size", "index_n_heads", "index_head_dim",
                     "index_topk", "hc_mult", "hc_sinkhorn_iters", "n_routed_experts",
                     "n_activated_experts", "moe_inter_dim", "max_position_embeddings"):
            positive(name)
        if not isinstance(self.rope_head_dim, int) or self.rope_head_dim <= 0 or self.rope_head_dim % 2:
            raise ConfigError(f"rope_head_dim (qk_rope_head_dim) must be a positive even integer, got {self.rope_head_dim!r}")
        if self.rope_head_dim > self.head_dim:
            raise ConfigError(f"qk_rope_head_dim={self.rope_head_dim} exceeds head_dim={self.head_dim}")
        if self.rope_head_dim > self.index_head_dim:
            raise ConfigError(f"qk_rope_head_dim={self.rope_head_dim} exceeds index_head_dim={self.index_head_dim}")
        if self.n_heads % self.o_groups:
            raise ConfigError(f"o_groups={self.o_groups} must divide num_attention_heads={self.n_heads}")
        if self.n_activated_experts > self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok={self.n_activated_experts} exceeds n_routed_experts={self.n_routed_experts}")
        if self.n_shared_experts != 1:
            raise ConfigError(f"n_shared_experts must be 1 (DeepSeek-V4 has exactly one shared expert), got {self.n_shared_experts}")
        if self.score_func != "sqrtsoftplus":
            raise ConfigError(f"scoring_func {self.score_func!r} is not supported (DeepSeek-V4 uses 'sqrtsoftplus')")
        if len(self.attention_kinds) != self.n_layers:
            raise ConfigError(f"compress_ratios/layer_types has {len(self.attention_kinds)} backbone entries, num_hidden_layers is {self.n_layers}")
        if len(self.hash_moe) != self.n_layers:
            raise ConfigError(f"mlp_layer_types has {len(self.hash_moe)} entries, num_hidden_layers is {self.n_layers}")
        for i, k in enumerate(self.attention_kinds):
            if not isinstance(k.ratio, int) or k.ratio < 0:
                raise ConfigError(f"compress_ratios[{i}] must be an integer >= 0, got {k.ratio!r}")
            if k.overlap and k.ratio == 0:
                raise ConfigError(f"layer_types[{i}] is compressed_sparse_attention but its compress rate is 0")
        for name in ("hc_eps", "norm_eps", "route_scale", "swiglu_limit"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{name} must be a positive finite number, got {v!r}")
        for name, rope in (("rope_theta", self.rope_main), ("compress_rope_theta", self.rope_compress)):
            if not rope.theta > 1:
                raise ConfigError(f"{name} must be > 1, got {rope.theta!r}")
            if rope.yarn is not None:
                y = rope.yarn
                if not y.factor >= 1:
                    raise ConfigError(f"rope_scaling.factor must be >= 1, got {y.factor!r}")
                if not (isinstance(y.original_seq_len, int) and y.original_seq_len > 0):
                    raise ConfigError(f"rope_scaling.original_max_position_embeddings must be a positive integer, got {y.original_seq_len!r}")
                if not y.beta_fast > y.beta_slow > 0:
                    raise ConfigError(f"rope_scaling needs beta_fast > beta_slow > 0, got {y.beta_fast}, {y.beta_slow}")
        for name in ("bos_token_id", "eos_token_id"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and 0 <= v < self.vocab_size):
                raise ConfigError(f"{name}={v!r} is not a token id in [0, vocab_size={self.vocab_size})")

    def _validate_v41(self) -> None:
        if self.sharing is None:
            raise ConfigError("a deepseek_v41 config needs kv_source_layer_ids and index_source_layer_ids")
        if self.n_hash_layers:
            raise ConfigError("DeepSeek-V4.1 has no hash-routed MoE layers (num_hash_layers must be 0)")
        if any(k.overlap for k in self.attention_kinds):
            raise ConfigError("DeepSeek-V4.1 compressors do not overlap (no compressed_sparse_attention layers)")
        if not (isinstance(self.gate_temp, (int, float)) and math.isfinite(self.gate_temp) and self.gate_temp > 0):
            raise ConfigError(f"gate_temp must be a positive finite number, got {self.gate_temp!r}")
        sh, n = self.sharing, self.n_layers
        for name, ids in (("kv_source_layer_ids", sh.kv_sources), ("index_source_layer_ids", sh.index_sources)):
            if list(ids) != sorted(set(ids)) or any(not isinstance(i, int) or not 0 <= i < n for i in ids):
                raise ConfigError(f"{name} must be increasing layer ids in [0, {n}), got {list(ids)}")
            for i in ids:
                if self.attention_kinds[i].ratio == 0:
                    raise ConfigError(f"{name} lists layer {i}, a sliding-only layer (compress ratio 0)")
        for i, k in enumerate(self.attention_kinds):
            if k.ratio == 0:
                continue
            src = self.kv_source_of(i)
            if src is None or self.attention_kinds[src].ratio != k.ratio:
                raise ConfigError(f"layer {i} (compress ratio {k.ratio}) has no KV source of the same ratio at or "
                                  f"before it in kv_source_layer_ids {list(sh.kv_sources)}")
            idx = self.index_source_of(i)
            if idx is None or self.kv_source_of(idx) != src:
                raise ConfigError(f"layer {i} has no index source reading its KV source {src} at or before it in "
                                  f"index_source_layer_ids {list(sh.index_sources)}")
        if sh.candidate_source is not None:
            if sh.candidate_source not in sh.index_sources:
                raise ConfigError(f"candidate_source_layer_id {sh.candidate_source} is not an index source")
            for name in ("candidate_topk_blocks", "candidate_block_size"):
                v = getattr(sh, name)
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.vision is not None and not (isinstance(self.image_token_id, int) and not isinstance(
                self.image_token_id, bool) and 0 <= self.image_token_id < self.vocab_size):
            raise ConfigError(f"a config with a vision tower needs image_token_id in [0, {self.vocab_size}), got "
                              f"{self.image_token_id!r}")
        e = self.engram
        if e is not None:
            if list(e.layer_ids) != sorted(set(e.layer_ids)) or any(not 0 <= i < n for i in e.layer_ids):
                raise ConfigError(f"engram_layer_ids must be increasing layer ids in [0, {n}), got {list(e.layer_ids)}")
            if len(e.num_embeddings) != len(e.layer_ids):
                raise ConfigError(f"engram_num_embeddings has {len(e.num_embeddings)} entries for "
                                  f"{len(e.layer_ids)} engram_layer_ids")
            for name in ("max_ngram_size", "n_heads", "head_dim", "vocab_size", "compressed_vocab_size"):
                v = getattr(e, name)
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    raise ConfigError(f"engram_{name} must be a positive integer, got {v!r}")
            if e.max_ngram_size < 2:
                raise ConfigError(f"engram_max_ngram_size must be >= 2, got {e.max_ngram_size}")
            if e.head_dim % 32:
                raise ConfigError(f"engram_head_dim must be a multiple of 32 (the table's scale groups), got {e.head_dim}")
            if not 0 <= e.pad_id < self.vocab_size:
                raise ConfigError(f"engram_pad_token_id={e.pad_id} is not a token id in [0, {self.vocab_size})")

    # ------------------------------------------------------------------ derived
    @property
    def is_v41(self) -> bool:
        return self.model_type == "deepseek_v41"

    def kv_source_of(self, layer: int) -> int | None:
        """V4.1: the KV source whose compressed caches `layer` reads (latest source at or before it)."""
        srcs = [s for s in self.sharing.kv_sources if s <= layer] if self.sharing else []
        return srcs[-1] if srcs else None

    def index_source_of(self, layer: int) -> int | None:
        """V4.1: the index source whose top-k `layer` uses (itself, or the latest one before it)."""
        srcs = [s for s in self.sharing.index_sources if s <= layer] if self.sharing else []
        return srcs[-1] if srcs else None

    @property
    def n_hash_layers(self) -> int:
        return sum(self.hash_moe)

    def rope_for(self, kind: AttentionKind) -> RopeConfig:
        """Sliding-only layers use the main RoPE; compressed layers the compress RoPE (YaRN)."""
        return self.rope_main if kind.ratio == 0 else self.rope_compress

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ config.json (config/formats.py)
    def to_dict(self) -> dict[str, Any]:
        """A DeepSeek-style HF config.json that `from_dict` reads back to an equal config."""
        return config_to_dict(self)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ModelConfig:
        """Read `config.json` (or a folder holding one)."""
        return cls.from_dict(read_config_json(path))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Any of the config.json spellings (config/formats.py), validated."""
        return cls(**config_fields(raw))
