"""The full tier's map, read from the test sources: each test (or parameter, or fixture parameter) marked
`pytest.mark.full` and the default-run tests its docstring names as covering its code path.

    python scripts/suite_tiers.py            # the map as a markdown table (docs/testing.md holds a copy)
    python scripts/suite_tiers.py --check    # exit 1, naming each problem, when a full-tier test names no covering
                                             # test, or names one that does not exist or is itself in the full tier

The rule (docs/testing.md): a test leaves the default run only when a default-run test covers the same code path,
and its docstring ends with `Full tier: tests/<file>::<test> covers <the path> in the default run.` (or
`Full tier (the [x] case): ...` when only some parameters are in the full tier). Pure source reading: nothing is
imported or compiled. tests/tools/test_suite_tiers.py runs the check in the default run."""

from __future__ import annotations

import argparse
import ast
import pathlib
import re
import sys
from typing import NamedTuple

REPO = pathlib.Path(__file__).resolve().parents[1]
FULL_TIER = re.compile(r"Full tier( \([^)]*\))?:")           # "Full tier:" or "Full tier (the [x] case):"
CITATION = re.compile(r"((?:tests/)?[\w/]+\.py)::(\w+)(\[[^\]\s]*\])?")


class TierEntry(NamedTuple):
    """One function of a test file: a test, or a fixture with a parameter in the full tier."""
    node: ast.FunctionDef
    whole: bool        # the whole test is in the full tier (its decorator, or the module's pytestmark)
    param: bool        # some parameter is (pytest.param(..., marks=pytest.mark.full))


def _is_full_mark(node: ast.AST) -> bool:
    """`pytest.mark.full` or `pytest.mark.full(...)`."""
    if isinstance(node, ast.Call):
        node = node.func
    return isinstance(node, ast.Attribute) and ast.unparse(node) == "pytest.mark.full"


def _marks_a_param(decorator: ast.AST) -> bool:
    """A decorator holding some `pytest.param(..., marks=pytest.mark.full)` (parametrize, or a fixture's params)."""
    return any(isinstance(n, ast.Call) and ast.unparse(n.func) == "pytest.param"
               and any(k.arg == "marks" and any(_is_full_mark(m) for m in ast.walk(k.value)) for k in n.keywords)
               for n in ast.walk(decorator))


def entries_of(source: str) -> dict[str, TierEntry]:
    """name -> TierEntry for a test file's test functions and its fixtures with a full-tier parameter."""
    tree = ast.parse(source)
    module_full = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                      and any(_is_full_mark(m) for m in ast.walk(n.value)) for n in tree.body)
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            is_test = node.name.startswith("test_")
            param = any(_marks_a_param(d) for d in node.decorator_list)
            if is_test or param:
                whole = is_test and (module_full or any(_is_full_mark(d) for d in node.decorator_list))
                out[node.name] = TierEntry(node, whole, param)
    return out


def test_files(tests: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in tests.rglob("test_*.py") if "nki_emulation" not in p.parts)


def _resolve(cited: str, citing: pathlib.Path, repo: pathlib.Path) -> pathlib.Path | None:
    for candidate in (repo / cited, repo / "tests" / cited, citing.parent / cited):
        if candidate.is_file():
            return candidate
    return None


def tier_map(repo: pathlib.Path = REPO) -> tuple[list[tuple[str, str, list[str]]], list[str]]:
    """([(full-tier test, what is in the full tier, [covering tests])], [problems])."""
    tables = {path: entries_of(path.read_text()) for path in test_files(repo / "tests")}
    rows, problems = [], []
    for path, entries in tables.items():
        for name, entry in entries.items():
            if not (entry.whole or entry.param):
                continue
            where = f"{path.relative_to(repo)}::{name}"
            doc = ast.get_docstring(entry.node) or ""
            start = FULL_TIER.search(doc)
            if start is None:
                problems.append(f"{where}: no 'Full tier: tests/<file>::<test> covers ...' paragraph in its docstring")
                continue
            cited = []
            for cited_file, cited_name, cited_param in CITATION.findall(doc[start.start():]):
                target = _resolve(cited_file, path, repo)
                if target is None or cited_name not in tables.get(target, {}):
                    problems.append(f"{where}: cites {cited_file}::{cited_name}, which does not exist")
                elif tables[target][cited_name].whole:
                    problems.append(f"{where}: cites {cited_file}::{cited_name}, which is itself in the full tier")
                else:
                    cited.append(f"{target.relative_to(repo)}::{cited_name}{cited_param}")
            if not cited and not any(p.startswith(where) for p in problems):
                problems.append(f"{where}: its 'Full tier:' paragraph names no tests/<file>::<test>")
            what = "the whole test" if entry.whole else (start.group(1) or " (some parameters)").strip(" ()")
            rows.append((where, what, cited))
    return rows, problems


def markdown(rows: list[tuple[str, str, list[str]]]) -> str:
    lines = ["| full tier | what | covered in the default run by |", "|---|---|---|"]
    for where, what, cited in rows:
        lines.append(f"| {where.removeprefix('tests/')} | {what} | "
                     f"{'<br>'.join(c.removeprefix('tests/') for c in dict.fromkeys(cited))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only check the rule; exit 1 naming each problem")
    args = p.parse_args(argv)
    rows, problems = tier_map()
    if not args.check:
        print(markdown(rows))
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
