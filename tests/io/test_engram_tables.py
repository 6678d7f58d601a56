"""Engram host side (jdeep.io.engram_tables): token map, hashing and history against DeepSeek's own outputs
(golden v41-tiny-q), an independent arbitrary-precision hash at the released V4.1 sizes, table gathers,
and a gather from a sparse ~189 GiB table file that must not pull the table into memory."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json

import ml_dtypes
import numpy as np
import pytest
from conftest import REPO, golden_path

from jdeep.io.engram_tables import EngramLayout, EngramTables, NgramHistory, build_token_map, dequant_rows, hash_ids
from jdeep.io.safetensors import CheckpointReader, write_safetensors

RELEASED = {"layer_ids": [1, 14], "max_ngram_size": 4, "n_heads": 8, "engram_vocab_size": 16_000_000,
            "compressed_vocab_size": 99_092, "pad_class": 2}
RELEASED_ROWS = (384_006_168, 384_016_682)           # engram_num_embeddings, spec §2.3
INT64_MAX = 2**63 - 1


# ---------------------------------------------------------------------------- golden fixtures
@pytest.fixture(scope="module")
def golden():
    return golden_path("v41-tiny-q")


@pytest.fixture(scope="module")
def text_config(golden):
    return json.loads((golden / "config.json").read_text())["text_config"]


@pytest.fixture(scope="module")
def streams(golden):
    return dict(np.load(golden / "layer_streams.npz"))


@pytest.fixture(scope="module")
def prompts(golden):
    ref = np.load(golden / "reference.npz")
    return [ref[f"prompt_{i}"].astype(np.int64) for i in range(3)]


@pytest.fixture(scope="module")
def token_map(golden, text_config):
    return build_token_map(golden / "tokenizer.json", text_config["engram_compressed_vocab_size"])


@pytest.fixture(scope="module")
def layout(text_config, token_map):
    return EngramLayout.from_config(text_config, token_map)


# ---------------------------------------------------------------------------- token map and layout
def test_token_map_matches_golden(token_map, streams):
    assert token_map.dtype == np.int64
    np.testing.assert_array_equal(token_map, streams["token_map"])


def test_token_map_class_count_checked(golden):
    with pytest.raises(ValueError, match=r"293 classes.*expects 294"):
        build_token_map(golden / "tokenizer.json", expected_classes=294)


def test_golden_layout(layout, text_config):
    # primes as listed in REFERENCE.md (official EngramLayout rule, engram_vocab_size 400)
    assert layout.primes == (((401, 409, 419, 421), (431, 433, 439, 443)),
                             ((449, 457, 461, 463), (467, 479, 487, 491)))
    assert layout.offsets[1][0] == (0, 449, 906, 1367)
    assert list(layout.table_rows) == text_config["engram_num_embeddings"]
    assert layout.pad_class == 2
    with pytest.raises(ValueError, match=r"\[3396, 3754\].*engram_num_embeddings \[3396, 3755\]"):
        layout.check_rows([3396, 3755])


def test_multiplier_seed_is_layer_id_and_draw_count_is_invisible():
    """Seeds are 10007 * model layer id (the golden ids match with it, not with the Engram index).
    Generator.integers draws one value after another, so the first N of 4 draws equal N draws: the
    golden (N = 3) cannot tell 'max_ngram_size draws' from 'always 4'; both give the same hashes."""
    bound = (INT64_MAX // 293) // 2
    for layer in (1, 4):
        three = np.random.default_rng(10007 * layer).integers(0, bound, size=3, dtype=np.int64)
        four = np.random.default_rng(10007 * layer).integers(0, bound, size=4, dtype=np.int64)
        np.testing.assert_array_equal(three, four[:3])
    lay = EngramLayout.create([1, 4], 3, 4, 400, 293, 2)
    assert lay.multipliers[0] == tuple(int(r) * 2 + 1 for r in np.random.default_rng(10007).integers(
        0, bound, size=3, dtype=np.int64))


def test_multipliers_seeded_by_engram_index_do_not_match_golden(layout, token_map, prompts, streams):
    wrong = dataclasses.replace(layout, multipliers=EngramLayout.create([0, 1], 3, 4, 400, 293, 2).multipliers)
    ids = NgramHistory(wrong, token_map, 1).ids_for_chunk(prompts[1][None])
    assert (ids[0] == streams["engram_hash_1"]).mean() < 0.05


# ---------------------------------------------------------------------------- golden hashes
def test_hash_ids_golden_one_shot(layout, token_map, prompts, streams):
    for i, prompt in enumerate(prompts):
        ids = NgramHistory(layout, token_map, 1).ids_for_chunk(prompt[None])
        assert ids.dtype == np.int64 and ids.shape == (1, len(prompt), 2, 8)
        np.testing.assert_array_equal(ids[0], streams[f"engram_hash_{i}"])
        # hash_ids on classes with the sequence-start pad history gives the same
        classes = np.concatenate([[layout.pad_class] * layout.history, token_map[prompt]])[None]
        np.testing.assert_array_equal(hash_ids(layout, classes)[0], streams[f"engram_hash_{i}"])


def test_hash_ids_golden_uneven_chunks(layout, token_map, prompts, streams):
    for i, prompt in enumerate(prompts):
        hist = NgramHistory(layout, token_map, 1)
        cuts = [0, 1, 2, 5, 8, 9, 30, 64, 65, 200, len(prompt)]
        cuts = sorted({c for c in cuts if c <= len(prompt)})
        parts = [hist.ids_for_chunk(prompt[None, a:b]) for a, b in itertools.pairwise(cuts)]
        np.testing.assert_array_equal(np.concatenate(parts, axis=1)[0], streams[f"engram_hash_{i}"])


def test_hash_ids_golden_ragged_batch(layout, token_map, prompts, streams):
    """The three prompts as one batch, padded with random in-range ids, fed in uneven chunks."""
    rng = np.random.default_rng(5)
    lens = np.array([len(p) for p in prompts])
    tokens = rng.integers(0, len(token_map), (3, lens.max()))
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    hist = NgramHistory(layout, token_map, 3)
    got = np.zeros((3, lens.max(), 2, 8), np.int64)
    cuts = [0, 3, 4, 50, 61, 170, 171, lens.max()]
    for a, b in itertools.pairwise(cuts):
        n_valid = np.clip(lens - a, 0, b - a)
        got[:, a:b] = hist.ids_for_chunk(tokens[:, a:b], n_valid)
    for b, p in enumerate(prompts):
        np.testing.assert_array_equal(got[b, : len(p)], streams[f"engram_hash_{b}"])


def test_reset_starts_a_sequence_afresh(layout, token_map, prompts, streams):
    hist = NgramHistory(layout, token_map, 2)
    hist.ids_for_chunk(np.stack([prompts[1][:8], prompts[1][:8]]))
    hist.reset([0])
    ids = hist.ids_for_chunk(np.stack([prompts[0], prompts[1][8:16]]))
    np.testing.assert_array_equal(ids[0], streams["engram_hash_0"])
    np.testing.assert_array_equal(ids[1], streams["engram_hash_1"][8:16])   # row 1 continued


def test_bad_inputs_are_rejected(layout, token_map):
    hist = NgramHistory(layout, token_map, 1)
    with pytest.raises(ValueError, match="token ids"):
        hist.ids_for_chunk(np.array([[len(token_map)]]))
    with pytest.raises(ValueError, match="n_valid"):
        hist.ids_for_chunk(np.array([[3, 4]]), [3])
    with pytest.raises(ValueError, match="class ids"):
        hash_ids(layout, np.array([[0, 0, layout.compressed_vocab_size]]))


# ---------------------------------------------------------------------------- independent reference
def _py_is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    d = 3
    while d * d <= n:
        if n % d == 0:
            return False
        d += 2
    return True


def _py_layout(layer_ids, max_ngram, n_heads, vocab, compressed):
    """Multipliers, primes, offsets with Python ints (the draws themselves come from NumPy's generator)."""
    bound = (INT64_MAX // compressed) // 2
    mults = [[int(r) * 2 + 1 for r in np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram,
                                                                                    dtype=np.int64)]
             for layer in layer_ids]
    used, primes, offsets = set(), [], []
    for _ in layer_ids:
        ps, offs, total = [], [], 0
        for _order in range(2, max_ngram + 1):
            for _head in range(n_heads):
                p = vocab
                while p in used or not _py_is_prime(p):
                    p += 1
                used.add(p)
                ps.append(p)
                offs.append(total)
                total += p
        primes.append(ps)
        offsets.append(offs)
    return mults, primes, offsets


def _py_ids(seq, mults, primes, offsets, max_ngram, n_heads, pad):
    """Row ids of every position of one sequence (list of classes starting at position 0)."""
    out = []
    for t in range(len(seq)):
        c = [seq[t - k] if t - k >= 0 else pad for k in range(max_ngram)]
        per_layer = []
        for m, ps, offs in zip(mults, primes, offsets):
            # The spec's arithmetic is int64; c < compressed vocab and M < int64_max // compressed, so no
            # product (nor XOR of non-negatives) leaves [0, 2^63): Python ints agree with int64 here.
            prods = [c[k] * m[k] for k in range(max_ngram)]
            assert all(0 <= p <= INT64_MAX for p in prods)
            h, row = prods[0], []
            for order in range(2, max_ngram + 1):
                h ^= prods[order - 1]
                for head in range(n_heads):
                    j = (order - 2) * n_heads + head
                    row.append(h % ps[j] + offs[j])
            per_layer.append(row)
        out.append(per_layer)
    return np.array(out, np.int64)


@pytest.fixture(scope="module")
def released_layout():
    return EngramLayout.create(**RELEASED)


def test_released_table_rows(released_layout):
    assert released_layout.table_rows == RELEASED_ROWS
    released_layout.check_rows(list(RELEASED_ROWS))
    _, primes, _ = _py_layout(RELEASED["layer_ids"], 4, 8, RELEASED["engram_vocab_size"], RELEASED["compressed_vocab_size"])
    assert tuple(sum(p) for p in primes) == RELEASED_ROWS
    assert [q for layer in released_layout.primes for order in layer for q in order] == primes[0] + primes[1]


def test_hash_ids_match_python_ints_released_sizes(released_layout):
    lay, cfg = released_layout, RELEASED
    mults, primes, offsets = _py_layout(cfg["layer_ids"], 4, 8, cfg["engram_vocab_size"], cfg["compressed_vocab_size"])
    assert [list(m) for m in lay.multipliers] == mults
    assert [list(sum(layer, ())) for layer in lay.offsets] == offsets
    rng = np.random.default_rng(11)
    top = cfg["compressed_vocab_size"] - 1
    for length in (1, 2, 3, 5, 40):
        seq = rng.integers(0, top + 1, length).tolist()
        seq[rng.integers(0, length)] = top                       # the largest class: largest products
        want = _py_ids(seq, mults, primes, offsets, 4, 8, cfg["pad_class"])
        classes = np.array([[cfg["pad_class"]] * 3 + seq])     # sequence start: pad history
        np.testing.assert_array_equal(hash_ids(lay, classes)[0], want)
        # mid-sequence: the first 3 classes are a real history, ids only for the rest
        if length > 3:
            np.testing.assert_array_equal(hash_ids(lay, np.array([seq]))[0], want[3:])


def test_dead_tokens_block_lookback(released_layout):
    """c_{t-k} reads as pad when any token t-k..t is dead; chunking does not change the ids."""
    lay = released_layout
    rng = np.random.default_rng(3)
    n_vocab, length = 1000, 23
    token_map = rng.integers(0, lay.compressed_vocab_size, n_vocab)
    tokens = rng.integers(0, n_vocab, (2, length))
    dead = np.zeros((2, length), bool)
    dead[0, [4, 5, 6, 15]] = True
    dead[1, [0, 22]] = True
    ids = NgramHistory(lay, token_map, 2).ids_for_chunk(tokens, dead=dead)
    for b in range(2):
        for t in range(length):
            win = []
            for k in range(lay.max_ngram_size):
                blocked = t - k < 0 or dead[b, t - k: t + 1].any()
                win.append(lay.pad_class if blocked else int(token_map[tokens[b, t - k]]))
            # windows [c_t, c_{t-1}, ...] -> hash_ids wants [c_{t-3}, c_{t-2}, c_{t-1}, c_t]
            np.testing.assert_array_equal(ids[b, t], hash_ids(lay, np.array([win[::-1]]))[0, 0])
    hist = NgramHistory(lay, token_map, 2)
    parts = [hist.ids_for_chunk(tokens[:, a:b], dead=dead[:, a:b]) for a, b in ((0, 5), (5, 6), (6, 16), (16, length))]
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), ids)


