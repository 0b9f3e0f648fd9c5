"""MXFP4 index key rows as the score kernel's keys: a mixin of ``IndexScoresSm90`` used by its
producer warpgroup.

A key row (72 bytes, ``dsv4_jax.kv_entry``: 64 bytes of e2m1 codes, the lower dim in the low
nibble, then 4 E8M0 scale bytes, one per 32 dims, and padding) becomes the same 256-byte BF16
row of the stage tile that a BF16 table gives, in two steps per pipeline block:

1. ``issue_fp4_row`` (cp.async, 4 bytes a copy: rows are only 8-byte aligned): the 4 code
   bytes of this thread's 16-byte output chunk ``kc`` (dims 8 kc .. 8 kc + 7) go to bytes
   12..15 of that chunk's own smem slot, the row's 4-byte scale word to bytes 8..11.
2. One block later (``finish_fp4_block``, while the next block's copies are in flight):
   ``cp.async.wait_group 1`` (this thread's copies of the block landed), then
   ``widen_e2m1_chunk`` per chunk: byte-permute lookups give each magnitude's BF16 value,
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
from cutlass.cutlass_dsl import dsl_user_op

from .index_scores_config import BLOCK_N, DIM, FP4_KEY_SCALE_OFFSET

CHUNK = 16                       # bytes of one output chunk: 8 BF16
DIMS_PER_SCALE = 32


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


@dsl_user_op
def widen_e2m1_chunk(chunk: Int32, scale_byte: Int32, *, loc=None, ip=None) -> None:
    """In place at shared ``chunk``: the 8 e2m1 codes in its bytes 12..15 times 2^(E - 127)
    (E the byte at shared ``scale_byte``), as 8 BF16 over all 16 bytes (code i -> BF16 i).

    Integer work only (conversions run at a fraction of the integer rate): ``prmt`` looks up
    the high and low BF16 bytes of four magnitudes at once, two more interleave them into
    BF16 pairs, ``bfi`` sets the signs, and one ``mul.rn.bf16x2`` per pair applies the
    scale (exact: a grid value times a power of two)."""
    pairs = "".join(
        f"prmt.b32 v{k}, lo{k // 2}, hi{k // 2}, {'0x5140' if k % 2 == 0 else '0x7362'};\n"
        f"shr.b32 t, w, {8 * k + 3};\nbfi.b32 v{k}, t, v{k}, 15, 1;\n"
        f"shr.b32 t, w, {8 * k + 7};\nbfi.b32 v{k}, t, v{k}, 31, 1;\n"
        f"mul.rn.bf16x2 v{k}, v{k}, s;\n"
        for k in range(4))
    _asm("{\n.reg .b32 w, m, e, s, t, hi0, hi1, lo0, lo1, v0, v1, v2, v3, ha, hb, la, lb;\n"
         f"mov.b32 ha, {_HIGH_BYTES[0]};\nmov.b32 hb, {_HIGH_BYTES[1]};\n"
         f"mov.b32 la, {_LOW_BYTES[0]};\nmov.b32 lb, {_LOW_BYTES[1]};\n"
         "ld.shared.b32 w, [$0+12];\n"
         "ld.shared.u8 e, [$1];\nshl.b32 e, e, 7;\nshl.b32 s, e, 16;\nor.b32 s, s, e;\n"
         "and.b32 m, w, 0x77777777;\n"
         "prmt.b32 hi0, ha, hb, m;\nprmt.b32 lo0, la, lb, m;\n"
         "shr.b32 m, m, 16;\n"
         "prmt.b32 hi1, ha, hb, m;\nprmt.b32 lo1, la, lb, m;\n"
         + pairs +
         "st.shared.v4.b32 [$0], {v0, v1, v2, v3};\n}",
         "r,r,~{memory}", [Int32(chunk), Int32(scale_byte)], loc, ip)


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
        for i in cutlass.range_constexpr(BLOCK_N // 8):
            chunk = self.chunk_addr(tile, done.index, row0 + 8 * i, kc)
            widen_e2m1_chunk(chunk, chunk + 8 + kc // (DIMS_PER_SCALE // 8))
        kv_pipe.producer_commit(done)


__all__ = ["Fp4KeyGather", "cp_async_4", "widen_e2m1_chunk"]
