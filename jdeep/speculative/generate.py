"""jdeep.generate's speculative path, for every drafter (drafter.Drafter: MTP on DeepSeek-V4, DSpark on V4.1): the
prompts' prefill chunks through the drafter's prefill (the engine's own program over a window of the whole batch),
then blocks of iterations between host reads (Drafter.block: n iterations as one program where the drafter allows,
else one iteration per host step), greedy and sampled.

Rows end on the device at their stop ids and max_new_tokens (the programs take them), and between blocks at the stop
strings `on_block` reports; a block runs `block_iterations` iterations while the longest running row needs that many
at the acceptance seen so far, then single iterations (two compiled programs per k).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..model.model import Model
from ..runtime.sampling import TOP_LOGPROBS_WIDTH, SamplingParams, batch_params
from ..runtime.steps import batch_bucket, length_bucket
from .drafter import Emitted, PrefillChunk, RowCarry
from .engine import make_drafter
from .stats import SpecStats

__all__ = ["Final", "Run", "speculative_generate", "run", "state_len", "block_length"]


class Final(NamedTuple):
    """What a run leaves: the target state (row b holds its prompt and every emitted token but the last, as plain
    decoding's state would), the drafter's state and the Engram histories (None without Engram)."""

    state: dict
    dstate: Any
    history: Any


class Run(NamedTuple):
    """A speculative run's results: tokens int32 [B, T = max max_new_tokens] (-1 after a request ended), stats
    (SpecStats.as_dict), final (Final), and outputs: an acceptance.Emitted [B, T] whose logprob fields (with
    logprobs=True) and logits f32 [B, T, V] (with logits=True; NaN after a request ended) are the target's at each
    emitted token, as plain decoding reports them, else None."""

    tokens: np.ndarray
    stats: dict
    final: Final
    outputs: Emitted


def state_len(prompt_lens: Sequence[int], max_new: Sequence[int], k: int) -> int:
    """The cache length a batch needs: its longest prompt + max_new_tokens, plus the k + 1 verified positions."""
    return length_bucket(max(int(n) + int(m) for n, m in zip(prompt_lens, max_new)) + k + 1, 256)


def block_length(stats: SpecStats, done: np.ndarray, max_new: np.ndarray, count: np.ndarray,
                 block_iterations: int) -> int:
    """Iterations of the next block: a whole block while the longest running row needs that many at the acceptance
    seen so far, then single iterations (two compiled programs per k)."""
    per_iter = 1 + stats.accepted / max(stats.iterations, 1)
    need = int(np.ceil(np.max(np.where(done, 0, max_new - count)) / per_iter))
    return block_iterations if need >= block_iterations else 1


def _take_block(emitted: Emitted, accepted: np.ndarray, out: Emitted, count: np.ndarray, stats: SpecStats,
                carry: RowCarry, on_block, B: int) -> tuple[RowCarry, np.ndarray]:
    """After a block (emitted: Emitted [n, Bb, k+1], accepted int32 [n, Bb]): count the acceptance, append each row's
    tokens (and their logprobs, where out holds them) to out at count (both updated in place), and end the rows
    on_block names (stop strings). Returns (carry, done bool [Bb])."""
    stats.add(accepted[:, :B])
    new = []
    for b in range(B):
        kept = emitted.tokens[:, b].reshape(-1) >= 0
        n, at = int(kept.sum()), count[b]
        for dst, src in zip(out, emitted):
            if dst is not None:
                dst[b, at:at + n] = src[:, b].reshape((-1,) + src.shape[3:])[kept]
        new.append(out.tokens[b, at:at + n].tolist())
        count[b] += n
    done = np.asarray(carry.done).copy()
    stop_rows = [b for b in (on_block(new) if on_block else ()) if not done[b]]
    if stop_rows:
        done[stop_rows] = True
        carry = carry._replace(done=jax.device_put(done, carry.done.sharding))    # placed as the program's output
    return carry, done


def speculative_generate(model: Model, prompts: Sequence[np.ndarray], sampling: Sequence[SamplingParams],
                         stop_ids: Sequence[tuple[int, ...]], method: str, k: int, prefill_chunk_size: int = 512,
                         default_seed: int = 0, on_block: Callable[[list[list[int]]], Sequence[int]] | None = None,
                         block_iterations: int = 8, logprobs: bool = False, logits: bool = False) -> Run:
    """The tokens of each prompt with k drafts of `method` ("mtp" or "dspark") per iteration, sampled per request as
    `sampling` says (greedy rows: exactly plain greedy decoding's tokens), the acceptance stats and, as asked, each
    token's logprobs and logits (Run). on_block(new tokens per row) runs after the first token and after every host
    read; it returns the rows to end (stop strings)."""
    return run(model, prompts, sampling, stop_ids, method, k, prefill_chunk_size, default_seed, on_block,
               block_iterations, logprobs, logits)


def run(model: Model, prompts, sampling, stop_ids, method: str, k: int, prefill_chunk_size: int = 512,
        default_seed: int = 0, on_block=None, block_iterations: int = 8, logprobs: bool = False,
        logits: bool = False) -> Run:
    """speculative_generate (module docstring)."""
    drafter = make_drafter(model, method, k)
    B, Bb = len(prompts), batch_bucket(len(prompts))
    max_new = np.array([s.max_new_tokens for s in sampling] + [1] * (Bb - B), np.int32)
    lens = np.array([len(p) for p in prompts] + [0] * (Bb - B))
    max_len = state_len([len(p) for p in prompts], max_new[:B], k)
    state, dstate = model.init_state(Bb, max_len), drafter.new_state(Bb, max_len)
    history = model.new_history(Bb)
    sb = batch_params(list(sampling), Bb, default_seed=default_seed, stop_ids=stop_ids)
    width = max(1, max(len(s) for s in stop_ids))
    stops = np.full((Bb, width), -1, np.int32)
    for b, s in enumerate(stop_ids):
        stops[b, :len(s)] = s
    greedy = all(s.temperature == 0 for s in sampling)
    T, W, V = int(max_new[:B].max()), TOP_LOGPROBS_WIDTH, model.config.vocab_size
    out = Emitted(np.full((Bb, T), -1, np.int32), *((np.zeros((Bb, T), np.float32), np.zeros((Bb, T, W), np.int32),
                                                      np.zeros((Bb, T, W), np.float32)) if logprobs else (None,) * 3),
                  np.full((Bb, T, V), np.nan, np.float32) if logits else None)
    for start in range(0, int(lens.max()), prefill_chunk_size):
        S = length_bucket(min(prefill_chunk_size, int(lens.max()) - start))
        toks = np.zeros((Bb, S), np.int32)
        pos = np.full((Bb, S), -1, np.int32)
        nxt = np.full((Bb, S), -1, np.int32)
        for b in range(B):
            n = int(np.clip(lens[b] - start, 0, S))
            following = prompts[b][start + 1:start + n + 1]     # (one short where the prompt ends)
            toks[b, :n], pos[b, :n] = prompts[b][start:start + n], np.arange(start, start + n)
            nxt[b, :len(following)] = following
        ends = (lens > start) & (lens <= start + S)
        state, dstate, first = drafter.prefill(state, dstate, PrefillChunk(Bb, 0, toks, pos, nxt, ends), sb, greedy,
                                               history, logprobs, logits)
        for dst, src in zip(out, first):
            if dst is not None:
                dst[ends, 0] = src[ends]
    x = np.maximum(out.tokens[:, 0], 0)           # (rows past B: done, fed token 0)
    count = np.ones(Bb, np.int32)
    done = np.array([b >= B or max_new[b] <= 1 or x[b] in stop_ids[b] for b in range(Bb)])
    done[list(set(on_block([[int(x[b])] for b in range(B)]) if on_block else ()))] = True
    carry = RowCarry(*model.commit((x, lens.astype(np.int32), count, done)))
    stats = SpecStats(k)
    stops, max_new_d = jnp.asarray(stops), jnp.asarray(max_new)
    while not done.all():
        n = block_length(stats, done, max_new, count, block_iterations) if drafter.blocks_on_device else 1
        state, dstate, carry, emitted, a = drafter.block(state, dstate, carry, sb, stops, max_new_d, n, greedy,
                                                         history, logprobs, logits)
        carry, done = _take_block(emitted, a, out, count, stats, carry, on_block, B)
    return Run(out.tokens[:B], stats.as_dict(), Final(state, dstate, history),
               Emitted(*(None if a is None else a[:B] for a in out)))
