"""The benchmark harness reports every field of its schema with sane values (tiny model, short runs)."""

from __future__ import annotations

import json

import numpy as np

from jdeep.cli import main
from jdeep.presets import one_layer_config

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
