"""`jdeep bench --compare transformers` (jdeep/serve/compare.py): transformers' DeepseekV4ForCausalLM runs the same
checkpoint and prompts; on the v4-tiny-hf golden (whose reference *is* transformers) the greedy tokens agree, and
a DeepSeek-style config translated for transformers loads every tensor and gives jdeep's logits."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("torch", reason="--compare needs the optional 'compare' extra (torch)")
pytest.importorskip("transformers", reason="--compare needs the optional 'compare' extra (transformers)")

from conftest import REPO, golden_path  # noqa: E402

import jdeep  # noqa: E402
from jdeep.cli import main  # noqa: E402
from jdeep.config import ModelConfig  # noqa: E402
from jdeep.tools.perf.compare import greedy_agreement, hf_config, load_transformers  # noqa: E402
from jdeep.tools.testing.random_weights import random_checkpoint  # noqa: E402

BENCH_SMALL = REPO.parent / "shared" / "bench" / "v4-bench-small.json"
HF_RUN_FIELDS = {"batch_size", "input_len", "output_len", "warmup_s", "ttft_s", "prefill_tok_s", "itl_ms",
                 "decode_tok_s_per_seq", "decode_tok_s"}


def _shrunk_bench_small() -> dict:
    """v4-bench-small.json (DeepSeek's spelling: compress_ratios, num_hash_layers, rope_scaling) at toy sizes:
    sliding + hash MoE, ratio-4 CSA + hash MoE, ratio-128 HCA + MoE. index_n_heads stays 16: with only a few
    indexer heads an entry's score is often exactly 0 (ReLU of every head), and exact ties at the top-k
    boundary are broken differently by torch.topk and lax.top_k."""
    if not BENCH_SMALL.exists():
        pytest.skip(f"{BENCH_SMALL} is absent")
    raw = json.loads(BENCH_SMALL.read_text())
    raw.update(vocab_size=512, hidden_size=64, num_hidden_layers=3, compress_ratios=raw["compress_ratios"][:3] + [0],
               num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16,
               n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, index_head_dim=32, index_topk=16)
    return raw


def test_compare_on_golden_agrees_and_reports_ratios(tmp_path, capsys):
    path = golden_path("v4-tiny-hf")
    out = tmp_path / "r.json"
    assert main(["bench", "--model", str(path), "--input-len", "16", "--output-len", "4", "--batch-size", "2",
                 "--dtype", "float32", "--compare", "transformers", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "transformers" in printed and "jdeep / transformers" in printed
    r = json.loads(out.read_text())
    hf = r["compare"]["transformers"]
    assert hf["transformers_version"] and hf["torch_version"] and hf["dtype"] == "float32" and hf["load_s"] > 0
    assert [run["batch_size"] for run in hf["runs"]] == [2]
    for run in hf["runs"]:
        assert HF_RUN_FIELDS <= set(run)
        assert 0 < run["itl_ms"]["p50"] <= run["itl_ms"]["p99"]
    for q in hf["ratios"]:
        assert set(q) == {"batch_size", "ttft", "prefill_tok_s", "decode_tok_s", "itl_p50"}
        assert all(math.isfinite(v) and v > 0 for v in q.values())
    for a in hf["agreement"]:      # the golden's reference is transformers: greedy tokens must agree
        assert a["tokens"] == 4 and a["rows_equal"] == 1.0 and a["first_divergence"] is None, a


def test_translated_config_loads_exactly_and_matches_jdeep_logits(tmp_path):
    raw = _shrunk_bench_small()
    random_checkpoint(raw, tmp_path, seed=3)
    ids = np.random.default_rng(5).integers(2, raw["vocab_size"], size=160)
    ids[0] = 0
    ours = jdeep.forward(jdeep.load(tmp_path, dtype="float32"), ids.tolist())
    import torch

    model = load_transformers(tmp_path, "float32")          # raises unless every tensor loads
    assert model.config.layer_types == ["sliding_attention", "compressed_sparse_attention",
                                        "heavily_compressed_attention"]
    assert model.config.compress_rates == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    assert model.config.mlp_layer_types == ["hash_moe", "hash_moe", "moe"]
    with torch.inference_mode():
        theirs = model(input_ids=torch.from_numpy(ids[None].astype(np.int64))).logits[0].float().numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_translation_of_golden_config_equals_its_own():
    from transformers import DeepseekV4Config

    path = golden_path("v4-tiny-hf")
    own = DeepseekV4Config.from_pretrained(path)
    ours = DeepseekV4Config(**hf_config(ModelConfig.from_file(path)))
    for key in ("layer_types", "compress_rates", "mlp_layer_types", "rope_parameters", "partial_rotary_factor",
                "qk_rope_head_dim", "sliding_window", "index_topk", "hc_mult", "routed_scaling_factor"):
        assert getattr(ours, key) == getattr(own, key), key


def test_missing_tensor_fails_loudly(tmp_path):
    from safetensors.numpy import load_file

    from jdeep.io.safetensors import write_safetensors

    raw = _shrunk_bench_small()
    random_checkpoint(raw, tmp_path, seed=0)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["layers.1.attn.indexer.wq_b.weight"]
    write_safetensors(str(tmp_path / "model.safetensors"), tensors)
    with pytest.raises(ValueError, match="missing_keys"):
        load_transformers(tmp_path, "float32")


def test_quantized_and_v41_checkpoints_are_refused():
    from jdeep.config.small_models import tiny_v41_config

    q = dict(_shrunk_bench_small(), quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match="unquantized"):
        hf_config(ModelConfig.from_dict(q))
    with pytest.raises(ValueError, match="V4.1"):
        hf_config(ModelConfig.from_dict(tiny_v41_config(quantized=False)))


def test_greedy_agreement():
    a = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    b = np.array([[1, 2, 3, 4], [5, 6, 0, 8]])
    g = greedy_agreement(a, b)
    assert g["rows_equal"] == 0.5 and g["first_divergence"] == 2 and g["row_first_divergence"] == [None, 2]
    assert g["mean_agreeing_prefix"] == 3.0


def test_missing_extra_names_the_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    with pytest.raises(SystemExit, match=r"jdeep\[compare\]"):
        main(["bench", "--compare", "transformers"])
