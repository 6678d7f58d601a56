"""DeepSeek-V4.1's config.json spellings, read and written: the HF layout that nests the text model under
`text_config` (with `vision_config` and `quantization_config` beside it), flattened for the V4 reader
(`flatten_v41`); V4.1's own fields — cross-layer KV / index sources, Engram, DSpark, the vision tower —
(`v41_fields`); and the nested layout written back (`v41_dict`). config/formats.py calls them."""

from __future__ import annotations

from typing import Any, Mapping

from .fields import from_model_args, int_list, optional, required
from .parts import ConfigError, DSparkConfig, EngramConfig, SharingConfig, VisionConfig

__all__ = ["flatten_v41", "v41_fields", "v41_dict", "V41_KEYS"]

_V41_MODELARGS_TO_HF = {
    "kv_source_layers": "kv_source_layer_ids", "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id", "engram_pad_id": "engram_pad_token_id",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}
_V41_VISION_ARGS = ("vision_n_layers", "vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size",
                    "vision_rope_theta", "vision_downsample_ratio", "vision_max_n_token", "vision_min_pixels",
                    "vision_max_wh_ratio")
# config.json keys only V4.1 has (the V4 reader takes them as known)
V41_KEYS = {
    "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id", "candidate_topk_blocks",
    "candidate_block_size", "engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size",
    "engram_n_heads", "engram_head_dim", "engram_vocab_size", "engram_pad_token_id",
    "engram_compressed_vocab_size", "dspark_block_size", "dspark_noise_token_id", "dspark_markov_rank",
    "dspark_n_routed_experts", "dspark_num_experts_per_tok", "dspark_target_layer_ids", "gate_temp",
    "image_token_id", "vision_config", "text_config",
}


def flatten_v41(raw: dict[str, Any]) -> dict[str, Any]:
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
        flat = from_model_args({_V41_MODELARGS_TO_HF.get(k, k): v for k, v in raw.items()
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


def v41_fields(raw: dict[str, Any]) -> dict[str, Any]:
    cand = raw.get("candidate_source_layer_id")
    if cand is not None and (isinstance(cand, bool) or not isinstance(cand, int)):
        raise ConfigError(f"candidate_source_layer_id must be an integer, got {cand!r}")
    sharing = SharingConfig(
        kv_sources=int_list(raw, "kv_source_layer_ids"),
        index_sources=int_list(raw, "index_source_layer_ids"),
        candidate_source=cand,
        candidate_topk_blocks=optional(raw, "candidate_topk_blocks", 2048),
        candidate_block_size=optional(raw, "candidate_block_size", 8),
    )
    engram = None
    if raw.get("engram_layer_ids"):
        engram = EngramConfig(
            layer_ids=int_list(raw, "engram_layer_ids"),
            num_embeddings=int_list(raw, "engram_num_embeddings"),
            max_ngram_size=optional(raw, "engram_max_ngram_size", 4),
            n_heads=required(raw, "engram_n_heads"),
            head_dim=required(raw, "engram_head_dim"),
            vocab_size=required(raw, "engram_vocab_size"),
            pad_id=optional(raw, "engram_pad_token_id", 2),
            compressed_vocab_size=required(raw, "engram_compressed_vocab_size"),
        )
    dspark = None
    n_mtp = optional(raw, "num_nextn_predict_layers", 0)
    if optional(raw, "dspark_block_size", 0) > 0 and n_mtp > 0:
        dspark = DSparkConfig(
            n_layers=n_mtp,
            block_size=required(raw, "dspark_block_size"),
            noise_token_id=raw.get("dspark_noise_token_id"),
            markov_rank=raw.get("dspark_markov_rank"),
            n_routed_experts=optional(raw, "dspark_n_routed_experts", 0),
            n_activated_experts=optional(raw, "dspark_num_experts_per_tok", 0),
            target_layer_ids=int_list(raw, "dspark_target_layer_ids", ()),
        )
    vision = raw.get("vision_config")
    if vision is not None and not isinstance(vision, Mapping):
        raise ConfigError(f"vision_config must be an object, got {vision!r}")
    if vision is not None and not vision.get("num_hidden_layers", vision.get("n_layers", 1)):
        vision = None   # DeepSeek's ModelArgs: vision_n_layers 0 means no tower
    return dict(sharing=sharing, engram=engram, dspark=dspark, gate_temp=optional(raw, "gate_temp", 1.0, float),
                image_token_id=raw.get("image_token_id"),
                vision=VisionConfig.from_mapping(vision) if vision else None)


def v41_dict(config: Any, d: dict[str, Any], ratios: list[int]) -> dict[str, Any]:
    """V4.1's HF layout: architecture fields under `text_config`."""
    text = {k: v for k, v in d.items() if k not in ("quantization_config", "bos_token_id", "eos_token_id",
                                                     "mlp_layer_types", "layer_types", "compress_rates")}
    text["model_type"] = "deepseek_v41_text"
    text["compress_ratios"] = ratios + [0] * config.n_mtp_layers
    sh = config.sharing
    text.update({"kv_source_layer_ids": list(sh.kv_sources), "index_source_layer_ids": list(sh.index_sources),
                 "candidate_source_layer_id": sh.candidate_source,
                 "candidate_topk_blocks": sh.candidate_topk_blocks,
                 "candidate_block_size": sh.candidate_block_size, "gate_temp": config.gate_temp})
    if config.engram is not None:
        e = config.engram
        text.update({"engram_layer_ids": list(e.layer_ids), "engram_num_embeddings": list(e.num_embeddings),
                     "engram_max_ngram_size": e.max_ngram_size, "engram_n_heads": e.n_heads,
                     "engram_head_dim": e.head_dim, "engram_vocab_size": e.vocab_size,
                     "engram_pad_token_id": e.pad_id, "engram_compressed_vocab_size": e.compressed_vocab_size})
    if config.dspark is not None:
        ds = config.dspark
        text.update({"dspark_block_size": ds.block_size, "dspark_noise_token_id": ds.noise_token_id,
                     "dspark_markov_rank": ds.markov_rank, "dspark_n_routed_experts": ds.n_routed_experts,
                     "dspark_num_experts_per_tok": ds.n_activated_experts,
                     "dspark_target_layer_ids": list(ds.target_layer_ids)})
    out: dict[str, Any] = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
                           "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
                           "text_config": text}
    if config.image_token_id is not None:
        out["image_token_id"] = config.image_token_id
    if config.vision is not None:
        out["vision_config"] = config.vision.to_hf()
    if config.quantization is not None:
        out["quantization_config"] = config.quantization.to_hf()
    return out
