"""Routed experts of one MoE layer: the op every DSV4 MoE layer calls.

Contract::

    moe_experts(x, route_idx, route_w, w1, w3, w2, *, swiglu_limit, quantized, simulate,
                implementation=None) -> y [T, d] f32
    moe_expert_rows(xa, ea, wa, w1, w3, w2, *, swiglu_limit, quantized, simulate,
                    implementation=None) -> rows [A, d] in xa's dtype

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

Two XLA schedules compute that: with fewer rows than experts (decode) each row gathers its
expert's weights; otherwise rows are sorted by expert and each projection is one
``lax.ragged_dot_general``. The outputs are fresh arrays.

Expert ids outside ``[0, E)`` are never read: concrete ids (outside ``jit``) raise
``ValueError``; traced ids are *dropped* -- the row's output is 0 and it adds nothing to its
token (expert parallelism relies on this for its empty slots, id -1).
"""
from __future__ import annotations

import functools
import os

import numpy as np
import jax
import jax.numpy as jnp

from dsv4_jax import quant
from dsv4_jax.kernels.moe_sm90 import (ALGORITHMS, BLOCK_K, DEFAULT_DECODE_ALGORITHM,
                                       DEFAULT_PREFILL_ALGORITHM, FP8_ACTIVATION_ALGORITHMS,
                                       PREFILL_ALGORITHMS, MoeGemmSm90Config, choose_config,
                                       num_tile_slots, warp_scale_group)
from .dispatch import cute_or_reference, select_implementation

__all__ = ["moe_experts", "moe_experts_reference", "moe_expert_rows",
           "moe_expert_rows_reference", "check_moe_args", "kernel_support", "swiglu",
           "decode_algorithm", "prefill_algorithm", "few_rows_split_k", "moe_experts_cute", "sum_rows_per_token",
           "weight_format", "moe_expert_rows_cute", "moe_schedule", "grouped_gemm_sm90"]

HIGHEST = jax.lax.Precision.HIGHEST
# Kernel for decode-size inputs: "mma_fp8" (default: warp-level MMAs on FP8 tensor cores for
# FP4/FP8 weights with the FP8 simulation, else "mma_sync"), "mma_sync" (warp-level bf16
# MMAs on weights dequantised in registers), "wgmma" (the prefill kernel with 8-row tiles) or
# "wgmma_fp8". Read at trace time.
ALGORITHM_ENV_VAR = "DSV4_MOE_ALGORITHM"
# Kernel for prefill-size inputs: "wgmma" (default) or "wgmma_fp8" (FP8 WGMMAs, FP4/FP8
# weights with the FP8 simulation; opt-in until measured on a GPU). Read at trace time.
PREFILL_ALGORITHM_ENV_VAR = "DSV4_MOE_PREFILL_ALGORITHM"
# K split of the decode kernels for at most 16 rows (T = 1-2): "1" (default, until measured
# on a GPU) or e.g. "4". Read at trace time.
SPLIT_K_ENV_VAR = "DSV4_MOE_SPLIT_K"
_ACT_DTYPES = (jnp.bfloat16, jnp.float32)
_PLAIN_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_SCALE_DTYPES = (quant.E8M0_DTYPE, jnp.uint8, jnp.float32)


# ----------------------------------------------------------------------------- argument checks
def _describe(name, x):
    return f"{name} has shape {tuple(x.shape)} and dtype {x.dtype}"


def weight_format(weight, scale, name: str = "weight", op: str = "moe") -> str:
    """``"fp4"``, ``"fp8"`` or ``"plain"`` from the storage dtype; TypeError when unknown."""
    if weight.dtype in (jnp.int8, jnp.uint8):
        fmt = "fp4"
    elif weight.dtype == quant.FP8_DTYPE:
        fmt = "fp8"
    elif weight.dtype in _PLAIN_DTYPES:
        fmt = "plain"
    else:
        raise TypeError(f"{op}: {name} must be packed FP4 (int8/uint8), FP8 e4m3 or "
                        f"bf16/f16/f32; {_describe(name, weight)}")
    if fmt == "plain" and scale is not None:
        raise ValueError(f"{op}: {name} is plain {weight.dtype} and takes no scale; "
                         f"{_describe(name + ' scale', scale)}")
    if fmt != "plain" and scale is None:
        raise ValueError(f"{op}: {name} is {fmt.upper()} ({_describe(name, weight)}) and needs "
                         f"its E8M0 scale, got None")
    return fmt


