"""The routed experts' pure-JAX reference and argument checks (contract: ``ffi/moe.py``).

The reference is two grouped GEMMs (``grouped_gemm_reference``: the gated w1/w3 with the
SwiGLU x routing weight, then w2) over the assignment rows, each row in its expert's group.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from dsv4_jax.quant import matrix_dims
from .grouped_gemm_reference import ACT_DTYPES, check_weight, describe, grouped_gemm_reference

__all__ = ["moe_experts_reference", "moe_expert_rows_reference", "check_moe_args",
           "inverse_order", "sum_rows_per_token"]


def check_moe_args(x, idx, weights, w1, w3, w2, *, op: str = "moe_experts"):
    """Raise ``TypeError``/``ValueError`` naming the argument when shapes or dtypes are wrong.

    Token form: ``x [T, d]``, ``idx``/``weights [T, k]``; row form: ``x [A, d]``,
    ``idx``/``weights [A]``. Returns the weights' ``quant.WeightFormat``.
    """
    if x.ndim != 2:
        raise ValueError(f"{op}: x must be [rows, d]; {describe('x', x)}")
    if jnp.dtype(x.dtype) not in ACT_DTYPES:
        raise TypeError(f"{op}: x must be bf16 or f32; {describe('x', x)}")
    rows, d = x.shape
    want = "[T, k]" if idx.ndim == 2 else "[A]"
    if idx.ndim not in (1, 2) or idx.shape[0] != rows:
        raise ValueError(f"{op}: expert ids must be [T={rows}, k] (or [A={rows}] per row); "
                         f"{describe('idx', idx)}, {describe('x', x)}")
    if idx.dtype != jnp.int32:
        raise TypeError(f"{op}: expert ids must be int32; {describe('idx', idx)}")
    if tuple(weights.shape) != tuple(idx.shape):
        raise ValueError(f"{op}: routing weights must be {want} like the ids; "
                         f"{describe('weights', weights)}, {describe('idx', idx)}")
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise TypeError(f"{op}: routing weights must be floating; "
                        f"{describe('weights', weights)}")
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        if (not isinstance(w, (tuple, list)) or len(w) != 2
                or getattr(w[0], "ndim", 0) not in (3, 5)):
            raise ValueError(f"{op}: {name} must be a (weight [E, out, in], scale) pair "
                             f"(blocked FP4: [E, out/64, in/128, 64, 64]); got "
                             + (describe(name, w[0]) if isinstance(w, (tuple, list)) and w
                                and hasattr(w[0], "shape") else type(w).__name__))
    e, inter = matrix_dims(w1[0])[:2]
    fmt = check_weight(op, "w1", w1, e, inter, d)
    fmt3 = check_weight(op, "w3", w3, e, inter, d)
    w2_in = matrix_dims(w2[0])[2] * (2 if w2[0].dtype in (jnp.int8, jnp.uint8) else 1)
    if w2[0].shape[0] != e or w2_in != inter:
        raise ValueError(f"{op}: w2 weight must be [E={e}, d={d}, inter={inter}] (w1 is "
                         f"{tuple(w1[0].shape)}); {describe('w2', w2[0])}")
    fmt2 = check_weight(op, "w2", w2, e, d, inter)
    if not fmt is fmt3 is fmt2:
        raise TypeError(f"{op}: w1, w3, w2 must share one format, got {fmt.label}, "
                        f"{fmt3.label}, {fmt2.label}")
    if idx.ndim == 2 and idx.shape[1] > e:
        raise ValueError(f"{op}: k={idx.shape[1]} experts per token > E={e} experts; "
                         f"{describe('idx', idx)}")
    return fmt


def moe_expert_rows_reference(xa, ea, wa, w1, w3, w2, *, swiglu_limit, quantized, simulate):
    """Pure-JAX definition of ``moe_expert_rows`` (runs anywhere); see ``ffi/moe.py``."""
    check_moe_args(xa, ea, wa, w1, w3, w2, op="moe_expert_rows")
    sim = bool(quantized and simulate)
    h = grouped_gemm_reference(xa, ea, w1, w_up=w3, row_weights=wa,
                               swiglu_limit=swiglu_limit, simulate=sim)
    return grouped_gemm_reference(h, ea, w2, simulate=sim)


def inverse_order(order):
    """``position`` with ``position[order[j]] = j``: where each row of a permutation went."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def sum_rows_per_token(rows, order, t: int, k: int, position=None):
    """``[t, d]`` f32: token ``i``'s sum of its ``k`` assignment rows, where ``rows[j]``
    holds assignment ``order[j]`` (assignment ``a`` = token ``a // k``; ``order`` None: the
    identity), or ``rows[position[a]]`` holds assignment ``a`` (``position``, the inverse of
    ``order``, when the caller has it). A gather and k - 1 additions in assignment order --
    ``((r_0 + r_1) + r_2) ...`` -- not a scatter-add (``segment_sum``): those are atomic on
    the GPU and change the last bit run to run. Elementwise additions, not a reduction: XLA
    fuses them with what consumes the sum (the shared expert's add and the cast)."""
    if position is None and order is not None:
        position = inverse_order(order)
    if position is not None:
        rows = rows[position]
    per_token = rows.astype(jnp.float32).reshape(t, k, rows.shape[-1])
    total = per_token[:, 0]
    for j in range(1, k):
        total = total + per_token[:, j]
    return total


def moe_experts_reference(x, route_idx, route_w, w1, w3, w2, *, swiglu_limit, quantized,
                          simulate, summed: bool = True):
    """Pure-JAX definition of ``moe_experts`` (runs anywhere); see ``ffi/moe.py``
    (``summed=False``: the rows in assignment order, the identity positions, their ids'
    validity)."""
    check_moe_args(x, route_idx, route_w, w1, w3, w2, op="moe_experts")
    t, k = route_idx.shape
    rows = functools.partial(moe_expert_rows_reference, w1=w1, w3=w3, w2=w2,
                             swiglu_limit=swiglu_limit, quantized=quantized, simulate=simulate)
    token = jnp.repeat(jnp.arange(t), k)
    out = rows(x[token], route_idx.reshape(-1), route_w.reshape(-1))
    if not summed:
        ids = route_idx.reshape(-1)
        return (out, jnp.arange(t * k, dtype=jnp.int32),
                (ids >= 0) & (ids < w1[0].shape[0]))
    return sum_rows_per_token(out, None, t, k)
