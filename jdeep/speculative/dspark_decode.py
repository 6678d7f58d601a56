"""Speculative decoding with DeepSeek-V4.1's DSpark drafter (model/dspark.py), greedy and sampled: the method, what
it needs of a model, and its whole-batch programs (dspark_drafter.DSparkDrafter runs them for the engine and for
jdeep.generate's speculative path, generate.py).

Per row, an iteration starts from x (the last accepted token, at position p, not yet in the target state); the
target state holds positions < p, the drafter's windows the target hiddens of positions < p.

    draft    dspark_draft(x, p): the block d_1 .. d_block at positions p+1 .., of which the first k are verified.
             Each Markov-loop token is drawn through dspark_draft's `choose` hook from the row's transform of the
             drafter's (Markov-biased) logits, q_i = acceptance.distribution of them (argmax for greedy rows)
    verify   target steps over [x, d_1..d_k] at positions p .. p+k (all logits and the DSpark taps), then the
             acceptance rule (acceptance.py): a accepted drafts, g_0..g_a emitted (cut after a stop id and at
             max_new_tokens: n tokens); greedy rows get exactly plain greedy decoding's tokens
    restore  the target state entries that positions p+n .. p+k wrote are set back from an undo log (undo.py), so the
             state equals plain decoding's
    append   the taps of the kept positions p .. p+n-1 go into the drafter's windows (dspark_append); rejected
             positions are never written there, so the drafter needs no undo. Next x = g_a at p+a+1.

The verify runs as one target step when every ring of the state (window, compressor rings) has at least k+1
entries; otherwise as consecutive steps of at most `ring` positions (the shortest ring; undo logs are per step and
restored in reverse order). A compressor ring keeps only its chunk's last m positions, so a longer chunk would lose
kept positions' projections that a later group still pools (V4.1's ratio-m compressor ring has m entries; DeepSeek's
ratio 4 allows k <= 3 in one step, the tiny golden's ratio 2 allows k = 1).

Engram (V4.1 layers with Engram): a target step needs the table rows of its tokens, gathered on the host from the
n-gram history, and the drafts exist only after the draft program. So an iteration is two programs with a host step
between: draft -> host reads the drafts, gathers the rows of [x, d_1..d_k] from a copy of the history -> verify,
accept, restore, append -> host reads n and advances the real history by the kept tokens x, d_1..d_{n-1} only
(NgramHistory.advance), so the history always equals plain decoding's. Without Engram layers an iteration is one
program and blocks of `block_iterations` iterations run on the device between host reads (as MTP's do).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from ..model.cache import PROGRAMS
from ..model.model import Model
from ..model.spec import ModelSpec
from .dspark_iteration import draft, iterations, verify

__all__ = ["check_dspark_model", "check_dspark_spec", "check_k", "dead_tokens", "draft_program", "verify_program", "iterations_program"]


def check_dspark_model(model: Model) -> None:
    """Clear errors for what the DSpark drafter needs and this version does not run."""
    check_dspark_spec(model.spec)


def check_dspark_spec(spec: ModelSpec) -> None:
    """check_dspark_model for a model's spec (a loaded model's, or one built from a config for lowering)."""
    if spec.config.dspark is None:
        raise ValueError("speculative method 'dspark' needs a DeepSeek-V4.1 checkpoint with the DSpark drafter "
                         "(dspark_* in config.json); DeepSeek-V4 checkpoints draft with method 'mtp'")
    if spec.plan.dspark is None:
        raise ValueError("speculative decoding with method 'dspark' needs the checkpoint's DSpark stages loaded: "
                         "jdeep.load(path, drafter=True)")
    if spec.host_embedding or spec.layout is not None:
        raise ValueError("DSpark speculative decoding runs on one device with the embedding on the device so far (not "
                         "with host embedding or on a mesh)")


def check_k(spec: ModelSpec, k: int) -> None:
    """num_speculative_tokens k must lie in [1, the DSpark block size] (spec: a ModelSpec or a Model)."""
    block = spec.config.dspark.block_size
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= block:
        raise ValueError(f"num_speculative_tokens for 'dspark' must lie in [1, {block}] (the checkpoint's "
                         f"dspark_block_size {block}: the drafter drafts one block per iteration), got {k!r}")


def _kw(spec: ModelSpec) -> dict:
    return dict(config=spec.config, plan=spec.plan, numerics=spec.numerics)


def draft_program(spec: ModelSpec, greedy: bool):
    """(params, dstate, carry, sb) -> (drafts int32 [B, block], q or None): dspark_iteration.draft."""
    return PROGRAMS.keyed("dspark_spec_draft", spec,
                          lambda: jax.jit(functools.partial(draft, greedy=greedy, **_kw(spec))), greedy=greedy)


def verify_program(spec: ModelSpec, k: int, greedy: bool, keep_logits: bool = False):
    """dspark_iteration.verify (state and dstate donated)."""
    return PROGRAMS.keyed("dspark_spec_verify", spec, lambda: jax.jit(
        functools.partial(verify, k=k, greedy=greedy, keep_logits=keep_logits, **_kw(spec)), donate_argnums=(1, 2)),
        k=k, greedy=greedy, keep_logits=keep_logits)


def iterations_program(spec: ModelSpec, k: int, n: int, greedy: bool, keep_logits: bool = False):
    """n iterations as one program (dspark_iteration.iterations; state, dstate and carry donated)."""
    return PROGRAMS.keyed("dspark_spec_iterations", spec, lambda: jax.jit(
        functools.partial(iterations, n=n, k=k, greedy=greedy, keep_logits=keep_logits, **_kw(spec)),
        donate_argnums=(1, 2, 3)), k=k, n=n, greedy=greedy, keep_logits=keep_logits)


def dead_tokens(model: Model, tokens: np.ndarray) -> np.ndarray | None:
    """Which of tokens int [B, S] are dead for Engram (image tokens; None for models without image tokens)."""
    image = model.config.image_token_id
    return None if image is None else np.asarray(tokens) == image
