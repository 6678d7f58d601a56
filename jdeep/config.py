"""Typed, validated model configuration for the DeepSeek-V4 family.

`ModelConfig.from_dict` reads the three spellings found in the wild (model-spec.md §2):
DeepSeek's Hugging Face `config.json` (legacy keys such as `compress_ratios`, `num_hash_layers`,
`qk_rope_head_dim`, `rope_scaling`), the transformers-normalised fields (`layer_types` +
`compress_rates`, `mlp_layer_types`, `rope_parameters`, `partial_rotary_factor`) and the reference
code's `ModelArgs` names (`dim`, `n_layers`, ... of `inference/config.json`).
Every problem raises `ConfigError` naming the offending field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["ConfigError", "YarnConfig", "RopeConfig", "SharingConfig", "EngramConfig", "DSparkConfig", "ModelConfig",
           "PRESETS", "preset"]


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


_LAYER_TYPE_NAMES = {
    "sliding_attention": 0,
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
_DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}

# Keys that carry no information jdeep needs; present in real configs, accepted silently.
_IGNORED_KEYS = {
    "architectures", "attention_bias", "attention_dropout", "hidden_act", "initializer_range",
    "torch_dtype", "dtype", "transformers_version", "use_cache", "output_router_logits",
    "router_aux_loss_coef", "router_jitter_noise", "tie_word_embeddings", "topk_method",
    "norm_topk_prob", "pad_token_id", "mlp_bias", "num_key_value_heads", "auto_map",
    "_name_or_path", "max_batch_size", "max_seq_len", "scale_fmt",
    "expert_dtype", "compress_rate_csa", "compress_rate_hca", "model_type", "quantization_config",
}


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
    quantization: Mapping[str, Any] | None = field(default=None, compare=False)
    # DeepSeek-V4.1 only (model_type "deepseek_v41")
    sharing: SharingConfig | None = None
    engram: EngramConfig | None = None
    dspark: DSparkConfig | None = None
    gate_temp: float = 1.0
    image_token_id: int | None = None
    vision: Mapping[str, Any] | None = field(default=None, compare=False)

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

    def to_dict(self) -> dict[str, Any]:
        """A DeepSeek-style HF config.json that `from_dict` reads back to an equal config."""
        ratios = [k.ratio for k in self.attention_kinds]
        legacy_ok = all((k.ratio == 4) == k.overlap for k in self.attention_kinds)
        d: dict[str, Any] = {
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.window_size,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.n_activated_experts,
            "n_shared_experts": self.n_shared_experts,
            "moe_intermediate_size": self.moe_inter_dim,
            "routed_scaling_factor": self.route_scale,
            "scoring_func": self.score_func,
            "swiglu_limit": self.swiglu_limit,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_main.theta,
            "compress_rope_theta": self.rope_compress.theta,
            "num_nextn_predict_layers": self.n_mtp_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "mlp_layer_types": ["hash_moe" if h else "moe" for h in self.hash_moe],
        }
        if legacy_ok:
            d["compress_ratios"] = ratios + [0] * self.n_mtp_layers
        else:
            d["layer_types"] = [
                "sliding_attention" if k.ratio == 0 else
                ("compressed_sparse_attention" if k.overlap else "heavily_compressed_attention")
                for k in self.attention_kinds]
            rates = {("compressed_sparse_attention" if k.overlap else "heavily_compressed_attention"): k.ratio
                     for k in self.attention_kinds if k.ratio}
            d["compress_rates"] = rates
        def rope_dict(rope: RopeConfig) -> dict[str, Any]:
            y = rope.yarn
            if y is None:
                return {"rope_type": "default", "rope_theta": rope.theta}
            return {"rope_type": "yarn", "rope_theta": rope.theta, "factor": y.factor,
                    "original_max_position_embeddings": y.original_seq_len,
                    "beta_fast": y.beta_fast, "beta_slow": y.beta_slow}

        if self.rope_main.yarn is not None:  # only the normalised spelling can say so
            d["rope_parameters"] = {"main": rope_dict(self.rope_main), "compress": rope_dict(self.rope_compress)}
        elif self.rope_compress.yarn is not None:
            y = self.rope_compress.yarn
            d["rope_scaling"] = {"type": "yarn", "factor": y.factor, "original_max_position_embeddings": y.original_seq_len,
                                 "beta_fast": y.beta_fast, "beta_slow": y.beta_slow}
        if self.quantization is not None:
            d["quantization_config"] = dict(self.quantization)
        if self.is_v41:
            return self._v41_dict(d, ratios)
        return d

    def _v41_dict(self, d: dict[str, Any], ratios: list[int]) -> dict[str, Any]:
        """V4.1's HF layout: architecture fields under `text_config`."""
        text = {k: v for k, v in d.items() if k not in ("quantization_config", "bos_token_id", "eos_token_id",
                                                         "mlp_layer_types", "layer_types", "compress_rates")}
        text["model_type"] = "deepseek_v41_text"
        text["compress_ratios"] = ratios + [0] * self.n_mtp_layers
        sh = self.sharing
        text.update({"kv_source_layer_ids": list(sh.kv_sources), "index_source_layer_ids": list(sh.index_sources),
                     "candidate_source_layer_id": sh.candidate_source,
                     "candidate_topk_blocks": sh.candidate_topk_blocks,
                     "candidate_block_size": sh.candidate_block_size, "gate_temp": self.gate_temp})
        if self.engram is not None:
            e = self.engram
            text.update({"engram_layer_ids": list(e.layer_ids), "engram_num_embeddings": list(e.num_embeddings),
                         "engram_max_ngram_size": e.max_ngram_size, "engram_n_heads": e.n_heads,
                         "engram_head_dim": e.head_dim, "engram_vocab_size": e.vocab_size,
                         "engram_pad_token_id": e.pad_id, "engram_compressed_vocab_size": e.compressed_vocab_size})
        if self.dspark is not None:
            ds = self.dspark
            text.update({"dspark_block_size": ds.block_size, "dspark_noise_token_id": ds.noise_token_id,
                         "dspark_markov_rank": ds.markov_rank, "dspark_n_routed_experts": ds.n_routed_experts,
                         "dspark_num_experts_per_tok": ds.n_activated_experts,
                         "dspark_target_layer_ids": list(ds.target_layer_ids)})
        out: dict[str, Any] = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
                               "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                               "text_config": text}
        if self.image_token_id is not None:
            out["image_token_id"] = self.image_token_id
        if self.vision is not None:
            out["vision_config"] = dict(self.vision)
        if self.quantization is not None:
            out["quantization_config"] = dict(self.quantization)
        return out

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read `config.json` (or a folder holding one)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"config.json at {path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config.json at {path} must hold a JSON object, got {type(raw).__name__}")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        return _parse(dict(raw))


