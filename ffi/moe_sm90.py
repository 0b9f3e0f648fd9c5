"""The routed experts on Hopper: two launches of the grouped GEMM (``grouped_gemm_sm90``) on
the assignment rows sorted once by expert.

``moe_expert_rows_cute`` computes what the reference computes for assignment rows:

1. the schedule (``moe_schedule_sm90.sorted_schedule``: one launch at decode sizes, else
   XLA's sort): rows sorted by expert, dropped ids last, and each row's sorted position --
   or, for a few rows over many experts (decode), every row a tile of its own in assignment
   order (``row_schedule``: no sort, no gathers by order);
2. the FP8 1 x 128 simulation (when asked) on the source rows -- the T tokens for
   ``moe_experts``: quantisation is per row, so it commutes with the gather -- and the sorted
   rows gathered from them; launch 1: ``h = bf16(w_r * swiglu(bf16(x w1^T), bf16(x w3^T)))``,
   both matrices and the SwiGLU in one kernel;
3. h quantised the same way when simulating; launch 2: ``y = bf16(h w2^T)``;
4. ``moe_experts``: sorted rows summed into their tokens in f32; ``moe_expert_rows``: rows
   scattered back to assignment order (dropped rows are zero).

Rows in no tile are never written by the kernel: step 4 masks them with the validity. Each
launch has its kernel config (``moe_configs``), which its support check shares; the two
share their tiles, and differ only where the policy's decode algorithm is ``"auto"``.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import jax.numpy as jnp

from dsv4_jax.kernels.grouped_gemm_config import GroupedGemmSm90Config
from dsv4_jax.quant import matrix_dims
from . import grouped_gemm_sm90 as gemm
from . import moe_schedule_sm90 as moe_schedule
from .moe_reference import sum_rows_per_token
from .policy import GroupedGemmPolicy

__all__ = ["moe_configs", "moe_support", "with_token_codes", "moe_expert_rows_cute",
           "moe_experts_cute"]

MoeConfigs = tuple[GroupedGemmSm90Config, GroupedGemmSm90Config]


def moe_configs(rows: int, w1, w2, *, simulate: bool,
                policy: GroupedGemmPolicy | None) -> MoeConfigs | None:
    """The kernel configs of the gated launch and of the w2 launch for ``rows`` assignment
    rows (None: the weights are in no kernel format). Resolved for the same call, they share
    tiles, so both launches run on one schedule; under "auto" their kernels, K splits and
    stages may differ (``choose_config``)."""
    fmt = gemm.kernel_weight_format(*w1)
    if fmt is None:
        return None
    d, inter = matrix_dims(w2[0])[1], matrix_dims(w1[0])[1]
    return tuple(gemm.resolve_config(policy, rows, w1[0].shape[0], fmt, (d, inter), simulate,
                                     (inter, d), gated=g) for g in (True, False))


def moe_support(rows: int, x_dtype: str, w1, w3, w2, *, simulate: bool,
                policy: GroupedGemmPolicy | None) -> tuple[bool, str]:
    """Whether the two launches run these arguments: ``(ok, reason)``; imports no cutlass."""
    fmts = {gemm.kernel_weight_format(*w) for w in (w1, w3, w2)}
    if None in fmts or len(fmts) != 1:
        return False, "expert weights not all in one of the formats fp4/fp8/bf16"
    if gemm.kernel_weight_layout(w1[0], w3[0], w2[0]) is None:
        return False, "expert weights in different layouts (rows and blocked FP4)"
    if rows == 0:
        return False, "no rows"
    gated, down = moe_configs(rows, w1, w2, simulate=simulate, policy=policy)
    d, inter = matrix_dims(w2[0])[1], matrix_dims(w1[0])[1]
    fmt = fmts.pop()
    for config, launch in ((gated, (True, inter, d)), (down, (False, d, inter))):
        ok, why = gemm.launch_support(config, fmt, x_dtype, rows, w1[0].shape[0], [launch])
        if not ok:
            return False, why
    return True, ""


def _sorted_rows(x, source_row, ea, wa, w1, w3, w2, *, swiglu_limit, simulate, policy,
                 config, source_stride: int = 0):
    """Both launches on assignment rows sorted by expert; row ``a`` reads ``x[source_row[a]]``
    (``source_row`` None: ``x[a]``). ``source_stride`` k > 0: ``source_row[a]`` is ``a //
    k``, which the kernels that quantise their tokens ("mma_fp8", "wgmma_rs") read
    themselves on row tiles (no gather). Returns ``position`` (row -> its sorted position;
    None: the rows kept their order, one tile each -- ``grouped_gemm_sm90.use_row_tiles``),
    the rows' outputs ``[A, d]`` bf16 in sorted order and their validity ``[A]`` (a row of a
    dropped id is never written: mask it)."""
    groups = w1[0].shape[0]
    explicit = config is not None
    config, down_config = ((config, config) if config is not None else
                           moe_configs(ea.shape[0], w1, w2, simulate=simulate, policy=policy))
    if gemm.use_row_tiles(ea.shape[0], groups, config):
        order = position = None
        valid_sorted, *tiles = gemm.row_schedule(ea, groups)
        rw = wa.astype(jnp.float32)        # a dropped row's weight is never read
        rows = source_row
    else:
        order, position, valid_sorted, *tiles = moe_schedule.sorted_schedule(
            ea, groups, config.block_n)
        rw = jnp.where(valid_sorted, wa[order].astype(jnp.float32), 0.0)
        rows = order if source_row is None else source_row[order]
    stride = 1
    if order is None and source_stride > 0 and config.spec.quantizes_tokens:
        rows, stride = None, source_stride
    config, down_config = with_token_codes(config, down_config, policy, gathered=rows is not None,
                                       explicit=explicit)
    xs, x_scale = gemm.quantized_rows(x, rows, config, simulate)
    h = gemm.launch(xs, tiles, *w1, weight_b=w3[0], scale_b=w3[1], route_w=rw,
                    swiglu_limit=swiglu_limit, x_scale=x_scale, config=config,
                    token_stride=stride)
    hs, h_scale = gemm.quantized_rows(h, None, down_config, simulate)
    ys = gemm.launch(hs, tiles, *w2, x_scale=h_scale, config=down_config)
    return position, ys, valid_sorted


def with_token_codes(config, down_config, policy: GroupedGemmPolicy | None, *, gathered: bool,
                 explicit: bool) -> MoeConfigs:
    """The launches' configs under ``policy.token_codes``: the gated launch takes its rows
    quantised by XLA where they are ``gathered`` (the quantisation joins the gather), both
    do under "routed"; only for kernels that would quantise them themselves (the same
    codes), never for a ``config`` the caller chose (``explicit``)."""
    mode = (policy or GroupedGemmPolicy()).token_codes
    if explicit or mode == "none":
        return config, down_config
    if config.spec.quantizes_tokens and (gathered or mode == "routed"):
        config = dataclasses.replace(config, token_codes=True)
    if mode == "routed" and down_config.spec.quantizes_tokens:
        down_config = dataclasses.replace(down_config, token_codes=True)
    return config, down_config


def _masked(ys, valid):
    return jnp.where(valid[:, None], ys, jnp.zeros((), ys.dtype))


def moe_expert_rows_cute(xa, ea, wa, w1, w3, w2, *, swiglu_limit: float, simulate: bool,
                         policy: GroupedGemmPolicy | None = None,
                         config: GroupedGemmSm90Config | None = None):
    """``moe_expert_rows`` on the Hopper kernel (see the module docstring); rows whose expert
    id is outside [0, E) give zeros. ``simulate``: FP8 activation quantisation (quantised
    weights with the simulation on). ``config``: a kernel variant for tests and benchmarks,
    for both launches, else ``moe_configs`` under ``policy``."""
    position, ys, valid = _sorted_rows(xa, None, ea, wa, w1, w3, w2,
                                       swiglu_limit=swiglu_limit, simulate=simulate,
                                       policy=policy, config=config)
    ys = _masked(ys, valid)
    if position is not None:
        ys = ys[position]
    return ys.astype(xa.dtype)


def moe_experts_cute(x, route_idx, route_w, w1, w3, w2, *, swiglu_limit: float,
                     simulate: bool, policy: GroupedGemmPolicy | None = None,
                     config: GroupedGemmSm90Config | None = None, summed: bool = True):
    """``moe_experts`` on the Hopper kernel: as ``moe_expert_rows_cute`` on the T k
    assignments, but the FP8 simulation runs on the T token rows, the sorted rows gather
    their token directly and each token gathers and sums its rows (f32, deterministic).
    ``summed=False``: ``(rows, position, valid)`` instead -- the sorted rows unmasked, each
    assignment's row and each row's validity (``ffi.ffn_sum``: its consumer adds them)."""
    t, k = route_idx.shape
    token = jnp.asarray(np.arange(t * k, dtype=np.int32) // k)      # a constant, no launch
    position, ys, valid = _sorted_rows(x, token, route_idx.reshape(-1), route_w.reshape(-1),
                                       w1, w3, w2, swiglu_limit=swiglu_limit,
                                       simulate=simulate, policy=policy, config=config,
                                       source_stride=k)
    if not summed:
        if position is None:
            position = jnp.asarray(np.arange(t * k, dtype=np.int32))
        return ys, position.astype(jnp.int32), valid.astype(jnp.bool_)
    return sum_rows_per_token(_masked(ys, valid), None, t, k, position=position)
