"""Sparse MQA attention with a per-head sink for Hopper (sm_90a), in CuTe DSL.

One CTA owns one query token ``t``, one block of 64 heads ``hb`` and one split ``s`` of the
token's entry list (flash-decoding). The entry list is the concatenation of the ``K`` window
indices ``idx[t]`` (rows of ``kv``) and the ``K2`` compressed indices ``extra_idx[t]`` (rows of
``extra_kv``); every index outside its pool is an unused slot. With ``has_extra_len`` a
token's extra slots at or past ``extra_len[t]`` are unused too, and its CTAs' block loop
stops there (an HCA query in a long cache gathers and multiplies only its visible entries).

Dataflow (384 threads: a producer warpgroup WG0 and two math warpgroups WG1, WG2):

1. Gather (WG0, 72 registers). ``cp.async`` (16 B per thread, two 256 B row halves per warp
   instruction) brings Q[t, 64 heads, 512] and then each block of ``block_n`` entries into
   a 128B-swizzled K-major tile: entry ``j`` is one 1 KB row of ``kv`` or ``extra_kv``; an
   unused slot fetches row 0 of ``kv`` and is masked through a per-stage validity vector.
   ``num_stages`` tiles form an mbarrier pipeline (full: the copies of a block landed;
   empty: both math warpgroups are done with it). Indices are read one block ahead.
   With ``extra_fp8`` the second pool holds 584-byte FP8 entry rows (``dsv4_jax.kv_entry``):
   their bytes are copied into the same tile and widened to BF16 in place by the producer
   before the block is committed, one block behind its copies (``Fp8EntryGather``), so the
   math warpgroups see exactly the BF16 rows the rows encode.
   With ``q_prep`` the producer copies no Q: the math warpgroups load it, apply the heads'
   RMSNorm and the RoPE of its last 64 channels and write the tile (``QueryRope``).
2. S = Q K^T (WGMMA m64 x block_n, A = Q and B = entries from smem), in one of two ways:
   * split (``qk_split``; the default without flash-decoding splits or FP8 rows, refused with
     those: it would deadlock against their late commit): math warpgroup w
     multiplies head_dim slice [256w, 256w + 256) only, stores its fp32 partial block in smem
     and adds the other's (named barriers: both written, each buffer read), so QK^T is done
     once. Both warpgroups then hold bitwise-identical scores. The next block's partial QK^T
     is issued right behind this block's P.V, so the tensor pipe runs the two back to back.
   * duplicated: each math warpgroup computes the whole block's scores (QK^T done twice)
     and the two never exchange anything; their GEMM issues are ordered ping-pong (named
     barriers), so one warpgroup's softmax overlaps the other's GEMMs. Faster when each CTA
     has only a few blocks (flash-decoding splits).
3. Online softmax in the log2 domain, rows complete inside each warpgroup (both compute the
   same statistics). P = 2^(s - m) is cast to bf16 (the reference's numerics) straight into
   the A-operand registers of the next GEMM (the WGMMA C and A register layouts line up for
   16-bit types).
4. O += P V (WGMMA, A = P from registers, B = the same entry tile viewed MN-major: keys are
   values). Math warpgroup w owns output columns [256w, 256w + 256): 64 x 256 fp32.
5. Epilogue. Without a split the sink joins the denominator and ``o`` (bf16) and ``lse`` are
   written. With ``num_splits > 1`` each CTA writes its split's normalised fp32 partial and
   its lse, and a second kernel launched by the same launcher merges the splits. Output
   tiles go through the (then idle) stage buffers so that global stores are 16 B chunks
   (``OutputEpilogue``). With ``q_prep`` the output's last 64 channels are rotated back
   before their bf16 store, in the epilogue or the merge.

Constraints:
* sm_90a (WGMMA, setmaxnreg, cp.async); bf16 only; head_dim == 512.
* num_heads a multiple of 64 (64 heads per CTA; H=128 runs two CTAs per token, which read the
  same entries, the second mostly from L2).
* K >= 1 window slots; K2 >= 0 extra slots; pools of at least one row each; int32 indices;
  ``extra_len`` (with ``has_extra_len``) int32 [T], any value (clamped to 0 .. K2);
  an FP8 second pool is uint8 [M, 584] (448 e4m3 codes, 64 BF16 RoPE dims, 7 E8M0 scales).
* (block_n, num_stages, qk_split) in ``sparse_attention_config.CONFIGS``: the stages, Q and
  (split) the 2 x 64 x block_n fp32 score exchange fit in 227 KB of smem; split QK^T needs
  head_dim / 16 even.
* Any number of tokens T <= 65535; the entry list is processed in blocks (tail masked).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .sm90_primitives import copy16, cp_async_arrive, half_warp_rows, row_copy_atom
from .sparse_attention_sm90_combine import SplitCombine
from .sparse_attention_sm90_epilogue import LOG2_E, OutputEpilogue
from .sparse_attention_sm90_fp8 import Fp8EntryGather
from .sparse_attention_sm90_rope import QueryRope
from .sparse_attention_config import (DEFAULT_CONFIG, FP8_ENTRY_BYTES, HEAD_BLOCK, HEAD_DIM,
                                    SMEM_BYTES, SparseAttentionSm90Config)

NUM_THREADS = 384               # producer warpgroup + two math warpgroups
PRODUCER_REGS, MATH_REGS = 72, 216
# setmaxnreg.inc blocks until the registers released by .dec are free: the CTA holds
# 384 x 168 at launch, so producer + 2 x math must stay within 3 x 168 (64/224 hangs). Below
# 72 the producer spills with dynamic shapes; 216 is enough for the math warpgroups.
assert PRODUCER_REGS + 2 * MATH_REGS <= 3 * (65536 // NUM_THREADS // 8 * 8)
ORDER_BARRIER = 1               # named barriers 1 and 2: GEMM issue turns of WG1 and WG2
JOIN_BARRIER = 3                # both math warpgroups done with the stages
FULL_BARRIER = 6                # split QK^T: both partial score blocks are in smem
EMPTY_BARRIER = 7               # 7 and 8: warpgroup w's exchange buffer was read
# named barriers 4 and 5: the output tiles (sparse_attention_sm90_epilogue); 9: the
# producer's FP8 copies of a block landed (sparse_attention_sm90_fp8); 10: the prepared Q
# tile (sparse_attention_sm90_rope)


class SparseAttentionSm90(SplitCombine, Fp8EntryGather, QueryRope, OutputEpilogue):
    """Static configuration of one compiled kernel (see the module docstring)."""

    def __init__(self, num_heads: int, softmax_scale: float, num_splits: int = 1,
                 has_extra: bool = True, ablation: str = "", block_n: int = 64,
                 num_stages: int = 2, qk_split: bool = False, extra_fp8: bool = False,
                 has_extra_len: bool = False, q_prep: bool = False, norm_eps: float = 0.0):
        # raises ValueError for a configuration (or ablation) the kernel does not offer
        config = SparseAttentionSm90Config(block_n, num_stages, qk_split, ablation)
        assert config.smem_bytes() <= SMEM_BYTES
        if qk_split and extra_fp8 and has_extra:
            raise ValueError("SparseAttentionSm90: qk_split=True with an FP8 second pool "
                             "would deadlock (see SparseAttentionSm90Config.is_supported)")
        self.qk_split = qk_split
        self.ablation = ablation
        self.num_heads = num_heads
        self.num_head_blocks = num_heads // HEAD_BLOCK
        self.scale_log2 = float(softmax_scale) * LOG2_E
        self.num_splits = num_splits
        self.has_extra = has_extra
        self.extra_fp8 = extra_fp8 and has_extra
        self.has_extra_len = has_extra_len and has_extra
        self.block_n = block_n
        self.num_stages = num_stages
        self.q_prep = q_prep
        self.norm_eps = float(norm_eps)
        self.dtype = cutlass.BFloat16

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor,
                 mXKV: cute.Tensor, mXIdx: cute.Tensor, mXLen: cute.Tensor,
                 mSink: cute.Tensor, mCos: cute.Tensor, mSin: cute.Tensor, mO: cute.Tensor,
                 mLse: cute.Tensor, mOPart: cute.Tensor, mLsePart: cute.Tensor,
                 stream: cuda.CUstream):
        bn, stages = self.block_n, self.num_stages
        # S = Q K^T: 64 heads x block_n entries, K = head_dim, both operands from smem.
        tiled_mma_s = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
            (1, 1, 1), (HEAD_BLOCK, bn))
        # O += P V: 64 heads x 256 columns, K = entries; P from registers, V = the entry
        # tile read MN-major (head_dim contiguous), so keys and values share one smem tile.
        tiled_mma_o = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
            (1, 1, 1), (HEAD_BLOCK, HEAD_DIM // 2), warpgroup.OperandSource.RMEM)
        sQ_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (HEAD_BLOCK, bn, HEAD_DIM), self.dtype, 1)
        # Entries as S's B operand: (N = entries, K = head_dim), K-major ...
        sK_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (HEAD_BLOCK, bn, HEAD_DIM), self.dtype, stages)
        # ... and the same bytes as O's B operand: (N = head_dim, K = entries), MN-major. Both
        # tile a 128B-swizzled 8 x 64 atom entries-first, so sV(d, n) == sK(n, d).
        sV_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.COL_MAJOR, (HEAD_BLOCK, HEAD_DIM, bn), self.dtype, stages)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[Int64, 2 * stages]
            sValid: cute.struct.MemRange[Int32, bn * stages]
            sScale: cute.struct.MemRange[Int64, bn * stages]     # FP8 rows' scale words
            sQ: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            # Split QK^T: each math warpgroup's fp32 partial score block.
            sX: cute.struct.Align[cute.struct.MemRange[
                Float32, 2 * HEAD_BLOCK * bn if self.qk_split else 4], 128]

        self.shared_storage = SharedStorage
        num_tokens = mQ.shape[0]
        self.kernel(mQ, mKV, mIdx, mXKV, mXIdx, mXLen, mSink, mCos, mSin, mO, mLse, mOPart,
                    mLsePart, tiled_mma_s, tiled_mma_o, sQ_layout, sK_layout,
                    sV_layout).launch(
            grid=[self.num_splits, self.num_head_blocks, num_tokens],
            block=[NUM_THREADS, 1, 1], stream=stream, min_blocks_per_mp=1)
        if const_expr(self.num_splits > 1):
            rows = num_tokens * self.num_heads
            self.combine_kernel(mSink, mCos, mSin, mO, mLse, mOPart, mLsePart).launch(
                grid=[(rows + 3) // 4, 1, 1], block=[128, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor,
               mXKV: cute.Tensor, mXIdx: cute.Tensor, mXLen: cute.Tensor, mSink: cute.Tensor,
               mCos: cute.Tensor, mSin: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor,
               mOPart: cute.Tensor, mLsePart: cute.Tensor, tiled_mma_s: cute.TiledMma,
               tiled_mma_o: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        split, hb, t = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        bn = self.block_n

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(cute.slice_(sQ_layout.outer, (None, None, 0)),
                                   swizzle=sQ_layout.inner)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        sValid = storage.sValid.get_tensor(cute.make_layout((bn, self.num_stages)))
        kv_pipe = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar.data_ptr(), num_stages=self.num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 256))

        num_window = mIdx.shape[1]
        num_extra = Int32(0)
        if const_expr(self.has_extra):
            num_extra = mXIdx.shape[1]
            if const_expr(self.has_extra_len):
                # This token's used extra slots lie below its bound: the blocks past it are
                # never gathered nor multiplied (splits past it are empty: lse = -inf).
                num_extra = cutlass.max(cutlass.min(mXLen[t], num_extra), 0)
        num_blocks = (num_window + num_extra + bn - 1) // bn
        per_split = (num_blocks + self.num_splits - 1) // self.num_splits
        blk_begin = split * per_split
        n_local = cutlass.max(cutlass.min(blk_begin + per_split, num_blocks) - blk_begin, 0)

        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.produce(mQ, mKV, mIdx, mXKV, mXIdx, t, hb, blk_begin, n_local, num_window,
                         num_extra, sQ, sK, sValid, kv_pipe, tidx,
                         storage.sKV.data_ptr().toint(), storage.sScale.data_ptr().toint())
        else:
            cute.arch.setmaxregister_increase(MATH_REGS)
            if const_expr(self.q_prep):
                self.prepare_q(mQ, mCos, mSin, t, hb, sQ, tidx - 128)
            self.consume(mSink, mCos, mSin, mO, mLse, mOPart, mLsePart, t, hb, split, n_local,
                         wg - 1, tidx % 128, sQ, sK, sV, sValid, kv_pipe, tiled_mma_s,
                         tiled_mma_o, storage.sKV.data_ptr(), storage.sX.data_ptr())

    @cute.jit
    def produce(self, mQ: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor,
                mXKV: cute.Tensor, mXIdx: cute.Tensor, t: Int32, hb: Int32, blk_begin: Int32,
                n_local: Int32, num_window: Int32, num_extra: Int32, sQ: cute.Tensor,
                sK: cute.Tensor, sValid: cute.Tensor, kv_pipe: pipeline.PipelineAsync,
                tidx: Int32, tile: Int32, scales: Int32):
        """WG0: gather Q and the entry blocks with cp.async into the pipeline stages (FP8
        rows of the second pool: copied, then widened in place; ``Fp8EntryGather``)."""
        bn = self.block_n
        atom_cp = row_copy_atom(self.dtype)
        # A warp instruction covers two 256 B row segments; thread (warp w, lane l) copies
        # rows 2 (w + 4 i) + l // 16 and 16 B chunks l % 16 + 16 c of them.
        row0, chunk0 = half_warp_rows(tidx)
        sK_vec = cute.flat_divide(sK, (1, 8))[0, None, None, None, None]
        sQ_vec = cute.flat_divide(sQ, (1, 8))[0, None, None, None]

        if const_expr(not self.q_prep):     # else the math warpgroups write Q (QueryRope)
            q_base = mQ.iterator.toint() + (t * self.num_heads + hb * HEAD_BLOCK).to(Int64) * (
                HEAD_DIM * 2)
            for i in cutlass.range_constexpr(HEAD_BLOCK // 8):
                for c in cutlass.range_constexpr(4):
                    copy16(atom_cp, self.dtype,
                           q_base + ((row0 + 8 * i) * HEAD_DIM + (chunk0 + 16 * c) * 8).to(
                               Int64) * 2,
                           sQ_vec[None, row0 + 8 * i, chunk0 + 16 * c])

        rIdx = cute.make_rmem_tensor((bn // 8,), Int32)
        rXIdx = cute.make_rmem_tensor((bn // 8,), Int32)
        self.read_indices(mIdx, mXIdx, t, blk_begin, num_window, num_extra, row0, rIdx, rXIdx)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                             self.num_stages)
        # FP8 pool: a block is committed one iteration late, once its copies landed and its
        # code chunks were widened (``done``: the oldest uncommitted block; ``pending``: its
        # FP8 rows, bit i for this thread's row row0 + 8 i), so that the next block's copies
        # are in flight meanwhile.
        done = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                            self.num_stages)
        pending = Int32(0)
        kv_base = mKV.iterator.toint()
        for j in cutlass.range(n_local, unroll=1):
            kv_pipe.producer_acquire(state)
            stage = state.index
            blk = blk_begin + j
            issue = True
            if const_expr(self.ablation == "no_gather"):
                issue = j < self.num_stages
            fp8_rows = Int32(0)
            for i in cutlass.range_constexpr(bn // 8):
                row = row0 + 8 * i
                pos = blk * bn + row
                g = rIdx[i]
                valid = pos < num_window and g >= 0 and g < mKV.shape[0]
                addr = kv_base + (g.to(Int64) * (HEAD_DIM * 2) if valid else Int64(0))
                xvalid = False
                if const_expr(self.has_extra):
                    gx = rXIdx[i]
                    xvalid = self.extra_valid(pos, gx, num_window, num_extra, mXKV)
                    if const_expr(not self.extra_fp8):
                        if xvalid:
                            addr = mXKV.iterator.toint() + gx.to(Int64) * (HEAD_DIM * 2)
                    valid = valid or xvalid
                if chunk0 == 0:
                    sValid[row, stage] = Int32(1) if valid else Int32(0)
                if const_expr(self.extra_fp8):
                    if xvalid:
                        fp8_rows = fp8_rows | (1 << i)
                        if issue:
                            self.issue_fp8_row(
                                mXKV.iterator.toint() + gx.to(Int64) * FP8_ENTRY_BYTES,
                                tile, scales, stage, row, chunk0)
                    elif issue:
                        self.copy_row(atom_cp, addr, sK_vec, row, chunk0, stage)
                elif issue:
                    self.copy_row(atom_cp, addr, sK_vec, row, chunk0, stage)
            if const_expr(self.extra_fp8):
                cute.arch.cp_async_commit_group()
                if j > 0:
                    self.finish_fp8_block(kv_pipe, done, pending, tile, scales, row0, chunk0, 1)
                    done.advance()
                pending = fp8_rows
            else:
                # The barrier phase completes once every producer thread's copies landed and
                # its validity stores are released.
                cp_async_arrive(kv_pipe.producer_get_barrier(state))
                kv_pipe.producer_commit(state)
            state.advance()
            self.read_indices(mIdx, mXIdx, t, blk + 1, num_window, num_extra, row0,
                              rIdx, rXIdx)
        if const_expr(self.extra_fp8):
            if n_local > 0:
                self.finish_fp8_block(kv_pipe, done, pending, tile, scales, row0, chunk0, 0)
        # Q rides with block 0; without blocks the copies must still land before exit.
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def copy_row(self, atom_cp: cute.CopyAtom, addr: Int64, sK_vec: cute.Tensor, row: Int32,
                 chunk0: Int32, stage: Int32):
        """cp.async this thread's four 16 B chunks of the BF16 row at ``addr``."""
        for c in cutlass.range_constexpr(4):
            chunk = chunk0 + 16 * c
            copy16(atom_cp, self.dtype, addr + (chunk * 16).to(Int64),
                   sK_vec[None, row, chunk, stage])

    @cute.jit
    def extra_valid(self, pos: Int32, gx: Int32, num_window: Int32, num_extra: Int32,
                    mXKV: cute.Tensor):
        """Whether list position ``pos`` is a used slot of the second pool (row ``gx``)."""
        return (pos >= num_window and pos < num_window + num_extra and gx >= 0
                and gx < mXKV.shape[0])

    @cute.jit
    def read_indices(self, mIdx: cute.Tensor, mXIdx: cute.Tensor, t: Int32, blk: Int32,
                     num_window: Int32, num_extra: Int32, row0: Int32, rIdx: cute.Tensor,
                     rXIdx: cute.Tensor):
        """Pool indices of this thread's rows of block ``blk`` (reads clamped in bounds)."""
        for i in cutlass.range_constexpr(self.block_n // 8):
            pos = blk * self.block_n + row0 + 8 * i
            rIdx[i] = mIdx[t, cutlass.min(pos, num_window - 1)]
            if const_expr(self.has_extra):
                xpos = cutlass.max(cutlass.min(pos - num_window, num_extra - 1), 0)
                rXIdx[i] = mXIdx[t, xpos]

    @cute.jit
    def consume(self, mSink: cute.Tensor, mCos: cute.Tensor, mSin: cute.Tensor,
                mO: cute.Tensor, mLse: cute.Tensor, mOPart: cute.Tensor,
                mLsePart: cute.Tensor, t: Int32, hb: Int32, split: Int32,
                n_local: Int32, half: Int32, wg_tidx: Int32, sQ: cute.Tensor, sK: cute.Tensor,
                sV: cute.Tensor, sValid: cute.Tensor, kv_pipe: pipeline.PipelineAsync,
                tiled_mma_s: cute.TiledMma, tiled_mma_o: cute.TiledMma,
                staging: cute.Pointer, exchange: cute.Pointer):
        """WG1/WG2: S, online softmax and P.V for output columns [256 half, +256)."""
        bn = self.block_n
        thr_mma_s = tiled_mma_s.get_slice(wg_tidx)
        tSrQ = tiled_mma_s.make_fragment_A(thr_mma_s.partition_A(sQ))
        tSrK = tiled_mma_s.make_fragment_B(thr_mma_s.partition_B(sK))
        acc_s = thr_mma_s.make_fragment_C(thr_mma_s.partition_shape_C((HEAD_BLOCK, bn)))
        tScS = thr_mma_s.partition_C(cute.make_identity_tensor((HEAD_BLOCK, bn)))

        thr_mma_o = tiled_mma_o.get_slice(wg_tidx)
        sV_mine = cute.flat_divide(sV, (HEAD_DIM // 2, bn))[None, None, half, 0, None]
        tOrV = tiled_mma_o.make_fragment_B(thr_mma_o.partition_B(sV_mine))
        tOrP = tiled_mma_o.make_fragment_A(thr_mma_o.partition_shape_A((HEAD_BLOCK, bn)))
        # P written through S's accumulator layout: for 16-bit A operands the C and A register
        # layouts enumerate the same (row, column) in the same order.
        tOrP_as_s = cute.make_tensor(tOrP.iterator, acc_s.layout)
        acc_o = thr_mma_o.make_fragment_C(thr_mma_o.partition_shape_C((HEAD_BLOCK,
                                                                       HEAD_DIM // 2)))
        acc_o.fill(0.0)

        # Each thread holds two rows of the accumulators: element i sits on row slot
        # (i // 2) % 2 of a ((2, 2, V), 1, 1) fragment.
        row_max = cute.make_rmem_tensor((2,), Float32)
        row_sum = cute.make_rmem_tensor((2,), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        # Split QK^T: warpgroup `half` multiplies head_dim slice [256 half, +256) only.
        num_k = cute.size(tSrQ, mode=[2])
        k_first = 0
        if const_expr(self.qk_split):
            num_k = num_k // 2
            k_first = half * num_k
            tiled_mma_s.set(warpgroup.Field.ACCUMULATE, True)   # see issue_qk
        mine, other = ORDER_BARRIER + half, ORDER_BARRIER + 1 - half
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                             self.num_stages)
        if const_expr(self.qk_split):
            if n_local > 0:
                self.issue_qk(kv_pipe, state, tiled_mma_s, acc_s, tSrQ, tSrK, k_first, num_k)
        elif half == 1 and n_local > 0:   # ping-pong: WG1 issues first
            cute.arch.barrier_arrive(barrier_id=other, number_of_threads=256)
        for j in cutlass.range(n_local, unroll=1):
            stage = state.index
            if const_expr(self.qk_split):
                warpgroup.wait_group(0)   # this block's partial scores (issued earlier)
                if const_expr(self.ablation == "no_qk"):
                    acc_s.fill(0.0)
                self.exchange_scores(acc_s, exchange, half, wg_tidx, j, n_local)
            else:
                cute.arch.barrier(barrier_id=mine, number_of_threads=256)
                self.issue_qk(kv_pipe, state, tiled_mma_s, acc_s, tSrQ, tSrK, k_first, num_k)
                # The other warpgroup may issue its GEMMs now (not after our last block).
                if half == 0 or j + 1 < n_local:
                    cute.arch.barrier_arrive(barrier_id=other, number_of_threads=256)
                warpgroup.wait_group(0)
                if const_expr(self.ablation == "no_qk"):
                    acc_s.fill(0.0)

            if const_expr(self.ablation == "no_softmax"):
                tOrP_as_s.store(acc_s.load().to(self.dtype))
            else:
                self.online_softmax(acc_s, acc_o, tOrP_as_s, tScS, sValid, stage, row_max,
                                    row_sum)
            if const_expr(self.ablation != "no_pv"):
                warpgroup.fence()
                tiled_mma_o.set(warpgroup.Field.ACCUMULATE, True)
                for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                    cute.gemm(tiled_mma_o, acc_o, tOrP[None, None, k],
                              tOrV[None, None, k, stage], acc_o)
                warpgroup.commit_group()
            if const_expr(self.qk_split):
                # The next block's QK^T queues right behind this P.V (acc_s is free once P
                # is in registers), so the tensor pipe runs the two back to back. Issuing it
                # after this block's release, or only when the next block has already
                # landed, was slower (docs/performance.md, "Split QK^T (v4)").
                nxt = state.clone()
                nxt.advance()
                if j + 1 < n_local:
                    self.issue_qk(kv_pipe, nxt, tiled_mma_s, acc_s, tSrQ, tSrK, k_first,
                                  num_k)
                    warpgroup.wait_group(1)   # P.V done (groups retire in order)
                else:
                    warpgroup.wait_group(0)
            else:
                warpgroup.wait_group(0)
            kv_pipe.consumer_release(state)
            state.advance()

        # Both math warpgroups are past their last GEMM: the stages can hold the output.
        cute.arch.barrier(barrier_id=JOIN_BARRIER, number_of_threads=256)
        self.epilogue(mSink, mCos, mSin, mO, mLse, mOPart, mLsePart, t, hb, split, half,
                      wg_tidx, thr_mma_o, acc_o, tScS, row_max, row_sum, staging)

    @cute.jit
    def issue_qk(self, kv_pipe: pipeline.PipelineAsync, state: pipeline.PipelineState,
                 tiled_mma_s: cute.TiledMma, acc_s: cute.Tensor, tSrQ: cute.Tensor,
                 tSrK: cute.Tensor, k_first: Int32, num_k: cutlass.Constexpr):
        """Wait for the block in ``state``'s stage and issue S = Q K^T over k-blocks
        [k_first, k_first + num_k) (one commit group; the caller waits)."""
        kv_pipe.consumer_wait(state)
        # cp.async writes are generic-proxy stores; WGMMA reads smem through the async proxy.
        cute.arch.fence_proxy("async.shared", space="cta")
        if const_expr(self.ablation != "no_qk"):
            if const_expr(self.qk_split):
                # Zeroed, then accumulated into: the MMA's ACCUMULATE field may not change
                # inside the branches this is called from (staged values cannot escape).
                acc_s.fill(0.0)
            else:
                tiled_mma_s.set(warpgroup.Field.ACCUMULATE, False)
            warpgroup.fence()
            for k in cutlass.range_constexpr(num_k):
                cute.gemm(tiled_mma_s, acc_s, tSrQ[None, None, k_first + k],
                          tSrK[None, None, k_first + k, state.index], acc_s)
                if const_expr(not self.qk_split):
                    tiled_mma_s.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()

    @cute.jit
    def exchange_scores(self, acc_s: cute.Tensor, exchange: cute.Pointer, half: Int32,
                        wg_tidx: Int32, j: Int32, n_local: Int32):
        """Split QK^T: add the other warpgroup's partial scores to ours, through smem.

        Thread i of both warpgroups holds the same (row, column) elements, so each thread
        trades 16 B chunks with its twin (a warp covers 512 contiguous bytes: no bank
        conflicts). Both sides compute p0 + p1 (fp32 addition commutes), so the two
        warpgroups see bitwise identical scores and keep identical softmax statistics."""
        n_s = cute.size(acc_s)
        # Buffer w: n_s / 4 rows of 128 threads x 16 B; thread i's chunk c at row c, slot i.
        region = exchange.toint() + wg_tidx * 16
        acc_vec = cute.make_tensor(acc_s.iterator, cute.make_layout((4, n_s // 4)))
        if j > 0:   # the other warpgroup has read our previous block
            cute.arch.barrier(barrier_id=EMPTY_BARRIER + half, number_of_threads=256)
        for c in cutlass.range_constexpr(n_s // 4):
            self.chunk(region + (half * n_s // 4 + c) * 128 * 16).store(
                acc_vec[None, c].load())
        cute.arch.barrier(barrier_id=FULL_BARRIER, number_of_threads=256)
        for c in cutlass.range_constexpr(n_s // 4):
            theirs = self.chunk(region + ((1 - half) * n_s // 4 + c) * 128 * 16).load()
            acc_vec[None, c].store(acc_vec[None, c].load() + theirs)
        if j + 1 < n_local:   # its buffer is free for the next block
            cute.arch.barrier_arrive(barrier_id=EMPTY_BARRIER + 1 - half,
                                     number_of_threads=256)

    @cute.jit
    def chunk(self, addr: Int32) -> cute.Tensor:
        """Four fp32 at a 16 B aligned smem address (one vector access)."""
        return cute.make_tensor(cute.make_ptr(Float32, addr, cute.AddressSpace.smem,
                                              assumed_align=16), cute.make_layout((4,)))

    @cute.jit
    def online_softmax(self, acc_s: cute.Tensor, acc_o: cute.Tensor, tOrP_as_s: cute.Tensor,
                       tScS: cute.Tensor, sValid: cute.Tensor, stage: Int32,
                       row_max: cute.Tensor, row_sum: cute.Tensor):
        """Mask, update the running max and sum, write P (bf16) and rescale O."""
        n_s = cute.size(acc_s)
        for i in cutlass.range_constexpr(n_s):
            valid = sValid[tScS[i][1], stage] != 0
            acc_s[i] = acc_s[i] * self.scale_log2 if valid else -Float32.inf
        scale_prev = cute.make_rmem_tensor((2,), Float32)
        use_max = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            mx = row_max[r]
            for i in cutlass.range_constexpr(n_s):
                if const_expr((i // 2) % 2 == r):
                    mx = cute.arch.fmax(mx, acc_s[i])
            # The 4 lanes of a quad hold the same two rows.
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=2))
            # A row with nothing attended yet keeps max -inf: shift by 0 so that
            # 2^(-inf - 0) = 0 instead of NaN.
            use_max[r] = mx if mx != -Float32.inf else Float32(0.0)
            scale_prev[r] = cute.math.exp2(row_max[r] - use_max[r], fastmath=True)
            row_max[r] = mx
            row_sum[r] = row_sum[r] * scale_prev[r]
        for i in cutlass.range_constexpr(n_s):
            p = cute.math.exp2(acc_s[i] - use_max[(i // 2) % 2], fastmath=True)
            row_sum[(i // 2) % 2] = row_sum[(i // 2) % 2] + p
            tOrP_as_s[i] = p.to(self.dtype)
        # Skip the O rescale when no row of this warp got a new max (the usual case late in
        # the list); the vote keeps the branch warp-uniform.
        changed = scale_prev[0] != Float32(1.0) or scale_prev[1] != Float32(1.0)
        if cute.arch.vote_any_sync(changed):
            for i in cutlass.range(cute.size(acc_o), unroll_full=True):
                acc_o[i] = acc_o[i] * scale_prev[(i // 2) % 2]


@cute.jit
def sparse_attention_launcher(stream: cuda.CUstream, q: cute.Tensor, kv: cute.Tensor,
                              idx: cute.Tensor, extra_kv: cute.Tensor, extra_idx: cute.Tensor,
                              extra_len: cute.Tensor, sink: cute.Tensor,
                              cos: cute.Tensor, sin: cute.Tensor, o: cute.Tensor,
                              lse: cute.Tensor, o_part: cute.Tensor, lse_part: cute.Tensor, *,
                              num_heads: cutlass.Constexpr, softmax_scale: cutlass.Constexpr,
                              num_splits: cutlass.Constexpr, has_extra: cutlass.Constexpr,
                              block_n: cutlass.Constexpr = DEFAULT_CONFIG.block_n,
                              num_stages: cutlass.Constexpr = DEFAULT_CONFIG.num_stages,
                              qk_split: cutlass.Constexpr = False,
                              ablation: cutlass.Constexpr = "",
                              extra_fp8: cutlass.Constexpr = False,
                              has_extra_len: cutlass.Constexpr = False,
                              q_prep: cutlass.Constexpr = False,
                              norm_eps: cutlass.Constexpr = 0.0):
    """``cutlass_call`` entry point: (stream, *inputs, *outputs, **static config). Without
    ``q_prep`` cos and sin are placeholders the kernel never reads."""
    SparseAttentionSm90(num_heads, softmax_scale, num_splits, has_extra, ablation, block_n,
                        num_stages, qk_split, extra_fp8, has_extra_len, q_prep, norm_eps)(
        q, kv, idx, extra_kv, extra_idx, extra_len, sink, cos, sin, o, lse, o_part, lse_part,
        stream)


__all__ = ["SparseAttentionSm90", "sparse_attention_launcher"]
