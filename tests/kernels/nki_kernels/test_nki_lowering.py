"""On the neuron path every hot op lowers to its NKI custom call: the programs of quantized tiny DeepSeek-V4 (every
layer kind: sliding, ratio-4 with indexer, ratio-16, hash MoE) and DeepSeek-V4.1 (KV sources, shared top-k, candidate
blocks, Engram) models, traced with the dispatch answering as on Neuron and `nki.jit` standing in for the real
lowering (tests/nki_emulation: it emits NKI's custom call and records it; nothing is run), contain one
`AwsNeuronCustomNativeKernel` call per recorded kernel, every kernel of the registry among them, with the weight codes
passed to them undecoded, and pass the compile-safety rules as the programs Neuron compiles; the same programs traced
for CPU have no custom call. (With the real `nki` package this needs its JAX lowering, so it only runs under the
emulation.)

Each call carries jax-neuronx's payload (the array arguments then an s8[128, 128] constant, a backend config naming
the kernel, its launch grid at the runtime's LNC and its compiled file), and `jdeep export` of such programs copies
every kernel's compiled file beside the graph, where neuronx-cc launched from the export folder on another host
finds it (NCC_EVRF059's lookup rule)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re

import jax
import jax.numpy as jnp
import nki
import pytest

from jdeep.config import ModelConfig
from jdeep.kernels import nki as nki_kernels
from jdeep.kernels import registry
from jdeep.model import model_step
from jdeep.model.cache import ProgramCache
from jdeep.numerics import Numerics
from jdeep.param_spec import abstract_params
from jdeep.plan import build_plan
from jdeep.platforms import logical_nc_config
from jdeep.config.small_models import TINY_CONFIG, one_layer_config, tiny_v41_config
from jdeep.state import init_state
from jdeep.tools.dev import programs as graphs
from jdeep.tools.dev.export import export_programs, load_exported, model_info
from jdeep.tools.dev.graphcheck import check_lowered
from jdeep.tools.dev.kernel_artifacts import copy_artifacts, kernel_refs, relative_location, unresolved

pytestmark = pytest.mark.skipif(not getattr(nki, "EMULATED", False), reason="the recording stand-in is the emulation's")

QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32],
         "expert_dtype": "fp4"}
# every registered kernel body, plus the second kernel of the MoE ops and attention's entry point for layers without
# selected keys; swiglu_kernel's tiles are fused into the expert kernels, so the model never calls it on its own
MODEL_KERNELS = {body for op, (_, _, body) in nki_kernels.KERNELS.items() if op != "swiglu"} | {
    "expert_down_kernel", "sparse_attention_shared_kernel"}


def _lower(config: ModelConfig, batch: int, S: int, max_len: int = 256) -> str:
    """The scan-mode step of `config` with trn2 weights (fp8_max 240), lowered from abstract bf16 params and state
    (a fresh jit: the model's cached programs are not touched)."""
    plan = build_plan(config)
    params = abstract_params(config, plan, jnp.bfloat16)
    state = jax.eval_shape(lambda: init_state(config, plan, batch, max_len, jnp.bfloat16))
    tok = jax.ShapeDtypeStruct((batch, S), jnp.int32)
    numerics = Numerics.for_config(config, fp8_max=240.0)
    assert numerics.trn2_weights and numerics.quantize_activations
    step = jax.jit(functools.partial(model_step, config=config, plan=plan, numerics=numerics))
    return step.lower(params, state, tok, tok, None).as_text()


def _neuron_and_cpu(monkeypatch, config: ModelConfig, batch: int, S: int) -> tuple[str, list[dict], str]:
    nki_kernels.register_all()
    monkeypatch.setattr(registry, "_backend", lambda: "neuron")
    nki.RECORDED.clear()
    neuron = _lower(config, batch, S)
    recorded = list(nki.RECORDED)
    monkeypatch.undo()
    return neuron, recorded, _lower(config, batch, S)     # after it: no neuron trace leaks into later programs


def _check_calls(neuron: str, recorded: list[dict]) -> None:
    """Weight codes and scales reach the kernels as uint8 and no float8 type appears in the graph (S13)."""
    assert "f8E4M3" not in neuron and "f8E5M2" not in neuron
    for r in recorded:
        if r["kernel"] == "fp8_linear_kernel":                           # activations bf16, codes and scales as is
            assert [dt for _, dt in r["inputs"]] == ["bfloat16", "uint8", "uint8"], r
        if r["kernel"] in ("expert_gate_up_kernel", "expert_down_kernel"):
            assert "uint8" in [dt for _, dt in r["inputs"]], r           # fp4 / fp8 expert codes undecoded


def _n_calls(text: str) -> int:
    return len(re.findall(rf"custom_call @{nki.CUSTOM_CALL_TARGET}\(", text))


def _check_payload(text: str) -> None:
    """Every NKI call: API_VERSION_STATUS_RETURNING, an s8[128, 128] last operand, launched at the runtime's LNC,
    naming an existing compiled kernel file by absolute path with one input name per array argument."""
    calls = re.findall(rf"custom_call @{nki.CUSTOM_CALL_TARGET}\((.*?)\) \{{(.*?)\}} : \((.*?)\) ->", text)
    assert calls and len(calls) == _n_calls(text)
    for _, attrs, types in calls:
        operands = re.findall(r"tensor<[^>]*>", types)
        assert "api_version = 2" in attrs and operands[-1] == "tensor<128x128xi8>", (attrs[:80], operands)
    for ref in kernel_refs(text):
        assert ref.grid == logical_nc_config() and os.path.isabs(ref.binary) and os.path.isfile(ref.binary), ref


def _regions_programs(config: ModelConfig) -> list:
    """Every program of the regions compile mode (Neuron's default) for a 2-slot bucket, prefill 32 and decode, with
    fresh jits and program caches (the model's cached programs are not touched)."""
    target = graphs.Target(config, build_plan(config), Numerics.for_config(config, fp8_max=240.0), jnp.bfloat16,
                           "regions")
    return graphs.model_programs(target, (2,), 32, 256, cache=ProgramCache())


V4_CONFIG = dict(TINY_CONFIG, head_dim=128, qk_rope_head_dim=64, index_head_dim=64,   # blocks DeepSeek's numerics tile
                 quantization_config=QUANT)


@pytest.mark.parametrize("raw", [V4_CONFIG, tiny_v41_config()], ids=["v4", "v41"])
def test_neuron_programs_call_every_kernel_and_pass_the_compile_safety_rules(monkeypatch, raw):
    """The regions-mode programs of a 2-slot prefill and decode step, lowered as on Neuron: together they call every
    model kernel of the registry, and each passes the compile-safety rules (neuron-notes §9) with its custom calls."""
    config = ModelConfig.from_dict(raw)
    nki_kernels.register_all()
    monkeypatch.setattr(registry, "_backend", lambda: "neuron")
    nki.RECORDED.clear()          # recorded when a program is first traced (building the list traces some)
    programs = _regions_programs(config)
    texts = [prog.lower() for prog in programs]
    for prog, lowered in zip(programs, texts):
        report = check_lowered(lowered, name=prog.name, n_experts=config.n_routed_experts,
                               decode=prog.bucket["step"] == "decode")
        assert report.ok, report.format()
    texts = [lowered.as_text() for lowered in texts]
    assert sum(map(_n_calls, texts)) == len(nki.RECORDED)           # one custom call per kernel call traced
    for text in texts:
        _check_calls(text, nki.RECORDED)
        if _n_calls(text):
            _check_payload(text)
    names = {r["kernel"] for r in nki.RECORDED}
    assert names == MODEL_KERNELS, (MODEL_KERNELS - names, names - MODEL_KERNELS)
    monkeypatch.undo()
    cpu = _regions_programs(config)[-1].lower().as_text()               # the CPU dispatch: no neuron trace leaks
    assert nki.CUSTOM_CALL_TARGET not in cpu                           # (jdeep's native CPU kernels may run)


def test_every_fp8_projection_outside_the_moe_is_one_gemm_call(monkeypatch):
    """One fp8_linear custom call per quantized dense weight of a one-layer model outside the MoE (whose experts,
    the shared one included, go through the expert kernels): no projection is left to a decoded XLA dot."""
    config = ModelConfig.from_dict(one_layer_config(head_dim=128, qk_rope_head_dim=64, index_head_dim=64,
                                                    quantization_config=QUANT))
    neuron, recorded, cpu = _neuron_and_cpu(monkeypatch, config, 1, 16)
    assert nki.CUSTOM_CALL_TARGET not in cpu and _n_calls(neuron) == len(recorded)
    assert "jdeep_rows_gemm" not in neuron                              # the CPU kernels stay off Neuron
    _check_calls(neuron, recorded)
    params = abstract_params(config, build_plan(config), jnp.bfloat16)
    fp8_weights = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)
                   if "codes" in jax.tree_util.keystr(p) and "['ffn']" not in jax.tree_util.keystr(p)]
    gemms = [r for r in recorded if r["kernel"] == "fp8_linear_kernel"]
    assert len(gemms) == len(fp8_weights), (len(gemms), fp8_weights)


