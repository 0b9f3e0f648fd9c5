"""The grouped GEMM's pure-JAX reference and argument checks (contract: ``ffi/grouped_gemm.py``).

The checks here are shared by every op built on the grouped GEMM (the routed experts
check their three projections with ``check_weight``).
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from dsv4_jax import quant
from dsv4_jax.quant import WeightFormat, matrix_dims
from .norm import rms_norm

__all__ = ["grouped_gemm_reference", "check_grouped_gemm_args", "check_weight",
           "grouped_gemm_pair_reference", "check_pair_args", "check_row_norm", "normed_rows",
           "check_ids_in_range", "grouped_products", "swiglu", "describe"]

HIGHEST = jax.lax.Precision.HIGHEST
ACT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def describe(name: str, x) -> str:
    return f"{name} has shape {tuple(x.shape)} and dtype {x.dtype}"


def check_weight(op: str, name: str, w, groups: int, out_f: int, in_f: int) -> WeightFormat:
    """One ``(weight, scale)`` pair of logical shape ``[groups, out_f, in_f]``: its format, or
    ``TypeError``/``ValueError`` naming ``name`` and the shapes."""
    if not isinstance(w, (tuple, list)) or len(w) != 2:
        raise TypeError(f"{op}: {name} must be a (weight, scale or None) pair, got "
                        f"{type(w).__name__}")
    weight, scale = w
    fmt = quant.weight_format(weight, scale, name=name, op=op)
    want = (groups, *fmt.stored_shape(out_f, in_f))
    if tuple(weight.shape) != want or in_f % fmt.codes_per_byte:
        packed = ""
        if fmt.name == "fp4":
            packed = (" (FP4 blocked: [E, out/64, in/128, 64, 64] bytes)"
                      if fmt.layout == "blocked" else " (FP4: two codes per byte)")
        raise ValueError(f"{op}: {name} weight must be [E={groups}, "
                         f"{', '.join(map(str, want[1:]))}]"
                         f"{packed}; {describe(name, weight)}")
    if not fmt.quantized:
        return fmt
    if fmt.name == "fp4" and in_f % fmt.scale_block[1]:
        raise ValueError(f"{op}: {name} is FP4 with in={in_f}, not a multiple of the 32-wide "
                         f"scale blocks; {describe(name, weight)}")
    want = (groups, *fmt.scale_shape(out_f, in_f))
    if tuple(scale.shape) != want:
        raise ValueError(f"{op}: {name} scale must be {list(want)} for {fmt.name.upper()} "
                         f"weight {tuple(weight.shape)}; {describe(name + ' scale', scale)}")
    if jnp.dtype(scale.dtype) not in quant.SCALE_DTYPES:
        raise TypeError(f"{op}: {name} scale must be E8M0 (float8_e8m0fnu or uint8) or f32; "
                        f"{describe(name + ' scale', scale)}")
    return fmt


def check_ids_in_range(ids, n_groups: int, op: str, what: str = "expert") -> None:
    """Concrete ids outside ``[0, G)`` are a caller bug: raise. Traced ids are dropped."""
    if ids is None or isinstance(ids, jax.core.Tracer):
        return
    values = np.asarray(ids)
    bad = (values < 0) | (values >= n_groups)
    if bad.any():
        raise ValueError(f"{op}: {what} id {int(values[bad][0])} outside [0, {n_groups}) "
                         f"({int(bad.sum())} of {values.size} ids); inside jit such ids are "
                         f"dropped")


def check_grouped_gemm_args(x, group_ids, w, w_up=None, row_weights=None) -> WeightFormat:
    """Raise ``TypeError``/``ValueError`` naming the argument when shapes or dtypes are wrong;
    returns the weights' format."""
    op = "grouped_gemm"
    if x.ndim != 2:
        raise ValueError(f"{op}: x must be [rows, K]; {describe('x', x)}")
    if jnp.dtype(x.dtype) not in ACT_DTYPES:
        raise TypeError(f"{op}: x must be bf16 or f32; {describe('x', x)}")
    rows, k = x.shape
    if (not isinstance(w, (tuple, list)) or len(w) != 2
            or getattr(w[0], "ndim", 0) not in (3, 5)):
        raise ValueError(f"{op}: w must be a (weight [G, N, K], scale) pair (blocked FP4: "
                         f"[G, N/64, K/128, 64, 64]); got "
                         + (describe("w", w[0]) if isinstance(w, (tuple, list)) and w
                            and hasattr(w[0], "shape") else type(w).__name__))
    groups, n = matrix_dims(w[0])[:2]
    if group_ids is None:
        if rows % groups:
            raise ValueError(f"{op}: group_ids=None takes the rows in {groups} equal blocks, "
                             f"one per group: M={rows} is not a multiple of G={groups}; "
                             f"{describe('x', x)}, {describe('w', w[0])}")
    elif group_ids.shape != (rows,):
        raise ValueError(f"{op}: group_ids must be [M={rows}]; {describe('group_ids', group_ids)}")
    elif group_ids.dtype != jnp.int32:
        raise TypeError(f"{op}: group_ids must be int32; {describe('group_ids', group_ids)}")
    fmt = check_weight(op, "w", w, groups, n, k)
    if w_up is not None:
        fmt_up = check_weight(op, "w_up", w_up, groups, n, k)
        if fmt_up is not fmt:
            raise TypeError(f"{op}: w and w_up must share one format, got {fmt.label}, "
                            f"{fmt_up.label}")
    if row_weights is not None:
        if w_up is None:
            raise ValueError(f"{op}: row_weights belong to the gated form (give w_up too)")
        if row_weights.shape != (rows,) or not jnp.issubdtype(row_weights.dtype, jnp.floating):
            raise ValueError(f"{op}: row_weights must be floating [M={rows}]; "
                             f"{describe('row_weights', row_weights)}")
    return fmt


