"""The FP8 entry format of the compressed KV cache (docs/architecture.md §4.1, §5.4).

An entry of ``head_dim`` D whose last ``rope`` dims carry RoPE (Flash and Pro: 512 and 64) is
one row of ``entry_bytes(D, rope)`` bytes -- 584 for DSV4, the layout DeepSeek's FlashMLA
reads for V4 -- instead of 2 D bytes of BF16:

    [0, n)                 the n = D - rope no-RoPE dims as e4m3fn codes
    [n, n + 2 rope)        the RoPE dims, BF16 (little-endian)
    [n + 2 rope, + n/64)   one E8M0 byte per 64 no-RoPE dims: the block's scale 2^(E - 127)
    then zero bytes up to a multiple of 8

Codes and scales are the KV entry's FP8 simulation (``quant.fp8_simulate`` in blocks of 64:
power-of-two scales, round-to-nearest-even codes), so ``decode(encode(x))`` is that
simulation of the no-RoPE dims and the BF16 rounding of the RoPE dims, bit for bit: with
``quant_simulation`` on, an FP8 cache holds exactly the values a BF16 cache holds.

``kv_dtype="fp8+fp4"`` also keeps the lightning indexer's keys (width Di, 128 in
DSV4) as MXFP4 rows of ``index_key_bytes(Di)`` bytes (72) instead of 2 Di of BF16:

    [0, Di/2)              the e2m1 codes, two per byte, the lower dim in the low nibble
    [Di/2, Di/2 + Di/32)   one E8M0 byte per 32 dims: the block's scale 2^(E - 127)
    then zero bytes up to a multiple of 8

the reference's FP4 simulation of the keys (``quant.fp4_simulate`` in blocks of 32), so
``decode_index_keys(encode_index_keys(x))`` is that simulation, bit for bit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .quant import (FP8_DTYPE, act_quant, dequant_fp4_weight, e8m0_to_f32,
                    quantize_fp4_weight)

__all__ = ["KV_DTYPES", "SCALE_BLOCK", "INDEX_SCALE_BLOCK", "entry_bytes", "rope_dim_of",
           "encode", "decode", "index_key_bytes", "encode_index_keys", "decode_index_keys",
           "is_fp8_table", "is_index_key_rows", "check_kv_dtype"]

SCALE_BLOCK = 64                       # no-RoPE dims per E8M0 scale
INDEX_SCALE_BLOCK = 32                 # index key dims per E8M0 scale (MXFP4)
# ``Cache.init(kv_dtype=...)``: None = the cache dtype; "fp8": FP8 compressed entries;
# "fp8+fp4": those and MXFP4 index keys (smaller still, a slower indexer: docs/performance.md)
KV_DTYPES = (None, "fp8", "fp8+fp4")


def entry_bytes(head_dim: int, rope_dim: int) -> int:
    """Bytes of one FP8 entry: codes, BF16 RoPE dims and scales, padded to 8."""
    nope = head_dim - rope_dim
    if not 0 < rope_dim < head_dim or nope % SCALE_BLOCK:
        raise ValueError(f"FP8 KV entries need 0 < rope_dim < head_dim and head_dim - rope_dim "
                         f"a multiple of {SCALE_BLOCK}; got head_dim={head_dim}, "
                         f"rope_dim={rope_dim}")
    raw = nope + 2 * rope_dim + nope // SCALE_BLOCK
    return -(-raw // 8) * 8


def rope_dim_of(width: int, head_dim: int) -> int | None:
    """The RoPE dims of the FP8 entry layout whose rows are ``width`` bytes for ``head_dim``
    (None when no layout has that width). Unique: the width falls as no-RoPE dims grow."""
    for nope in range(SCALE_BLOCK, head_dim, SCALE_BLOCK):
        if entry_bytes(head_dim, head_dim - nope) == width:
            return head_dim - nope
    return None


def _layout(x_last: int, rope_dim: int):
    nope = x_last - rope_dim
    return nope, nope + 2 * rope_dim, nope // SCALE_BLOCK, entry_bytes(x_last, rope_dim)


def encode(x: jax.Array, rope_dim: int) -> jax.Array:
    """Entries ``[..., D]`` (any float dtype) -> uint8 rows ``[..., entry_bytes(D, rope_dim)]``.

    The no-RoPE dims are quantised (as ``quant.fp8_simulate`` does), the RoPE dims rounded to
    BF16."""
    nope, rope_end, n_scales, width = _layout(x.shape[-1], rope_dim)
    codes, scales = act_quant(x[..., :nope], SCALE_BLOCK)          # e4m3 codes, f32 2^k
    code_bytes = jax.lax.bitcast_convert_type(codes, jnp.uint8)
    rope = jax.lax.bitcast_convert_type(x[..., nope:].astype(jnp.bfloat16), jnp.uint8)
    rope_bytes = rope.reshape(*x.shape[:-1], 2 * rope_dim)
    exponent = (jax.lax.bitcast_convert_type(scales, jnp.uint32) >> 23) & 0xFF
    pad = jnp.zeros((*x.shape[:-1], width - rope_end - n_scales), jnp.uint8)
    return jnp.concatenate([code_bytes, rope_bytes, exponent.astype(jnp.uint8), pad], axis=-1)


def decode(rows: jax.Array, head_dim: int, dtype=jnp.bfloat16) -> jax.Array:
    """uint8 rows ``[..., W]`` -> entries ``[..., head_dim]`` in ``dtype`` (exact for BF16)."""
    rope_dim = rope_dim_of(rows.shape[-1], head_dim)
    if rope_dim is None:
        raise ValueError(f"kv_entry.decode: rows of {rows.shape[-1]} bytes are no FP8 entry "
                         f"layout of head_dim {head_dim}")
    nope, rope_end, n_scales, _ = _layout(head_dim, rope_dim)
    lead = rows.shape[:-1]
    codes = jax.lax.bitcast_convert_type(rows[..., :nope], FP8_DTYPE).astype(jnp.float32)
    scales = e8m0_to_f32(rows[..., rope_end:rope_end + n_scales])
    values = codes.reshape(*lead, n_scales, SCALE_BLOCK) * scales[..., None]
    rope = jax.lax.bitcast_convert_type(
        rows[..., nope:rope_end].reshape(*lead, rope_dim, 2), jnp.bfloat16)
    return jnp.concatenate([values.astype(dtype).reshape(*lead, nope), rope.astype(dtype)],
                           axis=-1)


def index_key_bytes(dim: int) -> int:
    """Bytes of one MXFP4 index key row of ``dim`` dims: codes and scales, padded to 8."""
    if dim < INDEX_SCALE_BLOCK or dim % INDEX_SCALE_BLOCK:
        raise ValueError(f"MXFP4 index keys need a width that is a multiple of "
                         f"{INDEX_SCALE_BLOCK}; got {dim}")
    raw = dim // 2 + dim // INDEX_SCALE_BLOCK
    return -(-raw // 8) * 8


def encode_index_keys(x: jax.Array) -> jax.Array:
    """Index keys ``[..., Di]`` (any float dtype) -> uint8 rows ``[..., index_key_bytes(Di)]``,
    quantised as ``quant.fp4_simulate`` does (the FP4 weight format's codes and scales)."""
    dim = x.shape[-1]
    width = index_key_bytes(dim)
    packed, scales = quantize_fp4_weight(x, INDEX_SCALE_BLOCK)
    pad = jnp.zeros((*x.shape[:-1], width - dim // 2 - dim // INDEX_SCALE_BLOCK), jnp.uint8)
    return jnp.concatenate([jax.lax.bitcast_convert_type(packed, jnp.uint8),
                            jax.lax.bitcast_convert_type(scales, jnp.uint8), pad], axis=-1)


def decode_index_keys(rows: jax.Array, dim: int, dtype=jnp.bfloat16) -> jax.Array:
    """uint8 rows ``[..., index_key_bytes(dim)]`` -> keys ``[..., dim]`` in ``dtype``
    (exact for BF16)."""
    if rows.shape[-1] != index_key_bytes(dim):
        raise ValueError(f"kv_entry.decode_index_keys: rows of {rows.shape[-1]} bytes are no "
                         f"MXFP4 index key layout of width {dim} "
                         f"({index_key_bytes(dim)} bytes)")
    scales = rows[..., dim // 2:dim // 2 + dim // INDEX_SCALE_BLOCK]
    return dequant_fp4_weight(rows[..., :dim // 2], scales, INDEX_SCALE_BLOCK).astype(dtype)


def is_index_key_rows(table, dim: int) -> bool:
    """Whether a table of index keys of width ``dim`` holds MXFP4 rows."""
    return (table is not None and jnp.dtype(table.dtype) == jnp.uint8
            and table.shape[-1] == index_key_bytes(dim))


def is_fp8_table(table) -> bool:
    """Whether a cache table (or an op's pool) holds FP8 entry rows."""
    return table is not None and jnp.dtype(table.dtype) == jnp.uint8


def check_kv_dtype(kv_dtype, head_dim: int, rope_dim: int, dtype,
                   index_dim: int | None = None) -> str | None:
    """``kv_dtype`` checked against the entry dims, the index keys' width (None: no CSA
    layer) and the cache ``dtype``; one of ``KV_DTYPES`` (None: compressed entries in the
    cache dtype). Raises ValueError naming it."""
    if not (kv_dtype is None or (isinstance(kv_dtype, str) and kv_dtype in KV_DTYPES)):
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    if kv_dtype in ("fp8", "fp8+fp4"):
        entry_bytes(head_dim, rope_dim)
        if kv_dtype == "fp8+fp4" and index_dim is not None:
            index_key_bytes(index_dim)
        if jnp.dtype(dtype) != jnp.bfloat16:
            raise ValueError(f"kv_dtype={kv_dtype!r} keeps the RoPE dims in BF16 (the official "
                             f"entry layout): the cache dtype must be bfloat16, got "
                             f"{jnp.dtype(dtype)}")
    return kv_dtype
