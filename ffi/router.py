"""The MoE router of one layer (docs/architecture.md §3.7): f32 affinities, the expert
choice and the routing weights, in one op.

Contract::

    moe_router(x, weight, bias, table, token_ids, *, k, score_func, route_scale,
               implementation=None) -> (route_w [T, k] f32, route_idx [T, k] int32)

    x: [T, d] floating (the normalised MoE input)     weight: [E, d] floating (the gate)
    bias: [E] f32 (top-k routing) or None             table: [vocab, k] int (hash routing) or None
    token_ids: [T] int (with a table)                 exactly one of bias and table
    logits = x @ weight.T                          in f32 (``matmul_f32``: exact products)
    scores = sqrt(softplus(logits)) | sigmoid(logits) | softmax(logits)    (score_func)
    route_idx = top_k(scores + bias, k) (ties: the lower expert first) | table[token_ids]
    route_w   = scores[route_idx], divided by its sum over k unless softmax, x route_scale

The reference (``ffi/router_reference.py``) is that chain in XLA (a dot, the score
function, a sort for the top-k, a gather, the normalisation); the Hopper kernel
(``ffi/router_sm90.py``) runs it in one launch for decode-size inputs (bf16 x and weight,
at most ``kernels.router_config.MAX_TOKENS`` tokens). ``table`` ids are expert ids in
``[0, E)`` by construction (the model's init and the checkpoint converter); token ids outside
``[0, vocab)`` read the nearest row, as XLA's gather does.
"""
from __future__ import annotations

from . import router_sm90
from .dispatch import dispatch
from .registry import OpSpec, register
from .router_reference import check_router_args, moe_router_reference

__all__ = ["moe_router", "moe_router_reference", "check_router_args"]


def _support(x, weight=None, bias=None, table=None, token_ids=None, *, k, score_func, **_):
    return router_sm90.support(x, weight, k)


def moe_router(x, weight, bias, table, token_ids, *, k: int, score_func: str,
               route_scale: float, implementation: str | None = None):
    """The router; see the module docstring. ``implementation``: ``"cute"`` (the Hopper
    kernel; raises when it cannot run), ``"xla"`` (the reference) or None (the kernel when
    lowering for a Hopper GPU and it supports the arguments, else the reference)."""
    check_router_args(x, weight, bias, table, token_ids, k, score_func, route_scale)
    static = dict(k=k, score_func=score_func, route_scale=float(route_scale))
    return dispatch("moe_router", implementation,
                    lambda: _support(x, weight, k=k, score_func=score_func),
                    lambda *a: moe_router_reference(*a, **static),
                    lambda *a: router_sm90.moe_router_cute(*a, **static),
                    x, weight, bias, table, token_ids)


register(OpSpec("moe_router", moe_router_reference, _support))
