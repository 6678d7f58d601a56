"""Tools around the engine: benchmarks (bench.py, compare.py against transformers, loadgen.py for the server),
size accounting (info.py), every compiled program of a config (programs.py) with the compile-safety rules
(graphcheck/) and StableHLO export (export.py), seeded random checkpoints (random_weights.py) and reference
checks (testing.py, memory.py)."""
