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
from ..model.dspark import dspark_append, dspark_draft, empty_dspark_state, greedy_choice
from ..model.model import Model
from ..model.scan import model_step
from ..runtime.sampling import SamplingBatch, SamplingParams, batch_params, sample
from ..runtime.steps import batch_bucket, length_bucket
from . import undo
from .acceptance import accept, accept_greedy, argmax_ids, distribution, draw, emit
from .mtp_decode import SpecStats, block_length, state_len, take_block

__all__ = ["Carry", "Final", "check_dspark_model", "check_k", "dspark_generate", "run", "run_full", "prefill_chunk",
           "draft", "verify", "iteration", "ring_entries", "dead_tokens",
           "draft_program", "verify_program"]

_DRAFT_TAG, _ACCEPT_TAG = 1, 1000


class Carry(NamedTuple):
    """Per-row state besides the caches: x int32 [B] (last accepted token, at position p, not in the target state),
    p int32 [B], count int32 [B] (tokens generated), done bool [B]."""

    x: jax.Array
    p: jax.Array
    count: jax.Array
    done: jax.Array


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
    if model.compile_mode != "scan" or model.host_embed is not None or model.layout is not None:
        raise ValueError("DSpark speculative decoding runs in the scan compile mode on one device with the embedding "
                         "on the device so far (not the regions mode, host embedding or a mesh)")


def check_k(model: Model, k: int) -> None:
    """num_speculative_tokens k must lie in [1, the DSpark block size]."""
    block = model.config.dspark.block_size
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= block:
        raise ValueError(f"num_speculative_tokens for 'dspark' must lie in [1, {block}] (the checkpoint's "
                         f"dspark_block_size {block}: the drafter drafts one block per iteration), got {k!r}")


def ring_entries(state: dict) -> int:
    """The shortest ring of a target state (entries less the scratch row): how many consecutive positions one
    target step may run and still be undone (undo.py)."""
    sizes = []

    def visit(d):
        sizes.extend(v.shape[2] - 1 for name, v in d.items() if name in undo.RINGS)

    for seg in state["segments"]:
        for slot in seg:
            visit(slot)
    for d in state["sources"].values():
        visit(d)
    return min(sizes)


def prefill_chunk(params, state, dstate, tokens, positions, engram, sb, *, config, plan, numerics,
                  greedy: bool = False):
    """A prompt chunk through the target with the DSpark taps, then every position into the drafter's windows.
    tokens, positions int32 [B, S] (-1 = padding). Returns (first token int32 [B], drawn from the logits at each
    row's last real position exactly as plain decoding draws it (runtime/sampling.sample, step 0), state, dstate);
    the first token means something only for rows whose prompt ends in this chunk. greedy: every row is greedy (the
    argmax without the sampler's noise: the same token, and no PRNG in the program)."""
    logits, state, taps = model_step(params, state, tokens, positions, engram, config=config, plan=plan,
                                     numerics=numerics, taps=True)
    first = argmax_ids(logits) if greedy else sample(logits, sb, jnp.zeros(tokens.shape[:1], jnp.int32))
    dstate = dspark_append(params, dstate, taps, positions, config=config, plan=plan, numerics=numerics)
    return first, state, dstate


def draft(params, dstate, carry: Carry, sb: SamplingBatch, *, config, plan, numerics, greedy: bool = False):
    """The drafter's block after each row's x: (drafts int32 [B, block], q fp32 [B, block, V] the distribution each
    draft was drawn from; None for a greedy program). Draft j is drawn with key (count, _DRAFT_TAG + j)."""
    x, p, count, _ = carry
    if greedy:
        choose = greedy_choice
    else:
        def choose(logits, j):
            return draw(distribution(logits[:, None], sb)[:, 0], sb, count, _DRAFT_TAG + j)
    ids, logits, _ = dspark_draft(params, dstate, x, p, config=config, plan=plan, numerics=numerics, choose=choose)
    return ids, (None if greedy else distribution(logits, sb))


