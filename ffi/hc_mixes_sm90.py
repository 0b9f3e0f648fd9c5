"""``hc_stream_mixes`` on Hopper: one launch of ``kernels/hc_mixes_sm90.py`` (partial sums per
K slice) as an XLA custom call, and the XLA fusion that adds the slices and scales."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4_jax.kernels.hc_mixes_config import (MAX_MIXES, MIX_COLUMNS, HcMixesSm90Config,
                                              choose_config)

__all__ = ["support", "hc_stream_mixes_cute"]


def _rows_and_k(x) -> tuple[int, int]:
    rows = 1
    for d in x.shape[:-2]:
        rows *= d
    return rows, x.shape[-2] * x.shape[-1]


def support(x, fn, config: HcMixesSm90Config | None = None) -> tuple[bool, str]:
    """``config.is_supported`` for these arguments (config None: ``choose_config``'s);
    imports no cutlass."""
    rows, k = _rows_and_k(x)
    config = config or choose_config(rows, k)
    return config.is_supported(rows=rows, k=k, mixes=fn.shape[0],
                               x_dtype=jnp.dtype(x.dtype).name,
                               fn_dtype=jnp.dtype(fn.dtype).name)


def hc_stream_mixes_cute(x, fn, *, norm_eps: float, config: HcMixesSm90Config | None = None):
    """The kernel on ``x [..., n, d]`` bf16 and ``fn [M, n d]`` f32 -> mixes ``[..., M]`` f32:
    the slices' partial sums added in slice order, then the mixes scaled by
    ``rsqrt(mean(x^2) + norm_eps)`` as the reference scales them."""
    # Imported when a kernel is emitted (the reference path never loads cutlass); cute_call
    # first: it pins CUTE_DSL_ARCH before cutlass is imported.
    from .cute_call import cute_call
    from dsv4_jax.kernels import hc_mixes_sm90 as kernel

    rows, k = _rows_and_k(x)
    mixes = fn.shape[0]
    config = config or choose_config(rows, k)
    (part,) = cute_call(kernel.hc_mixes_launcher,
                        (jax.ShapeDtypeStruct((config.slices, rows, MIX_COLUMNS), jnp.float32),),
                        x.reshape(rows, k), fn, mixes=mixes, tiles=config.tiles,
                        slices=config.slices)
    total = jnp.sum(part, axis=0)
    rsqrt = jax.lax.rsqrt(total[:, MAX_MIXES:MAX_MIXES + 1] / k + norm_eps)
    return (total[:, :mixes] * rsqrt).reshape(*x.shape[:-2], mixes)
