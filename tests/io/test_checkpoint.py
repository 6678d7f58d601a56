"""Checkpoint loading (jdeep.io.checkpoint, jdeep.load): single-file and sharded safetensors, the param-tree
layout, CheckpointError/ConfigError on broken folders, Orbax round trip and bfloat16 loading."""

from __future__ import annotations

import copy
import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import GOLDEN_DIR

import jdeep
from jdeep import CheckpointError, ConfigError
from jdeep.io.checkpoint import load_params
from jdeep.io.convert import is_converted, save_converted
from jdeep.io.safetensors import SafetensorsFile, write_safetensors
from jdeep.model.weights import from_cpu_bf16
from jdeep.plan import layer_kinds
from jdeep.config.small_models import TINY_CONFIG
from jdeep.tools.testing.random_weights import random_checkpoint

# Five layers, three layer bodies: [sliding/hash] x1, [csa4, hca16] x2 (a segment with reps = 2).
CFG = copy.deepcopy(TINY_CONFIG)
CFG.update(
    num_hidden_layers=5,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention", "heavily_compressed_attention"],
    num_hash_layers=1,
)
# 24 tokens: past the sliding window (16) and long enough to fill ratio-4 and ratio-16 compressed entries.
TOKENS = [(7 * i + 3) % CFG["vocab_size"] for i in range(24)]
Q_DIR = os.path.join(GOLDEN_DIR, "v4-tiny-q")


def _leaves(tree):
    return jax.tree_util.tree_leaves_with_path(tree)


def assert_trees_equal(a, b, check_dtype=True):
    la, lb = _leaves(a), _leaves(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    assert len(la) == len(lb) > 0
    for (pa, xa), (pb, xb) in zip(la, lb):
        assert pa == pb
        xa, xb = np.asarray(xa), np.asarray(xb)
        if check_dtype:
            assert xa.dtype == xb.dtype, jax.tree_util.keystr(pa)
        assert xa.shape == xb.shape, jax.tree_util.keystr(pa)
        np.testing.assert_array_equal(xa, xb, err_msg=jax.tree_util.keystr(pa))


def _read_all(folder: str) -> dict[str, np.ndarray]:
    f = SafetensorsFile(os.path.join(folder, "model.safetensors"))
    out = {name: np.array(f.get(name)) for name in f.entries}
    f.close()
    return out


def _variant(src: str, dst, mutate) -> str:
    """Copy of the single-file checkpoint `src` in `dst`, with its tensor dict passed through `mutate`."""
    dst = str(dst)
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), dst)
    tensors = _read_all(src)
    mutate(tensors)
    write_safetensors(os.path.join(dst, "model.safetensors"), tensors)
    return dst


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def single(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("single"))
    random_checkpoint(CFG, d, seed=0)
    assert sorted(os.listdir(d)) == ["config.json", "model.safetensors"]
    return d


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("sharded"))
    random_checkpoint(CFG, d, seed=0, n_shards=3)
    return d


@pytest.fixture(scope="module")
def model(single):
    return jdeep.load(single)


@pytest.fixture(scope="module")
def logits(model):
    out = jdeep.forward(model, TOKENS)
    assert out.shape == (len(TOKENS), CFG["vocab_size"]) and out.dtype == np.float32
    assert np.isfinite(out).all()
    return out


@pytest.fixture(scope="module")
def file_tensors(single):
    return _read_all(single)


