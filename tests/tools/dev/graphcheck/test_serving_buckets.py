"""The compile-safety contract at serving sizes: `jdeep check-graph` defaults to the serving buckets (batches 1..256,
prefill chunk buckets up to 8192), and the released presets' programs pass the rules there, lowered from their
configs alone (no weights). Decode is where the MoE's regime changes with the batch: the per-pair kernel while
tokens x top-k < experts, the sort-free grouped kernel from there on (S6: no sort in decode; S5: no loop of
exactly E trips).

A prefill step holds at most SERVING_PREFILL_TOKENS (8192) tokens, batch x chunk (check-graph's
--max-prefill-tokens): larger steps would exceed S4's loop trip budget in the MoE's tile loop and are not served.
Known budget failures the tests leave out (docs/neuron.md): the scan mode of a released preset exceeds S4's unroll
budgets (a layer scan around the MoE's tile loop; V4.1-Flash's scan step also S19's argument count)."""

from __future__ import annotations

import json

import ml_dtypes
import pytest

from conftest import golden_path
from jdeep.cli import build_parser, main
from jdeep.model.cache import ProgramCache
from jdeep.config.presets import PRESET_NAMES, preset
from jdeep.config.small_models import TINY_CONFIG
from jdeep.tools.dev.graphcheck import RULES, check_lowered
from jdeep.tools.dev.programs import (SERVING_BATCH_SIZES, SERVING_PREFILL_LEN, SERVING_PREFILL_TOKENS, Target,
                                  chunk_buckets, model_programs)

PRESETS = ("v4-flash", "v4-pro", "v41-flash")


def _skipped(name: str, mode: str, bucket: dict) -> set[str]:
    """The rules a program is known to exceed (budgets, see the module docstring): not checked."""
    if mode == "scan":
        return {"S4", "S19"} if name == "v41-flash" else {"S4"}
    return set()


def _failures(name: str, mode: str, batch_sizes, prefill_lens, steps=("prefill", "decode"), pool=None
              ) -> tuple[int, list[str]]:
    """Lower the preset's programs of `steps` (bfloat16, trn2 fp8, as check-graph does; with `pool`, as the Engine's
    windows of a pool of that many slots) and check each; (count, failures)."""
    config = preset(name)
    target = Target.for_config(config, ml_dtypes.bfloat16, mode, fp8_max=240.0, packed_params=mode == "scan",
                               platform="neuron")
    programs = [p for p in model_programs(target, batch_sizes, prefill_lens, SERVING_PREFILL_LEN, cache=ProgramCache(),
                                          max_prefill_tokens=SERVING_PREFILL_TOKENS, pool=pool)
                if p.bucket["step"] in steps]
    bad = []
    for prog in programs:
        rules = set(RULES) - _skipped(name, mode, prog.bucket)
        report = check_lowered(prog.lower(), name=prog.name, n_experts=config.n_routed_experts,
                               decode=prog.bucket["step"] == "decode", rules=rules)
        if not report.ok:
            bad.append(report.format())
    return len(programs), bad


