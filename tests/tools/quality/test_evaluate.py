"""jdeep eval: sliding-window perplexity equals a float64 numpy computation from the no-cache forward's logits; KL,
top-1 agreement and Δppl against a base model equal their numpy definitions; every numerics mode of a quantized
checkpoint gets a row; empty files, one-token texts and models without a tokenizer are refused by name."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import jdeep
from jdeep.cli import main
from jdeep.config.small_models import TINY_CONFIG, one_layer_config
from jdeep.tools.quality.evaluate import EvalError, TokenStats, compare, read_texts, score_text, windows
from jdeep.tools.testing.random_weights import random_checkpoint, write_word_tokenizer

IDS = np.random.default_rng(0).integers(1, 512, 41).astype(np.int32)
IDS[0] = 0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = []
    for seed in (31, 32):
        folder = tmp_path_factory.mktemp(f"m{seed}")
        random_checkpoint(one_layer_config(), str(folder), seed=seed)
        write_word_tokenizer(str(folder / "tokenizer.json"), 512)
        out.append(jdeep.load(folder))
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _reference_logp(model, ids, context, stride) -> tuple[np.ndarray, np.ndarray]:
    """log-probabilities [N, V] of every scored target, and the targets, from no-cache forwards of each window."""
    rows, targets, done, start = [], [], 1, 0
    while done < len(ids):
        end = min(start + context, len(ids))
        logp = _log_softmax(jdeep.forward(model, ids[start:end]))
        rows.append(logp[done - 1 - start:end - 1 - start])
        targets.append(ids[done:end])
        done, start = end, start + stride
    return np.concatenate(rows), np.concatenate(targets)


def test_windows_score_every_target_once():
    for n, context, stride in [(2, 2, 1), (41, 16, 8), (41, 16, 15), (41, 64, 32), (100, 10, 3)]:
        seen = []
        for start, end, first in windows(n, context, stride):
            assert end - start <= context and start <= first - 1 < end
            seen += list(range(first, end))
        assert seen == list(range(1, n)), (n, context, stride)
    with pytest.raises(EvalError, match="stride"):
        windows(10, 8, 8)


@pytest.mark.parametrize("context, stride", [(64, 32), (16, 8)], ids=["one-window", "sliding"])
def test_perplexity_equals_numpy(models, context, stride):
    model = models[0]
    stats = TokenStats()
    score_text(model, IDS, stats, context=context, stride=stride, chunk=8)
    logp, targets = _reference_logp(model, IDS, context, stride)
    nll = -logp[np.arange(len(targets)), targets]
    s = stats.summary()
    assert s["tokens"] == len(IDS) - 1
    np.testing.assert_allclose(s["ppl"], math.exp(nll.mean()), rtol=1e-5)


def test_kl_agreement_and_delta_ppl_equal_numpy(models):
    model, base = models
    result = compare({"same": base, "other": model}, [("t", IDS)], base=base, context=16, stride=8, chunk=8)
    same, other = result["modes"]["same"], result["modes"]["other"]
    assert (same["kl_mean"], same["top1_agreement"], same["delta_ppl"]) == (0.0, 1.0, 0.0)
    logp, targets = _reference_logp(model, IDS, 16, 8)
    base_logp, _ = _reference_logp(base, IDS, 16, 8)
    kl = np.sum(np.exp(base_logp) * (base_logp - logp), axis=-1)
    agree = np.mean(np.argmax(logp, -1) == np.argmax(base_logp, -1))
    ppl = math.exp(-logp[np.arange(len(targets)), targets].mean())
    base_ppl = math.exp(-base_logp[np.arange(len(targets)), targets].mean())
    np.testing.assert_allclose([other["kl_mean"], other["kl_p99"]], [kl.mean(), np.percentile(kl, 99)], rtol=1e-4)
    np.testing.assert_allclose(other["delta_ppl"], ppl - base_ppl, rtol=1e-4)
    assert other["top1_agreement"] == pytest.approx(agree) and other["kl_mean"] > 0


def test_bad_texts_are_refused_by_name(models, tmp_path):
    tok = models[0].tokenizer
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "one.txt").write_text("tok5")
    with pytest.raises(EvalError, match="empty.txt is empty"):
        read_texts([tmp_path / "empty.txt"], tok, None)
    with pytest.raises(EvalError, match="one.txt has 1 token"):
        read_texts([tmp_path / "one.txt"], tok, None)
    with pytest.raises(EvalError, match="no tokenizer"):
        read_texts([tmp_path / "one.txt"], None, 0)
    assert read_texts([tmp_path / "one.txt"], tok, 0)[0][1].tolist() == [0, 5]      # BOS first


@pytest.mark.parametrize("numerics", ["deepseek", pytest.param("deepseek,packed-kv,trn2-240", marks=pytest.mark.full)],
                         ids=["deepseek", "every-mode"])
def test_eval_command_gives_a_row_per_numerics_mode(tmp_path, capsys, numerics):
    """`jdeep eval --base-numerics float --numerics ... --mtp`: a row (and an MTP row) per numerics mode, in the
    table and the JSON report. Every mode but trn2-224 (trn2-240's code path with another fp8 range) in the full
    tier; the default run compares one quantized mode with the float base.

    Full tier: tests/tools/quality/test_evaluate.py::test_eval_command_gives_a_row_per_numerics_mode[deepseek] covers
    cmd_eval's per-mode path (load_modes -> compare -> format_table, mtp_accuracy per mode, the JSON report) in the
    default run: every mode is one jdeep.load with NUMERICS_MODES' keywords scored by the same loop.
    tests/test_quantized.py::test_packed_kv_records_are_bit_identical[bfloat16] covers packed-kv's equality with the
    deepseek numerics (the KV records bit-identical) in the default run."""
    cfg = dict(TINY_CONFIG, head_dim=128, qk_rope_head_dim=64, index_head_dim=64, num_hidden_layers=2,
               layer_types=["compressed_sparse_attention", "heavily_compressed_attention"], num_hash_layers=1,
               num_nextn_predict_layers=1,
               quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                    "weight_block_size": [32, 32], "expert_dtype": "fp4"})
    random_checkpoint(cfg, str(tmp_path / "q"), seed=3)
    write_word_tokenizer(str(tmp_path / "q" / "tokenizer.json"), 512)
    (tmp_path / "a.txt").write_text(" ".join(f"tok{i}" for i in IDS[1:30]))
    rc = main(["eval", "--model", str(tmp_path / "q"), "--text-file", str(tmp_path / "a.txt"), "--base-numerics",
               "float", "--numerics", numerics, "--context", "16", "--prefill-chunk", "16",
               "--no-progress", "--json", str(tmp_path / "r.json"), "--mtp"])
    assert rc == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["schema"] == "jdeep.eval/1" and list(r["modes"]) == ["float"] + numerics.split(",")
    assert r["modes"]["float"]["kl_mean"] == 0 and all(m["tokens"] == 29 for m in r["modes"].values())
    assert r["modes"]["deepseek"]["kl_mean"] > 0
    if "packed-kv" in r["modes"]:
        # packed KV records reproduce DeepSeek's KV QAT exactly
        assert r["modes"]["packed-kv"]["ppl"] == pytest.approx(r["modes"]["deepseek"]["ppl"], rel=1e-6)
    # the MTP block's accuracy per mode: windows [0, 16) and [16, 30) of BOS + 29 tokens give 14 + 12 positions
    assert list(r["mtp"]) == list(r["modes"]) and all(m["positions"] == 26 for m in r["mtp"].values())
    assert all(0 <= m[k] <= 1 for m in r["mtp"].values() for k in ("mtp_top1", "agreement", "main_top1"))
    if "packed-kv" in r["mtp"]:
        assert r["mtp"]["packed-kv"] == r["mtp"]["deepseek"]
    out = capsys.readouterr().out
    assert all(name in out for name in r["modes"]) and "KL mean" in out and "MTP top-1" in out
    assert main(["eval", "--model", str(tmp_path / "q"), "--text-file", str(tmp_path / "missing.txt")]) == 2
