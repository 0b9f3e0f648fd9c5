"""Manifold-constrained hyper-connections (mHC, docs/architecture.md §3.2, §3.8).

The residual stream is ``hc_mult`` (= 4) parallel copies ``X [B, S, n, d]``. Per sub-block,
24 input-dependent mixes come from one f32 GEMM of the flattened streams, scaled by their RMS:
``[0:4]`` pre (4->1 collapse), ``[4:8]`` post (1->4 expand), ``[8:24]`` comb (4x4 Sinkhorn).
"""
from __future__ import annotations

import jax

from dsv4_jax.ffi.hc_pre import hc_pre
from dsv4_jax.ffi.hc_pre_reference import collapse, hc_post, stream_mixes
from dsv4_jax.ffi.hc_sinkhorn import hc_split_sinkhorn
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


def mhc_pre(x: jax.Array, fn: jax.Array, scale: jax.Array, base: jax.Array,
            weight: jax.Array, n: int, iters: int, hc_eps: float, norm_eps: float, *,
            implementation: str | None = None, split_implementation: str | None = None,
            mixes_implementation: str | None = None, mesh=None, pending=None):
    """The sub-block's input and gates: ``(rms_norm(collapse(X, pre)), post, comb)`` (the
    op ``ffi.hc_pre``; with a ``mesh``, each device its own rows). ``pending``: the
    previous sub-block's ``(out, post, comb)``, whose ``hc_post`` on ``x`` the op applies
    first; the updated streams are then returned fourth."""
    def run(xs, *rest):           # the rows (x, then any pending arrays), then the weights
        *p, f, s, b, w = rest
        return hc_pre(xs, f, s, b, w, n=n, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps,
                      implementation=implementation, split_implementation=split_implementation,
                      mixes_implementation=mixes_implementation, pending=tuple(p) or None)
    rows = (x, *(pending or ()))
    if mesh is None:
        return run(*rows, fn, scale, base, weight)
    return batch_parallel(run, mesh, rows, (fn, scale, base, weight), 3 if pending is None else 4)


def hc_head(x: jax.Array, fn: jax.Array, scale: jax.Array, base: jax.Array,
            norm_eps: float, hc_eps: float) -> jax.Array:
    """Final collapse of the streams (no Sinkhorn): ``sum_j (sigmoid(.) + eps)_j X[j]``."""
    mixes = stream_mixes(x, fn, norm_eps)
    pre = jax.nn.sigmoid(mixes * scale + base) + hc_eps
    return collapse(x, pre)