# ---------------------------------------------------------------------------- tables
def _golden_rows_ml_dtypes(reader, layer):
    codes = reader.get(f"layers.{layer}.engram.embed.weight").view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scale = reader.get(f"layers.{layer}.engram.embed.scale").view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    return codes * np.repeat(scale, 32, axis=1)


def test_dequant_rows_matches_ml_dtypes(golden, layout):
    reader = CheckpointReader(str(golden))
    for layer in layout.layer_ids:
        codes = reader.get(f"layers.{layer}.engram.embed.weight").view(np.uint8)
        scale = reader.get(f"layers.{layer}.engram.embed.scale").view(np.uint8)
        np.testing.assert_array_equal(dequant_rows(codes, scale), _golden_rows_ml_dtypes(reader, layer))
    every = np.arange(256, dtype=np.uint8)[:, None].repeat(32, 1)
    ref = every.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(2.0 ** -3)
    np.testing.assert_array_equal(dequant_rows(every, np.full((256, 1), 124, np.uint8)), ref)


def test_tables_gather_golden(golden, layout, token_map, prompts, streams):
    reader = CheckpointReader(str(golden))
    tables = EngramTables(reader, layout.layer_ids, layout)
    assert tables.head_dim == 32
    ids = NgramHistory(layout, token_map, 1).ids_for_chunk(prompts[2][None])
    codes, scales = tables.gather(ids)
    assert codes.shape == (2, 1, 300, 8, 32) and codes.dtype == np.uint8
    assert scales.shape == (2, 1, 300, 8, 1) and scales.dtype == np.uint8
    for i, layer in enumerate(layout.layer_ids):
        want = _golden_rows_ml_dtypes(reader, layer)[streams["engram_hash_2"][:, i, :]]
        np.testing.assert_array_equal(dequant_rows(codes[i, 0], scales[i, 0]), want)
    # a folder path works as the source too
    np.testing.assert_array_equal(EngramTables(str(golden), layout.layer_ids).gather(ids)[0], codes)


