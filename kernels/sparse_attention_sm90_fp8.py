"""FP8 entry rows as the sparse attention kernel's second pool: a mixin of
``SparseAttentionSm90`` used by its producer warpgroup (reads ``self.block_n``).

An FP8 row (584 bytes, ``dsv4_jax.kv_entry``: 448 e4m3 codes, 64 BF16 RoPE dims, 7 E8M0
scale bytes, padding) becomes the same 1 KB BF16 row of the stage tile that a BF16 pool
gives, in two steps per pipeline block:

1. ``issue_fp8_row`` (cp.async, 8 bytes a copy: rows are only 8-byte aligned): the codes
   of 16-byte output chunk ``kc < 56`` go to the *upper half* of that chunk's own smem slot;
   the RoPE chunks (``kc >= 56``) go to their slots as they are (already BF16); the row's
   8-byte scale word goes to a per-stage side buffer.
2. One block later (``finish_fp8_block``, while the next block's copies are in flight):
   ``cp.async.wait_group 1`` (this thread's copies of the block landed), a producer-only
   named barrier (the scale words copied by one thread are visible to all), then
   ``convert_fp8_row``: each thread widens its own chunks in place -- 8 codes from the upper
   half, times the block's power-of-two scale, rounded to BF16 (exact: an e4m3 value times a
   power of two is a BF16 value) -- into the whole 16-byte slot, and the block is committed
   to the math warpgroups (an ordinary arrive: it releases the widened stores). A thread
   converts only the chunks it copied, so no other thread's chunk is read or written.

The stage tile's byte layout (``chunk_addr``) is the K-major 128B-swizzled layout of
``make_smem_layout_b``: entry ``n``'s 16-byte chunk ``kc`` of stage ``s`` sits at
``s * block_n * 1024 + (kc // 8) * block_n * 128 + n * 128 + ((kc % 8) ^ (n % 8)) * 16``
(the swizzle XORs a 128-byte row's chunk index with the row index mod 8; the tile base is
1024-byte aligned).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr, pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from .sparse_attention_config import (FP8_NOPE_DIM, FP8_ROPE_OFFSET, FP8_SCALE_OFFSET,
                                      HEAD_DIM)

CHUNK = 16                              # bytes of one output chunk: 8 BF16
NOPE_CHUNKS = FP8_NOPE_DIM // 8         # chunks holding codes (the rest hold RoPE dims)
CHUNKS_PER_SCALE = 64 // 8
GATHER_BARRIER = 9                      # named barrier of the producer warpgroup's 128 threads


def _asm(text: str, constraints: str, args: list, loc, ip) -> None:
    llvm.inline_asm(None, [a.ir_value(loc=loc, ip=ip) for a in args], text, constraints,
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def cp_async_8(dst: Int32, src: Int64, *, loc=None, ip=None) -> None:
    """``cp.async.ca`` of 8 bytes from global ``src`` to shared ``dst`` (both 8-aligned)."""
    _asm("cp.async.ca.shared.global [$0], [$1], 8;", "r,l,~{memory}",
         [Int32(dst), Int64(src)], loc, ip)


@dsl_user_op
def widen_e4m3_chunk(chunk: Int32, scale: Int32, *, loc=None, ip=None) -> None:
    """In place at shared ``chunk``: the 8 e4m3 codes in its upper 8 bytes times 2^(E-127)
    (E the byte at shared ``scale``), as 8 BF16 over all 16 bytes (code i -> BF16 i)."""
    widen = "".join(
        f"mov.b32 {{e0, e1}}, h{i};\ncvt.f32.f16 f0, e0;\ncvt.f32.f16 f1, e1;\n"
        f"mul.rn.f32 f0, f0, s;\nmul.rn.f32 f1, f1, s;\ncvt.rn.bf16x2.f32 h{i}, f1, f0;\n"
        for i in range(4))
    _asm("{\n.reg .b32 a, b, e, h0, h1, h2, h3;\n.reg .b16 p0, p1, p2, p3, e0, e1;\n"
         ".reg .f32 s, f0, f1;\n"
         "ld.shared.v2.b32 {a, b}, [$0+8];\n"
         "ld.shared.u8 e, [$1];\nshl.b32 e, e, 23;\nmov.b32 s, e;\n"
         "mov.b32 {p0, p1}, a;\nmov.b32 {p2, p3}, b;\n"
         "cvt.rn.f16x2.e4m3x2 h0, p0;\ncvt.rn.f16x2.e4m3x2 h1, p1;\n"
         "cvt.rn.f16x2.e4m3x2 h2, p2;\ncvt.rn.f16x2.e4m3x2 h3, p3;\n"
         + widen +
         "st.shared.v4.b32 [$0], {h0, h1, h2, h3};\n}",
         "r,r,~{memory}", [Int32(chunk), Int32(scale)], loc, ip)


class Fp8EntryGather:
    """``issue_fp8_row`` and ``convert_fp8_row`` (see the module docstring)."""

    @cute.jit
    def chunk_addr(self, tile: Int32, stage: Int32, row: Int32, kc: Int32) -> Int32:
        """Shared address of entry ``row``'s 16-byte chunk ``kc`` in ``stage`` of the tile."""
        bn = self.block_n
        return (tile + stage * (bn * HEAD_DIM * 2) + (kc // 8) * (bn * 128) + row * 128
                + ((kc % 8) ^ (row % 8)) * CHUNK)

    @cute.jit
    def issue_fp8_row(self, src: Int64, tile: Int32, scales: Int32, stage: Int32, row: Int32,
                      chunk0: Int32):
        """cp.async this thread's chunks ``chunk0 + 16 c`` of the FP8 row at global ``src``
        (codes to each slot's upper half, RoPE dims as they are); the row's first thread
        also copies the scale word to ``scales`` (8 bytes per row and stage)."""
        for c in cutlass.range_constexpr(4):
            kc = chunk0 + 16 * c
            dst = self.chunk_addr(tile, stage, row, kc)
            # chunk0 < 16: the first three chunks always hold codes, the fourth holds codes
            # for chunk0 < 8 and RoPE dims after.
            if const_expr(c < 3):
                cp_async_8(dst + 8, src + (kc * 8).to(Int64))
            elif kc < NOPE_CHUNKS:
                cp_async_8(dst + 8, src + (kc * 8).to(Int64))
            else:
                rope = src + (FP8_ROPE_OFFSET + (kc - NOPE_CHUNKS) * CHUNK).to(Int64)
                cp_async_8(dst, rope)
                cp_async_8(dst + 8, rope + Int64(8))
        if chunk0 == 0:
            cp_async_8(scales + (stage * self.block_n + row) * 8,
                       src + Int64(FP8_SCALE_OFFSET))

    @cute.jit
    def convert_fp8_row(self, tile: Int32, scales: Int32, stage: Int32, row: Int32,
                        chunk0: Int32):
        """Widen this thread's code chunks of ``row`` in place (after its copies landed and
        the producer's barrier)."""
        scale_word = scales + (stage * self.block_n + row) * 8
        for c in cutlass.range_constexpr(4):
            kc = chunk0 + 16 * c
            if const_expr(c < 3):
                widen_e4m3_chunk(self.chunk_addr(tile, stage, row, kc),
                                 scale_word + kc // CHUNKS_PER_SCALE)
            elif kc < NOPE_CHUNKS:
                widen_e4m3_chunk(self.chunk_addr(tile, stage, row, kc),
                                 scale_word + kc // CHUNKS_PER_SCALE)

    @cute.jit
    def finish_fp8_block(self, kv_pipe: pipeline.PipelineAsync, done: pipeline.PipelineState,
                         fp8_rows: Int32, tile: Int32, scales: Int32, row0: Int32,
                         chunk0: Int32, in_flight: cutlass.Constexpr):
        """Commit the block in ``done``'s stage: wait until this thread's copies of it landed
        (``in_flight`` newer groups may stay pending), the producer barrier (the scale words
        other threads copied are then visible), widen this thread's FP8 rows in place, arrive."""
        cute.arch.cp_async_wait_group(in_flight)
        cute.arch.barrier(barrier_id=GATHER_BARRIER, number_of_threads=128)
        for i in cutlass.range_constexpr(self.block_n // 8):
            if (fp8_rows >> i) & 1:
                self.convert_fp8_row(tile, scales, done.index, row0 + 8 * i, chunk0)
        kv_pipe.producer_commit(done)


__all__ = ["Fp8EntryGather"]
