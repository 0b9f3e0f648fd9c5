"""Grouped expert GEMM for decode tiles, weights streamed into registers:
``algorithm="mma_fp8_stream"`` (sm_90a).

The MMAs, lane mapping and arithmetic of ``grouped_gemm_sm90_mma_fp8`` ("mma_fp8": the same
``mma.sync`` e4m3 operands in the same order, so the same outputs bit for bit) without its
shared-memory weight ring and its CTA barrier per K block: each warp loads its own weight
bytes with ordinary loads into registers, a batch of K blocks at a time, and never waits on
another warp while it streams. It tested whether that barrier bounds the decode launches;
measured, it mostly does not (only wq_b at T = 1 got faster: docs/performance.md, "Decode
GEMMs with the weights in registers"), so it runs on request only. Its once-per-CTA token
staging is where a fused activation quantisation would go.

Dataflow (CTA = 4 warps x 16 weight rows of one expert, one tile of <= 8 token rows; grid
and K split as "mma_fp8"):

1. Tokens: the CTA's token codes and scales of up to ``STREAM_CHUNK_BLOCKS`` K blocks at a
   time go to shared memory with cp.async, then one CTA barrier (one per chunk: one for
   every decode launch of the Flash model); only the tile's real rows are copied (the MMA
   columns of the others are never written out). Per K block: row r's 128 codes at 128 r,
   16-byte unit u at ``stream_token_unit(r, u)`` (the reads below are free of bank
   conflicts), then the 8 rows' f32 scales.
2. Weights, per warp: lane 4g + t loads, of rows g and g + 8 of each matrix and each K block
   of the batch, exactly the bytes "mma_fp8" reads from its stages -- FP8: 8 bytes at
   32 i + 8 t for MMA step i (each load instruction reads whole 32-byte sectors of 8 rows,
   L1 bypassed); FP4: the word t of unit i (scale block i), kept in L1 for the neighbouring
   loads of the same sectors -- plus the E8M0 scales (FP8: the 128 x 128 block's byte,
   FP4: the row's 4 scale bytes of the K block in one word). A batch is
   ``stream_batch_blocks`` K blocks (its loads are in flight together); its MMAs follow.
3. Per K block, as "mma_fp8": 4 MMA steps of K = 32 (FP8: chained in the tensor core, the
   block sum scaled by the block scale times the token scales; FP4: each step's result times
   its rows' scale, the K block's sum times the token scales, 2^6 restored at the end).
4. Epilogue of "mma_sync" (bf16 outputs, SwiGLU x routing weight; a K split adds its sums
   in the cluster first).

Constraints: those of "mma_fp8". Ablations (benchmarks only, outputs wrong by design):
no_load (the weight loads of the first batch reused for every batch), no_mma (the MMAs
replaced by one integer op per operand).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .grouped_gemm_config import GroupedGemmSm90Config
from .grouped_gemm_layout import (BLOCK_K, STREAM_CHUNK_BLOCKS, STREAM_KBLOCK_BYTES,
                                  WARP_TOKENS, stream_batch_blocks, stream_token_unit,
                                  weight_offset)
from .grouped_gemm_sm90_convert import (byte_perm, copy_bytes, cp_async_atom, fp4x8_to_e4m3x8,
                                        load_global_words)
from .grouped_gemm_sm90_mma_fp8 import GroupedGemmMmaFp8Sm90, _load_f32x2, _load_words2
from .grouped_gemm_sm90_mma_sync import NUM_THREADS, STEPS

TOKEN_SCALES_OFFSET = WARP_TOKENS * BLOCK_K     # in a K block's token bytes


class GroupedGemmMmaFp8StreamSm90(GroupedGemmMmaFp8Sm90):
    """Static configuration of one compiled kernel (see the module docstring)."""
    TAKES_TOKEN_STRIDE = False        # stages its token rows itself (``stage_tokens``)

    def __init__(self, weight_format: str, gated: bool, swiglu_limit: float,
                 config: GroupedGemmSm90Config, scale_group: int, paired: bool = False,
                 token_stride: int = 1):
        super().__init__(weight_format, gated, swiglu_limit, config, scale_group, paired,
                         token_stride)
        self.batch = stream_batch_blocks(weight_format, gated, config.num_stages)
        # Per lane, row half and K block: FP8 two words per MMA step, FP4 one.
        self.step_words = 2 if weight_format == "fp8" else 1
        self.kb_words = 2 * self.mats * STEPS * self.step_words
        # Scales per K block: FP8 the block scale byte per matrix; FP4 one word (4 scale
        # bytes) per matrix and row half.
        self.kb_scales = self.mats if weight_format == "fp8" else 2 * self.mats
        self.smem_bytes = STREAM_CHUNK_BLOCKS * STREAM_KBLOCK_BYTES

    # ---------------------------------------------------------------- device
    @cute.jit
    def k_loop(self, acc: cute.Tensor, mX: cute.Tensor, mXs: cute.Tensor, mWa: cute.Tensor,
               mSa: cute.Tensor, mWb: cute.Tensor, mSb: cute.Tensor, expert: Int32,
               m_tile: Int32, w_row: Int32, row0: Int32, rows: Int32, kb0: Int32, kb1: Int32,
               base: Int32, warp: Int32, tidx: Int32):
        """K blocks [kb0, kb1) into ``acc`` (the kernel is "mma_sync"'s with this loop):
        weights in register batches, tokens staged per chunk."""
        lane = tidx % 32
        words = cute.make_rmem_tensor((self.batch * self.kb_words,), Int32)
        scales = cute.make_rmem_tensor((self.batch * self.kb_scales,), Int32)
        for c0 in cutlass.range(kb0, kb1, STREAM_CHUNK_BLOCKS, unroll=1):
            c1 = kb1 if kb1 < c0 + STREAM_CHUNK_BLOCKS else c0 + STREAM_CHUNK_BLOCKS
            for kb in cutlass.range(c0, c1, self.batch, unroll=1):
                if const_expr(self.leaves_out("no_load")):
                    if kb == kb0:
                        self.load_batch(words, scales, mWa, mSa, mWb, mSb, expert,
                                        m_tile, w_row, kb, c1, lane)
                else:
                    self.load_batch(words, scales, mWa, mSa, mWb, mSb, expert, m_tile,
                                    w_row, kb, c1, lane)
                if kb == c0:
                    # The chunk's tokens (after every warp is done with the last one's).
                    if c0 > kb0:
                        cute.arch.barrier()
                    self.stage_tokens(mX, mXs, row0, rows, c0, c1, base, tidx)
                    cute.arch.cp_async_commit_group()
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.barrier()
                for u in cutlass.range_constexpr(self.batch):
                    if kb + u < c1:
                        self.compute_block(acc, words, scales, u,
                                           base + (kb + u - c0) * STREAM_KBLOCK_BYTES,
                                           lane)

    @cute.jit
    def stage_tokens(self, mX: cute.Tensor, mXs: cute.Tensor, row0: Int32, rows: Int32,
                     c0: Int32, c1: Int32, base: Int32, tidx: Int32):
        """cp.async copies of the tile's real token rows, K blocks [c0, c1): codes in
        16-byte units (thread i: units i, i + 128, ...), then the f32 scales."""
        k_in = mX.shape[1]
        num_k = k_in // BLOCK_K
        copy_16, word_4 = cp_async_atom(16, bypass_l1=True), cp_async_atom(4)
        units = (c1 - c0) * WARP_TOKENS * (BLOCK_K // 16)
        for i in cutlass.range(tidx, units, NUM_THREADS, unroll=1):
            kbl, r, unit = i // 64, (i // 8) % 8, i % 8
            if r < rows:
                src = (mX.iterator.toint() + (row0 + r).to(Int64) * k_in
                       + ((c0 + kbl) * BLOCK_K + 16 * unit).to(Int64))
                copy_bytes(copy_16, 16, src, base + kbl * STREAM_KBLOCK_BYTES + r * BLOCK_K
                           + stream_token_unit(r, unit) * 16)
        for i in cutlass.range(tidx, (c1 - c0) * WARP_TOKENS, NUM_THREADS, unroll=1):
            kbl, r = i // WARP_TOKENS, i % WARP_TOKENS
            if r < rows:
                src = mXs.iterator.toint() + ((row0 + r).to(Int64) * num_k + c0 + kbl) * 4
                copy_bytes(word_4, 4, src, base + kbl * STREAM_KBLOCK_BYTES
                           + TOKEN_SCALES_OFFSET + r * 4)

    @cute.jit
    def load_batch(self, words: cute.Tensor, scales: cute.Tensor, mWa: cute.Tensor,
                   mSa: cute.Tensor, mWb: cute.Tensor, mSb: cute.Tensor, expert: Int32,
                   m_tile: Int32, w_row: Int32, kb: Int32, c1: Int32, lane: Int32):
        """This lane's weight words and scale words of K blocks kb .. kb + batch - 1 (past
        the chunk: the chunk's last K block again, never multiplied)."""
        g, t = lane // 4, lane % 4
        n_out = mWa.shape[1]
        num_k = mSa.shape[2] if const_expr(self.weight_format == "fp8") else (
            mSa.shape[2] * 32 // BLOCK_K)
        for u in cutlass.range_constexpr(self.batch):
            k = kb + u
            if k >= c1:
                k = c1 - 1
            for mat in cutlass.range_constexpr(self.mats):
                w_base = (mWa if mat == 0 else mWb).iterator.toint()
                s_base = (mSa if mat == 0 else mSb).iterator.toint()
                for half in cutlass.range_constexpr(2):
                    row = (w_row + g + 8 * half).to(Int64)
                    first = w_base + weight_offset(row, k, num_k, self.row_bytes,
                                                   self.weight_layout)
                    for i in cutlass.range_constexpr(STEPS):
                        at = (u * self.kb_words
                              + ((mat * 2 + half) * STEPS + i) * self.step_words)
                        if const_expr(self.weight_format == "fp8"):
                            got = load_global_words(first + 32 * i + 8 * t, 2)
                        else:
                            got = load_global_words(first + 16 * i + 4 * t, 1,
                                                    keep_in_l1=True)
                        for j in cutlass.range_constexpr(self.step_words):
                            words[at + j] = got[j]
                    if const_expr(self.weight_format == "fp4"):
                        scales[u * self.kb_scales + mat * 2 + half] = load_global_words(
                            s_base + row * (num_k * 4) + (k * 4).to(Int64), 1,
                            keep_in_l1=True)[0]
                if const_expr(self.weight_format == "fp8"):
                    # The 128 x 128 block's scale word holding K block k (byte k % 4).
                    blk_row = (expert * (n_out // 128) + m_tile // 2).to(Int64)
                    word = load_global_words(s_base + blk_row * num_k + (k - k % 4).to(Int64),
                                             1, keep_in_l1=True)[0]
                    scales[u * self.kb_scales + mat] = (word >> (8 * (k % 4))) & 0xFF

    @cute.jit
    def compute_block(self, acc: cute.Tensor, words: cute.Tensor, scales: cute.Tensor,
                      u: cutlass.Constexpr, tokens: Int32, lane: Int32):
        """The MMAs of batch entry ``u`` (its K block's tokens at ``tokens``), scaled into
        ``acc`` exactly as "mma_fp8" does."""
        g, t = lane // 4, lane % 4
        sx = _load_f32x2(tokens + TOKEN_SCALES_OFFSET + 8 * t)
        block = cute.make_rmem_tensor((4 * self.mats,), Float32)
        block.fill(0.0)
        for i in cutlass.range_constexpr(STEPS):
            x = _load_words2(tokens + g * BLOCK_K
                             + stream_token_unit(g, 2 * i + t // 2) * 16 + 8 * (t % 2))
            if const_expr(self.weight_format == "fp4"):
                b = (byte_perm(x[0], x[1], 0x6420), byte_perm(x[0], x[1], 0x7531))
            else:
                b = (x[0], x[1])
            for mat in cutlass.range_constexpr(self.mats):
                rows_ab = []
                for half in cutlass.range_constexpr(2):
                    at = u * self.kb_words + ((mat * 2 + half) * STEPS + i) * self.step_words
                    if const_expr(self.weight_format == "fp4"):
                        rows_ab.append(fp4x8_to_e4m3x8(words[at]))
                    else:
                        rows_ab.append((words[at], words[at + 1]))
                a = (rows_ab[0][0], rows_ab[1][0], rows_ab[0][1], rows_ab[1][1])
                self.mma_step(block, mat, i, a, b,
                              [(scales[u * self.kb_scales + mat * 2 + half] >> (8 * i)) & 0xFF
                               for half in range(2)] if self.weight_format == "fp4" else [])
        self.add_block(acc, block, sx, [scales[u * self.kb_scales + mat]
                                        for mat in range(self.mats)]
                       if self.weight_format == "fp8" else [])
