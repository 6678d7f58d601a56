"""`jdeep doctor`: Trainium bring-up in one command (docs/neuron.md, "Bring-up").

For a checkpoint folder or a released preset it reports the environment (environment.py), lowers every program jdeep
compiles, checks the compile-safety rules and compiles each with a compiler command — neuronx-cc on a Neuron host,
XLA:CPU standing in elsewhere — repeatedly, to measure crash rates (compiler.py), reduces every failure to the
smallest failing sub-program, written as a standalone StableHLO reproducer (reduce.py), runs the goldens' checks,
the NKI kernels against their twins and regions against scan on the device (numerics.py), measures dispatch cost,
TTFT / ITL and the host sampler's transfers (speed.py), and writes report.md, report.json and repro/ (run.py,
report.py)."""
