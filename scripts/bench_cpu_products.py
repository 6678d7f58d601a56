"""Products of few rows inside a layer scan on CPU: XLA's dot against jdeep's native kernel (kernels/cpu).

    python scripts/bench_cpu_products.py                         # 8 layers of [4096, 1024] fp32, rows 1..16
    python scripts/bench_cpu_products.py --n 512 --k 1024 --layers 64 --dtype bfloat16

Each variant runs the same program shape as the model's decode step: a `lax.scan` over L stacked weights
[L, N, K], each layer's product x [M, K] · W[l]ᵀ feeding the next layer's input. Variants:
  xla         the weight as the scan's sliced input (what the model did): XLA's dot; for M >= 2 XLA:CPU copies the
              slice out of the stack and runs its GEMM path
  native      the same sliced input through kernels.cpu.rows_gemm (the copy stays, the product changes)
  in place    the whole stack passed to rows_gemm with the layer index: no copy
Runs are interleaved (median of --repeats); GB/s is the weight bytes read per run over its time.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jdeep.kernels import cpu


def _programs(dtype) -> dict:
    def xla(x, ws):
        def body(h, w):
            y = jax.lax.dot_general(h.astype(w.dtype), w, (((1,), (1,)), ((), ())), precision="highest",
                                    preferred_element_type=jnp.float32)
            return h + y[:, :h.shape[1]] * 1e-3, None
        return jax.lax.scan(body, x, ws)[0]

    def native(x, ws):
        def body(h, w):
            return h + cpu.rows_gemm(h.astype(dtype), w)[:, :h.shape[1]] * 1e-3, None
        return jax.lax.scan(body, x, ws)[0]

    def in_place(x, ws):
        def body(h, i):
            return h + cpu.rows_gemm(h.astype(dtype), ws, (i,))[:, :h.shape[1]] * 1e-3, None
        return jax.lax.scan(body, x, jnp.arange(ws.shape[0], dtype=jnp.int32))[0]

    return {"xla": jax.jit(xla), "native": jax.jit(native), "in place": jax.jit(in_place)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    if not cpu.available():
        raise SystemExit(f"the native CPU kernels are not available: {cpu.status()['reason']}")
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.standard_normal((args.layers, args.n, args.k)) * 0.01, dtype)
    gb = ws.size * ws.dtype.itemsize / 1e9
    progs = _programs(dtype)
    print(f"{args.layers} x [{args.n}, {args.k}] {args.dtype} ({gb * 1e3:.0f} MB per run)")
    print(f"{'rows':>4}  " + "  ".join(f"{name:>20}" for name in progs))
    for m in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((m, args.k)), jnp.float32)
        ref = np.asarray(progs["xla"](x, ws))
        for f in progs.values():
            np.testing.assert_allclose(np.asarray(f(x, ws)), ref, rtol=1e-4, atol=1e-4)
        times: dict[str, list[float]] = {name: [] for name in progs}
        for _ in range(args.repeats):
            for name, f in progs.items():
                t0 = time.perf_counter()
                f(x, ws).block_until_ready()
                times[name].append(time.perf_counter() - t0)
        cells = [f"{np.median(t) * 1e3:7.2f} ms {gb / np.median(t):5.1f} GB/s" for t in times.values()]
        print(f"{m:>4}  " + "  ".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()
