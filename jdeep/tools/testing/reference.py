"""Helpers for checking jdeep against reference outputs: teacher-forced decoding, single-layer replay,
row statistics. Used by the tests and handy in notebooks."""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ...kernels import codecs
from ...layers.block import Streams, block
from ...layers.chunk import make_chunk
from ...layers.rope import inv_freq
from ...model.model import Model
from ...model.scan import slot_params
from ...runtime.steps import length_bucket, run_step
from ...state import slot_state_shapes

__all__ = ["teacher_forced_logits", "replay_layer", "rounding_shift", "row_cosine"]


def row_cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def teacher_forced_logits(model: Model, prompt, forced, chunk: int = 64, max_len: int = 512) -> np.ndarray:
    """Cached path: chunked prefill of `prompt` (logits at every prompt position), then one decode step
    per forced token (the reference's tokens). Returns fp32 [len(prompt) + len(forced), V]: row t is the
    prediction after token t of prompt + forced. Every chunk is padded to `chunk` tokens and the state
    sized for `max_len`, so all prompts share two compiled programs."""
    prompt = np.asarray(prompt, np.int32)
    forced = np.asarray(forced, np.int32)
    max_len = max(max_len, length_bucket(len(prompt) + len(forced) + 1, 256))
    state = model.init_state(1, max_len)
    history = model.new_history(1)
    rows = []
    for start in range(0, len(prompt), chunk):
        part = prompt[start:start + chunk]
        S = chunk
        toks = np.zeros((1, S), np.int32)
        pos = np.full((1, S), -1, np.int32)
        toks[0, :len(part)], pos[0, :len(part)] = part, np.arange(start, start + len(part))
        logits, state = run_step(model, state, toks, pos, history, all_logits=True)
        rows.extend(np.asarray(logits[0, :len(part)]))
    for k, tok in enumerate(forced):
        pos = np.array([[len(prompt) + k]], np.int32)
        logits, state = run_step(model, state, np.array([[tok]], np.int32), pos, history)
        rows.append(np.asarray(logits[0]))
    return np.stack(rows)


@functools.partial(jax.jit, static_argnames=("config", "numerics", "kind", "freqs_key"))
def _block_step(p, experts, st, X, tokens, positions, *, config, numerics, kind, freqs_key):
    chunk = make_chunk(tokens, positions, config.vocab_size)
    freqs = inv_freq(config.rope_for(kind.attn), config.rope_head_dim)
    streams, st, _ = block(p, experts, st, {}, jnp.int32(0), None, Streams(X), None, chunk, config=config,
                           numerics=numerics, kind=kind, freqs=freqs)
    return streams.X, st


def replay_layer(model: Model, layer: int, inputs: np.ndarray, ids: np.ndarray, prefill_len: int,
                 prefill_pad: int | None = None) -> np.ndarray:
    """Run backbone layer `layer` of a DeepSeek-V4 model (own pre-mixes, per-layer caches) alone on recorded
    input streams, as the reference's cached run did:
    one prefill call over the first `prefill_len` positions, then one decode call per position.

    inputs fp32 [T, n, d]; ids int32 [T]. The prefill chunk is padded to `prefill_pad` tokens (default:
    the length bucket) so that replays of different prompts share compiled programs.
    Returns the layer's output streams [T, n, d]."""
    cfg, plan = model.config, model.plan
    s, slot, rep = plan.locate(layer)
    kind = plan.segments[s].pattern[slot]
    layer_params = jax.tree_util.tree_map(lambda a: a[rep:rep + 1], model.params["segments"][s][slot])
    rest, experts = slot_params(layer_params)
    p = jax.tree_util.tree_map(lambda a: a[0], rest)
    T = len(ids)
    shapes = slot_state_shapes(cfg, kind, 1, 1, length_bucket(T, 256), model.dtype, model.numerics)
    dev = jax.devices()[0]   # committed like the params, so every call of a shape reuses one program
    st = jax.device_put({k: jnp.full(sh, -jnp.inf if k.endswith("score") else 0, dt)
                         for k, (sh, dt) in shapes.items()}, dev)
    X = jax.device_put(jnp.asarray(inputs, model.dtype)[None], dev)
    ids = jax.device_put(jnp.asarray(ids, jnp.int32)[None], dev)
    S = prefill_pad or length_bucket(prefill_len)
    pad = S - prefill_len
    Xp = jnp.pad(X[:, :prefill_len], ((0, 0), (0, pad), (0, 0), (0, 0)))
    idp = jnp.pad(ids[:, :prefill_len], ((0, 0), (0, pad)))
    pos = jnp.where(jnp.arange(S) < prefill_len, jnp.arange(S), -1).astype(jnp.int32)[None]
    y, st = _block_step(p, experts, st, Xp, idp, jax.device_put(pos, dev), config=cfg, numerics=model.numerics,
                        kind=kind, freqs_key=None)
    outs = [np.asarray(y[0, :prefill_len])]
    for t in range(prefill_len, T):
        pos = jax.device_put(jnp.asarray([[t]], jnp.int32), dev)
        y, st = _block_step(p, experts, st, X[:, t:t + 1], ids[:, t:t + 1], pos, config=cfg,
                            numerics=model.numerics, kind=kind, freqs_key=None)
        outs.append(np.asarray(y[0]))
    return np.concatenate(outs)


@contextlib.contextmanager
def rounding_shift(rel: float) -> Iterator[None]:
    """Within the block, replay_layer's programs see every fp8/fp4 rounding input and every power-of-two
    scale choice multiplied by (1 + rel): each value within `rel` (relative) of a rounding boundary on that
    side crosses it. Perturbing a layer's input cannot show such flips behind a GEMM: the GEMM's input is
    act-quantised first, which absorbs the perturbation, so a GEMM output that lies within float rounding of
    the next quantiser's boundary stays put (DeepSeek's golden sensitivity runs put the noise on the GEMM
    outputs for the same reason). Test instrumentation: it swaps module functions of jdeep.kernels.codecs
    and drops the replay's compiled programs on entry and exit."""
    originals = {name: getattr(codecs, name) for name in ("_e4m3_steps", "e2m1_round", "ceil_log2")}
    factor = 1.0 + rel

    def shifted(name):
        original = originals[name]

        def fn(xp, x, *args):
            if xp is jnp:
                x = jnp.asarray(x, jnp.float32) * jnp.float32(factor)
            return original(xp, x, *args)
        return fn

    _block_step.clear_cache()
    try:
        for name in originals:
            setattr(codecs, name, shifted(name))
        yield
    finally:
        for name, original in originals.items():
            setattr(codecs, name, original)
        _block_step.clear_cache()
