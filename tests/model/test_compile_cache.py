"""jdeep.load(..., compile_cache=...): the persistent compilation cache in a notebook (jdeep/model/compile_cache.py)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from jdeep.model import compile_cache
from jdeep.config.small_models import TINY_CONFIG
from jdeep.platforms import CACHE_MAX_ISA_FLAG
from jdeep.tools.testing.random_weights import random_checkpoint

NOTEBOOK = """
import os, sys, jax, jdeep
m = jdeep.load(sys.argv[1], compile_cache=sys.argv[2])
jdeep.generate(m, [[0, 5, 9]], max_new_tokens=2)
print(jax.config.jax_compilation_cache_dir)
print(os.environ.get("XLA_FLAGS", ""))
"""


def test_load_turns_the_cache_on_before_the_backend_starts(tmp_path):
    """In a fresh process (a notebook's first jdeep.load): programs are written to the folder, and on an x86 host
    the XLA flag its loader needs is set (jdeep.platforms.cache_xla_flags)."""
    random_checkpoint(TINY_CONFIG, str(tmp_path / "m"), seed=3)
    env = {k: v for k, v in os.environ.items() if k not in ("JDEEP_NO_COMPILE_CACHE", "XLA_FLAGS")}
    run = subprocess.run([sys.executable, "-c", NOTEBOOK, str(tmp_path / "m"), str(tmp_path / "cache")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    folder, flags = run.stdout.splitlines()[-2:]
    assert folder.startswith(str(tmp_path / "cache" / "jdeep-")) and any(pathlib.Path(folder).iterdir())
    if os.uname().machine == "x86_64":
        assert flags.endswith(CACHE_MAX_ISA_FLAG)


def test_enable_after_the_cpu_backend_started_keeps_the_cache_off(tmp_path, monkeypatch):
    """Too late for the XLA flag an x86-64 host needs: the cache stays off and the warning names the fix (no ERROR
    line per program)."""
    import jax

    jax.devices()                                       # the backend is up
    monkeypatch.delenv("JDEEP_NO_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "")
    # as on an x86-64 host, whatever this one is (elsewhere no flag is needed and the cache would turn on)
    monkeypatch.setattr(compile_cache, "cache_xla_flags", lambda flags: f"{flags} {CACHE_MAX_ISA_FLAG}".strip())
    before = jax.config.jax_compilation_cache_dir
    with pytest.warns(UserWarning, match="first jdeep.load"):
        assert compile_cache.enable(tmp_path / "late") is None
    assert jax.config.jax_compilation_cache_dir == before and not (tmp_path / "late").exists()


def test_no_compile_cache_environment_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("JDEEP_NO_COMPILE_CACHE", "1")
    assert compile_cache.enable(tmp_path / "c") is None and not (tmp_path / "c").exists()
