"""``hc_split_sinkhorn`` on Hopper: one launch of ``kernels/hc_sinkhorn_sm90.py`` (one thread
per token) as an XLA custom call."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4_jax.kernels.hc_sinkhorn_config import DEFAULT_CONFIG, HcSinkhornSm90Config

__all__ = ["support", "hc_split_sinkhorn_cute"]


def support(mixes, n: int, iters: int,
            config: HcSinkhornSm90Config = DEFAULT_CONFIG) -> tuple[bool, str]:
    """``config.is_supported`` for these arguments; imports no cutlass."""
    tokens = 1
    for d in mixes.shape[:-1]:
        tokens *= d
    return config.is_supported(n=n, iters=iters, dtype=jnp.dtype(mixes.dtype).name,
                               tokens=tokens)


def hc_split_sinkhorn_cute(mixes, scale, base, *, n: int, iters: int, eps: float,
                           config: HcSinkhornSm90Config | None = None):
    """The kernel on ``mixes [..., (2 + n) n]`` f32 -> ``(pre, post, comb)``."""
    # Imported when a kernel is emitted (the reference path never loads cutlass); cute_call
    # first: it pins CUTE_DSL_ARCH before cutlass is imported.
    from .cute_call import cute_call
    from dsv4_jax.kernels import hc_sinkhorn_sm90 as kernel

    config = config or DEFAULT_CONFIG
    lead = mixes.shape[:-1]
    flat = mixes.reshape(-1, mixes.shape[-1])
    t = flat.shape[0]
    shapes = (jax.ShapeDtypeStruct((t, n), jnp.float32), jax.ShapeDtypeStruct((t, n), jnp.float32),
              jax.ShapeDtypeStruct((t, n * n), jnp.float32))
    pre, post, comb = cute_call(kernel.hc_sinkhorn_launcher, shapes, flat,
                                scale.astype(jnp.float32), base.astype(jnp.float32), n=n,
                                iters=iters, eps=float(eps), threads=config.threads)
    return pre.reshape(*lead, n), post.reshape(*lead, n), comb.reshape(*lead, n, n)
