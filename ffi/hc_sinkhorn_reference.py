"""The mHC split's pure-JAX reference and argument checks (contract: ``ffi/hc_sinkhorn.py``)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["hc_split_sinkhorn_reference", "check_hc_sinkhorn_args"]


def check_hc_sinkhorn_args(mixes, scale, base, n: int, iters: int) -> None:
    """``TypeError``/``ValueError`` naming the argument and its shape, in one line."""
    op = "hc_split_sinkhorn"
    width = (2 + n) * n
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{op}: n must be a positive int, got {n!r}")
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"{op}: iters must be a positive int, got {iters!r}")
    if mixes.ndim < 1 or mixes.shape[-1] != width:
        raise ValueError(f"{op}: mixes must be [..., (2 + n) n = {width}]; mixes has shape "
                         f"{tuple(mixes.shape)}")
    if not jnp.issubdtype(mixes.dtype, jnp.floating):
        raise TypeError(f"{op}: mixes must be floating; mixes has dtype {mixes.dtype}")
    if tuple(scale.shape) != (3,):
        raise ValueError(f"{op}: scale must be [3]; scale has shape {tuple(scale.shape)}")
    if tuple(base.shape) != (width,):
        raise ValueError(f"{op}: base must be [{width}]; base has shape {tuple(base.shape)}")


def _sum(c: jax.Array, axis: int) -> jax.Array:
    """Sum over one axis as a chain of adds in index order (keepdims): elementwise ops XLA
    fuses with their neighbours, where a reduce of 4 elements is a kernel of its own."""
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


def hc_split_sinkhorn_reference(mixes, scale, base, *, n: int, iters: int, eps: float):
    """Pure-JAX definition of ``hc_split_sinkhorn`` (runs anywhere), in f32."""
    check_hc_sinkhorn_args(mixes, scale, base, n, iters)
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