# ---------------------------------------------------------------------- parser helpers
_MODELARGS_TO_HF = {
    "dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "moe_inter_dim": "moe_intermediate_size", "n_activated_experts": "num_experts_per_tok",
    "route_scale": "routed_scaling_factor", "score_func": "scoring_func", "norm_eps": "rms_norm_eps",
    "window_size": "sliding_window", "rope_head_dim": "qk_rope_head_dim", "n_hash_layers": "num_hash_layers",
    "n_mtp_layers": "num_nextn_predict_layers",
}


def _from_model_args(raw: dict[str, Any]) -> dict[str, Any]:
    """Rename the reference code's ModelArgs keys (inference/config.json) to the HF spelling."""
    out = {"model_type": "deepseek_v4"}
    for k, v in raw.items():
        out[_MODELARGS_TO_HF.get(k, k)] = v
    if "original_seq_len" in raw or "rope_factor" in raw:
        out.pop("original_seq_len", None)
        factor = out.pop("rope_factor", 1)
        orig = raw.get("original_seq_len", 0)
        if orig and orig > 0:
            out["rope_scaling"] = {"type": "yarn", "factor": factor, "original_max_position_embeddings": orig,
                                   "beta_fast": out.pop("beta_fast", 32), "beta_slow": out.pop("beta_slow", 1)}
    out.pop("beta_fast", None)
    out.pop("beta_slow", None)
    return out


