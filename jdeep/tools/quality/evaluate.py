"""Quality on real text: perplexity of a model over text files and, against a base model, the per-token KL
divergence, top-1 agreement and Δppl — the statistics llama.cpp's perplexity tool reports for quantisation.

A text is tokenized (the model's tokenizer.json, BOS first) and scored with a sliding context: window k covers
tokens [k·stride, k·stride + context) and scores the targets the previous window did not reach, each predicted
from at most `context` tokens before it (every token after the first is scored exactly once). A window runs as
the engine's chunked prefill (runtime/steps.py) with logits at every position, so any compile mode, numerics
and placement the model was loaded with is what is measured.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ...config import ModelConfig
from ...model.load import load
from ...model.model import Model
from ...param_spec import weight_formats
from ...runtime.steps import length_bucket, pack_chunk, run_step

__all__ = ["EvalError", "TokenStats", "NUMERICS_MODES", "load_modes", "windows", "window_logits", "score_text",
           "compare", "read_texts", "format_table"]

# The numerics modes of a quantized checkpoint, as jdeep.load keywords
NUMERICS_MODES = {
    "float": dict(quantize_activations=False),          # quantized weights, float activations / KV / indexer
    "deepseek": dict(quantize_activations=True),        # DeepSeek's numerics: fp8 activations, KV and indexer QAT
    "packed-kv": dict(quantize_activations=True, packed_kv=True),   # the KV cache as uint8 records
    "trn2-240": dict(quantize_activations=True, fp8_max=240.0),     # trn2's e4m3 range
    "trn2-224": dict(quantize_activations=True, fp8_max=224.0),
}


class EvalError(ValueError):
    """An input the evaluation cannot score (empty file, text shorter than two tokens, no tokenizer)."""


def load_modes(path: str | os.PathLike, names: Sequence[str], **load_kwargs) -> dict[str, Model]:
    """The checkpoint at `path` loaded once per numerics mode (NUMERICS_MODES names); ValueError for an unknown
    name, or a mode other than "float" on an unquantized checkpoint (which has only float weights)."""
    quantized = weight_formats(ModelConfig.from_file(path))[0] != "float"
    for name in names:
        if name not in NUMERICS_MODES:
            raise EvalError(f"unknown numerics mode {name!r}: choose from {', '.join(NUMERICS_MODES)}")
        if name != "float" and not quantized:
            raise EvalError(f"numerics mode {name!r} needs a quantized (fp8/fp4) checkpoint; {path} has float weights")
    return {name: load(path, **NUMERICS_MODES[name], **load_kwargs) for name in names}


def windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored target) of each window over n tokens: targets [first, end) are scored from the
    tokens [start, target) before them; together the windows score targets 1 .. n-1 once each."""
    if context < 2 or not 1 <= stride <= context - 1:
        raise EvalError(f"context must be >= 2 and stride in [1, context - 1], got context={context}, stride={stride}")
    out, start, done = [], 0, 1
    while done < n:
        end = min(start + context, n)
        out.append((start, end, done))
        done, start = end, start + stride
    return out


def window_logits(model: Model, ids: np.ndarray, chunk: int) -> np.ndarray:
    """Logits float32 [len(ids), V] at every position of one sequence, run as chunked prefill on a fresh state."""
    T = len(ids)
    state = model.init_state(1, length_bucket(T, 256))
    history = model.new_history(1)
    rows = []
    for start in range(0, T, chunk):
        toks, pos, taken = pack_chunk([ids], [start], 1, chunk)
        logits, state = run_step(model, state, toks, pos, history, all_logits=True)
        rows.append(model.fetch(logits)[0, :taken[0]])
    return np.concatenate(rows).astype(np.float32)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@dataclass
class TokenStats:
    """Per-token statistics of the scored targets: nll (natural log), and against a base model kl (KL(base ||
    model), nats) and agree (same argmax)."""

    nll: list[np.ndarray] = field(default_factory=list)
    base_nll: list[np.ndarray] = field(default_factory=list)
    kl: list[np.ndarray] = field(default_factory=list)
    agree: list[np.ndarray] = field(default_factory=list)

    def add(self, logp: np.ndarray, targets: np.ndarray, base_logp: np.ndarray | None = None) -> None:
        """logp float64 [N, V] log-probabilities predicting targets int [N]; base_logp the base model's."""
        self.nll.append(-logp[np.arange(len(targets)), targets])
        if base_logp is not None:
            self.base_nll.append(-base_logp[np.arange(len(targets)), targets])
            self.kl.append(np.sum(np.exp(base_logp) * (base_logp - logp), axis=-1))
            self.agree.append(np.argmax(logp, axis=-1) == np.argmax(base_logp, axis=-1))

    def summary(self) -> dict:
        nll = np.concatenate(self.nll)
        out = {"tokens": int(nll.size), "nll": float(nll.mean()), "ppl": math.exp(float(nll.mean()))}
        if self.kl:
            kl = np.concatenate(self.kl)
            base_ppl = math.exp(float(np.concatenate(self.base_nll).mean()))
            out.update(base_ppl=base_ppl, delta_ppl=out["ppl"] - base_ppl, kl_mean=float(kl.mean()),
                       kl_p99=float(np.percentile(kl, 99)), top1_agreement=float(np.concatenate(self.agree).mean()))
        return out


