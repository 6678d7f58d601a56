"""Speculative decoding with DeepSeek-V4's MTP block as the drafter (model-spec.md §4.7) for jdeep.generate: the
prompt's prefill chunks (backbone and MTP block), then blocks of iterations (mtp_iteration.py) between host reads,
greedy and sampled.

The compiled programs per compile mode: in the scan mode a prefill chunk is one program and a block of n iterations
one program (a scan); in the regions mode (RegionsPrograms) a prefill chunk is the regions step with the final
streams, then the MTP half (prefill_tail), and an iteration is three calls: the draft program, the regions step over
the k + 1 verified positions, the finish program. Both give the same tokens and states.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..model.cache import PROGRAMS
from ..model.model import Model
from ..model.mtp import empty_mtp_state, init_mtp_state
from ..model.regions import regions_step
from ..runtime.sampling import SamplingParams, batch_params
from ..runtime.steps import batch_bucket, length_bucket
from .mtp_iteration import Carry, draft, finish, iteration, iterations, mtp_params, prefill_chunk, prefill_tail

__all__ = ["Carry", "mtp_generate", "check_mtp_model", "new_mtp_state", "prefill_chunk", "iteration", "iterations",
           "SpecStats", "ScanPrograms", "RegionsPrograms", "programs"]


def check_mtp_model(model: Model) -> None:
    """Clear errors for what the MTP drafter needs and this version does not run."""
    if model.engram is not None or model.config.dspark is not None or model.config.sharing is not None:
        raise ValueError("speculative method 'mtp' is for DeepSeek-V4 checkpoints; DeepSeek-V4.1 drafts with its "
                         "DSpark drafter: speculative={'method': 'dspark', 'num_speculative_tokens': k}")
    if model.plan.mtp is None:
        raise ValueError("speculative decoding with method 'mtp' needs the checkpoint's MTP block loaded: "
                         "jdeep.load(path, mtp=True) (a checkpoint without mtp.* weights has none)")
    if model.host_embed is not None:
        raise ValueError("MTP speculative decoding needs the embedding on the device (the MTP block embeds the "
                         "drafts): load without host_embedding")


def new_mtp_state(model: Model, batch: int, max_len: int) -> dict:
    """The MTP blocks' empty window state for `batch` sequences, on the device or, on a mesh, sharded by sequence
    slot like the backbone's state."""
    if model.layout is None:
        return init_mtp_state(model.config, model.plan, batch, max_len, model.dtype, model.numerics)
    empty = empty_mtp_state(model.config, model.plan, batch, max_len, model.dtype, model.numerics)
    return jax.device_put(empty, model.layout.state_shardings(empty))


def _key(model: Model) -> tuple:
    return (model.config, model.plan, model.numerics)


class ScanPrograms:
    """The scan compile mode's programs: prefill(params, state, mstate, tokens, positions, next_tokens, sb) ->
    (first, mlogits, hm, state, mstate) as one program, iterations(n)(params, state, mstate, carry, sb, stops,
    max_new) -> (state, mstate, carry, emitted [n, B, k+1], accepted [n, B]) as one program per n."""

    def __init__(self, model: Model, k: int, greedy: bool):
        self.k, self.kw = k, dict(config=model.config, plan=model.plan, numerics=model.numerics, greedy=greedy,
                                  layout=model.layout)
        self.prefill = PROGRAMS.get(("mtp_prefill", greedy, model.layout) + _key(model),
                                    lambda: jax.jit(functools.partial(prefill_chunk, **self.kw),
                                                    donate_argnums=(1, 2)))

    def iterations(self, n: int) -> Callable:
        return PROGRAMS.get(("mtp_iterations", self.k, n) + tuple(sorted(self.kw.items())),
                            lambda: jax.jit(functools.partial(iterations, n=n, k=self.k, **self.kw),
                                            donate_argnums=(1, 2, 3)))


