"""Speculative decoding with DeepSeek-V4.1's DSpark drafter (model/dspark.py), greedy and sampled.

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
program and blocks of `block_iterations` iterations run on the device between host reads (as mtp_decode).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..model.cache import PROGRAMS
from ..model.dspark import empty_dspark_state
from ..model.model import Model
from ..runtime.sampling import SamplingParams, batch_params
from ..runtime.steps import batch_bucket, length_bucket
from .dspark_iteration import Carry, draft, iterations, prefill_chunk, verify
from .dspark_regions import RegionsPrograms
from .mtp_decode import SpecStats, block_length, state_len, take_block

__all__ = ["Final", "check_dspark_model", "check_k", "dspark_generate", "run", "run_full", "dead_tokens",
           "prefill_program", "draft_program", "verify_program", "iterations_program"]


class Final(NamedTuple):
    """What a run leaves: the target state, the drafter's windows and the Engram histories (None without Engram)."""

    state: dict
    dstate: dict
    history: Any


def check_dspark_model(model: Model) -> None:
    """Clear errors for what the DSpark drafter needs and this version does not run."""
    if model.config.dspark is None:
        raise ValueError("speculative method 'dspark' needs a DeepSeek-V4.1 checkpoint with the DSpark drafter "
                         "(dspark_* in config.json); DeepSeek-V4 checkpoints draft with method 'mtp'")
    if model.plan.dspark is None:
        raise ValueError("speculative decoding with method 'dspark' needs the checkpoint's DSpark stages loaded: "
                         "jdeep.load(path, mtp=True)")
    if model.host_embed is not None or model.layout is not None:
        raise ValueError("DSpark speculative decoding runs on one device with the embedding on the device so far (not "
                         "with host embedding or on a mesh)")


def check_k(model: Model, k: int) -> None:
    """num_speculative_tokens k must lie in [1, the DSpark block size]."""
    block = model.config.dspark.block_size
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= block:
        raise ValueError(f"num_speculative_tokens for 'dspark' must lie in [1, {block}] (the checkpoint's "
                         f"dspark_block_size {block}: the drafter drafts one block per iteration), got {k!r}")


def _kw(model: Model) -> dict:
    return dict(config=model.config, plan=model.plan, numerics=model.numerics)


def _key(model: Model) -> tuple:
    return (model.config, model.plan, model.numerics)


def prefill_program(model: Model, greedy: bool):
    return PROGRAMS.get(("dspark_spec_prefill", greedy) + _key(model),
                        lambda: jax.jit(functools.partial(prefill_chunk, greedy=greedy, **_kw(model)),
                                        donate_argnums=(1, 2)))


def draft_program(model: Model, greedy: bool):
    return PROGRAMS.get(("dspark_spec_draft", greedy) + _key(model),
                        lambda: jax.jit(functools.partial(draft, greedy=greedy, **_kw(model))))


def verify_program(model: Model, k: int, greedy: bool):
    return PROGRAMS.get(("dspark_spec_verify", k, greedy) + _key(model),
                        lambda: jax.jit(functools.partial(verify, k=k, greedy=greedy, **_kw(model)),
                                        donate_argnums=(1, 2)))


def iterations_program(model: Model, k: int, n: int, greedy: bool):
    return PROGRAMS.get(("dspark_spec_iterations", k, n, greedy) + _key(model),
                        lambda: jax.jit(functools.partial(iterations, n=n, k=k, greedy=greedy, **_kw(model)),
                                        donate_argnums=(1, 2, 3)))


def dspark_generate(model: Model, prompts: Sequence[np.ndarray], sampling: Sequence[SamplingParams],
                    stop_ids: Sequence[tuple[int, ...]], k: int, prefill_chunk_size: int = 512, default_seed: int = 0,
                    on_block: Callable[[list[list[int]]], Sequence[int]] | None = None,
                    block_iterations: int = 8) -> tuple[np.ndarray, dict]:
    """Tokens of each prompt (int32 [B, max max_new_tokens], -1 after a request ended) with k DSpark draft tokens per
    iteration, sampled per request as `sampling` says (greedy rows: exactly plain greedy decoding's tokens), and the
    acceptance stats (mtp_decode.SpecStats.as_dict). on_block(new tokens per row) runs after the first token and
    after every host read (every iteration with Engram layers, else every block of up to `block_iterations`); it
    returns the rows to end (stop strings)."""
    out, stats, _ = run_full(model, prompts, sampling, stop_ids, k, prefill_chunk_size, default_seed, on_block,
                             block_iterations)
    return out, stats


def run(model: Model, prompts, sampling, stop_ids, k: int, prefill_chunk_size: int = 512, default_seed: int = 0,
        on_block=None, block_iterations: int = 8) -> tuple[np.ndarray, dict, dict]:
    """dspark_generate, also returning the target state at the end (row b holds its prompt and every emitted token
    but the last, as plain decoding's state would)."""
    out, stats, final = run_full(model, prompts, sampling, stop_ids, k, prefill_chunk_size, default_seed, on_block,
                                 block_iterations)
    return out, stats, final.state


