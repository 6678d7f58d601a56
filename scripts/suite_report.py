"""Where the test suite's time went, per file, from a junit XML report (no timing in the tests themselves).

    python -m pytest -q --junitxml=/tmp/suite.xml            # the README's test command, with a report
    python scripts/suite_report.py /tmp/suite.xml [--top 30] [--tests 10]

Prints each test file's total seconds (setup + call + teardown of its tests, as pytest's junit report counts them),
its number of tests and its slowest test, largest first, and the suite's sum. With 2 xdist workers the wall clock
is about half the sum. The slowest single tests follow (--tests N). docs/testing.md says what the budget is.
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


def read_cases(path: str) -> list[tuple[str, str, float, str]]:
    """(file, test name, seconds, outcome) of every test case in the report."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        out.append((file_of(case), case.get("name", "?"), float(case.get("time") or 0.0), outcome))
    return out


def report(cases: list[tuple[str, str, float, str]], top: int, tests: int) -> str:
    per_file: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for f, name, secs, _ in cases:
        per_file[f].append((name, secs))
    rows = sorted(per_file.items(), key=lambda kv: -sum(s for _, s in kv[1]))
    total = sum(s for _, _, s, _ in cases)
    lines = [f"{'seconds':>8} {'share':>6} {'tests':>5}  file (slowest test)"]
    for f, items in rows[:top]:
        secs = sum(s for _, s in items)
        name, slowest = max(items, key=lambda x: x[1])
        lines.append(f"{secs:8.1f} {100 * secs / max(total, 1e-9):5.1f}% {len(items):5d}  {f} ({name}: {slowest:.1f} s)")
    if len(rows) > top:
        rest = rows[top:]
        lines.append(f"{sum(s for _, items in rest for _, s in items):8.1f}        {sum(len(i) for _, i in rest):5d}  "
                     f"... {len(rest)} more files")
    outcomes = defaultdict(int)
    for *_, o in cases:
        outcomes[o] += 1
    lines.append(f"{total:8.1f} 100.0% {len(cases):5d}  in all ({', '.join(f'{n} {o}' for o, n in sorted(outcomes.items()))}; "
                 f"sum over workers: the wall clock with 2 workers is about half)")
    if tests:
        lines.append("")
        lines.append(f"slowest {tests} tests:")
        for f, name, secs, _ in sorted(cases, key=lambda c: -c[2])[:tests]:
            lines.append(f"{secs:8.1f}  {f}::{name}")
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
