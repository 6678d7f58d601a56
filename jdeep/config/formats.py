"""Reading and writing config.json for the DeepSeek-V4 family (model-spec.md §2).

`config_fields` reads the three spellings found in the wild: DeepSeek's Hugging Face `config.json` (legacy
keys such as `compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`), the
transformers-normalised fields (`layer_types` + `compress_rates`, `mlp_layer_types`, `rope_parameters`,
`partial_rotary_factor`) and the reference code's `ModelArgs` names (`dim`, `n_layers`, ... of
`inference/config.json`); DeepSeek-V4.1's HF layout nests the architecture under `text_config`.
Every problem raises `ConfigError` naming the offending field. `config_to_dict` writes the HF spelling back (an
equal config when read again). These are what `ModelConfig.from_dict`, `from_file` and `to_dict` call.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Mapping

from .fields import from_model_args, number, optional, required
from .formats_v41 import V41_KEYS, flatten_v41, v41_dict, v41_fields
from .parts import AttentionKind, ConfigError, QuantizationConfig, RopeConfig, YarnConfig

__all__ = ["config_fields", "read_config_json", "config_to_dict"]

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
def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object of `config.json` (or of a folder holding one), unparsed."""
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
    return raw


# ---------------------------------------------------------------------- parser helpers
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
    n_hash = optional(raw, "num_hash_layers", 0)
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
        rope_dim = int(head_dim * number(prf, "partial_rotary_factor"))
    elif prf is not None and int(head_dim * number(prf, "partial_rotary_factor")) != rope_dim:
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
        main = RopeConfig(number(main_d["rope_theta"], "rope_parameters.main.rope_theta"),
                          _yarn_from(main_d, "rope_parameters.main"))
        comp = RopeConfig(number(comp_d["rope_theta"], "rope_parameters.compress.rope_theta"),
                          _yarn_from(comp_d, "rope_parameters.compress"))
        for key, rope in (("rope_theta", main), ("compress_rope_theta", comp)):
            if raw.get(key) is not None and float(raw[key]) != rope.theta:
                raise ConfigError(f"{key}={raw[key]} disagrees with rope_parameters ({rope.theta})")
        return main, comp, rope_dim
    theta = optional(raw, "rope_theta", 10000.0, float)
    ctheta = optional(raw, "compress_rope_theta", 160000.0, float)
    scaling = raw.get("rope_scaling")
    yarn = _yarn_from(scaling, "rope_scaling") if scaling is not None else None
    # DeepSeek's reference applies YaRN only on compressed layers (compress_ratio > 0).
    return RopeConfig(theta), RopeConfig(ctheta, yarn), rope_dim


