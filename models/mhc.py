"""Manifold-constrained hyper-connections (mHC, docs/architecture.md §3.2, §3.8).

The residual stream is ``hc_mult`` (= 4) parallel copies ``X [B, S, n, d]``. Per sub-block,
24 input-dependent mixes come from one f32 GEMM of the flattened streams, scaled by their RMS:
``[0:4]`` pre (4->1 collapse), ``[4:8]`` post (1->4 expand), ``[8:24]`` comb (4x4 Sinkhorn).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from .layers import HIGHEST


def _sum(c: jax.Array, axis: int) -> jax.Array:
    """Sum over one axis of size n as a chain of adds in index order (keepdims): elementwise
    ops that XLA fuses into its neighbours, where a reduce of 4 elements would be a kernel of
    its own; the same order as XLA's CPU reduction, so the same bits there."""
    parts = jnp.split(c, c.shape[axis], axis=axis)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _max(c: jax.Array, axis: int) -> jax.Array:
    parts = jnp.split(c, c.shape[axis], axis=axis)
    total = parts[0]
    for part in parts[1:]:
        total = jnp.maximum(total, part)
    return total


def split_sinkhorn(mixes: jax.Array, scale: jax.Array, base: jax.Array, n: int,
                   iters: int, eps: float):
    """``hc_split_sinkhorn``: mixes ``[..., (2+n)n]`` -> pre ``[..., n]``, post, comb ``[..., n, n]``.

    pre = sigmoid(.) + eps; post = 2 sigmoid(.); comb = row softmax + eps, column
    normalise, then ``iters - 1`` (row, column) normalisations -- in f32, as the kernel. The
    iterations are unrolled and the n-wide sums are adds (``_sum``), so the whole chain is
    one elementwise computation for XLA (a loop of small reductions was dozens of launches
    per sub-block on a GPU).
    """
    mixes = mixes.astype(jnp.float32)
    pre = jax.nn.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + eps
    post = 2.0 * jax.nn.sigmoid(mixes[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb = (mixes[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(*mixes.shape[:-1], n, n)
    comb = jnp.exp(comb - _max(comb, -1))
    comb = comb / _sum(comb, -1) + eps
    comb = comb / (_sum(comb, -2) + eps)
    for _ in range(iters - 1):
        comb = comb / (_sum(comb, -1) + eps)
        comb = comb / (_sum(comb, -2) + eps)
    return pre, post, comb


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