def score_text(model: Model, ids: Sequence[int], stats: TokenStats, *, context: int = 512, stride: int | None = None,
               chunk: int = 256, base: Model | None = None, on_window: Callable[[], None] | None = None) -> None:
    """Add the scored targets of one token sequence to `stats` (and, with `base`, their KL and agreement)."""
    ids = np.asarray(ids, np.int32)
    if len(ids) < 2:
        raise EvalError(f"a text of {len(ids)} token(s) has nothing to score (needs at least two tokens)")
    stride = stride or max(1, context // 2)
    for start, end, first in windows(len(ids), context, stride):
        part = ids[start:end]
        rows = slice(first - 1 - start, end - 1 - start)      # row j predicts token start + j + 1
        targets = ids[first:end]
        logp = _log_softmax(window_logits(model, part, chunk)[rows])
        base_logp = None if base is None else _log_softmax(window_logits(base, part, chunk)[rows])
        stats.add(logp, targets, base_logp)
        if on_window is not None:
            on_window()


def read_texts(paths: Sequence[str | os.PathLike], tokenizer, bos: int | None) -> list[tuple[str, np.ndarray]]:
    """(path, token ids int32 [T]) per text file, BOS first when the model has one; EvalError naming the file
    that is missing, empty or shorter than two tokens, or when there is no tokenizer."""
    if tokenizer is None:
        raise EvalError("the model has no tokenizer (no tokenizer.json in its folder): text cannot be scored")
    out = []
    for path in paths:
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise EvalError(f"{path}: cannot read it as UTF-8 text: {e}") from None
        if not text.strip():
            raise EvalError(f"{path} is empty")
        ids = ([] if bos is None else [bos]) + tokenizer.encode(text)
        if len(ids) < 2:
            raise EvalError(f"{path} has {len(ids)} token(s): at least two are needed to score one")
        out.append((path, np.asarray(ids, np.int32)))
    return out


def compare(models: dict[str, Model], texts: list[tuple[str, np.ndarray]], *, base: Model | None = None,
            context: int = 512, stride: int | None = None, chunk: int = 256,
            progress: Callable[[int], Callable[[], None]] | None = None) -> dict:
    """Score every text under each named model (a numerics mode) and, with `base`, against the base distribution.
    progress(total windows) -> a callback per window. Returns {"context", "stride", "modes": {name: summary}}."""
    stride = stride or max(1, context // 2)
    n_windows = sum(len(windows(len(ids), context, stride)) for _, ids in texts) * len(models)
    tick = progress(n_windows) if progress is not None else None
    modes = {}
    for name, model in models.items():
        stats = TokenStats()
        for _, ids in texts:
            score_text(model, ids, stats, context=context, stride=stride, chunk=chunk,
                       base=None if model is base else base, on_window=tick)
        summary = stats.summary()
        if model is base:
            summary.update(base_ppl=summary["ppl"], delta_ppl=0.0, kl_mean=0.0, kl_p99=0.0, top1_agreement=1.0)
        modes[name] = summary
    return {"context": context, "stride": stride, "modes": modes}


def format_table(result: dict) -> str:
    """The result as a text table, one row per numerics mode."""
    cols = [("mode", "{}"), ("tokens", "{:d}"), ("ppl", "{:.4f}"), ("Δppl", "{:+.4f}"), ("KL mean", "{:.3e}"),
            ("KL p99", "{:.3e}"), ("top-1 agree", "{:.2%}")]
    keys = {"Δppl": "delta_ppl", "KL mean": "kl_mean", "KL p99": "kl_p99", "top-1 agree": "top1_agreement"}
    rows = [[c for c, _ in cols]]
    for name, s in result["modes"].items():
        row = []
        for c, fmt in cols:
            v = name if c == "mode" else s.get(keys.get(c, c))
            row.append("-" if v is None else fmt.format(v))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    head = f"context {result['context']}, stride {result['stride']}"
    return "\n".join([head, lines[0], "-" * len(lines[0])] + lines[1:])
