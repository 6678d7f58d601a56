"""Test support: seeded random checkpoints in DeepSeek's format (random_weights.py) and helpers for comparing jdeep
with reference outputs (reference.py)."""
