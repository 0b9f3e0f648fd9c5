"""The mHC pre's pure-JAX reference, its parts and argument checks (contract: ``ffi/hc_pre.py``).

The parts (``stream_mixes``, ``collapse``, ``rms_norm`` (``ffi/norm.py``), ``hc_post``) are
the model's own definitions:
``models/mhc.py`` and ``models/layers.py`` import them from here, so the op and the model
cannot drift apart.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .ffn_sum import FfnSum, check_ffn_sum
from .hc_sinkhorn_reference import hc_split_sinkhorn_reference
from .norm import rms_norm

__all__ = ["hc_pre_reference", "check_hc_pre_args", "stream_mixes", "collapse", "rms_norm",
           "hc_post", "pending_total"]

HIGHEST = jax.lax.Precision.HIGHEST
# fn split into three bf16 parts that sum to it exactly (8 + 8 + 8 significant bits), each
# multiplied on bf16 tensor cores with f32 sums: XLA's algorithm, the split made in the GEMM.
BF16_X6 = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6
# Fewer rows keep the f32 GEMM: XLA rewrites a dot of one row into a multiply and a sum at
# the algorithm's bf16 operand precision, dropping fn's lower parts (docs/performance.md);
# the prefill chain this serves runs above the mHC pre kernel's rows anyway.
BF16_X6_MIN_ROWS = 256


def _mixes_f32(xf: jax.Array, fn: jax.Array) -> jax.Array:
    return jnp.einsum("...k,mk->...m", xf, fn, precision=HIGHEST)


def _mixes_bf16_x6(xf: jax.Array, fn: jax.Array) -> jax.Array:
    return jnp.einsum("...k,mk->...m", xf, fn, precision=BF16_X6)


def stream_mixes(x: jax.Array, fn: jax.Array, norm_eps: float) -> jax.Array:
    """``(flatten(X) @ fn.T) * rsqrt(mean(flatten(X)^2) + eps)`` in f32: ``[..., rows(fn)]``.

    BF16 streams on a GPU, at least ``BF16_X6_MIN_ROWS`` rows: the product is XLA's
    BF16_BF16_F32_X6 dot. A bf16 X is its own bf16 split, so of the six bf16 products the
    dot sums, the three that do not vanish are X times each of fn's three parts: every
    product is exact in f32, and the mixes are the f32 product's up to the summation order,
    without the f32 copy of the streams and the f32 GEMM that the prefill's chain spent its
    time in (docs/performance.md). Elsewhere: the f32 GEMM."""
    xf = x.reshape(*x.shape[:-2], -1).astype(jnp.float32)
    rsqrt = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + norm_eps)
    fn = fn.astype(jnp.float32)
    if x.dtype == jnp.bfloat16 and math.prod(x.shape[:-2]) >= BF16_X6_MIN_ROWS:
        mixes = jax.lax.platform_dependent(xf, fn, cuda=_mixes_bf16_x6, default=_mixes_f32)
    else:
        mixes = _mixes_f32(xf, fn)
    return mixes * rsqrt


def collapse(x: jax.Array, pre: jax.Array) -> jax.Array:
    """``sum_j pre[j] X[j]`` in f32, cast to X's dtype: the sub-block input ``[..., d]``."""
    return jnp.sum(pre[..., None] * x.astype(jnp.float32), axis=-2).astype(x.dtype)


