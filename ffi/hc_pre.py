"""The mHC pre of one sub-block (docs/architecture.md §3.2): the stream mixes, the mHC split,
the collapse of the streams into the sub-block input and its RMSNorm, in one op.

Contract::

    hc_pre(x, fn, scale, base, weight, *, n, iters, hc_eps, norm_eps, implementation=None,
           split_implementation=None, mixes_implementation=None, pending=None)
        -> (out [..., d], post [..., n], comb [..., n, n])      (pending: and x_new [..., n, d])

    x: [..., n, d] floating (the residual streams)   fn: [(2 + n) n, n d] f32
    scale: [3]   base: [(2 + n) n]   weight: [d] (the sub-block's RMSNorm weight)
    mix  = (flatten(x) @ fn.T) * rsqrt(mean(flatten(x)^2) + norm_eps)      in f32
    pre, post, comb = hc_split_sinkhorn(mix, scale, base, n=n, iters=iters, eps=hc_eps)
    y    = (sum_j pre[j] x[j]) in f32, cast to x's dtype
    out  = rms_norm(y, weight, norm_eps)                                     x's dtype

    pending = (out_p [..., d], post_p [..., n], comb_p [..., n, n]) of the sub-block before:
    x is first replaced by x_new = hc_post(out_p, x, post_p, comb_p) -- post_p[k] out_p +
    sum_j comb_p[j, k] x[j] in f32, in x's dtype -- and x_new is returned too, the residual
    streams of the next hc_post. One op for the previous sub-block's update and this one's
    pre (2 XLA launches fewer per sub-block on the kernel). out_p may be an
    ``ffi.ffn_sum.FfnSum`` (a MoE sub-block's routed rows and shared row, unsummed): out_p
    is then its ``total()``, which the kernel adds itself, in the same order (one XLA launch
    fewer per layer).

The reference (``ffi/hc_pre_reference.py``) is that chain in XLA; the Hopper kernel
(``ffi/hc_pre_sm90.py``) runs it in one launch for decode-size inputs (bf16 x, at most
``kernels.hc_pre_config.MAX_TOKENS`` tokens); for one cluster's tokens (a batch-1 decode
step) the split's Sinkhorn chain is a second launch on the mixes it stores
(``HcPreSm90Config.split_apart``): only the next sub-block's mHC pre reads post and comb, so
the split is off the step's critical path.
Where the kernel does not run (a prefill's rows), the chain runs with the stream mixes and
the split as ops of their own (``mixes_implementation``, ``split_implementation``: their
kernels on Hopper).
"""
from __future__ import annotations

from . import hc_pre_sm90
from .dispatch import dispatch
from .hc_mixes import hc_stream_mixes
from .hc_pre_reference import check_hc_pre_args, check_pending, hc_pre_reference
from .hc_sinkhorn import hc_split_sinkhorn
from .registry import OpSpec, register

__all__ = ["hc_pre", "hc_pre_reference", "check_hc_pre_args"]


def _support(x, fn=None, scale=None, base=None, weight=None, pending_out=None, *_, n, **__):
    return hc_pre_sm90.support(x, fn, weight, n, pending=pending_out is not None,
                               pending_out=pending_out)


def hc_pre(x, fn, scale, base, weight, *, n: int, iters: int, hc_eps: float, norm_eps: float,
           implementation: str | None = None, split_implementation: str | None = None,
           mixes_implementation: str | None = None, pending=None):
    """The mHC pre; see the module docstring. ``implementation``: ``"cute"`` (the Hopper
    kernel; raises when it cannot run), ``"xla"`` (the XLA chain) or None (the kernel when
    lowering for a Hopper GPU and it supports the arguments, else the chain).
    ``split_implementation``: the split op's, in the chain or after the kernel;
    ``mixes_implementation``: the stream-mixes op's, in the chain.
    ``pending``: the previous sub-block's ``(out, post, comb)`` (``out`` an array or an
    ``FfnSum``), applied to x first (x_new returned fourth)."""
    check_hc_pre_args(x, fn, scale, base, weight, n, iters)
    if pending is not None:
        check_pending(x, pending, n)
    static = dict(n=n, iters=iters, hc_eps=float(hc_eps), norm_eps=float(norm_eps))

    def split(mixes, s, b, *, n, iters, eps):
        return hc_split_sinkhorn(mixes, s, b, n=n, iters=iters, eps=eps,
                                 implementation=split_implementation)

    def mixes(xs, f, eps):
        return hc_stream_mixes(xs, f, norm_eps=eps, implementation=mixes_implementation)

    return dispatch("hc_pre", implementation,
                    lambda: _support(x, fn, scale, base, weight, *(pending or ()), n=n),
                    lambda *a: hc_pre_reference(*a, **static, split=split, mixes=mixes),
                    lambda *a: hc_pre_sm90.hc_pre_cute(*a, **static, split=split),
                    x, fn, scale, base, weight, *(pending or ()))


register(OpSpec("hc_pre", hc_pre_reference, _support))
