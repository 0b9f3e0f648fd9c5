"""The stream mixes' pure-JAX reference and argument checks (contract: ``ffi/hc_mixes.py``).

The definition itself is ``hc_pre_reference.stream_mixes``, the mHC pre chain's part that the
model imports too, so the op, the chain and the model cannot drift apart.
"""
from __future__ import annotations

import jax.numpy as jnp

from .hc_pre_reference import stream_mixes

__all__ = ["hc_stream_mixes_reference", "check_hc_stream_mixes_args", "stream_mixes"]


def check_hc_stream_mixes_args(x, fn) -> None:
    """``TypeError``/``ValueError`` naming the argument and its shape, in one line."""
    op = "hc_stream_mixes"
    if x.ndim < 2:
        raise ValueError(f"{op}: x must be [..., n, d]; x has shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{op}: x must be floating; x has dtype {x.dtype}")
    k = x.shape[-2] * x.shape[-1]
    if fn.ndim != 2 or fn.shape[1] != k:
        raise ValueError(f"{op}: fn must be [M, n d = {k}] for x of shape {tuple(x.shape)}; "
                         f"fn has shape {tuple(fn.shape)}")
    if not jnp.issubdtype(fn.dtype, jnp.floating):
        raise TypeError(f"{op}: fn must be floating; fn has dtype {fn.dtype}")


def hc_stream_mixes_reference(x, fn, *, norm_eps: float):
    """Pure-JAX definition (runs anywhere): ``stream_mixes``."""
    check_hc_stream_mixes_args(x, fn)
    return stream_mixes(x, fn, norm_eps)
