"""NKI kernel tests run the kernels under the real `nki.simulate` when the Neuron `nki` package is importable,
else under the numpy emulation in tests/nki_emulation (put on sys.path here, before any kernel module imports
`nki`)."""

from __future__ import annotations

import os
import pathlib
import sys

EMULATION = pathlib.Path(__file__).resolve().parents[2] / "nki_emulation"


def _real_nki() -> bool:
    try:
        import nki
    except ImportError:
        return False
    return hasattr(nki, "simulate") and not getattr(nki, "EMULATED", False)


REAL_NKI = _real_nki()
if REAL_NKI:
    os.environ.setdefault("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
else:
    for name in [m for m in sys.modules if m == "nki" or m.startswith("nki.")]:
        del sys.modules[name]          # a PyPI placeholder
    sys.path.insert(0, str(EMULATION))