def _req(raw: dict[str, Any], key: str, kind: type | tuple[type, ...] = int) -> Any:
    if key not in raw:
        raise ConfigError(f"config.json is missing required field {key!r}")
    v = raw[key]
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise ConfigError(f"{key} must be an integer, got {v!r}")
    if kind is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{key} must be a number, got {v!r}")
        return float(v)
    return v


def _opt(raw: dict[str, Any], key: str, default: Any, kind: type = int) -> Any:
    return _req(raw, key, kind) if raw.get(key) is not None else default


def _num(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    return float(value)


def _yarn_from(d: Mapping[str, Any], where: str) -> YarnConfig | None:
    if not isinstance(d, Mapping):
        raise ConfigError(f"{where} must be an object, got {d!r}")
    rtype = d.get("rope_type", d.get("type"))
    if rtype in (None, "default"):
        return None
    if rtype != "yarn":
        raise ConfigError(f"{where}.rope_type {rtype!r} is not supported (only 'yarn' or 'default')")
    try:
        return YarnConfig(
            factor=float(d["factor"]),
            original_seq_len=int(d["original_max_position_embeddings"]),
            beta_fast=float(d.get("beta_fast", 32)),
            beta_slow=float(d.get("beta_slow", 1)),
        )
    except KeyError as e:
        raise ConfigError(f"{where} is missing {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where} has a non-numeric value: {e}") from None


def _attention_kinds(raw: dict[str, Any], n_layers: int) -> tuple[AttentionKind, ...]:
    if raw.get("compress_ratios") is not None:
        ratios = raw["compress_ratios"]
        if not isinstance(ratios, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ratios):
            raise ConfigError(f"compress_ratios must be a list of integers, got {ratios!r}")
        if len(ratios) < n_layers:
            raise ConfigError(f"compress_ratios has {len(ratios)} entries, fewer than num_hidden_layers={n_layers}")
        for i, r in enumerate(ratios):
            if r < 0:
                raise ConfigError(f"compress_ratios[{i}] must be >= 0, got {r}")
        # DeepSeek's reference: ratio 4 overlaps and has an indexer; any other ratio pools plainly.
        return tuple(AttentionKind(r, overlap=(r == 4)) for r in ratios[:n_layers])
    if raw.get("layer_types") is not None:
        types = raw["layer_types"]
        if not isinstance(types, list) or len(types) < n_layers:
            raise ConfigError(f"layer_types must be a list of at least num_hidden_layers={n_layers} names, got {types!r}")
        rates = dict(_DEFAULT_COMPRESS_RATES)
        if raw.get("compress_rate_csa") is not None:
            rates["compressed_sparse_attention"] = raw["compress_rate_csa"]
        if raw.get("compress_rate_hca") is not None:
            rates["heavily_compressed_attention"] = raw["compress_rate_hca"]
        given = raw.get("compress_rates")
        if given is not None:
            if not isinstance(given, Mapping):
                raise ConfigError(f"compress_rates must be an object mapping layer type to rate, got {given!r}")
            rates.update(given)
        kinds = []
        for i, t in enumerate(types[:n_layers]):
            if not isinstance(t, str) or t not in _LAYER_TYPE_NAMES:
                raise ConfigError(f"layer_types[{i}] = {t!r} is not one of {sorted(_LAYER_TYPE_NAMES)}")
            if t == "sliding_attention":
                kinds.append(AttentionKind(0))
                continue
            r = rates.get(t)
            if isinstance(r, bool) or not isinstance(r, int) or r < 1:
                raise ConfigError(f"compress_rates[{t!r}] must be an integer >= 1, got {r!r}")
            kinds.append(AttentionKind(r, overlap=(t == "compressed_sparse_attention")))
        return tuple(kinds)
    raise ConfigError("config.json needs compress_ratios or layer_types to describe the attention of each layer")


def _hash_layers(raw: dict[str, Any], n_layers: int) -> tuple[bool, ...]:
    if raw.get("mlp_layer_types") is not None:
        types = raw["mlp_layer_types"]
        if not isinstance(types, list) or len(types) < n_layers:
            raise ConfigError(f"mlp_layer_types must list at least num_hidden_layers={n_layers} entries, got {types!r}")
        for i, t in enumerate(types[:n_layers]):
            if not isinstance(t, str) or t not in ("hash_moe", "moe"):
                raise ConfigError(f"mlp_layer_types[{i}] = {t!r} is not 'hash_moe' or 'moe'")
        flags = tuple(t == "hash_moe" for t in types[:n_layers])
        if raw.get("num_hash_layers") is not None and raw["num_hash_layers"] != sum(flags):
            raise ConfigError(f"num_hash_layers={raw['num_hash_layers']} disagrees with mlp_layer_types ({sum(flags)} hash_moe layers)")
        return flags
    n_hash = _opt(raw, "num_hash_layers", 0)
    if not 0 <= n_hash <= n_layers:
        raise ConfigError(f"num_hash_layers={n_hash} must be within [0, num_hidden_layers={n_layers}]")
    return tuple(i < n_hash for i in range(n_layers))


def _ropes(raw: dict[str, Any], head_dim: int) -> tuple[RopeConfig, RopeConfig, int]:
    rope_dim = raw.get("qk_rope_head_dim")
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, Mapping):
        raise ConfigError(f"rope_parameters must be an object, got {params!r}")
    prf = raw.get("partial_rotary_factor")
    if rope_dim is None and prf is None and isinstance(params, Mapping):
        sub = params.get("main") if isinstance(params.get("main"), Mapping) else params
        prf = sub.get("partial_rotary_factor")
    if rope_dim is None:
        if prf is None:
            raise ConfigError("config.json needs qk_rope_head_dim or partial_rotary_factor")
        rope_dim = int(head_dim * _num(prf, "partial_rotary_factor"))
    elif prf is not None and int(head_dim * _num(prf, "partial_rotary_factor")) != rope_dim:
        raise ConfigError(f"partial_rotary_factor={prf} gives {int(head_dim * float(prf))} rope dims, but qk_rope_head_dim={rope_dim}")
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, int):
        raise ConfigError(f"qk_rope_head_dim must be an integer, got {rope_dim!r}")

    if isinstance(params, Mapping) and isinstance(params.get("main"), Mapping):
        main_d, comp_d = params["main"], params.get("compress")
        if not isinstance(comp_d, Mapping):
            raise ConfigError("rope_parameters has 'main' but no 'compress' entry")
        for name, d in (("main", main_d), ("compress", comp_d)):
            if "rope_theta" not in d:
                raise ConfigError(f"rope_parameters.{name} is missing 'rope_theta'")
        main = RopeConfig(_num(main_d["rope_theta"], "rope_parameters.main.rope_theta"),
                          _yarn_from(main_d, "rope_parameters.main"))
        comp = RopeConfig(_num(comp_d["rope_theta"], "rope_parameters.compress.rope_theta"),
                          _yarn_from(comp_d, "rope_parameters.compress"))
        for key, rope in (("rope_theta", main), ("compress_rope_theta", comp)):
            if raw.get(key) is not None and float(raw[key]) != rope.theta:
                raise ConfigError(f"{key}={raw[key]} disagrees with rope_parameters ({rope.theta})")
        return main, comp, rope_dim
    theta = _opt(raw, "rope_theta", 10000.0, float)
    ctheta = _opt(raw, "compress_rope_theta", 160000.0, float)
    scaling = raw.get("rope_scaling")
    yarn = _yarn_from(scaling, "rope_scaling") if scaling is not None else None
    # DeepSeek's reference applies YaRN only on compressed layers (compress_ratio > 0).
    return RopeConfig(theta), RopeConfig(ctheta, yarn), rope_dim