def check_row_norm(op: str, row_norm, x) -> None:
    """``row_norm``: None or ``(weight [K], eps)`` -- a floating norm weight of x's features
    and a non-negative Python float; else ``TypeError``/``ValueError`` naming it."""
    if row_norm is None:
        return
    if not isinstance(row_norm, (tuple, list)) or len(row_norm) != 2:
        raise TypeError(f"{op}: row_norm must be None or a (weight [K], eps) pair, got "
                        f"{type(row_norm).__name__}")
    weight, eps = row_norm
    if (getattr(weight, "ndim", None) != 1 or weight.shape[0] != x.shape[1]
            or not jnp.issubdtype(weight.dtype, jnp.floating)):
        raise ValueError(f"{op}: row_norm weight must be floating [K={x.shape[1]}]; "
                         + (describe("row_norm weight", weight) if hasattr(weight, "shape")
                            else f"got {type(weight).__name__}") + f", {describe('x', x)}")
    if not isinstance(eps, (float, int)) or isinstance(eps, bool) or not eps >= 0:
        raise TypeError(f"{op}: row_norm eps must be a Python float >= 0 (static), got "
                        f"{eps!r} of type {type(eps).__name__}")


def normed_rows(x, row_norm):
    """``rms_norm(x, weight, eps)`` for ``row_norm = (weight, eps)``; ``x`` when None."""
    return x if row_norm is None else rms_norm(x, row_norm[0], float(row_norm[1]))


def check_pair_args(x, group_ids, w, w_next) -> None:
    """``grouped_gemm_pair``'s arguments: ``check_grouped_gemm_args`` for ``w``, and
    ``w_next`` a (weight, scale) pair of the same groups and input features."""
    check_grouped_gemm_args(x, group_ids, w)
    op = "grouped_gemm_pair"
    if (not isinstance(w_next, (tuple, list)) or len(w_next) != 2
            or getattr(w_next[0], "ndim", 0) not in (3, 5)):
        raise ValueError(f"{op}: w_next must be a (weight [G, N_next, K], scale) pair "
                         f"(blocked FP4: [G, N_next/64, K/128, 64, 64]); got "
                         + (describe("w_next", w_next[0])
                            if isinstance(w_next, (tuple, list)) and w_next
                            and hasattr(w_next[0], "shape") else type(w_next).__name__))
    check_weight(op, "w_next", w_next, w[0].shape[0], matrix_dims(w_next[0])[1], x.shape[1])


