"""The routed experts on Hopper: the JAX side of ``kernels/moe_sm90_kernel.py``.

``expert_rows_sm90`` computes what ``ffi.moe``'s reference computes for assignment rows,
with two launches of the grouped expert GEMM:

1. schedule (XLA, on device, no host sync): rows sorted by expert (ids outside [0, E) sort
   last and are dropped), per-expert counts and offsets, and a static worst-case list of
   row tiles (expert, first sorted row, row count) -- ``num_tile_slots`` entries, unused
   slots have expert -1;
2. x (FP8 1x128 quantisation simulated when asked, as the reference does) gathered in sorted
   order; launch 1: ``h = bf16(w_r * swiglu(bf16(x w1^T), bf16(x w3^T)))``, both matrices
   and the SwiGLU in one kernel;
3. h quantised the same way when simulating; launch 2: ``y = bf16(h w2^T)``;
4. rows scattered back to assignment order (dropped rows are zero).

Weights stay in their storage format (the kernel reads the FP4/FP8 bytes and E8M0 scales).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4_jax import quant
from dsv4_jax.kernels.moe_sm90 import (MoeGemmSm90Config, choose_config,
                                               num_tile_slots)

__all__ = ["expert_rows_sm90", "sm90_support", "moe_schedule", "weight_format",
           "grouped_gemm_sm90"]


def weight_format(weight, scale) -> str | None:
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


def sm90_support(xa, w1, w3, w2) -> tuple[bool, str]:
    """Whether the kernels take these operands: ``(ok, reason)``; imports no cutlass."""
    fmts = {weight_format(*w) for w in (w1, w3, w2)}
    if None in fmts or len(fmts) != 1:
        return False, "expert weights not all in one of the formats fp4/fp8/bf16"
    fmt = fmts.pop()
    rows, d = xa.shape
    num_experts, inter = w1[0].shape[0], w1[0].shape[1]
    if rows == 0:
        return False, "no rows"
    config = choose_config(rows, num_experts, fmt)
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
                      route_w=None, swiglu_limit: float = 0.0,
                      config: MoeGemmSm90Config) -> jax.Array:
    """One launch: sorted rows ``xs`` [A, K] bf16 times their experts' ``weight`` [E, N, .]
    -> [A, N] bf16 (gated: with ``weight_b`` and the SwiGLU x ``route_w`` epilogue). Rows
    outside every tile are left unwritten."""
    from .cute_call import cute_call   # first: pins CUTE_DSL_ARCH before cutlass loads
    from dsv4_jax.kernels import moe_sm90_kernel as kernel

    _, tile_expert, tile_row0, tile_rows = schedule
    fmt = weight_format(weight, scale)
    gated = weight_b is not None
    w_a, s_a = _as_bytes(weight, scale)
    w_b, s_b = _as_bytes(weight_b, scale_b) if gated else (w_a, s_a)
    rw = route_w.astype(jnp.float32) if gated else jnp.zeros((1,), jnp.float32)
    out = jax.ShapeDtypeStruct((xs.shape[0], weight.shape[1]), jnp.bfloat16)
    (y,) = cute_call(kernel.moe_gemm_launcher, (out,), xs, tile_expert, tile_row0,
                     tile_rows, w_a, s_a, w_b, s_b, rw, weight_format=fmt, gated=gated,
                     swiglu_limit=float(swiglu_limit) if gated else 0.0,
                     block_n=config.block_n, num_stages=config.num_stages,
                     ablation=config.ablation)
    return y


def expert_rows_sm90(xa, ea, wa, w1, w3, w2, *, swiglu_limit: float, simulate: bool):
    """``w2(wa * swiglu(w1 xa, w3 xa))`` per assignment row on the Hopper kernels; rows whose
    expert id is outside [0, E) give zeros. Same contract as ``ffi.moe``'s reference."""
    rows = xa.shape[0]
    num_experts = w1[0].shape[0]
    config = choose_config(rows, num_experts, weight_format(*w1))
    order, valid_sorted, *tiles = moe_schedule(ea, num_experts, config.block_n)
    schedule = (order, *tiles)
    x = quant.act_quant_dequant(xa).astype(jnp.bfloat16) if simulate else xa
    rw = jnp.where(valid_sorted, wa[order].astype(jnp.float32), 0.0)
    h = grouped_gemm_sm90(x[order], schedule, *w1, weight_b=w3[0],
                          scale_b=w3[1], route_w=rw, swiglu_limit=swiglu_limit,
                          config=config)
    if simulate:
        h = quant.act_quant_dequant(h).astype(jnp.bfloat16)
    ys = grouped_gemm_sm90(h, schedule, *w2, config=config)
    ys = jnp.where(valid_sorted[:, None], ys, jnp.zeros((), ys.dtype))
    return jnp.zeros_like(ys).at[order].set(ys).astype(xa.dtype)
