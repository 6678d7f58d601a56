"""Notebook-level API: `generate` (chunked prefill of a ragged batch, then the decode loop, with per-request
sampling, stop tokens and stop strings, streaming) and `forward` (logits of one sequence without a cache).
Shapes are bucketed (batch, chunk length, max length) so repeated calls reuse programs."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from ..model.model import Model
from ..speculative.config import parse_speculative
from ..speculative.generate import speculative_generate
from .buckets import default_chunk_buckets
from .images import expand_image_prompt, is_image_prompt
from .lowering import sharded_tree
from .requests import RequestError, check_request, prompt_ids
from .sampling import PenaltyState, SamplingParams, batch_params
from .slot_sampling import SPECULATIVE_UNSUPPORTED, chunk_prompt_logprobs, logprob_entries, refuse_unsupported
from .steps import (_device_block_program, batch_bucket, count_tokens, decode_block, first_done, length_bucket,
                    pack_chunk, run_step, sample_program)
from .stops import StopMatcher

__all__ = ["GenerateOutput", "generate", "forward", "prefill"]


@dataclass
class GenerateOutput:
    tokens: np.ndarray               # int32 [B, max_new_tokens]; -1 after a request ended (stop token / EOS kept)
    logits: np.ndarray | None        # float32 [B, max_new_tokens, vocab]; row 0 = last prompt position; NaN after the end
    lengths: np.ndarray | None = None  # int [B]: tokens generated per request
    texts: list[str] | None = None   # the generated text per request (cut before a stop string), given a tokenizer
    logprobs: list | None = None     # per request asking for them: per token (id, logprob, [(id, logprob)] top)
    prompt_logprobs: list | None = None   # per request asking for them: None for the first prompt token, then entries


# jdeep.generate's shortest chunk: a notebook's short prompts (under 64 tokens) share one prefill program; a
# 64-position chunk costs little more than a 16-position one next to a compile
GENERATE_MIN_CHUNK = 64

# compiles the decode block while the prefill compiles (_compile_block_early)
_EARLY = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jdeep-compile")


def prefill(model: Model, state: dict, prompts: list[np.ndarray], chunk_size: int = 512,
            history=None, scored: dict[int, int] | None = None, images: list | None = None
            ) -> tuple[jax.Array, dict]:
    """Run every prompt (row b of the batch; extra rows stay empty) through the model in chunks.
    `history`: the batch's Engram histories (models with Engram; advanced in place). scored: row -> top N for
    the rows whose prompt logprobs are wanted (the chunks then run the all-positions step). images: per prompt its
    image spans [(start, rows)] (runtime.images); a chunk holding span positions gets their rows as embeddings.

    Returns (logits fp32 [B, V] at each prompt's last token, state), and with `scored` a third value: row -> its
    prompt logprob entries (None for the first prompt token)."""
    B = jax.tree_util.tree_leaves(state)[0].shape[1]
    lens = np.array([len(p) for p in prompts] + [0] * (B - len(prompts)))
    last = None
    entries = {b: [None] for b in scored or {}}
    longest = length_bucket(chunk_size)
    ladder = default_chunk_buckets(longest, min(GENERATE_MIN_CHUNK, longest))
    for start in range(0, int(lens.max()), chunk_size):
        need = int(np.clip(lens - start, 0, chunk_size).max())     # chunks padded to the ladder: few programs
        toks, pos, _ = pack_chunk(prompts, [start] * len(prompts), B, chunk_size,
                                  width=next(S for S in ladder if S >= need))
        logits, state = run_step(model, state, toks, pos, history, all_logits=bool(scored), images=images)
        if scored:
            logits, chunk_entries = chunk_prompt_logprobs(
                model, logits, pos, {b: (prompts[b], start, n) for b, n in scored.items() if lens[b] > start})
            for b, e in chunk_entries.items():
                entries[b] += e
        ends_here = model.put((lens > start) & (lens <= start + chunk_size))
        last = logits if last is None else jnp.where(ends_here[:, None], logits, last)
    return (last, state, entries) if scored is not None else (last, state)


def _sampling_for(n: int, sampling, max_new_tokens: int, temperature: float, seed: int
                  ) -> list[SamplingParams]:
    if sampling is None:
        sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
        return [dataclasses.replace(sampling, seed=seed + i) for i in range(n)]
    if isinstance(sampling, SamplingParams):
        return [sampling if sampling.seed is None or n == 1 else dataclasses.replace(sampling, seed=sampling.seed + i)
                for i in range(n)]
    sampling = list(sampling)
    if len(sampling) != n or not all(isinstance(p, SamplingParams) for p in sampling):
        raise ValueError(f"sampling must be one SamplingParams or one per prompt ({n}), got {len(sampling)} items")
    return sampling


def generate(model: Model, prompts: Sequence[Sequence[int] | str | Mapping], max_new_tokens: int = 16,
             temperature: float = 0.0,
             return_logits: bool = False, seed: int = 0, prefill_chunk: int = 512,
             sampling: SamplingParams | Sequence[SamplingParams] | None = None, ignore_eos: bool = False,
             stream: Callable[[list[list[int]]], None] | None = None, stream_every: int = 16,
             tokenizer=None, speculative: dict | None = None) -> GenerateOutput:
    """Generate after each prompt of a ragged batch of token-id lists, strings, or (DeepSeek-V4.1 with its vision
    tower) {"text": ..., "images": [PIL image | path | bytes | data URL]} (runtime.images: the text's
    `<｜deepseek_image｜>` placeholders mark where the images go, else they come first).

    sampling: one SamplingParams for every prompt or one per prompt (temperature, top-k, top-p, min-p,
    seed, max_new_tokens, stop_token_ids, stop strings, logit_bias, presence / frequency / repetition penalties,
    min_tokens, logprobs, prompt_logprobs: sampling.py); without it, `max_new_tokens`, `temperature` and
    `seed` apply (prompt i seeded seed + i). Penalised requests' token counts are carried in the on-device decode
    loop; logprobs come from the sampler program (GenerateOutput.logprobs), prompt logprobs from all-positions
    prefill steps (GenerateOutput.prompt_logprobs), both None for requests that did not ask. A request ends at its max_new_tokens, at one of its stop tokens
    or at the model's EOS (kept in the output; `ignore_eos` disables the EOS stop), or once its text
    contains one of its stop strings (checked on the host between blocks; the tokens after the one that
    completed it are dropped, and `texts` ends before it).
    tokenizer: for text prompts, stop strings and `texts` (default: model.tokenizer, from the folder's
    tokenizer.json).
    The decode loop runs on the device in blocks of `stream_every` steps with a fixed trip count and
    per-sequence done masks (in the regions compile mode, or with host-resident embedding, the same loop
    runs on the host, one step call per token); between blocks `stream(new_tokens)` (if given) receives each request's tokens
    since the last call, and generation ends early once every request is done. Models with Engram layers
    decode one step per block (their table rows are gathered on the host from the token just sampled).
    speculative: {"method": "mtp" | "dspark", "num_speculative_tokens": k} drafts k tokens per step with the
    checkpoint's drafter (V4's MTP block, V4.1's DSpark stages; jdeep.load(path, mtp=True)) and verifies them in one
    step (jdeep/speculative): greedy requests get the tokens of plain decoding, sampled ones the same distribution;
    blocks of up to `stream_every` iterations run on the device between host reads (per iteration for Engram
    models); logit_bias, min_tokens, logprobs and return_logits as plain decoding has them; no penalties or prompt
    logprobs (a RequestError naming the field; docs/speculative.md's feature matrix says why).
    """
    tokenizer = tokenizer if tokenizer is not None else model.tokenizer
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists (or of strings, with a tokenizer)")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
    if stream_every < 1:
        raise ValueError(f"stream_every must be positive, got {stream_every}")
    eos = None if ignore_eos else model.config.eos_token_id
    prompts, images = list(prompts), [[] for _ in prompts]
    for i, pr in enumerate(prompts):
        if is_image_prompt(pr):
            ip = expand_image_prompt(model, pr, tokenizer, i)
            prompts[i], images[i] = list(ip.ids), list(ip.spans)
    if speculative is not None and any(images):
        raise RequestError("prompts with images are not supported with speculative decoding yet", "speculative")
    requests = [check_request(pr, p, vocab_size=model.config.vocab_size, tokenizer=tokenizer, eos=eos,
                              max_len=model.config.max_position_embeddings, limit_name="max_position_embeddings",
                              index=i)
                for i, (pr, p) in enumerate(zip(prompts, _sampling_for(len(prompts), sampling, max_new_tokens,
                                                                       temperature, seed)))]
    prompts = [r.ids for r in requests]
    params = [r.params for r in requests]
    if speculative is not None:
        for p in params:
            refuse_unsupported(p, SPECULATIVE_UNSUPPORTED, "speculative decoding")
        return _speculative(model, requests, speculative, prefill_chunk, tokenizer, return_logits, stream, stream_every,
                            seed)
    n_new = max(p.max_new_tokens for p in params)
    longest = max(len(pr) + p.max_new_tokens for pr, p in zip(prompts, params))
    B = len(prompts)
    Bb = batch_bucket(B)
    max_len = length_bucket(longest, 256)
    state = model.init_state(Bb, max_len)
    history = model.new_history(Bb)
    scored = {b: p.prompt_logprobs for b, p in enumerate(params) if p.prompt_logprobs is not None}
    block = 1 if model.engram is not None else min(length_bucket(stream_every, 1), length_bucket(n_new - 1, 1))
    want_lp = any(p.logprobs is not None for p in params)
    width = max(1, max(len(r.stop_ids) for r in requests))
    sb = batch_params(params, Bb, default_seed=seed, stop_ids=[r.stop_ids for r in requests])
    early = _compile_block_early(model, state, sb, width, any(p.penalized for p in params), block, return_logits,
                                 want_lp) if n_new > 1 else None
    first, state, prompt_lps = prefill(model, state, prompts, prefill_chunk, history, scored, images)

    stops = np.full((Bb, width), -1, np.int32)
    for b, r in enumerate(requests):
        stops[b, :len(r.stop_ids)] = r.stop_ids
    max_new = np.asarray([p.max_new_tokens for p in params] + [1] * (Bb - B), np.int32)
    lens = np.array([len(p) for p in prompts] + [0] * (Bb - B), np.int32)

    first, sb, stops, max_new, lens, zeros, ones = model.to_sampler(
        (first, sb, stops, max_new, lens, np.zeros((Bb,), np.int32), np.ones((Bb,), np.int32)))
    pen = _penalties(model, prompts, params, Bb)
    out0 = sample_program(want_lp)(first, sb, zeros, pen)
    tok = out0[0] if want_lp else out0
    done = first_done(tok, stops, max_new, lens)
    carry = (tok, ones, done, count_tokens(pen, tok))
    fetch = model.fetch
    tokens, logits = [fetch(tok)[:, None]], [fetch(first)[:, None]] if return_logits else None
    lps = [tuple(fetch(a)[:, None] for a in out0[1:])] if want_lp else None
    matchers = {b: StopMatcher(tokenizer, p.stop) for b, p in enumerate(params) if p.stop}
    kept = np.full(B, n_new)          # tokens kept per request (a stop string ends one early)
    sent = np.zeros(B, int)           # tokens already streamed per request

    def after_block(new: np.ndarray) -> None:
        """Stop strings and streaming for a block of new tokens [Bb, n] (-1 = ended)."""
        nonlocal carry
        stopped = []
        for b, m in matchers.items():
            if not m.stopped:
                m.push(t for t in new[b] if t >= 0)
                if m.stopped:
                    kept[b] = m.n_tokens
                    stopped.append(b)
        if stopped:                                  # end those rows on the device too
            done = np.array(fetch(carry[2]))
            done[stopped] = True
            carry = (carry[0], carry[1], model.to_sampler(done) if model.layout is not None else jnp.asarray(done),
                     carry[3])
        if stream is not None:
            chunks = []
            for b in range(B):
                row = [int(t) for t in new[b] if t >= 0][:max(0, kept[b] - sent[b])]
                sent[b] += len(row)
                chunks.append(row)
            stream(chunks)

    after_block(tokens[0])
    if early is not None:
        early.result()                   # (its failure is the call's to report: it compiles there again)
    produced = 1
    while produced < n_new and not bool(np.all(fetch(carry[2]))):
        engram = None
        if model.engram is not None:
            t_last, count, dn = (fetch(c) for c in carry[:3])
            pos = np.where(dn, -1, fetch(lens) + count - 1).astype(np.int32)[:, None]
            engram = model.engram_inputs(history, np.maximum(t_last, 0)[:, None], pos)
        state, carry, toks, lg, lp = decode_block(model, state, engram, carry, lens, sb, stops, max_new, n_steps=block,
                                                  keep_logits=return_logits, want_logprobs=want_lp)
        toks = fetch(toks).T                                             # [B, block]
        if want_lp:
            lps.append(tuple(np.swapaxes(fetch(a), 0, 1) for a in lp))
        tokens.append(toks)
        if return_logits:
            logits.append(fetch(lg).transpose(1, 0, 2))
        produced += block
        after_block(toks)
    out = np.concatenate(tokens, axis=1)[:B, :n_new]
    out_logits = None
    if return_logits:
        out_logits = np.concatenate(logits, axis=1)[:B, :n_new]
        if out_logits.shape[1] < n_new:   # every request ended early
            pad = np.full((B, n_new - out_logits.shape[1], model.config.vocab_size), np.nan, np.float32)
            out_logits = np.concatenate([out_logits, pad], axis=1)
    if out.shape[1] < n_new:
        out = np.concatenate([out, np.full((B, n_new - out.shape[1]), -1, np.int32)], axis=1)
    for b in range(B):                     # tokens after a stop string's last token are dropped
        out[b, kept[b]:] = -1
        if out_logits is not None:
            out_logits[b, kept[b]:] = np.nan
    lengths = np.sum(out >= 0, axis=1)
    texts = None
    if tokenizer is not None:
        texts = [matchers[b].text if b in matchers and matchers[b].stopped else tokenizer.decode(out[b, :lengths[b]])
                 for b in range(B)]
    return GenerateOutput(out, out_logits, lengths, texts, _token_logprobs(out, lengths, params, lps),
                          [prompt_lps.get(b) for b in range(B)] if scored else None)


def _compile_block_early(model: Model, state: dict, sb, width: int, penalized: bool, block: int, keep_logits: bool,
                         want_lp: bool) -> concurrent.futures.Future | None:
    """The decode block's program (steps.decode_block: `block` steps, power-of-two blocks keep them few) compiled, or
    read from the executable store, on a thread of its own while the prompt's prefill compiles and runs: the first
    call's two big compiles side by side. Over the arguments the block will get (the state as prefill leaves it,
    the rows' carry, lengths, sampling rows, stop ids and limits, all on the model's device); None where the block
    is not one device program (a host-driven loop, Engram, a mesh)."""
    if model.host_loop or model.engram is not None or model.layout is not None:
        return None
    Bb, V = sb.temperature.shape[0], model.config.vocab_size
    dev = SingleDeviceSharding(jax.devices()[0])

    def a(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=dev)

    row, flag = a((Bb,), jnp.int32), a((Bb,), jnp.bool_)
    pen = PenaltyState(a((Bb, V), jnp.int32), a((Bb, V), jnp.bool_)) if penalized else None
    args = (sharded_tree(model.params), sharded_tree(state), None, (row, row, flag, pen), row,
            jax.tree_util.tree_map(lambda x: a(x.shape, x.dtype), sb), a((Bb, width), jnp.int32), row)
    program = _device_block_program(model, block, keep_logits, want_lp)
    return _EARLY.submit(program.prepare, args)


def _penalties(model: Model, prompts: list[np.ndarray], params: list[SamplingParams], Bb: int) -> PenaltyState | None:
    """The batch's token counts (none yet) and prompt-token masks, when some request uses a penalty."""
    if not any(p.penalized for p in params):
        return None
    V = model.config.vocab_size
    seen = np.zeros((Bb, V), bool)
    for b, p in enumerate(prompts):
        seen[b, p] = True
    return model.to_sampler(PenaltyState(np.zeros((Bb, V), np.int32), seen))


def _token_logprobs(out: np.ndarray, lengths: np.ndarray, params: list[SamplingParams], lps) -> list | None:
    """Each request's logprob entries for its kept tokens (None for requests that did not ask)."""
    if lps is None:
        return None
    lp, ids, vals = (np.concatenate(a, axis=1) for a in zip(*lps))      # [Bb, steps], [Bb, steps, W] ...
    return [None if p.logprobs is None else
            [logprob_entries(out[b, j], lp[b, j], ids[b, j], vals[b, j], p.logprobs) for j in range(lengths[b])]
            for b, p in enumerate(params)]


def _speculative(model: Model, requests: list, speculative: dict, prefill_chunk: int, tokenizer, return_logits: bool,
                 stream, stream_every: int, seed: int) -> GenerateOutput:
    """generate() with speculative decoding (MTP on DeepSeek-V4, DSpark on DeepSeek-V4.1): greedy requests get plain
    decoding's tokens, sampled ones tokens with the same distribution; stop strings and streaming as plain decoding
    has them."""
    method, k = parse_speculative(speculative)
    B = len(requests)
    matchers = {b: StopMatcher(tokenizer, r.params.stop) for b, r in enumerate(requests) if r.params.stop}
    kept = np.array([r.params.max_new_tokens for r in requests])

    def on_block(new: list[list[int]]) -> list[int]:
        ended = []
        for b, m in matchers.items():
            if not m.stopped:
                m.push(new[b])
                if m.stopped:
                    kept[b] = m.n_tokens
                    ended.append(b)
        if stream is not None:
            chunks = [row[:max(0, kept[b] - sent[b])] for b, row in enumerate(new)]
            sent[:] += [len(c) for c in chunks]
            stream(chunks)
        return ended

    sent = np.zeros(B, int)
    params = [r.params for r in requests]
    want_lp = any(p.logprobs is not None for p in params)
    out, _, _, outputs = speculative_generate(model, [r.ids for r in requests], params,
                                              [tuple(r.stop_ids) for r in requests], method, k, prefill_chunk,
                                              default_seed=seed, on_block=on_block,
                                              block_iterations=max(1, stream_every), logprobs=want_lp,
                                              logits=return_logits)
    logits = outputs.logits
    for b in range(B):                       # tokens after the one completing a stop string are dropped
        out[b, kept[b]:] = -1
        if logits is not None:
            logits[b, kept[b]:] = np.nan
    lengths = np.sum(out >= 0, axis=1)
    texts = None
    if tokenizer is not None:
        texts = [matchers[b].text if b in matchers and matchers[b].stopped else tokenizer.decode(out[b, :lengths[b]])
                 for b in range(B)]
    lps = [outputs[1:4]] if want_lp else None
    return GenerateOutput(out, logits, lengths, texts, _token_logprobs(out, lengths, params, lps))


def forward(model: Model, token_ids: Sequence[int], pad_to: int | None = None) -> np.ndarray:
    """Logits at every position of one sequence, without a persistent cache: float32 [T, V].

    The sequence runs as one chunk padded to a length bucket (or to `pad_to`, so that calls with
    different lengths share one compiled program)."""
    ids = prompt_ids(token_ids, model.config.vocab_size)
    T = len(ids)
    S = length_bucket(T) if pad_to is None else int(pad_to)
    if S < T:
        raise ValueError(f"pad_to={pad_to} is shorter than the sequence ({T} tokens)")
    state = model.init_state(1, S)
    toks = np.zeros((1, S), np.int32)
    pos = np.full((1, S), -1, np.int32)
    toks[0, :T], pos[0, :T] = ids, np.arange(T)
    logits, _ = run_step(model, state, toks, pos, model.new_history(1), all_logits=True)
    return model.fetch(logits)[0, :T]
