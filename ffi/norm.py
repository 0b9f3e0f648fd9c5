"""The RMSNorm every op that normalises rows shares with the model (the mHC pre's output,
the grouped GEMM's ``row_norm``, ``models/layers.RMSNorm``): one definition, so that a
kernel that fuses the norm and the model's XLA path round at the same points."""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["rms_norm"]


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """``w * x / sqrt(mean(x^2) + eps)`` in f32, cast back to x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = weight.astype(jnp.float32) * y
    return y.astype(x.dtype)