class RegionsPrograms:
    """The regions compile mode's programs, called as ScanPrograms' are: a prefill chunk is the regions step (its
    final streams too) and the MTP half (mtp_iteration.prefill_tail, one program); an iteration is the draft program,
    the regions step over the k + 1 verified positions (all logits and the final streams) and the finish program,
    n of them dispatched one after another without a host read. The MTP programs take only the parameters the MTP
    block reads (mtp_iteration.mtp_params)."""

    def __init__(self, model: Model, k: int, greedy: bool):
        c, plan, nu = _key(model)
        kw = dict(config=c, plan=plan, numerics=nu, greedy=greedy)
        key = tuple(sorted(kw.items()))
        self.backbone = regions_step(c, plan, nu, False, layout=model.layout, hidden=True)
        self.verify = regions_step(c, plan, nu, True, layout=model.layout, hidden=True)
        self.tail = PROGRAMS.get(("mtp_prefill_tail",) + key,
                                 lambda: jax.jit(functools.partial(prefill_tail, **kw), donate_argnums=(1,)))
        self.draft = PROGRAMS.get(("mtp_draft", k) + key,
                                  lambda: jax.jit(functools.partial(draft, k=k, **kw), donate_argnums=(2,)))
        self.finish = PROGRAMS.get(("mtp_finish", k) + key,
                                   lambda: jax.jit(functools.partial(finish, k=k, **kw), donate_argnums=(1, 2)))

    def prefill(self, params, state, mstate, tokens, positions, next_tokens, sb):
        (logits, X), state = self.backbone(params, state, tokens, positions)
        first, mlogits, hm, mstate = self.tail(mtp_params(params), mstate, logits, X, positions, next_tokens, sb)
        return first, mlogits, hm, state, mstate

    def iteration(self, params, state, mstate, carry, sb, stops, max_new):
        mstate, dr = self.draft(mtp_params(params), state, mstate, carry, sb)
        (logits, XB), state = self.verify(params, state, dr.tokens, dr.pos)
        return self.finish(mtp_params(params), state, mstate, carry, dr, logits, XB, sb, stops, max_new)

    def iterations(self, n: int) -> Callable:
        def run(params, state, mstate, carry, sb, stops, max_new):
            emitted, accepted = [], []
            for _ in range(n):
                state, mstate, carry, e, a = self.iteration(params, state, mstate, carry, sb, stops, max_new)
                emitted.append(e)
                accepted.append(a)
            return state, mstate, carry, jnp.stack(emitted), jnp.stack(accepted)
        return run


def programs(model: Model, k: int, greedy: bool) -> ScanPrograms | RegionsPrograms:
    """The prefill and iteration programs of the model's compile mode (the one place that chooses)."""
    return (RegionsPrograms if model.compile_mode == "regions" else ScanPrograms)(model, k, greedy)


class SpecStats:
    """Acceptance counters: iterations (row-iterations that ran), drafted and accepted draft tokens, and per draft
    position how often it was accepted."""

    def __init__(self, k: int):
        self.k, self.iterations, self.drafted, self.accepted = k, 0, 0, 0
        self.per_position = np.zeros(k, np.int64)

    def add(self, accepted: np.ndarray) -> None:
        """accepted int [...]: per row-iteration accepted drafts (-1 = the row did not run)."""
        a = accepted[accepted >= 0]
        self.iterations += a.size
        self.drafted += a.size * self.k
        self.accepted += int(a.sum())
        self.per_position += np.sum(a[:, None] > np.arange(self.k)[None, :], axis=0)

    def as_dict(self) -> dict:
        it = max(self.iterations, 1)
        return {"k": self.k, "iterations": self.iterations, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.accepted / max(self.drafted, 1),
                "acceptance_per_position": (self.per_position / it).tolist(),
                "mean_accepted_length": 1 + self.accepted / it}


def mtp_generate(model: Model, prompts: Sequence[np.ndarray], sampling: Sequence[SamplingParams],
                 stop_ids: Sequence[tuple[int, ...]], k: int, prefill_chunk_size: int = 512, default_seed: int = 0,
                 on_block: Callable[[list[list[int]]], Sequence[int]] | None = None,
                 block_iterations: int = 8) -> tuple[np.ndarray, dict]:
    """Tokens of each prompt (int32 [B, max max_new_tokens], -1 after a request ended) with k MTP draft tokens per
    iteration, sampled per request as `sampling` says (greedy rows: exactly plain greedy decoding's tokens), and the
    acceptance stats (SpecStats.as_dict). on_block(new tokens per row) runs after the first token and after every
    block of iterations; it returns the rows to end (stop strings). Blocks run `block_iterations` iterations, or one
    near the end."""
    out, stats, _ = run(model, prompts, sampling, stop_ids, k, prefill_chunk_size, default_seed, on_block,
                        block_iterations)
    return out, stats


def block_length(stats: SpecStats, done: np.ndarray, max_new: np.ndarray, count: np.ndarray,
                 block_iterations: int) -> int:
    """Iterations of the next block: a whole block while the longest running row needs that many at the acceptance
    seen so far, then single iterations (two compiled programs per k)."""
    per_iter = 1 + stats.accepted / max(stats.iterations, 1)
    need = int(np.ceil(np.max(np.where(done, 0, max_new - count)) / per_iter))
    return block_iterations if need >= block_iterations else 1


