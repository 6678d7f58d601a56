"""The doctor's compiler driver: crash rates over repeated compiles, error codes, artefacts, timeouts; the
neuronx-cc wrapper's conversion and command line; XLA:CPU as the stand-in compiler."""

from __future__ import annotations

import os
import pathlib
import stat
import sys

import jax
import jax.numpy as jnp
import numpy as np

from fake_compiler import draw
from jdeep.tools.dev.doctor import neuron_cc
from jdeep.tools.dev.doctor.compiler import Compiler, error_code

FAKE = str(pathlib.Path(__file__).with_name("fake_compiler.py"))


def _text(op=jnp.sin):
    return jax.jit(lambda x: op(x) * 2).lower(jax.ShapeDtypeStruct((4, 4), jnp.float32)).as_text()


def test_crash_rate_is_measured_over_repeated_compiles(tmp_path):
    seed, n = 7, 40
    compiler = Compiler([sys.executable, FAKE, "--fail-on", r"stablehlo\.sine", "--rate", "0.3", "--seed", str(seed),
                         "--counter", str(tmp_path / "count"), "--code", "NCC_IINL902"])
    result = compiler.compile_repeated("p", _text(), n, str(tmp_path))
    expected = sum(draw(seed, k) < 0.3 for k in range(n))
    assert 0 < expected < n and result.failures == expected and result.passes == n - expected
    assert result.crash_rate == expected / n and result.error_codes == {"NCC_IINL902": expected}
    js = result.to_json()
    assert len(js["attempts"]) == n and js["max_artifact_bytes"] == len(_text())   # the .neff the fake writes
    failed = next(a for a in result.attempts if not a.ok)
    assert failed.returncode == 1 and any("NCC_IINL902" in line for line in failed.log_head)
    ok = next(a for a in result.attempts if a.ok)
    assert ok.error_code is None and ok.log_head == []


def test_a_program_without_the_pattern_always_compiles(tmp_path):
    compiler = Compiler([sys.executable, FAKE, "--fail-on", r"stablehlo\.sine"])
    result = compiler.compile_repeated("p", _text(jnp.cos), 3, str(tmp_path))
    assert result.passes == 3 and result.crash_rate == 0.0 and not compiler.fails(_text(jnp.cos), str(tmp_path))
    assert compiler.fails(_text(), str(tmp_path), "NCC_IINL902")
    assert not compiler.fails(_text(), str(tmp_path), "NCC_OTHR001")        # another failure is another bug


def test_error_codes():
    assert error_code(0, "NCC_IINL902 mentioned but exit 0") is None
    assert error_code(1, "[NCC_EVRF059] bad file; later NCC_IINL902") == "NCC_EVRF059"
    assert error_code(None, "") == "timeout" and error_code(-11, "") == "signal 11" and error_code(3, "x") == "exit 3"


def test_timeout_and_missing_command(tmp_path):
    hang = Compiler([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=1)
    a = hang.compile(_text(), str(tmp_path))
    assert not a.ok and a.error_code == "timeout" and a.returncode is None
    missing = Compiler([str(tmp_path / "no-such-compiler")]).compile(_text(), str(tmp_path))
    assert not missing.ok and missing.returncode == 127 and "cannot run" in missing.log_head[0]


def test_relative_script_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(pathlib.Path(FAKE).parent)
    c = Compiler.from_string(f"{sys.executable} ./fake_compiler.py --fail-on stablehlo.sine", "cpu")
    assert c.argv[1] == FAKE and c.compile(_text(jnp.cos), str(tmp_path)).ok


def test_xla_cpu_stands_in_for_the_device(tmp_path):
    c = Compiler.default("cpu")
    good = c.compile(_text(), str(tmp_path))
    assert good.ok and good.artifact_bytes > 0
    bad = c.compile("module { func.func @main() { %0 = stablehlo.no_such_op } }", str(tmp_path))
    assert not bad.ok and bad.error_code == "exit 1" and any("no_such_op" in ln for ln in bad.log_head)


def test_neuron_wrapper_converts_and_calls_neuronx_cc(tmp_path, monkeypatch):
    proto = neuron_cc.hlo_proto(_text())
    assert isinstance(proto, bytes) and len(proto) > 100
    argv = neuron_cc.compiler_argv("/x/p.hlo.pb", "trn2", 2, "--model-type transformer --cache_dir=/c")
    assert argv[:7] == ["neuronx-cc", "compile", "/x/p.hlo.pb", "--framework", "XLA", "--target", "trn2"]
    assert argv[argv.index("--logical-nc-config") + 1] == "2" and argv[-2:] == ["--output", "/x/p.neff"]
    assert "--model-type" in argv and not any(a.startswith("--cache_dir") for a in argv)
    assert any(a.startswith("--internal-hlo2tensorizer-options") for a in argv)      # jdeep's fp8 flag (trn2)
    trn3 = neuron_cc.compiler_argv("/x/p.hlo.pb", "trn3", 2, "")
    assert not any(a.startswith("--internal-hlo2tensorizer-options") for a in trn3)
    assert "--logical-nc-config" not in neuron_cc.compiler_argv("/x/p.hlo.pb", "trn1", 1, "")
    # the wrapper end to end, with a stand-in executable that records its arguments and fails like neuronx-cc
    fake = tmp_path / "neuronx-cc"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\necho 'ERROR [NCC_IINL902] crash' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    c = Compiler([sys.executable, "-m", "jdeep.tools.dev.doctor.neuron_cc", "--target", "trn2", "--neuronx-cc", str(fake)])
    a = c.compile(_text(), str(tmp_path))
    assert not a.ok and a.error_code == "NCC_IINL902"
    args = (tmp_path / "args").read_text().split()
    assert args[0] == "compile" and args[1].endswith(".hlo.pb") and args[args.index("--logical-nc-config") + 1] == "2"
    assert os.path.basename(args[-1]) == "program.neff" and np.isfinite(a.seconds)
