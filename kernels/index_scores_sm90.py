"""The lightning indexer's scores for Hopper (sm_90a), in CuTe DSL.

For the entries ``lo + j`` (``j < width``) of each batch row's index key table and every
query ``(b, s)`` of a chunk (``ffi/indexer.py``, the model's rounding points)::

    dot[h]   = bf16(sum_d q[b, s, h, d] keys[b, lo + j, d])           (f32 accumulation)
    p[h]     = bf16(relu(dot[h]) * weights[b, s, h])
    out[b, s, j] = bf16(sum_h p[h])   (f32, the order below),  -inf where lo + j >= visible[b, s]

written as bf16 ``[B, S, width]``: the ``[B, S, H, width]`` products never leave registers.

Dataflow (384 threads: a producer warpgroup WG0 and two math warpgroups; CTA = a group of
``2 x tokens_per_warpgroup`` queries -- one with ``split_n`` -- of one batch row x one split
of the entry blocks):

1. WG0 copies the group's Q tiles (64 heads x 128, bf16, 128B-swizzled, one per query) once,
   then each block of 128 key rows into a ``num_stages`` mbarrier ring (``cp.async`` 16 B per
   thread, a half warp per 256 B row; rows past the table read its last row: masked).
2. Math warpgroup w multiplies its queries' Q tiles by the stage (WGMMA m64 n128 k16, both
   operands from shared memory, f32 accumulators: 64 heads x 128 entries per query) and
   releases the stage. ``split_n`` (a decode row's one query): both warpgroups multiply that
   query, warpgroup w the stage's rows 64 w .. 64 w + 63 (WGMMA n64), and each sums and
   stores its 64 entries.
3. Epilogue in registers: each accumulator pair is rounded to bf16x2, ReLU'd and multiplied
   by the head's weight in bf16x2 (one ``mul.rn``: the exact product rounded, as the
   reference), then unpacked to f32. The head sum: a thread adds its two rows (g, g + 8),
   the 8 lanes that share columns reduce-scatter by shuffles (lane bits 4, 3, 2), and the
   four warps' partial sums meet in shared memory, added in warp order; thread i of the
   warpgroup writes entry i of the block (-inf past ``visible``). f32 additions in a fixed
   tree: equal to the reference whenever the sum is exact in f32 (FP4-grid indexer inputs:
   the dot products always are), else within an f32 rounding before the bf16 one.

Constraints: sm_90a; bf16 q ``[B, S, 64, 128]``, weights ``[B, S, 64]``, keys ``[B, N, 128]``
bf16 or ``[B, N, 72]`` uint8 MXFP4 rows (``fp4_keys``; widened to the same bf16 tile in
the producer, ``kernels/index_scores_fp4.py``) (N >= 1), visible int32 ``[B, S]`` (clamped
to N by the caller), lo int32 ``[1]``; out bf16
``[B, S, width]``. Queries past S in the last group compute on a copy of query S - 1 and
store nothing.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr, pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from .index_scores_config import (BLOCK_N, DIM, FP4_KEY_BYTES, HEADS, MATH_WARPGROUPS,
                                  IndexScoresSm90Config)
from .index_scores_fp4 import Fp4KeyGather
from .sm90_primitives import copy16, cp_async_arrive, half_warp_rows, row_copy_atom

NUM_THREADS = 128 * (1 + MATH_WARPGROUPS)
PRODUCER_REGS, MATH_REGS = 72, 216       # as the sparse attention kernel: 72 + 2 x 216 <= 3 x 168
EXCHANGE_BARRIER = 1                     # named barriers 1, 2: a math warpgroup's head sums


@dsl_user_op
def relu_weighted_pair(a: Float32, b: Float32, c: Float32, d: Float32, w_lo: Int32,
                       w_hi: Int32, *, loc=None, ip=None):
    """Columns (n, n + 1) of rows g (a, b) and g + 8 (c, d): ``bf16(relu(bf16(x)) * w)`` per
    element (``w_lo`` / ``w_hi``: the rows' weights as bf16x2 pairs), and each column's two
    products added in f32 -> (column n, column n + 1)."""
    text = ("{\n"
            ".reg .b32 x, y, z;\n"
            ".reg .f32 l0, h0, l1, h1;\n"
            "cvt.rn.bf16x2.f32 x, $3, $2;\n"
            "cvt.rn.bf16x2.f32 y, $5, $4;\n"
            "mov.b32 z, 0;\n"
            "max.bf16x2 x, x, z;\n"
            "max.bf16x2 y, y, z;\n"
            "mul.rn.bf16x2 x, x, $6;\n"
            "mul.rn.bf16x2 y, y, $7;\n"
            "shl.b32 z, x, 16;\n"
            "mov.b32 l0, z;\n"
            "and.b32 z, x, 0xFFFF0000;\n"
            "mov.b32 h0, z;\n"
            "shl.b32 z, y, 16;\n"
            "mov.b32 l1, z;\n"
            "and.b32 z, y, 0xFFFF0000;\n"
            "mov.b32 h1, z;\n"
            "add.rn.f32 $0, l0, l1;\n"
            "add.rn.f32 $1, h0, h1;\n"
            "}")
    args = [Float32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c, d)]
    args += [Int32(v).ir_value(loc=loc, ip=ip) for v in (w_lo, w_hi)]
    res = llvm.inline_asm(llvm.StructType.get_literal([T.f32(), T.f32()]), args, text,
                          "=f,=f,f,f,f,f,r,r", has_side_effects=False, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT)
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip))
                 for i in range(2))


@dsl_user_op
def bf16x2_splat(x: Float32, *, loc=None, ip=None) -> Int32:
    """``x`` (a bf16 value held in f32) in both halves of a bf16x2 word."""
    return Int32(llvm.inline_asm(T.i32(), [Float32(x).ir_value(loc=loc, ip=ip)],
                                 "cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,f",
                                 has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT))


class IndexScoresSm90(Fp4KeyGather):
    """Static configuration of one compiled kernel (see the module docstring)."""

    def __init__(self, splits: int, config: IndexScoresSm90Config, fp4_keys: bool = False):
        self.splits = splits
        self.fp4_keys = fp4_keys
        self.tpw = config.tokens_per_warpgroup
        self.tokens = config.tokens_per_cta
        self.split_n = config.split_n
        self.n_tile = config.n_tile
        self.n_tiles = self.n_tile // 8                # accumulator n8 tiles per query
        self.num_stages = config.num_stages
        self.skip_invisible = config.skip_invisible
        self.dtype = cutlass.BFloat16

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mW: cute.Tensor, mK: cute.Tensor, mVis: cute.Tensor,
                 mLo: cute.Tensor, mOut: cute.Tensor, stream: cuda.CUstream):
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
            (1, 1, 1), (HEADS, self.n_tile))
        # One Q tile per query of the group (the layout's "stage" mode), one key block per
        # pipeline stage; both K-major, 128B-swizzled.
        sQ_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (HEADS, BLOCK_N, DIM), self.dtype, self.tokens)
        sK_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (HEADS, BLOCK_N, DIM), self.dtype, self.num_stages)
        exchange = MATH_WARPGROUPS * 2 * self.tpw * 4 * BLOCK_N

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[Int64, 2 * self.num_stages]
            sQ: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sX: cute.struct.Align[cute.struct.MemRange[Float32, exchange], 128]

        self.shared_storage = SharedStorage
        batch, tokens = mQ.shape[0], mQ.shape[1]
        groups = (tokens + self.tokens - 1) // self.tokens
        self.kernel(mQ, mW, mK, mVis, mLo, mOut, tiled_mma, sQ_layout, sK_layout).launch(
            grid=[groups, self.splits, batch], block=[NUM_THREADS, 1, 1], stream=stream,
            min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mW: cute.Tensor, mK: cute.Tensor, mVis: cute.Tensor,
               mLo: cute.Tensor, mOut: cute.Tensor, tiled_mma: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        group, split, b = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // 128)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        kv_pipe = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar.data_ptr(), num_stages=self.num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     128 * MATH_WARPGROUPS))
        width = mOut.shape[2]
        num_blocks = (width + BLOCK_N - 1) // BLOCK_N
        per_split = (num_blocks + self.splits - 1) // self.splits
        blk_begin = split * per_split
        n_local = cutlass.max(cutlass.min(blk_begin + per_split, num_blocks) - blk_begin, 0)
        lo = mLo[0]
        # The blocks the pipeline streams: all of the split's, or (skip_invisible) those that
        # start below the group's largest visible count -- the same count in every warpgroup.
        n_live = n_local
        if const_expr(self.skip_invisible):
            tokens = mQ.shape[1]
            most = Int32(0)
            for slot in cutlass.range_constexpr(self.tokens):
                most = cutlass.max(most, mVis[b, cutlass.min(group * self.tokens + slot,
                                                             tokens - 1)])
            live_blocks = (most - lo + BLOCK_N - 1) // BLOCK_N - blk_begin
            if most <= lo:
                live_blocks = Int32(0)
            n_live = cutlass.max(cutlass.min(live_blocks, n_local), 0)

        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.produce(mQ, mK, b, group, lo, blk_begin, n_live, sQ, sK, kv_pipe, tidx,
                         storage.sK.data_ptr().toint())
        else:
            cute.arch.setmaxregister_increase(MATH_REGS)
            self.consume(mW, mVis, mOut, b, group, lo, blk_begin, n_live, wg - 1,
                         tidx % 128, sQ, sK, kv_pipe, tiled_mma, storage.sX.data_ptr())
            if const_expr(self.skip_invisible):
                self.store_invisible(mOut, b, group, wg - 1, blk_begin, n_live, n_local,
                                     tidx % 128)

    @cute.jit
    def produce(self, mQ: cute.Tensor, mK: cute.Tensor, b: Int32, group: Int32, lo: Int32,
                blk_begin: Int32, n_local: Int32, sQ: cute.Tensor, sK: cute.Tensor,
                kv_pipe: pipeline.PipelineAsync, tidx: Int32, tile: Int32):
        """WG0: the group's Q tiles, then the split's key blocks into the ring (MXFP4 rows:
        copied, then widened in place one block later; ``Fp4KeyGather``)."""
        atom_cp = row_copy_atom(self.dtype)
        row0, chunk = half_warp_rows(tidx)        # a half warp per 256 B row, 8 rows a pass
        sK_vec = cute.flat_divide(sK, (1, 8))[0, None, None, None, None]
        sQ_vec = cute.flat_divide(sQ, (1, 8))[0, None, None, None, None]
        tokens = mQ.shape[1]
        entries = mK.shape[1]
        q_base = mQ.iterator.toint()
        for slot in cutlass.range_constexpr(self.tokens):
            s = cutlass.min(group * self.tokens + slot, tokens - 1)
            q_row0 = ((b * tokens + s) * HEADS).to(Int64)
            for i in cutlass.range_constexpr(HEADS // 8):
                row = row0 + 8 * i
                copy16(atom_cp, self.dtype, q_base + ((q_row0 + row) * DIM + chunk * 8) * 2,
                       sQ_vec[None, row, chunk, slot])
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                             self.num_stages)
        # MXFP4 keys: a block is committed one iteration late (``done``: the oldest
        # uncommitted one), so that the next block's copies are in flight while it widens.
        done = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                            self.num_stages)
        k_base = mK.iterator.toint()
        for j in cutlass.range(n_local, unroll=1):
            kv_pipe.producer_acquire(state)
            first = lo + (blk_begin + j) * BLOCK_N
            for i in cutlass.range_constexpr(BLOCK_N // 8):
                row = row0 + 8 * i
                entry = cutlass.min(first + row, entries - 1)
                k_row = (b * entries + entry).to(Int64)
                if const_expr(self.fp4_keys):
                    self.issue_fp4_row(k_base + k_row * FP4_KEY_BYTES, tile, state.index, row,
                                       chunk)
                else:
                    copy16(atom_cp, self.dtype, k_base + (k_row * DIM + chunk * 8) * 2,
                           sK_vec[None, row, chunk, state.index])
            if const_expr(self.fp4_keys):
                cute.arch.cp_async_commit_group()
                if j > 0:
                    self.finish_fp4_block(kv_pipe, done, tile, row0, chunk, 1)
                    done.advance()
            else:
                # The phase completes once every producer thread's copies landed (Q rides
                # with the first block).
                cp_async_arrive(kv_pipe.producer_get_barrier(state))
                kv_pipe.producer_commit(state)
            state.advance()
        if const_expr(self.fp4_keys):
            if n_local > 0:
                self.finish_fp4_block(kv_pipe, done, tile, row0, chunk, 0)
        cute.arch.cp_async_wait_group(0)    # without blocks the Q copies still land first

    @cute.jit
    def consume(self, mW: cute.Tensor, mVis: cute.Tensor, mOut: cute.Tensor, b: Int32,
                group: Int32, lo: Int32, blk_begin: Int32, n_local: Int32, half: Int32,
                wg_tidx: Int32, sQ: cute.Tensor, sK: cute.Tensor,
                kv_pipe: pipeline.PipelineAsync, tiled_mma: cute.TiledMma,
                exchange: cute.Pointer):
        """Math warpgroup ``half``: queries ``half * tpw ..`` of the group (``split_n``: the
        group's one query, entries ``half * n_tile ..`` of each block), block by block."""
        thr_mma = tiled_mma.get_slice(wg_tidx)
        tSrQ = tiled_mma.make_fragment_A(thr_mma.partition_A(sQ))
        if const_expr(self.split_n):
            # this warpgroup's half of every stage's key rows (a 1 KB-aligned sub-tile)
            sK = cute.flat_divide(sK, (self.n_tile, DIM))[None, None, half, 0, None]
        tSrK = tiled_mma.make_fragment_B(thr_mma.partition_B(sK))
        accs = [thr_mma.make_fragment_C(thr_mma.partition_shape_C((HEADS, self.n_tile)))
                for _ in range(self.tpw)]
        tokens = mW.shape[1]
        warp = wg_tidx // 32
        lane = wg_tidx % 32
        g = lane // 4
        # Per query of this warpgroup: its index, whether it exists, its visible count and
        # its rows' weights (heads 16 warp + g and + 8) as bf16x2 pairs.
        slots, w_lo, w_hi, visible = [], [], [], []
        for k in cutlass.range_constexpr(self.tpw):
            s = group * self.tokens + self.slot(half, k)
            s_read = cutlass.min(s, tokens - 1)
            slots.append(s)
            head = 16 * warp + g
            w_lo.append(bf16x2_splat(mW[b, s_read, head].to(Float32)))
            w_hi.append(bf16x2_splat(mW[b, s_read, head + 8].to(Float32)))
            visible.append(mVis[b, s_read])
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                             self.num_stages)
        num_k = cute.size(tSrQ, mode=[2])
        for j in cutlass.range(n_local, unroll=1):
            kv_pipe.consumer_wait(state)
            # cp.async writes are generic-proxy stores; WGMMA reads smem through the async
            # proxy.
            cute.arch.fence_proxy("async.shared", space="cta")
            warpgroup.fence()
            for k in cutlass.range_constexpr(self.tpw):
                tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                for kk in cutlass.range_constexpr(num_k):
                    cute.gemm(tiled_mma, accs[k], tSrQ[None, None, kk, self.slot(half, k)],
                              tSrK[None, None, kk, state.index], accs[k])
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            kv_pipe.consumer_release(state)
            blk = blk_begin + j
            for k in cutlass.range_constexpr(self.tpw):
                self.head_sum(accs[k], w_lo[k], w_hi[k], exchange, half, k, j % 2, warp, lane)
            cute.arch.barrier(barrier_id=EXCHANGE_BARRIER + half, number_of_threads=128)
            for k in cutlass.range_constexpr(self.tpw):
                self.store_scores(mOut, exchange, half, k, j % 2, b, slots[k], tokens,
                                  visible[k], lo, blk, wg_tidx)
            state.advance()

    def slot(self, half, k):
        """The group's query slot of query ``k`` of math warpgroup ``half``."""
        return 0 if self.split_n else half * self.tpw + k

    def exchange_row(self, exchange, half, k, buf, warp):
        """Byte address of warp ``warp``'s 128 f32 partial sums of query ``k`` of math
        warpgroup ``half``, buffer ``buf``."""
        return exchange.toint() + ((((half * 2 + buf) * self.tpw + k) * 4 + warp)
                                   * BLOCK_N) * 4

    @cute.jit
    def head_sum(self, acc: cute.Tensor, w_lo: Int32, w_hi: Int32, exchange: cute.Pointer,
                 half: Int32, k: cutlass.Constexpr, buf: Int32, warp: Int32, lane: Int32):
        """This warp's 16-head sums of the warpgroup's ``n_tile`` entries of the block into
        the exchange buffer.

        Accumulator element 4 n + e holds row g + 8 (e // 2) (head), column 8 n + 2 t + e % 2
        (entry); after the reduce-scatter over g, lane (g, t) holds the columns 8 (g p + m) +
        2 t + {0, 1} of its p = n_tiles / 8 tiles m."""
        vals = []
        for n in cutlass.range_constexpr(self.n_tiles):
            pair = relu_weighted_pair(acc[4 * n], acc[4 * n + 1], acc[4 * n + 2],
                                      acc[4 * n + 3], w_lo, w_hi)
            vals += [pair[0], pair[1]]
        for stage in cutlass.range_constexpr(3):   # lane bits 4, 3, 2 = g bits 2, 1, 0
            offset = 16 >> stage
            upper = (lane & offset) != 0
            count = len(vals) // 2
            kept = []
            for i in cutlass.range_constexpr(count):
                send = vals[i] if upper else vals[count + i]
                keep = vals[count + i] if upper else vals[i]
                kept.append(keep + cute.arch.shuffle_sync_bfly(send, offset=offset))
            vals = kept
        g, t = lane // 4, lane % 4
        row = self.exchange_row(exchange, half, k, buf, warp)
        per = self.n_tiles // 8
        for n in cutlass.range_constexpr(per):
            col = 8 * (g * per + n) + 2 * t
            dst = cute.make_tensor(cute.make_ptr(Float32, row + col * 4, cute.AddressSpace.smem,
                                                 assumed_align=8), cute.make_layout((2,)))
            dst[0] = vals[2 * n]
            dst[1] = vals[2 * n + 1]

    @cute.jit
    def store_scores(self, mOut: cute.Tensor, exchange: cute.Pointer, half: Int32,
                     k: cutlass.Constexpr, buf: Int32, b: Int32, s: Int32, tokens: Int32,
                     visible: Int32, lo: Int32, blk: Int32, wg_tidx: Int32):
        """Thread i < n_tile: the warpgroup's entry i of the block, the four warps' sums added
        in warp order."""
        if wg_tidx < self.n_tile:
            total = Float32(0.0)
            for w in cutlass.range_constexpr(4):
                src = cute.make_tensor(
                    cute.make_ptr(Float32, self.exchange_row(exchange, half, k, buf, w)
                                  + wg_tidx * 4, cute.AddressSpace.smem, assumed_align=4),
                    cute.make_layout((1,)))
                total = src[0] if w == 0 else total + src[0]
            col = blk * BLOCK_N + wg_tidx
            if const_expr(self.split_n):
                col = col + half * self.n_tile
            if s < tokens and col < mOut.shape[2]:
                score = total if lo + col < visible else -Float32.inf
                mOut[b, s, col] = score.to(self.dtype)

    @cute.jit
    def store_invisible(self, mOut: cute.Tensor, b: Int32, group: Int32, half: Int32,
                        blk_begin: Int32, n_live: Int32, n_local: Int32, wg_tidx: Int32):
        """-inf for this warpgroup's queries (and entries, ``split_n``) in the split's blocks
        past the live ones (every entry there is at or past each query's visible count);
        thread i < n_tile: the warpgroup's entry i."""
        tokens = mOut.shape[1]
        if wg_tidx < self.n_tile:
            for j in cutlass.range(n_live, n_local, unroll=1):
                col = (blk_begin + j) * BLOCK_N + wg_tidx
                if const_expr(self.split_n):
                    col = col + half * self.n_tile
                for k in cutlass.range_constexpr(self.tpw):
                    s = group * self.tokens + self.slot(half, k)
                    if s < tokens and col < mOut.shape[2]:
                        mOut[b, s, col] = Float32(-Float32.inf).to(self.dtype)


@cute.jit
def index_scores_launcher(stream: cuda.CUstream, q: cute.Tensor, weights: cute.Tensor,
                          keys: cute.Tensor, visible: cute.Tensor, lo: cute.Tensor,
                          out: cute.Tensor, *, splits: cutlass.Constexpr,
                          tokens_per_warpgroup: cutlass.Constexpr,
                          num_stages: cutlass.Constexpr,
                          skip_invisible: cutlass.Constexpr = False,
                          fp4_keys: cutlass.Constexpr = False,
                          split_n: cutlass.Constexpr = False):
    """``cutlass_call`` entry point: (stream, *inputs, *outputs, **static config);
    ``fp4_keys``: ``keys`` is uint8 ``[B, N, FP4_KEY_BYTES]`` MXFP4 rows."""
    IndexScoresSm90(splits, IndexScoresSm90Config(tokens_per_warpgroup, num_stages,
                                                  skip_invisible, split_n), fp4_keys)(
        q, weights, keys, visible, lo, out, stream)


__all__ = ["IndexScoresSm90", "index_scores_launcher", "relu_weighted_pair"]
