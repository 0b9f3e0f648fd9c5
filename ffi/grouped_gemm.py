"""Grouped GEMM on weights in their storage format: the op the routed experts (one group per
expert) and the dense linears (one group) build on.

Contract::

    grouped_gemm(x, group_ids, w, *, w_up=None, row_weights=None, swiglu_limit=0.0,
                 simulate=False, row_norm=None, implementation=None, policy=None)
        -> y [M, N] in x's dtype
    grouped_gemm_pair(x, group_ids, w, w_next, *, simulate=False, row_norm=None,
                      implementation=None, policy=None) -> (y [M, N], y_next [M, N_next])

    x:           [M, K] bf16 or f32 rows
    group_ids:   [M] int32, the group of each row (any order), or None: the rows in G equal
                 consecutive blocks, block g in group g (G = 1: a dense linear)
    w, w_up:     (weight, scale or None) of logical shape [G, N, K] in one
                 ``quant.WeightFormat`` (FP4 + E8M0 1x32, FP8 + E8M0 128x128, or plain)
    row_weights: [M] floating, gated form only (None: 1)
    row_norm:    None, or (weight [K], eps): the rows are ``rms_norm(x, weight, eps)``'s
                 output first (a linear after an RMSNorm; under
                 ``GroupedGemmPolicy(row_norm_in_kernel=True)`` the decode kernels that
                 quantise their tokens normalise them too, so the norm takes no launch)

    plain:  y[m] = x'[m] . W[g_m]^T
    gated:  y[m] = rw[m] * swiglu(round(x'[m] . W[g_m]^T), round(x'[m] . W_up[g_m]^T))
    swiglu(g, u) = silu(min(g, l)) * clip(u, -l, l)          (l = swiglu_limit; 0: none)

Numerics (``quant.gemm_operands``): ``x' = act_quant_dequant(x)`` (FP8 e4m3, 1 x 128 blocks,
power-of-two scales) when ``simulate`` -- the official path for quantised weights -- else
``x``; the weights dequantised exactly; products summed in f32; every GEMM output rounded
to x's dtype ("round" above), the SwiGLU and the row weight applied in f32 and rounded once.
A row whose group id is outside ``[0, G)`` is dropped: its output is 0 (concrete ids outside
``jit`` raise ``ValueError``). The reference (``grouped_gemm_reference``) gathers each row's
group weights when there are fewer rows than groups, else sorts the rows by group and runs
one ``lax.ragged_dot_general`` per matrix; the kernel path is ``grouped_gemm_sm90``.

``grouped_gemm_pair`` is two plain ``grouped_gemm`` of the same rows, ``w`` and ``w_next``
(``[G, N_next, K]``), computed as one: at decode a layer's linears that share an input
(``wq_a`` and ``wkv``) then cost one kernel launch, not two. The same numbers as two calls,
but for the order of f32 additions (the launch's K split covers both weights).
"""
from __future__ import annotations

import jax.numpy as jnp

from . import grouped_gemm_sm90
from .dispatch import dispatch
from .grouped_gemm_reference import (check_grouped_gemm_args, check_ids_in_range,
                                     check_pair_args, check_row_norm,
                                     grouped_gemm_pair_reference, grouped_gemm_reference)
from .policy import GroupedGemmPolicy
from .registry import OpSpec, register

__all__ = ["grouped_gemm", "grouped_gemm_reference", "check_grouped_gemm_args",
           "grouped_gemm_pair", "grouped_gemm_pair_reference"]


# ----------------------------------------------------------------------------- the op
def _row_norm_operand(row_norm):
    """``(weight or None, rebuild)``: the norm weight as a positional array operand (dispatch
    passes no keywords) and the function that makes ``row_norm`` of it again, eps static."""
    if row_norm is None:
        return None, lambda weight: None
    eps = float(row_norm[1])
    return row_norm[0], lambda weight: (weight, eps)


def _support(x, group_ids, w, w_up=None, row_weights=None, *, simulate=False, policy=None):
    return grouped_gemm_sm90.support(
        x.shape[0], x.shape[1], jnp.dtype(x.dtype).name, w, w_up,
        ragged=group_ids is not None, simulate=simulate, policy=policy)


