"""DeepSeek-V4.1 on seeded random checkpoints (jdeep.config.small_models.tiny_v41_config: every V4.1 layer kind,
geometry different from the golden): cached decode of a ragged batch with chunked prefill equals a
no-cache forward; a checkpoint whose Engram tables are several times the machine's RAM loads and reads
only the rows it uses; drafter / vision tensors load; bad checkpoints fail with clear errors."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

import jdeep
from jdeep.io.safetensors import write_safetensors
from jdeep.config.small_models import tiny_v41_config
from jdeep.tools.perf.memory import status_bytes
from jdeep.tools.testing.random_weights import random_checkpoint

PROMPTS = [[0, 5, 6, 7, 8], list(range(3, 40)), [0] + list(range(100, 120))]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("v41")
    random_checkpoint(tiny_v41_config(), str(path), seed=3)
    return path


@pytest.mark.full
def test_chunked_cached_decode_equals_nocache_forward(folder):
    """DeepSeek's numerics; prefill in chunks of 16 (the ratio-2 compressor ring, the Engram histories and
    the published top-k cross chunk boundaries), ragged batch, then decode past index_topk.

    Full tier: tests/test_golden_v41_q.py::test_deepseek_numerics_teacher_forced covers V4.1's cached path in
    DeepSeek's numerics with prefill chunks (of 64) crossed by the ratio-2 compressor ring, the Engram history and the
    published top-k, then decode, against the reference (the golden has the same layer kinds: sliding, ratio-2 and
    ratio-1 KV sources, index and candidate sources, two Engram layers); ::test_cached_decode_equals_nocache_forward
    covers a ragged batch's cached decode (per-sequence Engram histories) past index_topk equal to a no-cache
    forward; tests/runtime/test_sampling.py::test_same_seed_same_tokens_and_batch_independence covers seeded
    sampling's reproducibility, in the default run."""
    model = jdeep.load(folder)
    out = jdeep.generate(model, PROMPTS, max_new_tokens=12, return_logits=True, prefill_chunk=16)
    for b, prompt in enumerate(PROMPTS):
        seq = list(prompt) + list(out.tokens[b, :-1])
        nocache = jdeep.forward(model, seq, pad_to=64)[len(prompt) - 1:]
        np.testing.assert_allclose(out.logits[b], nocache, atol=1e-4, rtol=0, err_msg=f"prompt {b}")
        assert out.tokens[b, -1] == np.argmax(out.logits[b, -1])
    # sampling is reproducible per seed (return_logits as above: the same compiled programs, temperature is data)
    s1, s2 = (jdeep.generate(model, PROMPTS, max_new_tokens=12, temperature=0.8, seed=5, prefill_chunk=16,
                             return_logits=True) for _ in range(2))
    np.testing.assert_array_equal(s1.tokens, s2.tokens)
    assert (s1.tokens != out.tokens).any() and s1.tokens.max() < model.config.vocab_size


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) * 1024


def test_engram_tables_larger_than_ram_stay_on_disk(sparse_dir):
    """Tables of ~3x the machine's RAM in a sparse file: load + a forward read only the gathered rows."""
    table_bytes_per_vocab = 2 * 8 * (32 + 1)            # 2 layers x 8 (order, head) primes x (32 codes + 1 scale)
    vocab = int(3.2 * _mem_total() / table_bytes_per_vocab)
    random_checkpoint(tiny_v41_config(engram_vocab_size=vocab), str(sparse_dir), seed=4, sparse_engram=True)
    table = os.path.join(sparse_dir, "engram.safetensors")
    logical, on_disk = os.path.getsize(table), os.stat(table).st_blocks * 512
    assert on_disk <= logical // 100 and logical > 3 * _mem_total()
    rss0, file0 = status_bytes("VmRSS"), status_bytes("RssFile")
    model = jdeep.load(sparse_dir, quantize_activations=False)
    logits = jdeep.forward(model, PROMPTS[1], pad_to=64)
    assert np.isfinite(logits).all()
    grown, file_grown = status_bytes("VmRSS") - rss0, status_bytes("RssFile") - file0
    print(f"tables {logical / 2**30:.1f} GiB logical ({on_disk / 2**20:.1f} MiB on disk); RSS +{grown / 2**20:.0f} "
          f"MiB, file-backed +{file_grown / 2**20:.1f} MiB")
    assert file_grown < 64 << 20     # the table pages of the gathered rows only
    assert grown < 2 << 30           # everything else is the tiny model and its compiled programs


def test_drafter_and_vision_tensors_load(folder, tmp_path):
    """Checkpoints that carry DSpark (`mtp.*`), vision (`vision.*`, `aligner.*`, `image_*`) and image
    routing (`ffn.gate.bias_vl`) tensors load; the tensors are kept for later, not run."""
    shutil.copytree(folder, tmp_path / "ckpt")
    extra = {"mtp.0.main_proj.weight": np.zeros((128, 384), ml_dtypes.float8_e4m3fn),
             "mtp.0.main_proj.scale": np.zeros((4, 12), ml_dtypes.float8_e8m0fnu),
             "mtp.2.markov_head.embed.weight": np.zeros((512, 16), ml_dtypes.bfloat16),
             "vision.patch_embed.weight": np.zeros((64, 588), ml_dtypes.bfloat16),
             "aligner.w1.weight": np.zeros((128, 576), ml_dtypes.bfloat16),
             "image_newline": np.zeros((128,), ml_dtypes.bfloat16),
             "layers.3.ffn.gate.bias_vl": np.zeros((8,), np.float32)}
    write_safetensors(str(tmp_path / "ckpt" / "extras.safetensors"), extra)
    model = jdeep.load(tmp_path / "ckpt", quantize_activations=False)
    assert np.isfinite(jdeep.forward(model, PROMPTS[0], pad_to=64)).all()


def test_missing_engram_table_and_tokenizer(folder, tmp_path):
    bad = tmp_path / "no_tokenizer"
    shutil.copytree(folder, bad)
    os.remove(bad / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        jdeep.load(bad)
    bad = tmp_path / "no_table"
    shutil.copytree(folder, bad)
    os.remove(bad / "engram.safetensors")
    with pytest.raises(jdeep.CheckpointError, match=r"missing Engram table 'layers\.1\.engram\.embed\.weight'"):
        jdeep.load(bad)


def test_config_disagreeing_with_tokenizer_is_rejected(folder, tmp_path):
    bad = tmp_path / "ckpt"
    shutil.copytree(folder, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw["text_config"]["engram_compressed_vocab_size"] += 1
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        jdeep.load(bad)
