"""Python-source prompts for `jdeep bench --prompts-file` on the demo model (docs/speculative.md): eight 400-character
slices of the standard library's os.py, tokenized with the demo model's tokenizer, one {"prompt_ids": [...]} per line.

    python scripts/code_prompts.py > code.jsonl
"""

from __future__ import annotations

import json
import os
import pathlib

from jdeep.io.tokenizer import Tokenizer

DEMO_TOKENIZER = pathlib.Path(__file__).resolve().parent.parent / "jdeep" / "demo_model" / "tokenizer.json"


def main() -> None:
    tok = Tokenizer(DEMO_TOKENIZER)
    with open(os.__file__, encoding="utf-8") as f:
        source = f.read()
    for start in range(0, 8000, 1000):
        print(json.dumps({"prompt_ids": tok.encode(source[start:start + 400])}))


if __name__ == "__main__":
    main()
