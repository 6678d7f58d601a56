"""The planner's collective volume (`jdeep.tools.dev.collectives`, `jdeep info --mesh ... --collectives`).

Programs on a mesh need that many devices, which JAX fixes at import: one subprocess with 8 CPU devices
(tests/tools/dev/collectives_worker.py) compiles the oracle programs and the golden model's steps on the 8-device
test meshes and runs the planner there; the tests here read what it wrote. The default run's worker (`worker`) measures
one mesh (MESH, tensor and expert axes both split); the full tier's (`worker_full`) the other two meshes and a model
with repeated layers. Expectations come from shapes by
arithmetic, and the golden steps are counted by this file's own flattening of the HLO, independent of the planner's
parser."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
from conftest import GOLDEN_DIR, REPO, golden_path

from jdeep.cli import main
from jdeep.config import ModelConfig
from jdeep.tools.dev.collectives import KINDS, Volume, collectives_table, hlo_collectives, link_bytes, result_from_json

F32 = 4


MESH = "tensor=2,expert=4"          # the default run's mesh


def _run_worker(tmp_path_factory, runs: list[str]):
    golden_path("v4-tiny-hf")      # skips without the golden folder
    out = tmp_path_factory.mktemp("collectives")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "tools" / "dev" / "collectives_worker.py"), str(out),
                           str(GOLDEN_DIR), *runs], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((out / "result.json").read_text())
    return out, result


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """The oracles and the golden on MESH."""
    return _run_worker(tmp_path_factory, [MESH])


@pytest.fixture(scope="module")
def worker_full(tmp_path_factory):
    """The oracles, the golden on the other two test meshes and the repeated-layer model ("deep")."""
    return _run_worker(tmp_path_factory, ["expert=8", "data=2,expert=4", "deep"])


def _hlo(worker, name: str) -> str:
    return (worker[0] / f"{name}.hlo").read_text()


def _expect(volumes: dict, kind: str, count: int, payload: float, group: int) -> None:
    v = volumes[kind]
    assert (v.count, v.payload) == (count, payload), (kind, v)
    assert v.link == pytest.approx(link_bytes(kind, payload, group), rel=1e-12), (kind, v)


# ------------------------------------------------------------------------------------- first-principles oracles
def test_link_bytes_follow_the_ring_and_pairwise_algorithms():
    assert link_bytes("all-reduce", 800, 4) == 2 * 3 / 4 * 800
    assert link_bytes("all-gather", 800, 4) == 3 * 800             # (n-1)/n of the n x 800 output
    assert link_bytes("reduce-scatter", 800, 4) == 3 / 4 * 800
    assert link_bytes("all-to-all", 800, 8) == 7 / 8 * 800
    assert link_bytes("collective-permute", 800, 4) == 800
    assert link_bytes("all-reduce", 800, 1) == 0


def test_collectives_in_one_scan(worker):
    o = worker[1]["oracle"]
    block, steps = o["rows"] * o["cols"] * F32, o["flat_steps"]
    got = hlo_collectives(_hlo(worker, "oracle-flat"))
    assert got["unknown_trips"] == 0
    # psum over b and the tuple psum over a ((c, c[:2]): every element counted) are two all-reduces per step
    tuple_payload = (o["rows"] + 2) * o["cols"] * F32
    assert got["all-reduce"].count == 2 * steps
    assert got["all-reduce"].payload == steps * (block + tuple_payload)
    assert got["all-reduce"].link == pytest.approx(
        steps * (link_bytes("all-reduce", block, o["b"]) + link_bytes("all-reduce", tuple_payload, o["a"])))
    _expect(got, "all-gather", steps, steps * block, o["b"])                    # operand: the local block
    _expect(got, "reduce-scatter", steps, steps * o["b"] * block, o["b"])       # operand: the gathered input
    _expect(got, "all-to-all", steps, steps * block, o["b"])
    _expect(got, "collective-permute", steps, steps * block, o["b"])


def test_nested_scans_multiply(worker):
    o = worker[1]["oracle"]
    block = o["rows"] * o["cols"] * F32
    got = hlo_collectives(_hlo(worker, "oracle-nested"))
    inner = o["outer_steps"] * o["inner_steps"]
    # inner psum over b, outer x inner times; the final scalar psum over all 8 devices once
    assert got["all-reduce"].count == inner + 1
    assert got["all-reduce"].payload == inner * block + F32
    assert got["all-reduce"].link == pytest.approx(
        inner * link_bytes("all-reduce", block, o["b"]) + link_bytes("all-reduce", F32, o["a"] * o["b"]))
    _expect(got, "all-gather", o["outer_steps"], o["outer_steps"] * block, o["a"])
    assert all(got[k].count == 0 for k in ("reduce-scatter", "all-to-all", "collective-permute"))


# hand-written HLO for the forms the CPU backend does not emit here: async -start/-done pairs, the iota and mesh
# replica groups, conditionals (the larger branch counts), a while without a known trip count
_HANDWRITTEN = """HloModule m, num_partitions=16

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%small (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups=[4,4]<=[16], to_apply=%add
}

