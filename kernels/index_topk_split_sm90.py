"""The indexer's top-k for a few long rows (a decode step over a long table) on Hopper
(sm_90a), in CuTe DSL: the radix select of ``index_topk_sm90.py`` with each row split over
many CTAs.

``index_topk_sm90`` runs one CTA per row: right for a prefill chunk's thousands of rows, but a
decode step has one to a few dozen rows of up to 262144 entries, and one CTA streaming such a
row three times leaves the GPU idle. Here every pass runs on ``SEGMENT``-entry segments of
every row at once, and the passes meet through a small per-row ``counts`` table in global
memory, which the caller zeroes (the launcher takes it as an in-place input).

In: ``scores [R, W]`` bf16; ``lo`` (``[1]`` int32, added to the ids). Out: the top k of each
row by value, in top-k order (value descending, the lower position first on ties) -- exactly
``lax.top_k``'s values and positions + lo. Requires k <= W, k <= ``2 x FINISH_THREADS``,
ceil(W / SEGMENT) <= ``MAX_SEGMENTS``.

Dataflow (keys: each bf16's bits made order-preserving as 16 unsigned bits, as
``index_topk_sm90``; a thread holds ``VEC`` consecutive entries, one 16-byte load when W is a
multiple of 8):

1. ``hist_high`` (one CTA per segment and row): a shared-memory histogram of the keys' high
   bytes, added to the row's global histogram (``counts[r, HIGH:]``, one atomic per non-empty
   bin).
2. ``hist_low``: every CTA finds, from the global histogram, the high byte of the row's k-th
   largest key (a scan from the top bin); the low bytes of its keys inside that bin go to the
   row's second global histogram (``counts[r, LOW:]``).
3. ``collect``: every CTA finds the k-th largest key T, ``above`` (keys > T) and ``take`` =
   k - above (ties to keep). Keys > T get slots of ``sel_key/sel_pos [R, k]`` from a global
   counter (one atomic per warp; any order). Ties keep their position order: each CTA ranks
   its own (a block scan), writes the first ``take`` of them to its row of ``tie_pos [R,
   segments, k]`` and its count (at most ``take``) to ``tie_count [R, segments]``; CTA 0 of
   the row writes T, above and take to ``counts``.
4. ``finish`` (one CTA per row): the segments' tie counts scanned, the words (key << 32 |
   ~position) of the ``above`` keys and of the first ``take`` ties (tie i: the segment whose
   running count covers i, found by a binary search) in shared memory, the bitonic sort of
   ``index_topk_sm90``, and the values and ids.

Every pass reads the scores from global memory (three times: 512 KB a row at a 1M-token
context, from L2 after the first pass); the scratch outputs are ``[R, k]`` and ``[R, segments,
k]`` int32.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from .index_scores_config import MAX_SEGMENTS, SPLIT_SEGMENT, TOPK_THREADS
from .index_topk_sm90 import ABOVE, BIN, BINS, WARP_COUNTS, IndexTopkSm90

THREADS = 256                   # per segment CTA: one histogram bin each
VEC = 8                         # consecutive entries a thread holds (one 16-byte load)
SEGMENT = SPLIT_SEGMENT
FINISH_THREADS = TOPK_THREADS   # the finish CTA: one compare-exchange per thread and stage
assert SEGMENT == THREADS * VEC and MAX_SEGMENTS == 2 * FINISH_THREADS
# counts words per row: the high-byte histogram, the low-byte histogram inside the
# threshold's high byte, the slot counter of keys above the threshold, then T, above, take.
HIGH, LOW, SLOTS, THRESHOLD, ABOVE_COUNT, TAKE = 0, BINS, 2 * BINS, 2 * BINS + 1, \
    2 * BINS + 2, 2 * BINS + 3
COUNT_WORDS = 2 * BINS + 4
ABSENT = -1                     # the key of a position past the row


def segments_of(width: int) -> int:
    return (width + SEGMENT - 1) // SEGMENT


class IndexTopkSplitSm90(IndexTopkSm90):
    """Static configuration of one compiled kernel set (see the module docstring);
    ``vector``: W is a multiple of 8 (16-byte loads)."""

    def __init__(self, k: int, vector: bool):
        super().__init__(k, has_running=False)
        self.vector = vector

    @cute.jit
    def __call__(self, mScores: cute.Tensor, mCounts: cute.Tensor, mLo: cute.Tensor,
                 mSelKey: cute.Tensor, mSelPos: cute.Tensor, mTieCount: cute.Tensor,
                 mTiePos: cute.Tensor, mOutV: cute.Tensor, mOutI: cute.Tensor,
                 stream: cuda.CUstream):
        @cute.struct
        class SegmentStorage:
            hist: cute.struct.MemRange[Int32, BINS]
            misc: cute.struct.MemRange[Int32, WARP_COUNTS + FINISH_THREADS // 32]

        @cute.struct
        class FinishStorage:
            starts: cute.struct.MemRange[Int32, MAX_SEGMENTS]
            misc: cute.struct.MemRange[Int32, WARP_COUNTS + FINISH_THREADS // 32]
            sel: cute.struct.Align[cute.struct.MemRange[Int64, self.k2], 16]

        self.segment_storage = SegmentStorage
        self.finish_storage = FinishStorage
        rows = mScores.shape[0]
        grid = [mTieCount.shape[1], rows, 1]
        self.hist_high(mScores, mCounts).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)
        self.hist_low(mScores, mCounts).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)
        self.collect(mScores, mCounts, mSelKey, mSelPos, mTieCount, mTiePos).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream)
        self.finish(mCounts, mLo, mSelKey, mSelPos, mTieCount, mTiePos, mOutV, mOutI).launch(
            grid=[rows, 1, 1], block=[FINISH_THREADS, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device
    @cute.jit
    def load_keys(self, mScores: cute.Tensor, r: Int32, seg: Int32, tidx: Int32,
                  keys: cute.Tensor):
        """This thread's ``VEC`` keys of segment ``seg`` of row ``r`` (``ABSENT`` past it)."""
        width = mScores.shape[1]
        p0 = seg * SEGMENT + tidx * VEC
        for v in cutlass.range_constexpr(VEC):
            keys[v] = Int32(ABSENT)
        if const_expr(self.vector):
            if p0 < width:
                addr = mScores.iterator.toint() + (r.to(Int64) * width + p0) * 2
                src = cute.make_tensor(
                    cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=16),
                    cute.make_layout((VEC // 2,)))
                words = cute.make_rmem_tensor((VEC // 2,), Int32)
                words.store(src.load())
                for v in cutlass.range_constexpr(VEC // 2):
                    w = words[v]
                    keys[2 * v] = self.order_key(w & 0xFFFF)
                    keys[2 * v + 1] = self.order_key((w >> 16) & 0xFFFF)
        else:
            for v in cutlass.range_constexpr(VEC):
                if p0 + v < width:
                    keys[v] = self.key_at(mScores, mScores, r, p0 + v, Int32(0))

    @cute.jit
    def find_threshold(self, mCounts: cute.Tensor, r: Int32, hist: cute.Tensor,
                       misc: cute.Tensor, tidx: Int32, lane: Int32, warp: Int32,
                       low: cutlass.Constexpr):
        """From the row's global histograms: (high byte, keys above its bin) of the k-th
        largest key; with ``low`` also (threshold key T, keys above T)."""
        hist[tidx] = mCounts[r, HIGH + tidx]
        cute.arch.barrier()
        self.find_bin(hist, misc, Int32(self.k), tidx, lane, warp)
        bin_hi = misc[BIN]
        above_hi = misc[ABOVE]
        threshold, above = bin_hi, above_hi
        if const_expr(low):
            hist[tidx] = mCounts[r, LOW + tidx]
            cute.arch.barrier()
            self.find_bin(hist, misc, self.k - above_hi, tidx, lane, warp)
            threshold = (bin_hi << 8) | misc[BIN]
            above = above_hi + misc[ABOVE]
        return threshold, above

    @cute.jit
    def add_histogram(self, mCounts: cute.Tensor, r: Int32, base: cutlass.Constexpr,
                      hist: cute.Tensor, tidx: Int32):
        """Add the CTA's shared histogram to the row's global one (after a barrier)."""
        cute.arch.barrier()
        n = hist[tidx]
        if n > 0:
            cute.arch.atomic_add(mCounts.iterator + (r * COUNT_WORDS + base + tidx), n)

    @cute.kernel
    def hist_high(self, mScores: cute.Tensor, mCounts: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        seg, r, _ = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate(self.segment_storage)
        hist = storage.hist.get_tensor(cute.make_layout((BINS,)))
        hist_ptr = storage.hist.data_ptr()
        keys = cute.make_rmem_tensor((VEC,), Int32)
        self.load_keys(mScores, r, seg, tidx, keys)
        hist[tidx] = Int32(0)
        cute.arch.barrier()
        for v in cutlass.range_constexpr(VEC):
            if keys[v] != ABSENT:
                cute.arch.atomic_add(hist_ptr + (keys[v] >> 8), Int32(1))
        self.add_histogram(mCounts, r, HIGH, hist, tidx)

    @cute.kernel
    def hist_low(self, mScores: cute.Tensor, mCounts: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        seg, r, _ = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate(self.segment_storage)
        hist = storage.hist.get_tensor(cute.make_layout((BINS,)))
        misc = storage.misc.get_tensor(cute.make_layout((WARP_COUNTS + THREADS // 32,)))
        hist_ptr = storage.hist.data_ptr()
        keys = cute.make_rmem_tensor((VEC,), Int32)
        self.load_keys(mScores, r, seg, tidx, keys)
        bin_hi, _ = self.find_threshold(mCounts, r, hist, misc, tidx, tidx % 32, tidx // 32,
                                        False)
        hist[tidx] = Int32(0)
        cute.arch.barrier()
        for v in cutlass.range_constexpr(VEC):
            if keys[v] >> 8 == bin_hi:              # ABSENT >> 8 is -1: never a bin
                cute.arch.atomic_add(hist_ptr + (keys[v] & 0xFF), Int32(1))
        self.add_histogram(mCounts, r, LOW, hist, tidx)

    @cute.kernel
    def collect(self, mScores: cute.Tensor, mCounts: cute.Tensor, mSelKey: cute.Tensor,
                mSelPos: cute.Tensor, mTieCount: cute.Tensor, mTiePos: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        seg, r, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        storage = cutlass.memory.SmemAllocator().allocate(self.segment_storage)
        hist = storage.hist.get_tensor(cute.make_layout((BINS,)))
        misc = storage.misc.get_tensor(cute.make_layout((WARP_COUNTS + THREADS // 32,)))
        keys = cute.make_rmem_tensor((VEC,), Int32)
        self.load_keys(mScores, r, seg, tidx, keys)
        threshold, above = self.find_threshold(mCounts, r, hist, misc, tidx, lane, warp, True)
        take = self.k - above
        if seg == 0 and tidx == 0:
            mCounts[r, THRESHOLD] = threshold
            mCounts[r, ABOVE_COUNT] = above
            mCounts[r, TAKE] = take
        p0 = seg * SEGMENT + tidx * VEC
        wins = Int32(0)
        ties = Int32(0)
        for v in cutlass.range_constexpr(VEC):
            if keys[v] > threshold:
                wins = wins + 1
            if keys[v] == threshold:
                ties = ties + 1

        # keys above T: the warp's slots from the row's counter, one atomic per warp
        win_incl = self.warp_inclusive_sum(wins, lane)
        warp_wins = cute.arch.shuffle_sync(win_incl, 31)
        base = Int32(0)
        if lane == 31 and warp_wins > 0:
            base = cute.arch.atomic_add(mCounts.iterator + (r * COUNT_WORDS + SLOTS), warp_wins)
        slot = cute.arch.shuffle_sync(base, 31) + win_incl - wins
        for v in cutlass.range_constexpr(VEC):
            if keys[v] > threshold:
                mSelKey[r, slot] = keys[v]
                mSelPos[r, slot] = p0 + v
                slot = slot + 1

        # ties: ranks in position order (thread order, then v), the first `take` kept
        tie_incl = self.warp_inclusive_sum(ties, lane)
        if lane == 31:
            misc[WARP_COUNTS + warp] = tie_incl
        cute.arch.barrier()
        rank = tie_incl - ties
        total = Int32(0)
        for w in cutlass.range_constexpr(THREADS // 32):
            n = misc[WARP_COUNTS + w]
            if w < warp:
                rank = rank + n
            total = total + n
        for v in cutlass.range_constexpr(VEC):
            if keys[v] == threshold:
                if rank < take:
                    mTiePos[r, seg, rank] = p0 + v
                rank = rank + 1
        if tidx == 0:
            mTieCount[r, seg] = cutlass.min(total, take)

    @cute.kernel
    def finish(self, mCounts: cute.Tensor, mLo: cute.Tensor, mSelKey: cute.Tensor,
               mSelPos: cute.Tensor, mTieCount: cute.Tensor, mTiePos: cute.Tensor,
               mOutV: cute.Tensor, mOutI: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        r, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        storage = cutlass.memory.SmemAllocator().allocate(self.finish_storage)
        starts = storage.starts.get_tensor(cute.make_layout((MAX_SEGMENTS,)))
        misc = storage.misc.get_tensor(cute.make_layout((WARP_COUNTS + FINISH_THREADS // 32,)))
        sel = storage.sel.get_tensor(cute.make_layout((self.k2,)))
        segments = mTieCount.shape[1]
        threshold = mCounts[r, THRESHOLD]
        above = mCounts[r, ABOVE_COUNT]
        take = mCounts[r, TAKE]

        # each segment's first tie slot: an exclusive scan, two segments a thread
        a = Int32(0)
        b = Int32(0)
        if 2 * tidx < segments:
            a = mTieCount[r, 2 * tidx]
        if 2 * tidx + 1 < segments:
            b = mTieCount[r, 2 * tidx + 1]
        incl = self.warp_inclusive_sum(a + b, lane)
        if lane == 31:
            misc[WARP_COUNTS + warp] = incl
        cute.arch.barrier()
        start = incl - a - b
        for w in cutlass.range_constexpr(FINISH_THREADS // 32):
            if w < warp:
                start = start + misc[WARP_COUNTS + w]
        starts[2 * tidx] = start
        starts[2 * tidx + 1] = start + a
        cute.arch.barrier()

        for i in cutlass.range(tidx, above, FINISH_THREADS, unroll=1):
            sel[i] = self.word(mSelKey[r, i], mSelPos[r, i])
        for i in cutlass.range(tidx, take, FINISH_THREADS, unroll=1):
            # the last segment starting at or before tie i holds it (starts ascend)
            s = Int32(0)
            for step in cutlass.range_constexpr(MAX_SEGMENTS.bit_length() - 2, -1, -1):
                probe = s + (1 << step)
                if probe < segments:
                    if starts[probe] <= i:
                        s = probe
            sel[above + i] = self.word(threshold, mTiePos[r, s, i - starts[s]])
        for i in cutlass.range(tidx, self.k2, FINISH_THREADS, unroll=1):
            if i >= self.k:
                sel[i] = Int64(-1)
        self.sort_words(sel, tidx)
        lo = mLo[0]
        for i in cutlass.range(tidx, self.k, FINISH_THREADS, unroll=1):
            key, pos = self.unword(sel[i])
            mOutV[r, i] = self.key_value(key).to(mOutV.element_type)
            mOutI[r, i] = lo + pos

    @cute.jit
    def warp_inclusive_sum(self, x: Int32, lane: Int32) -> Int32:
        for s in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(x, offset=1 << s)
            if lane >= (1 << s):
                x = x + up
        return x


@cute.jit
def index_topk_split_launcher(stream: cuda.CUstream, scores: cute.Tensor, counts: cute.Tensor,
                              lo: cute.Tensor, sel_key: cute.Tensor, sel_pos: cute.Tensor,
                              tie_count: cute.Tensor, tie_pos: cute.Tensor,
                              out_values: cute.Tensor, out_ids: cute.Tensor, *,
                              k: cutlass.Constexpr, vector: cutlass.Constexpr):
    """``cutlass_call`` entry point: (stream, *inputs, *outputs, **static config); ``counts``
    ``[R, COUNT_WORDS]`` int32 zeros, updated in place."""
    IndexTopkSplitSm90(k, vector)(scores, counts, lo, sel_key, sel_pos, tie_count, tie_pos,
                                  out_values, out_ids, stream)


__all__ = ["IndexTopkSplitSm90", "index_topk_split_launcher", "segments_of", "SEGMENT",
           "MAX_SEGMENTS", "COUNT_WORDS"]
