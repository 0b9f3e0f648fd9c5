"""MXFP4 index key rows as the score kernel's keys: a mixin of ``IndexScoresSm90`` used by its
producer warpgroup.

A key row (72 bytes, ``dsv4_jax.kv_entry``: 64 bytes of e2m1 codes, the lower dim in the low
nibble, then 4 E8M0 scale bytes, one per 32 dims, and padding) becomes the same 256-byte BF16
row of the stage tile that a BF16 table gives, in two steps per pipeline block:

1. ``issue_fp4_row`` (cp.async, 4 bytes a copy: rows are only 8-byte aligned): the 4 code
   bytes of this thread's 16-byte output chunk ``kc`` (dims 8 kc .. 8 kc + 7) go to bytes
   12..15 of that chunk's own smem slot, the row's 4-byte scale word to bytes 8..11.
2. One block later (``finish_fp4_block``, while the next block's copies are in flight):
   ``cp.async.wait_group 1`` (this thread's copies of the block landed), then per batch of
   chunks their loads, ``e2m1_to_bf16x8`` on each and their stores: byte-permute lookups give each magnitude's BF16 value,
   the sign bits are inserted, one BF16x2 multiply per pair applies the block's scale
   2^(E - 127) (exact: an e2m1 value times a power of two is a BF16 value), and the 8 BF16
   fill the slot; then the block is committed to the math warpgroups (an ordinary arrive: it
   releases the widened stores). A thread reads and writes only the slots it copied, so no
   barrier among the producer's threads is needed.

The stage tile's byte layout (``chunk_addr``) is the K-major 128B-swizzled layout of
``make_smem_layout_b``: entry ``n``'s 16-byte chunk ``kc`` of stage ``s`` sits at
``s * BLOCK_N * 256 + (kc // 8) * BLOCK_N * 128 + n * 128 + ((kc % 8) ^ (n % 8)) * 16``.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .index_scores_config import BLOCK_N, DIM, FP4_KEY_SCALE_OFFSET

CHUNK = 16                       # bytes of one output chunk: 8 BF16
DIMS_PER_SCALE = 32
WIDEN_BATCH = 8                  # chunks loaded before their conversions (registers: 6 each)


def _asm(text: str, constraints: str, args: list, loc, ip) -> None:
    llvm.inline_asm(None, [a.ir_value(loc=loc, ip=ip) for a in args], text, constraints,
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def cp_async_4(dst: Int32, src: Int64, *, loc=None, ip=None) -> None:
    """``cp.async.ca`` of 4 bytes from global ``src`` to shared ``dst`` (both 4-aligned)."""
    _asm("cp.async.ca.shared.global [$0], [$1], 4;", "r,l,~{memory}",
         [Int32(dst), Int64(src)], loc, ip)


# BF16 bytes of the e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (0x0000, 0x3F00, 0x3F80,
# 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0), as the two 4-byte halves of prmt's byte table.
_HIGH_BYTES = ("0x3F3F3F00", "0x40404040")
_LOW_BYTES = ("0xC0800000", "0xC0804000")


def _ints(count: int, args: list, text: str, constraints: str, side_effects: bool, loc, ip):
    """An inline-asm block with ``count`` 32-bit integer results, as a tuple of ``Int32``."""
    res = llvm.inline_asm(llvm.StructType.get_literal([T.i32()] * count),
                          [Int32(a).ir_value(loc=loc, ip=ip) for a in args], text, constraints,
                          has_side_effects=side_effects, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip))
                 for i in range(count))


@dsl_user_op
def load_fp4_chunk(chunk: Int32, scale_byte: Int32, *, loc=None, ip=None):
    """(the 8 e2m1 codes in bytes 12..15 of the slot at shared ``chunk``, the E8M0 byte at
    shared ``scale_byte``). Ordered (after the copies' wait), not merged with the stores."""
    return _ints(2, [chunk, scale_byte],
                 "{\nld.shared.b32 $0, [$2+12];\nld.shared.u8 $1, [$3];\n}",
                 "=r,=r,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def e2m1_to_bf16x8(codes: Int32, exponent: Int32, *, loc=None, ip=None):
    """The 8 e2m1 ``codes`` (code i in bits 4i..4i+3) times 2^(exponent - 127) as four
    BF16x2 words (codes 2k, 2k+1 in word k, the lower code in the low half).

    Integer work only (conversion instructions run at a fraction of the integer rate):
    ``prmt`` looks up the high and low BF16 bytes of four magnitudes at once, two more
    interleave them into BF16 pairs, ``bfi`` sets the signs, and one ``mul.rn.bf16x2`` per
    pair applies the scale (exact: a grid value times a power of two). Pure: the scheduler
    interleaves the chunks of a batch."""
    pairs = "".join(
        f"prmt.b32 ${k}, lo{k // 2}, hi{k // 2}, {'0x5140' if k % 2 == 0 else '0x7362'};\n"
        f"shr.b32 t, $4, {8 * k + 3};\nbfi.b32 ${k}, t, ${k}, 15, 1;\n"
        f"shr.b32 t, $4, {8 * k + 7};\nbfi.b32 ${k}, t, ${k}, 31, 1;\n"
        f"mul.rn.bf16x2 ${k}, ${k}, s;\n"
        for k in range(4))
    text = ("{\n.reg .b32 m, e, s, t, hi0, hi1, lo0, lo1, ha, hb, la, lb;\n"
            f"mov.b32 ha, {_HIGH_BYTES[0]};\nmov.b32 hb, {_HIGH_BYTES[1]};\n"
            f"mov.b32 la, {_LOW_BYTES[0]};\nmov.b32 lb, {_LOW_BYTES[1]};\n"
            "shl.b32 e, $5, 7;\nshl.b32 s, e, 16;\nor.b32 s, s, e;\n"
            "and.b32 m, $4, 0x77777777;\n"
            "prmt.b32 hi0, ha, hb, m;\nprmt.b32 lo0, la, lb, m;\n"
            "shr.b32 m, m, 16;\n"
            "prmt.b32 hi1, ha, hb, m;\nprmt.b32 lo1, la, lb, m;\n"
            + pairs + "}")
    return _ints(4, [codes, exponent], text, "=&r,=&r,=&r,=&r,r,r", False, loc, ip)


@dsl_user_op
def store_shared_b32x4(addr: Int32, words, *, loc=None, ip=None) -> None:
    """``st.shared.v4.b32``: four words at the 16-byte aligned shared address ``addr``."""
    _asm("st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r,~{memory}",
         [Int32(addr)] + [Int32(w) for w in words], loc, ip)


class Fp4KeyGather:
    """``issue_fp4_row`` and ``finish_fp4_block`` (see the module docstring)."""

    @cute.jit
    def chunk_addr(self, tile: Int32, stage: Int32, row: Int32, kc: Int32) -> Int32:
        """Shared address of key ``row``'s 16-byte chunk ``kc`` in ``stage`` of the tile."""
        return (tile + stage * (BLOCK_N * DIM * 2) + (kc // 8) * (BLOCK_N * 128) + row * 128
                + ((kc % 8) ^ (row % 8)) * CHUNK)

    @cute.jit
    def issue_fp4_row(self, src: Int64, tile: Int32, stage: Int32, row: Int32, kc: Int32):
        """cp.async chunk ``kc``'s codes and the row's scale word (row at global ``src``)."""
        dst = self.chunk_addr(tile, stage, row, kc)
        cp_async_4(dst + 12, src + (kc * 4).to(Int64))
        cp_async_4(dst + 8, src + Int64(FP4_KEY_SCALE_OFFSET))

    @cute.jit
    def finish_fp4_block(self, kv_pipe: pipeline.PipelineAsync, done: pipeline.PipelineState,
                         tile: Int32, row0: Int32, kc: Int32, in_flight: cutlass.Constexpr):
        """Commit the block in ``done``'s stage: wait until this thread's copies of it landed
        (``in_flight`` newer groups may stay pending), widen its chunks in place, arrive."""
        cute.arch.cp_async_wait_group(in_flight)
        # In batches: the loads of a batch, then its conversions (independent: they overlap),
        # then its stores -- a store may alias a later load, so interleaving them one chunk
        # at a time would serialise every chunk on the shared-memory round trip.
        rows = BLOCK_N // 8
        for batch in cutlass.range_constexpr(rows // WIDEN_BATCH):
            chunks = [self.chunk_addr(tile, done.index, row0 + 8 * (batch * WIDEN_BATCH + i),
                                      kc) for i in range(WIDEN_BATCH)]
            loaded = [load_fp4_chunk(c, c + 8 + kc // (DIMS_PER_SCALE // 8)) for c in chunks]
            words = [e2m1_to_bf16x8(codes, exponent) for codes, exponent in loaded]
            for c, w in zip(chunks, words):
                store_shared_b32x4(c, w)
        kv_pipe.producer_commit(done)


__all__ = ["Fp4KeyGather", "cp_async_4", "e2m1_to_bf16x8"]