def take_block(emitted: np.ndarray, accepted: np.ndarray, out: np.ndarray, count: np.ndarray, stats: SpecStats,
               carry, on_block, B: int):
    """After a block (emitted int32 [n, Bb, k+1], accepted int32 [n, Bb]): count the acceptance, append each row's
    tokens to out at count (both updated in place), and end the rows on_block names (stop strings). Returns (carry,
    done bool [Bb])."""
    stats.add(accepted[:, :B])
    new = [[int(t) for t in emitted[:, b].reshape(-1) if t >= 0] for b in range(B)]
    for b in range(B):
        out[b, count[b]:count[b] + len(new[b])] = new[b]
        count[b] += len(new[b])
    done = np.asarray(carry.done).copy()
    stop_rows = [b for b in (on_block(new) if on_block else ()) if not done[b]]
    if stop_rows:
        done[stop_rows] = True
        carry = carry._replace(done=jax.device_put(done, carry.done.sharding))    # placed as the program's output
    return carry, done


def state_len(prompt_lens: Sequence[int], max_new: Sequence[int], k: int) -> int:
    """The cache length a batch needs: its longest prompt + max_new_tokens, plus the k + 1 verified positions."""
    return length_bucket(max(int(n) + int(m) for n, m in zip(prompt_lens, max_new)) + k + 1, 256)


def run(model: Model, prompts, sampling, stop_ids, k: int, prefill_chunk_size: int = 512, default_seed: int = 0,
        on_block=None, block_iterations: int = 8) -> tuple[np.ndarray, dict, dict]:
    """mtp_generate, also returning the backbone state at the end (row b holds its prompt and every emitted token
    but the last, as plain decoding's state would)."""
    check_mtp_model(model)
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be at least 1, got {k}")
    B, Bb = len(prompts), batch_bucket(len(prompts))
    max_new = np.array([s.max_new_tokens for s in sampling] + [1] * (Bb - B), np.int32)
    lens = np.array([len(p) for p in prompts] + [0] * (Bb - B))
    max_len = state_len([len(p) for p in prompts], max_new[:B], k)
    state = model.init_state(Bb, max_len)
    mstate = new_mtp_state(model, Bb, max_len)
    sb = batch_params(list(sampling), Bb, default_seed=default_seed)
    width = max(1, max(len(s) for s in stop_ids))
    stops = np.full((Bb, width), -1, np.int32)
    for b, s in enumerate(stop_ids):
        stops[b, :len(s)] = s
    greedy = all(s.temperature == 0 for s in sampling)
    progs = programs(model, k, greedy)
    first = mlogits = hm = None
    for start in range(0, int(lens.max()), prefill_chunk_size):
        S = length_bucket(min(prefill_chunk_size, int(lens.max()) - start))
        toks = np.zeros((Bb, S), np.int32)
        pos = np.full((Bb, S), -1, np.int32)
        nxt = np.full((Bb, S), -1, np.int32)
        for b in range(B):
            n = int(np.clip(lens[b] - start, 0, S))
            toks[b, :n] = prompts[b][start:start + n]
            pos[b, :n] = np.arange(start, start + n)
            nxt[b, :n] = np.concatenate([prompts[b][start + 1:start + n + 1], [-1]])[:n] if n else []
        f, ml, h, state, mstate = progs.prefill(model.params, state, mstate, toks, pos, nxt, sb)
        ends = jnp.asarray((lens > start) & (lens <= start + S))
        pick = lambda new, old: new if old is None else jnp.where(ends.reshape((-1,) + (1,) * (new.ndim - 1)), new,
                                                                  old)
        first, mlogits, hm = pick(f, first), pick(ml, mlogits), pick(h, hm)
    x = np.asarray(first)
    out = np.full((Bb, int(max_new[:B].max())), -1, np.int32)
    out[:, 0] = x
    count = np.ones(Bb, np.int32)
    done = np.array([b >= B or max_new[b] <= 1 or x[b] in stop_ids[b] for b in range(Bb)])
    ended = set(on_block([[int(x[b])] for b in range(B)]) if on_block else ())
    done[list(ended)] = True
    x_, p_, count_, done_ = model.commit((x, lens.astype(np.int32), count, done))
    carry = Carry(x_, p_, mlogits, hm, count_, done_)
    stats = SpecStats(k)
    stops, max_new_d = jnp.asarray(stops), jnp.asarray(max_new)
    while not done.all():
        n = block_length(stats, done, max_new, count, block_iterations)
        state, mstate, carry, emitted, a = progs.iterations(n)(
            model.params, state, mstate, carry, sb, stops, max_new_d)
        emitted, a = np.asarray(emitted), np.asarray(a)
        carry, done = take_block(emitted, a, out, count, stats, carry, on_block, B)
    return out[:B], stats.as_dict(), state
