"""Speculative decoding: draft tokens with the checkpoint's own drafter, verify them in one target step, keep the
state exactly as plain decoding leaves it (undo.py). MTP (DeepSeek-V4) greedy so far: mtp_decode.py."""