def dead_tokens(model: Model, tokens: np.ndarray) -> np.ndarray | None:
    """Which of tokens int [B, S] are dead for Engram (image tokens; None for models without image tokens)."""
    image = model.config.image_token_id
    return None if image is None else np.asarray(tokens) == image


def run_full(model: Model, prompts, sampling, stop_ids, k: int, prefill_chunk_size: int = 512,
             default_seed: int = 0, on_block=None, block_iterations: int = 8) -> tuple[np.ndarray, dict, Final]:
    """run, returning the whole Final (target state, drafter windows, Engram histories)."""
    check_dspark_model(model)
    check_k(model, k)
    B, Bb = len(prompts), batch_bucket(len(prompts))
    max_new = np.array([s.max_new_tokens for s in sampling] + [1] * (Bb - B), np.int32)
    lens = np.array([len(p) for p in prompts] + [0] * (Bb - B))
    max_len = state_len([len(p) for p in prompts], max_new[:B], k)
    state = model.init_state(Bb, max_len)
    dstate = jax.device_put(empty_dspark_state(model.config, model.plan, Bb, max_len, model.dtype, model.numerics),
                            jax.devices()[0])
    history = model.new_history(Bb)
    sb = batch_params(list(sampling), Bb, default_seed=default_seed)
    width = max(1, max(len(s) for s in stop_ids))
    stops = np.full((Bb, width), -1, np.int32)
    for b, s in enumerate(stop_ids):
        stops[b, :len(s)] = s
    greedy = all(s.temperature == 0 for s in sampling)
    rp = RegionsPrograms(model, k, greedy) if model.compile_mode == "regions" else None
    prefill = prefill_program(model, greedy) if rp is None else rp.prefill
    first = None
    for start in range(0, int(lens.max()), prefill_chunk_size):
        S = length_bucket(min(prefill_chunk_size, int(lens.max()) - start))
        toks = np.zeros((Bb, S), np.int32)
        pos = np.full((Bb, S), -1, np.int32)
        for b in range(B):
            n = int(np.clip(lens[b] - start, 0, S))
            toks[b, :n] = prompts[b][start:start + n]
            pos[b, :n] = np.arange(start, start + n)
        engram = model.engram_inputs(history, toks, pos)
        f, state, dstate = prefill(model.params, state, dstate, toks, pos, engram, sb)
        ends = jnp.asarray((lens > start) & (lens <= start + S))
        first = f if first is None else jnp.where(ends, f, first)
    x = np.asarray(first)
    out = np.full((Bb, int(max_new[:B].max())), -1, np.int32)
    out[:, 0] = x
    count = np.ones(Bb, np.int32)
    done = np.array([b >= B or max_new[b] <= 1 or x[b] in stop_ids[b] for b in range(Bb)])
    ended = set(on_block([[int(x[b])] for b in range(B)]) if on_block else ())
    done[list(ended)] = True
    carry = Carry(*model.commit((x, lens.astype(np.int32), count, done)))
    stats = SpecStats(k)
    stops, max_new_d = jnp.asarray(stops), jnp.asarray(max_new)
    offs = np.arange(k + 1, dtype=np.int32)
    while not done.all():
        if history is not None or rp is not None:
            # a host step per iteration: Engram rows of the drafts are gathered once the drafts are known; the
            # regions mode's programs are called from the host
            drafts, q = (draft_program(model, greedy) if rp is None else rp.drafts)(model.params, dstate, carry, sb)
            if history is not None:
                x_h, p_h = np.asarray(carry.x), np.asarray(carry.p)
                tokens = np.concatenate([x_h[:, None], np.asarray(drafts)[:, :k]], axis=1).astype(np.int32)
                pos = np.where(done[:, None], -1, p_h[:, None] + offs[None, :]).astype(np.int32)
                seen = history.copy()
            if rp is None:
                state, dstate, carry, emitted, a, kept = verify_program(model, k, greedy)(
                    model.params, state, dstate, carry, drafts, q, sb, stops, max_new_d,
                    model.engram_inputs(seen, tokens, pos))
            else:
                engram = None if history is None else [model.engram_inputs(seen, tokens[:, sl], pos[:, sl])
                                                       for sl in rp.slices(state)]
                state, dstate, carry, emitted, a, kept = rp.verify(model.params, state, dstate, carry, drafts, q, sb,
                                                                   stops, max_new_d, engram)
            if history is not None:
                history.advance(tokens, np.asarray(kept), dead_tokens(model, tokens))
            emitted, a = np.asarray(emitted)[None], np.asarray(a)[None]
        else:
            n = block_length(stats, done, max_new, count, block_iterations)
            state, dstate, carry, emitted, a = iterations_program(model, k, n, greedy)(
                model.params, state, dstate, carry, sb, stops, max_new_d)
            emitted, a = np.asarray(emitted), np.asarray(a)
        carry, done = take_block(emitted, a, out, count, stats, carry, on_block, B)
    return out[:B], stats.as_dict(), Final(state, dstate, history)
