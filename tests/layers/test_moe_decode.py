"""End to end, a model whose decode batch routes more (token, expert) pairs than it has experts (6 experts, top-2,
batch 8: the sort-free grouped op) gives the logits of a no-cache forward (prefill: the sorted grouped op), and its
decode program has no sort in either compile mode."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jdeep
from jdeep.model.cache import ProgramCache
from jdeep.config.small_models import one_layer_config
from jdeep.tools.dev.graphcheck import check_lowered
from jdeep.tools.dev.programs import Target, model_programs
from jdeep.tools.testing.random_weights import random_checkpoint

RAW = one_layer_config(n_routed_experts=6, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe6")
    random_checkpoint(RAW, str(path), seed=11)
    return path


def test_batch8_decode_equals_forward(folder):
    model = jdeep.load(folder)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 512, size=n).tolist() for n in (9, 3, 11, 5, 7, 2, 10, 6)]
    out = jdeep.generate(model, prompts, max_new_tokens=5, return_logits=True)
    assert out.logits.shape[0] == 8
    for b, prompt in enumerate(prompts):
        seq = prompt + out.tokens[b, :-1].tolist()
        rows = jdeep.forward(model, seq)[len(prompt) - 1:]
        np.testing.assert_allclose(out.logits[b], rows, atol=2e-5, rtol=0)
        np.testing.assert_array_equal(out.tokens[b], np.argmax(rows, axis=-1))


@pytest.mark.parametrize("mode", ["scan", "regions"])
def test_decode_programs_have_no_sort(folder, mode):
    """Batch 4 and 8 (T*k = 8, 16 > 6 experts): every decode program passes every rule, S6 included."""
    model = jdeep.load(folder, compile_mode=mode)
    # the rules are Neuron's, where jdeep's native CPU products (a custom call) never run: checked without them
    target = Target.of(model)
    target = dataclasses.replace(target, numerics=target.numerics.portable())
    programs = model_programs(target, (4, 8), (), 64, cache=ProgramCache())
    assert {p.bucket["step"] for p in programs} == {"decode"}
    for prog in programs:
        lowered = prog.lower()
        assert "stablehlo.sort" not in lowered.as_text(), prog.name
        report = check_lowered(lowered, name=prog.name, n_experts=6, decode=True)
        assert report.ok, report.format()
