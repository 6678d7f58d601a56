"""Every program jdeep compiles for the goldens passes the compile-safety rules in both compile modes
(`jdeep check-graph`), and `jdeep export` writes programs that jax's own deserialiser runs with the live
path's results."""

from __future__ import annotations

import dataclasses

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import golden_path

import jdeep
from jdeep.cli import main
from jdeep.config.small_models import TINY_CONFIG
from jdeep.tools.dev.export import call_exported, load_exported
from jdeep.tools.dev.graphcheck import Limits, check_lowered
from jdeep.tools.dev.programs import Target, model_programs, step_inputs
from jdeep.tools.testing.random_weights import random_checkpoint


@pytest.mark.parametrize("name", ["v4-tiny-hf", pytest.param("v4-tiny-q", marks=pytest.mark.full),
                                  pytest.param("v41-tiny-q", marks=pytest.mark.full)])
def test_check_graph_passes_on_goldens_in_both_modes(name, capsys):
    """`jdeep check-graph` on a golden checkpoint passes in the scan and the regions mode.

    Full tier: tests/tools/dev/test_programs.py::test_check_graph_passes_on_goldens_in_both_modes[v4-tiny-hf] covers
    check-graph's golden path (cmd_check_graph -> model_programs -> check_lowered, V4's four layer kinds, both
    modes) in the default run; the quantized ops (fp8 linears, fp4 experts) and V4.1's Engram pass the rules in
    tests/tools/dev/graphcheck/test_serving_buckets.py::test_preset_decode_programs_pass_at_serving_batches
    [v41-flash-regions-b256] and ::test_dspark_regions_programs_pass_at_serving_batch_size (v41-dspark-tiny's
    quantized V4.1 config), and in the scan mode in ::test_speculative_programs_pass_at_serving_batch_sizes[scan]
    (V4-Flash's fp8/fp4 layers in the layer scan). v4-tiny-q's layer kinds are v4-tiny-hf's and its quantized ops
    v41-tiny-q's."""
    path = golden_path(name)
    for mode in ("scan", "regions"):
        assert main(["check-graph", "--model", str(path), "--mode", mode, "--batch-sizes", "2", "--prefill-len",
                     "32", "--max-len", "256"]) == 0, capsys.readouterr().out
        out = capsys.readouterr().out
        assert f"programs pass the compile-safety rules ({mode} mode" in out and "FAIL" not in out


def test_parameter_arenas_bring_scan_programs_under_128_arguments():
    """Unpacked, a scan step of v4-tiny-q takes > 128 arguments (S19, tested in tests/graphcheck); with arenas
    it takes well under."""
    path = golden_path("v4-tiny-q")
    config = jdeep.ModelConfig.from_file(path)
    from jdeep.numerics import Numerics
    from jdeep.plan import build_plan

    counts = []
    for packed in (False, True):
        t = Target(config, build_plan(config), Numerics.for_config(config), np.float32, "scan", packed_params=packed)
        counts.append(len(jax.tree_util.tree_leaves(step_inputs(t, 2, 1, 64))))
    assert counts[0] > 128 >= counts[1] + 32, counts


