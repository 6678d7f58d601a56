"""ModelConfig -> DeepSeek's Hugging Face config.json spelling (what `ModelConfig.to_dict` and jdeep's writers
emit); config_formats.parse_config reads it back to an equal config."""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, RopeConfig

__all__ = ["config_to_dict"]


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
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
        d["quantization_config"] = dict(config.quantization)
    if config.is_v41:
        return _v41_dict(config, d, ratios)
    return d


def _v41_dict(config: ModelConfig, d: dict[str, Any], ratios: list[int]) -> dict[str, Any]:
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
        out["quantization_config"] = dict(config.quantization)
    return out
