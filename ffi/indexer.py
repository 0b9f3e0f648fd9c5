"""The lightning indexer's scores and top-k (docs/architecture.md §3.5, §12): which compressed
entries each query of a CSA layer attends.

Contract::

    index_topk(q, weights, keys, visible, k, *, block=None, implementation=None)
        -> top [B, S, k'] int32 entry ids, -1 for an unused slot;  k' = min(k, N)

    q:       [B, S, H, D]  floating (the rotated, FP4-simulated index queries, the act dtype)
    weights: [B, S, H]     q's dtype (the head weights, already scaled)
    keys:    [B, N, D]     floating (the index key table; cast to q's dtype), or uint8
             [B, N, kv_entry.index_key_bytes(D)] MXFP4 rows (``kv_dtype="fp8+fp4"`` caches:
             the keys' FP4 simulation stored as codes and scales, decoded exactly)
    visible: [B, S]        integer: query (b, s) sees entries 0 .. visible[b, s] - 1
    k:       static int >= 1;   block: static int >= 1 or None

    I[b, s, j] = rnd(sum_h f32(rnd(relu(rnd(q[b, s, h] . keys[b, j])) * weights[b, s, h])))
    I[b, s, j] = -inf where j >= visible[b, s]
    top        = lax.top_k(I, k') ids (value descending, the lower id first on ties),
                 each id >= visible[b, s] replaced by -1

``rnd`` rounds to q's dtype; the dot products accumulate in f32 (the model's rounding points:
the ids are bit for bit those of the dense one-shot formula with every rounding applied).
Rows with fewer than k' visible entries list them all, then -1; N = 0 gives ``[B, S, 0]``.

Memory: the scores are never ``[B, S, H, N]`` at once. The reference computes them ``block``
entries at a time (the last block padded with invisible entries) and merges each block into
a running top-k, so its largest temporaries are ``[B, S, H, block]`` f32 whatever N is (XLA
on CPU keeps two: the dot's output and the rounded products); blocks past the longest row's
visible entries are not computed, so a short context in a large cache costs its own length.
``block=None`` is ``indexer_reference.choose_block``: the whole table in one block when its
f32 scores fit in ``SCORE_BLOCK_BUDGET_BYTES`` (decode: one score einsum and one top-k), else
the largest multiple of ``MIN_BLOCK`` entries that fits. The ids do not depend on ``block``.

Implementations: ``"xla"``, ``index_topk_reference`` (``ffi/indexer_reference.py``);
``"cute"``, ``ffi/indexer_sm90.py``: the scores of each block from a Hopper kernel
(``kernels/index_scores_sm90.py``: bf16 q and weights, bf16 keys or MXFP4 rows widened to
bf16 in the kernel, 64 heads of width 128; its launch config from
``index_scores_config.choose_config``), as bf16
``[B, S, block]`` (the ``[B, S, H, block]`` products stay in registers), merged by the same
running top-k -- by CuTe top-k kernels (``kernels/index_topk_sm90.py``, and for a decode
step's long rows ``index_topk_split_sm90.py``: exactly ``lax.top_k``'s values and ids) from
``indexer_reference.TOP_K_ROWS`` query rows on (prefill) and for a decode step's rows over
the whole table at once, else by XLA's (``indexer_sm90.choose_select``). Its blocks are
wider (``indexer_sm90.choose_kernel_block``: bf16 ``[B, S, block]`` within
``KERNEL_SCORE_BUDGET_BYTES``). The kernel adds the 64 head products in a
fixed f32 tree: its ids equal the reference's whenever that sum is exact in f32 (the
indexer's FP4-grid inputs make the dot products exact; the weighted sum is exact unless
its terms span more than f32's 24 bits), else scores may differ by an f32 rounding before
the bf16 one, which can only reorder near-ties.
"""
from __future__ import annotations

from . import indexer_sm90
from .dispatch import dispatch
from .indexer_reference import (MIN_BLOCK, SCORE_BLOCK_BUDGET_BYTES, check_index_topk_args,
                                choose_block, index_topk_reference)
from .registry import OpSpec, register

__all__ = ["index_topk", "index_topk_reference", "check_index_topk_args", "choose_block",
           "SCORE_BLOCK_BUDGET_BYTES", "MIN_BLOCK"]


def _support(q, weights, keys, visible, k=None, block=None, **_) -> tuple[bool, str]:
    return indexer_sm90.support(q, weights, keys, visible, k, block)


def index_topk(q, weights, keys, visible, k: int, *, block: int | None = None,
               implementation: str | None = None):
    """The indexer's top-k entry ids; see the module docstring. ``implementation``:
    ``"cute"`` (the kernel's scores; raises when it cannot run), ``"xla"`` (the reference)
    or None (the kernel when lowering for a Hopper GPU and it takes the arguments, else the
    reference)."""
    check_index_topk_args(q, weights, keys, visible, k, block)
    return dispatch("index_topk", implementation,
                    lambda: _support(q, weights, keys, visible, k, block),
                    lambda qq, w, kt, v: index_topk_reference(qq, w, kt, v, k, block=block),
                    lambda qq, w, kt, v: indexer_sm90.index_topk_cute(qq, w, kt, v, k,
                                                                      block=block),
                    q, weights, keys, visible)


register(OpSpec("index_topk", index_topk_reference, _support))
