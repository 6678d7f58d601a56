"""Shared fixtures: the golden reference folders live in ../shared/golden next to the repository
(override with JDEEP_GOLDEN_DIR); tests that need one skip with a message when it is absent."""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
# numpy's BLAS (the NKI emulation's matmuls, float64 oracles) one thread per xdist worker: two workers on two cores
# already fill the machine, and oversubscribed BLAS threads made the kernel tests slower and noisier
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# CLI runs inside the tests do not write the user's persistent compilation cache (test_cli checks the cache itself)
os.environ.setdefault("JDEEP_NO_COMPILE_CACHE", "1")
GOLDEN_DIR = pathlib.Path(os.environ.get("JDEEP_GOLDEN_DIR", REPO.parent / "shared" / "golden"))


def _use_nki_emulation() -> None:
    """NKI kernel tests (tests/kernels/nki_kernels) run under the real `nki.simulate` when the Neuron `nki` package
    is importable, else under the numpy emulation in tests/nki_emulation, put on sys.path here (jdeep itself
    imports `nki` only on the neuron backend)."""
    try:
        import nki
        if hasattr(nki, "simulate"):
            os.environ.setdefault("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
            return
    except ImportError:
        pass
    for name in [m for m in sys.modules if m == "nki" or m.startswith("nki.")]:
        del sys.modules[name]          # a PyPI placeholder
    sys.path.insert(0, str(REPO / "tests" / "nki_emulation"))


_use_nki_emulation()


def pytest_configure(config):
    """One persistent JAX compilation cache per test run, shared by the xdist workers: many test files build
    models of the same shapes (the goldens, the one-layer and tiny random models), and a program one worker
    compiled is read back by the other instead of compiled again. Removed when the run ends. (Unlike the CLI's
    cache, the XLA:CPU target is not capped at AVX2 (jdeep.platforms.cache_xla_flags): the cap made the suite ~12 %
    slower, and the cpu_aot_loader lines it silences show only in the captured output of failing tests.)"""
    if "JDEEP_TEST_COMPILE_CACHE" not in os.environ:
        os.environ["JDEEP_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="jdeep-test-jax-cache-")
        config._jdeep_compile_cache_owner = True
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ["JDEEP_TEST_COMPILE_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def pytest_unconfigure(config):
    if getattr(config, "_jdeep_compile_cache_owner", False):
        shutil.rmtree(os.environ.pop("JDEEP_TEST_COMPILE_CACHE"), ignore_errors=True)


def _keeps_holes(folder: pathlib.Path) -> bool:
    """Whether files in `folder` stay sparse: a 1 GiB file with one byte written at its end allocates < 1 MiB."""
    probe = folder / ".sparse-probe"
    try:
        with open(probe, "wb") as f:
            f.truncate(1 << 30)
            f.seek((1 << 30) - 1)
            f.write(b"\0")
        return os.stat(probe).st_blocks * 512 < 1 << 20
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


@pytest.fixture
def sparse_dir(tmp_path):
    """A folder whose files keep their holes, for the tests of tables larger than RAM in sparse files: the test's
    tmp_path, else a folder in /dev/shm (tmpfs always keeps holes). Probed before anything large is written, so a
    filesystem that would allocate the holes is never filled; without either, the test fails (it cannot show what
    it is for) rather than skipping."""
    if _keeps_holes(tmp_path):
        yield tmp_path
        return
    shm = pathlib.Path("/dev/shm")
    if shm.is_dir():
        folder = pathlib.Path(tempfile.mkdtemp(prefix="jdeep-sparse-", dir=shm))
        try:
            if _keeps_holes(folder):
                yield folder
                return
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    pytest.fail(f"neither {tmp_path} nor /dev/shm keeps sparse files: the larger-than-RAM table tests need one")


def golden_path(name: str) -> pathlib.Path:
    path = GOLDEN_DIR / name
    if not (path / "config.json").exists():
        pytest.skip(f"golden folder {path} is absent (set JDEEP_GOLDEN_DIR to the shared/golden folder)")
    return path


def load_script(name: str):
    """scripts/<name>.py as a module (the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compiled_variants() -> dict:
    """How many compiled variants each program in jdeep's program cache holds (key -> count)."""
    from jdeep.model.cache import PROGRAMS
    return {key: fn._cache_size() for key, fn in PROGRAMS.items() if hasattr(fn, "_cache_size")}


def assert_each_program_compiled_once_since(before: dict) -> None:
    """One call (one set of shapes) compiles each program at most once: a loop whose first input is placed
    differently from the outputs that replace it (a host or uncommitted array) would compile it a second time."""
    grown = {key: n - before.get(key, 0) for key, n in compiled_variants().items()}
    assert max(grown.values(), default=0) <= 1, [key[:2] for key, n in grown.items() if n > 1]


MAX_MAPPINGS = 20000   # a third of Linux's default vm.max_map_count (65530): one module added 22k


def _mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after a test module once this worker holds MAX_MAPPINGS memory mappings. XLA:CPU keeps
    a few per cached executable, and a worker that compiled thousands of programs reached the kernel's
    vm.max_map_count (65530) and crashed inside a later compile. Below the threshold programs stay cached, so
    later modules reuse them."""
    yield
    if _mappings() < MAX_MAPPINGS:
        return
    import gc

    import jax

    from jdeep.model.cache import PROGRAMS

    PROGRAMS.clear()
    jax.clear_caches()
    gc.collect()


# ------------------------------------------------------------------ where a test's time goes: JAX's compile events
_JAX_SECONDS = {"/jax/core/compile/jaxpr_trace_duration": "jax_trace_s",
                "/jax/core/compile/jaxpr_to_mlir_module_duration": "jax_lower_s",
                "/jax/core/compile/backend_compile_duration": "jax_compile_s"}
_jax_totals = dict.fromkeys(_JAX_SECONDS.values(), 0.0) | {"jax_compiles": 0}


def _on_jax_duration(event: str, duration: float, **kwargs) -> None:
    name = _JAX_SECONDS.get(event)
    if name is not None:
        _jax_totals[name] += duration
        _jax_totals["jax_compiles"] += name == "jax_compile_s"


def pytest_sessionstart(session):
    import jax

    jax.monitoring.register_event_duration_secs_listener(_on_jax_duration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's tracing, lowering and XLA compile seconds and its number of backend compiles, in its setup, call
    and teardown (module fixtures' compiles count for the first test that uses them), recorded as junit properties
    for scripts/suite_report.py: the compile-vs-run split of the suite's time. (Compiles in threads a test starts
    count for whichever test is running.)"""
    item._jdeep_jax_before = dict(_jax_totals)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "teardown" and hasattr(item, "_jdeep_jax_before"):
        before = item.__dict__.pop("_jdeep_jax_before")
        for name, total in _jax_totals.items():
            item.user_properties.append((name, round(total - before[name], 3)))
    yield