# ------------------------------------------------------------------------------------------ loading
def test_sharded_matches_single(single, sharded, model):
    files = sorted(p for p in os.listdir(sharded) if p.endswith(".safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    assert set(weight_map.values()) == set(files)
    m2 = jdeep.load(sharded)
    assert m2.config == model.config and m2.plan == model.plan
    assert_trees_equal(model.params, m2.params)


def test_param_tree_layout(model, file_tensors):
    c, plan, params = model.config, model.plan, model.params
    assert [(s.first_layer, [k.name for k in s.pattern], s.reps) for s in plan.segments] == \
        [(0, ["sliding_hash"], 1), (1, ["csa4", "hca16"], 2)]
    E, I, d, V = c.n_routed_experts, c.moe_inter_dim, c.dim, c.vocab_size
    assert params["embed"].shape == (V, d) and params["head"].shape == (d, V)    # head input-major
    np.testing.assert_array_equal(np.asarray(params["head"]), file_tensors["head.weight"].T)
    assert params["hc_head_fn"].shape == (c.hc_mult, c.hc_mult * d)
    assert len(params["segments"]) == len(plan.segments)
    for s, seg in enumerate(plan.segments):
        assert len(params["segments"][s]) == len(seg.pattern)
        for slot, kind in enumerate(seg.pattern):
            tree = params["segments"][s][slot]
            ffn = tree["ffn"]
            assert ffn["w1"].shape == (seg.reps, E, I, d)
            assert ffn["w3"].shape == (seg.reps, E, I, d)
            assert ffn["w2"].shape == (seg.reps, E, d, I)
            assert ffn["shared_experts"]["w1"].shape == (seg.reps, I, d)
            assert ("tid2eid" in ffn["gate"]) == kind.hash_moe
            assert ("bias" in ffn["gate"]) != kind.hash_moe
            assert ("compressor" in tree["attn"]) == (kind.attn.ratio > 0)
            assert ("indexer" in tree["attn"]) == kind.attn.has_indexer
            for path, leaf in _leaves(tree):
                assert leaf.shape[0] == seg.reps, jax.tree_util.keystr(path)

    np.testing.assert_array_equal(np.asarray(params["embed"]), file_tensors["embed.weight"])
    np.testing.assert_array_equal(np.asarray(params["hc_head_base"]), file_tensors["hc_head_base"])
    kinds = layer_kinds(c)
    for layer in range(c.n_layers):
        s, slot, rep = plan.locate(layer)
        assert plan.segments[s].pattern[slot] == kinds[layer]
        tree = params["segments"][s][slot]
        pre = f"layers.{layer}."
        for e in (0, 3, E - 1):
            for w in ("w1", "w2", "w3"):
                np.testing.assert_array_equal(np.asarray(tree["ffn"][w][rep, e]),
                                              file_tensors[f"{pre}ffn.experts.{e}.{w}.weight"])
        np.testing.assert_array_equal(np.asarray(tree["attn"]["wkv"][rep]), file_tensors[pre + "attn.wkv.weight"])
        np.testing.assert_array_equal(np.asarray(tree["attn"]["attn_sink"][rep]), file_tensors[pre + "attn.attn_sink"])
        np.testing.assert_array_equal(np.asarray(tree["hc_ffn_fn"][rep]), file_tensors[pre + "hc_ffn_fn"])
        np.testing.assert_array_equal(np.asarray(tree["ffn"]["shared_experts"]["w2"][rep]),
                                      file_tensors[pre + "ffn.shared_experts.w2.weight"])
        if kinds[layer].attn.ratio:
            np.testing.assert_array_equal(np.asarray(tree["attn"]["compressor"]["ape"][rep]),
                                          file_tensors[pre + "attn.compressor.ape"])
        if kinds[layer].attn.has_indexer:
            np.testing.assert_array_equal(np.asarray(tree["attn"]["indexer"]["wq_b"][rep]),
                                          file_tensors[pre + "attn.indexer.wq_b.weight"])
    # layers 1 and 3 share a slot: rep 0 and rep 1 hold different tensors
    s, slot, rep = plan.locate(3)
    assert (s, slot, rep) == (1, 0, 1)
    assert not np.array_equal(np.asarray(params["segments"][1][0]["attn"]["wkv"][0]),
                              np.asarray(params["segments"][1][0]["attn"]["wkv"][1]))


def test_tid2eid_is_int32(model, file_tensors):
    gate = model.params["segments"][0][0]["ffn"]["gate"]
    tid = np.asarray(gate["tid2eid"])
    assert tid.dtype == np.int32
    assert file_tensors["layers.0.ffn.gate.tid2eid"].dtype == np.int64  # converted on load
    assert tid.shape == (1, CFG["vocab_size"], CFG["num_experts_per_tok"])
    np.testing.assert_array_equal(tid[0], file_tensors["layers.0.ffn.gate.tid2eid"])


def test_float32_load_dtypes(model):
    for path, leaf in _leaves(model.params):
        key = jax.tree_util.keystr(path)
        expected = np.int32 if "tid2eid" in key else np.float32
        assert leaf.dtype == expected, key


def test_bfloat16_load_dtypes(single, model):
    """The loader's dtypes, read through from_cpu_bf16: on CPU the scan mode keeps the layer stack's bf16 weights as
    their uint16 bits and the head in fp32 (tests/model/test_cpu_bf16.py), which that maps back losslessly."""
    mb = jdeep.load(single, dtype="bfloat16")
    params = from_cpu_bf16(mb.params, mb.dtype)
    n_f32 = n_bf16 = 0
    f32_params = dict(_leaves(model.params))
    for path, leaf in _leaves(params):
        key = jax.tree_util.keystr(path)
        last = str(path[-1].key)
        if last == "tid2eid":
            assert leaf.dtype == np.int32, key
        elif last.startswith("hc_") or last in ("attn_sink", "ape", "bias"):
            assert leaf.dtype == np.float32, key  # mHC, sinks, position bias, gate bias stay f32
            np.testing.assert_array_equal(np.asarray(leaf), np.asarray(f32_params[path]), err_msg=key)
            n_f32 += 1
        else:
            assert leaf.dtype == jax.numpy.bfloat16, key
            np.testing.assert_array_equal(np.asarray(leaf),
                                          np.asarray(f32_params[path]).astype(ml_dtypes.bfloat16), err_msg=key)
            n_bf16 += 1
    assert n_f32 >= 10 and n_bf16 >= 20
    assert params["hc_head_scale"].dtype == np.float32
    assert params["segments"][1][1]["attn"]["attn_sink"].dtype == np.float32
    assert params["segments"][1][0]["ffn"]["w1"].dtype == jax.numpy.bfloat16


def test_mtp_tensors_ignored(single, tmp_path, model):
    def add_mtp(t):
        t["mtp.0.attn.wkv.weight"] = np.ones((64, 128), np.float32)
        t["mtp.0.e_proj.weight"] = np.zeros((128, 128), ml_dtypes.bfloat16)
        t["mtp.0.hc_head_fn"] = np.zeros((3, 5), np.int8)  # any shape or dtype: not read
    folder = _variant(single, tmp_path / "mtp", add_mtp)
    m = jdeep.load(folder)
    assert_trees_equal(model.params, m.params)


def test_load_params_progress(single, model):
    calls = []
    load_params(single, model.config, model.plan, np.float32, progress=lambda i, n: calls.append((i, n)))
    n = calls[-1][1]
    done = [i for i, _ in calls]
    assert done == sorted(done) and done[-1] == n and all(t == n for _, t in calls)
    assert n == len(_read_all(single))  # counts every tensor of the file


def test_bfloat16_checkpoint_file(tmp_path, model):
    """A bf16 checkpoint (the released format for non-quantized weights) loads in float32."""
    d = str(tmp_path / "bf16")
    random_checkpoint(CFG, d, seed=0, dtype="bfloat16")
    f = SafetensorsFile(os.path.join(d, "model.safetensors"))
    assert f.entries["layers.0.attn.wkv.weight"].dtype == "BF16"
    assert f.entries["layers.0.hc_attn_fn"].dtype == "F32"
    m = jdeep.load(d)
    w = np.asarray(m.params["segments"][0][0]["attn"]["wkv"][0])
    assert w.dtype == np.float32
    ref = np.asarray(model.params["segments"][0][0]["attn"]["wkv"][0])
    np.testing.assert_array_equal(w, ref.astype(ml_dtypes.bfloat16).astype(np.float32))


# ------------------------------------------------------------------------------------------ errors
def _drop(name):
    def f(t):
        del t[name]
    return f


def _put(name, value):
    def f(t):
        t[name] = value(t) if callable(value) else value
    return f


def _set_tid(value):
    def f(t):
        tid = t["layers.0.ffn.gate.tid2eid"].copy()
        tid[5, 1] = value
        t["layers.0.ffn.gate.tid2eid"] = tid
    return f


CKPT_ERRORS = [
    ("missing", _drop("layers.1.attn.wkv.weight"), r"missing tensor 'layers\.1\.attn\.wkv\.weight'"),
    ("missing expert", _drop("layers.4.ffn.experts.7.w2.weight"), r"missing tensor 'layers\.4\.ffn\.experts\.7\.w2"),
    ("missing top", _drop("hc_head_scale"), r"missing tensor 'hc_head_scale'"),
    ("extra", _put("layers.0.attn.bogus.weight", np.zeros((4, 4), np.float32)),
     r"unexpected tensor 'layers\.0\.attn\.bogus\.weight'"),
    ("extra layer", _put("layers.5.attn.wkv.weight", np.zeros((64, 128), np.float32)),
     r"unexpected tensor 'layers\.5\.attn\.wkv\.weight'"),
    ("indexer on an hca layer", _put("layers.2.attn.indexer.wq_b.weight", np.zeros((512, 64), np.float32)),
     r"unexpected tensor 'layers\.2\.attn\.indexer\.wq_b\.weight'"),
    ("mis-shaped", _put("layers.2.attn.wq_a.weight", lambda t: t["layers.2.attn.wq_a.weight"].T.copy()),
     r"'layers\.2\.attn\.wq_a\.weight' has shape \[128, 64\], expected \[64, 128\]"),
    ("mis-shaped ape", _put("layers.1.attn.compressor.ape", np.zeros((16, 128), np.float32)),
     r"'layers\.1\.attn\.compressor\.ape' has shape"),
    ("int weight", _put("layers.3.ffn_norm.weight", np.ones(128, np.int32)),
     r"'layers\.3\.ffn_norm\.weight' has dtype I32, expected a float"),
    ("int8 weight", _put("layers.1.attn.wo_b.weight", lambda t: np.zeros(t["layers.1.attn.wo_b.weight"].shape, np.int8)),
     r"'layers\.1\.attn\.wo_b\.weight' has dtype I8.*quantized"),
    ("float tid2eid", _put("layers.0.ffn.gate.tid2eid", lambda t: t["layers.0.ffn.gate.tid2eid"].astype(np.float32)),
     r"'layers\.0\.ffn\.gate\.tid2eid' has dtype F32, expected an integer"),
    ("tid2eid too large", _set_tid(8), r"'layers\.0\.ffn\.gate\.tid2eid' holds expert ids outside \[0, 8\)"),
    ("tid2eid negative", _set_tid(-1), r"'layers\.0\.ffn\.gate\.tid2eid' holds expert ids outside"),
]


@pytest.mark.parametrize("label, mutate, match", CKPT_ERRORS, ids=[e[0] for e in CKPT_ERRORS])
def test_checkpoint_errors(single, tmp_path, label, mutate, match):
    folder = _variant(single, tmp_path / "ckpt", mutate)
    with pytest.raises(CheckpointError, match=match):
        jdeep.load(folder)


def test_all_problems_reported_together(single, tmp_path):
    def several(t):
        del t["layers.1.attn.wkv.weight"]
        t["layers.0.attn.bogus.weight"] = np.zeros(3, np.float32)
        t["norm.weight"] = np.zeros(7, np.float32)
    folder = _variant(single, tmp_path / "ckpt", several)
    with pytest.raises(CheckpointError) as err:
        jdeep.load(folder)
    msg = str(err.value)
    for name in ("layers.1.attn.wkv.weight", "layers.0.attn.bogus.weight", "norm.weight"):
        assert name in msg


def test_invalid_config_json(single, tmp_path):
    folder = _variant(single, tmp_path / "ckpt", lambda t: None)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write('{"model_type": "deepseek_v4", ')
    with pytest.raises(ConfigError, match="not valid JSON"):
        jdeep.load(folder)


def test_config_inconsistent_with_weights(single, tmp_path):
    """A valid config that describes another model: every mismatch is a CheckpointError."""
    folder = _variant(single, tmp_path / "ckpt", lambda t: None)
    cfg = dict(CFG, moe_intermediate_size=32)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointError, match=r"ffn\.experts\.0\.w1\.weight' has shape \[64, 128\], expected \[32, 128\]"):
        jdeep.load(folder)


def test_config_error_in_checkpoint_folder(single, tmp_path):
    folder = _variant(single, tmp_path / "ckpt", lambda t: None)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(CFG, o_groups=3), f)
    with pytest.raises(ConfigError, match="o_groups"):
        jdeep.load(folder)


