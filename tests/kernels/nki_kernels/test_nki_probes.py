"""scripts/nki_hardware_probes.py (what a trn2 user runs to check the kernels' hardware assumptions) runs its probe
kernels through the NKI subset check and gets, on the emulation, the answers the emulation's model implies: the
uint32 bit operations refused, everything else as jdeep assumes."""

from __future__ import annotations

import importlib.util

import nki
import pytest
from conftest import REPO

pytestmark = pytest.mark.skipif(not getattr(nki, "EMULATED", False), reason="the emulation's answers")


def test_probes_run_and_match_the_emulations_model():
    spec = importlib.util.spec_from_file_location("nki_hardware_probes", REPO / "scripts" / "nki_hardware_probes.py")
    probes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probes)
    results = {r["probe"]: r for r in probes.run_probes()}
    assert set(results) == {"uint32-bitops", "e4m3-subnormals", "dma-4d", "activations", "tie-order", "scalar-offset"}
    assert results["uint32-bitops"]["ok"] is None and "not exact in fp32" in results["uint32-bitops"]["detail"]
    for name in set(results) - {"uint32-bitops"}:
        assert results[name]["ok"] is True, results[name]
