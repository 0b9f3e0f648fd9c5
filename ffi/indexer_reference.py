"""The indexer top-k's pure-JAX reference, its block rule and argument checks (contract:
``ffi/indexer.py``).

The scores are computed ``block`` entries at a time and merged into a running top-k, so the
largest temporary is one block's ``[B, S, H, block]`` f32 scores whatever the context length.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import kv_entry

__all__ = ["index_topk_reference", "check_index_topk_args", "choose_block", "blocked_topk",
           "top_k_in_parts", "select_reference",
           "SCORE_BLOCK_BUDGET_BYTES", "MIN_BLOCK"]

# The largest per-block temporary, the f32 scores ``[B, S, H, block]``: a 4096-token prefill
# chunk with 64 heads gets blocks of 256 entries, a decode step the whole table in one block.
# Small next to the model's other activations on an H200, and large enough that each block's
# einsum and top-k are big launches rather than many small ones.
SCORE_BLOCK_BUDGET_BYTES = 256 << 20
# The smallest automatic block: below it the per-block top-k (over k + block candidates) costs
# more than the scores it saves, and it keeps the block a multiple of the tensor-core tiles.
MIN_BLOCK = 128
# ``top_k_in_parts``: rows of at least 4 parts of this many entries are cut into parts when
# there are fewer than ``TOP_K_ROWS`` rows (decode steps; a prefill chunk's rows fill the GPU).
TOP_K_PART = 4096
TOP_K_ROWS = 256


def _cdiv(a, b):
    return (a + b - 1) // b


def choose_block(b: int, s: int, h: int, n: int) -> int:
    """The automatic block: the whole table when its ``b s h n`` f32 scores fit in
    ``SCORE_BLOCK_BUDGET_BYTES``, else the largest multiple of ``MIN_BLOCK`` that fits (at
    least ``MIN_BLOCK``)."""
    per_entry = max(1, b * s * h * 4)
    fit = SCORE_BLOCK_BUDGET_BYTES // per_entry
    if fit >= n:
        return max(n, 1)
    return min(max(MIN_BLOCK, fit // MIN_BLOCK * MIN_BLOCK), n)


def _int_value(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_index_topk_args(q, weights, keys, visible, k, block=None) -> None:
    """``TypeError``/``ValueError`` naming the argument and its shape, in one line."""
    op = "index_topk"
    if q.ndim != 4:
        raise ValueError(f"{op}: q must be [B, S, H, D]; q has shape {tuple(q.shape)}")
    b, s, h, d = q.shape
    if tuple(weights.shape) != (b, s, h):
        raise ValueError(f"{op}: weights must be [B, S, H] = {(b, s, h)} as q "
                         f"{tuple(q.shape)}; weights has shape {tuple(weights.shape)}")
    rows = jnp.dtype(keys.dtype) == jnp.uint8      # MXFP4 index key rows (kv_entry)
    if rows and (d < kv_entry.INDEX_SCALE_BLOCK or d % kv_entry.INDEX_SCALE_BLOCK):
        raise TypeError(f"{op}: keys must be floating, or uint8 MXFP4 rows for D a multiple of "
                        f"{kv_entry.INDEX_SCALE_BLOCK}; keys has dtype uint8, q has shape "
                        f"{tuple(q.shape)}")
    width = kv_entry.index_key_bytes(d) if rows else d
    if keys.ndim != 3 or keys.shape[0] != b or keys.shape[2] != width:
        what = f"uint8 MXFP4 rows [B = {b}, N, {width}]" if rows else f"[B = {b}, N, D = {d}]"
        raise ValueError(f"{op}: keys must be {what} as q {tuple(q.shape)}; keys has shape "
                         f"{tuple(keys.shape)}")
    if tuple(visible.shape) != (b, s):
        raise ValueError(f"{op}: visible must be [B, S] = {(b, s)} as q {tuple(q.shape)}; "
                         f"visible has shape {tuple(visible.shape)}")
    for name, x in (("q", q), ("weights", weights)) + ((("keys", keys),) if not rows else ()):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{op}: {name} must be floating; {name} has dtype {x.dtype}")
    if weights.dtype != q.dtype:
        raise TypeError(f"{op}: weights must have q's dtype {q.dtype}; weights has dtype "
                        f"{weights.dtype}")
    if not jnp.issubdtype(visible.dtype, jnp.integer):
        raise TypeError(f"{op}: visible must be integer; visible has dtype {visible.dtype}")
    if not _int_value(k) or k < 1:
        raise ValueError(f"{op}: k must be a positive int, got {k!r}")
    if block is not None and (not _int_value(block) or block < 1):
        raise ValueError(f"{op}: block must be None or a positive int, got {block!r}")


def _round_to(x, dtype):
    """``x`` (f32) rounded to ``dtype``'s precision, kept in f32 (a no-op for f32)."""
    info = jnp.finfo(dtype)
    if info.bits >= 32:
        return x
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _scores(q, weights, keys, lo, limit):
    """The masked scores ``[B, S, width]`` of entries ``lo .. lo + width - 1`` (``keys`` holds
    exactly those, values or MXFP4 rows), with the model's rounding points: the bf16 einsum
    accumulated in f32 and rounded, relu, times the weights rounded, the head sum in f32
    rounded."""
    dt = q.dtype
    if kv_entry.is_index_key_rows(keys, q.shape[-1]):
        keys = kv_entry.decode_index_keys(keys, q.shape[-1], dt)
    score = jnp.einsum("bshd,btd->bsht", q, keys.astype(dt),
                       preferred_element_type=jnp.float32).astype(dt)
    # relu(score) * weights rounded to dt, written as the exact f32 product of two dt values
    # and an explicit rounding: XLA's CPU dot fusion (YNNPACK) drops the rounding of a dt
    # multiply feeding the f32 head sum in some shapes and not others (the whole model's
    # CPU program dropped it), which would make the ids depend on the block width.
    prod = jax.nn.relu(score).astype(jnp.float32) * weights[..., None].astype(jnp.float32)
    prod = _round_to(prod, dt)
    score = jnp.sum(prod, axis=2).astype(dt)                                 # [B, S, width]
    entry = lo + jnp.arange(keys.shape[1], dtype=jnp.int32)
    return jnp.where(entry[None, None, :] < limit[..., None], score, -jnp.inf), entry


