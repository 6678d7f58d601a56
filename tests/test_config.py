"""ModelConfig: the three config spellings, presets and their layer plans, to_dict round trips,
and ConfigError / warning behaviour for malformed or inconsistent configs (model-spec.md §2)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import warnings

import pytest

from jdeep import ConfigError, ModelConfig
from jdeep.config import AttentionKind, RopeConfig, YarnConfig
from jdeep.param_spec import layer_specs
from jdeep.plan import build_plan, layer_kinds
from jdeep.config.presets import PRESETS, preset
from jdeep.config.small_models import TINY_CONFIG

# Same lookup as tests/conftest.py: ../shared/golden next to the repository, or $JDEEP_GOLDEN_DIR.
GOLDEN = os.environ.get("JDEEP_GOLDEN_DIR",
                        os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                     "shared", "golden"))
HF_DIR = os.path.join(GOLDEN, "v4-tiny-hf")            # transformers-normalised spelling
Q_DIR = os.path.join(GOLDEN, "v4-tiny-q")              # DeepSeek HF spelling (compress_ratios, rope_scaling)
ARGS_JSON = os.path.join(Q_DIR, "inference", "config.json")  # reference ModelArgs spelling
V41_JSON = os.path.join(GOLDEN, "v41-tiny-q", "config.json")

needs_golden = pytest.mark.skipif(not os.path.isdir(GOLDEN), reason="golden checkpoints not available")


def _raw(path: str) -> dict:
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _parse_quietly(raw: dict) -> ModelConfig:
    """from_dict, failing the test if any warning is emitted."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return ModelConfig.from_dict(raw)


def _q_raw() -> dict:
    return _raw(Q_DIR)


def _hf_raw() -> dict:
    return _raw(HF_DIR)


# ------------------------------------------------------------------------------------------ spellings
@needs_golden
def test_transformers_normalised_spelling():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every key of a real transformers config is known
        c = ModelConfig.from_file(HF_DIR)
    assert c.n_layers == 4 and c.dim == 128 and c.vocab_size == 512
    assert c.attention_kinds == (AttentionKind(16, overlap=False), AttentionKind(4, overlap=True),
                                 AttentionKind(0, overlap=False), AttentionKind(4, overlap=True))
    assert [k.name for k in c.attention_kinds] == ["hca16", "csa4", "sliding", "csa4"]
    assert [k.has_indexer for k in c.attention_kinds] == [False, True, False, True]
    assert c.hash_moe == (True, True, False, False)
    assert c.n_hash_layers == 2
    assert c.rope_main == RopeConfig(10000.0, None)
    assert c.rope_compress.theta == 160000.0
    assert c.rope_compress.yarn == YarnConfig(factor=16.0, original_seq_len=256, beta_fast=32.0, beta_slow=1.0)
    # sliding layers use the main RoPE, compressed layers the YaRN one
    assert c.rope_for(c.attention_kinds[2]) is c.rope_main
    assert c.rope_for(c.attention_kinds[0]) is c.rope_compress
    assert c.rope_head_dim == 16
    assert c.n_mtp_layers == 1
    assert (c.n_heads, c.head_dim, c.o_groups, c.o_lora_rank, c.q_lora_rank) == (4, 64, 2, 32, 64)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.window_size) == (16, 32, 4, 16)
    assert (c.n_routed_experts, c.n_activated_experts, c.moe_inter_dim, c.route_scale) == (8, 2, 64, 1.5)


@needs_golden
def test_rope_head_dim_from_partial_rotary_factor():
    raw = _hf_raw()
    del raw["qk_rope_head_dim"]  # top-level partial_rotary_factor 0.25 * head_dim 64
    assert _parse_quietly(raw).rope_head_dim == 16
    del raw["partial_rotary_factor"]  # only rope_parameters.main.partial_rotary_factor left
    assert _parse_quietly(raw).rope_head_dim == 16
    raw["head_dim"] = 128  # factor scales with head_dim
    assert _parse_quietly(raw).rope_head_dim == 32


