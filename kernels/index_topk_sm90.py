"""The indexer's running top-k on Hopper (sm_90a), in CuTe DSL: a radix select per row.

For each row r, the candidates are the running top-k (``run_values[r, :Kr]``, ids
``run_ids[r, :Kr]``, in top-k order; absent in a first step) followed by a block's bf16 scores
(``scores[r, :W]``, ids ``lo + j``). Out: their top k by value, in top-k order (value
descending, the lower position first on ties) -- exactly ``lax.top_k`` over the concatenation,
whose positions are id order (``ffi/indexer_reference.blocked_topk``). Requires Kr + W >= k.

Dataflow (one CTA of 512 threads per row):

1. Keys: each bf16's bits made order-preserving as 16 unsigned bits (negative values: all
   bits flipped; others: the sign bit set) -- XLA's total order (-0 < +0).
2. Select: a 256-bin shared-memory histogram of the keys' high bytes, scanned from the top
   bin, finds the high byte of the k-th largest key and how many keys lie above its bin; a
   second histogram of the low bytes inside that bin finds the k-th largest key T and
   ``above``, the count of keys > T.
3. Collect, in rounds of 512 consecutive positions: keys > T take slots [0, above) through
   a shared-memory counter (any order); keys == T take slots above + rank, rank in position
   order (warp ballots, per-warp counts, a running base), while rank < k - above.
4. Sort the k slots (64-bit words key << 32 | ~position, descending: value descending,
   position ascending; padded to a power of two) by a bitonic network in shared memory, and
   write values and ids.

Every pass reads the row from global memory (three passes; the row is the block's scores of
one query: a few KB to 512 KB); the CTA count is the row count.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .index_scores_config import TOPK_THREADS

NUM_THREADS = TOPK_THREADS
WARPS = NUM_THREADS // 32
BINS = 256
# misc words: the selected bin, keys above it, the threshold key, ties to take, the slot
# counter of keys above the threshold, the running tie base; then one count per warp.
BIN, ABOVE, THRESHOLD, TAKE, COUNTER, TIE_BASE, WARP_COUNTS = 0, 1, 2, 3, 4, 5, 8


@dsl_user_op
def f32_bits(x: Float32, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(T.i32(), [Float32(x).ir_value(loc=loc, ip=ip)],
                                 "mov.b32 $0, $1;", "=r,f", has_side_effects=False,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def bits_f32(x: Int32, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.inline_asm(T.f32(), [Int32(x).ir_value(loc=loc, ip=ip)],
                                   "mov.b32 $0, $1;", "=f,r", has_side_effects=False,
                                   is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def next_pow2(k: int) -> int:
    p = 1
    while p < k:
        p *= 2
    return p


class IndexTopkSm90:
    """Static configuration of one compiled kernel (see the module docstring)."""

    def __init__(self, k: int, has_running: bool):
        self.k = k
        self.k2 = next_pow2(k)
        self.has_running = has_running
        assert self.k2 <= 2 * NUM_THREADS       # one compare-exchange per thread and stage

    @cute.jit
    def __call__(self, mScores: cute.Tensor, mRunV: cute.Tensor, mRunI: cute.Tensor,
                 mLo: cute.Tensor, mOutV: cute.Tensor, mOutI: cute.Tensor,
                 stream: cuda.CUstream):
        @cute.struct
        class SharedStorage:
            hist: cute.struct.MemRange[Int32, BINS]
            misc: cute.struct.MemRange[Int32, WARP_COUNTS + WARPS]
            sel: cute.struct.Align[cute.struct.MemRange[Int64, self.k2], 16]

        self.shared_storage = SharedStorage
        self.kernel(mScores, mRunV, mRunI, mLo, mOutV, mOutI).launch(
            grid=[mScores.shape[0], 1, 1], block=[NUM_THREADS, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mScores: cute.Tensor, mRunV: cute.Tensor, mRunI: cute.Tensor,
               mLo: cute.Tensor, mOutV: cute.Tensor, mOutI: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        r, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        hist = storage.hist.get_tensor(cute.make_layout((BINS,)))
        misc = storage.misc.get_tensor(cute.make_layout((WARP_COUNTS + WARPS,)))
        sel = storage.sel.get_tensor(cute.make_layout((self.k2,)))
        hist_ptr = storage.hist.data_ptr()
        misc_ptr = storage.misc.data_ptr()
        kr = Int32(0)
        if const_expr(self.has_running):
            kr = mRunV.shape[1]
        total = kr + mScores.shape[1]
        lane = tidx % 32
        warp = tidx // 32

        # 2. the high byte, then the low byte, of the k-th largest key
        if tidx < BINS:
            hist[tidx] = Int32(0)
        if tidx < WARP_COUNTS:
            misc[tidx] = Int32(0)
        cute.arch.barrier()
        for c in cutlass.range(tidx, total, NUM_THREADS, unroll=1):
            key = self.key_at(mScores, mRunV, r, c, kr)
            cute.arch.atomic_add(hist_ptr + (key >> 8), Int32(1))
        cute.arch.barrier()
        self.find_bin(hist, misc, Int32(self.k), tidx, lane, warp)
        bin_hi = misc[BIN]
        above_hi = misc[ABOVE]
        if tidx < BINS:
            hist[tidx] = Int32(0)
        cute.arch.barrier()
        for c in cutlass.range(tidx, total, NUM_THREADS, unroll=1):
            key = self.key_at(mScores, mRunV, r, c, kr)
            if key >> 8 == bin_hi:
                cute.arch.atomic_add(hist_ptr + (key & 0xFF), Int32(1))
        cute.arch.barrier()
        self.find_bin(hist, misc, self.k - above_hi, tidx, lane, warp)
        threshold = (bin_hi << 8) | misc[BIN]
        above = above_hi + misc[ABOVE]
        take = self.k - above

        # 3. collect: keys above the threshold in any order, ties in position order
        lower_lanes = (Int32(1) << lane) - 1
        for base in cutlass.range(0, total, NUM_THREADS, unroll=1):
            c = base + tidx
            key = Int32(-1)
            if c < total:
                key = self.key_at(mScores, mRunV, r, c, kr)
            if key > threshold:
                slot = cute.arch.atomic_add(misc_ptr + COUNTER, Int32(1))
                sel[slot] = self.word(key, c)
            tie = key == threshold
            ballot = cute.arch.vote_ballot_sync(tie)
            if lane == 0:
                misc[WARP_COUNTS + warp] = cute.arch.popc(ballot)
            cute.arch.barrier()
            rank = misc[TIE_BASE] + cute.arch.popc(ballot & lower_lanes)
            round_ties = Int32(0)
            for w in cutlass.range_constexpr(WARPS):
                n = misc[WARP_COUNTS + w]
                if w < warp:
                    rank = rank + n
                round_ties = round_ties + n
            if tie and rank < take:
                sel[above + rank] = self.word(key, c)
            cute.arch.barrier()
            if tidx == 0:
                misc[TIE_BASE] = misc[TIE_BASE] + round_ties

        # 4. bitonic sort of the k2 words, descending
        for i in cutlass.range(tidx, self.k2, NUM_THREADS, unroll=1):
            if i >= self.k:
                sel[i] = Int64(-1)
        self.sort_words(sel, tidx)
        lo = mLo[0]
        for i in cutlass.range(tidx, self.k, NUM_THREADS, unroll=1):
            key, pos = self.unword(sel[i])
            mOutV[r, i] = self.key_value(key).to(mOutV.element_type)
            ident = lo + pos - kr
            if const_expr(self.has_running):
                if pos < kr:
                    ident = mRunI[r, pos]
            mOutI[r, i] = ident

    @cute.jit
    def key_at(self, mScores: cute.Tensor, mRunV: cute.Tensor, r: Int32, c: Int32,
               kr: Int32) -> Int32:
        """The order-preserving 16-bit key of candidate ``c``."""
        value = Float32(0.0)
        if const_expr(self.has_running):
            if c < kr:
                value = mRunV[r, c].to(Float32)
            else:
                value = mScores[r, c - kr].to(Float32)
        else:
            value = mScores[r, c].to(Float32)
        return self.order_key((f32_bits(value) >> 16) & 0xFFFF)

    @cute.jit
    def order_key(self, b: Int32) -> Int32:
        """The order-preserving 16-bit key of bf16 bits ``b`` (negative: all bits flipped;
        others: the sign bit set)."""
        return b ^ 0xFFFF if (b & 0x8000) != 0 else b | 0x8000

    def word(self, key, c):
        """Sort word: key descending first, then position ascending."""
        return (key.to(Int64) << 32) | (Int64(0xFFFFFFFF) - c.to(Int64))

    @cute.jit
    def unword(self, w: Int64):
        """(key, position) of a sort word."""
        return (w >> 32).to(Int32), (Int64(0xFFFFFFFF) - (w & Int64(0xFFFFFFFF))).to(Int32)

    @cute.jit
    def key_value(self, key: Int32) -> Float32:
        """The bf16 value (as f32) of an order-preserving key."""
        bits = key & 0x7FFF if (key & 0x8000) != 0 else key ^ 0xFFFF
        return bits_f32(bits << 16)

    @cute.jit
    def sort_words(self, sel: cute.Tensor, tidx: Int32):
        """Bitonic sort of the ``k2`` words of ``sel`` (shared memory), descending, by the
        CTA's first ``k2 / 2`` threads (every thread takes the barriers). Ends with a
        barrier."""
        for size_log in cutlass.range_constexpr(1, self.k2.bit_length()):
            size = 1 << size_log
            for stride_log in cutlass.range_constexpr(size_log - 1, -1, -1):
                stride = 1 << stride_log
                cute.arch.barrier()
                if tidx < self.k2 // 2:
                    i = 2 * stride * (tidx // stride) + tidx % stride
                    j = i + stride
                    a, b = sel[i], sel[j]
                    # descending where (i & size) == 0, so that the whole ends descending
                    down = (i & size) == 0
                    if (a < b) == down:
                        sel[i] = b
                        sel[j] = a
        cute.arch.barrier()

    @cute.jit
    def find_bin(self, hist: cute.Tensor, misc: cute.Tensor, need: Int32, tidx: Int32,
                 lane: Int32, warp: Int32):
        """The bin b holding the need-th largest key (bins scanned from the top) into
        misc[BIN], the count of keys in bins above it into misc[ABOVE]. Ends with a
        barrier."""
        count = Int32(0)
        incl = Int32(0)
        if tidx < BINS:
            count = hist[BINS - 1 - tidx]
            incl = count
            for s in cutlass.range_constexpr(5):
                up = cute.arch.shuffle_sync_up(incl, offset=1 << s)
                if lane >= (1 << s):
                    incl = incl + up
            if lane == 31:
                misc[WARP_COUNTS + warp] = incl
        cute.arch.barrier()
        if tidx < BINS:
            for w in cutlass.range_constexpr(BINS // 32):
                if w < warp:
                    incl = incl + misc[WARP_COUNTS + w]
            excl = incl - count
            if excl < need and incl >= need:
                misc[BIN] = BINS - 1 - tidx
                misc[ABOVE] = excl
        cute.arch.barrier()


@cute.jit
def index_topk_launcher(stream: cuda.CUstream, scores: cute.Tensor, run_values: cute.Tensor,
                        run_ids: cute.Tensor, lo: cute.Tensor, out_values: cute.Tensor,
                        out_ids: cute.Tensor, *, k: cutlass.Constexpr,
                        has_running: cutlass.Constexpr):
    """``cutlass_call`` entry point: (stream, *inputs, *outputs, **static config)."""
    IndexTopkSm90(k, has_running)(scores, run_values, run_ids, lo, out_values, out_ids, stream)


__all__ = ["IndexTopkSm90", "index_topk_launcher", "next_pow2"]
