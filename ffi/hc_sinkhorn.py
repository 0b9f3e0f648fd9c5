"""The mHC split of one sub-block (docs/architecture.md §3.2): the pre and post gates and the
Sinkhorn-normalised stream mixing matrix, from the sub-block's mixes.

Contract::

    hc_split_sinkhorn(mixes, scale, base, *, n, iters, eps, implementation=None)
        -> (pre [..., n], post [..., n], comb [..., n, n]), all f32

    mixes: [..., (2 + n) n] floating (the stream mixes, f32)    scale: [3]    base: [(2 + n) n]
    pre  = sigmoid(mixes[0:n] * scale[0] + base[0:n]) + eps
    post = 2 sigmoid(mixes[n:2n] * scale[1] + base[n:2n])
    M    = (mixes[2n:] * scale[2] + base[2n:]).view(n, n)
    M    = softmax_rows(M) + eps;  M = M / (colsum(M) + eps)
    iters - 1 times:  M = M / (rowsum(M) + eps);  M = M / (colsum(M) + eps)
    comb = M

All in f32. The reference (``ffi/hc_sinkhorn_reference.py``) is an elementwise chain in XLA;
the Hopper kernel (``ffi/hc_sinkhorn_sm90.py``) does it in one launch, one thread per token,
and matches it to a few ulps (both scale a row by the reciprocal of its sum).
"""
from __future__ import annotations

from . import hc_sinkhorn_sm90
from .dispatch import dispatch
from .hc_sinkhorn_reference import check_hc_sinkhorn_args, hc_split_sinkhorn_reference
from .registry import OpSpec, register

__all__ = ["hc_split_sinkhorn", "hc_split_sinkhorn_reference", "check_hc_sinkhorn_args"]


def _support(mixes, scale=None, base=None, *, n, iters, **_):
    return hc_sinkhorn_sm90.support(mixes, n, iters)


def hc_split_sinkhorn(mixes, scale, base, *, n: int, iters: int, eps: float,
                      implementation: str | None = None):
    """The mHC split; see the module docstring. ``implementation``: ``"cute"`` (the Hopper
    kernel; raises when it cannot run), ``"xla"`` (the reference) or None (the kernel when
    lowering for a Hopper GPU, else the reference)."""
    check_hc_sinkhorn_args(mixes, scale, base, n, iters)
    static = dict(n=n, iters=iters, eps=float(eps))
    return dispatch("hc_split_sinkhorn", implementation,
                    lambda: _support(mixes, n=n, iters=iters),
                    lambda m, s, b: hc_split_sinkhorn_reference(m, s, b, **static),
                    lambda m, s, b: hc_sinkhorn_sm90.hc_split_sinkhorn_cute(m, s, b, **static),
                    mixes, scale, base)


register(OpSpec("hc_split_sinkhorn", hc_split_sinkhorn_reference, _support))
