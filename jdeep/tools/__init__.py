"""Tools around the engine, by audience: `dev/` for deploying and debugging (check-graph's compile-safety rules in
graphcheck/, the programs a config compiles, StableHLO export, the Neuron bring-up doctor, size and collective
accounting), `perf/` for benchmarks (`jdeep bench`, speculative decoding, a transformers comparison, server load),
`quality/` for evaluation and training (perplexity and KL, MTP accuracy, the demo model's training), and `testing/`
for test support (seeded random checkpoints in DeepSeek's format, reference-comparison helpers)."""