def top_k_in_parts(score, kk: int):
    """``lax.top_k(score, kk)`` over the last axis, the same values and positions; a few long
    rows (a decode step over a long table) are cut into parts of ``TOP_K_PART`` whose top-kk
    are merged by one more top-k. XLA sorts each row in one segment, so a handful of rows of
    hundreds of thousands of entries leave the GPU idle; the parts give it many.

    Exact, ties included: every entry of the top-kk is in its part's top-kk; the candidates sit
    in part order, each part's in top-k order (the lower position first on ties), so a tie
    between parts goes to the earlier part -- the lower position, as one top-k. The last part
    is padded with -inf past the row, positions no real entry loses to (the row holds at
    least kk entries, all before them)."""
    *lead, width = score.shape
    rows = int(np.prod(lead)) if lead else 1
    part = max(TOP_K_PART, _cdiv(kk, TOP_K_PART) * TOP_K_PART)
    if rows >= TOP_K_ROWS or width < 4 * part:
        return jax.lax.top_k(score, kk)
    parts = _cdiv(width, part)
    padded = jnp.pad(score, [(0, 0)] * len(lead) + [(0, parts * part - width)],
                     constant_values=-jnp.inf)
    values, pos = jax.lax.top_k(padded.reshape(*lead, parts, part), kk)
    pos = pos + (jnp.arange(parts, dtype=pos.dtype) * part)[:, None]
    values, sel = jax.lax.top_k(values.reshape(*lead, parts * kk), kk)
    return values, jnp.take_along_axis(pos.reshape(*lead, parts * kk), sel, axis=-1)


