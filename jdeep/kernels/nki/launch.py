"""How jdeep launches its NKI kernels and how a kernel shares its work over the launch's logical cores.

A kernel runs at the LNC the Neuron runtime is configured for (NEURON_LOGICAL_NC_CONFIG, trn2's default 2): `nki.jit`
launches at LNC=1 unless called as `kernel[lnc](...)`, and a mismatch is a runtime error. `launch` is the one call
site that reads the LNC (jdeep.kernels.neuron_target.logical_nc_config); every JAX op calls its kernel through it.

Inside a kernel, `program_share` splits a count of independent work items (row tiles, query tokens, key tiles, output
column tiles) over the launch's programs (`nl.program_id` / `nl.num_programs`): each logical core takes a contiguous
run, the first ones one item more when the count does not divide, and writes its own part of the shared-HBM outputs.
"""

from __future__ import annotations

import nki.language as nl

from ..neuron_target import logical_nc_config

__all__ = ["launch", "program_share"]


def launch(kernel):
    """`kernel` bound to the runtime's LNC: call the result as the kernel (kernel[lnc](...))."""
    return kernel[logical_nc_config()]


def program_share(n: int):
    """Kernel code: (first, count) of the n work items this program takes, contiguous and as even as possible
    (count 0 for programs beyond n); (0, n) without a launch grid."""
    programs = 1
    pid = 0
    if nl.program_ndim() != 0:
        programs = nl.num_programs(axes=0)
        pid = nl.program_id(axis=0)
    base = n // programs
    extra = n % programs
    first = pid * base + min(pid, extra)
    count = base + (1 if pid < extra else 0)
    return first, count