@needs_golden
def test_deepseek_hf_spelling():
    raw = _q_raw()
    assert len(raw["compress_ratios"]) == 7 and raw["num_hidden_layers"] == 6  # trailing MTP entry
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = ModelConfig.from_file(Q_DIR)
    assert c.n_layers == 6
    assert len(c.attention_kinds) == 6
    assert [k.ratio for k in c.attention_kinds] == [0, 4, 128, 4, 128, 0]
    assert [k.overlap for k in c.attention_kinds] == [False, True, False, True, False, False]
    for k in c.attention_kinds:
        if k.ratio == 128:
            assert not k.overlap and not k.has_indexer and k.name == "hca128"
    assert c.n_mtp_layers == 1
    assert c.hash_moe == (True, True, False, False, False, False)
    assert c.n_hash_layers == 2
    assert c.rope_head_dim == 64 and c.head_dim == 128
    assert c.rope_main == RopeConfig(10000.0, None)
    assert c.rope_compress == RopeConfig(160000.0, YarnConfig(4.0, 64, 32.0, 1.0))
    assert c.quantization.quant_method == "fp8" and c.quantization.fp8
    assert c.quantization.expert_dtype == "fp4"


ARCH_FIELDS = [f.name for f in dataclasses.fields(ModelConfig)
               if f.name not in ("max_position_embeddings", "bos_token_id", "eos_token_id", "quantization")]


@needs_golden
def test_model_args_spelling_matches_hf_spelling():
    args_raw = _raw(ARGS_JSON)
    assert "dim" in args_raw and "hidden_size" not in args_raw  # really the ModelArgs spelling
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = ModelConfig.from_file(ARGS_JSON)
    h = ModelConfig.from_file(Q_DIR)
    assert "attention_kinds" in ARCH_FIELDS and "rope_compress" in ARCH_FIELDS and len(ARCH_FIELDS) >= 30
    for name in ARCH_FIELDS:
        assert getattr(a, name) == getattr(h, name), name
    # spot checks against the raw ModelArgs values
    assert a.dim == 128 and a.n_layers == 6 and a.window_size == 16 and a.rope_head_dim == 64
    assert a.rope_compress.yarn == YarnConfig(4.0, 64, 32.0, 1.0)
    assert a.hash_moe == (True, True, False, False, False, False)


@needs_golden
def test_model_args_without_yarn():
    raw = _raw(ARGS_JSON)
    raw["original_seq_len"] = 0  # the reference code's "no YaRN"
    c = _parse_quietly(raw)
    assert c.rope_compress == RopeConfig(160000.0, None)


# ------------------------------------------------------------------------------------------ ratios
@pytest.mark.parametrize("ratios", [[1, 2, 3, 7, 64], [0, 1, 64, 4, 2], [1] * 5])
def test_any_compress_ratio_via_compress_ratios(ratios):
    raw = copy.deepcopy(TINY_CONFIG)
    del raw["layer_types"], raw["compress_rates"]
    raw.update(num_hidden_layers=5, compress_ratios=ratios + [0], num_hash_layers=1)
    c = _parse_quietly(raw)
    assert [k.ratio for k in c.attention_kinds] == ratios
    assert [k.overlap for k in c.attention_kinds] == [r == 4 for r in ratios]  # reference: ratio 4 overlaps
    plan = build_plan(c)
    assert sum(s.n_layers for s in plan.segments) == 5
    for kind in layer_kinds(c):
        specs = {s.name: s.shape for s in layer_specs(c, kind)}
        if kind.attn.ratio:
            cw = 2 if kind.attn.overlap else 1
            assert specs["attn.compressor.ape"] == (kind.attn.ratio, cw * c.head_dim)
        else:
            assert "attn.compressor.ape" not in specs
    assert ModelConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("csa, hca", [(1, 2), (2, 3), (3, 7), (7, 64), (64, 1)])