def test_missing_config_json(single, tmp_path):
    folder = _variant(single, tmp_path / "ckpt", lambda t: None)
    os.remove(os.path.join(folder, "config.json"))
    with pytest.raises(ConfigError, match="no config.json"):
        jdeep.load(folder)


def test_not_a_folder(tmp_path):
    with pytest.raises(FileNotFoundError):
        jdeep.load(tmp_path / "nowhere")


def test_no_safetensors(single, tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    shutil.copy(os.path.join(single, "config.json"), folder)
    with pytest.raises(CheckpointError, match="no .safetensors"):
        jdeep.load(folder)


def test_index_points_to_missing_shard(sharded, tmp_path):
    folder = str(tmp_path / "sharded")
    shutil.copytree(sharded, folder)
    os.remove(os.path.join(folder, "model-00002-of-00003.safetensors"))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors.*missing"):
        jdeep.load(folder)


def test_index_lists_tensor_in_wrong_shard(sharded, tmp_path):
    folder = str(tmp_path / "sharded")
    shutil.copytree(sharded, folder)
    index = os.path.join(folder, "model.safetensors.index.json")
    with open(index) as f:
        data = json.load(f)
    wm = data["weight_map"]
    wrong = next(fn for fn in sorted(set(wm.values())) if fn != wm["embed.weight"])
    wm["embed.weight"] = wrong
    with open(index, "w") as f:
        json.dump(data, f)
    with pytest.raises(CheckpointError, match=r"'embed\.weight' is listed in " + wrong):
        jdeep.load(folder)


def test_malformed_index(sharded, tmp_path):
    folder = str(tmp_path / "sharded")
    shutil.copytree(sharded, folder)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}}, f)
    with pytest.raises(CheckpointError, match="index.json is malformed"):
        jdeep.load(folder)