def config_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig's fields from any of the spellings (V4.1: top level + `text_config`, or ModelArgs); the
    ModelConfig built from them validates the whole (ModelConfig.from_dict)."""
    raw = dict(raw)
    model_type = raw.get("model_type")
    if model_type is None and "dim" in raw and "n_layers" in raw:
        if any(k in raw for k in ("kv_source_layers", "index_source_layers", "engram_layer_ids")):
            model_type = "deepseek_v41"
        else:
            raw = from_model_args(raw)
            model_type = "deepseek_v4"
    v41 = model_type in ("deepseek_v41", "deepseek_v41_text")
    if v41:
        raw = flatten_v41(raw)
    elif model_type != "deepseek_v4":
        raise ConfigError(f"model_type {model_type!r} is not a DeepSeek-V4 model (expected 'deepseek_v4' or 'deepseek_v41')")

    n_layers = required(raw, "num_hidden_layers")
    if n_layers <= 0:
        raise ConfigError(f"num_hidden_layers must be positive, got {n_layers}")
    head_dim = required(raw, "head_dim")
    main, comp, rope_dim = _ropes(raw, head_dim)
    quant = raw.get("quantization_config")
    if quant is not None and not isinstance(quant, Mapping):
        raise ConfigError(f"quantization_config must be an object, got {quant!r}")
    if quant is not None or raw.get("expert_dtype") is not None:
        quant = dict(quant or {})
        if raw.get("expert_dtype") is not None:
            quant.setdefault("expert_dtype", raw["expert_dtype"])
        quant = QuantizationConfig.from_hf(quant)

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
        known |= V41_KEYS | {"temperature"}
    unknown = sorted(k for k in raw if k not in known)
    if unknown:
        warnings.warn(f"config.json: ignoring unknown fields {unknown}", stacklevel=3)

    kinds = _attention_kinds(raw, n_layers)
    extra: dict[str, Any] = {}
    if v41:   # V4.1 compressors never overlap; indexers are placed by index_source_layer_ids
        kinds = tuple(AttentionKind(k.ratio) for k in kinds)
        extra = v41_fields(raw)
    eos = raw.get("eos_token_id", 1)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return dict(
        vocab_size=required(raw, "vocab_size"),
        dim=required(raw, "hidden_size"),
        n_layers=n_layers,
        n_heads=required(raw, "num_attention_heads"),
        head_dim=head_dim,
        rope_head_dim=rope_dim,
        q_lora_rank=required(raw, "q_lora_rank"),
        o_groups=required(raw, "o_groups"),
        o_lora_rank=required(raw, "o_lora_rank"),
        window_size=required(raw, "sliding_window"),
        attention_kinds=kinds,
        hash_moe=_hash_layers(raw, n_layers),
        index_n_heads=required(raw, "index_n_heads"),
        index_head_dim=required(raw, "index_head_dim"),
        index_topk=required(raw, "index_topk"),
        hc_mult=optional(raw, "hc_mult", 4),
        hc_sinkhorn_iters=optional(raw, "hc_sinkhorn_iters", 20),
        hc_eps=optional(raw, "hc_eps", 1e-6, float),
        n_routed_experts=required(raw, "n_routed_experts"),
        n_activated_experts=required(raw, "num_experts_per_tok"),
        n_shared_experts=optional(raw, "n_shared_experts", 1),
        moe_inter_dim=required(raw, "moe_intermediate_size"),
        route_scale=optional(raw, "routed_scaling_factor", 1.0, float),
        score_func=raw.get("scoring_func", "sqrtsoftplus"),
        swiglu_limit=optional(raw, "swiglu_limit", 10.0, float),
        norm_eps=optional(raw, "rms_norm_eps", 1e-6, float),
        rope_main=main,
        rope_compress=comp,
        n_mtp_layers=optional(raw, "num_nextn_predict_layers", 0),
        max_position_embeddings=optional(raw, "max_position_embeddings", 1 << 20),
        bos_token_id=raw.get("bos_token_id", 0),
        eos_token_id=eos,
        model_type="deepseek_v41" if v41 else "deepseek_v4",
        quantization=quant,
        **extra,
    )


def config_to_dict(config: Any) -> dict[str, Any]:
    """A DeepSeek-style HF config.json that `parse_config` reads back to an equal config."""
    ratios = [k.ratio for k in config.attention_kinds]
    legacy_ok = all((k.ratio == 4) == k.overlap for k in config.attention_kinds)
    d: dict[str, Any] = {
        "model_type": config.model_type, "vocab_size": config.vocab_size, "hidden_size": config.dim,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads, "head_dim": config.head_dim,
        "qk_rope_head_dim": config.rope_head_dim, "q_lora_rank": config.q_lora_rank, "o_groups": config.o_groups,
        "o_lora_rank": config.o_lora_rank, "sliding_window": config.window_size, "index_n_heads": config.index_n_heads,
        "index_head_dim": config.index_head_dim, "index_topk": config.index_topk, "hc_mult": config.hc_mult,
        "hc_sinkhorn_iters": config.hc_sinkhorn_iters, "hc_eps": config.hc_eps,
        "n_routed_experts": config.n_routed_experts, "num_experts_per_tok": config.n_activated_experts,
        "n_shared_experts": config.n_shared_experts, "moe_intermediate_size": config.moe_inter_dim,
        "routed_scaling_factor": config.route_scale, "scoring_func": config.score_func,
        "swiglu_limit": config.swiglu_limit, "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_main.theta,
        "compress_rope_theta": config.rope_compress.theta, "num_nextn_predict_layers": config.n_mtp_layers,
        "max_position_embeddings": config.max_position_embeddings, "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id, "mlp_layer_types": ["hash_moe" if h else "moe" for h in config.hash_moe],
    }
    if legacy_ok:
        d["compress_ratios"] = ratios + [0] * config.n_mtp_layers
    else:
        d["layer_types"] = [
            "sliding_attention" if k.ratio == 0 else
            ("compressed_sparse_attention" if k.overlap else "heavily_compressed_attention")
            for k in config.attention_kinds]
        rates = {("compressed_sparse_attention" if k.overlap else "heavily_compressed_attention"): k.ratio
                 for k in config.attention_kinds if k.ratio}
        d["compress_rates"] = rates
    def rope_dict(rope: RopeConfig) -> dict[str, Any]:
        y = rope.yarn
        if y is None:
            return {"rope_type": "default", "rope_theta": rope.theta}
        return {"rope_type": "yarn", "rope_theta": rope.theta, "factor": y.factor,
                "original_max_position_embeddings": y.original_seq_len,
                "beta_fast": y.beta_fast, "beta_slow": y.beta_slow}

    if config.rope_main.yarn is not None:  # only the normalised spelling can say so
        d["rope_parameters"] = {"main": rope_dict(config.rope_main), "compress": rope_dict(config.rope_compress)}
    elif config.rope_compress.yarn is not None:
        y = config.rope_compress.yarn
        d["rope_scaling"] = {"type": "yarn", "factor": y.factor, "original_max_position_embeddings": y.original_seq_len,
                             "beta_fast": y.beta_fast, "beta_slow": y.beta_slow}
    if config.quantization is not None:
        d["quantization_config"] = config.quantization.to_hf()
    if config.is_v41:
        return v41_dict(config, d, ratios)
    return d
