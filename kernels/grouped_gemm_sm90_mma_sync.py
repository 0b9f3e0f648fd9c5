"""Grouped expert GEMM for decode tiles, warp by warp: ``algorithm="mma_sync"`` (sm_90a).

Computes exactly what ``grouped_gemm_sm90_wgmma.GroupedGemmWgmmaSm90`` computes (same launcher arguments,
same outputs, same rounding points) for tiles of at most 8 token rows:

    out[r, n] = sum_k W_e[n, k] * x[r, k]     (gated: bf16(rw[r] * swiglu(x.w1, x.w3)))

Why a second algorithm: at decode every weight byte is used by 1-8 token rows, so the work
is the weight stream and its conversion. The WGMMA kernel converts into a shared-memory A
tile that the tensor cores read back, behind fences and named barriers, in one converting
warpgroup per CTA (measured: bound by that conversion, not by HBM). Here the converted
weights never leave registers: they are the A fragments of warp-level ``mma.sync`` MMAs
(weights = M, 16 rows per warp; tokens = N = 8), and every warp is independent.

Dataflow (CTA = 4 warps = 64 weight rows of one expert and one tile of <= 8 token rows;
grid = (output features / 64, tile slots), like the WGMMA kernel), a ``num_stages``-deep
``cp.async`` ring with one CTA barrier per K block of 128 (the sm_80 multistage pattern):

1. Copies, all 16-byte and sector-complete where the format allows (per-lane 4-byte scale
   copies and per-warp token copies cost far more than their bytes; docs/performance.md):
   - weights: lane ``4g + t`` converts, of weight rows g and g + 8 of its warp (each
     matrix), the bytes of columns [32t, 32t + 32) -- one FP4 scale block. FP8 rows are
     copied whole, 4 rows per copy instruction (``fp8_row_copy``), into row-major stage
     rows (``fp8_row_slot``); FP4 and BF16 lanes read their own slots, the copies dealt so
     that each instruction reads whole 32-byte sectors (``warp_copy_unit``: BF16 rows'
     units go to a neighbour's slots, ``warp_copy_reader``). The CTA barrier of the K
     block orders copies and reads;
   - tokens: the CTA's 128 threads copy the tile's 8 token rows x 128 columns once, one
     16-byte unit each, into a stage shared by the warps, XOR-swizzled
     (``grouped_gemm_layout.warp_token_unit``; rows past the tile's count read the tile's first row,
     never stored);
   - scales: every ``warp_scale_group`` K blocks, lane q of a warp copies the FP4 scale bytes
     of its row q (16 rows per matrix) for those K blocks into the warp's scale buffers
     (FP8: one word per matrix covers 4 K blocks).
2. Each K block: ``cp.async.wait_group`` (this thread's copies of the oldest stage landed),
   a CTA barrier (everyone's landed, and everyone is done with the stage the next copy
   overwrites), the copies of the K block ``num_stages - 1`` ahead, then for each of 4 MMA
   steps the lane converts 8 codes per row to bf16 (FP4 by byte-permute lookup, FP8 by the
   shift trick, both exact, times the E8M0 scale) and issues 2 ``mma.sync.m16n8k16`` per
   matrix with f32 accumulators. The K order inside the block is permuted identically for
   weights and tokens (``grouped_gemm_layout.warp_lane_columns``), so the product is unchanged.
3. Epilogue from the accumulator fragments: rows g, g + 8 (output features), tokens
   2t, 2t + 1; SwiGLU x routing weight when gated; rows past the tile's count not written.

K split (``config.split_k`` > 1, grid z; ``choose_config`` gives it to launches of at most
two tiles of rows, and to "wgmma_rs" launches of more):
CTA z runs K blocks [z p, z p + p) (``grouped_gemm_config.split_k_blocks``: whole scale
groups); the split_k CTAs of a tile are one thread-block cluster, and CTA 0 adds the
others' f32 sums from their shared memory, in split order, before its epilogue
(``add_splits``): no partial sums leave the SMs, no second launch adds them.

Constraints: as the WGMMA kernel (K a multiple of 128, output features of 64, FP8 scale
words of 4 bytes), block_n = 8, and ``scale_group`` = ``warp_scale_group`` of the input
features (a launcher argument: K itself is a runtime value).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from .grouped_gemm_config import GroupedGemmSm90Config, split_k_blocks
from .grouped_gemm_layout import (BLOCK_K, BLOCK_M, ROW_BYTES, WARP_COUNT, WARP_ROWS,
                                  WARP_SCALE_BUFFER_BYTES, WARP_TOKEN_STAGE_BYTES,
                                  fp8_row_copy, mma_sync_fp8_unit, ring_group, ring_slot,
                                  warp_copy_reader, warp_copy_unit, warp_scale_buffers,
                                  warp_smem_bytes, warp_token_unit, warp_weight_slots,
                                  weight_offset)
from .grouped_gemm_sm90_convert import (copy_bytes, e8m0_bf16x2, fp4x8_to_bf16x8, fp8x4_to_bf16x4,
                               gated_output, mma_m16n8k16_bf16)
from .sm90_primitives import launch, load_cluster_f32x4, store_shared_f32x4

NUM_THREADS = 32 * WARP_COUNT
STEPS = 4                     # MMA steps (K = 32 each: 8 columns per lane) per K block


class GroupedGemmMmaSyncSm90:
    """Static configuration of one compiled kernel (see the module docstring)."""
    # Whether tile row r may read token row (row0 + r) / token_stride ("mma_fp8" only).
    TAKES_TOKEN_STRIDE = False

    def __init__(self, weight_format: str, gated: bool, swiglu_limit: float,
                 config: GroupedGemmSm90Config, scale_group: int, paired: bool = False,
                 token_stride: int = 1):
        if paired and gated:
            raise ValueError("GroupedGemmMmaSyncSm90: a paired launch is ungated")
        if token_stride != 1 and not self.TAKES_TOKEN_STRIDE:
            raise ValueError(f"{type(self).__name__}: token rows are read one per tile row "
                             f"(token_stride 1), got {token_stride}")
        self.token_stride = token_stride
        self.weight_format = weight_format
        self.gated = gated
        self.paired = paired
        self.mats = 2 if gated else 1
        # 64-row output blocks per CTA ("mma_fp8", "wgmma_rs": ``row_blocks``; 2 streams
        # the second block as a second matrix).
        self.row_blocks = config.row_blocks
        if config.row_blocks > 1:
            if gated:
                raise ValueError(f"{type(self).__name__}: row_blocks {config.row_blocks} "
                                 f"needs an ungated launch")
            self.mats = config.row_blocks
        self.swiglu_limit = float(swiglu_limit)
        self.num_stages = config.num_stages
        self.leaves_out = config.leaves_out
        self.split_k = config.split_k
        self.pdl = config.pdl
        self.interleaved_split = config.interleaved_split
        self.row_bytes = ROW_BYTES[weight_format]
        self.weight_layout = config.weight_layout
        self.lane_bytes = self.row_bytes // 4          # per row and K block, per lane
        self.chunks = self.lane_bytes // 16            # 16 B cp.async per row
        self.w_slots = warp_weight_slots(weight_format, gated)
        self.warp_stage_bytes = 32 * 16 * self.w_slots       # one warp's weights per stage
        # K blocks per scale copy (``warp_scale_group`` of the input features, static: the
        # kernel's shapes are not) and the buffers that needs, of those allocated.
        self.scale_group = scale_group
        self.scale_buffers = warp_scale_buffers(self.num_stages, scale_group)
        self.max_scale_buffers = warp_scale_buffers(self.num_stages)
        # Shared memory: [token ring][weight ring: stage-major, then warp][scale buffers].
        self.weights_offset = self.num_stages * WARP_TOKEN_STAGE_BYTES
        self.scales_offset = self.weights_offset + self.num_stages * WARP_COUNT * (
            self.warp_stage_bytes)
        self.smem_bytes = warp_smem_bytes(weight_format, gated, self.num_stages)
        self.dtype = cutlass.BFloat16

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, mX: cute.Tensor, mXs: cute.Tensor, mTileExpert: cute.Tensor,
                 mTileRow0: cute.Tensor, mTileRows: cute.Tensor, mWa: cute.Tensor,
                 mSa: cute.Tensor, mWb: cute.Tensor, mSb: cute.Tensor, mRw: cute.Tensor,
                 mOut: cute.Tensor, stream: cuda.CUstream):
        """The family's one signature (``grouped_gemm_sm90_launch``); ``mXs`` holds the
        token scales of "mma_fp8" and is unread here."""
        total = self.smem_bytes

        @cute.struct
        class SharedStorage:
            ring: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, total], 128]

        self.shared_storage = SharedStorage
        n_out = mWa.shape[1]
        if const_expr(self.paired):
            n_out = mWa.shape[1] + mWb.shape[1]
        grid = [n_out // (BLOCK_M * self.row_blocks), mTileExpert.shape[0], self.split_k]
        launched = self.kernel(mX, mTileExpert, mTileRow0, mTileRows, mWa, mSa, mWb, mSb, mRw,
                               mXs, mOut)
        # The splits of a tile are one cluster: they add their sums in shared memory.
        clustered = self.split_k > 1 and not self.leaves_out("no_cluster")
        launch(launched, grid, NUM_THREADS, [1, 1, self.split_k] if clustered else None,
               stream, use_pdl=bool(self.pdl))

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mX: cute.Tensor, mTileExpert: cute.Tensor, mTileRow0: cute.Tensor,
               mTileRows: cute.Tensor, mWa: cute.Tensor, mSa: cute.Tensor, mWb: cute.Tensor,
               mSb: cute.Tensor, mRw: cute.Tensor, mXs: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        m_tile, slot, split = cute.arch.block_idx()
        if const_expr(self.pdl):
            # The next launch may begin now (it waits for this one before its reads); "start":
            # this one waits for the previous kernel before reading anything.
            cute.arch.griddepcontrol_launch_dependents()
            if const_expr(self.pdl == "start"):
                cute.arch.griddepcontrol_wait()
        expert = mTileExpert[slot]
        if expert >= mWa.shape[0]:
            expert = Int32(-1)          # ids outside [0, G) are dropped, like -1
        if expert >= 0:
            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            warp = cute.arch.make_warp_uniform(tidx // 32)
            lane = tidx % 32
            base = storage.ring.data_ptr().toint()
            row0 = mTileRow0[slot]
            rows = mTileRows[slot]
            # The weight this CTA reads and its first 64-row block of it (paired: output
            # blocks past the first weight's are the second weight's).
            # (Ungated, the K loop reads no second matrix: the chosen one stands in for it;
            # with two row blocks the second "matrix" is the next 64 rows of the weight.)
            mW, mS, mW2, mS2, w_tile = mWa, mSa, mWb, mSb, m_tile
            if const_expr(self.paired):
                mW, mS, w_tile = self.paired_weight(mWa, mSa, mWb, mSb, m_tile)
                mW2, mS2 = mW, mS
            if const_expr(self.row_blocks > 1):
                w_tile = w_tile * self.row_blocks
                mW2, mS2 = self.next_row_block(mW, mS)
            # First weight row (of [E * N]) of this warp's 16.
            w_row = expert * mW.shape[1] + w_tile * BLOCK_M + warp * WARP_ROWS
            acc = cute.make_rmem_tensor((4 * self.mats,), Float32)
            acc.fill(0.0)
            kb0, kb1 = self.k_blocks(mX.shape[1] // BLOCK_K, split)
            self.k_loop(acc, mX, mXs, mW, mS, mW2, mS2, expert, w_tile, w_row, row0, rows,
                        kb0, kb1, base, warp, tidx)
            self.finish(acc)
            # Ablations: "no_reduce" keeps the cluster launch but not its sums, "no_cluster"
            # neither (every split then writes its own partial outputs).
            if const_expr(self.split_k > 1 and not self.leaves_out("no_reduce")
                          and not self.leaves_out("no_cluster")):
                self.add_splits(acc, base, split, tidx)
                if split == 0:
                    self.epilogue(mRw, mOut, m_tile, warp, row0, rows, lane, acc)
            else:
                self.epilogue(mRw, mOut, m_tile, warp, row0, rows, lane, acc)

    @cute.jit
    def paired_weight(self, mWa: cute.Tensor, mSa: cute.Tensor, mWb: cute.Tensor,
                      mSb: cute.Tensor, m_tile: Int32):
        """A paired launch's output block ``m_tile``: ``(weight, scales, block in it)`` --
        ``mWa``'s blocks first, then ``mWb``'s. Both are [G, N_i, row bytes] in one format
        (scales [G, N_i / 128, K / 128] or [G, N_i, K / 32]); the K loop reads only their
        base addresses and N, so the chosen pair is rebuilt from those."""
        tiles_a = mWa.shape[1] // (BLOCK_M * self.row_blocks)
        w_addr, s_addr = mWa.iterator.toint(), mSa.iterator.toint()
        n, scale_rows, w_tile = Int32(mWa.shape[1]), Int32(mSa.shape[1]), m_tile
        if m_tile >= tiles_a:
            w_addr, s_addr = mWb.iterator.toint(), mSb.iterator.toint()
            n, scale_rows, w_tile = mWb.shape[1], mSb.shape[1], m_tile - tiles_a
        groups, row_bytes, scale_cols = mWa.shape[0], mWa.shape[2], mSa.shape[2]
        weight = cute.make_tensor(
            cute.make_ptr(cutlass.Uint8, w_addr, cute.AddressSpace.gmem, assumed_align=16),
            cute.make_layout((groups, n, row_bytes), stride=(n * row_bytes, row_bytes, 1)))
        scales = cute.make_tensor(
            cute.make_ptr(cutlass.Uint8, s_addr, cute.AddressSpace.gmem, assumed_align=4),
            cute.make_layout((groups, scale_rows, scale_cols),
                             stride=(scale_rows * scale_cols, scale_cols, 1)))
        return weight, scales, w_tile

    @cute.jit
    def next_row_block(self, mW: cute.Tensor, mS: cute.Tensor):
        """``row_blocks`` 2: the weight and scales as seen from BLOCK_M rows further on, so
        that the second "matrix" of the K loop is the CTA's second row block. FP4 scales
        are per row ([G, N, K / 32] bytes); FP8 scales are per 128 x 128 block, which holds
        both of the CTA's (its first block is even), so they are the same."""
        weight = cute.make_tensor(
            cute.make_ptr(cutlass.Uint8, mW.iterator.toint() + BLOCK_M * mW.shape[2],
                          cute.AddressSpace.gmem, assumed_align=16), mW.layout)
        scales = mS
        if const_expr(self.weight_format == "fp4"):
            scales = cute.make_tensor(
                cute.make_ptr(cutlass.Uint8, mS.iterator.toint() + BLOCK_M * mS.shape[2],
                              cute.AddressSpace.gmem, assumed_align=4), mS.layout)
        return weight, scales

    @cute.jit
    def add_splits(self, acc: cute.Tensor, base: Int32, split: Int32, tidx: Int32):
        """K split: the cluster's CTA 0 adds the other splits' sums to ``acc``, in split
        order (repeatable bit for bit). Each CTA leaves its sums at the start of its ring
        (every warp is done with it after the CTA barrier); CTA 0 reads them through
        distributed shared memory between two cluster barriers (the second keeps the
        others resident until it has read them)."""
        cute.arch.barrier()
        own = base + tidx * (16 * self.mats)
        for mat in cutlass.range_constexpr(self.mats):
            store_shared_f32x4(own + 16 * mat, [acc[4 * mat + j] for j in range(4)])
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if split == 0:
            for z in cutlass.range_constexpr(1, self.split_k):
                for mat in cutlass.range_constexpr(self.mats):
                    part = load_cluster_f32x4(own + 16 * mat, Int32(z))
                    for j in cutlass.range_constexpr(4):
                        acc[4 * mat + j] = acc[4 * mat + j] + part[j]
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    @cute.jit
    def k_loop(self, acc: cute.Tensor, mX: cute.Tensor, mXs: cute.Tensor, mWa: cute.Tensor,
               mSa: cute.Tensor, mWb: cute.Tensor, mSb: cute.Tensor, expert: Int32,
               m_tile: Int32, w_row: Int32, row0: Int32, rows: Int32, kb0: Int32, kb1: Int32,
               base: Int32, warp: Int32, tidx: Int32):
        """K blocks [kb0, kb1) into ``acc``: the cp.async ring, one CTA barrier per block;
        the token hooks (``first_tokens``, ``tokens_ahead``) run between that barrier and
        the block's MMAs."""
        lane = tidx % 32
        for s in cutlass.range_constexpr(self.num_stages - 1):
            if kb0 + s < kb1:
                self.issue(mX, mXs, mWa, mSa, mWb, mSb, expert, m_tile, w_row, row0,
                           rows, kb0 + s, base, warp, tidx)
            cute.arch.cp_async_commit_group()
        tokens = self.first_tokens(mX, mXs, row0, rows, kb0, kb1, base, tidx)
        for kb in cutlass.range(kb0, kb1, unroll=1):
            cute.arch.cp_async_wait_group(self.num_stages - 2)
            # Ablation "no_barrier": the block's CTA barrier left out (warps then race the
            # copies into stages others still read).
            if const_expr(not self.leaves_out("no_barrier")):
                cute.arch.barrier()
            ahead = kb + self.num_stages - 1
            if ahead < kb1:
                self.issue(mX, mXs, mWa, mSa, mWb, mSb, expert, m_tile, w_row, row0,
                           rows, ahead, base, warp, tidx)
            cute.arch.cp_async_commit_group()
            tokens = self.tokens_ahead(tokens, mX, mXs, row0, rows, kb, kb1, base, tidx)
            self.compute(acc, base, kb, warp, lane)
        cute.arch.cp_async_wait_group(0)

    def first_tokens(self, mX, mXs, row0, rows, kb0, kb1, base, tidx):
        """Hook before the K loop; returns the state ``tokens_ahead`` carries. Here the
        token rows travel with the weights' copies (``issue``): a placeholder."""
        return Int32(0)

    def tokens_ahead(self, tokens, mX, mXs, row0, rows, kb, kb1, base, tidx):
        """Hook of K block ``kb``, after its barrier, before its MMAs ("mma_fp8" quantises
        the next block's rows there)."""
        return tokens

    @cute.jit
    def k_blocks(self, num_k: Int32, split: Int32):
        """This CTA's K blocks ``[kb0, kb1)``: all of them, or its split's (starting a scale
        group: ring and scale-buffer positions are kb's own, not relative)."""
        kb0 = Int32(0)
        kb1 = num_k
        if const_expr(self.split_k > 1):
            per = split_k_blocks(num_k, self.split_k, self.scale_group)
            kb0 = split * per
            kb1 = num_k if num_k < kb0 + per else kb0 + per
        return kb0, kb1

    @cute.jit
    def k_read(self, kb: Int32, num_k: Int32):
        """The K block whose bytes the loop's block ``kb`` reads: ``kb`` itself, or with
        ``interleaved_split`` split z's j-th block ``z + split_k j`` (its range [z per,
        (z + 1) per) then numbers the blocks it computes; per = num_k / split_k)."""
        if const_expr(not self.interleaved_split):
            return kb
        _, _, z = cute.arch.block_idx()
        return kb * self.split_k - z * (num_k - 1)

    def token_stage(self, base, kb):
        return base + ring_slot(kb, self.num_stages) * WARP_TOKEN_STAGE_BYTES

    def weight_stage(self, base, kb, warp):
        return (base + self.weights_offset
                + (ring_slot(kb, self.num_stages) * WARP_COUNT + warp) * self.warp_stage_bytes)

    def scale_buffer(self, base, kb, warp):
        return (base + self.scales_offset
                + (warp * self.max_scale_buffers
                   + ring_slot(ring_group(kb, self.scale_group), self.scale_buffers))
                * WARP_SCALE_BUFFER_BYTES)

    @cute.jit
    def issue(self, mX: cute.Tensor, mXs: cute.Tensor, mWa: cute.Tensor, mSa: cute.Tensor,
              mWb: cute.Tensor, mSb: cute.Tensor, expert: Int32, m_tile: Int32, w_row: Int32,
              row0: Int32, rows: Int32, kb: Int32, base: Int32, warp: Int32, tidx: Int32):
        """This thread's cp.async copies of K block ``kb`` (see the module docstring;
        ``mXs``, the activation scales of "mma_fp8", is not read)."""
        lane = tidx % 32
        n_out = mWa.shape[1]
        k_in = mX.shape[1]
        num_k = k_in // BLOCK_K
        # Token rows bypass L1 too: the CTA shares them through shared memory.
        copy_16 = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), cutlass.Uint8,
            num_bits_per_copy=128)
        # Ablations: a kind of copy only for the first stages (the ring then holds stale
        # bytes that are still converted and multiplied).
        first_stages = kb < self.num_stages
        load = first_stages if const_expr(self.leaves_out("no_load")) else True
        load_scales = first_stages if const_expr(self.leaves_out("no_scale_load")) else True
        load_tokens = first_stages if const_expr(self.leaves_out("no_token_load")) else True
        if load:
            self.issue_weights(mWa, mWb, w_row, kb, self.weight_stage(base, kb, warp), k_in,
                               lane)
        # Tokens: thread tidx copies unit tidx % 16 of tile row tidx // 16.
        r, unit = tidx // 16, tidx % 16
        x_row = row0 + r
        if r >= rows:
            x_row = row0
        src = mX.iterator.toint() + (x_row.to(Int64) * k_in
                                     + self.k_read(kb, num_k) * BLOCK_K + 8 * unit) * 2
        dst = self.token_stage(base, kb) + r * (BLOCK_K * 2) + warp_token_unit(r, unit) * 16
        if load_tokens:
            copy_bytes(copy_16, 16, src, dst)
        if const_expr(self.weight_format != "bf16"):
            if ring_slot(kb, self.scale_group) == 0:
                if load_scales:
                    self.issue_scales(mSa, mSb, n_out, expert, m_tile, w_row, kb, num_k,
                                      self.scale_buffer(base, kb, warp), lane)

    @cute.jit
    def issue_weights(self, mWa: cute.Tensor, mWb: cute.Tensor, w_row: Int32, kb: Int32,
                      stage: Int32, k_in: Int32, lane: Int32):
        """This lane's 16-byte copies of K block ``kb`` of the warp's weight rows. FP8: whole
        128-byte rows per copy instruction (``fp8_row_copy``) into ``fp8_row_slot``. FP4 and
        BF16: lane 4g + t copies units ``warp_copy_unit(t, c)`` of rows g and g + 8 of each
        matrix (whole sectors per copy instruction) to ``copy_slot``."""
        g, t = lane // 4, lane % 4
        num_k = k_in // BLOCK_K
        kb_read = self.k_read(kb, num_k)
        # 16-byte copies bypass L1 (.cg): no SM reads a weight byte twice.
        copy_16 = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), cutlass.Uint8,
            num_bits_per_copy=128)
        for mat in cutlass.range_constexpr(self.mats):
            w_base = (mWa if mat == 0 else mWb).iterator.toint()
            if const_expr(self.weight_format == "fp8"):
                for i in cutlass.range_constexpr(WARP_ROWS // 4):
                    r, unit = fp8_row_copy(lane, i)
                    src = w_base + weight_offset((w_row + r).to(Int64), kb_read, num_k,
                                                 self.row_bytes, self.weight_layout) + unit * 16
                    copy_bytes(copy_16, 16, src, self.fp8_row_slot(stage, mat, r, unit))
            else:
                for half in cutlass.range_constexpr(2):             # rows g and g + 8
                    row = (w_row + g + 8 * half).to(Int64)
                    at = w_base + weight_offset(row, kb_read, num_k, self.row_bytes,
                                                self.weight_layout)
                    for c in cutlass.range_constexpr(self.chunks):
                        src = at + warp_copy_unit(t, c) * 16
                        copy_bytes(copy_16, 16, src,
                                   self.copy_slot(stage, mat, half, c, lane))

    def copy_slot(self, stage, mat, half, chunk, lane):
        """Where lane 4g + t's copy ``chunk`` of row g + 8 ``half`` of ``mat`` goes (FP4,
        BF16): the slot of the lane that converts that unit (``warp_copy_reader``)."""
        g, t = lane // 4, lane % 4
        reader, reader_chunk = warp_copy_reader(warp_copy_unit(t, chunk), self.chunks)
        return self.weight_slot(stage, mat, half, reader_chunk, 4 * g + reader)

    def weight_slot(self, stage, mat, half, chunk, lane):
        """Shared address of the lane's 16-byte ``chunk`` of row g + 8 ``half`` of ``mat``:
        FP4 and BF16, its own slots, read back by itself only; FP8, unit ``t chunks + chunk``
        of the row (``fp8_row_slot``)."""
        if const_expr(self.weight_format == "fp8"):
            g, t = lane // 4, lane % 4
            return self.fp8_row_slot(stage, mat, g + 8 * half, t * self.chunks + chunk)
        return stage + (((mat * 2 + half) * self.chunks + chunk) * 32 + lane) * 16

    def fp8_row_slot(self, stage, mat, row, unit):
        """FP8: 16-byte ``unit`` of warp row ``row`` (0-15) of ``mat`` in a stage: rows of
        128 bytes, row-major, units swizzled (``mma_sync_fp8_unit``)."""
        return (stage + (mat * WARP_ROWS + row) * self.row_bytes
                + mma_sync_fp8_unit(row, unit) * 16)

    @cute.jit
    def issue_scales(self, mSa: cute.Tensor, mSb: cute.Tensor, n_out: Int32, expert: Int32,
                     m_tile: Int32, w_row: Int32, kb: Int32, num_k: Int32, buffer: Int32,
                     lane: Int32):
        """Scales of the group of K blocks starting at ``kb``: FP4, lane q its row q % 16 of
        matrix q // 16 (4 bytes per K block); FP8, lane ``mat`` the matrix's word."""
        nbytes = 4 * self.scale_group if const_expr(self.weight_format == "fp4") else 4
        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL)
            if const_expr(nbytes == 16) else cpasync.CopyG2SOp(), cutlass.Uint8,
            num_bits_per_copy=8 * nbytes)
        mat = lane // WARP_ROWS
        if mat < self.mats:
            s_base = mSa.iterator.toint()
            if mat == 1:
                s_base = mSb.iterator.toint()
            if const_expr(self.weight_format == "fp4" and self.interleaved_split):
                # The group's K blocks lie split_k apart: a word each.
                row = (w_row + lane % WARP_ROWS).to(Int64)
                word = cute.make_copy_atom(cpasync.CopyG2SOp(), cutlass.Uint8,
                                           num_bits_per_copy=32)
                for i in cutlass.range_constexpr(self.scale_group):
                    copy_bytes(word, 4, s_base + row * (num_k * 4)
                               + self.k_read(kb + i, num_k) * 4, buffer + lane * 16 + 4 * i)
            elif const_expr(self.weight_format == "fp4"):
                row = (w_row + lane % WARP_ROWS).to(Int64)
                copy_bytes(atom, nbytes, s_base + row * (num_k * 4) + kb * 4,
                           buffer + lane * 16)
            elif lane % WARP_ROWS == 0:
                # One 128 x 128 scale block for all 16 rows; byte kb % 4 of the word.
                blk_row = (expert * (n_out // 128) + m_tile // 2).to(Int64)
                copy_bytes(atom, 4, s_base + blk_row * num_k + kb, buffer + mat * 4)

    @cute.jit
    def compute(self, acc: cute.Tensor, base: Int32, kb: Int32, warp: Int32, lane: Int32):
        """Convert this lane's weight bytes of K block ``kb`` and run its 8 MMAs per matrix."""
        g, t = lane // 4, lane % 4
        stage = self.weight_stage(base, kb, warp)
        scales = self.scale_buffer(base, kb, warp)
        in_group = ring_slot(kb, self.scale_group)
        words = []            # per (matrix, row half): the lane's weight words
        mults = []            # per (matrix, row half): bf16x2 scale multiplier
        for mat in cutlass.range_constexpr(self.mats):
            for half in cutlass.range_constexpr(2):
                row_words = []
                for c in cutlass.range_constexpr(self.chunks):
                    vec = _load_words(self.weight_slot(stage, mat, half, c, lane))
                    row_words += [vec[j] for j in range(4)]
                words.append(row_words)
                if const_expr(self.weight_format == "fp4"):
                    # Row g + 8 half of matrix mat: its scale bytes of this K block.
                    scale = _load_word(scales + (mat * WARP_ROWS + g + 8 * half) * 16
                                       + in_group * 4)
                    mults.append(e8m0_bf16x2((scale >> (8 * t)) & 0xFF))
                elif const_expr(self.weight_format == "fp8"):
                    scale = _load_word(scales + mat * 4)
                    mults.append(e8m0_bf16x2((scale >> (8 * in_group)) & 0xFF))
        tokens = self.token_stage(base, kb)
        for i in cutlass.range_constexpr(STEPS):
            # Columns 32t + 8i .. + 7 of token row g: unit 4t + i of the row.
            x = _load_words(tokens + g * (BLOCK_K * 2) + warp_token_unit(g, 4 * t + i) * 16)
            for mat in cutlass.range_constexpr(self.mats):
                # (c0 c1, c2 c3, c4 c5, c6 c7) of rows g and g + 8: bf16 pairs.
                pairs = [self.codes_to_bf16(words[mat * 2 + half], mults, mat * 2 + half, i)
                         for half in range(2)]
                for h in cutlass.range_constexpr(2):
                    a = (pairs[0][2 * h], pairs[1][2 * h], pairs[0][2 * h + 1],
                         pairs[1][2 * h + 1])
                    c = tuple(acc[4 * mat + j] for j in range(4))
                    b = (x[2 * h], x[2 * h + 1])
                    if const_expr(self.leaves_out("no_mma")):
                        # Keeps the operands live at one integer op + one convert per value.
                        d = [c[j] + (a[j] ^ b[j % 2]).to(Float32) for j in range(4)]
                    else:
                        d = mma_m16n8k16_bf16(a, b, c)
                    for j in cutlass.range_constexpr(4):
                        acc[4 * mat + j] = d[j]

    def finish(self, acc: cute.Tensor):
        """Hook before the epilogue (``grouped_gemm_sm90_mma_fp8`` rescales there)."""

    def codes_to_bf16(self, row_words, mults, q, step):
        """The 8 codes of MMA step ``step`` (one row) as four bf16 pairs, in column order."""
        if const_expr(self.leaves_out("no_dequant")):
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
        col0 = m_tile * BLOCK_M * self.row_blocks + warp * WARP_ROWS + g
        for j in cutlass.range_constexpr(4):
            n = 2 * t + j % 2                    # token row of accumulator j
            col = col0 + 8 * (j // 2)            # weight row = output feature
            if n < rows:
                if const_expr(self.gated):
                    h = gated_output(acc[j], acc[4 + j], mRw[row0 + n], self.swiglu_limit)
                    mOut[row0 + n, col] = h.to(self.dtype)
                else:
                    for b in cutlass.range_constexpr(self.row_blocks):
                        mOut[row0 + n, col + BLOCK_M * b] = acc[4 * b + j].to(self.dtype)


def _load_words(addr):
    """Four 32-bit words from a 16-byte aligned shared-memory address."""
    return cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.smem,
                                          assumed_align=16), cute.make_layout((4,))).load()


def _load_word(addr):
    return cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.smem,
                                          assumed_align=4), cute.make_layout((1,)))[0]
