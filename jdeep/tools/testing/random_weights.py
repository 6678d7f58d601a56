"""Seeded random checkpoints in DeepSeek's real format (config.json + safetensors under the original
tensor names), for tests, demos and benchmarks that need no download."""

from __future__ import annotations

import dataclasses
import json
import os

import ml_dtypes
import numpy as np
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from ...config import ModelConfig
from ...io.safetensors import write_safetensors
from ...io.chat.formats import ASSISTANT, BOS, END_THINK, EOS, THINK, USER
from ...io.writer import quantize_weight
from ...kernels import codecs
from ...param_spec import (F32, FP4, FP8, FP8_DEQUANT, INDEX, TensorSpec, dspark_extra_specs, dspark_stage_specs,
                          engram_table_specs, layer_specs, mtp_specs, top_specs)
from ...plan import layer_kinds, mtp_depths
from ...vision.params import random_vision_tensors
from ...config.small_models import TINY_CONFIG, deep_tiny_config, one_layer_config, tiny_v41_config

__all__ = ["TINY_CONFIG", "deep_tiny_config", "one_layer_config", "tiny_v41_config", "random_tensor", "random_checkpoint",
           "write_word_tokenizer"]


def write_word_tokenizer(path: str, vocab_size: int, chat_markers: bool = False) -> None:
    """A word-level tokenizer.json whose ids 0..vocab_size-1 decode to distinct words `tok<i>`. chat_markers:
    ids 0..5 are DeepSeek's chat markers instead (BOS, EOS, User, Assistant, <think>, </think>; special tokens),
    so `Tokenizer.chat` works on it."""
    markers = [BOS, EOS, USER, ASSISTANT, THINK, END_THINK] if chat_markers else []
    vocab = {f"tok{i}": i for i in range(len(markers), vocab_size)}
    vocab.update({m: i for i, m in enumerate(markers)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=f"tok{len(markers)}"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if markers:
        tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in markers])
    tok.save(path)


def random_tensor(rng: np.random.Generator, spec: TensorSpec, config: ModelConfig) -> np.ndarray:
    """A float32 (or int64 for tid2eid) tensor with scales that keep activations well-conditioned."""
    name, shape = spec.name, spec.shape
    if spec.kind == INDEX:  # tid2eid: distinct experts per token id
        E = config.n_routed_experts
        return np.argsort(rng.random((shape[0], E)), axis=1)[:, : shape[1]].astype(np.int64)
    last = name.split(".")[-1]
    if last.startswith("hc_"):
        if last.endswith("_fn"):
            return rng.normal(0, 0.5 / np.sqrt(shape[1]), shape).astype(np.float32)
        if last.endswith("_base"):
            return rng.normal(0, 0.5, shape).astype(np.float32)
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.normal(size=shape)).astype(np.float32)
    if name.endswith("attn_sink"):
        return rng.normal(0, 1, shape).astype(np.float32)
    if name.endswith(".ape"):
        return rng.normal(0, 0.5, shape).astype(np.float32)
    if name.endswith("gate.bias"):
        return rng.normal(0, 0.1, shape).astype(np.float32)
    if name == "embed.weight":
        return rng.normal(0, 1, shape).astype(np.float32)
    if name == "head.weight":
        return rng.normal(0, 2.0 / np.sqrt(shape[1]), shape).astype(np.float32)
    return rng.normal(0, 1.0 / np.sqrt(shape[-1]), shape).astype(np.float32)


def _all_specs(config: ModelConfig):
    for spec in top_specs(config):
        yield spec.name, spec
    for layer, kind in enumerate(layer_kinds(config)):
        for spec in layer_specs(config, kind):
            yield f"layers.{layer}.{spec.name}", spec
    for depth in range(mtp_depths(config)):   # DeepSeek-V4 checkpoints carry their MTP blocks
        for spec in mtp_specs(config):
            yield f"mtp.{depth}.{spec.name}", spec
    if config.dspark is not None:             # DeepSeek-V4.1 checkpoints carry the DSpark drafter's stages
        for stage in range(config.dspark.n_layers):
            for spec in dspark_stage_specs(config):
                yield f"mtp.{stage}.{spec.name}", spec
        for stage, spec in dspark_extra_specs(config):
            yield f"mtp.{stage}.{spec.name}", spec


