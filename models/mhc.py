"""Manifold-constrained hyper-connections (mHC, docs/architecture.md §3.2, §3.8).

The residual stream is ``hc_mult`` (= 4) parallel copies ``X [B, S, n, d]``. Per sub-block,
24 input-dependent mixes come from one f32 GEMM of the flattened streams, scaled by their RMS:
``[0:4]`` pre (4->1 collapse), ``[4:8]`` post (1->4 expand), ``[8:24]`` comb (4x4 Sinkhorn).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4_jax.ffi.hc_sinkhorn import hc_split_sinkhorn
from .layers import HIGHEST
from .parallel import batch_parallel


def split_sinkhorn(mixes: jax.Array, scale: jax.Array, base: jax.Array, n: int,
                   iters: int, eps: float, *, implementation: str | None = None, mesh=None):
    """``hc_split_sinkhorn``: mixes ``[..., (2+n)n]`` -> pre ``[..., n]``, post, comb ``[..., n, n]``
    (the op ``ffi.hc_split_sinkhorn``; with a ``mesh``, each device its own rows).

    pre = sigmoid(.) + eps; post = 2 sigmoid(.); comb = row softmax + eps, column
    normalise, then ``iters - 1`` (row, column) normalisations -- in f32, as the kernel.
    """
    def run(m, s, b):
        return hc_split_sinkhorn(m, s, b, n=n, iters=iters, eps=eps,
                                 implementation=implementation)
    if mesh is None:
        return run(mixes, scale, base)
    return batch_parallel(run, mesh, (mixes,), (scale, base), 3)


def stream_mixes(x: jax.Array, fn: jax.Array, norm_eps: float) -> jax.Array:
    """``(flatten(X) @ fn.T) * rsqrt(mean(flatten(X)^2) + eps)`` in f32: ``[B, S, rows(fn)]``."""
    xf = x.reshape(*x.shape[:-2], -1).astype(jnp.float32)
    rsqrt = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + norm_eps)
    return jnp.einsum("...k,mk->...m", xf, fn.astype(jnp.float32), precision=HIGHEST) * rsqrt


def collapse(x: jax.Array, pre: jax.Array) -> jax.Array:
    """``sum_j pre[j] X[j]`` in f32, cast to X's dtype: the sub-block input ``[B, S, d]``."""
    return jnp.sum(pre[..., None] * x.astype(jnp.float32), axis=-2).astype(x.dtype)


def hc_post(out: jax.Array, residual: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """``X_new[k] = post[k] out + sum_j comb[j, k] X[j]`` (comb used transposed), f32 math."""
    mixed = jnp.einsum("...jk,...jd->...kd", comb, residual.astype(jnp.float32),
                       precision=HIGHEST)
    y = post[..., None] * out.astype(jnp.float32)[..., None, :] + mixed
    return y.astype(out.dtype)


def hc_head(x: jax.Array, fn: jax.Array, scale: jax.Array, base: jax.Array,
            norm_eps: float, hc_eps: float) -> jax.Array:
    """Final collapse of the streams (no Sinkhorn): ``sum_j (sigmoid(.) + eps)_j X[j]``."""
    mixes = stream_mixes(x, fn, norm_eps)
    pre = jax.nn.sigmoid(mixes * scale + base) + hc_eps
    return collapse(x, pre)