def select_reference(score, kk: int, lo, running=None):
    """The top kk of ``running`` (values, ids: a top-k in top-k order, or None) followed by
    ``score [B, S, width]`` (ids lo + j): ``(values, ids)`` in top-k order, ties to the
    earlier candidate (``top_k_in_parts``)."""
    if running is None:
        values, pos = top_k_in_parts(score, kk)
        return values, pos + lo
    values, ids = running
    entry = lo + jnp.arange(score.shape[-1], dtype=jnp.int32)
    cand = jnp.concatenate([values, score], axis=-1)
    cand_ids = jnp.concatenate([ids, jnp.broadcast_to(entry, score.shape)], axis=-1)
    values, pos = top_k_in_parts(cand, kk)
    return values, jnp.take_along_axis(cand_ids, pos, axis=-1)


def blocked_topk(block_scores, b: int, s: int, n: int, kk: int, width: int, limit,
                 select=select_reference):
    """The running top-k over ``ceil(n / width)`` blocks of entries (``ffi/indexer.py``).

    ``block_scores(lo)`` gives the masked scores ``[B, S, width]`` of entries ``lo .. lo +
    width - 1`` (``lo`` traced; -inf for every entry at or past ``limit``, entries past ``n``
    included); ``limit`` ``[B, S]`` int32 is the visible count clamped to ``n``;
    ``select(score, kk, lo, running)`` keeps the top kk (``select_reference``).

    The first step scores the first ``ceil(kk / width)`` blocks (one at a time) and takes
    their top kk, so the running set always holds kk real entries; each later block is merged
    by a top-k over ``[running, block]``. ``lax.top_k`` puts the lower position first on
    ties, and the running set (itself in top-k order) sits before the block, whose entries all
    have higher ids, so ties resolve by id exactly as one top-k over the whole table (a visible
    entry scored -inf included: it outranks the invisible ones by id, as there). Blocks past
    the longest row's visible entries are skipped (a ``while_loop``): they would only add -inf
    candidates with higher ids than every entry already held, which never displace one.
    """
    n_blocks = _cdiv(n, width)
    first = min(_cdiv(kk, width), n_blocks)
    if first == 1:                  # one block (decode: the whole table)
        score = block_scores(jnp.int32(0))
    else:                           # [B, S, first * width] from one block's temporaries
        parts = jax.lax.map(lambda i: block_scores(i * width), jnp.arange(first, dtype=jnp.int32))
        score = jnp.moveaxis(parts, 0, 2).reshape(b, s, first * width)
    values, ids = select(score, kk, jnp.int32(0))         # positions are ids: it starts at 0

    if n_blocks > first:
        needed = _cdiv(jnp.max(limit), width)
        stop = jnp.clip(needed, first, n_blocks).astype(jnp.int32)

        def body(carry):
            i, values, ids = carry
            values, ids = select(block_scores(i * width), kk, i * width, (values, ids))
            return i + 1, values, ids

        _, values, ids = jax.lax.while_loop(lambda c: c[0] < stop, body,
                                            (jnp.int32(first), values, ids))
    return jnp.where(ids < limit[..., None], ids, -1).astype(jnp.int32)


def index_topk_reference(q, weights, keys, visible, k: int, *, block: int | None = None):
    """Pure-JAX definition of ``index_topk`` (runs anywhere); ``block=None``: ``choose_block``.
    The scores of each block in XLA (the last block padded with invisible entries), merged by
    ``blocked_topk``."""
    check_index_topk_args(q, weights, keys, visible, k, block)
    b, s, h, _ = q.shape
    n = keys.shape[1]
    if n == 0:
        return jnp.full((b, s, 0), -1, jnp.int32)
    kk = min(k, n)
    width = choose_block(b, s, h, n) if block is None else min(block, n)
    n_blocks = _cdiv(n, width)
    limit = jnp.minimum(visible.astype(jnp.int32), n)     # entries past the table are none
    if n_blocks * width != n:                             # padded entries are never visible
        keys = jnp.pad(keys, ((0, 0), (0, n_blocks * width - n), (0, 0)))
    if n_blocks == 1:
        return blocked_topk(lambda lo: _scores(q, weights, keys, 0, limit)[0],
                            b, s, n, kk, width, limit)

    def block_scores(lo):
        keys_i = jax.lax.dynamic_slice_in_dim(keys, lo, width, axis=1)
        return _scores(q, weights, keys_i, lo, limit)[0]

    return blocked_topk(block_scores, b, s, n, kk, width, limit)
