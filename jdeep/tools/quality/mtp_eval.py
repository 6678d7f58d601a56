"""How well a model's MTP block predicts the token after next on real text — the number that bounds speculative
decoding with it (one drafted token per step).

Each text is cut into windows of `context` tokens, each run from position 0 through the backbone (model_step, the
model's numerics, logits at every position) and MTP block 0 (model/mtp.py) with the true next tokens. Per position t
with a token t+2: "mtp_top1", MTP's top-1 equals token t+2 of the text; "agreement", MTP's top-1 equals the
backbone's own top-1 at t+1 (the greedy acceptance rate of a one-token draft, teacher-forced); "main_top1", the
backbone's top-1 at t equals token t+1, for scale.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from ...model.cache import PROGRAMS
from ...model.model import Model
from ...model.mtp import empty_mtp_state, mtp_inputs, mtp_step
from ...model.scan import model_step
from ...state import empty_state

__all__ = ["window_logits", "mtp_accuracy", "format_mtp_table"]


def _program(config, plan, numerics, dtype, context: int):
    """The cached jit(params, tokens int32 [1, C], positions int32 [1, C]) -> (backbone logits, MTP logits),
    fp32 [1, C, V] each."""
    def run(params, tokens, positions):
        state = empty_state(config, plan, 1, context, dtype, numerics)
        out = model_step(params, state, tokens, positions, config=config, plan=plan, numerics=numerics,
                         all_logits=True, training=True)
        logits, aux = out.logits, out.training
        next_tokens, mtp_positions = mtp_inputs(tokens, positions)
        mtp_logits, _, _ = mtp_step(params, empty_mtp_state(config, plan, 1, context, dtype, numerics), aux["hidden"],
                                    next_tokens, mtp_positions, config=config, plan=plan,
                                    numerics=numerics)
        return logits, mtp_logits

    return PROGRAMS.get(("mtp_eval", config, plan, numerics, dtype, context), lambda: jax.jit(run))


def window_logits(model: Model, ids: np.ndarray, context: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The backbone's and MTP block 0's logits, float32 [T, V] each, at every position of ids int32 [T] run from
    position 0 (padded to `context`, default T): row t of the MTP logits is its distribution of token t+2 given
    token t+1 (the last row, without a token t+1, is meaningless)."""
    if model.plan.mtp is None:
        raise ValueError("the model was loaded without its MTP blocks: jdeep.load(path, drafter=True)")
    T = len(ids)
    context = T if context is None else context
    run = _program(model.config, model.plan, model.numerics, model.dtype, context)
    tokens = np.zeros((1, context), np.int32)
    tokens[0, :T] = ids
    positions = np.where(np.arange(context) < T, np.arange(context), -1).astype(np.int32)[None]
    main, mtp = run(model.params, tokens, positions)
    return np.asarray(main, np.float32)[0, :T], np.asarray(mtp, np.float32)[0, :T]


def mtp_accuracy(model: Model, texts: Sequence[np.ndarray], context: int = 256) -> dict:
    """{"positions", "mtp_top1", "agreement", "main_top1"} over token-id arrays `texts` (module docstring); the model
    must be loaded with its MTP blocks (jdeep.load(..., drafter=True))."""
    if model.plan.mtp is None:
        raise ValueError("the model was loaded without its MTP blocks: jdeep.load(path, drafter=True)")
    n = mtp_hits = agree = main_hits = 0
    for ids in texts:
        ids = np.asarray(ids, np.int32)
        for start in range(0, len(ids) - 2, context):
            w = ids[start:start + context]
            T = len(w)
            if T < 3:
                break
            main, mtp = (np.argmax(x, -1) for x in window_logits(model, w, context))
            n += T - 2
            mtp_hits += int(np.sum(mtp[:T - 2] == w[2:]))
            agree += int(np.sum(mtp[:T - 2] == main[1:T - 1]))
            main_hits += int(np.sum(main[:T - 2] == w[1:T - 1]))
    if n == 0:
        raise ValueError("no text of three tokens or more to score")
    return {"positions": n, "mtp_top1": mtp_hits / n, "agreement": agree / n, "main_top1": main_hits / n}


def format_mtp_table(results: dict[str, dict], context: int) -> str:
    """A text table of mtp_accuracy results, one row per name (a numerics mode)."""
    lines = [f"MTP block 0, windows of {context} tokens",
             f"{'mode':<14} {'positions':>9} {'MTP top-1 (t+2)':>16} {'= backbone top-1 (t+1)':>23} {'backbone top-1':>15}",
             "-" * 81]
    for name, r in results.items():
        lines.append(f"{name:<14} {r['positions']:>9} {r['mtp_top1']:>16.2%} {r['agreement']:>23.2%} "
                     f"{r['main_top1']:>15.2%}")
    return "\n".join(lines)