def _engram_tables(rng: np.random.Generator, config: ModelConfig, sparse: bool) -> tuple[dict, dict]:
    """Random Engram tables (fp8 codes of N(0,1) values, e8m0 scales), or holes when `sparse`."""
    tensors, holes = {}, {}
    for name, code_shape, scale_shape in engram_table_specs(config):
        if sparse:
            holes[name + ".weight"] = (ml_dtypes.float8_e4m3fn, code_shape)
            holes[name + ".scale"] = (ml_dtypes.float8_e8m0fnu, scale_shape)
            continue
        # fp8 e4m3 rows with one e8m0 scale per 32 codes (model-spec.md §6.2)
        w = rng.normal(0, 1, code_shape).astype(np.float32)
        blocks = w.reshape(code_shape[0], -1, 32)
        e = codecs.ceil_log2(np, (np.maximum(np.abs(blocks).max(-1), 1e-30) / 448.0).astype(np.float32))
        codes = codecs.e4m3_encode(np, (blocks / codecs.pow2(np, e)[..., None]).reshape(code_shape).astype(np.float32))
        tensors[name + ".weight"] = codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
        tensors[name + ".scale"] = (e + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
    return tensors, holes


def random_checkpoint(config: ModelConfig | dict, folder: str, seed: int = 0, dtype: str = "float32",
                      n_shards: int = 1, sparse_engram: bool = False) -> ModelConfig:
    """Write config.json and seeded random weights (float32 or bfloat16) to `folder`; a config with a
    quantization_config gets DeepSeek's fp8/fp4 tensors (uint8 codes with e8m0 scales), as released.

    With n_shards > 1 the tensors are split over several files plus model.safetensors.index.json.
    V4.1 models with a vision tower get its tensors (vision.params). V4.1 models with Engram also get a tokenizer.json (write_word_tokenizer) and their Engram tables in
    `engram.safetensors`; with `sparse_engram` the tables are holes of a sparse file (zeros, no disk space).
    """
    if isinstance(config, dict):
        raw = dict(config)
        config = ModelConfig.from_dict(raw)
    else:
        raw = config.to_dict()
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, spec in _all_specs(config):
        full = dataclasses.replace(spec, name=name)
        t = random_tensor(rng, full, config)
        if spec.fmt in (FP8, FP8_DEQUANT, FP4):
            tensors.update(quantize_weight(t, full))
            continue
        if dtype == "bfloat16" and spec.kind not in (F32, INDEX):
            t = t.astype(ml_dtypes.bfloat16)
        tensors[name] = t
    if config.vision is not None:             # V4.1 with its vision tower: vision.*, aligner.*, image_* (float)
        for name, t in random_vision_tensors(rng, config).items():
            tensors[name] = t.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else t
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
    extra_files = {}
    if config.engram is not None:
        write_word_tokenizer(os.path.join(folder, "tokenizer.json"), config.engram.compressed_vocab_size)
        tables, holes = _engram_tables(rng, config, sparse_engram)
        write_safetensors(os.path.join(folder, "engram.safetensors"), tables, holes=holes)
        extra_files = {n: "engram.safetensors" for n in list(tables) + list(holes)}
    names = list(tensors)
    if n_shards <= 1:
        write_safetensors(os.path.join(folder, "model.safetensors"), tensors)
        return config   # without an index.json every *.safetensors file of the folder is read
    weight_map = {}
    for s in range(n_shards):
        fn = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::n_shards]}
        write_safetensors(os.path.join(folder, fn), part)
        weight_map.update({n: fn for n in part})
    weight_map.update(extra_files)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    return config
