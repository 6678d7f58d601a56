"""Where the test suite's time went, per file, from a junit XML report (no timing in the tests themselves).

    python -m pytest -q --junitxml=/tmp/suite.xml            # the README's test command, with a report
    python scripts/suite_report.py /tmp/suite.xml [--top 30] [--tests 10]

Prints each test file's total seconds (setup + call + teardown of its tests, as pytest's junit report counts them),
its number of tests and its slowest test, largest first, and the suite's sum. With 2 xdist workers the wall clock
is about half the sum. The slowest single tests follow (--tests N). docs/testing.md says what the budget is.

Where the report carries them (tests/conftest.py records them for every test), two more columns split the time:
`jax s`, the seconds JAX spent tracing, lowering and compiling in the test process (XLA:CPU compiles in the
subprocesses some tests start are not in it), and `compiles`, the number of XLA compiles (reads from the
persistent compilation cache are not compiles).
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def file_of(case: ET.Element) -> str:
    """The test file of a junit <testcase> (its `file` attribute, else its dotted classname)."""
    if case.get("file"):
        return case.get("file")
    parts = (case.get("classname") or "?").split(".")
    while parts and parts[-1][:1].isupper():      # a test class: Test...
        parts.pop()
    return "/".join(parts) + ".py"


JAX_SECONDS = ("jax_trace_s", "jax_lower_s", "jax_compile_s")


def read_cases(path: str) -> list[tuple[str, str, float, str, dict[str, float]]]:
    """(file, test name, seconds, outcome, {junit property: number}) of every test case in the report."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, props = "passed", {}
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
            for prop in child.iter("property"):
                try:
                    props[prop.get("name")] = float(prop.get("value"))
                except (TypeError, ValueError):
                    pass
        out.append((file_of(case), case.get("name", "?"), float(case.get("time") or 0.0), outcome, props))
    return out


def _jax_columns(props: list[dict[str, float]]) -> str:
    """`jax s` and `compiles` of some cases, or dashes where the report has no JAX properties."""
    if not any("jax_compiles" in p for p in props):
        return f"{'-':>7} {'-':>8}"
    seconds = sum(p.get(k, 0.0) for p in props for k in JAX_SECONDS)
    return f"{seconds:7.1f} {int(sum(p.get('jax_compiles', 0) for p in props)):8d}"


def report(cases: list[tuple[str, str, float, str, dict[str, float]]], top: int, tests: int) -> str:
    per_file: dict[str, list[tuple[str, float, dict[str, float]]]] = defaultdict(list)
    for f, name, secs, _, props in cases:
        per_file[f].append((name, secs, props))
    rows = sorted(per_file.items(), key=lambda kv: -sum(s for _, s, _ in kv[1]))
    total = sum(c[2] for c in cases)
    lines = [f"{'seconds':>8} {'share':>6} {'tests':>5} {'jax s':>7} {'compiles':>8}  file (slowest test)"]
    for f, items in rows[:top]:
        secs = sum(s for _, s, _ in items)
        name, slowest, _ = max(items, key=lambda x: x[1])
        lines.append(f"{secs:8.1f} {100 * secs / max(total, 1e-9):5.1f}% {len(items):5d} "
                     f"{_jax_columns([p for *_, p in items])}  {f} ({name}: {slowest:.1f} s)")
    if len(rows) > top:
        rest = [item for _, items in rows[top:] for item in items]
        lines.append(f"{sum(s for _, s, _ in rest):8.1f}        {len(rest):5d} {_jax_columns([p for *_, p in rest])}  "
                     f"... {len(rows) - top} more files")
    outcomes = defaultdict(int)
    for c in cases:
        outcomes[c[3]] += 1
    lines.append(f"{total:8.1f} 100.0% {len(cases):5d} {_jax_columns([c[4] for c in cases])}  in all "
                 f"({', '.join(f'{n} {o}' for o, n in sorted(outcomes.items()))}; "
                 f"sum over workers: the wall clock with 2 workers is about half)")
    if tests:
        lines.append("")
        lines.append(f"slowest {tests} tests:")
        for f, name, secs, _, props in sorted(cases, key=lambda c: -c[2])[:tests]:
            lines.append(f"{secs:8.1f} {_jax_columns([props])}  {f}::{name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("junit_xml", help="pytest's --junitxml report")
    p.add_argument("--top", type=int, default=30, help="files to list (default 30)")
    p.add_argument("--tests", type=int, default=10, help="slowest single tests to list (default 10; 0: none)")
    args = p.parse_args(argv)
    try:
        cases = read_cases(args.junit_xml)
    except (OSError, ET.ParseError) as e:
        print(f"suite_report: cannot read {args.junit_xml}: {e}", file=sys.stderr)
        return 2
    if not cases:
        print(f"suite_report: {args.junit_xml} holds no test cases", file=sys.stderr)
        return 2
    print(report(cases, args.top, args.tests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
