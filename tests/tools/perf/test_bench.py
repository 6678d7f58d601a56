"""The benchmark harness reports every field of its schema with sane values (tiny model, short runs)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import jdeep
from jdeep.cli import main
from jdeep.config.small_models import one_layer_config
from jdeep.tools.perf.bench import _chunk_lengths, _run_one, bench_prompts
from jdeep.tools.testing.random_weights import random_checkpoint

RUN_FIELDS = {"batch_size", "input_len", "output_len", "compile_s", "ttft_s", "prefill_tok_s", "itl_ms",
              "decode_tok_s_per_seq", "decode_tok_s", "decode_step_bytes", "achieved_bandwidth_gbs",
              "roofline_fraction", "peak_rss_bytes"}


def test_bench_json_has_every_field(tmp_path, capsys):
    (tmp_path / "c.json").write_text(json.dumps(one_layer_config()))
    assert main(["bench", "--random-weights", str(tmp_path / "c.json"), "--input-len", "16", "--output-len", "4",
                 "--batch-size", "1,2", "--dtype", "float32", "--json", str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["schema"] == "jdeep.bench/1"
    assert r["model"]["weight_bytes"] > 0 and r["model"]["kv_bytes_per_token"] > 0
    assert r["machine"]["measured_bandwidth_gbs"] > 0
    assert [run["batch_size"] for run in r["runs"]] == [1, 2]
    for run in r["runs"]:
        assert RUN_FIELDS <= set(run)
        assert run["compile_s"]["prefill"] > 0 and run["compile_s"]["decode"] > 0
        assert 0 < run["itl_ms"]["p50"] <= run["itl_ms"]["p99"]
        assert np.isclose(run["decode_tok_s"], run["batch_size"] * run["decode_tok_s_per_seq"])
        assert 0 < run["roofline_fraction"] < 10
    assert "tok/s" in capsys.readouterr().out


def test_bench_rejects_bad_sizes(capsys):
    try:
        main(["bench", "--batch-size", "1,x"])
    except SystemExit as e:
        assert "batch-size" in str(e)
    else:
        raise AssertionError("a bad --batch-size must fail")


def test_bench_plot(tmp_path, capsys):
    import pytest

    pytest.importorskip("matplotlib", reason="--plot needs the optional 'plot' extra (matplotlib)")
    (tmp_path / "c.json").write_text(json.dumps(one_layer_config()))
    assert main(["bench", "--random-weights", str(tmp_path / "c.json"), "--input-len", "16", "--output-len", "3",
                 "--batch-size", "1,2", "--dtype", "float32", "--plot", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_prefills_in_the_engines_chunks(tmp_path):
    """A 40-token prompt prefilled 16 tokens at a time (chunks of 16, 16 and 8 -> a 16-bucket): the bench's greedy
    tokens are jdeep.generate's with the same prefill chunk."""
    assert _chunk_lengths(40, 16) == [16] and _chunk_lengths(40, 32) == [16, 32]    # pack_chunk's step lengths
    assert _chunk_lengths(16384, 256) == [256]                 # a long prompt: one chunk-sized program
    random_checkpoint(one_layer_config(), str(tmp_path), seed=5)
    model = jdeep.load(tmp_path)
    ids = bench_prompts(model.config, 40, [2], seed=3)[0]
    run, tokens = _run_one(model, ids, 5, 256, 1.0, 16)
    assert run["prefill_chunk"] == 16 and run["compile_s"]["prefill"] > 0
    want = jdeep.generate(model, ids.tolist(), max_new_tokens=5, prefill_chunk=16, ignore_eos=True)
    np.testing.assert_array_equal(tokens, want.tokens)


def test_context_sweep_reports_latency_and_state_per_context(tmp_path, capsys):
    import importlib.util

    (tmp_path / "c.json").write_text(json.dumps(one_layer_config()))
    plot = importlib.util.find_spec("matplotlib") is not None
    assert main(["bench", "--random-weights", str(tmp_path / "c.json"), "--context-sweep", "512,64", "--output-len",
                 "4", "--prefill-chunk", "32", "--dtype", "float32", "--json", str(tmp_path / "r.json")]
                + (["--plot", str(tmp_path / "p.png")] if plot else [])) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["schema"] == "jdeep.bench/1" and r["runs"] == []
    sweep = r["context_sweep"]
    assert [s["context"] for s in sweep] == [64, 512] and [s["state_len"] for s in sweep] == [256, 512]
    assert [s["prefill_len"] for s in sweep] == [60, 508] and all(s["prefill_chunk"] == 32 for s in sweep)
    kv = r["model"]["kv_bytes_per_token"]
    assert np.isclose(sweep[1]["state_bytes"] - sweep[0]["state_bytes"], kv * 256)
    for s in sweep:
        assert 0 < s["itl_ms"]["p50"] <= s["itl_ms"]["p99"] and s["prefill_s"] > 0 and s["peak_rss_bytes"] > 0
    assert "context sweep" in capsys.readouterr().out
    if plot:
        assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_context_sweep_rejects_contexts_not_longer_than_the_decode_steps(tmp_path, capsys):
    (tmp_path / "c.json").write_text(json.dumps(one_layer_config()))
    assert main(["bench", "--random-weights", str(tmp_path / "c.json"), "--context-sweep", "8", "--output-len",
                 "8"]) == 2
    assert "decode_steps" in capsys.readouterr().err


def test_mixed_workload_reports_no_stalls_and_both_ttfts(tmp_path, capsys):
    """`jdeep bench --mixed`: 2 streams decode while a 100-token prompt prefills in 32-token chunks (4 iterations);
    no stream misses an iteration, and the row carries every field of the "mixed" section."""
    (tmp_path / "c.json").write_text(json.dumps(one_layer_config()))
    assert main(["bench", "--random-weights", str(tmp_path / "c.json"), "--mixed", "100", "--mixed-streams", "2",
                 "--mixed-chunks", "32", "--dtype", "float32", "--json", str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["runs"] == [] and len(r["mixed"]) == 1
    m = r["mixed"][0]
    assert (m["streams"], m["long_len"], m["prefill_chunk"], m["max_num_batched_tokens"]) == (2, 100, 32, 8 + 32)
    assert m["iterations"] == 4 and m["stalls"] == 0
    assert m["ttft_s"] > 0 and m["ttft_alone_s"] > 0 and np.isclose(m["ttft_ratio"], m["ttft_s"] / m["ttft_alone_s"])
    assert 0 < m["itl_ms"]["p50"] <= m["itl_ms"]["p99"] <= m["itl_ms"]["max"]
    assert m["decode_step_ms"] > 0 and 0 < m["chunk_ms"]["mean"] <= m["chunk_ms"]["max"]
    assert 0 < m["itl_bound_ms"]["p50"] <= m["itl_bound_ms"]["p99"] and m["iteration_over_bound"]["max"] > 0
    assert "mixed workload: 2 streams decoding, a 100-token prompt arrives" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--mixed"):
        main(["bench", "--mixed", "100", "--context-sweep", "512"])