_V41_MODELARGS_TO_HF = {
    "kv_source_layers": "kv_source_layer_ids", "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id", "engram_pad_id": "engram_pad_token_id",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}
_V41_VISION_ARGS = ("vision_n_layers", "vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size",
                    "vision_rope_theta", "vision_downsample_ratio", "vision_max_n_token", "vision_min_pixels",
                    "vision_max_wh_ratio")
_V41_KEYS = {
    "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id", "candidate_topk_blocks",
    "candidate_block_size", "engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size",
    "engram_n_heads", "engram_head_dim", "engram_vocab_size", "engram_pad_token_id",
    "engram_compressed_vocab_size", "dspark_block_size", "dspark_noise_token_id", "dspark_markov_rank",
    "dspark_n_routed_experts", "dspark_num_experts_per_tok", "dspark_target_layer_ids", "gate_temp",
    "image_token_id", "vision_config", "text_config",
}


def _v41_flatten(raw: dict[str, Any]) -> dict[str, Any]:
    """V4.1 HF config (top level + `text_config`) or ModelArgs spelling -> one flat HF-style dict."""
    if isinstance(raw.get("text_config"), Mapping):
        flat = {k: v for k, v in raw.items() if k not in ("text_config",)}
        flat.update(raw["text_config"])
        for k in ("quantization_config", "bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"):
            if raw.get(k) is not None:
                flat[k] = raw[k]
    elif raw.get("text_config") is not None:
        raise ConfigError(f"text_config must be an object, got {raw['text_config']!r}")
    elif "dim" in raw and "n_layers" in raw:          # inference/config.json (ModelArgs)
        flat = _from_model_args({_V41_MODELARGS_TO_HF.get(k, k): v for k, v in raw.items()
                                 if k not in _V41_VISION_ARGS})
        if raw.get("n_routed_experts_score") is not None:
            flat.pop("n_routed_experts_score")
        if raw.get("vision_n_layers"):
            flat["vision_config"] = {k[len("vision_"):]: raw[k] for k in _V41_VISION_ARGS if k in raw}
        if raw.get("dtype") == "fp8" and "quantization_config" not in raw:
            flat["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32],
                                           "scale_fmt": raw.get("scale_fmt", "ue8m0"),
                                           "expert_dtype": raw.get("expert_dtype", "fp8")}
    else:
        flat = dict(raw)
    flat["model_type"] = "deepseek_v41"
    return flat