def test_tables_validate(tmp_path, layout):
    rows = layout.table_rows
    good = {f"layers.{layer}.engram.embed.weight": np.zeros((n, 32), ml_dtypes.float8_e4m3fn)
            for layer, n in zip(layout.layer_ids, rows)}
    good.update({f"layers.{layer}.engram.embed.scale": np.zeros((n, 1), ml_dtypes.float8_e8m0fnu)
                 for layer, n in zip(layout.layer_ids, rows)})
    write_safetensors(str(tmp_path / "model.safetensors"), good)
    EngramTables(str(tmp_path), layout.layer_ids, layout)
    raw = {name: a.view(np.uint8) for name, a in good.items()}         # U8 raw bytes are accepted
    write_safetensors(str(tmp_path / "model.safetensors"), raw)
    EngramTables(str(tmp_path), layout.layer_ids, layout)
    with pytest.raises(ValueError, match=r"'layers.4.engram.embed.weight' has 3754 rows.*expects 3755"):
        EngramTables(str(tmp_path), layout.layer_ids, dataclasses.replace(layout, table_rows=(3396, 3755)))
    with pytest.raises(ValueError, match=r"'layers.7.engram.embed.weight' is missing"):
        EngramTables(str(tmp_path), [7])
    bad = dict(good)
    bad["layers.1.engram.embed.weight"] = np.zeros((rows[0], 32), np.float32)
    write_safetensors(str(tmp_path / "model.safetensors"), bad)
    with pytest.raises(ValueError, match=r"'layers.1.engram.embed.weight' must be F8_E4M3.*got F32"):
        EngramTables(str(tmp_path), layout.layer_ids)
    bad = dict(good)
    bad["layers.4.engram.embed.scale"] = np.zeros((rows[1], 2), ml_dtypes.float8_e8m0fnu)
    write_safetensors(str(tmp_path / "model.safetensors"), bad)
    with pytest.raises(ValueError, match=r"'layers.4.engram.embed.scale' must be F8_E8M0 \[3754, 1\]"):
        EngramTables(str(tmp_path), layout.layer_ids)


# ---------------------------------------------------------------------------- sparse table, RSS
def _sparse_script():
    spec = importlib.util.spec_from_file_location("engram_sparse_rss", REPO / "scripts" / "engram_sparse_rss.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gather_from_sparse_table_keeps_rss_small(sparse_dir):
    """Released-size tables (~189 GiB logical, far above this machine's RAM) in a sparse file: a gather
    reads the right rows and grows the resident set by about the pages under them, not the table."""
    out = _sparse_script().run(str(sparse_dir), batch=2, seq=16)
    assert out["table_bytes"] > 150 << 30
    assert out["known_rows_hit"] > 0
    assert out["rss_growth"] < 64 << 20
    assert out["rss_growth"] < 4 * out["bytes_touched"] + (8 << 20)