def _inputs(model, B, S, max_len, step):
    """Concrete (params, state, tokens, positions, engram, embeds) for a prefill or decode step."""
    rng = np.random.default_rng(B)
    toks = rng.integers(0, model.config.vocab_size, (B, S)).astype(np.int32)
    pos = np.broadcast_to(np.arange(S, dtype=np.int32) + (7 if step == "decode" else 0), (B, S)).copy()
    pos[-1, S // 2 + 1:] = -1                        # a ragged row
    return model.params, model.init_state(B, max_len), jnp.asarray(toks), jnp.asarray(pos), None, None


def test_export_regions_buckets_reload_and_run(tmp_path):
    """A one-layer model (CSA with compressor and indexer, hash-routed MoE: the richest kinds) keeps the 16
    modules (embed, attention, MoE, head per bucket and step) cheap to compile."""
    raw = dict(TINY_CONFIG, layer_types=["compressed_sparse_attention"], num_hidden_layers=1, num_hash_layers=1)
    path = tmp_path / "model"
    random_checkpoint(raw, str(path), seed=5)
    model = jdeep.load(path, compile_mode="regions")
    out = tmp_path / "export"
    assert main(["export", "--model", str(path), "--out", str(out), "--mode", "regions", "--batch-sizes", "1,4",
                 "--prefill-len", "16", "--max-len", "64", "--dtype", "float32", "--platform", "cpu"]) == 0
    manifest, exported = load_exported(str(out))
    assert len(manifest["programs"]) == 16
    assert {(p["bucket"]["batch"], p["bucket"]["step"]) for p in manifest["programs"]} == \
        {(b, s) for b in (1, 4) for s in ("prefill", "decode")}
    assert manifest["model"]["compile_mode"] == "regions" and manifest["jax_version"] == jax.__version__
    for entry in manifest["programs"]:
        for kind in ("mlir", "mlirbc", "jax_exported"):
            assert (out / entry["files"][kind]).stat().st_size > 0
        if ".attn." in entry["name"]:               # the state argument is donated and aliased
            assert any(i["donated"] for i in entry["inputs"]) and entry["aliases"]
    # export lowers without jdeep's native CPU products (cli.commands._graph_target): the live step likewise
    step = jdeep.model.regions.regions_step(model.config, model.plan, model.numerics.portable(), False)
    for B in (1, 4):
        for step_kind, S in (("prefill", 16), ("decode", 1)):
            args = _inputs(model, B, S, 64, step_kind)
            live, live_state = step(*args)
            prefix = f"b{B}.{step_kind}."
            args = _inputs(model, B, S, 64, step_kind)
            logits, state = step._run(*args, lambda name, fn, *a: call_exported(exported[prefix + name], fn, *a))
            np.testing.assert_array_equal(np.asarray(logits), np.asarray(live), err_msg=prefix)
            for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(live_state)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.full
def test_export_scan_reload_and_run(tmp_path):
    """`jdeep export --mode scan` of a golden writes the scan step (state donated and aliased, <= 128 arguments),
    and jax's deserialiser runs it with the live step's results.

    Full tier: tests/tools/dev/test_programs.py::test_export_regions_buckets_reload_and_run covers export's
    reload-and-run path (cmd_export -> load_exported -> call_exported, donated state, aliases) in the default run;
    the scan-mode export itself (_graph_target, the packed scan step's manifest) runs in the default run in
    ::test_check_graph_and_export_walk_the_engines_program_inventory and
    ::test_export_with_speculative_programs_takes_the_live_argument_trees (both --mode scan), and the packed scan
    step's argument count in ::test_parameter_arenas_bring_scan_programs_under_128_arguments."""
    path = golden_path("v4-tiny-hf")
    model = jdeep.load(path, pack_params=True)
    out = tmp_path / "export"
    assert main(["export", "--model", str(path), "--out", str(out), "--mode", "scan", "--batch-sizes", "2",
                 "--prefill-len", "16", "--max-len", "64", "--dtype", "float32", "--platform", "cpu"]) == 0
    manifest, exported = load_exported(str(out))
    assert [p["name"] for p in manifest["programs"]] == ["b2.prefill", "b2.decode"]
    entry = manifest["programs"][1]
    n_state = len(jax.tree_util.tree_leaves(model.init_state(2, 64)))
    assert sum(i["donated"] for i in entry["inputs"]) == n_state == len(entry["aliases"])
    assert len(entry["inputs"]) <= 128 and json.loads((out / "manifest.json").read_text())["schema"] == "jdeep.export/2"
    # export lowers without jdeep's native CPU products (cli.commands._graph_target): the live step likewise
    step = dataclasses.replace(model, numerics=model.numerics.portable()).step_fn(all_logits=False)
    for name, S in (("b2.prefill", 16), ("b2.decode", 1)):
        live = step(*_inputs(model, 2, S, 64, name[3:])[:5])
        got = call_exported(exported[name], step, *_inputs(model, 2, S, 64, name[3:]))
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(live)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_model_programs_match_a_loaded_model():
    """graphs.Target.of(model) builds the same abstract inputs the model's live step takes."""
    model = jdeep.load(golden_path("v4-tiny-hf"), pack_params=True)
    target = Target.of(model)        # checked against Neuron's rules: without the native CPU products
    target = dataclasses.replace(target, numerics=target.numerics.portable())
    (prog,) = [p for p in model_programs(target, (2,), 16, 64) if p.bucket["step"] == "decode"]
    live = jax.tree_util.tree_structure(model.params)
    assert jax.tree_util.tree_structure(prog.args[0]) == live
    report = check_lowered(prog.lower(), name=prog.name, n_experts=model.config.n_routed_experts, decode=True,
                           limits=Limits())
    assert report.ok, report.format()


def test_export_with_speculative_programs_takes_the_live_argument_trees(tmp_path):
    """`jdeep export --speculative-tokens 1` (the demo model's config, with its MTP block) writes the speculative
    engine's prefill and decode programs beside the plain ones; the exported greedy decode takes exactly the leaves
    of the arguments the engine's MTP drafter passes it (the loaded model's packed params, state, drafter state, the
    rows, sampling rows, the window's first slot)."""
    from jdeep.runtime.sampling import batch_params
    from jdeep.speculative.mtp_drafter import MtpDrafter

    demo = pathlib.Path(jdeep.__file__).parent / "demo_model"
    out = tmp_path / "export"
    assert main(["export", "--model", str(demo), "--out", str(out), "--mode", "scan", "--batch-sizes", "1",
                 "--prefill-len", "16", "--max-len", "64", "--dtype", "float32", "--speculative-tokens", "1"]) == 0
    manifest, exported = load_exported(str(out))
    names = [p["name"] for p in manifest["programs"]]
    assert names == ["b1.prefill", "b1.decode", "b1.spec1.decode.greedy", "b1.spec1.decode.sampled",
                     "b1.spec.prefill16.greedy", "b1.spec.prefill16.sampled"]
    model = jdeep.load(demo, drafter=True, pack_params=True, quantize_activations=False, weights="codes")  # as exported
    z = np.zeros(1, np.int32)
    args = (model.params, model.init_state(1, 64), MtpDrafter(model, 1).new_state(1, 64), z, z, z,
            np.zeros(1, bool), batch_params([jdeep.SamplingParams()], 1), np.int32(0))
    leaves = jax.tree_util.tree_leaves(args)
    avals = exported["b1.spec1.decode.greedy"].in_avals
    assert [(a.shape, a.dtype) for a in avals] == [(np.shape(x), np.asarray(x).dtype if not hasattr(x, "dtype")
                                                   else x.dtype) for x in leaves]


def test_check_graph_and_export_walk_the_engines_program_inventory(tmp_path, capsys):
    """With serve settings (--max-num-seqs, --max-len, --prefill-chunk), check-graph and export lower exactly the
    programs the Engine's warm-up runs — its inventory (Engine.programs, which warm-up walks entry by entry:
    tests/runtime/test_engine.py) — by name and in order, from the config alone. Every Neuron program passes
    Neuron's compile-safety rules (the slot reset too: one slot's rows updated in place, S20); the sampler and the
    penalty rows run on the host's CPU backend on Neuron (threefry PRNG, uint64 iotas) and are listed as host
    programs, not checked."""
    from jdeep.config.small_models import one_layer_config
    from jdeep.runtime.engine import Engine

    path = tmp_path / "m"
    random_checkpoint(one_layer_config(), str(path), seed=5)
    eng = Engine(jdeep.load(path), max_num_seqs=2, max_len=160, prefill_chunk=16, prefix_cache_bytes=1 << 20)
    names = [p.name for p in eng.programs()]
    assert {"slots.reset", "slots.move", "b2.decode", "b1.prefill16", "b1.sample", "penalties.reset",
            "snapshot.head.out", "snapshot.block.in",
            "b2.prefill16.all_logits", "b2.prompt_logprobs16"} <= set(names)
    settings = ["--model", str(path), "--mode", "scan", "--max-num-seqs", "2", "--max-len", "160", "--prefill-chunk",
                "16"]
    main(["check-graph", *settings])
    out = capsys.readouterr().out
    reports = {line.split()[1].rstrip(":"): line.split()[0] for line in out.splitlines()
               if line.startswith(("ok ", "graphcheck ", "host "))}
    assert list(reports) == names
    host = {name for name, what in reports.items() if what == "host"}
    assert host == {n for n in names if n.endswith(".sample") or n.startswith("penalties.")} and "b1.sample" in host
    assert all(what == "ok" for name, what in reports.items() if name not in host), out
    assert main(["export", *settings, "--out", str(tmp_path / "export")]) == 0
    manifest, _ = load_exported(str(tmp_path / "export"))
    assert [p["name"] for p in manifest["programs"]] == names


@pytest.mark.parametrize("name,mode", [("mtp", "regions"), ("v41-dspark-tiny", "scan")])
def test_check_graph_walks_the_speculative_engines_program_inventory(name, mode, tmp_path, capsys):
    """With serve settings and --speculative-tokens, check-graph lowers, by name and in order, the programs the
    speculative engine's warm-up runs (SpeculativeEngine.programs), from the config alone: an entry that runs several
    programs lowers as that many, "{name}.{part}" — MTP in the regions mode (draft, each region of the verify step,
    finish), DSpark with Engram (draft and verify around the host's gather; its decode entry holds 2 programs)."""
    from jdeep.config.small_models import one_layer_config
    from jdeep.speculative.engine import make_engine

    if name == "mtp":
        path = tmp_path / "m"
        random_checkpoint(one_layer_config(num_nextn_predict_layers=1), str(path), seed=5)
    else:
        path = golden_path(name)
    model = jdeep.load(path, drafter=True, compile_mode=mode)
    method = "mtp" if name == "mtp" else "dspark"
    eng = make_engine(model, {"method": method, "num_speculative_tokens": 2}, max_num_seqs=2, max_len=160,
                      prefill_chunk=16, prefix_cache_bytes=1 << 20)
    entries = eng.programs()
    assert {"slots.reset", "drafter.reset", "drafter.snapshot.out", "b2.spec2.decode.sampled",
            "b2.spec.prefill16.greedy"} <= {e.name for e in entries}
    main(["check-graph", "--model", str(path), "--mode", mode, "--max-num-seqs", "2", "--max-len", "160",
          "--prefill-chunk", "16", "--speculative-tokens", "2"])
    lowered = [line.split()[1].rstrip(":") for line in capsys.readouterr().out.splitlines()
               if line.startswith(("ok ", "graphcheck "))]
    i = 0
    for e in entries:      # each entry's programs, in order
        parts = [n for n in lowered[i:] if n == e.name or n.startswith(e.name + ".")]
        assert parts and lowered[i:i + len(parts)] == parts, (e.name, lowered[i:i + 3])
        if e.kind == "spec.decode" and mode == "scan":
            assert len(parts) == e.programs
        i += len(parts)
    assert i == len(lowered)