def _int_list(raw: dict[str, Any], key: str, default: Any = None) -> tuple[int, ...]:
    v = raw.get(key, default)
    if v is None:
        raise ConfigError(f"config.json is missing required field {key!r}")
    if not isinstance(v, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise ConfigError(f"{key} must be a list of integers, got {v!r}")
    return tuple(v)


def _v41_fields(raw: dict[str, Any]) -> dict[str, Any]:
    cand = raw.get("candidate_source_layer_id")
    if cand is not None and (isinstance(cand, bool) or not isinstance(cand, int)):
        raise ConfigError(f"candidate_source_layer_id must be an integer, got {cand!r}")
    sharing = SharingConfig(
        kv_sources=_int_list(raw, "kv_source_layer_ids"),
        index_sources=_int_list(raw, "index_source_layer_ids"),
        candidate_source=cand,
        candidate_topk_blocks=_opt(raw, "candidate_topk_blocks", 2048),
        candidate_block_size=_opt(raw, "candidate_block_size", 8),
    )
    engram = None
    if raw.get("engram_layer_ids"):
        engram = EngramConfig(
            layer_ids=_int_list(raw, "engram_layer_ids"),
            num_embeddings=_int_list(raw, "engram_num_embeddings"),
            max_ngram_size=_opt(raw, "engram_max_ngram_size", 4),
            n_heads=_req(raw, "engram_n_heads"),
            head_dim=_req(raw, "engram_head_dim"),
            vocab_size=_req(raw, "engram_vocab_size"),
            pad_id=_opt(raw, "engram_pad_token_id", 2),
            compressed_vocab_size=_req(raw, "engram_compressed_vocab_size"),
        )
    dspark = None
    n_mtp = _opt(raw, "num_nextn_predict_layers", 0)
    if _opt(raw, "dspark_block_size", 0) > 0 and n_mtp > 0:
        dspark = DSparkConfig(
            n_layers=n_mtp,
            block_size=_req(raw, "dspark_block_size"),
            noise_token_id=raw.get("dspark_noise_token_id"),
            markov_rank=raw.get("dspark_markov_rank"),
            n_routed_experts=_opt(raw, "dspark_n_routed_experts", 0),
            n_activated_experts=_opt(raw, "dspark_num_experts_per_tok", 0),
            target_layer_ids=_int_list(raw, "dspark_target_layer_ids", ()),
        )
    vision = raw.get("vision_config")
    if vision is not None and not isinstance(vision, Mapping):
        raise ConfigError(f"vision_config must be an object, got {vision!r}")
    if vision is not None and not vision.get("num_hidden_layers", vision.get("n_layers", 1)):
        vision = None
    return dict(sharing=sharing, engram=engram, dspark=dspark, gate_temp=_opt(raw, "gate_temp", 1.0, float),
                image_token_id=raw.get("image_token_id"), vision=dict(vision) if vision else None)


def _parse(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type is None and "dim" in raw and "n_layers" in raw:
        if any(k in raw for k in ("kv_source_layers", "index_source_layers", "engram_layer_ids")):
            model_type = "deepseek_v41"
        else:
            raw = _from_model_args(raw)
            model_type = "deepseek_v4"
    v41 = model_type in ("deepseek_v41", "deepseek_v41_text")
    if v41:
        raw = _v41_flatten(raw)
    elif model_type != "deepseek_v4":
        raise ConfigError(f"model_type {model_type!r} is not a DeepSeek-V4 model (expected 'deepseek_v4' or 'deepseek_v41')")

    n_layers = _req(raw, "num_hidden_layers")
    if n_layers <= 0:
        raise ConfigError(f"num_hidden_layers must be positive, got {n_layers}")
    head_dim = _req(raw, "head_dim")
    main, comp, rope_dim = _ropes(raw, head_dim)
    quant = raw.get("quantization_config")
    if quant is not None and not isinstance(quant, Mapping):
        raise ConfigError(f"quantization_config must be an object, got {quant!r}")
    if quant is not None or raw.get("expert_dtype") is not None:
        quant = dict(quant or {})
        if raw.get("expert_dtype") is not None:
            quant.setdefault("expert_dtype", raw["expert_dtype"])

    known = set(_IGNORED_KEYS) | {
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
        "qk_rope_head_dim", "partial_rotary_factor", "q_lora_rank", "o_groups", "o_lora_rank",
        "sliding_window", "compress_ratios", "layer_types", "compress_rates", "mlp_layer_types",
        "num_hash_layers", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
        "hc_sinkhorn_iters", "hc_eps", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
        "moe_intermediate_size", "routed_scaling_factor", "scoring_func", "swiglu_limit", "rms_norm_eps",
        "rope_theta", "compress_rope_theta", "rope_scaling", "rope_parameters", "num_nextn_predict_layers",
        "max_position_embeddings", "bos_token_id", "eos_token_id",
    }
    if v41:
        known |= _V41_KEYS | {"temperature"}
    unknown = sorted(k for k in raw if k not in known)
    if unknown:
        warnings.warn(f"config.json: ignoring unknown fields {unknown}", stacklevel=3)

    kinds = _attention_kinds(raw, n_layers)
    extra: dict[str, Any] = {}
    if v41:   # V4.1 compressors never overlap; indexers are placed by index_source_layer_ids
        kinds = tuple(AttentionKind(k.ratio) for k in kinds)
        extra = _v41_fields(raw)
    eos = raw.get("eos_token_id", 1)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return ModelConfig(
        vocab_size=_req(raw, "vocab_size"),
        dim=_req(raw, "hidden_size"),
        n_layers=n_layers,
        n_heads=_req(raw, "num_attention_heads"),
        head_dim=head_dim,
        rope_head_dim=rope_dim,
        q_lora_rank=_req(raw, "q_lora_rank"),
        o_groups=_req(raw, "o_groups"),
        o_lora_rank=_req(raw, "o_lora_rank"),
        window_size=_req(raw, "sliding_window"),
        attention_kinds=kinds,
        hash_moe=_hash_layers(raw, n_layers),
        index_n_heads=_req(raw, "index_n_heads"),
        index_head_dim=_req(raw, "index_head_dim"),
        index_topk=_req(raw, "index_topk"),
        hc_mult=_opt(raw, "hc_mult", 4),
        hc_sinkhorn_iters=_opt(raw, "hc_sinkhorn_iters", 20),
        hc_eps=_opt(raw, "hc_eps", 1e-6, float),
        n_routed_experts=_req(raw, "n_routed_experts"),
        n_activated_experts=_req(raw, "num_experts_per_tok"),
        n_shared_experts=_opt(raw, "n_shared_experts", 1),
        moe_inter_dim=_req(raw, "moe_intermediate_size"),
        route_scale=_opt(raw, "routed_scaling_factor", 1.0, float),
        score_func=raw.get("scoring_func", "sqrtsoftplus"),
        swiglu_limit=_opt(raw, "swiglu_limit", 10.0, float),
        norm_eps=_opt(raw, "rms_norm_eps", 1e-6, float),
        rope_main=main,
        rope_compress=comp,
        n_mtp_layers=_opt(raw, "num_nextn_predict_layers", 0),
        max_position_embeddings=_opt(raw, "max_position_embeddings", 1 << 20),
        bos_token_id=raw.get("bos_token_id", 0),
        eos_token_id=eos,
        model_type="deepseek_v41" if v41 else "deepseek_v4",
        quantization=quant,
        **extra,
    )


# ---------------------------------------------------------------------- presets
def _v4_preset(*, dim, n_layers, ratios, n_heads, q_lora_rank, o_groups, index_topk, n_experts,
               route_scale, moe_inter_dim) -> dict[str, Any]:
    return {
        "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": dim, "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": q_lora_rank,
        "o_groups": o_groups, "o_lora_rank": 1024, "sliding_window": 128, "compress_ratios": ratios,
        "num_hash_layers": 3, "index_n_heads": 64, "index_head_dim": 128, "index_topk": index_topk,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "n_routed_experts": n_experts,
        "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": moe_inter_dim,
        "routed_scaling_factor": route_scale, "scoring_func": "sqrtsoftplus", "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-6, "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "num_nextn_predict_layers": 1, "max_position_embeddings": 1048576, "bos_token_id": 0, "eos_token_id": 1,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [128, 128], "activation_scheme": "dynamic",
                                "expert_dtype": "fp4"},
    }


def _v41_preset() -> dict[str, Any]:
    """DeepSeek-V4.1-Flash as released (model-spec.md §2.1-§2.3), in its HF config layout."""
    text = _v4_preset(dim=5120, n_layers=40, ratios=[0, 0] + [2] * 18 + [1] * 20 + [0] * 3, n_heads=64,
                      q_lora_rank=1280, o_groups=8, index_topk=512, n_experts=384, route_scale=1.5,
                      moe_inter_dim=2304)
    for k in ("quantization_config", "bos_token_id", "eos_token_id"):
        text.pop(k)
    text.update({
        "model_type": "deepseek_v41_text", "num_hash_layers": 0, "index_n_heads": 32, "rms_norm_eps": 1e-20,
        "num_nextn_predict_layers": 3, "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36], "candidate_source_layer_id": 20,
        "candidate_topk_blocks": 2048, "candidate_block_size": 8, "gate_temp": 1.0,
        "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
        "engram_n_heads": 8, "engram_head_dim": 256, "engram_vocab_size": 16000000, "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 99092, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
        "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
        "dspark_target_layer_ids": [37, 38, 39],
    })
    return {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "bos_token_id": 0,
        "eos_token_id": 1, "pad_token_id": 2, "image_token_id": 129264,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                                "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
        "text_config": text,
        "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024,
                          "num_attention_heads": 16, "intermediate_size": 2816, "patch_size": 14, "rope_theta": 10000,
                          "downsample_ratio": 3, "max_image_tokens": 1024, "min_pixels": 295936,
                          "max_wh_ratio": None},
    }


PRESETS: dict[str, dict[str, Any]] = {
    "v4-flash": _v4_preset(dim=4096, n_layers=43, ratios=[0, 0] + [4, 128] * 20 + [4] + [0], n_heads=64,
                           q_lora_rank=1024, o_groups=8, index_topk=512, n_experts=256, route_scale=1.5,
                           moe_inter_dim=2048),
    "v4-pro": _v4_preset(dim=7168, n_layers=61, ratios=[128, 128] + [4, 128] * 29 + [4] + [0], n_heads=128,
                         q_lora_rank=1536, o_groups=16, index_topk=1024, n_experts=384, route_scale=2.5,
                         moe_inter_dim=3072),
    "v41-flash": _v41_preset(),
}


def preset(name: str) -> ModelConfig:
    """The released architecture sizes: 'v4-flash', 'v4-pro' or 'v41-flash'."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return ModelConfig.from_dict(PRESETS[name])
