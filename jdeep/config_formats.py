"""Reading and writing config.json for the DeepSeek-V4 family (model-spec.md §2).

`parse_config` reads the three spellings found in the wild: DeepSeek's Hugging Face `config.json` (legacy
keys such as `compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`), the
transformers-normalised fields (`layer_types` + `compress_rates`, `mlp_layer_types`, `rope_parameters`,
`partial_rotary_factor`) and the reference code's `ModelArgs` names (`dim`, `n_layers`, ... of
`inference/config.json`); DeepSeek-V4.1's HF layout nests the architecture under `text_config`.
Every problem raises `ConfigError` naming the offending field. These (and config_json.config_to_dict, which
writes the HF spelling back) are the entry points behind `ModelConfig.from_dict`, `from_file` and `to_dict`,
registered when this module is imported (the jdeep package imports it).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Mapping

from .config import (AttentionKind, ConfigError, DSparkConfig, EngramConfig, ModelConfig, RopeConfig, SharingConfig,
                     VisionConfig, YarnConfig, register_formats)
from .config_json import config_to_dict

__all__ = ["parse_config", "load_config"]

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


# ---------------------------------------------------------------------- parsing
def load_config(path: str | os.PathLike) -> ModelConfig:
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
    return parse_config(raw)


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
        vision = None   # DeepSeek's ModelArgs: vision_n_layers 0 means no tower
    return dict(sharing=sharing, engram=engram, dspark=dspark, gate_temp=_opt(raw, "gate_temp", 1.0, float),
                image_token_id=raw.get("image_token_id"),
                vision=VisionConfig.from_mapping(vision) if vision else None)


def parse_config(raw: Mapping[str, Any]) -> ModelConfig:
    """One validated ModelConfig from any of the spellings (V4.1: top level + `text_config`, or ModelArgs)."""
    raw = dict(raw)
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


register_formats(parse=parse_config, load=load_config, to_dict=config_to_dict)
