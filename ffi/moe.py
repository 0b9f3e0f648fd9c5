"""Routed experts of one MoE layer: the op every DSV4 MoE layer calls.

Contract::

    moe_experts(x, route_idx, route_w, w1, w3, w2, *, swiglu_limit, quantized, simulate,
                implementation=None, policy=None) -> y [T, d] f32
    moe_expert_rows(xa, ea, wa, w1, w3, w2, *, swiglu_limit, quantized, simulate,
                    implementation=None, policy=None) -> rows [A, d] in xa's dtype

    x:          [T, d]  token rows, bf16 or f32
    route_idx:  [T, k]  int32 expert ids, k <= E;   route_w: [T, k] floating routing weights
    xa, ea, wa: [A, d], [A], [A]  one row per (token, expert) assignment
    w1, w3:     (weight, scale) of logical shape [E, inter, d];  w2: [E, d, inter]
      packed FP4 e2m1: int8/uint8 weight [E, out, in/2] (low nibble = even column),
                       E8M0 scale [E, out, in/32]
      FP8 e4m3:        float8_e4m3fn weight [E, out, in], E8M0 scale [E, ceil(out/128),
                       ceil(in/128)]
      plain:           bf16/f16/f32 weight [E, out, in], scale None
      (E8M0 scales: float8_e8m0fnu, raw uint8 exponent bytes, or f32 powers of two)

    rows[a] = w2[e] (wa[a] * swiglu(w1[e] xa[a], w3[e] xa[a]))          e = ea[a]
    y[t]    = sum_j rows of (t, route_idx[t, j])                          f32 accumulation
    swiglu(g, u) = silu(min(g, l)) * clip(u, -l, l)                       l = swiglu_limit (0: none)

Numerics of the reference (the model's arithmetic, ``quant.gemm_operands``):

* official (``quantized`` weights and ``simulate``, i.e. ``Config.quant_simulation``): before
  each of the three GEMMs the activation is quantised to FP8 e4m3 in 1x128 blocks with
  power-of-two scales; the GEMMs multiply those values by the exactly dequantised weights (BF16
  operands, both exact), accumulate in f32 and round their outputs to xa's dtype (BF16 for the
  BF16 model). SwiGLU and the routing weight are applied in f32 -- the weight *before* w2 --
  and h is rounded to xa's dtype before the FP8 quantisation of the w2 GEMM.
* ``simulate=False`` or plain weights: weights dequantised exactly; BF16 activations multiply
  BF16 weights, f32 activations f32 weights (true f32, no TF32), f32 accumulation.

The reference (``ffi/moe_reference.py``) is two grouped GEMMs (``ffi/grouped_gemm.py``, one
group per expert); so is the Hopper path (``ffi/moe_sm90.py``), which sorts the rows once
for both launches. The outputs are fresh arrays.

Expert ids outside ``[0, E)`` are never read: concrete ids (outside ``jit``) raise
``ValueError``; traced ids are *dropped* -- the row's output is 0 and it adds nothing to its
token (expert parallelism relies on this for its empty slots, id -1).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from .dispatch import dispatch
from .grouped_gemm_reference import check_ids_in_range, swiglu
from .moe_reference import (check_moe_args, moe_expert_rows_reference, moe_experts_reference,
                            sum_rows_per_token)
from .moe_sm90 import moe_expert_rows_cute, moe_experts_cute, moe_support
from .policy import GroupedGemmPolicy
from .registry import OpSpec, register

__all__ = ["moe_experts", "moe_experts_reference", "moe_expert_rows",
           "moe_expert_rows_reference", "check_moe_args", "swiglu", "sum_rows_per_token",
           "moe_experts_cute", "moe_expert_rows_cute"]


def _rows_support(xa, ea, wa, w1, w3, w2, *, quantized=True, simulate=True, policy=None,
                  **_):
    return moe_support(xa.shape[0], jnp.dtype(xa.dtype).name, w1, w3, w2,
                       simulate=bool(quantized and simulate), policy=policy)


def _tokens_support(x, route_idx, route_w, w1, w3, w2, *, quantized=True, simulate=True,
                    policy=None, **_):
    return moe_support(route_idx.size, jnp.dtype(x.dtype).name, w1, w3, w2,
                       simulate=bool(quantized and simulate), policy=policy)


def _run(op, reference_fn, kernel_fn, support_fn, args, weights, *, swiglu_limit, quantized,
         simulate, implementation, policy):
    policy = policy or GroupedGemmPolicy()
    static = dict(swiglu_limit=swiglu_limit, quantized=quantized, simulate=simulate)

    def reference(*operands):
        return reference_fn(*operands[:3], *_pairs(operands[3:]), **static)

    def kernel(*operands):
        return kernel_fn(*operands[:3], *_pairs(operands[3:]),
                         swiglu_limit=float(swiglu_limit),
                         simulate=bool(quantized and simulate), policy=policy)

    return dispatch(op, implementation,
                    lambda: support_fn(*args, *weights, policy=policy, **static),
                    reference, kernel, *args, *(a for w in weights for a in w))


def _pairs(flat):
    return [tuple(flat[i:i + 2]) for i in range(0, len(flat), 2)]


def moe_expert_rows(xa, ea, wa, w1, w3, w2, *, swiglu_limit, quantized, simulate,
                    implementation=None, policy: GroupedGemmPolicy | None = None):
    """``w2(wa * swiglu(w1 xa, w3 xa))`` per assignment row; see the module docstring.

    ``implementation``: ``"cute"`` (the Hopper kernel; raises when it cannot run these
    arguments or there is no GPU), ``"xla"`` (the reference) or ``None`` (the kernel when
    lowering for a Hopper GPU and it supports the arguments, else the reference).
    ``policy``: the grouped GEMM's ``GroupedGemmPolicy`` (None: the defaults).
    """
    check_moe_args(xa, ea, wa, w1, w3, w2, op="moe_expert_rows")
    # The kernel drops ids outside [0, E) itself: expert parallelism sends id -1 for its
    # empty capacity slots, and clamping them would make it compute expert 0 for every one.
    check_ids_in_range(ea, w1[0].shape[0], "moe_expert_rows")
    return _run("moe_expert_rows", moe_expert_rows_reference, moe_expert_rows_cute,
                _rows_support, (xa, ea, wa), (w1, w3, w2), swiglu_limit=swiglu_limit,
                quantized=quantized, simulate=simulate, implementation=implementation,
                policy=policy)


def moe_experts(x, route_idx, route_w, w1, w3, w2, *, swiglu_limit, quantized, simulate,
                implementation=None, policy: GroupedGemmPolicy | None = None,
                summed: bool = True):
    """Routed-expert output of one MoE layer, f32 ``[T, d]``; see the module docstring.

    ``implementation`` and ``policy`` as for ``moe_expert_rows``. ``summed=False``: the
    unsummed parts ``(rows [T k, d], position [T k] int32, valid [T k] bool)`` of
    ``ffi.ffn_sum.FfnSum`` instead (a kernel's rows in its own order), for a consumer that
    adds them itself.
    """
    check_moe_args(x, route_idx, route_w, w1, w3, w2, op="moe_experts")
    check_ids_in_range(route_idx, w1[0].shape[0], "moe_experts")
    return _run("moe_experts", functools.partial(moe_experts_reference, summed=summed),
                functools.partial(moe_experts_cute, summed=summed), _tokens_support,
                (x, route_idx, route_w), (w1, w3, w2), swiglu_limit=swiglu_limit,
                quantized=quantized, simulate=simulate, implementation=implementation,
                policy=policy)


register(OpSpec("moe_experts", moe_experts_reference, _tokens_support))
register(OpSpec("moe_expert_rows", moe_expert_rows_reference, _rows_support))
