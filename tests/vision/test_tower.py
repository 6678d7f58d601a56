"""The vision tower (jdeep.vision.tower) against a float64 numpy oracle written from model-spec.md §5.9 and
DeepSeek-V4.1's vision code: patch embedding, ViT blocks (2-D half-split RoPE, bidirectional attention, SwiGLU),
the 3x3 aligner (zero padding right and below, channel-major neighbourhoods, exact GELU) and the span rows."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdeep.config import ModelConfig
from jdeep.config.small_models import tiny_v41_config
from jdeep.vision.geometry import tower_inputs
from jdeep.vision.params import random_vision_tensors, vision_tree
from jdeep.vision.processor import ImagePatches
from jdeep.vision import geometry, tower as tower_module
from jdeep.vision.tower import span_rows, tower

CONFIG = ModelConfig.from_dict(tiny_v41_config(vision=True))


def _tree(tensors: dict, config: ModelConfig) -> dict:
    """The checkpoint tensors as the tower's param tree (blocks stacked), float32."""
    return jax.tree_util.tree_map(jnp.asarray, vision_tree(config, tensors))


# ------------------------------------------------------------------------------------------- float64 oracle
def _rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _oracle(t: dict, img: ImagePatches, config: ModelConfig) -> np.ndarray:
    vc = config.vision
    g = {k: np.asarray(v, np.float64) for k, v in t.items()}
    n_h, n_w = img.n_vit_h, img.n_vit_w
    x = img.patches.astype(np.float64) @ g["vision.patch_embed.proj.weight"].T + g["vision.patch_embed.proj.bias"]
    H, hd = vc.n_heads, vc.head_dim
    quarter = hd // 4
    # angle of rotation pair (d, d + hd/2) for the patch at (row, col): row frequencies first, then column
    ang = np.zeros((n_h * n_w, hd // 2))
    for i in range(n_h):
        for j in range(n_w):
            for d in range(hd // 2):
                f = vc.rope_theta ** (-(d % quarter) / quarter)
                ang[i * n_w + j, d] = (i if d < quarter else j) * f

    def rope(v):                                         # v [N, H, hd]
        a, b = v[..., :hd // 2], v[..., hd // 2:]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)

    for layer in range(vc.n_layers):
        p = lambda k: g[f"vision.blocks.{layer}.{k}"]
        h = _rms(x, p("norm1.weight"), vc.norm_eps)
        qkv = h @ p("attn.wqkv.weight").T + p("attn.wqkv.bias")
        d = vc.dim
        q, k, v = (qkv[:, i * d:(i + 1) * d].reshape(-1, H, hd) for i in range(3))
        q, k = rope(q), rope(k)
        o = np.zeros_like(q)
        for head in range(H):
            lg = q[:, head] @ k[:, head].T / math.sqrt(hd)
            pr = np.exp(lg - lg.max(-1, keepdims=True))
            o[:, head] = (pr / pr.sum(-1, keepdims=True)) @ v[:, head]
        x = x + o.reshape(-1, d) @ p("attn.wo.weight").T + p("attn.wo.bias")
        h = _rms(x, p("norm2.weight"), vc.norm_eps)
        gu = h @ p("mlp.w1.weight").T
        gate, up = gu[:, :vc.inter_dim], gu[:, vc.inter_dim:]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ p("mlp.w2.weight").T
    x = _rms(x, g["vision.norm.weight"], vc.norm_eps)
    # aligner: 3x3 neighbourhoods over the grid padded with zeros to multiples of 3
    r = vc.downsample_ratio
    grid = np.zeros((img.n_llm_h * r, img.n_llm_w * r, vc.dim))
    grid[:n_h, :n_w] = x.reshape(n_h, n_w, vc.dim)
    rows = []
    for bi in range(img.n_llm_h):
        for bj in range(img.n_llm_w):
            vec = np.zeros(vc.dim * r * r)
            for c in range(vc.dim):
                for di in range(r):
                    for dj in range(r):
                        vec[c * r * r + di * r + dj] = grid[bi * r + di, bj * r + dj, c]
            rows.append(vec)
    a = np.stack(rows) @ g["aligner.w1.weight"].T + g["aligner.w1.bias"]
    a = 0.5 * a * (1 + np.vectorize(math.erf)(a / math.sqrt(2)))
    a = a @ g["aligner.w2.weight"].T + g["aligner.w2.bias"]
    # span rows: delimiters by type, IMAGE positions take the aligner rows in reading order
    out = [g["image_start"]]
    for bi in range(img.n_llm_h):
        out += [a[bi * img.n_llm_w + bj] for bj in range(img.n_llm_w)] + [g["image_newline"]]
    return np.stack(out + [g["image_end"]])


def _span(t: dict, img: ImagePatches) -> np.ndarray:
    vc = CONFIG.vision
    ti = tower_inputs(img, vc.downsample_ratio)
    aligned = jax.jit(functools.partial(tower, vc=vc))(_tree(t, CONFIG), ti.patches, ti.pos, ti.valid, ti.gather)
    return span_rows(np.asarray(aligned), ti.types, {k: t[k] for k in ("image_start", "image_end", "image_newline")})


@pytest.mark.parametrize("grid", [(6, 6), (7, 4), (3, 10), (1, 1)])
def test_tower_matches_float64_oracle(grid):
    """Grids that are and are not multiples of the aligner's 3 (its zero padding), a single patch."""
    n_h, n_w = grid
    rng = np.random.default_rng(n_h * 31 + n_w)
    t = random_vision_tensors(rng, CONFIG)
    vc = CONFIG.vision
    patches = rng.uniform(-1, 1, (n_h * n_w, vc.patch_values)).astype(np.float32)
    img = ImagePatches(patches, n_h, n_w, -(-n_h // 3), -(-n_w // 3))
    got = _span(t, img)
    want = _oracle(t, img, CONFIG)
    assert got.shape == want.shape == (img.n_tokens, CONFIG.dim)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_padding_patches_do_not_leak():
    """The bucket's padding patches are masked out of attention: changing them changes no span row."""
    rng = np.random.default_rng(5)
    vc = CONFIG.vision
    params = _tree(random_vision_tensors(rng, CONFIG), CONFIG)
    img = ImagePatches(rng.uniform(-1, 1, (5 * 5, vc.patch_values)).astype(np.float32), 5, 5, 2, 2)
    ti = tower_inputs(img, vc.downsample_ratio)
    assert ti.patches.shape[0] > 25                                    # the bucket pads
    noisy = ti.patches.copy()
    noisy[25:] = rng.normal(0, 5, noisy[25:].shape)
    f = jax.jit(functools.partial(tower, vc=vc))
    a = np.asarray(f(params, ti.patches, ti.pos, ti.valid, ti.gather))[:4]
    b = np.asarray(f(params, noisy, ti.pos, ti.valid, ti.gather))[:4]
    np.testing.assert_array_equal(a, b)


def test_attention_in_query_blocks_matches_the_oracle(monkeypatch):
    """Past ATTENTION_BLOCK patches the tower attends one block of queries at a time (here blocks of 16 over a
    7x8 grid padded to 64 patches)."""
    monkeypatch.setattr(tower_module, "ATTENTION_BLOCK", 16)
    monkeypatch.setattr(geometry, "ATTENTION_BLOCK", 16)
    rng = np.random.default_rng(11)
    t = random_vision_tensors(rng, CONFIG)
    img = ImagePatches(rng.uniform(-1, 1, (56, CONFIG.vision.patch_values)).astype(np.float32), 7, 8, 3, 3)
    assert tower_inputs(img, 3).patches.shape[0] == 64
    want = _oracle(t, img, CONFIG)
    np.testing.assert_allclose(_span(t, img), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
