"""`jdeep info --programs` counts, from the config alone, the programs `jdeep serve` with the same settings compiles:
the Engine's own inventory, per kind."""

from __future__ import annotations

from collections import Counter

import numpy as np

import jdeep
from jdeep.cli import main
from jdeep.config import ModelConfig
from jdeep.config.small_models import one_layer_config
from jdeep.runtime.engine import Engine
from jdeep.tools.dev.inventory_report import count_inventory
from jdeep.tools.dev.programs import Target
from jdeep.tools.testing.random_weights import random_checkpoint


def test_info_programs_counts_the_engines_inventory(tmp_path, capsys):
    path = tmp_path / "m"
    random_checkpoint(one_layer_config(), str(path), seed=5)
    eng = Engine(jdeep.load(path), max_num_seqs=4, max_len=300, prefill_chunk=64, prefix_cache_bytes=1 << 20,
                 batch_buckets=[1])
    config = ModelConfig.from_file(path)
    counted = count_inventory(Target.for_config(config, np.float32), 4, 300, 64, batch_buckets=[1])
    assert [s.name for s in counted.specs] == [s.name for s in eng.programs()]
    assert counted.warmup_programs == sum(1 for s in eng.programs() if not s.first_use)
    # windows 1 and 4 (the pool's size is always a bucket), chunks 16 and 64: the samplers, steps and first-use
    # prompt-logprob variants follow from the ladders
    kinds = Counter((s.kind, s.first_use) for s in counted.specs)
    assert kinds[("sampler", False)] == 2 and kinds[("step", False)] == 2 + 2 + 1 and kinds[("step", True)] == 3
    assert main(["info", "--programs", "--model", str(path), "--max-num-seqs", "4", "--max-len", "300",
                 "--prefill-chunk", "64", "--batch-buckets", "1", "--mode", "regions", "--platform", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "regions mode" in out and f"warm-up compiles" in out
    regions = int(out.split("warm-up compiles ")[1].split()[0])
    assert regions > counted.warmup_programs       # a regions-mode step is one program per region
