"""The grouped GEMM on Hopper: schedule, FP8 activation quantisation and the kernel launch
(``kernels/grouped_gemm_sm90_launch.py``), as XLA custom calls.

One call of ``grouped_gemm_cute``:

1. schedule (XLA, on device, no host sync): rows sorted by group (ids outside ``[0, G)``
   sort last and are dropped), per-group counts and offsets, and a static worst case of row
   tiles (group, first sorted row, row count) -- ``num_tile_slots`` entries, unused slots
   have group -1. Rows already in equal blocks per group (``group_ids`` None: a dense linear,
   or the grouped ``wo_a``) need none of it: their tiles are known when tracing;
2. the FP8 1 x 128 activation quantisation (when simulating) on the rows before the gather
   (it is per row, so it commutes with it): the FP8 kernels take e4m3 codes and scales, the
   others their exact bf16 products;
3. one launch (gated: both matrices, SwiGLU x row weight in the epilogue);
4. rows back in their order; dropped rows are 0.

``grouped_gemm_pair_cute``: two ungated weights of the same rows (a layer's linears that
share their input) in one launch of a warp kernel, whose output blocks past the first
weight's read the second weight (``paired``); prefill tiles run a launch per weight.

``row_norm`` (both): the rows are an RMSNorm's inputs. Under
``GroupedGemmPolicy(row_norm_in_kernel=True)`` a launch of a kernel that quantises its tokens
normalises them itself (``with_row_norm``: the norm weight takes the token scales' place);
else XLA's ``rms_norm`` runs before the launch.

``resolve_config`` turns a ``GroupedGemmPolicy`` into the ``GroupedGemmSm90Config`` of a
launch, which its support check shares.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import jax
import jax.numpy as jnp

from dsv4_jax import quant
from dsv4_jax.quant import matrix_dims
from dsv4_jax.kernels.grouped_gemm_config import (FP8_CODE_ALGORITHMS, WEIGHT_FORMATS,
                                                  GroupedGemmSm90Config, choose_config,
                                                  num_tile_slots)
from dsv4_jax.kernels.grouped_gemm_layout import BLOCK_K, BLOCK_M, warp_scale_group
from .grouped_gemm_reference import normed_rows
from .policy import GroupedGemmPolicy

__all__ = ["resolve_config", "kernel_weight_format", "kernel_weight_layout", "support",
           "launch_support", "schedule",
           "row_schedule", "use_row_tiles", "block_schedule", "launch", "grouped_gemm_cute",
           "pair_config", "pair_support", "grouped_gemm_pair_cute", "with_constant_tiles",
           "with_row_norm"]

_KERNEL_SCALE_DTYPES = (jnp.dtype(jnp.uint8), jnp.dtype(quant.E8M0_DTYPE))


def kernel_weight_format(weight, scale) -> str | None:
    """The ``quant.WeightFormat`` name the kernels read (``"fp4"``, ``"fp8"``, ``"bf16"``),
    or None when they cannot read this weight (f32/f16 weights, f32 scales)."""
    try:
        fmt = quant.weight_format(weight, scale)
    except (TypeError, ValueError):
        return None
    if fmt.name not in WEIGHT_FORMATS:
        return None
    if scale is not None and jnp.dtype(scale.dtype) not in _KERNEL_SCALE_DTYPES:
        return None      # the kernels read E8M0 exponent bytes (f32 scales: the reference)
    return fmt.name


def kernel_weight_layout(*weights) -> str | None:
    """The one ``GroupedGemmSm90Config.weight_layout`` of ``weights`` ("blocked": packed FP4
    in 64-row x K-block tiles, ``quant.block_fp4_weight``; else "rows"), or None when they
    differ (a launch reads all its weights in one layout)."""
    layouts = {"blocked" if quant.is_blocked_fp4(w) else "rows" for w in weights}
    return layouts.pop() if len(layouts) == 1 else None


def resolve_config(policy: GroupedGemmPolicy | None, rows: int, groups: int, fmt: str,
                   k_ins: tuple[int, ...], simulate: bool,
                   n_outs: tuple[int, ...] = (), gated: bool = False) -> GroupedGemmSm90Config:
    """The kernel config of a launch (``gated``: two matrices and the SwiGLU):
    ``choose_config`` under ``policy`` for ``rows`` rows in ``groups`` groups, in a call whose
    launches have input features ``k_ins`` and outputs ``n_outs``."""
    policy = policy or GroupedGemmPolicy()
    return choose_config(rows, groups, fmt, decode_algorithm=policy.decode_algorithm,
                         prefill_algorithm=policy.prefill_algorithm, fp8_activations=simulate,
                         k_ins=k_ins, n_outs=n_outs, split_k=policy.split_k,
                         pdl=policy.pdl, gated=gated, row_blocks=policy.row_blocks,
                         token_stages=policy.token_stages,
                         interleaved_split=policy.interleaved_split)


def launch_support(config: GroupedGemmSm90Config, fmt: str, x_dtype: str, rows: int,
                   groups: int, launches) -> tuple[bool, str]:
    """``config.is_supported`` for every ``(gated, n_out, k_in)`` launch of a call."""
    slots = num_tile_slots(rows, groups, config.block_n)
    for gated, n_out, k_in in launches:
        ok, why = config.is_supported(weight_format=fmt, gated=gated, n_out=n_out, k_in=k_in,
                                      x_dtype=x_dtype, num_tiles=slots)
        if not ok:
            return False, why
    return True, ""


def support(rows: int, k: int, x_dtype: str, w, w_up=None, *, ragged: bool, simulate: bool,
            policy: GroupedGemmPolicy | None) -> tuple[bool, str]:
    """Whether ``grouped_gemm_cute`` runs these arguments: ``(ok, reason)``; no cutlass."""
    mats = [w] if w_up is None else [w, w_up]
    fmts = {kernel_weight_format(*m) for m in mats}
    if None in fmts or len(fmts) != 1:
        return False, "weights not all in one of the kernel formats fp4/fp8/bf16 (E8M0 scales)"
    if kernel_weight_layout(*(m[0] for m in mats)) is None:
        return False, "weights in different layouts (rows and blocked FP4)"
    fmt = fmts.pop()
    if rows == 0:
        return False, "no rows"
    groups, n = w[0].shape[0], matrix_dims(w[0])[1]
    config = resolve_config(policy, rows, groups, fmt, (k,), simulate, (n,),
                            gated=w_up is not None)
    if not ragged and rows % groups:
        return False, f"{rows} rows in {groups} equal blocks"
    return launch_support(config, fmt, x_dtype, rows, groups, [(w_up is not None, n, k)])


def schedule(group_ids: jax.Array, groups: int, block_n: int):
    """Sort rows by group and cut each group's rows into tiles of at most ``block_n``.

    Returns ``order`` [M] (sorted position -> row), ``valid_sorted`` [M] (the sorted row has a
    group in [0, G)), and per tile slot ``tile_group`` (-1 = unused), ``tile_row0`` (first
    sorted row) and ``tile_rows`` -- int32 arrays of ``num_tile_slots`` entries.
    """
    rows = group_ids.shape[0]
    valid = (group_ids >= 0) & (group_ids < groups)
    key = jnp.where(valid, group_ids, groups).astype(jnp.int32)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    counts = jnp.bincount(key, length=groups + 1)[:groups].astype(jnp.int32)
    offsets = jnp.cumsum(counts) - counts
    tiles = (counts + block_n - 1) // block_n
    tile_end = jnp.cumsum(tiles)
    slot = jnp.arange(num_tile_slots(rows, groups, block_n), dtype=jnp.int32)
    # compare_all: one fused comparison; the default scan method is a loop of small
    # launches on GPU (docs/performance.md: the glue of the op at T = 1).
    group = jnp.searchsorted(tile_end, slot, side="right", method="compare_all")
    group = group.astype(jnp.int32)
    used = group < groups
    g = jnp.minimum(group, groups - 1)
    local = slot - (tile_end[g] - tiles[g])
    row0 = offsets[g] + local * block_n
    count = jnp.minimum(block_n, counts[g] - local * block_n)
    return (order, key[order] < groups, jnp.where(used, g, -1),
            jnp.where(used, row0, 0).astype(jnp.int32),
            jnp.where(used, count, 0).astype(jnp.int32))


# A few rows over many groups (decode of the routed experts: T k rows over E experts) need no
# sort: each row is a tile of its own. Rows that share a group then read its weights once each:
# allowed while the expected number of such repeated reads, rows (rows - 1) / (2 groups) for
# independent rows, is at most ROW_TILE_REPEATS (docs/performance.md: at more, the extra
# weight bytes cost more than the sort's launches save).
ROW_TILE_REPEATS = 1.0


def use_row_tiles(rows: int, groups: int, config: GroupedGemmSm90Config) -> bool:
    return (config.spec.tiles == "decode"
            and rows * (rows - 1) <= 2 * groups * ROW_TILE_REPEATS)


def row_schedule(group_ids: jax.Array, groups: int):
    """Every row its own tile, rows in their order: ``(valid [M], tile_group, tile_row0,
    tile_rows)``, one tile slot per row. The ids are the tiles' groups as they are: the warp
    kernels drop a tile whose group is outside ``[0, G)`` (no select before the launch);
    the rest are constants."""
    rows = group_ids.shape[0]
    valid = (group_ids >= 0) & (group_ids < groups)
    return (valid, group_ids.astype(jnp.int32), jnp.asarray(np.arange(rows, dtype=np.int32)),
            jnp.asarray(np.ones(rows, np.int32)))


def block_schedule(rows: int, groups: int, block_n: int):
    """The tiles of rows in ``groups`` equal consecutive blocks (one group: a dense linear),
    as constants: ``(tile_group, tile_row0, tile_rows)`` int32, ``ceil(rows / groups /
    block_n)`` tiles per group."""
    per = rows // groups
    local = np.arange(0, per, block_n, dtype=np.int32)
    group = np.repeat(np.arange(groups, dtype=np.int32), local.size)
    row0 = (group * per + np.tile(local, groups)).astype(np.int32)
    count = np.minimum(block_n, per - np.tile(local, groups)).astype(np.int32)
    return jnp.asarray(group), jnp.asarray(row0), jnp.asarray(count)


def _as_bytes(weight, scale):
    """Weight and scale operands as the kernel reads them (raw bytes; bf16 stays bf16; a
    blocked FP4 weight's bytes as [G, N, K/2], in their order: ``weight_offset``)."""
    weight = weight.reshape(matrix_dims(weight))
    if scale is None:
        return weight, jnp.zeros((4,), jnp.uint8)
    w = weight if weight.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(weight,
                                                                              jnp.uint8)
    return w, jax.lax.bitcast_convert_type(scale, jnp.uint8)


def launch(xs, tiles, weight, scale, *, weight_b=None, scale_b=None, route_w=None,
           swiglu_limit: float = 0.0, x_scale=None, norm_weight=None,
           config: GroupedGemmSm90Config, paired: bool = False,
           token_stride: int = 1) -> jax.Array:
    """One launch: sorted rows ``xs`` [M, K] bf16 times their groups' ``weight`` [G, N, .]
    -> [M, N] bf16 (gated: with ``weight_b`` and the SwiGLU x ``route_w`` epilogue;
    ``paired``: ``weight_b`` [G, N_b, .] is a second, ungated weight of the same format
    whose outputs follow: [M, N + N_b]; ``token_stride``, "mma_fp8" only: row m reads
    ``xs[m // token_stride]``, ``xs`` then has M / token_stride rows).
    ``tiles``: ``(tile_group, tile_row0, tile_rows)``; rows outside every tile are left
    unwritten. Algorithms that take codes (``takes_fp8_codes``): ``xs`` are e4m3 codes and
    ``x_scale`` [M, K / 128] f32 their scales (``quant.act_quant``); "mma_fp8" takes the bf16
    rows and quantises them itself; with ``config.row_norm_eps`` it normalises them first
    by ``norm_weight`` [K] (bf16). A K split (``config.split_k`` > 1) is added up inside
    the launch (a cluster per tile)."""
    # Imported when a kernel is emitted, so that the reference path never loads cutlass;
    # cute_call first: it pins CUTE_DSL_ARCH before cutlass is imported.
    from .cute_call import cute_call
    from dsv4_jax.kernels import grouped_gemm_sm90_launch as kernel

    tile_group, tile_row0, tile_rows = tiles
    fmt = kernel_weight_format(weight, scale)
    layout = kernel_weight_layout(weight, weight if weight_b is None else weight_b)
    if layout is None:
        raise ValueError(f"grouped_gemm launch: weight {weight.shape} and weight_b "
                         f"{weight_b.shape} in different layouts (rows and blocked FP4)")
    gated = weight_b is not None and not paired
    w_a, s_a = _as_bytes(weight, scale)
    w_b, s_b = _as_bytes(weight_b, scale_b) if weight_b is not None else (w_a, s_a)
    rw = route_w.astype(jnp.float32) if gated else jnp.zeros((1,), jnp.float32)
    fp8_x = config.takes_codes
    if fp8_x != (x_scale is not None) or fp8_x != (xs.dtype == jnp.float8_e4m3fn):
        raise ValueError(f"grouped_gemm launch: algorithm {config.algorithm!r} (token_codes "
                         f"{config.token_codes}) with xs {xs.dtype} and x_scale "
                         f"{None if x_scale is None else x_scale.shape} (e4m3 codes + scales "
                         f"for {FP8_CODE_ALGORITHMS} and token_codes only)")
    normed = config.row_norm_eps is not None
    if normed != (norm_weight is not None):
        raise ValueError(f"grouped_gemm launch: row_norm_eps {config.row_norm_eps} with "
                         f"norm_weight {None if norm_weight is None else norm_weight.shape} "
                         f"(both or neither)")
    if fp8_x:
        xs = jax.lax.bitcast_convert_type(xs, jnp.uint8)
        x_scale = x_scale.astype(jnp.float32)
    elif normed:
        x_scale = norm_weight.astype(jnp.bfloat16)
    else:
        x_scale = jnp.zeros((1,), jnp.float32)
    n_out = matrix_dims(weight)[1] + (matrix_dims(weight_b)[1] if paired else 0)
    out = jax.ShapeDtypeStruct((xs.shape[0] * token_stride, n_out), jnp.bfloat16)
    (y,) = cute_call(kernel.grouped_gemm_launcher, (out,), xs, x_scale, tile_group, tile_row0,
                     tile_rows, w_a, s_a, w_b, s_b, rw, weight_format=fmt, gated=gated,
                     swiglu_limit=float(swiglu_limit) if gated else 0.0,
                     block_n=config.block_n, num_stages=config.num_stages,
                     algorithm=config.algorithm, split_k=config.split_k,
                     ablation=config.ablation,
                     scale_group=warp_scale_group(fmt, xs.shape[1] // BLOCK_K),
                     token_stages=config.token_stages, paired=paired,
                     token_stride=token_stride, **({"pdl": config.pdl} if config.pdl else {}),
                     **({"token_codes": True} if config.token_codes else {}),
                     **({"row_norm_eps": config.row_norm_eps} if normed else {}),
                     **({"row_blocks": config.row_blocks} if config.row_blocks > 1 else {}),
                     **({"interleaved_split": True} if config.interleaved_split else {}),
                     **({"weight_layout": layout} if layout != "rows" else {}))
    return y


def quantized_rows(x, rows, config: GroupedGemmSm90Config, simulate: bool):
    """The kernel's operands for the rows ``x[rows]`` (``rows`` None: all, in order): e4m3
    codes and their scales for the launches that take them (``FP8_CODE_ALGORITHMS``, and
    ``token_codes``), the rows as they are for "mma_fp8" (it quantises them itself) and
    without the simulation, else the FP8 simulation's exact products in bf16. The
    quantisation is per row, so it runs on ``x`` before the gather."""
    take = (lambda a: a) if rows is None else (lambda a: a[rows])
    if config.takes_codes:
        codes, scales = quant.act_quant(x)
        return take(codes), take(scales)
    quantized_in_kernel = config.spec.quantizes_tokens
    xq = (quant.act_quant_dequant(x).astype(jnp.bfloat16)
          if simulate and not quantized_in_kernel else x)
    return take(xq), None


def _tiles(rows: int, group_ids, groups: int, config: GroupedGemmSm90Config):
    """``(order, valid_sorted, tiles)`` of a call: None, None and constant tiles for rows in
    equal blocks (``group_ids`` None), else ``schedule``'s."""
    if group_ids is None:
        return None, None, block_schedule(rows, groups, config.block_n)
    order, valid_sorted, *tiles = schedule(group_ids, groups, config.block_n)
    return order, valid_sorted, tiles


def with_constant_tiles(config: GroupedGemmSm90Config) -> GroupedGemmSm90Config:
    """``config`` for a launch whose tile arrays are constants (rows in equal blocks): a
    programmatic dependent launch of a kernel that quantises its tokens ("mma_fp8",
    "wgmma_rs") may then read them and issue its first weight
    copies before it waits for the kernel before it ("weights"); routed tiles come from
    that kernel, so their launches keep "start"."""
    if config.pdl == "start" and config.spec.quantizes_tokens:
        return dataclasses.replace(config, pdl="weights")
    return config


def with_row_norm(config: GroupedGemmSm90Config, x, row_norm,
                  policy: GroupedGemmPolicy | None):
    """``(config, x, norm_weight)`` of a launch whose rows are ``row_norm``'s inputs (None: as
    they come): with ``policy.row_norm_in_kernel``, a bf16 launch of a kernel that quantises
    its tokens takes the norm (``row_norm_eps``, ``norm_weight``); otherwise XLA normalises
    ``x`` here."""
    if row_norm is None:
        return config, x, None
    weight, eps = row_norm
    if ((policy or GroupedGemmPolicy()).row_norm_in_kernel and config.spec.quantizes_tokens
            and not config.token_codes and x.dtype == jnp.bfloat16):
        return dataclasses.replace(config, row_norm_eps=float(eps)), x, weight
    return config, normed_rows(x, row_norm), None


def _in_row_order(ys, order, valid_sorted, dtype):
    """Sorted rows' outputs back in row order, dropped rows 0, in ``dtype``."""
    if order is None:
        return ys.astype(dtype)
    ys = jnp.where(valid_sorted[:, None], ys, jnp.zeros((), ys.dtype))
    return jnp.zeros_like(ys).at[order].set(ys).astype(dtype)


def grouped_gemm_cute(x, group_ids, w, *, w_up=None, row_weights=None,
                      swiglu_limit: float = 0.0, simulate: bool = False, row_norm=None,
                      policy: GroupedGemmPolicy | None = None,
                      config: GroupedGemmSm90Config | None = None):
    """``grouped_gemm`` on the Hopper kernel (see the module docstring). ``config``: a kernel
    variant for tests and benchmarks (its ablations), else ``resolve_config(policy)``'s."""
    rows, k = x.shape
    groups, n = w[0].shape[0], matrix_dims(w[0])[1]
    fmt = kernel_weight_format(*w)
    gated = w_up is not None
    config = config or resolve_config(policy, rows, groups, fmt, (k,), simulate, (n,),
                                      gated=gated)
    config, x, norm_weight = with_row_norm(config, x, row_norm, policy)
    order, valid_sorted, tiles = _tiles(rows, group_ids, groups, config)
    rw = None
    if gated:
        rw = (jnp.ones((rows,), jnp.float32) if row_weights is None
              else row_weights.astype(jnp.float32))
        rw = rw if order is None else jnp.where(valid_sorted, rw[order], 0.0)
    xs, x_scale = quantized_rows(x, order, config, simulate)
    if order is None:
        config = with_constant_tiles(config)
    ys = launch(xs, tiles, *w, weight_b=None if not gated else w_up[0],
                scale_b=None if not gated else w_up[1], route_w=rw,
                swiglu_limit=swiglu_limit, x_scale=x_scale, norm_weight=norm_weight,
                config=config)
    return _in_row_order(ys, order, valid_sorted, x.dtype)


def pair_config(policy: GroupedGemmPolicy | None, rows: int, k: int, w, w_next,
                simulate: bool) -> GroupedGemmSm90Config | None:
    """The config of one paired launch of ``w`` and ``w_next`` (same rows, one format, a
    warp kernel's decode tiles: they take pairs; ``policy.pair_linears``), or None: two
    launches."""
    fmt = kernel_weight_format(*w)
    if (fmt is None or kernel_weight_format(*w_next) != fmt
            or not (policy or GroupedGemmPolicy()).pair_linears):
        return None
    groups = w[0].shape[0]
    config = resolve_config(policy, rows, groups, fmt, (k,), simulate,
                            (matrix_dims(w[0])[1] + matrix_dims(w_next[0])[1],))
    if any(matrix_dims(m[0])[1] % (BLOCK_M * config.row_blocks) for m in (w, w_next)):
        # A CTA's row blocks lie in one of the two weights.
        config = dataclasses.replace(config, row_blocks=1)
    return config if config.spec.tiles == "decode" else None


def pair_support(rows: int, k: int, x_dtype: str, w, w_next, *, ragged: bool,
                 simulate: bool, policy: GroupedGemmPolicy | None) -> tuple[bool, str]:
    """Whether ``grouped_gemm_pair_cute`` runs these arguments; no cutlass."""
    for m in (w, w_next):
        ok, why = support(rows, k, x_dtype, m, ragged=ragged, simulate=simulate,
                          policy=policy)
        if not ok:
            return False, why
    config = pair_config(policy, rows, k, w, w_next, simulate)
    if config is None:
        return True, ""
    if kernel_weight_layout(w[0], w_next[0]) is None:
        return False, "w and w_next in different layouts (rows and blocked FP4)"
    n = matrix_dims(w[0])[1] + matrix_dims(w_next[0])[1]
    return launch_support(config, kernel_weight_format(*w), x_dtype, rows, w[0].shape[0],
                          [(False, n, k)])


def grouped_gemm_pair_cute(x, group_ids, w, w_next, *, simulate: bool = False,
                           row_norm=None, policy: GroupedGemmPolicy | None = None):
    """``grouped_gemm_pair`` on the Hopper kernels: one paired launch where ``pair_config``
    gives one (the outputs of ``w`` then ``w_next`` in one [M, N + N_next] buffer, split
    here), else a ``grouped_gemm_cute`` per weight (of rows normed once)."""
    rows, k = x.shape
    config = pair_config(policy, rows, k, w, w_next, simulate)
    if config is None:
        x = normed_rows(x, row_norm)
        return tuple(grouped_gemm_cute(x, group_ids, m, simulate=simulate, policy=policy)
                     for m in (w, w_next))
    config, x, norm_weight = with_row_norm(config, x, row_norm, policy)
    order, valid_sorted, tiles = _tiles(rows, group_ids, w[0].shape[0], config)
    xs, x_scale = quantized_rows(x, order, config, simulate)
    if order is None:
        config = with_constant_tiles(config)
    ys = launch(xs, tiles, *w, weight_b=w_next[0], scale_b=w_next[1], x_scale=x_scale,
                norm_weight=norm_weight, config=config, paired=True)
    ys = _in_row_order(ys, order, valid_sorted, x.dtype)
    n = matrix_dims(w[0])[1]
    return ys[:, :n], ys[:, n:]