%big (q: f32[8]) -> f32[8] {
  %q = f32[8]{0} parameter(0)
  %g = f32[16,8]{1,0} all-gather(%q), replica_groups=[8,2]<=[2,8]T(1,0), dimensions={0}
  ROOT %r = f32[8]{0} slice(%g), slice={[0:1], [0:8]}
}

%body (t: (s32[], bf16[64,32])) -> (s32[], bf16[64,32]) {
  %t = (s32[], bf16[64,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = bf16[64,32]{1,0} get-tuple-element(%t), index=1
  %st = (bf16[64,32]{1,0}, bf16[256,32]{1,0}) all-gather-start(%x), replica_groups=mesh['x'=2,'y'=4] {'y'}
  %dn = bf16[256,32]{1,0} all-gather-done(%st)
  %y = bf16[64,32]{1,0} slice(%dn), slice={[0:64], [0:32]}
  ROOT %o = (s32[], bf16[64,32]{1,0}) tuple(%i, %y)
}

%cond (t: (s32[], bf16[64,32])) -> pred[] {
  %t = (s32[], bf16[64,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: bf16[64,32], v: f32[8], k: s32[]) -> f32[8] {
  %x = bf16[64,32]{1,0} parameter(0)
  %v = f32[8]{0} parameter(1)
  %k = s32[] parameter(2)
  %z = s32[] constant(0)
  %t0 = (s32[], bf16[64,32]{1,0}) tuple(%z, %x)
  %w = (s32[], bf16[64,32]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
  %w2 = (s32[], bf16[64,32]{1,0}) while(%t0), condition=%cond, body=%body
  %cp = f32[8]{0} collective-permute-start(%v), source_target_pairs={{0,1},{1,0}}
  %cd = f32[8]{0} collective-permute-done(%cp)
  ROOT %c = f32[8]{0} conditional(%k, %cd, %cd), branch_computations={%small, %big}
}
"""


def test_async_pairs_group_forms_conditionals_and_unknown_trips():
    got = hlo_collectives(_HANDWRITTEN)
    x = 64 * 32 * 2                                   # bf16 operand of the async all-gather
    # 7 trips plus one while without a trip count (counted once, reported); -done not counted again
    _expect(got, "all-gather", 8, 8 * x, 4)           # mesh form: 'y' spans 4 devices
    assert got["unknown_trips"] == 1
    _expect(got, "collective-permute", 1, 8 * F32, 2)
    # branches: all-reduce of 32 B over 4 (48 link bytes) vs all-gather of 32 B over 2 (32): the first counts
    _expect(got, "all-reduce", 1, 8 * F32, 4)
    assert link_bytes("all-reduce", 32, 4) > link_bytes("all-gather", 32, 2)


# --------------------------------------------------------- the criterion: the 8-device test meshes
_KIND = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                   r"(-start|-done)?\(")


def _bytes(shape: str) -> int:
    sizes = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1, "s64": 8, "f64": 8}
    return sum(sizes[t] * math.prod(int(d) for d in dims.split(",") if d)
               for t, dims in re.findall(r"([a-z]\w*)\[([\d,]*)\]", shape))


def _group(line: str, devices: int) -> int:
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", line):
        return len(m.group(1).split(","))
    if m := re.search(r"replica_groups=\[\d+,(\d+)\]<=", line):
        return int(m.group(1))
    if m := re.search(r"replica_groups=mesh\[(.*?)\] \{(.*?)\}", line):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
    return devices


def _count(text: str) -> dict[str, list]:
    """[count, payload, link] per kind, by flattening: computations appear callees first, so walking them from
    the ENTRY (last) backwards every caller's multiplicity is known before its callees'. A while body runs its
    known_trip_count times per run of the while, anything else called runs once per call. The payload from the
    result shape: an all-gather's result is n operands, a reduce-scatter's 1/n of its operand."""
    blocks = re.split(r"\n(?=(?:ENTRY )?%[\w.\-]+ \()", text)
    comps = {re.match(r"(?:ENTRY )?%([\w.\-]+)", b).group(1): b for b in blocks[1:]}
    names = list(comps)
    assert blocks[-1].startswith("ENTRY")
    times = {n: 0 for n in names}
    times[names[-1]] = 1
    out = {k: [0, 0, 0.0] for k in KINDS}
    for name in reversed(names):
        for line in comps[name].splitlines():
            assert " conditional(" not in line and "-start(" not in line     # not in these CPU programs
            trips = int(re.search(r'"known_trip_count":\{"n":"(\d+)"', line).group(1)) if " while(" in line else 1
            for role, callee in re.findall(r"\b(body|condition|to_apply|calls)=%([\w.\-]+)", line):
                times[callee] += times[name] * (trips + (role == "condition") if " while(" in line else 1)
            m = _KIND.search(line)
            if m and times[name]:
                shape, kind = m.group(1), m.group(2)
                n = _group(line, 8)
                payload = _bytes(shape) * (n if kind == "reduce-scatter" else 1) // (n if kind == "all-gather" else 1)
                link = {"all-reduce": 2 * (n - 1) / n * payload, "all-gather": (n - 1) * payload,
                        "collective-permute": payload}.get(kind, (n - 1) / n * payload)
                for i, v in enumerate((1, payload, link)):
                    out[kind][i] += times[name] * v
    return out


def _check_against_own_count(worker, name: str) -> int:
    """Assert the planner's volumes of `name` equal this file's count of the loaded model's steps; return how many
    collective runs came from loop trips (runs beyond one per op in the text)."""
    planned = worker[1]["meshes"][name]
    looped = 0
    for step in ("decode", "prefill"):
        text = _hlo(worker, f"{name}-{step}")
        want = _count(text)
        assert planned[step]["unknown_trips"] == 0
        for kind in KINDS:
            got = planned[step][kind]
            assert (got["count"], got["payload"]) == tuple(want[kind][:2]), (step, kind, got, want[kind])
            assert got["link"] == pytest.approx(want[kind][2], rel=1e-12), (step, kind)
        assert sum(want[k][0] for k in KINDS) > 0, "a sharded step runs collectives"
        looped += sum(want[k][0] for k in KINDS) - len(_KIND.findall(text))
    return looped


@pytest.mark.parametrize("mesh", [pytest.param("expert=8", marks=pytest.mark.full), MESH,
                                  pytest.param("data=2,expert=4", marks=pytest.mark.full)])
def test_planner_matches_the_loaded_models_compiled_steps(request, mesh):
    """The planner (abstract arguments, no weights) measures exactly what a count of the steps jdeep.load(...,
    mesh=) compiles for the golden checkpoint finds (its four layers are four kinds: no layer scan repeats).

    Full tier: tests/tools/dev/test_collectives.py::test_planner_matches_the_loaded_models_compiled_steps
    [tensor=2,expert=4] covers the planner against the compiled steps (step_collectives vs this file's HLO count,
    with both the tensor and the expert axis split) in the default run; the other meshes run the same planner and
    count on other axis splits."""
    _check_against_own_count(request.getfixturevalue("worker" if mesh == MESH else "worker_full"), mesh)


@pytest.mark.full
def test_planner_counts_collectives_of_repeated_layers(worker_full):
    """A model whose layer pairs repeat (a scan segment of several reps) on tensor=2,expert=4: the MoE's and the
    partitioner's collectives inside the layer scan run once per layer.

    Full tier: tests/tools/dev/test_collectives.py::test_collectives_in_one_scan and ::test_nested_scans_multiply
    cover the planner's count of collectives inside a scan (hlo_collectives multiplying by the while loop's known
    trip count) in the default run, and ::test_planner_matches_the_loaded_models_compiled_steps[tensor=2,expert=4]
    the golden's sharded steps on the same mesh."""
    assert _check_against_own_count(worker_full, "deep") > 0


def test_decode_gathers_logits_not_the_head(worker):
    """The head is stored split by vocabulary over `tensor`: a decode step computes each device's logit columns and
    gathers those (B x V), not the head's weights (d x V in fp32, 1.5 GB per device per step on V4-Flash before
    sharding.Layout.constrain_logits)."""
    cfg = ModelConfig.from_file(golden_path("v4-tiny-hf") / "config.json")
    gathered = worker[1]["meshes"]["tensor=2,expert=4"]["decode"]["all-gather"]["payload"]
    assert gathered < cfg.dim * (cfg.vocab_size // 2) * 4


# ------------------------------------------------------------------------------------------------------ CLI
def test_table_rows_are_the_volumes_in_its_units():
    mib = 2**20
    vols = {k: Volume() for k in KINDS}
    vols["all-reduce"] = Volume(3, 3 * mib, 4.5 * mib)
    vols["all-gather"] = Volume(2, 1 * mib, 7 * mib)
    result = {"decode": vols, "prefill": {k: Volume() for k in KINDS}, "compile_s": 1.0}
    lines = collectives_table(result, 50).splitlines()
    assert "50 GB/s" in lines[0] and lines[1].split()[-5:] == ["payload", "MiB", "link", "MiB", "ms"]
    rows = {ln.split()[-5]: ln.split()[-4:] for ln in lines[2:]}
    for kind, runs, payload, link in (("all-reduce", 3, 3, 4.5), ("all-gather", 2, 1, 7), ("total", 5, 4, 11.5)):
        ms = link * mib / 50e9 * 1e3
        assert rows[kind] == [str(runs), f"{payload:.3f}", f"{link:.3f}", f"{ms:.3f}"], kind
    assert rows["none"] == ["0", "0.000", "0.000", "0.000"]          # a step without collectives
    small = {**result, "decode": {**vols, "all-reduce": Volume(1, 2048, 3072), "all-gather": Volume()}}
    lines = collectives_table(small, 50).splitlines()
    assert lines[1].split()[-5:] == ["payload", "KiB", "link", "KiB", "us"]
    assert lines[2].split()[-4:] == ["1", "2.000", "3.000", f"{3072 / 50e3:.3f}"]


def test_cli_prints_the_collectives_table(worker, capsys):
    """`jdeep info --mesh tensor=2,expert=4` from this one-device process: measured in an 8-device subprocess, the
    table of what the worker's planner run measured for the same steps."""
    step = worker[1]["step"]
    assert main(["info", "--model", str(golden_path("v4-tiny-hf")), "--mesh", MESH, "--link-gbps", "50",
                 "--batch", str(step["batch"]), "--max-len", str(step["max_len"]),
                 "--prefill-len", str(step["prefill_len"])]) == 0
    out = capsys.readouterr().out.rstrip().splitlines()
    head = next(i for i, ln in enumerate(out) if ln.startswith("collectives "))
    assert any(ln.startswith("total/device") for ln in out[:head])          # after the memory lines
    planned = result_from_json({s: v for s, v in worker[1]["meshes"][MESH].items()})
    assert out[head + 1:] == collectives_table(planned, 50).splitlines()[1:]
    assert "time = link bytes / 50 GB/s" in out[head]


@pytest.mark.parametrize("argv, message", [
    (["--link-gbps", "50"], "--link-gbps only apply with --mesh"),
    (["--collectives"], "--collectives only apply with --mesh"),
    (["--mesh", "data=1", "--link-gbps", "0"], "--link-gbps must be a positive number"),
    (["--mesh", "data=1", "--prefill-len", "0"], "--prefill-len must be a positive integer"),
    (["--mesh", "data=1", "--prefill-len", "512", "--max-len", "256"], "longer than --max-len"),
])
def test_cli_rejects_bad_collective_arguments(capsys, argv, message):
    assert main(["info", "--preset", "v4-flash"] + argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""
