"""scripts/suite_report.py: per-file totals from a junit XML report, largest first, with the slowest test of each."""

from __future__ import annotations

from pathlib import Path

from conftest import load_script

REPO = Path(__file__).resolve().parents[2]


def _script():
    return load_script("suite_report")


REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.runtime.test_engine" name="test_a" time="3.5"><properties>
<property name="jax_trace_s" value="0.5"/><property name="jax_lower_s" value="0.25"/>
<property name="jax_compile_s" value="2.0"/><property name="jax_compiles" value="3"/></properties></testcase>
<testcase classname="tests.runtime.test_engine" name="test_b" time="10.0"><skipped message="x"/></testcase>
<testcase classname="tests.serve.test_server.TestThing" name="test_c" time="20.25"><failure message="y"/></testcase>
<testcase classname="tests.test_cli" name="test_d" time="0.25"/>
</testsuite></testsuites>"""


def test_per_file_totals_largest_first(tmp_path, capsys):
    path = tmp_path / "suite.xml"
    path.write_text(REPORT)
    mod = _script()
    assert [c[0] for c in mod.read_cases(str(path))] == ["tests/runtime/test_engine.py"] * 2 + [
        "tests/serve/test_server.py", "tests/test_cli.py"]
    assert mod.main([str(path), "--tests", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[0] == "20.2" and "tests/serve/test_server.py (test_c: 20.2 s)" in lines[1]
    assert lines[2].split()[:5] == ["13.5", "39.7%", "2", "2.8", "3"] and "(test_b: 10.0 s)" in lines[2]
    assert lines[1].split()[3:5] == ["-", "-"]         # a file whose cases carry no JAX properties
    assert lines[4].split()[0] == "34.0" and "1 failure, 2 passed, 1 skipped" in lines[4]
    assert [ln.split() for ln in lines[-2:]] == [["20.2", "-", "-", "tests/serve/test_server.py::test_c"],
                                                 ["10.0", "-", "-", "tests/runtime/test_engine.py::test_b"]]


def test_reports_without_jax_properties_show_dashes(tmp_path, capsys):
    path = tmp_path / "suite.xml"
    path.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="t" time="1.0"/></testsuite>'
                    '</testsuites>')
    assert _script().main([str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:5] == ["1.0", "100.0%", "1", "-", "-"]


def test_unreadable_or_empty_report(tmp_path, capsys):
    mod = _script()
    assert mod.main([str(tmp_path / "missing.xml")]) == 2
    empty = tmp_path / "empty.xml"
    empty.write_text("<testsuites/>")
    assert mod.main([str(empty)]) == 2
    assert "holds no test cases" in capsys.readouterr().err
