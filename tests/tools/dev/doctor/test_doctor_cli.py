"""`jdeep doctor` end to end on CPU: a golden checkpoint (programs, compiles with a failing stand-in compiler,
reproducers, numerics, speed) and a released preset (config only)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from conftest import golden_path

from jdeep.cli import main
from jdeep.tools.dev.doctor.run import DoctorOptions

FAKE = str(pathlib.Path(__file__).with_name("fake_compiler.py"))


def test_doctor_on_a_golden_checkpoint(tmp_path):
    out = tmp_path / "report"
    cmd = f"{sys.executable} {FAKE} --fail-on stablehlo\\.sort --code NCC_IINL902"
    assert main(["doctor", "--model", str(golden_path("v4-tiny-hf")), "--out", str(out), "--batch-sizes", "1",
                 "--prefill-len", "16", "--max-len", "64", "--dtype", "float32", "--compiler-cmd", cmd,
                 "--repeat", "2", "--reduce-tries", "1"]) == 0
    report = json.loads((out / "report.json").read_text())
    progs = report["programs"]
    names = [p["name"] for p in progs]
    assert "b1.decode.head" in names and any(".attn." in n for n in names) and any(".ffn." in n for n in names)
    assert all(p["rules"]["ok"] for p in progs)
    failing = [p for p in progs if p["compile"]["failures"]]
    passing = [p for p in progs if not p["compile"]["failures"]]
    assert failing and passing
    for p in failing:                       # every program holding a sort failed twice, and was reduced to it
        assert p["compile"]["error_codes"] == {"NCC_IINL902": 2} and p["compile"]["crash_rate"] == 1.0
        rep = p["reproducer"]
        text = (out / rep["file"]).read_text()
        assert "stablehlo.sort" in text and rep["n_ops"] < 40 and rep["error_code"] == "NCC_IINL902"
        replay = subprocess.run(["sh", str(out / rep["command"])], capture_output=True, text=True, cwd=tmp_path)
        assert replay.returncode == 1 and "NCC_IINL902" in replay.stderr
    for p in passing:
        assert "reproducer" not in p and p["compile"]["max_artifact_bytes"] > 0
    assert report["compiler_check"]["ok"]
    checks = {c["name"]: c for c in report["numerics"]}
    assert checks["golden reference.npz (float)"]["status"] == "pass"
    assert checks["regions vs scan logits"]["status"] == "pass"
    assert checks["NKI kernels vs jnp twins"]["status"] == "skip"           # CPU: nothing to compare
    speed = report["speed"]
    assert speed["dispatch"]["calls_per_decode_step"] > 2 and speed["latency"][0]["itl_ms_p50"] > 0
    assert speed["sampler_transfer"][0]["logits_bytes"] > 0
    md = (out / "report.md").read_text()
    for section in ("## Environment", "## Programs", "## Minimal reproducers", "## Numerics", "## Speed"):
        assert section in md
    assert f"{len(failing)} minimal reproducers" in md


@pytest.mark.full
def test_doctor_on_a_preset_lowers_every_program_without_weights(tmp_path):
    """V4-Flash at its released widths: every regions-mode program of one bucket, the rules, no compile (the
    compile path is the one above; `jdeep doctor --preset v4-flash` with XLA:CPU is measured in docs/neuron.md).

    Full tier: tests/tools/dev/doctor/test_doctor_cli.py::test_a_broken_compiler_is_named_and_nothing_is_reduced
    covers `jdeep doctor --preset v4-flash` (DoctorOptions.preset: the regions-mode programs lowered from the
    config alone, no weights, the report written) and ::test_doctor_on_a_golden_checkpoint doctor's rules stage
    (check_lowered per program, p["rules"]) in the default run; the preset's programs pass the rules at serving
    sizes in tests/tools/dev/graphcheck/test_serving_buckets.py::test_preset_decode_programs_pass_at_serving_batches
    [v4-flash-regions-b256] and ::test_preset_longest_prefill_chunk_passes."""
    out = tmp_path / "flash"
    assert main(["doctor", "--preset", "v4-flash", "--out", str(out), "--batch-sizes", "8", "--prefill-len", "16",
                 "--max-len", "1024", "--skip", "compile"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["numerics"] is None and report["speed"] is None
    assert len(report["programs"]) >= 8 and all(p["rules"]["ok"] for p in report["programs"])
    assert all("compile" not in p for p in report["programs"])


def test_a_broken_compiler_is_named_and_nothing_is_reduced(tmp_path):
    out = tmp_path / "broken"
    assert main(["doctor", "--preset", "v4-flash", "--out", str(out), "--batch-sizes", "1", "--prefill-len", "16",
                 "--compiler-cmd", str(tmp_path / "missing-cc"), "--skip", "rules"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert not report["compiler_check"]["ok"] and report["compiler_check"]["returncode"] == 127
    assert all("compile" not in p and "reproducer" not in p for p in report["programs"])
    assert "The compiler failed on a one-op program" in (out / "report.md").read_text()


def test_options_are_validated():
    with pytest.raises(ValueError, match="either a checkpoint folder"):
        DoctorOptions()
    with pytest.raises(ValueError, match="--skip takes"):
        DoctorOptions(preset="v4-flash", skip=frozenset({"nope"}))
    with pytest.raises(ValueError, match="--repeat"):
        DoctorOptions(preset="v4-flash", repeat=0)
