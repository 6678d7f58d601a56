"""With the real `nki` package (Neuron SDK 2.32, NKI 0.6) installed, the NKI compiler itself accepts jdeep's kernels:
- tracing a quantized tiny DeepSeek-V4 and V4.1 model step on the neuron path runs `nki.jit`'s JAX integration,
  which compiles every kernel it meets (the NKI compiler parses and specialises the kernel at trace time) and emits
  one `AwsNeuronCustomNativeKernel` call per kernel call, each naming its compiled file at the runtime's LNC;
- the compile-only entry point the NKI language guide names, `nki.compiler.kernel_builder.compile_kernel`, compiles
  two kernel bodies on their own.
Skipped without the real package (these machines cannot install it: docs/kernels.md); on CPU the same kernels pass
the emulation's subset check (test_nki_subset.py). The kernel_builder call follows the language guide's example
(`compile_kernel(fn, inputs={...}, compile_opts=...)` with hyperparameters as keywords); its options class is taken
from nki.compiler.ncc_driver, as in public integrations: adjust here if a release moves it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import nki
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(getattr(nki, "EMULATED", False) or not hasattr(nki, "jit"),
                                reason="needs the real nki package (AWS's package repository)")


def test_the_nki_compiler_accepts_every_kernel_a_model_step_calls(monkeypatch):
    from jdeep.config import ModelConfig
    from jdeep.kernels import nki as nki_kernels
    from jdeep.kernels import registry
    from jdeep.model import model_step
    from jdeep.numerics import Numerics
    from jdeep.param_spec import abstract_params
    from jdeep.plan import build_plan
    from jdeep.platforms import logical_nc_config
    from jdeep.config.small_models import TINY_CONFIG, tiny_v41_config
    from jdeep.state import init_state
    from jdeep.tools.dev.kernel_artifacts import kernel_refs

    quant = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32],
             "expert_dtype": "fp4"}
    nki_kernels.register_all()
    monkeypatch.setattr(registry, "_backend", lambda: "neuron")
    names = set()
    for raw in (dict(TINY_CONFIG, head_dim=128, qk_rope_head_dim=64, index_head_dim=64, quantization_config=quant),
                tiny_v41_config()):
        config = ModelConfig.from_dict(raw)
        plan = build_plan(config)
        params = abstract_params(config, plan, jnp.bfloat16)
        state = jax.eval_shape(lambda: init_state(config, plan, 2, 256, jnp.bfloat16))
        for S in (16, 1):
            tok = jax.ShapeDtypeStruct((2, S), jnp.int32)
            step = jax.jit(functools.partial(model_step, config=config, plan=plan,
                                             numerics=Numerics.for_config(config, fp8_max=240.0)))
            text = step.lower(params, state, tok, tok, None).as_text()
            refs = kernel_refs(text)
            assert refs and all(r.grid == logical_nc_config() for r in refs)
            names |= {r.func_name.rsplit(".", 1)[-1] for r in refs}
    want = {body for op, (_, _, body) in nki_kernels.KERNELS.items() if op != "swiglu"} | {"expert_down_kernel"}
    assert want <= names, want - names


def test_compile_kernel_builds_kernels_on_their_own(tmp_path):
    kernel_builder = pytest.importorskip("nki.compiler.kernel_builder")
    ncc_driver = pytest.importorskip("nki.compiler.ncc_driver")
    from jdeep.kernels.nki import norm, topk
    from jdeep.platforms import logical_nc_config

    lnc = logical_nc_config()
    rng = np.random.default_rng(0)
    cases = [(norm.rmsnorm_kernel, {"x": rng.normal(size=(4, 256)).astype(np.float32),
                                    "weight": np.ones(256, np.float32)}, {"eps": 1e-6}),
             (topk.topk_kernel, {"x": rng.normal(size=(3, 300)).astype(np.float32)}, {"k": 20})]
    for body, inputs, hyper in cases:
        opts = ncc_driver.CompileOptions(target="trn2", lnc=lnc, artifacts_dir=str(tmp_path / body.__name__),
                                         output_path=str(tmp_path / f"{body.__name__}.neff"))
        kernel_builder.compile_kernel(body, inputs=inputs, compile_opts=opts, **hyper)
