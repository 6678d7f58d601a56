"""DeepSeek's own DSpark protocol (the `__main__` smoke test of DeepSeek-V4.1's inference/model.py), replayed: the
target decodes plainly and greedily, and after every decode step the drafter drafts a block from the target's newest
token; the drafts are recorded, not verified. This is what the golden `v41-dspark-tiny` holds, so it checks the
drafter end to end (model/dspark.py).

    prefill the prompt (positions 0..L-1), seed the stages' windows with its main hiddens   (forward_spec at 0)
    for s = 1..n_steps: target step on greedy[s-1] at position p = L+s-1 -> greedy[s] and the main hidden of p;
                        append p to the windows, draft from anchor greedy[s] at position p+1  (forward_spec at p)
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from ..model.cache import PROGRAMS
from ..model.dspark import dspark_append, dspark_draft, empty_dspark_state
from ..model.model import Model
from ..model.scan import model_step
from ..runtime.steps import length_bucket

__all__ = ["draft_trace"]



def _taps(out) -> tuple:
    """(logits, state, main_hidden) of a model_step(taps=True) output."""
    return out.logits, out.state, out.taps

def draft_trace(model: Model, prompt_ids, n_steps: int, forced=None, *, pad_to: int | None = None
                ) -> dict[str, np.ndarray]:
    """Greedy target decoding of one prompt for n_steps steps with a DSpark draft after each.

    model: jdeep.load(..., drafter=True) of a DeepSeek-V4.1 checkpoint with DSpark (one device, device embedding).
    forced (optional, int [n_steps+1]): teacher forcing, the tokens fed to the target and drafted from instead of
    its own greedy choices (to compare drafts where a chaotic target would otherwise drift off a reference path).
    pad_to: the prefill chunk length (>= the prompt's; default its power-of-two bucket); prompts traced with one
    pad_to share every compiled program.
    Returns numpy arrays: greedy int32 [n_steps+1] (the target's argmax after the prefill and after each step),
    draft_ids int32 [n_steps, block+1] (row s-1: the anchor greedy[s] (forced[s] when forced), then d_1..d_block),
    draft_logits float32 [n_steps, block, V] (Markov bias included), confidence float32 [n_steps, block]."""
    _check(model)
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    L = len(prompt)
    if L == 0 or n_steps < 1:
        raise ValueError("draft_trace needs a non-empty prompt and n_steps >= 1")
    if forced is not None:
        forced = np.asarray(forced, np.int32).reshape(-1)
        if len(forced) < n_steps + 1:
            raise ValueError(f"forced holds {len(forced)} tokens, n_steps={n_steps} needs {n_steps + 1}")
    config, plan, numerics, params = model.config, model.plan, model.numerics, model.params
    step, append, draft = _programs(model)

    S = length_bucket(L) if pad_to is None else int(pad_to)     # padding: position -1
    if S < L:
        raise ValueError(f"pad_to={pad_to} is shorter than the prompt ({L} tokens)")
    tokens = np.zeros((1, S), np.int32)
    tokens[0, :L] = prompt
    positions = np.where(np.arange(S) < L, np.arange(S), -1).astype(np.int32)[None]
    state = model.init_state(1, length_bucket(S + n_steps))
    dstate = jax.device_put(empty_dspark_state(config, plan, 1, S + n_steps, model.dtype, numerics),
                            jax.devices()[0])
    history = model.new_history(1)

    logits, state, main_hidden = _taps(step(params, state, tokens, positions,
                                            model.engram_inputs(history, tokens, positions)))
    dstate = append(params, dstate, main_hidden, positions)
    greedy = [int(np.argmax(np.asarray(logits)[0]))]
    path = greedy if forced is None else forced     # the tokens the target is fed and the drafts start from
    ids, draft_logits, confidence = [], [], []
    for s in range(1, n_steps + 1):
        pos = L + s - 1
        tok, at = np.asarray([[path[s - 1]]], np.int32), np.asarray([[pos]], np.int32)
        logits, state, main_hidden = _taps(step(params, state, tok, at, model.engram_inputs(history, tok, at)))
        greedy.append(int(np.argmax(np.asarray(logits)[0])))
        dstate = append(params, dstate, main_hidden, at)
        anchor = int(path[s])
        d_ids, d_logits, conf = draft(params, dstate, np.asarray([anchor], np.int32), np.asarray([pos + 1], np.int32))
        ids.append(np.concatenate([[anchor], np.asarray(d_ids)[0]]))
        draft_logits.append(np.asarray(d_logits)[0])
        confidence.append(np.asarray(conf)[0])
    return {"greedy": np.asarray(greedy, np.int32), "draft_ids": np.stack(ids).astype(np.int32),
            "draft_logits": np.stack(draft_logits).astype(np.float32),
            "confidence": np.stack(confidence).astype(np.float32)}


def _check(model: Model) -> None:
    if model.plan.dspark is None:
        raise ValueError("draft_trace needs the DSpark stages: jdeep.load(..., drafter=True) on a DeepSeek-V4.1 "
                         "checkpoint with DSpark")
    if model.compile_mode != "scan" or model.host_embed is not None or model.layout is not None:
        raise ValueError("draft_trace runs the scan compile mode on one device with the embedding on the device "
                         "(compile_mode='scan', no host_embedding, no mesh)")


def _programs(model: Model):
    """(target step returning the taps, dspark_append, dspark_draft), jitted once per architecture and numerics."""
    config, plan, numerics = model.config, model.plan, model.numerics
    kw = dict(config=config, plan=plan, numerics=numerics)

    step = PROGRAMS.get(("dspark_target_step", config, plan, numerics),
                        lambda: jax.jit(functools.partial(model_step, taps=True, **kw), donate_argnums=(1,)))
    append = PROGRAMS.get(("dspark_append", config, plan, numerics),
                          lambda: jax.jit(functools.partial(dspark_append, **kw), donate_argnums=(1,)))
    draft = PROGRAMS.get(("dspark_draft", config, plan, numerics),
                         lambda: jax.jit(functools.partial(dspark_draft, **kw)))
    return step, append, draft
