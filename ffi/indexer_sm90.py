"""``index_topk`` on Hopper: the scores of each block of entries from
``kernels/index_scores_sm90.py`` (one launch per block, bf16 ``[B, S, width]``: no
``[B, S, H, width]`` temporary), merged into the running top-k by
``kernels/index_topk_sm90.py`` (a radix select per query row) when there are at least
``TOP_K_ROWS`` query rows and k <= ``MAX_TOPK``; a decode step's few rows over one block by
``kernels/index_topk_split_sm90.py`` (the same select, each row split over many CTAs) from
``SPLIT_MIN_WIDTH`` entries on, below that by ``index_topk_sm90.py`` too; else (a few rows
over several blocks) by XLA's ``top_k`` (in parts for long rows); in the reference's loop
(``indexer_reference.blocked_topk``)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4_jax.kernels.index_scores_config import (BLOCK_N, MAX_SEGMENTS, MAX_TOPK,
                                                  SPLIT_SEGMENT, IndexScoresSm90Config,
                                                  choose_config)
from .indexer_reference import (TOP_K_ROWS, _cdiv, blocked_topk, check_index_topk_args,
                                select_reference)

__all__ = ["support", "index_scores_cute", "select_cute", "select_split_cute",
           "split_select_supported", "choose_select", "index_topk_cute",
           "choose_kernel_block", "KERNEL_SCORE_BUDGET_BYTES"]

# The largest per-block temporary of the kernel path, the bf16 scores ``[B, S, width]``: a
# 4096-token chunk merges blocks of 32768 entries, a decode step the whole table at once.
# Fewer, wider blocks mean fewer top-k merges, which cost more than the scores at this width.
KERNEL_SCORE_BUDGET_BYTES = 256 << 20
# The narrowest row the split top-k takes (eight of its segments).
SPLIT_MIN_WIDTH = 8 * SPLIT_SEGMENT


def choose_kernel_block(b: int, s: int, n: int, k: int) -> int:
    """The kernel path's block: the whole table when its bf16 scores fit in
    ``KERNEL_SCORE_BUDGET_BYTES``, else as many blocks as the budget needs, of equal widths
    (multiples of the kernel's block: the last block is not mostly past the table, whose
    entries the kernel would score and the merge would sort for nothing), and at least k
    (rounded up to the kernel's block) so that the first merge is one block."""
    fit = KERNEL_SCORE_BUDGET_BYTES // max(1, 2 * b * s)
    if fit >= n:
        return max(n, 1)
    floor = _cdiv(min(k, n), BLOCK_N) * BLOCK_N
    blocks = _cdiv(n, max(floor, fit // BLOCK_N * BLOCK_N))
    return min(max(floor, _cdiv(_cdiv(n, blocks), BLOCK_N) * BLOCK_N), n)


def support(q, weights, keys, visible, k=None, block=None,
            config: IndexScoresSm90Config | None = None) -> tuple[bool, str]:
    """``config.is_supported`` for these arguments (None: ``choose_config``); imports no
    cutlass."""
    b, s, h, d = q.shape
    config = choose_config(s) if config is None else config
    n = keys.shape[1]
    width = n if block is None else min(block, n)
    return config.is_supported(heads=h, dim=d, dtype=jnp.dtype(q.dtype).name,
                               key_dtype=jnp.dtype(keys.dtype).name, batch=b, tokens=s,
                               entries=n, width=width, key_row_bytes=keys.shape[2])


def index_scores_cute(q, weights, keys, limit, lo, width: int,
                      config: IndexScoresSm90Config | None = None):
    """The kernel's masked bf16 scores ``[B, S, width]`` of entries ``lo .. lo + width - 1``
    (``lo`` an int32 scalar, may be traced; ``limit`` the visible counts clamped to N)."""
    # Imported when a kernel is emitted; cute_call first: it pins CUTE_DSL_ARCH.
    from .cute_call import cute_call
    from dsv4_jax.kernels import index_scores_sm90 as kernel

    b, s = q.shape[:2]
    config = choose_config(s) if config is None else config
    _, splits, _ = config.grid(b, s, width)
    out = jax.ShapeDtypeStruct((b, s, width), jnp.bfloat16)
    res = cute_call(kernel.index_scores_launcher, (out,), q, weights, keys,
                    limit.astype(jnp.int32), jnp.reshape(lo, (1,)).astype(jnp.int32),
                    splits=splits, tokens_per_warpgroup=config.tokens_per_warpgroup,
                    num_stages=config.num_stages, skip_invisible=config.skip_invisible,
                    fp4_keys=bool(jnp.dtype(keys.dtype) == jnp.uint8), split_n=config.split_n)
    return res[0] if isinstance(res, (tuple, list)) else res


def select_cute(score, kk: int, lo, running=None):
    """``indexer_reference.select_reference`` by the top-k kernel (``kernels/index_topk_sm90``,
    one CTA per query row): the same values and ids, in the same order; bf16 scores,
    kk <= ``MAX_TOPK``."""
    from .cute_call import cute_call
    from dsv4_jax.kernels import index_topk_sm90 as kernel

    *lead, width = score.shape
    rows = 1
    for d in lead:
        rows *= d
    flat = score.reshape(rows, width)
    if running is None:               # the kernel reads no running set: placeholders
        run_values, run_ids = flat, jnp.zeros((1, 1), jnp.int32)
    else:
        run_values, run_ids = (x.reshape(rows, x.shape[-1]) for x in running)
    outs = (jax.ShapeDtypeStruct((rows, kk), score.dtype),
            jax.ShapeDtypeStruct((rows, kk), jnp.int32))
    values, ids = cute_call(kernel.index_topk_launcher, outs, flat, run_values, run_ids,
                            jnp.reshape(lo, (1,)).astype(jnp.int32), k=kk,
                            has_running=running is not None)
    return values.reshape(*lead, kk), ids.reshape(*lead, kk)


def split_select_supported(width: int, kk: int, dtype) -> bool:
    """Whether ``select_split_cute`` takes a ``[rows, width]`` score of ``dtype``."""
    return (jnp.dtype(dtype) == jnp.bfloat16 and 1 <= kk <= min(width, MAX_TOPK)
            and _cdiv(width, SPLIT_SEGMENT) <= MAX_SEGMENTS)


def select_split_cute(score, kk: int, lo, running=None):
    """``indexer_reference.select_reference`` without a running set by the split top-k kernels
    (``kernels/index_topk_split_sm90``: every row over many CTAs; a decode step's few long
    rows): the same values and ids, in the same order; bf16 scores."""
    from .cute_call import cute_call
    from dsv4_jax.kernels import index_topk_split_sm90 as kernel

    if running is not None:
        raise ValueError("select_split_cute: takes no running set (one block of entries)")
    *lead, width = score.shape
    if not split_select_supported(width, kk, score.dtype):
        raise ValueError(f"select_split_cute: the kernels do not take k={kk} over scores "
                         f"{tuple(score.shape)} of dtype {score.dtype}")
    rows = 1
    for d in lead:
        rows *= d
    segments = kernel.segments_of(width)
    counts = jnp.zeros((rows, kernel.COUNT_WORDS), jnp.int32)        # updated in place
    outs = (jax.ShapeDtypeStruct(counts.shape, counts.dtype),
            jax.ShapeDtypeStruct((rows, kk), jnp.int32),              # keys above T
            jax.ShapeDtypeStruct((rows, kk), jnp.int32),              # their positions
            jax.ShapeDtypeStruct((rows, segments), jnp.int32),        # ties kept per segment
            jax.ShapeDtypeStruct((rows, segments, kk), jnp.int32),    # their positions
            jax.ShapeDtypeStruct((rows, kk), score.dtype),
            jax.ShapeDtypeStruct((rows, kk), jnp.int32))
    *_, values, ids = cute_call(kernel.index_topk_split_launcher, outs,
                                score.reshape(rows, width), counts,
                                jnp.reshape(lo, (1,)).astype(jnp.int32),
                                input_output_aliases={1: 0}, k=kk, vector=width % 8 == 0)
    return values.reshape(*lead, kk), ids.reshape(*lead, kk)


def index_topk_cute(q, weights, keys, visible, k: int, *, block: int | None = None,
                    config: IndexScoresSm90Config | None = None, select=None):
    """``index_topk`` with the kernel's scores; ``block=None``: ``choose_kernel_block``;
    ``select``: the running top-k's merge (``select_reference``, ``select_cute`` or
    ``select_split_cute``), None: ``choose_select``."""
    check_index_topk_args(q, weights, keys, visible, k, block)
    b, s = q.shape[:2]
    n = keys.shape[1]
    if n == 0:
        return jnp.full((b, s, 0), -1, jnp.int32)
    config = choose_config(s) if config is None else config
    ok, reason = support(q, weights, keys, visible, k, block, config)
    if not ok:
        raise ValueError(f"index_topk: the kernel does not take these arguments: {reason}")
    kk = min(k, n)
    width = choose_kernel_block(b, s, n, kk) if block is None else min(block, n)
    limit = jnp.minimum(visible.astype(jnp.int32), n)
    return blocked_topk(lambda lo: index_scores_cute(q, weights, keys, limit, lo, width, config),
                        b, s, n, kk, width, limit,
                        select=select or choose_select(b * s, n, kk, width))


def choose_select(rows: int, n: int, kk: int, width: int):
    """The running top-k's merge: the one-CTA-per-row kernel from ``TOP_K_ROWS`` rows on (a
    prefill chunk's rows fill the GPU); for fewer rows over one block (a decode step: the
    whole table at once), the split kernels, which spread each row over many CTAs, from
    ``SPLIT_MIN_WIDTH`` entries on, and the one-CTA-per-row kernel below that (one launch
    where XLA's top-k is three on the step's critical path: docs/performance.md, "the
    one-CTA top-k at decode"); else (a few rows over several blocks) XLA's top-k, in parts for
    long rows."""
    if kk <= MAX_TOPK and (rows >= TOP_K_ROWS or n <= width < SPLIT_MIN_WIDTH):
        return select_cute
    if (width >= n and width >= SPLIT_MIN_WIDTH
            and split_select_supported(width, kk, jnp.bfloat16)):
        return select_split_cute
    return select_reference
