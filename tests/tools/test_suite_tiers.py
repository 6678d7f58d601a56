"""scripts/suite_tiers.py: the full tier's rule, checked on the test sources. A test leaves the default run
(`pytest.mark.full`, on the function, one of its parameters or a fixture's parameter) only when a default-run test
covers the same code path, and its docstring names it (`Full tier: tests/<file>::<test> covers ...`)."""

from __future__ import annotations

from pathlib import Path

from conftest import load_script

REPO = Path(__file__).resolve().parents[2]


def _script():
    return load_script("suite_tiers")


def test_every_full_tier_test_names_a_default_run_test_that_covers_its_path():
    rows, problems = _script().tier_map(REPO)
    assert rows, "no test is in the full tier: the rule checked here would check nothing"
    assert problems == [], "\n".join(problems)


MADE_UP = '''
import pytest

@pytest.mark.full
def test_long():
    """Long, and no paragraph naming what covers it."""

@pytest.mark.full
def test_cites_a_full_one():
    """Full tier: tests/test_x.py::test_long covers it."""

@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.full)])
def test_param(n):
    """Full tier (the [2] case): tests/test_x.py::test_short covers it, and tests/test_x.py::test_param[1]."""

@pytest.fixture(params=["a", pytest.param("b", marks=pytest.mark.full)])
def thing(request):
    """Full tier (the b parameter): tests/test_x.py::test_missing covers it."""

def test_short():
    pass
'''


def test_the_check_finds_each_kind_of_violation(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(MADE_UP)
    rows, problems = _script().tier_map(tmp_path)
    assert sorted(problems) == sorted([
        "tests/test_x.py::test_long: no 'Full tier: tests/<file>::<test> covers ...' paragraph in its docstring",
        "tests/test_x.py::test_cites_a_full_one: cites tests/test_x.py::test_long, which is itself in the full tier",
        "tests/test_x.py::thing: cites tests/test_x.py::test_missing, which does not exist",
    ])
    assert ("tests/test_x.py::test_param", "the [2] case",
            ["tests/test_x.py::test_short", "tests/test_x.py::test_param[1]"]) in rows
