"""Manifold-constrained hyper-connections (model-spec.md §4.2, §4.6). All mixing math in fp32.

The per-token steps are hot ops (kernels/reference.py; NKI kernels on Neuron), called through `kernels.get`:
`hc_mix_logits` (the fp32 GEMM with the RMS scale), `hc_split_sinkhorn` (gates and the Sinkhorn matrix),
`hc_collapse` (pre-mix) and `hc_expand` (post-mix)."""

from __future__ import annotations

import jax

from .. import kernels
from .stages import stage

__all__ = ["hc_mixes", "hc_split_sinkhorn", "hc_collapse", "hc_expand", "hc_head_collapse"]


@stage("mhc")
def hc_mixes(X: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, norm_eps: float,
             hc_eps: float, sinkhorn_iters: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """X [..., n, d] -> pre [..., n], post [..., n], comb [..., n, n] (fp32).

    fn [(2+n)n, n*d], base [(2+n)n], scale [3]. comb ends with a column normalisation.
    """
    n = X.shape[-2]
    mu = kernels.get("hc_mix_logits")(X, fn, norm_eps)
    return hc_split_sinkhorn(mu, scale, base, n=n, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)


def hc_split_sinkhorn(mu: jax.Array, scale: jax.Array, base: jax.Array, *, n: int, hc_eps: float,
                      sinkhorn_iters: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Mixes mu [..., (2+n)n] -> pre [..., n], post [..., n], comb [..., n, n] (fp32): the `hc_split_sinkhorn` hot
    op (kernels/reference.py; an NKI kernel on Neuron)."""
    return kernels.get("hc_split_sinkhorn")(mu, scale, base, n=n, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)


@stage("mhc")
def hc_collapse(X: jax.Array, pre: jax.Array) -> jax.Array:
    """Σ_i pre_i X_i in fp32, cast to X's dtype: [..., n, d] -> [..., d] (the `hc_collapse` hot op)."""
    return kernels.get("hc_collapse")(X, pre)


@stage("mhc")
def hc_expand(y: jax.Array, post: jax.Array, comb: jax.Array, X: jax.Array) -> jax.Array:
    """X'_k = post_k y + Σ_j comb[j, k] X_j  -> [..., n, d] in X's dtype (the `hc_expand` hot op)."""
    return kernels.get("hc_expand")(y, post, comb, X)


@stage("mhc")
def hc_head_collapse(X: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, norm_eps: float,
                     hc_eps: float) -> jax.Array:
    """Final stream collapse before the norm and head: [..., n, d] -> [..., d]."""
    mu = kernels.get("hc_mix_logits")(X, fn, norm_eps)
    pre = jax.nn.sigmoid(mu * scale[0] + base) + hc_eps
    return hc_collapse(X, pre)
