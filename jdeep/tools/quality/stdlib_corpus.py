"""The demo model's text: the .py files of the running Python's standard library (sysconfig's stdlib path,
site-packages excluded), split by file into training and validation by a CRC32 of the file's relative path, so
every machine has the same split of its Python version's stdlib without a download."""

from __future__ import annotations

import glob
import os
import sysconfig
import zlib

__all__ = ["stdlib_files", "read_text"]


def stdlib_files(val_every: int = 50) -> tuple[list[str], list[str]]:
    """(training files, validation files), sorted paths: 1 file in `val_every` is validation."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True) if "site-packages" not in f)
    val = [zlib.crc32(os.path.relpath(f, root).encode()) % val_every == 0 for f in files]
    return [f for f, v in zip(files, val) if not v], [f for f, v in zip(files, val) if v]


def read_text(path: str) -> str:
    """A source file's text (undecodable bytes replaced)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()
