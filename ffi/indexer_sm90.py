"""``index_topk`` on Hopper: the scores of each block of entries from
``kernels/index_scores_sm90.py`` (one launch per block, bf16 ``[B, S, width]``: no
``[B, S, H, width]`` temporary), merged into the running top-k by
``kernels/index_topk_sm90.py`` (a radix select per query row) when there are at least
``TOP_K_ROWS`` query rows and k <= ``MAX_TOPK``, else by XLA's ``top_k`` (in parts for a few
long rows), in the reference's loop (``indexer_reference.blocked_topk``)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4_jax.kernels.index_scores_config import (BLOCK_N, DEFAULT_CONFIG, MAX_TOPK,
                                                  IndexScoresSm90Config)
from .indexer_reference import (TOP_K_ROWS, _cdiv, blocked_topk, check_index_topk_args,
                                select_reference)

__all__ = ["support", "index_scores_cute", "select_cute", "index_topk_cute",
           "choose_kernel_block", "KERNEL_SCORE_BUDGET_BYTES"]

# The largest per-block temporary of the kernel path, the bf16 scores ``[B, S, width]``: a
# 4096-token chunk merges blocks of 32768 entries, a decode step the whole table at once.
# Fewer, wider blocks mean fewer top-k merges, which cost more than the scores at this width.
KERNEL_SCORE_BUDGET_BYTES = 256 << 20


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
            config: IndexScoresSm90Config = DEFAULT_CONFIG) -> tuple[bool, str]:
    """``config.is_supported`` for these arguments; imports no cutlass."""
    b, s, h, d = q.shape
    n = keys.shape[1]
    width = n if block is None else min(block, n)
    return config.is_supported(heads=h, dim=d, dtype=jnp.dtype(q.dtype).name,
                               key_dtype=jnp.dtype(keys.dtype).name, batch=b, tokens=s,
                               entries=n, width=width)


def index_scores_cute(q, weights, keys, limit, lo, width: int,
                      config: IndexScoresSm90Config | None = None):
    """The kernel's masked bf16 scores ``[B, S, width]`` of entries ``lo .. lo + width - 1``
    (``lo`` an int32 scalar, may be traced; ``limit`` the visible counts clamped to N)."""
    # Imported when a kernel is emitted; cute_call first: it pins CUTE_DSL_ARCH.
    from .cute_call import cute_call
    from dsv4_jax.kernels import index_scores_sm90 as kernel

    config = config or DEFAULT_CONFIG
    b, s = q.shape[:2]
    _, splits, _ = config.grid(b, s, width)
    out = jax.ShapeDtypeStruct((b, s, width), jnp.bfloat16)
    res = cute_call(kernel.index_scores_launcher, (out,), q, weights, keys,
                    limit.astype(jnp.int32), jnp.reshape(lo, (1,)).astype(jnp.int32),
                    splits=splits, tokens_per_warpgroup=config.tokens_per_warpgroup,
                    num_stages=config.num_stages)
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


def index_topk_cute(q, weights, keys, visible, k: int, *, block: int | None = None,
                    config: IndexScoresSm90Config | None = None):
    """``index_topk`` with the kernel's scores; ``block=None``: ``choose_kernel_block``."""
    check_index_topk_args(q, weights, keys, visible, k, block)
    b, s = q.shape[:2]
    n = keys.shape[1]
    if n == 0:
        return jnp.full((b, s, 0), -1, jnp.int32)
    ok, reason = support(q, weights, keys, visible, k, block, config or DEFAULT_CONFIG)
    if not ok:
        raise ValueError(f"index_topk: the kernel does not take these arguments: {reason}")
    kk = min(k, n)
    width = choose_kernel_block(b, s, n, kk) if block is None else min(block, n)
    limit = jnp.minimum(visible.astype(jnp.int32), n)
    # The top-k kernel runs one CTA per query row: with many rows (prefill) it fills the GPU;
    # a few long rows (decode) take XLA's top-k in parts, which spreads each row over many
    # sort segments (docs/performance.md).
    kernel_select = kk <= MAX_TOPK and b * s >= TOP_K_ROWS
    return blocked_topk(lambda lo: index_scores_cute(q, weights, keys, limit, lo, width, config),
                        b, s, n, kk, width, limit,
                        select=select_cute if kernel_select else select_reference)
