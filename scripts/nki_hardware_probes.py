"""What jdeep's NKI kernels assume about trn2 that no CPU check can confirm, probed on the device.

Run on a trn2 host with the Neuron SDK 2.32 packages (jax-neuronx, nki) installed:

    NEURON_PLATFORM_TARGET_OVERRIDE=trn2 python scripts/nki_hardware_probes.py [--json out.json]

Each probe is a small NKI kernel called with NumPy arguments (nki.jit then compiles and runs it on the NeuronCore)
and compared with what jdeep assumes; one line per probe says `ok` or `DIFFERS` and what to change where (see
docs/kernels.md, "What still needs hardware"). Without the real nki package the script runs the same kernels on
tests/nki_emulation (`--emulate`), which checks the probes themselves and shows the emulation's model.

Probes:
- uint32-bitops: bit operations on 32-bit words above 2^24 (the emulation refuses them: issue #1308 says the Vector
  Engine casts 32-bit values through fp32); jdeep decodes fp4 on 16-bit lanes, so a difference here costs nothing.
- e4m3-subnormals: every finite trn2 e4m3 code (subnormals included) times 1.0 on the PE array equals its value.
- dma-4d: the 4-level access pattern of the fp4 expert load (quadrants, each 16-byte run read twice).
- activations: the largest relative error of exp / silu / sigmoid / rsqrt on the Scalar Engine against float64
  (the emulation assumes ACTIVATION_REL_ERROR = 2^-16), and exp of -100 (jdeep no longer relies on it being 0).
- tie-order: nc_find_index8 and nc_match_replace8 on duplicate values (the NKI 0.6 stubs' documented orders).
- scalar-offset: `ap(scalar_offset=register, indirect_dim=0)` starts at the register value times dim 0's stride.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

if __name__ == "__main__" and "--emulate" in sys.argv:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "nki_emulation"))

import nki  # noqa: E402  (the real package, or the emulation with --emulate)
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

ASSUMED_ACTIVATION_REL_ERROR = 2.0 ** -16


def _load(a):
    t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    return t


def _store(t):
    o = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=o, src=t)
    return o


def uint32_bitops(words):
    """(words & 0xF0F0F0F0) >> 2 on uint32 lanes (-252645136 is 0xF0F0F0F0 as a 32-bit immediate)."""
    t = _load(words)
    r = nl.ndarray(words.shape, nl.uint32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=r, data=t, op0=nl.bitwise_and, operand0=-252645136, op1=nl.right_shift, operand1=2)
    return _store(r)


def e4m3_times_one(codes, ones):
    """codes uint8 [1, W] read as float8_e4m3 times a bf16 1.0 on the PE array -> fp32 [1, W]."""
    c = _load(codes)
    o = _load(ones)
    ps = nl.ndarray((1, codes.shape[1]), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=ps, stationary=o.view(nl.bfloat16), moving=c.view(nl.float8_e4m3))
    r = nl.ndarray((1, codes.shape[1]), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=r, src=ps)
    return _store(r)


def dma_4d(packed):
    """The fp4 expert load's pattern: 4 quadrants, each 16-byte run read twice, 4 rows of `half` bytes."""
    half = packed.shape[1]
    t = nl.ndarray((128, 4), nl.uint8, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=packed.ap(pattern=[[16, 4], [0, 2], [1, 16], [half, 4]], offset=0))
    return _store(t)


def activation(x, op):
    t = _load(x)
    nisa.activation(dst=t, op=op, data=t)
    return _store(t)


def ties(x):
    t = _load(x)
    v = nl.ndarray((1, 8), nl.float32, buffer=nl.sbuf)
    found = nl.ndarray((1, 8), nl.uint32, buffer=nl.sbuf)
    pos = nl.ndarray((1, 8), nl.uint32, buffer=nl.sbuf)
    nisa.max8(dst=v, src=t)
    nisa.nc_find_index8(dst=found, data=t, vals=v)
    nisa.nc_match_replace8(dst=t, data=t, vals=v, imm=-1.0, dst_idx=pos)
    return _store(found), _store(pos)


def scalar_offset(stack, ids):
    """stack[ids[0, 0]] through a register-offset DMA (ap(scalar_offset=..., indirect_dim=0))."""
    reg = nisa.register_alloc()
    i = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=i, src=ids)
    nisa.register_load(reg, i)
    t = nl.ndarray((stack.shape[1], stack.shape[2]), stack.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=stack.ap(pattern=[[stack.shape[2], stack.shape[1]], [1, stack.shape[2]]], offset=0,
                                      scalar_offset=reg, indirect_dim=0))
    return _store(t)