def test_any_compress_ratio_via_layer_types(csa, hca):
    raw = copy.deepcopy(TINY_CONFIG)
    raw["compress_rates"] = {"compressed_sparse_attention": csa, "heavily_compressed_attention": hca}
    c = _parse_quietly(raw)
    expected = [AttentionKind(0), AttentionKind(csa, True), AttentionKind(hca, False),
                AttentionKind(csa, True), AttentionKind(hca, False), AttentionKind(csa, True)]
    assert list(c.attention_kinds) == expected
    for kind in layer_kinds(c):
        names = {s.name for s in layer_specs(c, kind)}
        assert ("attn.indexer.compressor.ape" in names) == kind.attn.overlap
    back = ModelConfig.from_dict(c.to_dict())
    assert back == c


def test_legacy_compress_rate_keys():
    raw = copy.deepcopy(TINY_CONFIG)
    del raw["compress_rates"]
    raw.update(compress_rate_csa=8, compress_rate_hca=32)
    c = _parse_quietly(raw)
    assert [k.ratio for k in c.attention_kinds] == [0, 8, 32, 8, 32, 8]
    del raw["compress_rate_csa"], raw["compress_rate_hca"]
    c = _parse_quietly(raw)  # transformers' defaults: CSA 4, HCA 128
    assert [k.ratio for k in c.attention_kinds] == [0, 4, 128, 4, 128, 4]


# ------------------------------------------------------------------------------------------ presets
@pytest.mark.parametrize("name, n_layers, n4, n128, n_sliding, n_reps", [
    ("v4-flash", 43, 21, 20, 2, 20),
    ("v4-pro", 61, 30, 31, 0, 29),
])
def test_presets(name, n_layers, n4, n128, n_sliding, n_reps):
    c = preset(name)
    ratios = [k.ratio for k in c.attention_kinds]
    assert c.n_layers == n_layers == len(ratios)
    assert len(PRESETS[name]["compress_ratios"]) == n_layers + 1  # MTP entry dropped
    assert ratios.count(4) == n4
    assert ratios.count(128) == n128
    assert ratios.count(0) == n_sliding
    assert all(k.overlap == (k.ratio == 4) for k in c.attention_kinds)
    assert c.hash_moe == (True, True, True) + (False,) * (n_layers - 3)
    assert c.n_hash_layers == 3
    assert c.n_mtp_layers == 1
    assert c.rope_compress.yarn == YarnConfig(16.0, 65536, 32.0, 1.0)

    plan = build_plan(c)
    structure = [(s.first_layer, tuple(k.name for k in s.pattern), s.reps) for s in plan.segments]
    first = "sliding_hash" if name == "v4-flash" else "hca128_hash"
    assert structure == [(0, (first,), 2), (2, ("csa4_hash",), 1), (3, ("hca128", "csa4"), n_reps)]

    # every backbone layer sits in exactly one (segment, slot, rep), of the right kind
    kinds = layer_kinds(c)
    seen = set()
    for layer in range(n_layers):
        s, slot, rep = plan.locate(layer)
        seg = plan.segments[s]
        assert 0 <= slot < len(seg.pattern) and 0 <= rep < seg.reps
        assert seg.layer(rep, slot) == layer
        assert seg.pattern[slot] == kinds[layer]
        seen.add((s, slot, rep))
    assert len(seen) == n_layers
    assert sum(s.n_layers for s in plan.segments) == n_layers
    with pytest.raises(IndexError):
        plan.locate(n_layers)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="v4-lite"):
        preset("v4-lite")


# ------------------------------------------------------------------------------------------ round trip
def _roundtrip_cases():
    cases = [("tiny", lambda: ModelConfig.from_dict(TINY_CONFIG)),
             ("v4-flash", lambda: preset("v4-flash")),
             ("v4-pro", lambda: preset("v4-pro"))]
    if os.path.isdir(GOLDEN):
        cases += [("v4-tiny-hf", lambda: ModelConfig.from_file(HF_DIR)),
                  ("v4-tiny-q", lambda: ModelConfig.from_file(Q_DIR)),
                  ("v4-tiny-q-args", lambda: ModelConfig.from_file(ARGS_JSON))]
    return cases


