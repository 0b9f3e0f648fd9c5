"""Grouped expert GEMM for decode tiles, warp by warp: ``algorithm="mma_sync"`` (sm_90a).

Computes exactly what ``moe_sm90_kernel.MoeGemmSm90`` computes (same launcher arguments,
same outputs, same rounding points) for tiles of at most 8 token rows:

    out[r, n] = sum_k W_e[n, k] * x[r, k]     (gated: bf16(rw[r] * swiglu(x.w1, x.w3)))

Why a second algorithm: at decode every weight byte is used by 1-8 token rows, so the work
is the weight stream and its conversion. The WGMMA kernel converts into a shared-memory A
tile that the tensor cores read back, behind fences and named barriers, in one converting
warpgroup per CTA (measured: bound by that conversion, not by HBM). Here the converted
weights never leave registers: they are the A fragments of warp-level ``mma.sync`` MMAs
(weights = M, 16 rows per warp; tokens = N = 8), and every warp is independent.

Dataflow (CTA = 4 warps = 64 weight rows of one expert and one tile of <= 8 token rows;
grid = (output features / 64, tile slots), like the WGMMA kernel):

1. Each lane ``4g + t`` streams, per K block of 128, only what it will read itself, by
   ``cp.async`` into its own shared-memory slots (a ``num_stages``-deep ring per lane, no
   barriers): of weight rows g and g + 8 (of each matrix) the bytes of columns
   [32t, 32t + 32) -- one FP4 scale block -- their scale word, and the same columns of
   token row g (tile rows past the count read the tile's first row; never stored).
2. ``cp.async.wait_group`` releases the oldest stage; for each of 4 MMA steps the lane
   converts 8 codes per row to bf16 (FP4 by byte-permute lookup, FP8 by the shift trick,
   both exact, times the E8M0 scale) and issues 2 ``mma.sync.m16n8k16`` per matrix with
   f32 accumulators. The K order inside the block is permuted identically for weights and
   tokens (``moe_sm90.warp_lane_columns``), so the product is unchanged.
3. Epilogue from the accumulator fragments: rows g, g + 8 (output features), tokens
   2t, 2t + 1; SwiGLU x routing weight when gated; rows past the tile's count not written.

Constraints: as the WGMMA kernel (K a multiple of 128, output features of 64, FP8 scale
words of 4 bytes), and block_n = 8.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from .moe_sm90 import (BLOCK_K, BLOCK_M, ROW_BYTES, WARP_COUNT, WARP_ROWS,
                       MoeGemmSm90Config, warp_lane_columns, warp_lane_weight_byte, warp_slots,
                       warp_stage_bytes)
from .moe_sm90_convert import (copy_bytes, e8m0_bf16x2, fp4x8_to_bf16x8, fp8x4_to_bf16x4,
                               gated_output, mma_m16n8k16_bf16)

NUM_THREADS = 32 * WARP_COUNT
STEPS = 4                     # MMA steps (K = 32 each: 8 columns per lane) per K block


class MoeGemmWarpSm90:
    """Static configuration of one compiled kernel (see the module docstring)."""

    def __init__(self, weight_format: str, gated: bool, swiglu_limit: float,
                 config: MoeGemmSm90Config):
        self.weight_format = weight_format
        self.gated = gated
        self.mats = 2 if gated else 1
        self.swiglu_limit = float(swiglu_limit)
        self.num_stages = config.num_stages
        self.ablation = config.ablation
        self.row_bytes = ROW_BYTES[weight_format]
        self.lane_bytes = self.row_bytes // 4          # per row and K block, per lane
        self.chunks = self.lane_bytes // 16            # 16 B cp.async per row
        self.w_slots, self.x_slots, self.s_slots = warp_slots(weight_format, gated)
        self.stage_bytes = warp_stage_bytes(weight_format, gated)
        self.dtype = cutlass.BFloat16

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, mX: cute.Tensor, mTileExpert: cute.Tensor, mTileRow0: cute.Tensor,
                 mTileRows: cute.Tensor, mWa: cute.Tensor, mSa: cute.Tensor,
                 mWb: cute.Tensor, mSb: cute.Tensor, mRw: cute.Tensor, mOut: cute.Tensor,
                 stream: cuda.CUstream):
        total = WARP_COUNT * self.num_stages * self.stage_bytes

        @cute.struct
        class SharedStorage:
            ring: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, total], 128]

        self.shared_storage = SharedStorage
        n_out = mOut.shape[1]
        self.kernel(mX, mTileExpert, mTileRow0, mTileRows, mWa, mSa, mWb, mSb, mRw,
                    mOut).launch(grid=[n_out // BLOCK_M, mTileExpert.shape[0], 1],
                                 block=[NUM_THREADS, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mX: cute.Tensor, mTileExpert: cute.Tensor, mTileRow0: cute.Tensor,
               mTileRows: cute.Tensor, mWa: cute.Tensor, mSa: cute.Tensor, mWb: cute.Tensor,
               mSb: cute.Tensor, mRw: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        m_tile, slot, _ = cute.arch.block_idx()
        expert = mTileExpert[slot]
        if expert >= 0:
            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            warp = cute.arch.make_warp_uniform(tidx // 32)
            lane = tidx % 32
            ring = (storage.ring.data_ptr().toint()
                    + warp * (self.num_stages * self.stage_bytes))
            row0 = mTileRow0[slot]
            rows = mTileRows[slot]
            # First weight row (of [E * N]) of this warp's 16, and this lane's token row.
            w_row = expert * mOut.shape[1] + m_tile * BLOCK_M + warp * WARP_ROWS
            g = lane // 4
            x_row = row0 + g
            if g >= rows:
                x_row = row0
            acc = cute.make_rmem_tensor((4 * self.mats,), Float32)
            acc.fill(0.0)
            num_k = mX.shape[1] // BLOCK_K
            for s in cutlass.range_constexpr(self.num_stages - 1):
                if s < num_k:
                    self.issue(mX, mWa, mSa, mWb, mSb, expert, m_tile, w_row, x_row, s,
                               ring + s * self.stage_bytes, lane)
                cute.arch.cp_async_commit_group()
            for kb in cutlass.range(num_k, unroll=1):
                ahead = kb + self.num_stages - 1
                if ahead < num_k:
                    self.issue(mX, mWa, mSa, mWb, mSb, expert, m_tile, w_row, x_row, ahead,
                               ring + (ahead % self.num_stages) * self.stage_bytes, lane)
                cute.arch.cp_async_commit_group()
                if const_expr(self.ablation != "no_wait"):
                    cute.arch.cp_async_wait_group(self.num_stages - 1)
                self.compute(acc, ring + (kb % self.num_stages) * self.stage_bytes, kb,
                             lane)
            cute.arch.cp_async_wait_group(0)
            self.epilogue(mRw, mOut, m_tile, warp, row0, rows, lane, acc)

    @cute.jit
    def issue(self, mX: cute.Tensor, mWa: cute.Tensor, mSa: cute.Tensor, mWb: cute.Tensor,
              mSb: cute.Tensor, expert: Int32, m_tile: Int32, w_row: Int32, x_row: Int32,
              kb: Int32, stage: Int32, lane: Int32):
        """cp.async of this lane's bytes of K block ``kb`` into its slots of ``stage``."""
        g, t = lane // 4, lane % 4
        n_out = mWa.shape[1]
        k_in = mX.shape[1]
        w_stride = Int64(k_in * self.row_bytes // BLOCK_K)       # bytes per weight row
        weights_16 = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), cutlass.Uint8,
            num_bits_per_copy=128)
        # Token rows: cached in L1, where the CTA's other warps find them.
        tokens_16 = cute.make_copy_atom(cpasync.CopyG2SOp(), cutlass.Uint8,
                                        num_bits_per_copy=128)
        word_4 = cute.make_copy_atom(cpasync.CopyG2SOp(), cutlass.Uint8, num_bits_per_copy=32)
        # Ablations: a kind of copy only for the first stages (the ring then holds stale
        # bytes that are still converted and multiplied).
        first_stages = kb < self.num_stages
        load = first_stages if const_expr(self.ablation == "no_load") else True
        load_scales = first_stages if const_expr(self.ablation == "no_scale_load") else True
        load_tokens = first_stages if const_expr(self.ablation == "no_token_load") else True
        for mat in cutlass.range_constexpr(self.mats):
            w_base = (mWa if mat == 0 else mWb).iterator.toint()
            s_base = (mSa if mat == 0 else mSb).iterator.toint()
            for half in cutlass.range_constexpr(2):             # rows g and g + 8
                row = (w_row + g + 8 * half).to(Int64)
                q = mat * 2 + half
                for c in cutlass.range_constexpr(self.chunks):
                    src = (w_base + row * w_stride + (
                        warp_lane_weight_byte(t, kb, self.weight_format) + c * 16).to(Int64))
                    dst = stage + ((q * self.chunks + c) * 32 + lane) * 16
                    if load:
                        copy_bytes(weights_16, 16, src, dst)
                if const_expr(self.weight_format == "fp4"):
                    # The row's 4 scale bytes of this K block; the lane uses byte t.
                    src = s_base + row * (k_in // 32) + kb * 4
                    if load_scales:
                        copy_bytes(word_4, 4, src, self.scale_slot(stage, q, lane))
            if const_expr(self.weight_format == "fp8"):
                # One 128 x 128 scale block for all 16 rows; byte kb % 4 of the word.
                blk_row = (expert * (n_out // 128) + m_tile // 2).to(Int64)
                src = s_base + blk_row * (k_in // 128) + (kb // 4) * 4
                if load_scales:
                    copy_bytes(word_4, 4, src, self.scale_slot(stage, mat, lane))
        x_base = mX.iterator.toint()
        for i in cutlass.range_constexpr(STEPS):
            col = warp_lane_columns(t, kb, i)
            src = x_base + (x_row.to(Int64) * k_in + col) * 2
            if load_tokens:
                copy_bytes(tokens_16, 16, src, stage + ((self.w_slots + i) * 32 + lane) * 16)

    def scale_slot(self, stage, index, lane):
        return stage + 16 * 32 * (self.w_slots + self.x_slots) + (index * 32 + lane) * 4

    @cute.jit
    def compute(self, acc: cute.Tensor, stage: Int32, kb: Int32, lane: Int32):
        """Convert this lane's weight bytes of one stage and run its 8 MMAs per matrix."""
        t = lane % 4
        words = []            # per (matrix, row half): the lane's weight words
        mults = []            # per (matrix, row half): bf16x2 scale multiplier
        for mat in cutlass.range_constexpr(self.mats):
            for half in cutlass.range_constexpr(2):
                q = mat * 2 + half
                row_words = []
                for c in cutlass.range_constexpr(self.chunks):
                    vec = _load_words(stage + ((q * self.chunks + c) * 32 + lane) * 16)
                    row_words += [vec[j] for j in range(4)]
                words.append(row_words)
                if const_expr(self.weight_format == "fp4"):
                    scale = _load_word(self.scale_slot(stage, q, lane))
                    mults.append(e8m0_bf16x2((scale >> (8 * t)) & 0xFF))
                elif const_expr(self.weight_format == "fp8"):
                    scale = _load_word(self.scale_slot(stage, mat, lane))
                    mults.append(e8m0_bf16x2((scale >> (8 * (kb % 4))) & 0xFF))
        for i in cutlass.range_constexpr(STEPS):
            x = _load_words(stage + ((self.w_slots + i) * 32 + lane) * 16)
            for mat in cutlass.range_constexpr(self.mats):
                # (c0 c1, c2 c3, c4 c5, c6 c7) of rows g and g + 8: bf16 pairs.
                pairs = [self.codes_to_bf16(words[mat * 2 + half], mults, mat * 2 + half, i)
                         for half in range(2)]
                for h in cutlass.range_constexpr(2):
                    a = (pairs[0][2 * h], pairs[1][2 * h], pairs[0][2 * h + 1],
                         pairs[1][2 * h + 1])
                    c = tuple(acc[4 * mat + j] for j in range(4))
                    b = (x[2 * h], x[2 * h + 1])
                    if const_expr(self.ablation == "no_mma"):
                        # Keeps the operands live at one integer op + one convert per value.
                        d = [c[j] + (a[j] ^ b[j % 2]).to(Float32) for j in range(4)]
                    else:
                        d = mma_m16n8k16_bf16(a, b, c)
                    for j in cutlass.range_constexpr(4):
                        acc[4 * mat + j] = d[j]

    def codes_to_bf16(self, row_words, mults, q, step):
        """The 8 codes of MMA step ``step`` (one row) as four bf16 pairs, in column order."""
        if const_expr(self.ablation == "no_dequant"):
            return [row_words[(step * len(row_words) // STEPS + j) % len(row_words)]
                    for j in range(4)]
        if const_expr(self.weight_format == "fp4"):
            return list(fp4x8_to_bf16x8(row_words[step], mults[q]))
        if const_expr(self.weight_format == "fp8"):
            lo = fp8x4_to_bf16x4(row_words[2 * step], mults[q])
            hi = fp8x4_to_bf16x4(row_words[2 * step + 1], mults[q])
            return [lo[0], lo[1], hi[0], hi[1]]
        return [row_words[4 * step + j] for j in range(4)]

    @cute.jit
    def epilogue(self, mRw: cute.Tensor, mOut: cute.Tensor, m_tile: Int32, warp: Int32,
                 row0: Int32, rows: Int32, lane: Int32, acc: cute.Tensor):
        """bf16 outputs of the tile's valid rows (SwiGLU x routing weight when gated)."""
        g, t = lane // 4, lane % 4
        col0 = m_tile * BLOCK_M + warp * WARP_ROWS + g
        for j in cutlass.range_constexpr(4):
            n = 2 * t + j % 2                    # token row of accumulator j
            col = col0 + 8 * (j // 2)            # weight row = output feature
            if n < rows:
                if const_expr(self.gated):
                    h = gated_output(acc[j], acc[4 + j], mRw[row0 + n], self.swiglu_limit)
                    mOut[row0 + n, col] = h.to(self.dtype)
                else:
                    mOut[row0 + n, col] = acc[j].to(self.dtype)


def _load_words(addr):
    """Four 32-bit words from a 16-byte aligned shared-memory address."""
    return cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.smem,
                                          assumed_align=16), cute.make_layout((4,))).load()


def _load_word(addr):
    return cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.smem,
                                          assumed_align=4), cute.make_layout((1,)))[0]
