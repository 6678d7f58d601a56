"""The `jdeep` command line, run in-process."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import jdeep
from jdeep import SamplingParams
from jdeep.cli import main
from jdeep.config.small_models import TINY_CONFIG, one_layer_config
from jdeep.runtime.engine import Engine
from jdeep.tools.testing.random_weights import random_checkpoint


def test_generate_prints_the_same_tokens_as_the_api(tmp_path, capsys):
    random_checkpoint(TINY_CONFIG, str(tmp_path), seed=11)
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "0,5,9", "--max-new-tokens", "8",
                 "--temperature", "0"]) == 0
    printed = json.loads(capsys.readouterr().out)["tokens"]
    out = jdeep.generate(jdeep.load(tmp_path), [[0, 5, 9]], max_new_tokens=8)
    np.testing.assert_array_equal(printed, out.tokens[0, :out.lengths[0]])


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


def test_bad_bucket_ladders_fail_before_the_model_loads(monkeypatch, capsys):
    """serve (and compile: the same serving_engine) checks --batch-buckets, --prefill-batch-buckets and
    --chunk-buckets against the slots and the longest chunk before loading the checkpoint, naming the bucket."""
    import jdeep.cli.serve as serve_cli
    monkeypatch.setattr(serve_cli, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    demo = str(jdeep.cli.commands.DEMO_MODEL)
    for cmd, flags, what in [("serve", ["--prefill-batch-buckets", "2", "--batch-buckets", "1,4"],
                              "prefill batch bucket 2"),
                             ("serve", ["--batch-buckets", "16"], "batch bucket 16 exceeds"),
                             ("serve", ["--chunk-buckets", "512"], "chunk bucket 512 exceeds")]:
        assert main([cmd, "--model", demo, *flags]) == 2, (cmd, flags)
        assert what in capsys.readouterr().err


def test_info_reports_v41_flash_sizes(capsys):
    assert main(["info", "--preset", "v41-flash", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "deepseek_v41" in out and "40 (" in out and "engram tables" in out
    # bf16 logical caches at the KV sources: 3*(1024+256)/2 + (1024+256) = 3200 B/token (model-spec.md §6.5)
    assert "3200 B/token" in out


def test_convert_refuses_engram_models(tmp_path):
    from jdeep.config.small_models import tiny_v41_config

    random_checkpoint(tiny_v41_config(), str(tmp_path / "m"), seed=1)
    try:
        main(["convert", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "c")])
    except SystemExit as e:
        assert "Engram" in str(e)
    else:
        raise AssertionError("converting an Engram model must fail with a message")
    assert not (tmp_path / "c").exists()


@pytest.mark.full
def test_golden_generate_prints_the_api_tokens(capsys):
    """`jdeep generate` on the v4-tiny-hf golden prints jdeep.generate's tokens.

    Full tier: tests/test_cli.py::test_generate_prints_the_same_tokens_as_the_api covers `jdeep generate
    --prompt-ids` (load, greedy generate, the printed JSON tokens against the API's) in the default run."""
    from conftest import golden_path

    folder = golden_path("v4-tiny-hf")
    assert main(["generate", "--model", str(folder), "--prompt-ids", "0,5,9", "--max-new-tokens", "8",
                 "--temperature", "0"]) == 0
    printed = json.loads(capsys.readouterr().out)["tokens"]
    out = jdeep.generate(jdeep.load(folder), [[0, 5, 9]], max_new_tokens=8)
    assert printed == out.tokens[0, :out.lengths[0]].tolist()


def test_prompts_file_through_the_engine(tmp_path, capsys):
    random_checkpoint(one_layer_config(), str(tmp_path / "m"), seed=12)
    rng = np.random.default_rng(1)
    prompts = [[0] + rng.integers(2, 512, size=int(rng.integers(2, 30))).tolist() for _ in range(24)]
    lines = [json.dumps({"prompt_ids": p, "max_new_tokens": int(rng.integers(1, 8))}) for p in prompts]
    lines.insert(5, json.dumps({"prompt_ids": [0, 99999]}))              # a bad line fails alone
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompts-file", str(tmp_path / "p.jsonl"),
                 "--max-num-seqs", "2", "--max-len", "64", "--output", str(tmp_path / "out.jsonl")]) == 0
    recs = [json.loads(ln) for ln in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(recs) == 25 and "outside the vocabulary" in recs[5]["error"]
    recs.pop(5)
    model = jdeep.load(tmp_path / "m")
    picked = list(zip(prompts, [ln for i, ln in enumerate(lines) if i != 5], recs))[::6]
    want = jdeep.generate(model, [p for p, _, _ in picked], sampling=[
        SamplingParams(max_new_tokens=json.loads(line)["max_new_tokens"]) for _, line, _ in picked])
    for j, (_, _, rec) in enumerate(picked):                   # each line's tokens as the notebook API gives them
        assert rec["tokens"] == want.tokens[j, :want.lengths[j]].tolist()
    assert all(r["finish_reason"] in ("stop", "length") for r in recs)


@pytest.mark.full
def test_persistent_compile_cache(tmp_path):
    """In a fresh process (JAX sets its cache up at the first compilation of a process).

    Full tier: tests/test_cli.py::test_cached_cli_run_prints_no_xla_errors covers --compile-cache in a fresh CLI
    process (cli.main -> setup_compile_cache -> compile_cache.enable, the same for every command): the first run
    writes the programs there and the second reads them back, in the default run."""
    import os
    import subprocess
    import sys

    random_checkpoint(TINY_CONFIG, str(tmp_path / "m"), seed=13)
    env = {k: v for k, v in os.environ.items() if k != "JDEEP_NO_COMPILE_CACHE"}
    run = subprocess.run([sys.executable, "-m", "jdeep.cli", "generate", "--model", str(tmp_path / "m"),
                          "--prompt-ids", "0,5", "--max-new-tokens", "2", "--compile-cache", str(tmp_path / "cache")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert any((tmp_path / "cache").iterdir())          # compiled programs were written there


def test_cached_cli_run_prints_no_xla_errors(tmp_path):
    """A second CLI run reads its programs back from the persistent compilation cache without XLA:CPU's AOT loader
    logging an ERROR per program (jaxlib <= 0.10 took AVX-512 hosts' +prefer-no-gather tuning attribute for a
    missing ISA feature: openxla/xla#44565); the debug logs show the reads (jdeep's executable store, which loads
    through the same AOT loader, and JAX's cache)."""
    import os
    import re
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("JDEEP_NO_COMPILE_CACHE", "XLA_FLAGS")}
    env["JAX_DEBUG_LOG_MODULES"] = "jax._src.compiler,jdeep.model.executables"
    cmd = [sys.executable, "-m", "jdeep.cli", "demo", "--random", "--max-new-tokens", "4", "--compile-cache",
           str(tmp_path / "cache")]
    runs = [subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr
    assert "from the executable store" in runs[1].stderr
    errors = [ln for ln in runs[1].stderr.splitlines() if "cpu_aot_loader" in ln or re.match(r"[EF]\d{4} ", ln)]
    assert errors == [], errors[:2]


def test_compile_cache_xla_flags_keep_the_users_own():
    from jdeep.platforms import CACHE_MAX_ISA_FLAG, cache_xla_flags

    assert cache_xla_flags("--xla_dump_to=d", "x86_64") == f"--xla_dump_to=d {CACHE_MAX_ISA_FLAG}"
    assert cache_xla_flags("--xla_cpu_max_isa=AVX512", "x86_64") == "--xla_cpu_max_isa=AVX512"   # theirs wins
    assert cache_xla_flags("--xla_dump_to=d", "aarch64") == "--xla_dump_to=d"                   # no AVX-512 there


@pytest.mark.full
def test_chat_streams_the_reply(tmp_path, monkeypatch, capsys):
    """`jdeep chat` on a tiny V4 with a word tokenizer streams the reply jdeep.generate gives for the chat prompt.

    Full tier: tests/test_cli.py::test_chat_with_an_image covers `jdeep chat` (the stdin loop, the chat prompt's
    encoding, the streamed reply equal to jdeep.generate's, /exit) in the default run."""
    import io

    from jdeep.io.tokenizer import Tokenizer
    from jdeep.tools.testing.random_weights import write_word_tokenizer

    random_checkpoint(TINY_CONFIG, str(tmp_path), seed=14)
    write_word_tokenizer(str(tmp_path / "tokenizer.json"), 512)
    monkeypatch.setattr("sys.stdin", io.StringIO("tok5 tok9\n/exit\n"))
    assert main(["chat", "--model", str(tmp_path), "--temperature", "0", "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out
    tok = Tokenizer(tmp_path)
    ids = tok.chat([{"role": "user", "content": "tok5 tok9"}])
    out = jdeep.generate(jdeep.load(tmp_path), [ids], max_new_tokens=6)
    assert printed.strip() == tok.decode(out.tokens[0, :out.lengths[0]]).strip() != ""


def test_chat_with_an_image(tmp_path, monkeypatch, capsys):
    """`jdeep chat --image PATH` on a tiny V4.1 with a vision tower answers as jdeep.generate does for the same
    image part; `/image` with a bad file is reported and the chat goes on."""
    import io

    from PIL import Image

    from jdeep.io.chat import FORMATS, encode_chat
    from jdeep.config.small_models import tiny_v41_config

    random_checkpoint(tiny_v41_config(vision=True), str(tmp_path), seed=2)
    image = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(image)
    monkeypatch.setattr("sys.stdin", io.StringIO("/image /nonexistent.png\ntok5 tok9\n/exit\n"))
    assert main(["chat", "--model", str(tmp_path), "--image", str(image), "--temperature", "0",
                 "--max-new-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    assert "[image not attached: cannot read image '/nonexistent.png'" in printed
    model = jdeep.load(tmp_path)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                             {"type": "text", "text": "tok5 tok9"}]}]
    out = jdeep.generate(model, [{"text": encode_chat(FORMATS["v41"], messages), "images": [str(image)]}],
                         max_new_tokens=4)
    reply = model.tokenizer.decode(out.tokens[0, :out.lengths[0]], skip_special_tokens=False).strip()
    assert reply and printed.split("]", 1)[1].strip() == reply


def test_serve_answers_with_the_api_key_and_stops_on_sigterm(tmp_path):
    """`jdeep compile` fills a compilation cache with the serving inventory (first-use variants too); `jdeep serve`
    with the same flags in its own process reads it back: warmup, /health, 401 without the key (given as
    $JDEEP_API_KEY, out of the process list), a completion, SIGTERM -> a clean drain and exit status 0."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    random_checkpoint(one_layer_config(), str(tmp_path / "m"), seed=3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shape = ["--model", str(tmp_path / "m"), "--max-num-seqs", "1", "--max-len", "32", "--prefill-chunk", "16",
             "--compile-cache", str(tmp_path / "cache")]
    env = {k: v for k, v in os.environ.items() if k not in ("JDEEP_NO_COMPILE_CACHE", "XLA_FLAGS")}
    compiled = subprocess.run([sys.executable, "-m", "jdeep.cli", "compile", *shape], env=env, capture_output=True,
                              text=True, timeout=300)
    assert compiled.returncode == 0, compiled.stderr
    everything = Engine(jdeep.load(tmp_path / "m"), max_num_seqs=1, max_len=32, prefill_chunk=16).warmup(first_use=True)
    assert re.search(r"jdeep compile: (\d+) programs compiled", compiled.stdout).group(1) == str(everything)
    cmd = [sys.executable, "-m", "jdeep.cli", "serve", *shape, "--port", str(port), "--served-model-name", "one-layer"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(env, PYTHONUNBUFFERED="1", JDEEP_API_KEY="k3y",
                                     JAX_DEBUG_LOG_MODULES="jax._src.compiler"))
    base = f"http://127.0.0.1:{port}"

    def call(path, body=None, key="k3y"):
        req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        t0 = time.time()
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if call("/health", key=None)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.time() - t0 < 180, "the server did not come up"
            time.sleep(0.2)
        assert call("/v1/models", key=None)[0] == 401
        code, models = call("/v1/models")
        assert code == 200 and models["data"][0]["id"] == "one-layer" and models["data"][0]["max_model_len"] == 32
        code, r = call("/v1/completions", {"model": "one-layer", "prompt": [0, 5, 9], "max_tokens": 4, "temperature": 0})
        assert code == 200 and len(r["choices"][0]["token_ids"]) >= 1     # no tokenizer.json: token ids come back
        want = jdeep.generate(jdeep.load(tmp_path / "m"), [[0, 5, 9]], max_new_tokens=4)
        assert r["choices"][0]["token_ids"] == want.tokens[0, :want.lengths[0]].tolist()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    warmed = re.search(r"jdeep serve: compiled (\d+) programs", err)
    same = Engine(jdeep.load(tmp_path / "m"), max_num_seqs=1, max_len=32, prefill_chunk=16).warmup()
    assert warmed and int(warmed.group(1)) == same        # the server warmed the engine's whole program set
    assert "Persistent compilation cache hit" in err      # what `jdeep compile` wrote
    assert "Shutting down" in err and "Traceback" not in err
