"""The mHC stream mixes of many rows for Hopper (sm_90a), in CuTe DSL: the prefill's GEMM of
``hc_stream_mixes`` (``ffi/hc_mixes.py``; docs/architecture.md §3.2).

For rows X ``[R, K]`` (bf16, K = n d, the flattened streams) and fn ``[M, K]`` (f32) it writes
per K slice s (grid y) the partial sums

    part[s, r, m]  = sum_{k in slice s} X[r, k] fn[m, k]       (m < M)
    part[s, r, 24] = sum_{k in slice s} X[r, k]^2

and the op adds the slices in order and scales the mixes by rsqrt(mean + eps) (one XLA
fusion). Why a kernel: XLA's BF16_BF16_F32_X6 dot for this shape (M = 24 columns over K =
16384) runs at a fraction of the rate of reading the rows (docs/performance.md).

Dataflow (CTA = 4 warps; warp w takes rows [R0 + 16 tiles w, + 16 tiles) and all CHUNK-column
chunks of its slice; no shared memory, no barrier):
1. Per chunk, lane 4 g + t loads 16 consecutive bf16 (two 16-byte loads, not kept in L1) of
   rows g and g + 8 of each 16-row tile, and 16 consecutive f32 of fn rows 8 j + g (four
   16-byte loads, kept in L1: the CTA's 4 warps read the same fn). The next chunk's loads
   are issued before this chunk's MMAs (registers double-buffered).
2. The lane's 16 columns are the K positions of four ``mma.sync.m16n8k16`` steps: in step s
   its A pairs (columns 2t, 2t+1 and 2t+8, 2t+9 of the MMA) are physical columns 16t + 4s +
   {0, 1} and {2, 3} of the chunk, and its B pairs of fn are the same columns -- a
   permutation of K that A and B share, so every product is a product of X and fn at the
   same k.
3. fn is split in registers into three bf16 parts that sum to it exactly (truncations:
   hi = top 8 significant bits, mid = the next 8 of the remainder, lo = the rest, <= 8
   bits); each part is one MMA into the same f32 accumulators: every product is exact in
   f32. A chunk's MMAs start from zero and their sums are added to the lane's totals with
   f32 adds: the tensor cores' accumulation (which does not round to nearest) runs over 4
   steps at most, the long sums round to nearest.
4. The sums of squares come from the tensor cores too: an MMA with B = the tile's own A pairs
   of rows g (or g + 8) gives X_tile X_rows^T, whose diagonal entries are the rows' sums of
   squares (lane 4 g + g / 2 holds rows g and g + 8).
5. Rows past R load row R - 1 and store nothing.

Numerics: f32 sums of exact products -- the MMAs' within a chunk, round-to-nearest adds across
chunks and (in the op) slices; the mixes equal the f32 GEMM's up to the summation order
(tests/test_hc_mixes.py bounds them against float64).

Constraints (``hc_mixes_config``): bf16 X, f32 fn, M a multiple of 8 up to 24, K a multiple
of CHUNK x slices, R K < 2^31.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .grouped_gemm_sm90_convert import load_global_words, mma_m16n8k16_bf16
from .hc_mixes_config import CHUNK, MAX_MIXES, WARPS, HcMixesSm90Config
from .sm90_primitives import split_bf16x3

STEPS = CHUNK // 16             # MMA steps per chunk
X_WORDS = 8                     # 16 bf16 per row and lane per chunk
FN_WORDS = 16                   # 16 f32 per fn row and lane per chunk


class HcMixesSm90:
    """Static configuration of one compiled kernel (see the module docstring)."""

    def __init__(self, mixes: int, config: HcMixesSm90Config):
        self.mixes = mixes
        self.ntiles = mixes // 8
        self.tiles = config.tiles
        self.slices = config.slices
        self.rows_per_cta = config.rows_per_cta

    @cute.jit
    def __call__(self, mX: cute.Tensor, mFn: cute.Tensor, mPart: cute.Tensor,
                 stream: cuda.CUstream):
        rows = mX.shape[0]
        blocks = (rows + self.rows_per_cta - 1) // self.rows_per_cta
        self.kernel(mX, mFn, mPart).launch(grid=[blocks, self.slices, 1],
                                           block=[WARPS * 32, 1, 1], stream=stream)

    @cute.jit
    def load_chunk(self, xw: cute.Tensor, fw: cute.Tensor, row_addr: list, fn_addr: list,
                   column: Int32):
        """The lane's words of the chunk starting at slice column ``column``: rows into
        ``xw`` [tiles * 2 * X_WORDS], fn into ``fw`` [ntiles * FN_WORDS]."""
        for q in cutlass.range_constexpr(2 * self.tiles):
            for u in cutlass.range_constexpr(2):
                words = load_global_words(row_addr[q] + Int64(column * 2 + 16 * u), 4)
                for w in cutlass.range_constexpr(4):
                    xw[q * X_WORDS + 4 * u + w] = words[w]
        for j in cutlass.range_constexpr(self.ntiles):
            for u in cutlass.range_constexpr(4):
                words = load_global_words(fn_addr[j] + Int64(column * 4 + 16 * u), 4,
                                          keep_in_l1=True)
                for w in cutlass.range_constexpr(4):
                    fw[j * FN_WORDS + 4 * u + w] = words[w]

    @cute.jit
    def mma_chunk(self, acc: cute.Tensor, sq: cute.Tensor, xw: cute.Tensor, fw: cute.Tensor):
        """The chunk's MMAs (module docstring, steps 2-4): its sums start from zero in the
        MMAs' accumulators and are added to ``acc`` / ``sq`` once per chunk (f32 adds,
        round-to-nearest), so no tensor-core accumulation chain runs longer than a chunk."""
        zero = Float32(0.0)
        mix_sums = [[(zero,) * 4 for _ in range(self.ntiles)] for _ in range(self.tiles)]
        square_sums = [[(zero,) * 4 for _ in range(2)] for _ in range(self.tiles)]
        for s in cutlass.range_constexpr(STEPS):
            parts = []                              # [j] -> ((hi, mid, lo) of b0, of b1)
            for j in cutlass.range_constexpr(self.ntiles):
                f = j * FN_WORDS + 4 * s
                parts.append((split_bf16x3(fw[f], fw[f + 1]),
                              split_bf16x3(fw[f + 2], fw[f + 3])))
            for i in cutlass.range_constexpr(self.tiles):
                g_row, g8_row = (2 * i) * X_WORDS, (2 * i + 1) * X_WORDS
                a = (xw[g_row + 2 * s], xw[g8_row + 2 * s], xw[g_row + 2 * s + 1],
                     xw[g8_row + 2 * s + 1])
                for j in cutlass.range_constexpr(self.ntiles):
                    c = mix_sums[i][j]
                    for p in cutlass.range_constexpr(3):
                        c = mma_m16n8k16_bf16(a, (parts[j][0][p], parts[j][1][p]), c)
                    mix_sums[i][j] = c
                for h in cutlass.range_constexpr(2):    # B = rows g (h = 0) or g + 8 (h = 1)
                    square_sums[i][h] = mma_m16n8k16_bf16(a, (a[h], a[h + 2]),
                                                          square_sums[i][h])
        for i in cutlass.range_constexpr(self.tiles):
            for j in cutlass.range_constexpr(self.ntiles):
                for e in cutlass.range_constexpr(4):
                    acc[(i * self.ntiles + j) * 4 + e] += mix_sums[i][j][e]
            for h in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(4):
                    sq[(2 * i + h) * 4 + e] += square_sums[i][h][e]

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mFn: cute.Tensor, mPart: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        block, slice_, _ = cute.arch.block_idx()
        rows, k = mX.shape[0], mX.shape[1]
        warp, lane = tidx // 32, tidx % 32
        g, t = lane // 4, lane % 4
        row0 = block * self.rows_per_cta + warp * (16 * self.tiles)
        chunks = k // (CHUNK * self.slices)
        k0 = slice_ * chunks * CHUNK
        x_base, fn_base = mX.iterator.toint(), mFn.iterator.toint()
        row_addr = []                               # [2 i + h]: row 16 i + 8 h + g, column 16 t
        for q in cutlass.range_constexpr(2 * self.tiles):
            row = row0 + 16 * (q // 2) + 8 * (q % 2) + g
            row = cutlass.min(row, rows - 1)
            row_addr.append(x_base + (Int64(row) * Int64(k) + Int64(k0 + 16 * t)) * 2)
        fn_addr = [fn_base + (Int64(8 * j + g) * Int64(k) + Int64(k0 + 16 * t)) * 4
                   for j in range(self.ntiles)]
        acc = cute.make_rmem_tensor((self.tiles * self.ntiles * 4,), Float32)
        acc.fill(0.0)
        sq = cute.make_rmem_tensor((self.tiles * 2 * 4,), Float32)
        sq.fill(0.0)
        xw = cute.make_rmem_tensor((self.tiles * 2 * X_WORDS,), Int32)
        fw = cute.make_rmem_tensor((self.ntiles * FN_WORDS,), Int32)
        xw_next = cute.make_rmem_tensor((self.tiles * 2 * X_WORDS,), Int32)
        fw_next = cute.make_rmem_tensor((self.ntiles * FN_WORDS,), Int32)
        self.load_chunk(xw_next, fw_next, row_addr, fn_addr, Int32(0))
        for c in cutlass.range(chunks, unroll=1):
            for e in cutlass.range_constexpr(self.tiles * 2 * X_WORDS):
                xw[e] = xw_next[e]
            for e in cutlass.range_constexpr(self.ntiles * FN_WORDS):
                fw[e] = fw_next[e]
            # The next chunk's loads before this chunk's MMAs (the last chunk reloads itself).
            ahead = cutlass.min(c + 1, chunks - 1)
            self.load_chunk(xw_next, fw_next, row_addr, fn_addr, ahead * CHUNK)
            self.mma_chunk(acc, sq, xw, fw)
        self.store(mPart, acc, sq, slice_, row0, rows, g, t)

    @cute.jit
    def store(self, mPart: cute.Tensor, acc: cute.Tensor, sq: cute.Tensor, slice_: Int32,
              row0: Int32, rows: Int32, g: Int32, t: Int32):
        """Lane 4 g + t: mixes 8 j + 2t, 8 j + 2t + 1 of rows g, g + 8 of each tile; the
        lanes with t = g / 2 also the two rows' sums of squares (the diagonal entries)."""
        for i in cutlass.range_constexpr(self.tiles):
            for h in cutlass.range_constexpr(2):
                row = row0 + 16 * i + 8 * h + g
                if row < rows:
                    for j in cutlass.range_constexpr(self.ntiles):
                        base = (i * self.ntiles + j) * 4 + 2 * h
                        mPart[slice_, row, 8 * j + 2 * t] = acc[base]
                        mPart[slice_, row, 8 * j + 2 * t + 1] = acc[base + 1]
                    if t == g // 2:
                        base = (2 * i + h) * 4 + 2 * h
                        mPart[slice_, row, MAX_MIXES] = Float32(
                            cutlass.select_(g % 2 == 0, sq[base], sq[base + 1]))


@cute.jit
def hc_mixes_launcher(stream: cuda.CUstream, x: cute.Tensor, fn: cute.Tensor,
                      part: cute.Tensor, *, mixes: cutlass.Constexpr,
                      tiles: cutlass.Constexpr = 2, slices: cutlass.Constexpr = 8):
    """``cutlass_call`` entry point: (stream, *inputs, *outputs, **static config)."""
    HcMixesSm90(mixes, HcMixesSm90Config(tiles, slices))(x, fn, part, stream)
