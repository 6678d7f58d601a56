"""Speculative decoding: draft tokens with the checkpoint's own drafter, verify them in one target step, keep the
state exactly as plain decoding leaves it (undo.py). MTP (DeepSeek-V4) greedy so far: mtp_decode.py. DeepSeek-V4.1's
DSpark drafter: model/dspark.py, with DeepSeek's own draft protocol replayed by `draft_trace` (dspark_trace.py)."""

from .dspark_trace import draft_trace

__all__ = ["draft_trace"]