def verify(params, state, dstate, carry: Carry, drafts, q, sb: SamplingBatch, stops, max_new, engram=None, *, k,
           config, plan, numerics, greedy: bool = False):
    """Verify the first k drafts (drafts int32 [B, >=k], q fp32 [B, >=k, V] or None for greedy), emit, restore the
    target state, append the kept positions to the drafter's windows. engram: the rows of [x, d_1..d_k] at
    p .. p+k ([n_eng, B, k+1, ...], models with Engram). stops int32 [B, W] (-1 = unused), max_new int32 [B].
    Returns (state, dstate, carry, emitted int32 [B, k+1] (-1 past what the row emits), accepted int32 [B] (-1 for
    rows that were done), kept int32 [B] (positions p .. p+kept-1 entered the state: 0 for done rows))."""
    x, p, count, done = carry
    live = ~done
    drafts = jnp.clip(drafts[:, :k], 0, config.vocab_size - 1)       # (indices from an input: Neuron's S12)
    offs = jnp.arange(k + 1, dtype=jnp.int32)
    pos = jnp.where(live[:, None], p[:, None] + offs[None, :], -1)                     # [B, k+1]
    tokens = jnp.concatenate([x[:, None], drafts], axis=1)                             # [B, k+1]
    split = min(ring_entries(state), k + 1)
    logs, logits, taps = [], [], []
    for s0 in range(0, k + 1, split):
        sl = slice(s0, min(s0 + split, k + 1))
        index = undo.entry_index(state, plan, pos[:, sl])
        logs.append((sl, index, undo.save(state, index)))
        eg = None if engram is None else tuple(e[:, :, sl] for e in engram)
        lg, state, tp = model_step(params, state, tokens[:, sl], pos[:, sl], eg, config=config, plan=plan,
                                   numerics=numerics, all_logits=True, taps=True)
        logits.append(lg)
        taps.append(tp)
    logits, taps = jnp.concatenate(logits, axis=1), jnp.concatenate(taps, axis=1)
    if greedy:
        g, a = accept_greedy(drafts, logits)
    else:
        g, a = accept(drafts, q[:, :k], distribution(logits, sb), sb, count, _ACCEPT_TAG)
    n, rejected, emitted, count, ended = emit(g, a, stops, max_new, count, live)
    # the state keeps positions p .. p+n-1 (x and the emitted tokens but the last), as plain decoding's would
    for sl, index, saved in reversed(logs):
        state = undo.restore(state, saved, index, rejected[:, sl])
    dstate = dspark_append(params, dstate, taps, jnp.where(rejected, -1, pos), config=config, plan=plan,
                           numerics=numerics)
    done = done | ended
    nxt = jnp.take_along_axis(g, jnp.clip(a, 0, k)[:, None], axis=1)[:, 0]          # (clamped index: S12)
    carry = Carry(jnp.where(live, nxt, x), jnp.where(live, p + a + 1, p), count, done)
    return state, dstate, carry, emitted, jnp.where(live, a, -1), n


def iteration(params, state, dstate, carry, sb, stops, max_new, *, k, config, plan, numerics, greedy=False):
    """draft then verify in one program (models without Engram layers)."""
    kw = dict(config=config, plan=plan, numerics=numerics, greedy=greedy)
    drafts, q = draft(params, dstate, carry, sb, **kw)
    return verify(params, state, dstate, carry, drafts, q, sb, stops, max_new, None, k=k, **kw)


def iterations(params, state, dstate, carry, sb, stops, max_new, *, n, k, config, plan, numerics, greedy=False):
    """n iterations as one scan (no Engram): (state, dstate, carry, emitted int32 [n, B, k+1], accepted [n, B])."""
    step = functools.partial(iteration, k=k, config=config, plan=plan, numerics=numerics, greedy=greedy)

    def body(c, _):
        state, dstate, carry = c
        state, dstate, carry, emitted, a, _ = step(params, state, dstate, carry, sb, stops, max_new)
        return (state, dstate, carry), (emitted, a)

    (state, dstate, carry), (emitted, a) = jax.lax.scan(body, (state, dstate, carry), None, length=n)
    return state, dstate, carry, emitted, a


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
    prefill = prefill_program(model, all(s.temperature == 0 for s in sampling))
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
    greedy = all(s.temperature == 0 for s in sampling)
    stops, max_new_d = jnp.asarray(stops), jnp.asarray(max_new)
    offs = np.arange(k + 1, dtype=np.int32)
    while not done.all():
        if history is not None:
            # Engram: a host step per iteration (the rows of the drafts are gathered once the drafts are known)
            drafts, q = draft_program(model, greedy)(model.params, dstate, carry, sb)
            x_h, p_h = np.asarray(carry.x), np.asarray(carry.p)
            tokens = np.concatenate([x_h[:, None], np.asarray(drafts)[:, :k]], axis=1).astype(np.int32)
            pos = np.where(done[:, None], -1, p_h[:, None] + offs[None, :]).astype(np.int32)
            engram = model.engram_inputs(history.copy(), tokens, pos)
            state, dstate, carry, emitted, a, kept = verify_program(model, k, greedy)(
                model.params, state, dstate, carry, drafts, q, sb, stops, max_new_d, engram)
            history.advance(tokens, np.asarray(kept), dead_tokens(model, tokens))
            emitted, a = np.asarray(emitted)[None], np.asarray(a)[None]
        else:
            n = block_length(stats, done, max_new, count, block_iterations)
            state, dstate, carry, emitted, a = iterations_program(model, k, n, greedy)(
                model.params, state, dstate, carry, sb, stops, max_new_d)
            emitted, a = np.asarray(emitted), np.asarray(a)
        carry, done = take_block(emitted, a, out, count, stats, carry, on_block, B)
    return out[:B], stats.as_dict(), Final(state, dstate, history)
