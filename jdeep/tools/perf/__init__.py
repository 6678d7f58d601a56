"""Benchmarks: `jdeep bench` (bench.py), speculative decoding (spec_bench.py), transformers (compare.py), mixed
workloads through the engine and load on a running server (mixed_load.py, loadgen.py), process memory."""
