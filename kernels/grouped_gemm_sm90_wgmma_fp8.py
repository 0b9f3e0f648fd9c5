"""Grouped expert GEMM for prefill tiles on FP8 tensor cores: ``algorithm="wgmma_fp8"`` (sm_90a).

Same launcher, schedule, tiles and epilogue as ``grouped_gemm_sm90_wgmma`` ("wgmma"), for FP4 and
FP8 expert weights with the FP8 activation simulation on (the official numerics): the token
rows arrive quantised -- e4m3 codes ``x`` [rows, K] (uint8) and f32 power-of-two scales
``x_scale`` [rows, K / 128] (``quant.act_quant``) -- and the WGMMAs run on e4m3 operands
(twice the bf16 rate, half the shared-memory bytes per K element).

Scales. Each K block of 128 is one WGMMA chain whose f32 result is scaled into the
accumulators ("promotion", as the official ``fp8_gemm``): ``acc += blk * w_scale[row] *
x_scale[token]``. FP8 weights: ``w_scale`` is the 128 x 128 block's E8M0 scale. FP4 weights
(E8M0 per 1 x 32): the row's four scales of the K block are folded into the e4m3 codes --
``w_scale = 2^(s_max - 127 - 6)`` and every code of sub-block ``i`` becomes
``e4m3(value * 2^(s_i - s_max + 6))`` through an 8-entry ``prmt`` table per sub-block
(``e4m3_fold_table``, ``fp4x8_to_e4m3x8_table``). The largest code of the largest sub-block
is 6 * 2^6 = 384 < 448, and the fold is exact while a row's four scales of a K block lie
within 2^14 of each other (DeepSeek's own lossless FP4 -> FP8 conversion folds whole
128 x 128 blocks the same way); past that the smallest codes round to nearest e4m3.

Dataflow (256 threads: producer warpgroup WG0, math warpgroup WG1; ``num_stages`` stages,
each holding its raw weight bytes, the converted e4m3 A tiles, the token codes, their scales
and the rows' fold scales):

1. WG0, K block ``kb``: issues the cp.async copies of K block ``kb + num_stages - 2`` (raw
   weight bytes and scale word of its own row half, 16-byte token chunks, token scales) as
   one cp.async group, waits for group ``kb`` (its own copies only: thread ``t`` converts
   the bytes it copied, row ``t / 2``, K half ``t % 2``, so no barrier is needed), converts
   them into the stage's swizzled e4m3 A tiles and writes the row's ``w_scale``, then
   commits the stage (proxy fence + mbarrier arrive).
2. WG1: per K block, the WGMMAs of the stage into one of two block accumulators
   (alternating, the K loop unrolled by 2), then -- while those run -- waits for the
   previous block's and promotes it into the accumulators and releases its stage.
3. Epilogue as "wgmma" (bf16, SwiGLU x routing weight when gated).

Constraints: sm_90a; FP4/FP8 weights; K a multiple of 256 (an even number of K blocks);
output features a multiple of 64; block_n <= 64 (registers: 2 x 2 block accumulators +
2 accumulators of 64 x block_n f32 per warpgroup when gated); ablations "no_dequant"
(the stage's A tiles are not written) and "no_mma" (no WGMMA; outputs wrong by design).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync

from .grouped_gemm_config import BLOCK_K, BLOCK_M, GroupedGemmSm90Config
from .grouped_gemm_layout import weight_offset
from .grouped_gemm_sm90_convert import (copy_bytes, e4m3_fold_table, e8m0_f32, fence_f32,
                               fp4x8_to_e4m3x8_table)
from .grouped_gemm_sm90_wgmma import GroupedGemmWgmmaSm90

FP4_FOLD_BIAS = 127 + 6       # e8m0_f32(s_i - s_max + FP4_FOLD_BIAS) = 2^(s_i - s_max + 6)
CHUNK = 16                    # bytes = e4m3 codes per vector store / token copy


@cute.jit
def convert_half_row(weight_format: cutlass.Constexpr, word: Int32, kb: Int32, half: Int32,
                     row_addr: Int32, store: cutlass.Constexpr) -> Float32:
    """K half ``half`` (64 columns) of one weight row's K block ``kb``, raw bytes at the
    shared address ``row_addr``, as e4m3 codes: ``store(chunk, words)`` receives each 16-byte
    chunk (K columns 16 chunk .. 16 chunk + 15 of the block) as 4 words. FP4: ``word`` holds
    the row's 4 E8M0 scales of the block, folded into the codes (module docstring); FP8:
    the codes as stored, ``word`` the aligned scale word holding the block's byte. Returns
    the row's promotion scale for the block. Shared by "wgmma_fp8" (its producer converts)
    and "wgmma_fp8_coop" (its math warpgroups do)."""
    if const_expr(weight_format == "fp4"):
        s0, s1 = word & 0xFF, (word >> 8) & 0xFF
        s2, s3 = (word >> 16) & 0xFF, (word >> 24) & 0xFF
        s01 = s0 if s0 > s1 else s1
        s23 = s2 if s2 > s3 else s3
        s_max = s01 if s01 > s23 else s23
        row_scale = e8m0_f32(s_max) * Float32(1.0 / 64.0)
        for j in cutlass.range_constexpr(2):             # sub-blocks 2 half + j
            s_i = (word >> (16 * half + 8 * j)) & 0xFF
            fold = s_i - s_max + FP4_FOLD_BIAS
            fold = fold if fold > 0 else Int32(0)
            t_lo, t_hi = e4m3_fold_table(e8m0_f32(fold))
            codes = cute.make_tensor(
                cute.make_ptr(Int32, row_addr + half * 32 + j * 16, cute.AddressSpace.smem,
                              assumed_align=16), cute.make_layout((4,))).load()
            for c in cutlass.range_constexpr(2):         # 16 codes -> one 16 B chunk
                out = cute.make_rmem_tensor((4,), Int32)
                for w in cutlass.range_constexpr(2):
                    o = fp4x8_to_e4m3x8_table(codes[2 * c + w], t_lo, t_hi)
                    out[2 * w] = o[0]
                    out[2 * w + 1] = o[1]
                store(half * 4 + j * 2 + c, out.load())
    else:
        row_scale = e8m0_f32((word >> (8 * (kb % 4))) & 0xFF)
        for c in cutlass.range_constexpr(4):             # e4m3 bytes as stored
            codes = cute.make_tensor(
                cute.make_ptr(Int32, row_addr + half * 64 + c * 16, cute.AddressSpace.smem,
                              assumed_align=16), cute.make_layout((4,))).load()
            store(half * 4 + c, codes)
    return row_scale


class GroupedGemmWgmmaFp8Sm90(GroupedGemmWgmmaSm90):
    """Static configuration of one compiled kernel (see the module docstring)."""

    def __init__(self, weight_format: str, gated: bool, swiglu_limit: float,
                 config: GroupedGemmSm90Config, scale_group: int = 1):
        if weight_format not in ("fp4", "fp8"):
            raise ValueError(f"GroupedGemmWgmmaFp8Sm90: FP4/FP8 weights, got {weight_format!r}")
        super().__init__(weight_format, gated, swiglu_limit, config, scale_group)
        self.dtype = cutlass.Float8E4M3FN
        self.a_buffers = self.num_stages * self.mats     # converted with the stage's copies

    @cute.jit
    def storage_struct(self, sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout):
        """Shared memory per stage: the rows' fold scales, the token scales, one scale word
        per producer thread and matrix (each reads only its own), raw weight bytes, the
        e4m3 A tiles (buffer ``stage * mats + mat``) and the token codes."""
        stages, mats, bn = self.num_stages, self.mats, self.block_n
        raw_bytes = mats * BLOCK_M * self.row_bytes

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[Int64, 2 * stages]
            sWs: cute.struct.Align[cute.struct.MemRange[Float32, stages * mats * BLOCK_M], 16]
            sXs: cute.struct.Align[cute.struct.MemRange[Float32, stages * bn], 16]
            sScale: cute.struct.Align[
                cute.struct.MemRange[Int32, stages * mats * 2 * BLOCK_M], 16]
            sRaw: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, stages * raw_bytes],
                                    128]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sA_layout)], 1024]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sB_layout)], 1024]

        return SharedStorage

    @cute.jit
    def produce(self, mX: cute.Tensor, mXs: cute.Tensor, mWa: cute.Tensor, mSa: cute.Tensor,
                mWb: cute.Tensor, mSb: cute.Tensor, expert: Int32, m_tile: Int32,
                row0: Int32, rows: Int32, num_k: Int32, storage, sA: cute.Tensor,
                sB: cute.Tensor, pipe: pipeline.PipelineAsync, tidx: Int32):
        """WG0: copies ``num_stages - 2`` K blocks ahead, converts K block ``kb``."""
        raw = storage.sRaw.data_ptr().toint()
        scales = storage.sScale.data_ptr().toint()
        ws = storage.sWs.data_ptr().toint()
        xs = storage.sXs.data_ptr().toint()
        lookahead = self.num_stages - 2
        load_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                  self.num_stages)
        state = load_state.clone()
        for kb in cutlass.range(lookahead, unroll=1):
            if kb < num_k:
                pipe.producer_acquire(load_state)
                self.issue(mX, mXs, mWa, mSa, mWb, mSb, expert, m_tile, row0, rows, kb,
                           load_state.index, raw, scales, xs, sB, tidx)
                load_state.advance()
            cute.arch.cp_async_commit_group()
        sA_vec = cute.flat_divide(sA, (1, CHUNK))[0, None, None, None, None]
        for kb in cutlass.range(num_k, unroll=1):
            ahead = kb + lookahead
            if ahead < num_k:
                pipe.producer_acquire(load_state)
                self.issue(mX, mXs, mWa, mSa, mWb, mSb, expert, m_tile, row0, rows, ahead,
                           load_state.index, raw, scales, xs, sB, tidx)
                load_state.advance()
            cute.arch.cp_async_commit_group()
            # This thread's copies of K block kb (every group but the newest lookahead).
            cute.arch.cp_async_wait_group(lookahead)
            for mat in cutlass.range_constexpr(self.mats):
                self.convert(raw, scales, ws, state.index, mat, kb, tidx, sA_vec)
            # Ordinary shared stores (A tiles) are read by the WGMMAs (async proxy).
            cute.arch.fence_proxy("async.shared", space="cta")
            pipe.producer_commit(state)
            state.advance()

    @cute.jit
    def issue(self, mX: cute.Tensor, mXs: cute.Tensor, mWa: cute.Tensor, mSa: cute.Tensor,
              mWb: cute.Tensor, mSb: cute.Tensor, expert: Int32, m_tile: Int32, row0: Int32,
              rows: Int32, kb: Int32, stage: Int32, raw: Int32, scales: Int32, xs: Int32,
              sB: cute.Tensor, tidx: Int32):
        """This thread's cp.async copies of K block ``kb`` into ``stage``: its row half of
        each matrix (row tidx / 2, K half tidx % 2) and that row's scale word, 16-byte token
        chunks ``tidx + 128 i``, and token ``tidx``'s scale."""
        bn = self.block_n
        n_out = mWa.shape[1]
        k_in = mX.shape[1]
        atom16 = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), cutlass.Uint8,
            num_bits_per_copy=128)
        atom4 = cute.make_copy_atom(cpasync.CopyG2SOp(), cutlass.Uint8, num_bits_per_copy=32)
        r, half = tidx // 2, tidx % 2
        w_row = (expert * n_out + m_tile * BLOCK_M + r).to(Int64)
        w_at = weight_offset(w_row, kb, k_in // BLOCK_K, self.row_bytes, self.weight_layout)
        half_bytes = self.row_bytes // 2
        raw_stage = self.mats * BLOCK_M * self.row_bytes
        for mat in cutlass.range_constexpr(self.mats):
            w_base = (mWa if mat == 0 else mWb).iterator.toint()
            s_base = (mSa if mat == 0 else mSb).iterator.toint()
            for c in cutlass.range_constexpr(half_bytes // 16):
                src = w_base + w_at + (half * half_bytes + c * 16)
                dst = raw + (stage * raw_stage + (mat * BLOCK_M + r) * self.row_bytes
                             + half * half_bytes + c * 16)
                copy_bytes(atom16, 16, src, dst)
            # FP4: the row's 4 scale bytes of this K block; FP8: the aligned word holding
            # this K block's byte of the row block's scale row.
            if const_expr(self.weight_format == "fp4"):
                src = s_base + w_row * (k_in // 32) + (kb * 4).to(Int64)
            else:
                blk_row = (expert * (n_out // 128) + m_tile * BLOCK_M // 128).to(Int64)
                src = s_base + blk_row * (k_in // 128) + ((kb // 4) * 4).to(Int64)
            copy_bytes(atom4, 4, src,
                       scales + ((stage * self.mats + mat) * 2 * BLOCK_M + tidx) * 4)
        # Token codes: bn rows x 8 chunks; token scales: one f32 per row. Rows past the
        # tile's count are not copied (as in the bf16 kernel: their columns are never
        # stored, and repeating the first row made same-address requests).
        sB_vec = cute.flat_divide(sB, (1, CHUNK))[0, None, None, None, None]
        x_base = mX.iterator.toint()
        for i in cutlass.range_constexpr((bn * 8 + 127) // 128):
            flat = i * 128 + tidx
            if flat < bn * 8:
                tr, c = flat // 8, flat % 8
                if tr < rows:
                    src = (x_base + (row0 + tr).to(Int64) * k_in
                           + (kb * BLOCK_K + c * CHUNK).to(Int64))
                    s = cute.make_tensor(cute.make_ptr(self.dtype, src,
                                                       cute.AddressSpace.gmem,
                                                       assumed_align=16),
                                         cute.make_layout((CHUNK,)))
                    cute.copy(cute.make_copy_atom(
                        cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                        self.dtype, num_bits_per_copy=128), s, sB_vec[None, tr, c, stage])
        if tidx < rows:                   # rows <= bn
            src = mXs.iterator.toint() + ((row0 + tidx).to(Int64) * (k_in // BLOCK_K) + kb) * 4
            copy_bytes(atom4, 4, src, xs + (stage * bn + tidx) * 4)

    @cute.jit
    def convert(self, raw: Int32, scales: Int32, ws: Int32, stage: Int32,
                mat: cutlass.Constexpr, kb: Int32, tidx: Int32, sA_vec: cute.Tensor):
        """Row ``tidx / 2``, K half ``tidx % 2`` of one matrix: raw bytes -> e4m3 codes in A
        buffer ``stage * mats + mat``; the row's scale for the promotion -> ``ws``."""
        r, half = tidx // 2, tidx % 2
        buf = stage * self.mats + mat
        row_addr = raw + ((stage * self.mats + mat) * BLOCK_M + r) * self.row_bytes
        word = cute.make_tensor(
            cute.make_ptr(Int32, scales + ((stage * self.mats + mat) * 2 * BLOCK_M + tidx) * 4,
                          cute.AddressSpace.smem, assumed_align=4), cute.make_layout((1,)))[0]
        def store(chunk, words):
            if const_expr(not self.leave_out["no_dequant"]):
                sA_vec[None, r, chunk, buf].store(words.bitcast(self.dtype))
        row_scale = convert_half_row(self.weight_format, word, kb, half, row_addr, store)
        if half == 0:
            slot = cute.make_tensor(
                cute.make_ptr(Float32, ws + ((stage * self.mats + mat) * BLOCK_M + r) * 4,
                              cute.AddressSpace.smem, assumed_align=4), cute.make_layout((1,)))
            slot[0] = row_scale

    @cute.jit
    def consume(self, mRw: cute.Tensor, mOut: cute.Tensor, m_tile: Int32, row0: Int32,
                rows: Int32, num_k: Int32, wg_tidx: Int32, storage, sA: cute.Tensor,
                sB: cute.Tensor, pipe: pipeline.PipelineAsync, tiled_mma: cute.TiledMma,
                math_wg: Int32):
        """WG1 (``math_wg`` 0: one math warpgroup): two K blocks' WGMMA chains per
        iteration; the first promoted while the second runs, then the second; then the
        epilogue."""
        bn = self.block_n
        ws = storage.sWs.data_ptr().toint()
        xs = storage.sXs.data_ptr().toint()
        thr_mma = tiled_mma.get_slice(wg_tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        shape_c = thr_mma.partition_shape_C((BLOCK_M, bn))
        acc = [thr_mma.make_fragment_C(shape_c) for _ in range(self.mats)]
        blk = [[thr_mma.make_fragment_C(shape_c) for _ in range(self.mats)] for _ in range(2)]
        for a in acc:
            a.fill(0.0)
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((BLOCK_M, bn)))
        num_kk = cute.size(tCrA, mode=[2])
        mma_mats = 0 if self.leave_out["no_mma"] else self.mats
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                             self.num_stages)
        # Two K blocks per iteration: both chains issued, then the first promoted while the
        # second runs. Every wait retires a chain of the same iteration: ptxas serializes
        # all WGMMAs of a kernel whose accumulators are read while a chain issued in an
        # earlier iteration is retired only by a later wait (a one-deep ring across
        # iterations compiled to that, C7514).
        for kb2 in cutlass.range(num_k // 2, unroll=1):
            stages = []
            for p in cutlass.range_constexpr(2):
                pipe.consumer_wait(state)
                # The producer fenced its shared stores before its arrive; fencing here too
                # costs one instruction per K block (as "wgmma" does after its own stores).
                cute.arch.fence_proxy("async.shared", space="cta")
                _fence_operands(blk[p])          # the last promotion's reads come first
                cute.nvgpu.warpgroup.fence()
                for mat in cutlass.range_constexpr(mma_mats):
                    for kk in cutlass.range_constexpr(num_kk):
                        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, kk > 0)
                        cute.gemm(tiled_mma, blk[p][mat],
                                  tCrA[None, None, kk, state.index * self.mats + mat],
                                  tCrB[None, None, kk, state.index], blk[p][mat])
                cute.nvgpu.warpgroup.commit_group()
                stages.append(state.clone())
                state.advance()
            for p in cutlass.range_constexpr(2):
                cute.nvgpu.warpgroup.wait_group(1 - p)
                _fence_operands(blk[p])          # read only after the wait
                self.promote(acc, blk[p], tCcC, ws, xs, stages[p].index)
                pipe.consumer_release(stages[p])
        self.epilogue(mRw, mOut, m_tile, row0, rows, thr_mma, acc[0], acc[self.mats - 1])

    def promote(self, acc: list, blk: list, tCcC: cute.Tensor, ws: Int32, xs: Int32,
                stage: Int32):
        """``acc[m, n] += blk[m, n] * w_scale[m] * x_scale[n]`` for one K block's stage
        (traced inline: its arguments are lists of fragments)."""
        bn = self.block_n
        for mat in range(self.mats):
            w_scales = cute.make_tensor(
                cute.make_ptr(Float32, ws + (stage * self.mats + mat) * BLOCK_M * 4,
                              cute.AddressSpace.smem, assumed_align=16),
                cute.make_layout((BLOCK_M,)))
            x_scales = cute.make_tensor(
                cute.make_ptr(Float32, xs + stage * bn * 4, cute.AddressSpace.smem,
                              assumed_align=16), cute.make_layout((bn,)))
            for i in range(cute.size(acc[mat])):
                m, n = tCcC[i][0], tCcC[i][1]
                acc[mat][i] = acc[mat][i] + blk[mat][i] * (w_scales[m] * x_scales[n])


def _fence_operands(fragments: list):
    """``fence_f32`` on every element of WGMMA accumulator fragments (traced inline)."""
    for frag in fragments:
        for i in range(cute.size(frag)):
            frag[i] = fence_f32(frag[i])
