"""The package's shape: no import cycle, imports only at module level (but for optional dependencies), imports that
run one way (kernels <- layers <- model <- runtime <- serve / tools / cli), and modules of one job each (an opening
docstring, at most ~450 lines)."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jdeep"
MAX_LINES = 450

# optional dependencies, imported where used: the Neuron toolchain and the extras `compare`, `plot`, `test`
LAZY_OK = {"nki", "torch", "transformers", "matplotlib", "openai"}

# rank of each part of the package: a module imports only modules of its own rank or below
RANKS = [
    ("jdeep.kernels", 0),
    ("jdeep.config", 1), ("jdeep.numerics", 1),
    ("jdeep.plan", 1), ("jdeep.platforms", 1), ("jdeep.param_spec", 1), ("jdeep.arenas", 1), ("jdeep.state", 1),
    ("jdeep.sharding", 1), ("jdeep.io", 1),
    ("jdeep.layers", 2), ("jdeep.vision", 2),
    ("jdeep.model", 3),
    ("jdeep.runtime", 4), ("jdeep.speculative", 4),
    ("jdeep.serve", 5), ("jdeep.tools", 5),
    ("jdeep.cli", 6), ("jdeep", 6),
]


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, bool, int]]:
    """(imported module, inside a function, line) for every import of module `name`."""
    path, is_pkg = MODULES[name]
    tree = ast.parse(path.read_text())
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1] + ([node.module] if node.module else [])
                module = ".".join(base)
            else:
                module = node.module
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names]
        else:
            continue
        out += [(t, id(node) in nested, node.lineno) for t in targets]
    return out


def _part_rank(name: str) -> int:
    best = max((p for p, _ in RANKS if name == p or name.startswith(p + ".")), key=len)
    return dict(RANKS)[best]


def test_no_import_inside_a_function_but_optional_dependencies():
    bad = [f"{m}:{line} imports {t}" for m in MODULES for t, nested, line in _imports(m)
           if nested and t.split(".")[0] not in LAZY_OK]
    assert not bad, bad


def test_no_import_cycle():
    graph = {m: {t for t, _, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            assert state.get(t) != 1, " -> ".join(path[path.index(t):] + [t]) if t in path else f"{m} -> {t}"
            if t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m, [m])


def test_imports_run_one_way():
    bad = [f"{m} (rank {_part_rank(m)}) imports {t} (rank {_part_rank(t)})" for m in MODULES
           for t, _, _ in _imports(m) if t in MODULES and _part_rank(t) > _part_rank(m)]
    assert not bad, bad


def test_modules_state_their_job_and_stay_small():
    for name, (path, _) in MODULES.items():
        text = path.read_text()
        assert ast.get_docstring(ast.parse(text)), f"{name} has no opening docstring"
        assert text.count("\n") <= MAX_LINES, f"{name} has {text.count(chr(10))} lines (> {MAX_LINES})"
