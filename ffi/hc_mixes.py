"""The stream mixes of one sub-block's mHC pre (docs/architecture.md §3.2), as an op: the
GEMM of the prefill's mHC chain.

Contract::

    hc_stream_mixes(x, fn, *, norm_eps, implementation=None) -> mixes [..., M] f32

    x: [..., n, d] floating (the residual streams)      fn: [M, n d] f32 (M = (2 + n) n)
    mixes = (flatten(x) @ fn.T) * rsqrt(mean(flatten(x)^2) + norm_eps)      in f32

The reference (``ffi/hc_mixes_reference.py``) is ``hc_pre_reference.stream_mixes`` (XLA's
dot), the chain's own definition. The Hopper kernel
(``ffi/hc_mixes_sm90.py``) runs the product on bf16 tensor cores with fn split exactly into
three bf16 parts, K sliced over the grid, for bf16 streams; the slices are added in order in
one XLA fusion, so its mixes are the f32 product's up to the summation order. ``hc_pre``'s
chain (the rows above its own kernel's, i.e. prefill) calls this op.
"""
from __future__ import annotations

from . import hc_mixes_sm90
from .dispatch import dispatch
from .hc_mixes_reference import (check_hc_stream_mixes_args, hc_stream_mixes_reference,
                                 stream_mixes)
from .registry import OpSpec, register

__all__ = ["hc_stream_mixes", "hc_stream_mixes_reference", "check_hc_stream_mixes_args"]


def _support(x, fn, **_):
    return hc_mixes_sm90.support(x, fn)


def hc_stream_mixes(x, fn, *, norm_eps: float, implementation: str | None = None):
    """The stream mixes; see the module docstring. ``implementation``: ``"cute"`` (the
    Hopper kernel; raises when it cannot run), ``"xla"`` (the reference) or None (the
    kernel when lowering for a Hopper GPU and it supports the arguments, else the
    reference)."""
    check_hc_stream_mixes_args(x, fn)
    eps = float(norm_eps)
    return dispatch("hc_stream_mixes", implementation, lambda: _support(x, fn),
                    lambda a, f: stream_mixes(a, f, eps),
                    lambda a, f: hc_mixes_sm90.hc_stream_mixes_cute(a, f, norm_eps=eps),
                    x, fn)


register(OpSpec("hc_stream_mixes", hc_stream_mixes_reference, _support))