def grouped_gemm(x, group_ids, w, *, w_up=None, row_weights=None, swiglu_limit: float = 0.0,
                 simulate: bool = False, row_norm=None, implementation: str | None = None,
                 policy: GroupedGemmPolicy | None = None):
    """Rows times their group's weights; see the module docstring for the contract.

    ``implementation``: ``"cute"`` (the Hopper kernel; raises when it cannot run these
    arguments or there is no GPU), ``"xla"`` (the reference) or None (the kernel when lowering
    for a Hopper GPU and it supports the arguments, else the reference). ``policy``: the
    kernels' ``GroupedGemmPolicy`` (None: the defaults).
    """
    check_grouped_gemm_args(x, group_ids, w, w_up, row_weights)
    check_ids_in_range(group_ids, w[0].shape[0], "grouped_gemm", "group")
    check_row_norm("grouped_gemm", row_norm, x)
    policy = policy or GroupedGemmPolicy()
    static = dict(swiglu_limit=float(swiglu_limit), simulate=bool(simulate))
    w_up = (None, None) if w_up is None else w_up
    norm_weight, norm = _row_norm_operand(row_norm)

    def reference(x, group_ids, weight, scale, up, up_scale, row_weights, norm_weight):
        return grouped_gemm_reference(
            x, group_ids, (weight, scale), w_up=None if up is None else (up, up_scale),
            row_weights=row_weights, row_norm=norm(norm_weight), **static)

    def kernel(x, group_ids, weight, scale, up, up_scale, row_weights, norm_weight):
        return grouped_gemm_sm90.grouped_gemm_cute(
            x, group_ids, (weight, scale), w_up=None if up is None else (up, up_scale),
            row_weights=row_weights, row_norm=norm(norm_weight), policy=policy, **static)

    gated = w_up[0] is not None
    return dispatch("grouped_gemm", implementation,
                    lambda: _support(x, group_ids, w, w_up if gated else None, row_weights,
                                     simulate=simulate, policy=policy),
                    reference, kernel, x, group_ids, *w, *w_up, row_weights, norm_weight)


def grouped_gemm_pair(x, group_ids, w, w_next, *, simulate: bool = False, row_norm=None,
                      implementation: str | None = None,
                      policy: GroupedGemmPolicy | None = None):
    """``(grouped_gemm(x, group_ids, w), grouped_gemm(x, group_ids, w_next))`` in one kernel
    launch where the kernel takes the pair (see the module docstring); ``row_norm``,
    ``implementation`` and ``policy`` are the grouped GEMM's."""
    check_pair_args(x, group_ids, w, w_next)
    check_ids_in_range(group_ids, w[0].shape[0], "grouped_gemm_pair", "group")
    check_row_norm("grouped_gemm_pair", row_norm, x)
    policy = policy or GroupedGemmPolicy()
    simulate = bool(simulate)
    norm_weight, norm = _row_norm_operand(row_norm)

    def reference(x, group_ids, weight, scale, weight_next, scale_next, norm_weight):
        return grouped_gemm_pair_reference(x, group_ids, (weight, scale),
                                           (weight_next, scale_next), simulate=simulate,
                                           row_norm=norm(norm_weight))

    def kernel(x, group_ids, weight, scale, weight_next, scale_next, norm_weight):
        return grouped_gemm_sm90.grouped_gemm_pair_cute(
            x, group_ids, (weight, scale), (weight_next, scale_next), simulate=simulate,
            row_norm=norm(norm_weight), policy=policy)

    def supported():
        return grouped_gemm_sm90.pair_support(
            x.shape[0], x.shape[1], jnp.dtype(x.dtype).name, w, w_next,
            ragged=group_ids is not None, simulate=simulate, policy=policy)

    return dispatch("grouped_gemm", implementation, supported, reference, kernel, x,
                    group_ids, *w, *w_next, norm_weight)


register(OpSpec("grouped_gemm", grouped_gemm_reference, _support))
