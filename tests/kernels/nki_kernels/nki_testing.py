"""What the NKI kernel tests share: how a kernel body is launched under `nki.simulate` (at trn2's LNC by default, so
every test exercises the split over the two logical cores), and the emulation's model of the Scalar Engine's
activation accuracy that the tolerances include.

ACT_REL: the relative error an activation function (exp, silu, sigmoid, rsqrt, ...) may carry. The hardware's
piece-wise polynomial approximations have no documented accuracy; the emulation assumes this bound and returns values
anywhere inside it (tests/nki_emulation/nki/isa.py, `scalar_engine`); under the real simulator, which computes
them with numpy, the bound holds a fortiori. docs/kernels.md says how a trn2 user measures the real figure."""

from __future__ import annotations

import nki

LNC = 2                                                     # trn2's default NEURON_LOGICAL_NC_CONFIG
ACT_REL = getattr(nki.isa, "ACTIVATION_REL_ERROR", 2.0 ** -16)


def run(body, *args, lnc: int = LNC):
    """body(*args) under nki.simulate, launched on `lnc` logical cores (kernel[lnc])."""
    return nki.simulate(nki.jit(body)[lnc])(*args)
