"""The released DeepSeek-V4 family's architectures by name, as config.json dicts (`PRESETS`) and as configs
(`preset(name)` -> ModelConfig): what `--preset` takes where no checkpoint is needed (check-graph, export, memory
and collective estimates). The small models filled with seeded random weights are config/small_models.py."""

from __future__ import annotations

from typing import Any

from .model import ConfigError, ModelConfig

__all__ = ["PRESETS", "PRESET_NAMES", "preset"]


# ---------------------------------------------------------------------- released models
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


PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)
