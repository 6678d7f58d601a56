"""Step 4 of the doctor, on the platform it runs on: the goldens' checks (as the tests make them), regions vs scan,
and each NKI kernel against its jnp twin.

- A golden folder (reference.npz, ../shared/golden/LAYOUT.md) is checked as tests/test_golden_*.py check it: the
  float reference (an unquantized checkpoint's reference.npz, or a quantized one's reference_noquant.npz with
  jdeep's activation quantisation off) end to end to GOLDEN_ATOL on every prompt position; a quantized reference
  (chaotic at long context) statistically, by the row cosines of the longest prompt's logits (median >= 0.99,
  25th percentile >= 0.97). fp8_max is DeepSeek's 448 there, on every platform, so that the numerics are theirs.
- Regions vs scan: the logits of one prompt under both compile modes (bit-identical on CPU, tested).
- Kernels: on the neuron platform every op with an NKI implementation that has an input generator here is run
  both ways on random inputs; elsewhere there is nothing to compare and the check says so."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from ....kernels import implementation, registered
from ....model.load import load
from ....runtime.generate import forward
from ...testing.reference import row_cosine

__all__ = ["Check", "golden_checks", "regions_vs_scan", "kernels_vs_twins", "GOLDEN_ATOL", "KERNEL_CASES"]

GOLDEN_ATOL = 1e-3           # tests/test_golden_v4_*.py's end-to-end bound on float references
COSINE_MEDIAN, COSINE_P25 = 0.99, 0.97


@dataclass
class Check:
    name: str
    status: str                   # "pass" | "fail" | "skip"
    detail: str
    metrics: dict = field(default_factory=dict)


def _prompts(ref) -> list[int]:
    return sorted(int(k.split("_")[1]) for k in ref.files if k.startswith("prompt_"))


def _float_check(name: str, model, ref) -> Check:
    worst, where = 0.0, None
    idx = _prompts(ref)
    pad = max(len(ref[f"prompt_{i}"]) for i in idx)
    for i in idx:
        want = ref[f"full_logits_{i}"] if f"full_logits_{i}" in ref.files else ref[f"logits_{i}"][:1]
        got = np.asarray(forward(model, ref[f"prompt_{i}"], pad_to=pad))[-len(want):]
        err = float(np.abs(got - want).max())
        if err >= worst:
            worst, where = err, i
    ok = worst <= GOLDEN_ATOL
    return Check(name, "pass" if ok else "fail",
                 f"max |Δlogit| {worst:.2e} over {len(idx)} prompts (prompt {where}); bound {GOLDEN_ATOL:g}",
                 {"max_abs": worst, "prompts": len(idx)})


def _statistical_check(name: str, model, ref) -> Check:
    idx = _prompts(ref)
    i = max(idx, key=lambda i: len(ref[f"prompt_{i}"]))
    if f"full_logits_{i}" not in ref.files:
        return Check(name, "skip", "the reference has no full_logits to compare statistically")
    c = row_cosine(np.asarray(forward(model, ref[f"prompt_{i}"])), ref[f"full_logits_{i}"])
    med, p25 = float(np.median(c)), float(np.percentile(c, 25))
    ok = med >= COSINE_MEDIAN and p25 >= COSINE_P25
    return Check(name, "pass" if ok else "fail",
                 f"row cosine over prompt {i}'s {len(c)} positions: median {med:.4f} (>= {COSINE_MEDIAN}), "
                 f"p25 {p25:.4f} (>= {COSINE_P25})", {"median": med, "p25": p25, "positions": len(c)})


def golden_checks(model_dir: str, dtype: str = "float32") -> list[Check]:
    """The golden folder's checks; a folder without reference outputs gives one skipped check."""
    ref_path = os.path.join(model_dir, "reference.npz")
    if not os.path.exists(ref_path):
        return [Check("golden", "skip", f"{model_dir} has no reference.npz (not a golden folder)")]
    with open(os.path.join(model_dir, "config.json")) as f:
        quantized = "quantization_config" in json.load(f)
    checks = []
    ref = np.load(ref_path)
    if quantized:
        checks.append(_statistical_check("golden reference.npz (quantized, statistical)",
                                         load(model_dir, dtype=dtype, fp8_max=448.0), ref))
        noquant = os.path.join(model_dir, "reference_noquant.npz")
        if os.path.exists(noquant):
            checks.append(_float_check("golden reference_noquant.npz (activation quantisation off)",
                                       load(model_dir, dtype=dtype, quantize_activations=False, fp8_max=448.0),
                                       np.load(noquant)))
    else:
        checks.append(_float_check("golden reference.npz (float)", load(model_dir, dtype=dtype), ref))
    return checks


