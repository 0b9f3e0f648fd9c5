"""RoPE on interleaved pairs and the heads' weightless RMSNorm, as the model and the attention
op compute them (``sparse_attention(..., rope=, q_norm_eps=)`` takes the queries before both
and applies them itself): one definition, so the op's reference and the model's own path
give the same bits.

    rope_table(positions, inv_freq) -> (cos, sin)      f32 [..., r / 2], angle = p f_i
    rotate_pairs(x, cos, sin, inverse) -> x's pairs (x_2i, x_2i+1) rotated by the angle
                                          (by its conjugate when inverse), f32 math
    rotate_tail(x, cos, sin, inverse)  -> the same on the last r = 2 cos.shape[-1] channels
    head_rms_norm(q, eps)              -> q * rsqrt(mean(q^2) + eps) over the last axis,
                                          rounded after every op in q's dtype
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["rope_table", "rotate_pairs", "rotate_tail", "head_rms_norm"]


def rope_table(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` of ``positions [...] x inv_freq [r / 2]``, f32 ``[..., r / 2]``."""
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angle), jnp.sin(angle)


def rotate_pairs(x: jax.Array, cos: jax.Array, sin: jax.Array,
                 inverse: bool = False) -> jax.Array:
    """Rotate the interleaved pairs of ``x [..., r]`` by the angles of ``cos``/``sin``
    (broadcastable to ``x.shape[:-1] + (r / 2,)``); f32 math, result in x's dtype."""
    r = x.shape[-1]
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], r // 2, 2)
    if inverse:
        sin = -sin
    x0, x1 = xf[..., 0], xf[..., 1]
    y = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    return y.reshape(x.shape).astype(x.dtype)


def rotate_tail(x: jax.Array, cos: jax.Array, sin: jax.Array,
                inverse: bool = False) -> jax.Array:
    """``rotate_pairs`` on the last ``2 cos.shape[-1]`` channels of x, the others as they
    are."""
    rope_dim = 2 * cos.shape[-1]
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    return jnp.concatenate([head, rotate_pairs(tail, cos, sin, inverse)], axis=-1)


def head_rms_norm(q: jax.Array, eps: float) -> jax.Array:
    """Per-head weightless RMSNorm of queries, in q's own dtype as the reference computes it
    (``q *= rsqrt(q.square().mean(-1) + eps)`` on a BF16 tensor rounds after every op)."""
    sq = q * q
    ms = jnp.mean(sq, axis=-1, keepdims=True)          # f32 accumulate, rounded to q.dtype
    r = jax.lax.rsqrt((ms.astype(jnp.float32) + eps).astype(q.dtype))
    return q * r
