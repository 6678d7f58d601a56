"""Running a loaded model: request validation (requests.py), per-request sampling on the device (sampling.py),
stop strings (stops.py), the step helpers (steps.py: buckets, the prefill packer, the decode loop), the notebook
API (generate.py) and the continuous-batching engine (engine.py)."""
