"""The small DeepSeek-V4 / V4.1 models jdeep fills with seeded random weights (tools/testing/random_weights.py), as
config.json dicts: `TINY_CONFIG` (every V4 layer kind; `jdeep demo --random`), `tiny_v41_config` (every V4.1 layer
kind), `one_layer_config` and `deep_tiny_config` (the test suite's cheapest and deepest), and `BENCH_DEFAULT_CONFIG`
(`jdeep bench` with no model). Not released architectures: those are config/presets.py."""

from __future__ import annotations

from typing import Any

from ..io.engram_tables import EngramLayout

__all__ = ["TINY_CONFIG", "deep_tiny_config", "one_layer_config", "tiny_v41_config", "BENCH_DEFAULT_CONFIG"]

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