@pytest.mark.parametrize("label, make", _roundtrip_cases(), ids=[c[0] for c in _roundtrip_cases()])
def test_to_dict_round_trip(label, make):
    c = make()
    d = c.to_dict()
    d = json.loads(json.dumps(d))  # to_dict is plain JSON
    back = _parse_quietly(d)
    assert back == c
    assert back.quantization == c.quantization  # not part of ==, but carried along
    assert back.to_dict() == d


def test_to_dict_round_trip_none_token_ids():
    c = ModelConfig.from_dict(TINY_CONFIG).replace(bos_token_id=None, eos_token_id=None)
    back = ModelConfig.from_dict(c.to_dict())
    assert back == c and back.eos_token_id is None and back.bos_token_id is None


# ------------------------------------------------------------------------------------------ errors
def _without(key):
    def f(d):
        del d[key]
    return f


def _set(**kw):
    def f(d):
        d.update(kw)
    return f


def _set_in(key, index, value):
    def f(d):
        d[key] = list(d[key])
        d[key][index] = value
    return f


# Mutations of the DeepSeek HF spelling (v4-tiny-q config.json without quantization).
Q_ERRORS = [
    ("unknown model_type", _set(model_type="llama"), "model_type"),
    ("missing model_type", _without("model_type"), "model_type"),
    ("missing hidden_size", _without("hidden_size"), "hidden_size"),
    ("missing n_routed_experts", _without("n_routed_experts"), "n_routed_experts"),
    ("string int", _set(num_attention_heads="4"), "num_attention_heads"),
    ("fractional int", _set(hidden_size=128.5), "hidden_size"),
    ("bool int", _set(q_lora_rank=True), "q_lora_rank"),
    ("zero layers", _set(num_hidden_layers=0), "num_hidden_layers"),
    ("non-positive vocab", _set(vocab_size=0), "vocab_size"),
    ("non-positive window", _set(sliding_window=0), "window_size|sliding_window"),
    ("o_groups", _set(o_groups=3), "o_groups"),
    ("too many active experts", _set(num_experts_per_tok=9), "num_experts_per_tok"),
    ("two shared experts", _set(n_shared_experts=2), "n_shared_experts"),
    ("softmax scoring", _set(scoring_func="softmax"), "scoring_func"),
    ("ratios too short", _set(compress_ratios=[0, 4, 128, 4, 128]), "compress_ratios"),
    ("ratios not a list", _set(compress_ratios="0,4,128"), "compress_ratios"),
    ("negative ratio", _set_in("compress_ratios", 2, -1), r"compress_ratios\[2\]"),
    ("float ratio", _set_in("compress_ratios", 1, 4.0), "compress_ratios"),
    ("hash layers above n_layers", _set(num_hash_layers=7), "num_hash_layers"),
    ("negative hash layers", _set(num_hash_layers=-1), "num_hash_layers"),
    ("rope dim odd", _set(qk_rope_head_dim=63), "qk_rope_head_dim"),
    ("rope dim > head_dim", _set(qk_rope_head_dim=256), "qk_rope_head_dim"),
    ("rope dim > index_head_dim", _set(index_head_dim=32), "qk_rope_head_dim|index_head_dim"),
    ("prf vs rope dim", _set(partial_rotary_factor=0.25), "partial_rotary_factor"),
    ("rope_scaling linear", _set(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
    ("rope_scaling dynamic", _set(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling"),
    ("rope_scaling not an object", _set(rope_scaling="yarn"), "rope_scaling"),
    ("yarn without factor", _set(rope_scaling={"type": "yarn", "original_max_position_embeddings": 64}),
     "rope_scaling.*factor"),
    ("yarn factor < 1", _set(rope_scaling={"type": "yarn", "factor": 0.5, "original_max_position_embeddings": 64}),
     "rope_scaling.factor"),
    ("yarn betas", _set(rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
                                      "beta_fast": 1, "beta_slow": 32}), "beta_fast"),
    ("rope_theta string", _set(rope_theta="10k"), "rope_theta"),
    ("rope_theta <= 1", _set(rope_theta=1.0), "rope_theta"),
    ("eos out of vocab", _set(eos_token_id=512), "eos_token_id"),
    ("bos negative", _set(bos_token_id=-1), "bos_token_id"),
    ("eps nan", _set(rms_norm_eps=float("nan")), "norm_eps|rms_norm_eps"),
    ("route scale zero", _set(routed_scaling_factor=0), "route_scale|routed_scaling_factor"),
    ("no attention schedule", _without("compress_ratios"), "compress_ratios"),
    ("quantization not an object", _set(quantization_config="fp8"), "quantization_config"),
]


@needs_golden
@pytest.mark.parametrize("label, mutate, match", Q_ERRORS, ids=[e[0] for e in Q_ERRORS])
def test_malformed_deepseek_config(label, mutate, match):
    raw = _q_raw()
    mutate(raw)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


# Mutations of the transformers-normalised spelling (v4-tiny-hf config.json).
HF_ERRORS = [
    ("bad layer type", _set_in("layer_types", 1, "full_attention"), r"layer_types\[1\]"),
    ("layer_types short", _set(layer_types=["sliding_attention"] * 3), "layer_types"),
    ("csa rate 0", _set(compress_rates={"compressed_sparse_attention": 0, "heavily_compressed_attention": 16}),
     "compress_rates"),
    ("hca rate negative", _set(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": -2}),
     "compress_rates"),
    ("compress_rates not an object", _set(compress_rates=[4, 16]), "compress_rates"),
    ("hash count disagrees", _set(num_hash_layers=1), "num_hash_layers"),
    ("bad mlp layer type", _set_in("mlp_layer_types", 2, "dense"), r"mlp_layer_types\[2\]"),
    ("mlp_layer_types short", _set(mlp_layer_types=["moe"] * 3), "mlp_layer_types"),
    ("prf inconsistent", _set(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ("no rope dim at all", lambda d: (d.pop("qk_rope_head_dim"), d.pop("partial_rotary_factor"),
                                      d["rope_parameters"]["main"].pop("partial_rotary_factor")),
     "qk_rope_head_dim|partial_rotary_factor"),
    ("rope_parameters unsupported type",
     lambda d: d["rope_parameters"]["compress"].update(rope_type="longrope"), "rope_parameters.compress"),
    ("rope_parameters without compress", lambda d: d["rope_parameters"].pop("compress"), "compress"),
    ("rope_parameters without theta", lambda d: d["rope_parameters"]["main"].pop("rope_theta"),
     "rope_parameters.main.*rope_theta"),
    ("rope_theta disagrees", _set(rope_theta=20000.0), "rope_theta"),
    ("rope_parameters not an object", _set(rope_parameters=[1]), "rope_parameters"),
    ("eos out of vocab", _set(eos_token_id=4096), "eos_token_id"),
]


@needs_golden
@pytest.mark.parametrize("label, mutate, match", HF_ERRORS, ids=[e[0] for e in HF_ERRORS])
def test_malformed_transformers_config(label, mutate, match):
    raw = _hf_raw()
    mutate(raw)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_invalid_json_file(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4", "hidden_size": 128,')
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)


def test_config_json_is_a_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps([TINY_CONFIG]))
    with pytest.raises(ConfigError, match="JSON object.*list"):
        ModelConfig.from_file(tmp_path)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_file(tmp_path)


def test_from_file_accepts_file_path(tmp_path):
    p = tmp_path / "my.json"
    p.write_text(json.dumps(TINY_CONFIG))
    assert ModelConfig.from_file(p) == ModelConfig.from_dict(TINY_CONFIG)


def test_direct_construction_validates():
    c = ModelConfig.from_dict(TINY_CONFIG)
    with pytest.raises(ConfigError, match="o_groups"):
        c.replace(o_groups=3)
    with pytest.raises(ConfigError, match="mlp_layer_types"):
        c.replace(hash_moe=(True,))
    with pytest.raises(ConfigError, match=r"compress_ratios\[1\]"):
        c.replace(attention_kinds=(AttentionKind(0), AttentionKind(-4)) + c.attention_kinds[2:])


# ------------------------------------------------------------------------------------------ warnings
def test_unknown_key_warns_and_is_ignored():
    raw = dict(TINY_CONFIG, some_future_field=3)
    with pytest.warns(UserWarning, match="some_future_field"):
        c = ModelConfig.from_dict(raw)
    assert c == ModelConfig.from_dict(TINY_CONFIG)


@needs_golden
def test_unknown_key_in_model_args_warns():
    raw = dict(_raw(ARGS_JSON), made_up_args_field=1)
    with pytest.warns(UserWarning, match="made_up_args_field"):
        c = ModelConfig.from_dict(raw)
    assert c == ModelConfig.from_file(ARGS_JSON)


def test_n_routed_experts_score_warns():
    raw = dict(TINY_CONFIG, n_routed_experts_score=128)
    with pytest.warns(UserWarning, match="n_routed_experts_score"):
        c = ModelConfig.from_dict(raw)
    assert c == ModelConfig.from_dict(TINY_CONFIG)


def test_n_routed_experts_score_is_ignored():
    raw = dict(TINY_CONFIG, n_routed_experts_score=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ModelConfig.from_dict(raw) == ModelConfig.from_dict(TINY_CONFIG)


# ------------------------------------------------------------------------------------------ V4.1
def _v41_raw() -> dict:
    with open(V41_JSON) as f:
        return json.load(f)


@pytest.mark.skipif(not os.path.exists(V41_JSON), reason="golden checkpoints not available")
def test_v41_golden_config():
    raw = _v41_raw()
    text = raw["text_config"]
    c = ModelConfig.from_file(V41_JSON)
    assert c.is_v41 and c.norm_eps == text["rms_norm_eps"] and c.n_hash_layers == 0
    assert c.sharing.kv_sources == tuple(text["kv_source_layer_ids"])
    assert c.sharing.index_sources == tuple(text["index_source_layer_ids"])
    assert c.sharing.candidate_source == text["candidate_source_layer_id"]
    assert c.engram.layer_ids == tuple(text["engram_layer_ids"])
    assert c.engram.num_embeddings == tuple(text["engram_num_embeddings"])
    assert [k.ratio for k in c.attention_kinds] == text["compress_ratios"][:c.n_layers]
    assert not any(k.overlap for k in c.attention_kinds)
    assert c.quantization.weight_block_size == (32, 32)
    assert ModelConfig.from_dict(c.to_dict()) == c


@pytest.mark.skipif(not os.path.exists(V41_JSON), reason="golden checkpoints not available")
def test_v41_model_args_spelling():
    """The reference code's inference/config.json names give the same config as the HF layout."""
    text = _v41_raw()["text_config"]
    rename = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
              "moe_intermediate_size": "moe_inter_dim", "num_experts_per_tok": "n_activated_experts",
              "routed_scaling_factor": "route_scale", "scoring_func": "score_func", "rms_norm_eps": "norm_eps",
              "sliding_window": "window_size", "qk_rope_head_dim": "rope_head_dim",
              "num_nextn_predict_layers": "n_mtp_layers", "kv_source_layer_ids": "kv_source_layers",
              "index_source_layer_ids": "index_source_layers", "candidate_source_layer_id": "candidate_source_layer",
              "engram_pad_token_id": "engram_pad_id"}
    skip = {"model_type", "num_key_value_heads", "hidden_act", "attention_bias", "rope_scaling", "topk_method",
            "tie_word_embeddings", "max_position_embeddings"}
    args = {rename.get(k, k): v for k, v in text.items() if k not in skip}
    y = text["rope_scaling"]
    args.update(original_seq_len=y["original_max_position_embeddings"], rope_factor=y["factor"],
                beta_fast=y["beta_fast"], beta_slow=y["beta_slow"], dtype="fp8", expert_dtype="fp4",
                max_position_embeddings=text["max_position_embeddings"])
    a = ModelConfig.from_dict(args)
    b = ModelConfig.from_file(V41_JSON)
    assert a == b


@pytest.mark.parametrize("change, field", [
    (lambda t: t.pop("kv_source_layer_ids"), "kv_source_layer_ids"),
    (lambda t: t.update(kv_source_layer_ids=[0, 2, 5]), "sliding-only"),
    (lambda t: t.update(kv_source_layer_ids=[5]), "layer 2 .*no KV source"),
    (lambda t: t.update(index_source_layer_ids=[4, 5, 7]), "layer 2 has no index source"),
    (lambda t: t.update(candidate_source_layer_id=6), "candidate_source_layer_id 6"),
    (lambda t: t.update(engram_num_embeddings=[3396]), "engram_num_embeddings"),
    (lambda t: t.update(engram_layer_ids=[4, 1]), "engram_layer_ids"),
    (lambda t: t.update(engram_head_dim=40), "engram_head_dim"),
    (lambda t: t.update(num_hash_layers=2), "hash-routed"),
    (lambda t: t.update(index_source_layer_ids="2,4"), "index_source_layer_ids"),
])
@pytest.mark.skipif(not os.path.exists(V41_JSON), reason="golden checkpoints not available")
def test_v41_bad_fields(change, field):
    raw = _v41_raw()
    change(raw["text_config"])
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(raw)


def test_v41_flash_preset():
    c = preset("v41-flash")
    assert c.is_v41 and c.n_layers == 40 and c.dim == 5120
    assert [c.kv_source_of(i) for i in (2, 7, 8, 19, 20, 39)] == [2, 2, 8, 14, 20, 20]
    assert [c.index_source_of(i) for i in (3, 21, 24, 27, 39)] == [2, 20, 24, 24, 36]
    assert c.engram.rows_per_token == 24 and c.dspark.n_layers == 3 and c.vision is not None
    kinds = layer_kinds(c)
    assert kinds[20].shared.index == "candidate" and kinds[24].shared.index == "restricted"
    assert kinds[14].engram and kinds[14].shared.kv_source
    plan = build_plan(c)
    assert sum(s.n_layers for s in plan.segments) == 40
    assert len({k for s in plan.segments for k in s.pattern}) <= 10


# ------------------------------------------------------------------------------------------ odd values
# Wrongly typed values must surface as ConfigError naming the field, never as a bare TypeError/ValueError.
def test_partial_rotary_factor_not_a_number():
    raw = copy.deepcopy(TINY_CONFIG)
    del raw["qk_rope_head_dim"]
    raw["partial_rotary_factor"] = "quarter"
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        ModelConfig.from_dict(raw)


def test_layer_types_entry_unhashable():
    raw = copy.deepcopy(TINY_CONFIG)
    raw["layer_types"] = list(raw["layer_types"])
    raw["layer_types"][1] = ["compressed_sparse_attention"]
    with pytest.raises(ConfigError, match=r"layer_types\[1\]"):
        ModelConfig.from_dict(raw)


@needs_golden
def test_rope_parameters_theta_not_a_number():
    raw = _hf_raw()
    raw["rope_parameters"]["main"]["rope_theta"] = "ten thousand"
    with pytest.raises(ConfigError, match="rope_theta"):
        ModelConfig.from_dict(raw)


@needs_golden
def test_to_dict_keeps_main_rope_yarn():
    raw = _hf_raw()
    raw["rope_parameters"]["main"] = dict(raw["rope_parameters"]["compress"], rope_theta=10000.0)
    c = ModelConfig.from_dict(raw)
    assert c.rope_main.yarn is not None  # parsing keeps it ...
    assert ModelConfig.from_dict(c.to_dict()) == c  # ... and the round trip keeps it