def hc_post(out: jax.Array, residual: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """``X_new[k] = post[k] out + sum_j comb[j, k] X[j]`` (comb used transposed), f32 math,
    in out's dtype: the residual streams after a sub-block."""
    mixed = jnp.einsum("...jk,...jd->...kd", comb, residual.astype(jnp.float32),
                       precision=HIGHEST)
    y = post[..., None] * out.astype(jnp.float32)[..., None, :] + mixed
    return y.astype(out.dtype)


def pending_total(out) -> jax.Array:
    """A pending ``out`` as one array: an ``FfnSum``'s total (the MoE output's parts added
    as the model adds them), else ``out`` itself."""
    return out.total() if isinstance(out, FfnSum) else out


def check_pending(x, pending, n: int, op: str = "hc_pre") -> None:
    """``pending = (out, post, comb)`` of the sub-block before ``x`` (``out`` an array or an
    ``FfnSum``): shapes named in one line."""
    if not isinstance(pending, (tuple, list)) or len(pending) != 3:
        raise TypeError(f"{op}: pending must be (out, post, comb) or None, got "
                        f"{type(pending).__name__}")
    out, post, comb = pending
    if isinstance(out, FfnSum):
        check_ffn_sum(out, op)
    lead, d = tuple(x.shape[:-2]), x.shape[-1]
    for name, a, want in (("out", out, lead + (d,)), ("post", post, lead + (n,)),
                          ("comb", comb, lead + (n, n))):
        if tuple(a.shape) != want:
            raise ValueError(f"{op}: pending {name} must be {list(want)} for x of shape "
                             f"{tuple(x.shape)}; it has shape {tuple(a.shape)}")
    if out.dtype != x.dtype:
        raise TypeError(f"{op}: pending out must have x's dtype {x.dtype}; it has "
                        f"{out.dtype}")


def check_hc_pre_args(x, fn, scale, base, weight, n: int, iters: int) -> None:
    """``TypeError``/``ValueError`` naming the argument and its shape, in one line."""
    op = "hc_pre"
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{op}: n must be a positive int, got {n!r}")
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"{op}: iters must be a positive int, got {iters!r}")
    if x.ndim < 2 or x.shape[-2] != n:
        raise ValueError(f"{op}: x must be [..., n = {n}, d]; x has shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{op}: x must be floating; x has dtype {x.dtype}")
    d, mixes = x.shape[-1], (2 + n) * n
    if tuple(fn.shape) != (mixes, n * d):
        raise ValueError(f"{op}: fn must be [(2 + n) n = {mixes}, n d = {n * d}] for x of "
                         f"shape {tuple(x.shape)}; fn has shape {tuple(fn.shape)}")
    if tuple(scale.shape) != (3,):
        raise ValueError(f"{op}: scale must be [3]; scale has shape {tuple(scale.shape)}")
    if tuple(base.shape) != (mixes,):
        raise ValueError(f"{op}: base must be [{mixes}]; base has shape {tuple(base.shape)}")
    if tuple(weight.shape) != (d,):
        raise ValueError(f"{op}: weight must be [d = {d}] for x of shape {tuple(x.shape)}; "
                         f"weight has shape {tuple(weight.shape)}")


def hc_pre_reference(x, fn, scale, base, weight, pending_out=None, pending_post=None,
                     pending_comb=None, *, n: int, iters: int, hc_eps: float, norm_eps: float,
                     split=hc_split_sinkhorn_reference, mixes=stream_mixes):
    """Pure-JAX definition of ``hc_pre`` (runs anywhere). ``split``: the mHC split to use
    (its reference by default; the op's XLA path passes the ``hc_split_sinkhorn`` op);
    ``mixes(x, fn, norm_eps)``: the stream mixes (``stream_mixes``; the op's XLA path
    passes the ``hc_stream_mixes`` op). With the ``pending_*`` arrays, ``x`` is first
    updated by ``hc_post`` and also returned."""
    check_hc_pre_args(x, fn, scale, base, weight, n, iters)
    if pending_out is not None:
        check_pending(x, (pending_out, pending_post, pending_comb), n)
        x = hc_post(pending_total(pending_out), x, pending_post, pending_comb)
    pre, post, comb = split(mixes(x, fn, norm_eps), scale, base, n=n, iters=iters, eps=hc_eps)
    out = rms_norm(collapse(x, pre), weight, norm_eps)
    return (out, post, comb) if pending_out is None else (out, post, comb, x)
