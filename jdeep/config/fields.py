"""Raw config.json values read and checked (config/formats.py, formats_v41.py): required and optional fields of a
type, numbers, integer lists, and DeepSeek's reference-code `ModelArgs` names mapped to the HF spelling. Every
problem raises ConfigError naming the field."""

from __future__ import annotations

from typing import Any

from .parts import ConfigError

__all__ = ["required", "optional", "number", "int_list", "from_model_args", "MODELARGS_TO_HF"]


MODELARGS_TO_HF = {
    "dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "moe_inter_dim": "moe_intermediate_size", "n_activated_experts": "num_experts_per_tok",
    "route_scale": "routed_scaling_factor", "score_func": "scoring_func", "norm_eps": "rms_norm_eps",
    "window_size": "sliding_window", "rope_head_dim": "qk_rope_head_dim", "n_hash_layers": "num_hash_layers",
    "n_mtp_layers": "num_nextn_predict_layers",
}


def from_model_args(raw: dict[str, Any]) -> dict[str, Any]:
    """Rename the reference code's ModelArgs keys (inference/config.json) to the HF spelling."""
    out = {"model_type": "deepseek_v4"}
    for k, v in raw.items():
        out[MODELARGS_TO_HF.get(k, k)] = v
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


def required(raw: dict[str, Any], key: str, kind: type | tuple[type, ...] = int) -> Any:
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


def optional(raw: dict[str, Any], key: str, default: Any, kind: type = int) -> Any:
    return required(raw, key, kind) if raw.get(key) is not None else default


def number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    return float(value)


def int_list(raw: dict[str, Any], key: str, default: Any = None) -> tuple[int, ...]:
    v = raw.get(key, default)
    if v is None:
        raise ConfigError(f"config.json is missing required field {key!r}")
    if not isinstance(v, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise ConfigError(f"{key} must be a list of integers, got {v!r}")
    return tuple(v)
