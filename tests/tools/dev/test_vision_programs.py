"""The vision programs pass the compile-safety rules: every tower bucket of the released DeepSeek-V4.1-Flash
(lowered for Neuron from the config alone, up to its largest image), and `jdeep check-graph` on a tiny V4.1 with
a vision tower in both compile modes (tower buckets and the prefill steps that take image embeddings)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jdeep.cli import main
from jdeep.config.presets import preset
from jdeep.config.small_models import tiny_v41_config
from jdeep.tools.dev.graphcheck import Limits, check_lowered
from jdeep.tools.dev.programs import Target
from jdeep.tools.dev.vision_programs import tower_buckets, vision_programs
from jdeep.vision.geometry import bucket
from jdeep.vision.processor import plan_image_grid


def test_released_tower_buckets_cover_every_image_and_pass():
    t = Target.for_config(preset("v41-flash"), np.dtype("bfloat16"), fp8_max=240.0, platform="neuron")
    pairs = tower_buckets(t)
    vc = t.config.vision
    for w, h in [(544, 544), (1920, 1080), (4000, 3000), (20000, 50), (50, 20000), (3000, 40)]:
        n_h, n_w, ph, pw = plan_image_grid(w, h, vc)
        assert (bucket(ph // vc.patch_size * (pw // vc.patch_size)), bucket(n_h * n_w)) in pairs
    programs = vision_programs(t, [], [], 4096)
    assert len(programs) == len(pairs) and max(n for n, _ in pairs) >= 9 * 1000
    for p in programs:
        report = check_lowered(p.lower(), name=p.name, n_experts=t.config.n_routed_experts, decode=False,
                               limits=Limits())
        assert report.ok, report.format()


@pytest.mark.parametrize("mode", [pytest.param("scan", marks=pytest.mark.full), "regions"])
def test_check_graph_on_a_tiny_vision_model(tmp_path, capsys, mode):
    """`jdeep check-graph` on a tiny V4.1 with a vision tower: the tower buckets and the prefill steps that take
    image embeddings pass the rules, in each compile mode.

    Full tier: tests/tools/dev/test_vision_programs.py::test_check_graph_on_a_tiny_vision_model[regions] covers the
    tower programs (vision_programs, the same in both modes) and the prefill step with image embeddings (the splice
    in embed_streams, which the scan step calls too) in the default run; the scan mode's text-only steps pass the
    rules in tests/tools/dev/test_programs.py::test_check_graph_passes_on_goldens_in_both_modes[v4-tiny-hf]."""
    (tmp_path / "config.json").write_text(json.dumps(tiny_v41_config(vision=True)))
    assert main(["check-graph", "--model", str(tmp_path), "--mode", mode, "--batch-sizes", "2", "--prefill-len",
                 "32", "--max-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "ok    vision.n16.t16" in out and "b2.prefill32.embeds" in out and "FAIL" not in out
