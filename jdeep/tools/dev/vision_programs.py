"""The programs a V4.1 model with a vision tower adds (`jdeep check-graph`): the tower per (patch bucket,
aligner-row bucket) an image of the config can reach, and the prefill steps that take a chunk's embeddings
(image chunks; model.vision.chunk_embeds). Arguments are abstract, built from the config alone."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from ...model.cache import PROGRAMS
from ...model.model import compiled_step
from ...model.regions import regions_step
from ...vision.geometry import bucket, buckets_upto
from ...vision.params import vision_tensors
from ...vision.processor import num_image_tokens
from ...vision.tower import tower
from .programs import Program, Target, step_inputs

__all__ = ["tower_buckets", "vision_programs"]


def tower_buckets(t: Target) -> list[tuple[int, int]]:
    """(patch bucket, aligner-row bucket) pairs an image can take: each token grid h x w within the span budget
    comes from (3h-2..3h) x (3w-2..3w) patches (r = 3 in general: r·h - r + 1 .. r·h)."""
    vc = t.config.vision
    r = vc.downsample_ratio
    pairs = set()
    for h in range(1, vc.max_tokens):
        for w in range(1, vc.max_tokens):
            if num_image_tokens(h, w) > vc.max_tokens:
                break
            lo, hi = (r * h - r + 1) * (r * w - r + 1), r * h * r * w
            for n in buckets_upto(hi):
                if n >= bucket(lo):
                    pairs.add((n, bucket(h * w)))
    return sorted(pairs)


def _tower_params(t: Target) -> dict:
    out: dict = {}
    for _, path, shape in vision_tensors(t.config):
        if path[0] == "blocks":
            shape = (t.config.vision.n_layers,) + shape
            path = path[:2]
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = jax.ShapeDtypeStruct(shape, t.dtype)
    return out


def vision_programs(t: Target, batch_sizes: Sequence[int], prefill_lens: Sequence[int], max_len: int,
                    max_prefill_tokens: int | None = None) -> list[Program]:
    """"vision.n{N}.t{T}" for every tower bucket pair, then "b{B}.prefill{S}.embeds" (the prefill steps given
    embeddings: an image chunk) per batch bucket and chunk length within the token budget. Nothing for a model
    without a vision tower; no embeds variants where the embedding is on the host (every step takes embeds)."""
    if t.config.vision is None:
        return []
    vc = t.config.vision
    fn = jax.jit(functools.partial(tower, vc=vc))
    params = _tower_params(t)
    out = []
    for n, m in tower_buckets(t):
        args = (params, jax.ShapeDtypeStruct((n, vc.patch_values), jnp.float32),
                jax.ShapeDtypeStruct((n, 2), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.bool_),
                jax.ShapeDtypeStruct((m, vc.downsample_ratio ** 2), jnp.int32))
        out.append(Program(f"vision.n{n}.t{m}", fn, args, {"step": "vision", "patches": n, "rows": m}))
    if t.host_embedding:
        return out
    for B in batch_sizes:
        for S in prefill_lens:
            if max_prefill_tokens is not None and B * S > max_prefill_tokens:
                continue
            args = step_inputs(t, B, S, max_len)[:5] + (jax.ShapeDtypeStruct((B, S, t.config.dim), t.dtype),)
            name, b = f"b{B}.prefill{S}.embeds", {"batch": B, "seq": S, "step": "prefill", "max_len": max_len}
            if t.compile_mode == "scan":
                out.append(Program(name, compiled_step(t.config, t.plan, t.numerics, False, cache=PROGRAMS), args, b))
            else:
                rs = regions_step(t.config, t.plan, t.numerics, False)
                out += [Program(f"{name}.{k}", f, a, b) for k, f, a in rs.programs(*args) if k.startswith("embed")]
    return out
