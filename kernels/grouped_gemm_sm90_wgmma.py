"""Grouped expert GEMM on FP4 / FP8 / BF16 expert weights for Hopper (sm_90a), in CuTe DSL.

One launch multiplies token rows, sorted by expert, by their experts' weight matrices:

    out[r, n] = sum_k W_e[n, k] * x[r, k]        for every row r of a tile of expert e

with the weights kept in their storage format in HBM (packed FP4 e2m1 + E8M0 1x32 scales,
FP8 e4m3 + E8M0 128x128 scales, or BF16) and dequantised in shared memory, never in HBM.
``gated`` launches multiply by two matrices (w1, w3) at once and apply the DSV4 SwiGLU in
the epilogue: ``h = bf16(rw[r] * silu(min(g, l)) * clamp(u, -l, l))`` with
``g = bf16(x.w1)``, ``u = bf16(x.w3)`` (the reference's rounding points), so the
intermediate never exists unactivated in HBM.

Work split ("swap AB"): weights are the WGMMA M operand (64 weight rows per tile), tokens the
N operand (``block_n`` rows), so a decode tile of one token row wastes no tensor-core work
on padding rows. Grid: (output features / 64, row-tile slots); a slot whose expert id is
negative (the schedule's static worst case exceeds the real tiles) exits at once.

Dataflow (256 threads: a producer warpgroup WG0 and a math warpgroup WG1; "wgmma_coop",
``grouped_gemm_sm90_wgmma_coop``, runs the same steps with two math warpgroups on 128 weight
rows, each with single-buffered A tiles):

1. WG0 issues ``cp.async`` for each K block of 128: the raw weight bytes of the tile's 64
   rows (per matrix), their scale bytes (4 B), and the tile's token rows (bf16) into a
   128B-swizzled K-major tile of ``block_n`` rows (rows past the tile's count are not copied:
   their columns are never stored); ``num_stages`` stages form an mbarrier pipeline.
2. WG1 waits for a stage and converts the raw bytes to BF16 into a double-buffered,
   swizzled A tile: FP4 codes look their bf16 bytes up with byte permutes and are
   multiplied by the E8M0 scale; FP8 codes are shifted into bf16 bits times 2^-120 and
   multiplied back and by the scale -- both exact. It then issues the WGMMAs for that stage
   (f32 accumulators) asynchronously, so the conversion of stage j + 1 overlaps the
   tensor-core work of stage j.
3. Epilogue: bf16 outputs (SwiGLU and routing weight when gated), rows past the tile's row
   count are not written.

Measured (H200, docs/performance.md): the conversion in the one math warpgroup bounds the
decode launches (removing it halves their time; removing the loads changes nothing).

Constraints: sm_90a; x bf16 [A, K]; K a multiple of 128; output features a multiple of 64;
FP8 needs (K / 128) % 4 == 0 (4-byte scale copies); tile row starts and counts from
``grouped_gemm_config`` (rows of one tile belong to one expert, counts <= block_n).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync
from cutlass.tensor_utils import LayoutEnum

from .sm90_primitives import cp_async_arrive
from .grouped_gemm_config import BLOCK_K, BLOCK_M, KERNELS, ROW_BYTES, GroupedGemmSm90Config
from .grouped_gemm_layout import weight_offset
from .grouped_gemm_sm90_convert import (copy_bytes, e8m0_bf16x2, fp4x8_to_bf16x8, fp8x4_to_bf16x4,
                               gated_output)

DEQUANT_BARRIER = 1           # a math warpgroup's A tile is written (+ 2 x its index)
REUSE_BARRIER = 2             # its WGMMAs of a stage retired in every warp (+ 2 x its index)
# Two math warpgroups ("wgmma_coop"): the producer gives registers to the accumulators.
PRODUCER_REGS, MATH_REGS = 40, 232       # 40 + 2 x 232 <= 3 x 168 (no spills at 128-row tiles)


class GroupedGemmWgmmaSm90:
    """Static configuration of one compiled kernel (see the module docstring).

    ``MATH_WARPGROUPS`` math warpgroups share each stage's token rows, each converting and
    multiplying its own 64 weight rows (``grouped_gemm_sm90_wgmma_coop`` sets two)."""

    MATH_WARPGROUPS = 1

    def __init__(self, weight_format: str, gated: bool, swiglu_limit: float,
                 config: GroupedGemmSm90Config, scale_group: int = 1):
        # scale_group: the warp kernels' scale-copy group (the family's one constructor
        # signature); the WGMMA kernels copy one scale word per row and K block.
        self.weight_format = weight_format
        self.gated = gated
        self.mats = 2 if gated else 1
        self.swiglu_limit = float(swiglu_limit)
        self.block_n = config.block_n
        self.num_stages = config.num_stages
        self.leave_out = {stage: config.leaves_out(stage)
                          for stage in KERNELS["wgmma"].ablations}
        self.row_bytes = ROW_BYTES[weight_format]
        self.weight_layout = config.weight_layout
        self.dtype = cutlass.BFloat16          # the WGMMA operands in shared memory
        self.out_dtype = cutlass.BFloat16
        self.math_wgs = self.MATH_WARPGROUPS
        self.num_threads = 128 * (1 + self.math_wgs)
        self.cta_rows = BLOCK_M * self.math_wgs          # weight rows per CTA and matrix
        # One warpgroup double-buffers its A tiles (its conversion of the next stage overlaps
        # its WGMMAs); two single-buffer them (shared memory), the other warpgroup's
        # conversion overlapping a warpgroup's WGMMAs.
        self.a_parity = 2 if self.math_wgs == 1 else 1
        self.a_buffers = self.a_parity * self.mats * self.math_wgs   # (warpgroup, matrix, parity)

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, mX: cute.Tensor, mXs: cute.Tensor, mTileExpert: cute.Tensor,
                 mTileRow0: cute.Tensor, mTileRows: cute.Tensor, mWa: cute.Tensor,
                 mSa: cute.Tensor, mWb: cute.Tensor, mSb: cute.Tensor, mRw: cute.Tensor,
                 mOut: cute.Tensor, stream: cuda.CUstream):
        """The family's one signature (``grouped_gemm_sm90_launch``); ``mXs`` holds the
        token scales of "wgmma_fp8" (``grouped_gemm_sm90_wgmma_fp8``) and is unread here."""
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
            (1, 1, 1), (BLOCK_M, self.block_n))
        # A: the weight tiles the tensor cores read (``a_buffers`` of them); B: the token
        # rows of each stage.
        sA_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (BLOCK_M, self.block_n, BLOCK_K), self.dtype, self.a_buffers)
        sB_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (BLOCK_M, self.block_n, BLOCK_K), self.dtype,
            self.num_stages)
        self.shared_storage = self.storage_struct(sA_layout, sB_layout)
        n_out = mOut.shape[1]
        self.kernel(mX, mXs, mTileExpert, mTileRow0, mTileRows, mWa, mSa, mWb, mSb, mRw, mOut,
                    tiled_mma, sA_layout, sB_layout).launch(
            grid=[n_out // self.cta_rows, mTileExpert.shape[0], 1],
            block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.jit
    def storage_struct(self, sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout):
        """Shared memory: mbarriers, per-stage scale words and raw weight bytes, A and B."""
        stages = self.num_stages
        raw_bytes = self.mats * self.cta_rows * self.row_bytes

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[Int64, 2 * stages]
            sScale: cute.struct.Align[
                cute.struct.MemRange[Int32, stages * self.mats * self.cta_rows], 16]
            sRaw: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, stages * raw_bytes],
                                    128]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sA_layout)], 1024]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sB_layout)], 1024]

        return SharedStorage

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mX: cute.Tensor, mXs: cute.Tensor, mTileExpert: cute.Tensor,
               mTileRow0: cute.Tensor, mTileRows: cute.Tensor, mWa: cute.Tensor,
               mSa: cute.Tensor, mWb: cute.Tensor, mSb: cute.Tensor, mRw: cute.Tensor,
               mOut: cute.Tensor, tiled_mma: cute.TiledMma, sA_layout: cute.ComposedLayout,
               sB_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        m_tile, slot, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        expert = mTileExpert[slot]
        if expert >= 0:
            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
            sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
            pipe = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar.data_ptr(), num_stages=self.num_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         128 * self.math_wgs))
            row0 = mTileRow0[slot]
            rows = mTileRows[slot]
            num_k = mX.shape[1] // BLOCK_K
            if wg == 0:
                if const_expr(self.math_wgs > 1):
                    cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                self.produce(mX, mXs, mWa, mSa, mWb, mSb, expert, m_tile, row0, rows, num_k,
                             storage, sA, sB, pipe, tidx)
            else:
                if const_expr(self.math_wgs > 1):
                    cute.arch.setmaxregister_increase(MATH_REGS)
                self.consume(mRw, mOut, m_tile, row0, rows, num_k, tidx - 128 * wg, storage,
                             sA, sB, pipe, tiled_mma, wg - 1)

    @cute.jit
    def produce(self, mX: cute.Tensor, mXs: cute.Tensor, mWa: cute.Tensor, mSa: cute.Tensor,
                mWb: cute.Tensor, mSb: cute.Tensor, expert: Int32, m_tile: Int32,
                row0: Int32, rows: Int32, num_k: Int32, storage, sA: cute.Tensor,
                sB: cute.Tensor, pipe: pipeline.PipelineAsync, tidx: Int32):
        """WG0: raw weight bytes, scale bytes and token rows of each K block, by cp.async."""
        bn = self.block_n
        raw = storage.sRaw.data_ptr().toint()
        scales = storage.sScale.data_ptr().toint()
        n_out = mWa.shape[1]
        k_in = mX.shape[1]
        atom16 = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), cutlass.Uint8,
            num_bits_per_copy=128)
        atom4 = cute.make_copy_atom(cpasync.CopyG2SOp(), cutlass.Uint8, num_bits_per_copy=32)
        sB_vec = cute.flat_divide(sB, (1, 8))[0, None, None, None, None]
        cta_rows = self.cta_rows
        # This tile's first weight row, counted over all experts (``weight_offset``).
        w_row0 = (expert * n_out + m_tile * cta_rows).to(Int64)
        raw_stage = self.mats * cta_rows * self.row_bytes
        chunks = self.row_bytes // 16                 # 16 B chunks per weight row per stage
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                             self.num_stages)
        for kb in cutlass.range(num_k, unroll=1):
            pipe.producer_acquire(state)
            stage = state.index
            issue = True
            if const_expr(self.leave_out["no_load"]):
                issue = kb < self.num_stages
            issue_tokens = True
            if const_expr(self.leave_out["no_token_load"]):
                issue_tokens = kb < self.num_stages
            for mat in cutlass.range_constexpr(self.mats):
                w_base = (mWa if mat == 0 else mWb).iterator.toint()
                s_base = (mSa if mat == 0 else mSb).iterator.toint()
                # Weight bytes: cta_rows rows x `chunks` 16 B chunks.
                for i in cutlass.range_constexpr(cta_rows * chunks // 128):
                    flat = i * 128 + tidx
                    r, c = flat // chunks, flat % chunks
                    src = (w_base + weight_offset(w_row0 + r, kb, num_k, self.row_bytes,
                                                  self.weight_layout) + c * 16)
                    dst = raw + (stage * raw_stage + (mat * cta_rows + r) * self.row_bytes
                                 + c * 16)
                    if issue:
                        copy_bytes(atom16, 16, src, dst)
                # Scale bytes: 4 per row (FP4: K/32 per row, four per K block); FP8: the
                # aligned 4 bytes holding this K block's byte of the row block's scale row.
                if const_expr(self.weight_format == "fp4"):
                    if tidx < cta_rows:
                        src = s_base + ((w_row0 + tidx) * (k_in // 32) + kb * 4)
                        dst = scales + ((stage * self.mats + mat) * cta_rows + tidx) * 4
                        copy_bytes(atom4, 4, src, dst)
                if const_expr(self.weight_format == "fp8"):
                    if tidx == 0:      # cta_rows <= 128: the tile lies in one row block
                        blk_row = (expert * (n_out // 128) + m_tile * cta_rows // 128).to(Int64)
                        src = s_base + blk_row * (k_in // 128) + (kb // 4) * 4
                        dst = scales + ((stage * self.mats + mat) * cta_rows) * 4
                        copy_bytes(atom4, 4, src, dst)
            # Token rows: bn rows x 16 chunks of 8 bf16. Rows past the tile's count are not
            # copied: their WGMMA columns (outputs never stored; no column mixes with
            # another) hold whatever the stage held. Copying the tile's first row in their
            # place sent up to bn - 1 requests for the same bytes per chunk, which made
            # sparsely filled tiles slower than full ones (docs/performance_history.md).
            x_base = mX.iterator.toint()
            for i in cutlass.range_constexpr((bn * 16 + 127) // 128):
                flat = i * 128 + tidx
                if flat < bn * 16:
                    r, c = flat // 16, flat % 16
                    if r < rows and issue_tokens:
                        src = x_base + ((row0 + r).to(Int64) * k_in + kb * BLOCK_K + c * 8) * 2
                        self.copy_bf16x8(src, sB_vec[None, r, c, stage])
            cp_async_arrive(pipe.producer_get_barrier(state))
            pipe.producer_commit(state)
            state.advance()
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def copy_bf16x8(self, src: Int64, dst: cute.Tensor):
        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), self.dtype,
            num_bits_per_copy=128)
        s = cute.make_tensor(cute.make_ptr(self.dtype, src, cute.AddressSpace.gmem,
                                           assumed_align=16), cute.make_layout((8,)))
        cute.copy(atom, s, dst)

    @cute.jit
    def consume(self, mRw: cute.Tensor, mOut: cute.Tensor, m_tile: Int32, row0: Int32,
                rows: Int32, num_k: Int32, wg_tidx: Int32, storage, sA: cute.Tensor,
                sB: cute.Tensor, pipe: pipeline.PipelineAsync, tiled_mma: cute.TiledMma,
                math_wg: Int32):
        """Math warpgroup ``math_wg`` (its 64 weight rows of the CTA's tile): dequantise each
        stage into its A tiles, WGMMA, then the epilogue."""
        bn = self.block_n
        raw = storage.sRaw.data_ptr()
        scales = storage.sScale.data_ptr()
        thr_mma = tiled_mma.get_slice(wg_tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc_a = thr_mma.make_fragment_C(thr_mma.partition_shape_C((BLOCK_M, bn)))
        acc_b = thr_mma.make_fragment_C(thr_mma.partition_shape_C((BLOCK_M, bn)))
        acc_a.fill(0.0)
        acc_b.fill(0.0)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        sA_vec = cute.flat_divide(sA, (1, 8))[0, None, None, None, None]
        num_kk = cute.size(tCrA, mode=[2])
        dequant_barrier = DEQUANT_BARRIER + 2 * math_wg
        reuse_barrier = REUSE_BARRIER + 2 * math_wg
        # A buffer of (matrix, parity): this warpgroup's are the next mats x a_parity.
        a_base = math_wg * self.mats * self.a_parity
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                             self.num_stages)
        prev = state.clone()
        for kb in cutlass.range(num_k, unroll=1):
            pipe.consumer_wait(state)
            parity = kb % self.a_parity
            if const_expr(not self.leave_out["no_dequant"]):
                for mat in cutlass.range_constexpr(self.mats):
                    self.dequant(raw, scales, state.index, mat, kb, wg_tidx, sA_vec,
                                 a_base + mat * self.a_parity + parity, math_wg)
            # Ordinary smem stores (A) and cp.async stores (B) are read by the async proxy.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=dequant_barrier, number_of_threads=128)
            cute.nvgpu.warpgroup.fence()
            for kk in cutlass.range_constexpr(0 if self.leave_out["no_mma"] else num_kk):
                cute.gemm(tiled_mma, acc_a, tCrA[None, None, kk, a_base + parity],
                          tCrB[None, None, kk, state.index], acc_a)
            if const_expr(self.gated and not self.leave_out["no_mma"]):
                for kk in cutlass.range_constexpr(num_kk):
                    cute.gemm(tiled_mma, acc_b,
                              tCrA[None, None, kk, a_base + self.a_parity + parity],
                              tCrB[None, None, kk, state.index], acc_b)
            cute.nvgpu.warpgroup.commit_group()
            if const_expr(self.a_parity == 2):
                # The previous stage's GEMMs retired: its token rows and A buffer are free.
                cute.nvgpu.warpgroup.wait_group(1)
                cute.arch.barrier(barrier_id=reuse_barrier, number_of_threads=128)
                if kb > 0:
                    pipe.consumer_release(prev)
                    prev.advance()
            else:
                # One A buffer: this stage's GEMMs retire before the next conversion writes
                # it (the other warpgroup's conversion overlaps them).
                cute.nvgpu.warpgroup.wait_group(0)
                cute.arch.barrier(barrier_id=reuse_barrier, number_of_threads=128)
                pipe.consumer_release(state)
            state.advance()
        if const_expr(self.a_parity == 2):
            cute.nvgpu.warpgroup.wait_group(0)
            if num_k > 0:
                pipe.consumer_release(prev)
        self.epilogue(mRw, mOut, m_tile, row0, rows, thr_mma, acc_a, acc_b, math_wg)

    @cute.jit
    def dequant(self, raw: cute.Pointer, scales: cute.Pointer, stage: Int32,
                mat: cutlass.Constexpr, kb: Int32, wg_tidx: Int32, sA_vec: cute.Tensor,
                buf: Int32, math_wg: Int32):
        """This thread's share of one matrix's 64 x 128 tile of math warpgroup ``math_wg``:
        row wg_tidx // 2, K half wg_tidx % 2 (64 elements), raw bytes -> bf16 into A buffer
        ``buf``."""
        r = wg_tidx // 2
        half = wg_tidx % 2
        raw = raw.toint()
        scales = scales.toint()
        tile_row = math_wg * BLOCK_M + r                        # in the CTA's cta_rows
        row_addr = raw + ((stage * self.mats + mat) * self.cta_rows + tile_row) * self.row_bytes
        scale_row = tile_row if self.weight_format == "fp4" else 0  # FP8: one per row block
        scale_word = cute.make_tensor(
            cute.make_ptr(Int32,
                          scales + ((stage * self.mats + mat) * self.cta_rows + scale_row) * 4,
                          cute.AddressSpace.smem, assumed_align=4),
            cute.make_layout((1,)))
        if const_expr(self.weight_format == "fp4"):
            sw = scale_word[0]
            for c in cutlass.range_constexpr(2):            # 16 B = 32 codes each
                raw_words = cute.make_tensor(
                    cute.make_ptr(Int32, row_addr + half * 32 + c * 16,
                                  cute.AddressSpace.smem, assumed_align=16),
                    cute.make_layout((4,))).load()
                mult = e8m0_bf16x2((sw >> (8 * (half * 2 + c))) & 0xFF)
                for w in cutlass.range_constexpr(4):        # 8 codes -> one 16 B chunk
                    out = cute.make_rmem_tensor((4,), Int32)
                    o = fp4x8_to_bf16x8(raw_words[w], mult)
                    for i in cutlass.range_constexpr(4):
                        out[i] = o[i]
                    chunk = half * 8 + c * 4 + w
                    sA_vec[None, r, chunk, buf].store(out.load().bitcast(self.dtype))
        elif const_expr(self.weight_format == "fp8"):
            mult = e8m0_bf16x2((scale_word[0] >> (8 * (kb % 4))) & 0xFF)
            for c in cutlass.range_constexpr(4):            # 16 B = 16 codes each
                raw_words = cute.make_tensor(
                    cute.make_ptr(Int32, row_addr + half * 64 + c * 16,
                                  cute.AddressSpace.smem, assumed_align=16),
                    cute.make_layout((4,))).load()
                for h in cutlass.range_constexpr(2):        # 8 codes -> one 16 B chunk
                    out = cute.make_rmem_tensor((4,), Int32)
                    for w in cutlass.range_constexpr(2):
                        o = fp8x4_to_bf16x4(raw_words[2 * h + w], mult)
                        out[2 * w] = o[0]
                        out[2 * w + 1] = o[1]
                    sA_vec[None, r, half * 8 + c * 2 + h, buf].store(
                        out.load().bitcast(self.dtype))
        else:
            for c in cutlass.range_constexpr(8):            # 16 B = 8 bf16 each
                vals = cute.make_tensor(
                    cute.make_ptr(self.dtype, row_addr + half * 128 + c * 16,
                                  cute.AddressSpace.smem, assumed_align=16),
                    cute.make_layout((8,))).load()
                sA_vec[None, r, half * 8 + c, buf].store(vals)

    @cute.jit
    def epilogue(self, mRw: cute.Tensor, mOut: cute.Tensor, m_tile: Int32, row0: Int32,
                 rows: Int32, thr_mma: cute.ThrMma, acc_a: cute.Tensor, acc_b: cute.Tensor,
                 math_wg: Int32 = 0):
        """bf16 outputs of the tile's valid rows (SwiGLU x routing weight when gated), of
        math warpgroup ``math_wg``'s 64 output features."""
        bn = self.block_n
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((BLOCK_M, bn)))
        col0 = m_tile * self.cta_rows + math_wg * BLOCK_M
        for i in cutlass.range_constexpr(cute.size(acc_a)):
            m, n = tCcC[i][0], tCcC[i][1]
            if n < rows:
                if const_expr(self.gated):
                    h = gated_output(acc_a[i], acc_b[i], mRw[row0 + n], self.swiglu_limit)
                    mOut[row0 + n, col0 + m] = h.to(self.out_dtype)
                else:
                    mOut[row0 + n, col0 + m] = acc_a[i].to(self.out_dtype)