def run_probes() -> list[dict]:
    """Every probe: {"probe", "ok" (bool, or None where the platform refused the kernel), "detail"}."""
    import ml_dtypes

    call = {fn.__name__: nki.jit(fn) for fn in (uint32_bitops, e4m3_times_one, dma_4d, activation, ties,
                                                 scalar_offset)}
    results = []

    def record(name, fn):
        try:
            ok, detail = fn()
        except Exception as e:                       # a refusal is a result too (the emulation's model, or the device)
            ok, detail = None, f"refused: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        results.append({"probe": name, "ok": ok, "detail": detail})

    def bitops():
        words = np.array([[0x12345678, 0xFFFFFFFF, 0x01000001, 0x80808080]] * 2, np.uint32)
        got = np.asarray(call["uint32_bitops"](words))
        want = (words & np.uint32(0xF0F0F0F0)) >> np.uint32(2)
        return bool((got == want).all()), f"got {got[0].tolist()}, exact {want[0].tolist()}"

    def subnormals():
        codes = np.arange(256, dtype=np.uint8)
        codes = codes[(codes & 0x78) != 0x78].reshape(1, -1)              # trn2-finite e4m3 (|w| <= 240)
        width = codes.shape[1]
        ones = np.ones((1, 1), ml_dtypes.bfloat16).view(np.uint8).reshape(1, 2)
        got = np.asarray(call["e4m3_times_one"](codes, ones.view(np.uint8))).reshape(-1)
        want = codes.reshape(-1).view(ml_dtypes.float8_e4m3).astype(np.float32)
        bad = np.flatnonzero(got != want)
        return bad.size == 0, f"{width} codes, {bad.size} differ" + (f" (first code 0x{codes[0, bad[0]]:02X})"
                                                                     if bad.size else "")

    def dma():
        packed = np.arange(4 * 64, dtype=np.uint8).reshape(4, 64)
        got = np.asarray(call["dma_4d"](packed))
        flat = packed.reshape(-1)
        want = np.empty((128, 4), np.uint8)
        for q in range(4):
            for h in range(2):
                for i in range(16):
                    want[32 * q + 16 * h + i] = flat[16 * q + i + 64 * np.arange(4)]
        return bool((got == want).all()), "the fp4 quadrant pattern [[16,4],[0,2],[1,16],[64,4]]"

    def activations():
        x = np.linspace(-20, 20, 128 * 64, dtype=np.float32).reshape(128, 64)
        worst = {}
        exact = {"exp": np.exp, "silu": lambda v: v / (1 + np.exp(-v)), "sigmoid": lambda v: 1 / (1 + np.exp(-v))}
        for name, f in exact.items():
            got = np.asarray(call["activation"](x, getattr(nl, name))).astype(np.float64)
            want = f(x.astype(np.float64))
            keep = np.abs(want) > 1e-30
            worst[name] = float(np.max(np.abs(got[keep] / want[keep] - 1)))
        pos = np.linspace(1e-3, 1e3, 128 * 64, dtype=np.float32).reshape(128, 64)
        got = np.asarray(call["activation"](pos, nl.rsqrt)).astype(np.float64)
        worst["rsqrt"] = float(np.max(np.abs(got * np.sqrt(pos.astype(np.float64)) - 1)))
        tiny = float(np.asarray(call["activation"](np.full((1, 8), -100, np.float32), nl.exp)).max())
        ok = max(worst.values()) <= ASSUMED_ACTIVATION_REL_ERROR + 2.0 ** -22      # + the fp32 roundings
        return ok, f"max rel error {worst} (assumed {ASSUMED_ACTIVATION_REL_ERROR:.2e}); exp(-100) = {tiny:.3g}"

    def tie_order():
        x = np.array([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8, 0]], np.float32)
        found, pos = (np.asarray(a).reshape(-1).tolist() for a in call["ties"](x))
        ok = found == [4, 5, 6, 7, 8, 9, 10, 3] and pos == [10, 9, 8, 7, 6, 5, 4, 3]
        return ok, f"find_index8 {found}, match_replace8 dst_idx {pos}"

    def offsets():
        stack = np.arange(3 * 4 * 5, dtype=np.float32).reshape(3, 4, 5)
        got = np.asarray(call["scalar_offset"](stack, np.array([[2]], np.int32)))
        return bool((got == stack[2]).all()), "register 2 on dim 0 of a [3, 4, 5] stack"

    for name, fn in (("uint32-bitops", bitops), ("e4m3-subnormals", subnormals), ("dma-4d", dma),
                     ("activations", activations), ("tie-order", tie_order), ("scalar-offset", offsets)):
        record(name, fn)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--emulate", action="store_true", help="run on tests/nki_emulation instead of the device")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.emulate != bool(getattr(nki, "EMULATED", False)):
        p.error("--emulate needs the script run as a program (python scripts/nki_hardware_probes.py --emulate); "
                f"the nki imported is {'the emulation' if getattr(nki, 'EMULATED', False) else 'the real package'}")
    results = run_probes()
    for r in results:
        status = {True: "ok", False: "DIFFERS", None: "refused"}[r["ok"]]
        print(f"{status:8s} {r['probe']:16s} {r['detail']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