def test_export_with_kernels_carries_their_compiled_files(monkeypatch, tmp_path):
    """`jdeep export` of programs traced on the neuron path: the manifest lists every kernel the programs call, each
    compiled file copied to <hash folder>/<name> in the export folder with its sha256; on another host (the traced
    paths gone) neuronx-cc launched from the export folder resolves every one, from anywhere else none. A kernel file
    missing at export time is an error naming the kernel."""
    config = ModelConfig.from_dict(one_layer_config(head_dim=128, qk_rope_head_dim=64, index_head_dim=64,
                                                    quantization_config=QUANT))
    monkeypatch.setattr(nki, "ARTIFACT_DIR", str(tmp_path / "nki-cache"))
    nki_kernels.register_all()
    monkeypatch.setattr(registry, "_backend", lambda: "neuron")
    target = graphs.Target(config, build_plan(config), Numerics.for_config(config, fp8_max=240.0), jnp.bfloat16,
                           "scan")
    programs = graphs.model_programs(target, (1,), 16, 64, cache=ProgramCache())
    out = tmp_path / "export"
    manifest = export_programs(programs, str(out), model_info(target))
    kernels = manifest["kernels"]
    assert {k["func_name"].rsplit(".", 1)[1] for k in kernels} >= {"fp8_linear_kernel", "sparse_attention_kernel",
                                                                  "expert_gate_up_kernel", "topk_kernel"}
    assert all(entry["kernels"] for entry in manifest["programs"])
    for k in kernels:
        assert k["file"] == relative_location(k["traced_path"]) and k["grid"] == logical_nc_config()
        assert hashlib.sha256((out / k["file"]).read_bytes()).hexdigest() == k["sha256"]
    assert load_exported(str(out))[0]["schema"] == "jdeep.export/2"
    refs = [r for entry in manifest["programs"] for r in kernel_refs((out / entry["files"]["mlir"]).read_text())]
    elsewhere = [dataclasses.replace(r, binary="/nonexistent-host" + r.binary) for r in refs]
    assert refs and unresolved(elsewhere, str(out)) == [] and unresolved(elsewhere, str(tmp_path)) == elsewhere
    os.remove(refs[0].binary)                  # (tracing again would write it again, as NKI's cache does)
    with pytest.raises(FileNotFoundError, match=f"NKI kernel {refs[0].func_name}: its compiled file"):
        copy_artifacts(refs, str(tmp_path / "again"))
