"""The `jdeep` command line, run in-process."""

from __future__ import annotations

import json

import numpy as np

import jdeep
from jdeep.cli import main
from jdeep.random_weights import TINY_CONFIG, random_checkpoint


def test_generate_prints_the_same_tokens_as_the_api(tmp_path, capsys):
    random_checkpoint(TINY_CONFIG, str(tmp_path), seed=11)
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "0,5,9", "--max-new-tokens", "8",
                 "--temperature", "0"]) == 0
    printed = json.loads(capsys.readouterr().out)["tokens"]
    expected = jdeep.generate(jdeep.load(tmp_path), [[0, 5, 9]], max_new_tokens=8).tokens[0]
    np.testing.assert_array_equal(printed, expected)


def test_generate_rejects_out_of_vocab_ids(tmp_path, capsys):
    random_checkpoint(TINY_CONFIG, str(tmp_path), seed=11)
    try:
        main(["generate", "--model", str(tmp_path), "--prompt-ids", "0,5,100000"])
    except SystemExit as e:
        assert "outside the vocabulary" in str(e)
    else:
        raise AssertionError("an out-of-vocabulary id must fail")


def test_info_reports_flash_sizes(capsys):
    assert main(["info", "--preset", "v4-flash", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "43 (" in out and "[hca128+csa4]x20" in out
    # bf16 logical caches: 21*(1024+256)/4 + 20*1024/128 = 6880 B/token (model-spec.md §6.5)
    assert "6880 B/token" in out


def test_missing_model_folder_is_a_clear_error(tmp_path, capsys):
    assert main(["info", "--model", str(tmp_path / "nope")]) == 2
    assert "config.json" in capsys.readouterr().err


def test_info_reports_v41_flash_sizes(capsys):
    assert main(["info", "--preset", "v41-flash", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "deepseek_v41" in out and "40 (" in out and "engram tables" in out
    # bf16 logical caches at the KV sources: 3*(1024+256)/2 + (1024+256) = 3200 B/token (model-spec.md §6.5)
    assert "3200 B/token" in out


def test_convert_refuses_engram_models(tmp_path):
    from jdeep.random_weights import tiny_v41_config

    random_checkpoint(tiny_v41_config(), str(tmp_path / "m"), seed=1)
    try:
        main(["convert", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "c")])
    except SystemExit as e:
        assert "Engram" in str(e)
    else:
        raise AssertionError("converting an Engram model must fail with a message")
    assert not (tmp_path / "c").exists()
