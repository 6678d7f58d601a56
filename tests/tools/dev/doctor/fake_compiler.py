"""A stand-in for neuronx-cc in the doctor's tests: `python fake_compiler.py [--fail-on REGEX] [--rate R]
[--seed S] [--counter FILE] [--code NCC_XXXX999] FILE` fails (exit 1, the error code in its log, as neuronx-cc
prints it) when the file's text matches REGEX, with probability R per compile. The draws are deterministic: the
k-th compile recorded in --counter draws hash(seed, k), so a test of crash rates knows what to expect. A clean
compile writes FILE.neff (the artefact) with the input's size."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys


def draw(seed: int, k: int) -> float:
    """A uniform number in [0, 1) for the k-th compile."""
    h = hashlib.sha256(f"{seed}:{k}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2 ** 64


def _next(counter: str | None) -> int:
    if counter is None:
        return 0
    k = int(open(counter).read() or 0) if os.path.exists(counter) else 0
    with open(counter, "w") as f:
        f.write(str(k + 1))
    return k


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fail-on", default=None)
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--counter", default=None)
    p.add_argument("--code", default="NCC_IINL902")
    p.add_argument("file")
    args = p.parse_args()
    text = open(args.file).read()
    k = _next(args.counter)
    print(f"fake-cc: compiling {os.path.basename(args.file)} ({len(text)} bytes)")
    if args.fail_on and re.search(args.fail_on, text) and draw(args.seed, k) < args.rate:
        print(f"ERROR 12345 [{args.code}] Internal compiler error: pattern {args.fail_on!r} is unsupported",
              file=sys.stderr)
        return 1
    with open(args.file.rsplit(".", 1)[0] + ".neff", "wb") as f:
        f.write(b"\0" * len(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