def _expected_scale_shape(fmt, e, out_f, in_f):
    if fmt == "fp4":
        return (e, out_f, in_f // 32)
    return (e, -(-out_f // 128), -(-in_f // 128))


def _check_projection(op, name, w, e, out_f, in_f):
    """One ``(weight, scale)`` pair of logical shape ``[e, out_f, in_f]``; returns its format."""
    if not isinstance(w, (tuple, list)) or len(w) != 2:
        raise TypeError(f"{op}: {name} must be a (weight, scale or None) pair, got "
                        f"{type(w).__name__}")
    weight, scale = w
    fmt = weight_format(weight, scale, name, op)
    stored_in = in_f // 2 if fmt == "fp4" else in_f
    if weight.ndim != 3 or tuple(weight.shape) != (e, out_f, stored_in) or (
            fmt == "fp4" and in_f % 2):
        packed = " (FP4: two codes per byte)" if fmt == "fp4" else ""
        raise ValueError(f"{op}: {name} weight must be [E={e}, {out_f}, {stored_in}]{packed}; "
                         f"{_describe(name, weight)}")
    if fmt == "plain":
        return fmt
    if fmt == "fp4" and in_f % 32:
        raise ValueError(f"{op}: {name} is FP4 with in={in_f}, not a multiple of the 32-wide "
                         f"scale blocks; {_describe(name, weight)}")
    want = _expected_scale_shape(fmt, e, out_f, in_f)
    if tuple(scale.shape) != want:
        raise ValueError(f"{op}: {name} scale must be {list(want)} for {fmt.upper()} weight "
                         f"{tuple(weight.shape)}; {_describe(name + ' scale', scale)}")
    if scale.dtype not in _SCALE_DTYPES:
        raise TypeError(f"{op}: {name} scale must be E8M0 (float8_e8m0fnu or uint8) or f32; "
                        f"{_describe(name + ' scale', scale)}")
    return fmt


def check_moe_args(x, idx, weights, w1, w3, w2, *, op: str = "moe_experts"):
    """Raise ``TypeError``/``ValueError`` naming the argument when shapes or dtypes are wrong.

    Token form: ``x [T, d]``, ``idx``/``weights [T, k]``; row form: ``x [A, d]``,
    ``idx``/``weights [A]``. Returns the weight format (``"fp4"``, ``"fp8"``, ``"plain"``).
    """
    if x.ndim != 2:
        raise ValueError(f"{op}: x must be [rows, d]; {_describe('x', x)}")
    if x.dtype not in _ACT_DTYPES:
        raise TypeError(f"{op}: x must be bf16 or f32; {_describe('x', x)}")
    rows, d = x.shape
    want = "[T, k]" if idx.ndim == 2 else "[A]"
    if idx.ndim not in (1, 2) or idx.shape[0] != rows:
        raise ValueError(f"{op}: expert ids must be [T={rows}, k] (or [A={rows}] per row); "
                         f"{_describe('idx', idx)}, {_describe('x', x)}")
    if idx.dtype != jnp.int32:
        raise TypeError(f"{op}: expert ids must be int32; {_describe('idx', idx)}")
    if tuple(weights.shape) != tuple(idx.shape):
        raise ValueError(f"{op}: routing weights must be {want} like the ids; "
                         f"{_describe('weights', weights)}, {_describe('idx', idx)}")
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise TypeError(f"{op}: routing weights must be floating; "
                        f"{_describe('weights', weights)}")
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        if not isinstance(w, (tuple, list)) or len(w) != 2 or getattr(w[0], "ndim", 0) != 3:
            raise ValueError(f"{op}: {name} must be a (weight [E, out, in], scale) pair; got "
                             + (_describe(name, w[0]) if isinstance(w, (tuple, list)) and w
                                and hasattr(w[0], "shape") else type(w).__name__))
    e, inter = w1[0].shape[0], w1[0].shape[1]
    fmt = _check_projection(op, "w1", w1, e, inter, d)
    fmt3 = _check_projection(op, "w3", w3, e, inter, d)
    w2_in = w2[0].shape[2] * (2 if w2[0].dtype in (jnp.int8, jnp.uint8) else 1)
    if w2[0].shape[0] != e or w2_in != inter:
        raise ValueError(f"{op}: w2 weight must be [E={e}, d={d}, inter={inter}] (w1 is "
                         f"{tuple(w1[0].shape)}); {_describe('w2', w2[0])}")
    fmt2 = _check_projection(op, "w2", w2, e, d, inter)
    if not fmt == fmt3 == fmt2:
        raise TypeError(f"{op}: w1, w3, w2 must share one format, got {fmt}, {fmt3}, {fmt2}")
    if idx.ndim == 2 and idx.shape[1] > e:
        raise ValueError(f"{op}: k={idx.shape[1]} experts per token > E={e} experts; "
                         f"{_describe('idx', idx)}")
    return fmt


def _check_ids_in_range(ids, n_experts: int, op: str):
    """Concrete ids outside ``[0, E)`` are a caller bug: raise. Traced ids are dropped later."""
    if isinstance(ids, jax.core.Tracer):
        return
    values = np.asarray(ids)
    bad = (values < 0) | (values >= n_experts)
    if bad.any():
        raise ValueError(f"{op}: expert id {int(values[bad][0])} outside [0, {n_experts}) "
                         f"({int(bad.sum())} of {values.size} ids); inside jit such ids are "
                         f"dropped")


# ----------------------------------------------------------------------------- reference
def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """``silu(min(gate, l)) * clip(up, -l, l)`` in f32 (``limit`` 0: no clamp)."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    return jax.nn.silu(gate) * up


def _dequant(weight: jax.Array, scale: jax.Array | None, dtype) -> jax.Array:
    """Stacked expert weights in any storage format -> ``dtype`` (plain weights unchanged).

    FP8/FP4 codes times a power-of-two scale are exact in BF16, so dequantising straight to
    BF16 loses nothing and halves the transient memory of the XLA path."""
    if scale is None:
        return weight
    if weight.dtype in (jnp.int8, jnp.uint8):
        w = quant.dequant_fp4_weight(weight, scale)
    else:
        w = quant.dequant_fp8_weight(weight, scale)
    return w.astype(dtype)


def _dot_per_assignment(x, w, simulate, out_dtype):
    xin, win = quant.gemm_operands(x, w, simulate)
    return jnp.einsum("ad,aod->ao", xin, win, preferred_element_type=jnp.float32,
                      precision=HIGHEST).astype(out_dtype)


def _dot_grouped(x, w, group_sizes, simulate, out_dtype):
    xin, win = quant.gemm_operands(x, w, simulate)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])),
        lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(xin, win, group_sizes, dims, precision=HIGHEST,
                                      preferred_element_type=jnp.float32).astype(out_dtype)


def moe_expert_rows_reference(xa, ea, wa, w1, w3, w2, *, swiglu_limit, quantized, simulate):
    """Pure-JAX definition of ``moe_expert_rows`` (runs anywhere); see the module docstring."""
    check_moe_args(xa, ea, wa, w1, w3, w2, op="moe_expert_rows")
    dt = xa.dtype
    sim = bool(quantized and simulate)
    params = {"w1": w1, "w3": w3, "w2": w2}
    n_exp = w1[0].shape[0]
    valid = (ea >= 0) & (ea < n_exp)
    # Dropped rows compute expert 0 with weight 0 and are zeroed at the end.
    ea = jnp.where(valid, ea, 0)
    wa = jnp.where(valid, wa, 0)
    if xa.shape[0] < n_exp:
        def w(name):
            weight, scale = params[name]
            return _dequant(weight[ea], None if scale is None else scale[ea], dt)
        h = swiglu(_dot_per_assignment(xa, w("w1"), sim, dt),
                   _dot_per_assignment(xa, w("w3"), sim, dt), swiglu_limit)
        h = (wa[:, None] * h).astype(dt)
        out = _dot_per_assignment(h, w("w2"), sim, dt)
    else:
        order = jnp.argsort(ea, stable=True)
        group_sizes = jnp.bincount(ea, length=n_exp).astype(jnp.int32)
        xs = xa[order]
        deq = {n: _dequant(*params[n], dt) for n in ("w1", "w2", "w3")}
        h = swiglu(_dot_grouped(xs, deq["w1"], group_sizes, sim, dt),
                   _dot_grouped(xs, deq["w3"], group_sizes, sim, dt), swiglu_limit)
        h = (wa[order][:, None] * h).astype(dt)
        out = _dot_grouped(h, deq["w2"], group_sizes, sim, dt)
        out = jnp.zeros_like(out).at[order].set(out)
    return jnp.where(valid[:, None], out, jnp.zeros((), dt))


def sum_rows_per_token(rows, order, t: int, k: int):
    """``[t, d]`` f32: token ``i``'s sum of its ``k`` assignment rows, where ``rows[j]``
    holds assignment ``order[j]`` (assignment ``a`` = token ``a // k``; ``order`` None: the
    identity). A gather and a reduction over k in a fixed order, not a scatter-add
    (``segment_sum``): those are atomic on the GPU and change the last bit run to run."""
    if order is not None:
        position = jnp.zeros_like(order).at[order].set(
            jnp.arange(order.shape[0], dtype=order.dtype))
        rows = rows[position]
    return rows.astype(jnp.float32).reshape(t, k, rows.shape[-1]).sum(axis=1)


def _token_sum(rows_fn, x, route_idx, route_w):
    """Repeat each token per assignment, run ``rows_fn`` and sum each token's rows in f32."""
    t, k = route_idx.shape
    token = jnp.repeat(jnp.arange(t), k)
    out = rows_fn(x[token], route_idx.reshape(-1), route_w.reshape(-1))
    return sum_rows_per_token(out, None, t, k)


def moe_experts_reference(x, route_idx, route_w, w1, w3, w2, *, swiglu_limit, quantized,
                          simulate):
    """Pure-JAX definition of ``moe_experts`` (runs anywhere); see the module docstring."""
    check_moe_args(x, route_idx, route_w, w1, w3, w2, op="moe_experts")
    rows = functools.partial(moe_expert_rows_reference, w1=w1, w3=w3, w2=w2,
                             swiglu_limit=swiglu_limit, quantized=quantized, simulate=simulate)
    return _token_sum(rows, x, route_idx, route_w)


# ----------------------------------------------------------------------------- Hopper kernel
# The Hopper path of ``kernels/moe_sm90_kernel.py``.
# ``moe_expert_rows_cute`` computes what the reference computes for assignment rows, with
# two launches of the grouped expert GEMM:
#
# 1. schedule (XLA, on device, no host sync): rows sorted by expert (ids outside [0, E) sort
#    last and are dropped), per-expert counts and offsets, and a static worst-case list of
#    row tiles (expert, first sorted row, row count) -- ``num_tile_slots`` entries, unused
#    slots have expert -1;
# 2. x (FP8 1x128 quantisation simulated when asked, as the reference does, on the source
#    rows: the T tokens for ``moe_experts``) gathered in sorted order; launch 1:
#    ``h = bf16(w_r * swiglu(bf16(x w1^T), bf16(x w3^T)))``, both matrices and the SwiGLU in
#    one kernel;
# 3. h quantised the same way when simulating; launch 2: ``y = bf16(h w2^T)``;
# 4. ``moe_experts``: sorted rows summed into their tokens in f32; ``moe_expert_rows``: rows
#    scattered back to assignment order (dropped rows are zero).
# Rows in no tile are never written by the kernel: step 4 masks them with the validity.
#
# Weights stay in their storage format (the kernel reads the FP4/FP8 bytes and E8M0 scales).


def _kernel_weight_format(weight, scale) -> str | None:
    """``"fp4"`` / ``"fp8"`` / ``"bf16"`` for a stacked expert weight, or None (unsupported)."""
    dt = jnp.dtype(weight.dtype)
    if scale is not None and jnp.dtype(scale.dtype) not in (jnp.dtype(jnp.uint8),
                                                           jnp.dtype(quant.E8M0_DTYPE)):
        return None      # the kernel reads E8M0 exponent bytes (f32 scales: the reference)
    if scale is not None and dt in (jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8)):
        return "fp4"
    if scale is not None and dt == jnp.dtype(jnp.float8_e4m3fn):
        return "fp8"
    if scale is None and dt == jnp.dtype(jnp.bfloat16):
        return "bf16"
    return None


def decode_algorithm() -> str:
    """The kernel algorithm for decode-size inputs, from ``DSV4_MOE_ALGORITHM``."""
    value = os.environ.get(ALGORITHM_ENV_VAR, "").strip() or DEFAULT_DECODE_ALGORITHM
    if value not in ALGORITHMS:
        raise ValueError(f"{ALGORITHM_ENV_VAR}={value!r}: must be one of {ALGORITHMS}")
    return value


def prefill_algorithm() -> str:
    """The kernel algorithm for prefill-size inputs, from ``DSV4_MOE_PREFILL_ALGORITHM``."""
    value = os.environ.get(PREFILL_ALGORITHM_ENV_VAR, "").strip() or DEFAULT_PREFILL_ALGORITHM
    if value not in PREFILL_ALGORITHMS:
        raise ValueError(f"{PREFILL_ALGORITHM_ENV_VAR}={value!r}: must be one of "
                         f"{PREFILL_ALGORITHMS}")
    return value


def few_rows_split_k() -> int:
    """The decode kernels' K split for at most two tiles of rows, from ``DSV4_MOE_SPLIT_K``."""
    value = os.environ.get(SPLIT_K_ENV_VAR, "").strip() or "1"
    if not value.isdigit() or not 1 <= int(value) <= 16:
        raise ValueError(f"{SPLIT_K_ENV_VAR}={value!r}: must be an integer in [1, 16]")
    return int(value)


def _choose_config(rows: int, num_experts: int, fmt: str, d: int, inter: int,
                   simulate: bool) -> MoeGemmSm90Config:
    """``choose_config`` with the environment's algorithms, for both launches (K = d, inter)."""
    return choose_config(rows, num_experts, fmt, decode_algorithm(),
                         fp8_activations=simulate, prefill_algorithm=prefill_algorithm(),
                         k_ins=(d, inter),
                         few_rows_split_k=few_rows_split_k())


def kernel_support(xa, w1, w3, w2) -> tuple[bool, str]:
    """Whether the Hopper kernel handles these arguments: ``(ok, reason)``; imports no cutlass."""
    fmts = {_kernel_weight_format(*w) for w in (w1, w3, w2)}
    if None in fmts or len(fmts) != 1:
        return False, "expert weights not all in one of the formats fp4/fp8/bf16"
    fmt = fmts.pop()
    rows, d = xa.shape
    num_experts, inter = w1[0].shape[0], w1[0].shape[1]
    if rows == 0:
        return False, "no rows"
    config = _choose_config(rows, num_experts, fmt, d, inter, simulate=True)
    slots = num_tile_slots(rows, num_experts, config.block_n)
    for gated, n_out, k_in in ((True, inter, d), (False, d, inter)):
        ok, why = config.is_supported(weight_format=fmt, gated=gated, n_out=n_out, k_in=k_in,
                                      x_dtype=jnp.dtype(xa.dtype).name, num_tiles=slots)
        if not ok:
            return False, why
    return True, ""


def moe_schedule(expert_ids: jax.Array, num_experts: int, block_n: int):
    """Sort rows by expert and cut each expert's rows into tiles of at most ``block_n``.

    Returns ``order`` [A] (sorted position -> row), ``valid_sorted`` [A] (the sorted row has
    an expert in [0, E)), and per tile slot ``tile_expert`` (-1 = unused), ``tile_row0``
    (first sorted row) and ``tile_rows`` -- int32 arrays of ``num_tile_slots`` entries.
    """
    rows = expert_ids.shape[0]
    valid = (expert_ids >= 0) & (expert_ids < num_experts)
    key = jnp.where(valid, expert_ids, num_experts).astype(jnp.int32)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    counts = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    offsets = jnp.cumsum(counts) - counts
    tiles = (counts + block_n - 1) // block_n
    tile_end = jnp.cumsum(tiles)
    slot = jnp.arange(num_tile_slots(rows, num_experts, block_n), dtype=jnp.int32)
    # compare_all: one fused comparison; the default scan method is a loop of small
    # launches on GPU (measured ~90 us of glue at T = 1 with it).
    expert = jnp.searchsorted(tile_end, slot, side="right", method="compare_all")
    expert = expert.astype(jnp.int32)
    used = expert < num_experts
    e = jnp.minimum(expert, num_experts - 1)
    local = slot - (tile_end[e] - tiles[e])
    row0 = offsets[e] + local * block_n
    count = jnp.minimum(block_n, counts[e] - local * block_n)
    return (order, key[order] < num_experts, jnp.where(used, e, -1),
            jnp.where(used, row0, 0).astype(jnp.int32),
            jnp.where(used, count, 0).astype(jnp.int32))


def _as_bytes(weight, scale):
    """Weight and scale operands as the kernel reads them (raw bytes; bf16 stays bf16)."""
    if scale is None:
        return weight, jnp.zeros((4,), jnp.uint8)
    w = weight if weight.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(weight,
                                                                              jnp.uint8)
    return w, jax.lax.bitcast_convert_type(scale, jnp.uint8)


def grouped_gemm_sm90(xs, schedule, weight, scale, *, weight_b=None, scale_b=None,
                      route_w=None, swiglu_limit: float = 0.0, x_scale=None,
                      config: MoeGemmSm90Config) -> jax.Array:
    """One launch: sorted rows ``xs`` [A, K] bf16 times their experts' ``weight`` [E, N, .]
    -> [A, N] bf16 (gated: with ``weight_b`` and the SwiGLU x ``route_w`` epilogue). Rows
    outside every tile are left unwritten. Algorithms "mma_fp8", "wgmma_fp8": ``xs`` are e4m3
    codes and ``x_scale`` [A, K / 128] f32 their scales (``quant.act_quant``). A K split
    (``config.split_k`` > 1) adds the kernel's f32 partial sums here, then rounds (and gates,
    with the kernel epilogue's rounding points) in XLA."""
    # Imported when a kernel is emitted, so that the reference path never loads cutlass;
    # cute_call first: it pins CUTE_DSL_ARCH before cutlass is imported.
    from .cute_call import cute_call
    from dsv4_jax.kernels import moe_sm90_launch as kernel

    _, tile_expert, tile_row0, tile_rows = schedule
    fmt = _kernel_weight_format(weight, scale)
    gated = weight_b is not None
    w_a, s_a = _as_bytes(weight, scale)
    w_b, s_b = _as_bytes(weight_b, scale_b) if gated else (w_a, s_a)
    rw = route_w.astype(jnp.float32) if gated else jnp.zeros((1,), jnp.float32)
    fp8_x = config.algorithm in FP8_ACTIVATION_ALGORITHMS
    if fp8_x != (x_scale is not None) or fp8_x != (xs.dtype == jnp.float8_e4m3fn):
        raise ValueError(f"grouped_gemm_sm90: algorithm {config.algorithm!r} with xs "
                         f"{xs.dtype} and x_scale {None if x_scale is None else x_scale.shape}"
                         f" (e4m3 codes + scales for {FP8_ACTIVATION_ALGORITHMS} only)")
    if fp8_x:
        xs = jax.lax.bitcast_convert_type(xs, jnp.uint8)
        x_scale = x_scale.astype(jnp.float32)
    else:
        x_scale = jnp.zeros((1,), jnp.float32)
    n_out, split = weight.shape[1], config.split_k
    out = (jax.ShapeDtypeStruct((xs.shape[0], n_out), jnp.bfloat16) if split == 1 else
           jax.ShapeDtypeStruct((split, xs.shape[0], (2 if gated else 1) * n_out), jnp.float32))
    (y,) = cute_call(kernel.moe_gemm_launcher, (out,), xs, tile_expert, tile_row0,
                     tile_rows, w_a, s_a, w_b, s_b, rw, x_scale, weight_format=fmt, gated=gated,
                     swiglu_limit=float(swiglu_limit) if gated else 0.0,
                     block_n=config.block_n, num_stages=config.num_stages,
                     ablation=config.ablation, algorithm=config.algorithm,
                     scale_group=warp_scale_group(fmt, xs.shape[1] // BLOCK_K), split_k=split)
    if split == 1:
        return y
    y = jnp.sum(y, axis=0)              # a fixed-order reduction: repeatable bit for bit
    if not gated:
        return y.astype(jnp.bfloat16)
    gate, up = y[:, :n_out].astype(jnp.bfloat16), y[:, n_out:].astype(jnp.bfloat16)
    return (rw[:, None] * swiglu(gate, up, swiglu_limit)).astype(jnp.bfloat16)


def _sorted_rows_cute(x, source_row, ea, wa, w1, w3, w2, *, swiglu_limit, simulate, config):
    """Both launches on assignment rows sorted by expert; row ``a`` reads
    ``x[source_row[a]]`` (``source_row`` None: ``x[a]``). Returns ``order`` and the sorted
    rows' outputs ``[A, d]`` bf16 (rows of dropped ids are zero)."""
    num_experts = w1[0].shape[0]
    config = config or _choose_config(ea.shape[0], num_experts, _kernel_weight_format(*w1),
                                      x.shape[1], w1[0].shape[1], simulate)
    order, valid_sorted, *tiles = moe_schedule(ea, num_experts, config.block_n)
    schedule = (order, *tiles)
    rw = jnp.where(valid_sorted, wa[order].astype(jnp.float32), 0.0)
    rows = order if source_row is None else source_row[order]
    # The FP8 simulation quantises each row on its own, so it commutes with the gather:
    # quantise the (fewer) source rows, then gather. "mma_fp8" takes the e4m3 codes and
    # scales themselves, the other kernels their exact bf16 products.
    if config.algorithm in FP8_ACTIVATION_ALGORITHMS:
        codes, scales = quant.act_quant(x)
        h = grouped_gemm_sm90(codes[rows], schedule, *w1, weight_b=w3[0], scale_b=w3[1],
                              route_w=rw, swiglu_limit=swiglu_limit, x_scale=scales[rows],
                              config=config)
        codes, scales = quant.act_quant(h)
        ys = grouped_gemm_sm90(codes, schedule, *w2, x_scale=scales, config=config)
    else:
        xq = quant.act_quant_dequant(x).astype(jnp.bfloat16) if simulate else x
        h = grouped_gemm_sm90(xq[rows], schedule, *w1, weight_b=w3[0], scale_b=w3[1],
                              route_w=rw, swiglu_limit=swiglu_limit, config=config)
        if simulate:
            h = quant.act_quant_dequant(h).astype(jnp.bfloat16)
        ys = grouped_gemm_sm90(h, schedule, *w2, config=config)
    return order, jnp.where(valid_sorted[:, None], ys, jnp.zeros((), ys.dtype))


def moe_expert_rows_cute(xa, ea, wa, w1, w3, w2, *, swiglu_limit: float, simulate: bool,
                         config: MoeGemmSm90Config | None = None):
    """``moe_expert_rows`` on the Hopper kernel (two launches, see the section comment);
    rows whose expert id is outside [0, E) give zeros. ``simulate``: FP8 activation
    quantisation (quantised weights with the simulation on). ``config``: the kernel
    variant, else ``choose_config``'s (decode tiles: ``DSV4_MOE_ALGORITHM``)."""
    order, ys = _sorted_rows_cute(xa, None, ea, wa, w1, w3, w2, swiglu_limit=swiglu_limit,
                                  simulate=simulate, config=config)
    return jnp.zeros_like(ys).at[order].set(ys).astype(xa.dtype)


def moe_experts_cute(x, route_idx, route_w, w1, w3, w2, *, swiglu_limit: float,
                     simulate: bool, config: MoeGemmSm90Config | None = None):
    """``moe_experts`` on the Hopper kernel: as ``moe_expert_rows_cute`` on the T k
    assignments, but the FP8 simulation runs on the T token rows, the sorted rows gather
    their token directly and each token gathers and sums its rows (f32, deterministic)."""
    t, k = route_idx.shape
    token = jnp.arange(t * k, dtype=jnp.int32) // k
    order, ys = _sorted_rows_cute(x, token, route_idx.reshape(-1), route_w.reshape(-1),
                                  w1, w3, w2, swiglu_limit=swiglu_limit, simulate=simulate,
                                  config=config)
    return sum_rows_per_token(ys, order, t, k)


# ----------------------------------------------------------------------------- dispatch
def _dispatch(reference_fn, cute_fn, rows, args, weights, implementation, *, swiglu_limit,
              quantized, simulate):
    """Run ``reference_fn`` or ``cute_fn`` on ``(*args, *weights)`` as ``implementation``
    and the kernel's support for ``rows`` (the assignment rows, maybe abstract) decide."""
    choice = select_implementation("moe", implementation, kernel_support(rows, *weights))
    reference = functools.partial(reference_fn, swiglu_limit=swiglu_limit,
                                  quantized=quantized, simulate=simulate)
    if choice == "xla":
        return reference(*args, *weights)
    cute = functools.partial(cute_fn, swiglu_limit=float(swiglu_limit),
                             simulate=bool(quantized and simulate))
    if choice == "cute":
        return cute(*args, *weights)
    return cute_or_reference(cute, reference, *args, *weights)


def moe_expert_rows(xa, ea, wa, w1, w3, w2, *, swiglu_limit, quantized, simulate,
                    implementation=None):
    """``w2(wa * swiglu(w1 xa, w3 xa))`` per assignment row; see the module docstring.

    ``implementation``: ``"cute"`` (the Hopper kernel; raises when it cannot run these
    arguments or there is no GPU), ``"xla"`` (the reference) or ``None`` (the kernel when
    lowering for CUDA and it supports the arguments, else the reference).
    ``DSV4_IMPLEMENTATION=xla`` (or ``moe=xla``) forces the reference.
    """
    check_moe_args(xa, ea, wa, w1, w3, w2, op="moe_expert_rows")
    _check_ids_in_range(ea, w1[0].shape[0], "moe_expert_rows")
    # The kernel must drop ids outside [0, E) itself: expert parallelism sends id -1 for its
    # empty capacity slots, and clamping them would make it compute expert 0 for every one.
    return _dispatch(moe_expert_rows_reference, moe_expert_rows_cute, xa, (xa, ea, wa),
                     (w1, w3, w2), implementation, swiglu_limit=swiglu_limit,
                     quantized=quantized, simulate=simulate)


def moe_experts(x, route_idx, route_w, w1, w3, w2, *, swiglu_limit, quantized, simulate,
                implementation=None):
    """Routed-expert output of one MoE layer, f32 ``[T, d]``; see the module docstring.

    ``implementation`` as for ``moe_expert_rows``.
    """
    check_moe_args(x, route_idx, route_w, w1, w3, w2, op="moe_experts")
    _check_ids_in_range(route_idx, w1[0].shape[0], "moe_experts")
    rows = jax.ShapeDtypeStruct((route_idx.size, x.shape[1]), x.dtype)
    return _dispatch(moe_experts_reference, moe_experts_cute, rows, (x, route_idx, route_w),
                     (w1, w3, w2), implementation, swiglu_limit=swiglu_limit,
                     quantized=quantized, simulate=simulate)