def test_duplicate_tensor_across_shards(sharded, tmp_path):
    folder = str(tmp_path / "sharded")
    shutil.copytree(sharded, folder)
    os.remove(os.path.join(folder, "model.safetensors.index.json"))  # fall back to every *.safetensors
    write_safetensors(os.path.join(folder, "model-extra.safetensors"), {"embed.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(CheckpointError, match=r"'embed\.weight' appears in both"):
        jdeep.load(folder)


def test_shards_without_index_load(sharded, tmp_path, model):
    folder = str(tmp_path / "sharded")
    shutil.copytree(sharded, folder)
    os.remove(os.path.join(folder, "model.safetensors.index.json"))
    assert_trees_equal(model.params, jdeep.load(folder).params)


@pytest.mark.parametrize("keep", ["data", "header", "length"])
def test_truncated_safetensors(single, tmp_path, keep):
    folder = str(tmp_path / "trunc")
    shutil.copytree(single, folder)
    path = os.path.join(folder, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (n,) = np.frombuffer(f.read(8), dtype="<u8")
    cut = {"data": size - 100, "header": 8 + int(n) // 2, "length": 5}[keep]
    with open(path, "r+b") as f:
        f.truncate(cut)
    match = {"data": "truncated", "header": "corrupt safetensors header", "length": "8-byte header"}[keep]
    with pytest.raises(CheckpointError, match=match):
        jdeep.load(folder)


def test_corrupt_safetensors_header(single, tmp_path):
    folder = str(tmp_path / "corrupt")
    shutil.copytree(single, folder)
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"#")  # first header byte no longer '{'
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        jdeep.load(folder)


@pytest.mark.skipif(not os.path.isdir(Q_DIR), reason="golden checkpoints not available")
def test_quantized_tensors_without_quantization_config_rejected_clearly(tmp_path):
    """The quantized golden with its quantization_config removed: fp8 tensors where floats are expected."""
    folder = tmp_path / "q-no-qc"
    folder.mkdir()
    shutil.copy(os.path.join(Q_DIR, "model.safetensors"), folder / "model.safetensors")
    with open(os.path.join(Q_DIR, "config.json")) as f:
        raw = json.load(f)
    raw.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"'layers\.0\.attn\.wq_a\.weight' has dtype F8_E4M3.*no quantization_config"):
        jdeep.load(folder)


def test_write_read_safetensors_round_trip(tmp_path):
    tensors = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.array([1.5, -2.0], ml_dtypes.bfloat16),
        "c": np.array([[1, 2]], np.int64),
        "d": np.zeros((0, 4), np.float16),
        "e": np.array([7], np.uint8),
    }
    p = str(tmp_path / "x.safetensors")
    write_safetensors(p, tensors, metadata={"format": "pt"})
    f = SafetensorsFile(p)
    assert f.metadata == {"format": "pt"}
    assert [f.entries[k].dtype for k in tensors] == ["F32", "BF16", "I64", "F16", "U8"]
    for k, v in tensors.items():
        got = f.get(k)
        assert got.dtype == v.dtype and got.shape == v.shape
        np.testing.assert_array_equal(got, v)
    with open(p, "rb") as fh:
        (n,) = np.frombuffer(fh.read(8), dtype="<u8")
    assert n % 8 == 0  # data section aligned
    with pytest.raises(TypeError, match="z"):
        write_safetensors(str(tmp_path / "y.safetensors"), {"z": np.zeros(2, np.complex64)})


# ------------------------------------------------------------------------------------------ orbax, dtypes, forward
def test_orbax_round_trip(tmp_path, model, logits):
    out = str(tmp_path / "converted")
    save_converted(out, model.config, model.params, "float32")
    assert is_converted(out)
    assert not any(p.endswith(".safetensors") for p in os.listdir(out))
    m2 = jdeep.load(out)
    assert m2.config == model.config and m2.plan == model.plan
    assert_trees_equal(model.params, m2.params)
    l2 = jdeep.forward(m2, TOKENS)
    np.testing.assert_array_equal(l2, logits)
    with pytest.raises(ConfigError, match="float32"):
        jdeep.load(out, dtype="bfloat16")
    marker = os.path.join(out, "jdeep_converted.json")
    with open(marker, "w") as f:       # a folder converted by an older jdeep (a different param layout)
        json.dump({"format": "jdeep-orbax-v1", "dtype": "float32"}, f)
    with pytest.raises(ConfigError, match="jdeep convert"):
        jdeep.load(out)


def test_bfloat16_forward_close_to_float32(single, logits):
    mb = jdeep.load(single, dtype="bfloat16")
    lb = jdeep.forward(mb, TOKENS)
    assert lb.shape == logits.shape and lb.dtype == np.float32
    assert np.isfinite(lb).all()
    assert not np.array_equal(lb, logits)  # really ran in bfloat16
    cos = (lb * logits).sum(-1) / (np.linalg.norm(lb, axis=-1) * np.linalg.norm(logits, axis=-1))
    # Measured (seed 0, these 24 tokens, 2-core CPU, jax 0.10.0, jdeep a04664f): median 0.9999, mean 0.987,
    # min 0.868 (row 18); rows 9, 15, 18 and 20 fall below 0.99, all others >= 0.995. A per-row 0.99 bar does
    # not hold: the low rows come from discrete choices (top-k expert routing, the first ratio-16 entry at
    # position 15) flipping in this tiny random model. Rows 15 and 18 drop just as much with bf16-*rounded
    # weights* computed in float32 (0.953 / 0.879), and golden v4-tiny-hf (whose float32 logits match
    # transformers to 4e-6) shows the same pattern (min 0.925 over 64 tokens). So: statistical bars, with the
    # median catching any systematic bf16 error and the minimum catching garbage rows.
    assert np.median(cos) > 0.999, cos
    assert (cos > 0.99).mean() >= 0.75, cos
    assert cos.mean() > 0.95, cos
    assert cos.min() > 0.5, cos
    assert (lb.argmax(-1) == logits.argmax(-1)).mean() >= 0.75