def test_check_graph_defaults_are_the_serving_buckets():
    assert PRESET_NAMES == PRESETS
    args = build_parser().parse_args(["check-graph", "--preset", "v4-flash"])
    assert args.batch_sizes == "1,2,4,8,16,32,64,128,256" and tuple(SERVING_BATCH_SIZES) == (1, 2, 4, 8, 16, 32, 64,
                                                                                                 128, 256)
    assert args.prefill_len == args.max_len == SERVING_PREFILL_LEN == 8192 and args.mode == "regions"
    assert args.max_prefill_tokens == SERVING_PREFILL_TOKENS == 8192
    assert chunk_buckets(8192) == (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    assert chunk_buckets(100) == (16, 32, 64, 128) and chunk_buckets(1) == (16,)
    export = build_parser().parse_args(["export", "--preset", "v4-flash", "--out", "x"])
    assert (export.batch_sizes, export.prefill_len) == ("1,2,4,8", 128)        # export keeps its own defaults


@pytest.mark.parametrize("mode", [pytest.param("scan", marks=pytest.mark.full), "regions"])
def test_check_graph_small_model_whose_pairs_exceed_its_experts(tmp_path, capsys, mode):
    """6 experts, top-2 (config only, no weights; a hash-routed and a top-k layer): batch 3 has T*k == E, batches 4
    and 8 more pairs than experts; prefill and decode pass every rule in both modes.

    Full tier: tests/tools/dev/graphcheck/test_serving_buckets.py::test_check_graph_small_model_whose_pairs_exceed_its_experts
    [regions] covers the MoE's regime boundary (the routed op chosen at T*k == E and above, the same moe code in
    both modes) in the default run, and ::test_speculative_programs_pass_at_serving_batch_sizes[scan] the sort-free
    MoE inside the scan mode's layer scan."""
    raw = dict(TINY_CONFIG, n_routed_experts=6, num_experts_per_tok=2, num_hidden_layers=2, num_hash_layers=1,
               layer_types=["sliding_attention", "compressed_sparse_attention"])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    rc = main(["check-graph", "--model", str(tmp_path), "--mode", mode, "--batch-sizes", "3,4,8", "--prefill-len",
               "16", "--max-len", "64", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for B in (3, 4, 8):
        assert all(f"b{B}.{step}" in out for step in ("prefill16", "decode")), out
    assert f"programs pass the compile-safety rules ({mode} mode" in out and "FAIL" not in out


# The decode programs at the largest batch (sort-free MoE) of every preset in the regions mode, and of V4-Flash in
# the scan mode (the same MoE code in a layer scan). Default run: V4-Flash and V4.1-Flash (regions); V4-Pro
# (V4-Flash's code at other widths) and V4-Flash's scan mode (the sort-free MoE in a layer scan, checked by
# test_speculative_programs_pass_at_serving_batch_sizes[scan]) are in the full tier. The T*k == E boundary runs in
# the small-model test above (batch 3), the per-pair regime (T*k < E) in tests/tools/dev/test_programs.py's goldens
# (batch 2). The exhaustive sweep below covers every bucket of every preset in both modes (full tier).
FAST = [(name, "regions", (256,)) for name in PRESETS] + [("v4-flash", "scan", (256,))]
_FAST_FULL = {("v4-pro", "regions"), ("v4-flash", "scan")}


@pytest.mark.parametrize("name,mode,batches", [
    pytest.param(n, m, b, id=f"{n}-{m}-b{b[0]}", marks=[pytest.mark.full] if (n, m) in _FAST_FULL else [])
    for n, m, b in FAST])
def test_preset_decode_programs_pass_at_serving_batches(name, mode, batches):
    """A released preset's decode programs at the largest serving batch (the sort-free grouped MoE) pass the rules.

    Full tier: tests/tools/dev/graphcheck/test_serving_buckets.py::test_preset_decode_programs_pass_at_serving_batches
    [v4-flash-regions-b256] covers V4-Pro's decode path (the same V4 layers and sort-free MoE at other widths) in the
    default run, and ::test_speculative_programs_pass_at_serving_batch_sizes[scan] V4-Flash's scan-mode step (its
    verify over 4 positions x 64 rows runs the sort-free MoE in the layer scan: T*k above the expert count)."""
    n, bad = _failures(name, mode, batches, (), steps=("decode",))
    assert n and not bad, "\n".join(bad)


def test_preset_longest_prefill_chunk_passes():
    """The longest chunk (8192 tokens, batch 1) in the regions mode: the sorted grouped MoE at its largest tile
    loop within budget."""
    n, bad = _failures("v4-flash", "regions", (1,), (SERVING_PREFILL_LEN,), steps=("prefill",))
    assert n and not bad, "\n".join(bad)


@pytest.mark.full
def test_engine_windows_of_a_256_slot_pool_pass():
    """What the Engine compiles: decode and prefill steps over windows of 1 and 64 slots (first slot traced, clamped)
    of a 256-slot V4-Flash state, sliced out and written back in place (S12 index safety, S20 donation), in the
    regions mode (Neuron's; the scan mode's windows are the same state.slot_window / put_slot_window ops).

    Full tier: tests/tools/dev/test_programs.py::test_check_graph_and_export_walk_the_engines_program_inventory
    covers the pool-window programs (the Engine's b1/b2 windows of a 2-slot pool: state.slot_window /
    put_slot_window with a traced, clamped first slot, S12 and S20 checked) in the default run; this is the same
    path at a serving pool size."""
    n, bad = _failures("v4-flash", "regions", (1, 64), (256,), pool=256)
    assert n and not bad, "\n".join(bad)


@pytest.mark.full
@pytest.mark.parametrize("mode", ["regions", "scan"])
@pytest.mark.parametrize("name", PRESETS)
def test_preset_every_serving_bucket(name, mode):
    """check-graph's default grid (every batch bucket x every chunk bucket + decode) of each preset and mode,
    less the known budget failures (`_skipped`).

    Full tier: tests/tools/dev/graphcheck/test_serving_buckets.py::test_preset_decode_programs_pass_at_serving_batches
    and ::test_preset_longest_prefill_chunk_passes cover the presets' decode and prefill programs (the MoE regimes
    per bucket) in the default run, and tests/kernels/test_moe_nosort.py::test_routed_op_choice the op each bucket
    picks."""
    n, bad = _failures(name, mode, SERVING_BATCH_SIZES, chunk_buckets(SERVING_PREFILL_LEN))
    assert n and not bad, "\n".join(bad)


@pytest.mark.parametrize("mode", ["scan", pytest.param("regions", marks=pytest.mark.full)])
def test_speculative_programs_pass_at_serving_batch_sizes(mode):
    """V4-Flash's MTP speculative-decoding programs (k = 3: the iteration drafts, verifies 4 positions, restores the
    rejected ones' cache entries and catches the MTP block up; the prefill chunk with the MTP block) at batch 64
    (tokens x top-k above the expert count; `jdeep check-graph --speculative-tokens` checks every bucket), in both
    compile modes (regions: the draft and finish programs, the MTP half of the prefill, the region programs of the
    verify and prefill steps): the greedy variants pass every rule; the sampled ones every rule but those the
    threefry PRNG breaks (S10 64-bit counters, S13 its bits-to-float bitcast, S18), which Neuron leaves to the host
    sampler as plain decoding does.

    Full tier: tests/tools/dev/graphcheck/test_serving_buckets.py::test_dspark_regions_programs_pass_at_serving_batch_size
    covers the regions mode's speculative programs against the rules (speculative_programs in the regions mode: the
    draft and finish programs, the region programs of the verify and prefill steps) in the default run, and
    tests/tools/dev/test_programs.py::test_check_graph_walks_the_speculative_engines_program_inventory[mtp-regions]
    lowers MTP's regions-mode programs (draft, each verify region, finish) by name."""
    from jdeep.tools.dev.programs import speculative_programs

    name = "v4-flash"
    config = preset(name)
    target = Target.for_config(config, ml_dtypes.bfloat16, mode, fp8_max=240.0, packed_params=mode == "scan",
                               platform="neuron")
    failures = []
    programs = speculative_programs(target, (64,), 3, (16,), 1024)
    names = {p.name for p in programs}
    if mode == "scan":
        assert len(programs) == 4
    else:
        assert {f"b64.spec3.decode.{v}.{part}" for part in ("draft", "finish") for v in ("greedy", "sampled")} <= names
        assert {"b64.spec.prefill16.greedy.head", "b64.spec.prefill16.greedy.tail",
                "b64.spec3.decode.greedy.verify.head"} <= names
    for prog in programs:
        prng = {"S10", "S13", "S18"} if ".sampled" in prog.name else set()
        rules = set(RULES) - _skipped(name, mode, prog.bucket) - prng
        report = check_lowered(prog.lower(), name=prog.name, n_experts=config.n_routed_experts,
                               decode=prog.bucket["step"] == "decode", rules=rules)
        failures += [] if report.ok else [report.format()]
    assert not failures, "\n".join(failures)


@pytest.mark.full
@pytest.mark.parametrize("name", ["v41-dspark-tiny", "v41-flash"])
def test_dspark_programs_pass_at_serving_batch_size(name):
    """DSpark speculative-decoding programs (scan mode, k = 3: the prefill chunk with the taps and the
    window append, the draft block, the verify over 4 positions with the drafts' Engram rows): every rule but
    V4.1-Flash's known scan-mode budgets (S4, S19) and, for the sampled variants, the threefry rules. The golden's
    config (Engram, DSpark block 5); V4.1-Flash's own takes 90 s of lowering.

    Full tier: tests/tools/dev/test_programs.py::test_check_graph_walks_the_speculative_engines_program_inventory
    [v41-dspark-tiny-scan] covers the DSpark scan-mode programs (speculative_programs on the same golden config:
    the prefill chunk with the taps, the draft block, the verify with the drafts' Engram rows) in the default run;
    the rules on DSpark's programs run in ::test_dspark_regions_programs_pass_at_serving_batch_size (regions) and on
    the scan mode's speculative programs in ::test_speculative_programs_pass_at_serving_batch_sizes[scan] (MTP)."""
    from jdeep.config import ModelConfig
    from jdeep.tools.dev.programs import speculative_programs

    config = preset(name) if name == "v41-flash" else ModelConfig.from_file(golden_path(name) / "config.json")
    target = Target.for_config(config, ml_dtypes.bfloat16, "scan", fp8_max=240.0, packed_params=True,
                               platform="neuron")
    B = 64 if name == "v41-flash" else 8      # the golden's: 8 x 4 tokens x top-k above its expert count too
    assert B * 4 * config.n_activated_experts > config.n_routed_experts
    programs = speculative_programs(target, (B,), 3, (16,), 1024)
    assert sorted(p.name for p in programs) == sorted(
        [f"b{B}.spec.prefill16.{v}" for v in ("greedy", "sampled")] +
        [f"b{B}.spec3.decode.{v}.{part}" for part in ("draft", "verify") for v in ("greedy", "sampled")])
    failures = []
    for prog in programs:
        prng = {"S10", "S13", "S18"} if ".sampled" in prog.name else set()
        rules = set(RULES) - _skipped(name, "scan", prog.bucket) - prng
        report = check_lowered(prog.lower(), name=prog.name, n_experts=config.n_routed_experts,
                               decode=prog.bucket["step"] == "decode", rules=rules)
        failures += [] if report.ok else [report.format()]
    assert not failures, "\n".join(failures)


def test_dspark_regions_programs_pass_at_serving_batch_size():
    """DSpark's programs in the regions compile mode (the golden's config, k = 3: its ratio-2 ring splits the verify
    into two target steps of 2 positions): the region programs of the prefill and verify steps with the taps, the
    prefill tail, the draft, the verified chunks, the undo-log save and the finish pass every rule (the sampled
    variants every rule but the threefry ones)."""
    from jdeep.config import ModelConfig
    from jdeep.tools.dev.programs import speculative_programs

    name = "v41-dspark-tiny"
    config = ModelConfig.from_file(golden_path(name) / "config.json")
    target = Target.for_config(config, ml_dtypes.bfloat16, "regions", fp8_max=240.0, packed_params=False,
                               platform="neuron")
    programs = speculative_programs(target, (8,), 3, (16,), 1024)
    names = {p.name for p in programs}
    assert {f"b8.spec3.decode.{v}.{part}" for part in ("draft", "finish", "chunks", "save2", "verify2.head.taps")
            for v in ("greedy", "sampled")} | {"b8.spec.prefill16.greedy.tail", "b8.spec.prefill16.greedy.head.taps"} <= names
    assert any(n.startswith("b8.spec3.decode.greedy.verify2.attn.") and n.endswith(".tap") for n in names)
    failures = []
    for prog in programs:
        prng = {"S10", "S13", "S18"} if ".sampled" in prog.name else set()
        report = check_lowered(prog.lower(), name=prog.name, n_experts=config.n_routed_experts,
                               decode=prog.bucket["step"] == "decode", rules=set(RULES) - prng)
        failures += [] if report.ok else [report.format()]
    assert not failures, "\n".join(failures)