# ----------------------------------------------------------------------------- reference
def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """``silu(min(gate, l)) * clip(up, -l, l)`` in f32 (``limit`` 0: no clamp)."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    return jax.nn.silu(gate) * up


def _dot_rows(x, w, simulate, out_dtype):
    """Each row times its own weight matrix ``w [M, N, K]``."""
    xin, win = quant.gemm_operands(x, w, simulate)
    return jnp.einsum("ad,aod->ao", xin, win, preferred_element_type=jnp.float32,
                      precision=HIGHEST).astype(out_dtype)


def _dot_blocks(x, w, simulate, out_dtype):
    """Rows in G equal consecutive blocks, block g times ``w[g]`` (``w [G, N, K]``); one
    group is a dense linear."""
    xin, win = quant.gemm_operands(x, w, simulate)
    if w.shape[0] == 1:
        return jnp.einsum("...i,oi->...o", xin, win[0], preferred_element_type=jnp.float32,
                          precision=HIGHEST).astype(out_dtype)
    g = w.shape[0]
    y = jnp.einsum("gti,goi->gto", xin.reshape(g, -1, xin.shape[-1]), win,
                   preferred_element_type=jnp.float32, precision=HIGHEST)
    return y.reshape(x.shape[0], -1).astype(out_dtype)


def _dot_grouped(x, w, group_sizes, simulate, out_dtype):
    """Rows sorted by group times their group's matrix of ``w [G, N, K]``."""
    xin, win = quant.gemm_operands(x, w, simulate)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])),
        lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(xin, win, group_sizes, dims, precision=HIGHEST,
                                      preferred_element_type=jnp.float32).astype(out_dtype)


def grouped_products(x, group_ids, mats, simulate):
    """``[x' W^T for W in mats]`` rounded to x's dtype, each row by its group (ids must be in
    ``[0, G)``; ``group_ids`` None: the rows in G equal consecutive blocks). The reference's
    schedules: equal blocks are one batched dot; otherwise rows gather their group's weights
    when there are fewer rows than groups, else rows sorted by group and one
    ``ragged_dot_general`` per matrix (outputs back in row order)."""
    dt = x.dtype
    groups = mats[0][0].shape[0]
    if group_ids is None:
        return [_dot_blocks(x, quant.dequant_weight(w, s, dt), simulate, dt) for w, s in mats]
    if x.shape[0] < groups:
        return [_dot_rows(x, quant.dequant_weight(w[group_ids], None if s is None
                                                  else s[group_ids], dt), simulate, dt)
                for w, s in mats]
    order = jnp.argsort(group_ids, stable=True)
    sizes = jnp.bincount(group_ids, length=groups).astype(jnp.int32)
    xs = x[order]
    outs = [_dot_grouped(xs, quant.dequant_weight(w, s, dt), sizes, simulate, dt)
            for w, s in mats]
    return [jnp.zeros_like(o).at[order].set(o) for o in outs]


def grouped_gemm_reference(x, group_ids, w, *, w_up=None, row_weights=None,
                           swiglu_limit: float = 0.0, simulate: bool = False, row_norm=None):
    """Pure-JAX definition of ``grouped_gemm`` (runs anywhere); see the module docstring."""
    check_grouped_gemm_args(x, group_ids, w, w_up, row_weights)
    check_row_norm("grouped_gemm", row_norm, x)
    x = normed_rows(x, row_norm)
    groups = w[0].shape[0]
    ids, valid = group_ids, None
    if group_ids is not None:
        valid = (group_ids >= 0) & (group_ids < groups)
        ids = jnp.where(valid, group_ids, 0)
    mats = [w] if w_up is None else [w, w_up]
    outs = grouped_products(x, ids, mats, simulate)
    if w_up is None:
        y = outs[0]
    else:
        h = swiglu(outs[0], outs[1], swiglu_limit)
        if row_weights is not None:
            h = row_weights.astype(jnp.float32)[:, None] * h
        y = h.astype(x.dtype)
    return y if valid is None else jnp.where(valid[:, None], y, jnp.zeros((), y.dtype))


def grouped_gemm_pair_reference(x, group_ids, w, w_next, *, simulate: bool = False,
                                row_norm=None):
    """Pure-JAX definition of ``grouped_gemm_pair``: the two plain grouped GEMMs (of the
    normed rows with ``row_norm``)."""
    check_pair_args(x, group_ids, w, w_next)
    check_row_norm("grouped_gemm_pair", row_norm, x)
    x = normed_rows(x, row_norm)
    return tuple(grouped_gemm_reference(x, group_ids, m, simulate=simulate)
                 for m in (w, w_next))
