"""Every model size jdeep knows by name, as config.json dicts: the released architectures (`PRESETS`,
`preset(name)` -> ModelConfig) and the small models that tests, `jdeep demo` and `jdeep bench` fill with
seeded random weights (tools/random_weights.py)."""

from __future__ import annotations

from typing import Any

from .config import ConfigError, ModelConfig
from .config_formats import parse_config
from .io.engram_tables import EngramLayout

__all__ = ["PRESETS", "PRESET_NAMES", "preset", "TINY_CONFIG", "deep_tiny_config", "one_layer_config",
           "tiny_v41_config", "BENCH_DEFAULT_CONFIG"]


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
    return parse_config(PRESETS[name])


PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)


# ---------------------------------------------------------------------- small models (seeded random weights)
# A small model with every layer kind (sliding, ratio-4 CSA with indexer, ratio-16 HCA, hash MoE).
TINY_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v4", "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 6,
    "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 64, "o_groups": 2,
    "o_lora_rank": 32, "sliding_window": 16,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "num_hash_layers": 2, "index_n_heads": 16, "index_head_dim": 32, "index_topk": 4, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "moe_intermediate_size": 64, "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus", "swiglu_limit": 10.0, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 1,
}


def deep_tiny_config(n_repeats: int) -> dict[str, Any]:
    """TINY_CONFIG's kinds at depth 2 + 2 * n_repeats: sliding/hash, CSA/hash, then (HCA, CSA) repeated (for tests
    that the compiled programs do not grow with depth)."""
    raw = dict(TINY_CONFIG)
    raw["layer_types"] = ["sliding_attention", "compressed_sparse_attention"] + \
        ["heavily_compressed_attention", "compressed_sparse_attention"] * n_repeats
    raw["num_hidden_layers"] = len(raw["layer_types"])
    return raw


def one_layer_config(**overrides: Any) -> dict[str, Any]:
    """TINY_CONFIG cut to one layer of compressed sparse attention (compressor and indexer) with a top-k MoE:
    the cheapest model to compile that still runs the richest attention kind (tests)."""
    return dict(TINY_CONFIG, layer_types=["compressed_sparse_attention"], num_hidden_layers=1, num_hash_layers=0,
                **overrides)


def tiny_v41_config(engram_vocab_size: int = 400, quantized: bool = True, vision: bool = False) -> dict[str, Any]:
    """A small DeepSeek-V4.1 HF config with every V4.1 layer kind: sliding, ratio-2 and ratio-1 KV sources,
    layers reusing a top-k, index sources, the candidate source and a restricted index source, two Engram
    layers. Its tokenizer (write_word_tokenizer) has one class per id, so the compressed vocab is the vocab.
    The Engram tables' rows follow from engram_vocab_size (the hash primes). `vision`: with a tiny vision tower
    (2 ViT blocks of width 32 over 4x4-pixel patches, the real 3x3 aligner, spans of at most 64 positions, images
    scaled up to 24x24 pixels) and image_token_id 509."""
    vocab, layers, max_ngram, heads = 512, [1, 4], 3, 4
    rows = EngramLayout.create(layers, max_ngram, heads, engram_vocab_size, vocab, 0).table_rows
    text = {
        "model_type": "deepseek_v41_text", "vocab_size": vocab, "hidden_size": 128, "moe_intermediate_size": 64,
        "num_hidden_layers": 8, "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 32, "q_lora_rank": 64,
        "o_lora_rank": 32, "o_groups": 2, "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "max_position_embeddings": 4096,
        "rope_theta": 10000, "rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                                              "original_max_position_embeddings": 64},
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5, "sliding_window": 8, "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1],
        "compress_rope_theta": 160000, "kv_source_layer_ids": [2, 5], "index_source_layer_ids": [2, 4, 5, 7],
        "index_n_heads": 4, "index_head_dim": 32, "index_topk": 4, "candidate_source_layer_id": 5,
        "candidate_topk_blocks": 2, "candidate_block_size": 4, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "engram_layer_ids": layers, "engram_num_embeddings": list(rows), "engram_max_ngram_size": max_ngram,
        "engram_vocab_size": engram_vocab_size, "engram_n_heads": heads, "engram_head_dim": 32,
        "engram_pad_token_id": 2, "engram_compressed_vocab_size": vocab, "num_nextn_predict_layers": 0,
    }
    raw = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "bos_token_id": 0,
           "eos_token_id": 1, "pad_token_id": 2, "text_config": text}
    if quantized:
        raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    if vision:
        raw["image_token_id"] = vocab - 3
        raw["vision_config"] = {"model_type": "deepseek_v41_vision", "num_hidden_layers": 2, "hidden_size": 32,
                                "num_attention_heads": 2, "intermediate_size": 48, "patch_size": 4,
                                "rope_theta": 10000, "downsample_ratio": 3, "max_image_tokens": 64,
                                "min_pixels": 24 * 24, "max_wh_ratio": None}
    return raw


# `jdeep bench` with no model: a small DeepSeek-V4 (every layer kind) with seeded random weights
BENCH_DEFAULT_CONFIG = {
    "model_type": "deepseek_v4", "vocab_size": 32768, "hidden_size": 1024, "num_hidden_layers": 8,
    "num_attention_heads": 8, "head_dim": 256, "qk_rope_head_dim": 64, "q_lora_rank": 256, "o_groups": 4,
    "o_lora_rank": 256, "n_routed_experts": 32, "num_experts_per_tok": 4, "n_shared_experts": 1,
    "moe_intermediate_size": 512, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_hash_layers": 2,
    "compress_ratios": [0, 4, 128, 4, 128, 4, 128, 0], "sliding_window": 128, "index_n_heads": 16,
    "index_head_dim": 64, "index_topk": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "rope_scaling": {"type": "yarn", "factor": 16.0,
                                                       "original_max_position_embeddings": 4096,
                                                       "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 65536, "bos_token_id": 0, "eos_token_id": 1,
}