def regions_vs_scan(model_dir: str, dtype: str = "float32", length: int = 40) -> Check:
    """One prompt's logits under both compile modes."""
    logits = {}
    for mode in ("scan", "regions"):
        model = load(model_dir, dtype=dtype, compile_mode=mode)
        ids = (np.arange(length, dtype=np.int64) * 7919 % model.config.vocab_size).astype(np.int32)
        logits[mode] = np.asarray(forward(model, ids))
    err = float(np.abs(logits["scan"] - logits["regions"]).max())
    ok = err <= 1e-5 * max(1.0, float(np.abs(logits["scan"]).max()))
    return Check("regions vs scan logits", "pass" if ok else "fail",
                 f"max |Δlogit| {err:.2e} over {length} positions", {"max_abs": err})


def _cases(key) -> dict:
    """Random inputs of a few hot ops at serving-like shapes: op -> (args, kwargs, rtol)."""
    k = jax.random.split(key, 6)
    x = jax.random.normal(k[0], (8, 512), jnp.float32)
    return {
        "rms_norm": ((x, 1 + 0.1 * jax.random.normal(k[1], (512,)), 1e-6), {}, 2e-3),
        "swiglu": ((x, jax.random.normal(k[2], (8, 512)), 10.0), {}, 2e-3),
        "topk": ((jax.random.normal(k[3], (16, 1024)), 8), {}, 0.0),
        "softmax_pool": ((jax.random.normal(k[4], (2, 16, 4, 128)), jax.random.normal(k[5], (2, 16, 4, 128))), {},
                         2e-3),
    }


KERNEL_CASES = ("rms_norm", "swiglu", "topk", "softmax_pool")


def kernels_vs_twins(seed: int = 0) -> list[Check]:
    """Each NKI kernel with an input generator (KERNEL_CASES) against its jnp reference, on the neuron platform."""
    if jax.default_backend() != "neuron":
        return [Check("NKI kernels vs jnp twins", "skip",
                      f"platform {jax.default_backend()}: NKI kernels run only on neuron")]
    neuron_ops = [op for op, platforms in registered().items() if "neuron" in platforms]
    cases = _cases(jax.random.PRNGKey(seed))
    checks = []
    for op in neuron_ops:
        if op not in cases:
            checks.append(Check(f"kernel {op}", "skip", "no input generator in the doctor yet (its tests cover it "
                                                        "under the emulation)"))
            continue
        args, kwargs, rtol = cases[op]
        try:
            got = jax.tree_util.tree_map(np.asarray, jax.jit(implementation(op, "neuron"), static_argnums=_static(op))
                                         (*args, **kwargs))
            want = jax.tree_util.tree_map(np.asarray, implementation(op, "reference")(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - a kernel that does not run is this check's finding
            checks.append(Check(f"kernel {op}", "fail", f"{type(e).__name__}: {e}"[:300]))
            continue
        errs = [float(np.abs(g.astype(np.float64) - w).max() / max(1e-30, np.abs(w).max()))
                for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))]
        worst = max(errs)
        checks.append(Check(f"kernel {op}", "pass" if worst <= rtol else "fail",
                            f"max relative error {worst:.2e} (bound {rtol:g})", {"max_rel": worst}))
    return checks


def _static(op: str) -> tuple[int, ...]:
    return {"rms_norm": (2,), "swiglu": (2,), "topk": (1,)}.get(op, ())
