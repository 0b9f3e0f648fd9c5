"""Grouped expert GEMM for prefill tiles on FP8 tensor cores with two math warpgroups:
``algorithm="wgmma_fp8_coop"`` (sm_90a), the prefill default for FP4/FP8 weights.

"wgmma_fp8" (``grouped_gemm_sm90_wgmma_fp8``: the same e4m3 token codes and scales, FP4 scale
fold -- ``convert_half_row``, shared --, K = 32 FP8 WGMMA chain per K block and promotion, so
outputs equal bit for bit) with a CTA like "wgmma_coop"'s: a producer warpgroup that only
copies, and two math warpgroups that each convert their own weight rows and multiply them
against the shared token codes. Math warpgroup w multiplies one (matrix, 64-row block):
gated, matrix w (w1, w3) of the CTA's 64 rows; ungated, rows [64 w, 64 w + 64) of 128. One
accumulator and two block accumulators per math thread leave registers for token tiles of
128 rows, so each weight byte is converted once per 128 tokens.

Why (docs/performance.md, "FP8 WGMMAs converted by two math warpgroups"): "wgmma_fp8" halves
the tensor-core time of "wgmma_coop" but its one producer warpgroup converts every weight
byte and bounds the launch; "wgmma_coop" spreads the conversion over two warpgroups but
multiplies bf16. Here the conversion is spread and the WGMMAs are e4m3.

Dataflow (384 threads; the producer hands registers to the math warpgroups with
``setmaxnreg``):

1. WG0, K block ``kb``: cp.async copies of the CTA's 128 weight rows' raw bytes (consecutive
   threads copy consecutive 16-byte chunks: whole 32-byte sectors; FP8: into the stage's A
   tiles), their scale words
   (thread t: row t), the tile's token codes and token scales into stage
   ``kb % num_stages``; an mbarrier arrive on their completion.
2. Math warpgroup w (WG1 + w), two K blocks per iteration: waits for a stage, converts
   (FP4) its 64 rows into its own e4m3 A tile of that block's parity (thread t: row t / 2, K half
   t % 2; the codes stored as 32-bit words at the swizzled address, ``a_chunk_offset``) and
   writes the rows' promotion scales, then issues that block's WGMMA chain into a block
   accumulator of the same parity. The second block's conversion runs under the first
   block's WGMMAs, the first block's promotion ``acc += blk * w_scale[row] *
   x_scale[token]`` under the second's. A stage is released after its chain retired and
   was promoted. The promotion skips the tile's columns past its rows (groups of
   ``PROMOTE_COLUMNS``) and reads a lane's token scales, which the producer stored together
   (``x_scale_slot``), by vector loads.
3. Epilogue (bf16): ungated, each warpgroup writes its 64 output features of the tile's
   rows; gated, the up projection's warpgroup stores its sums in shared memory, and after a
   barrier of both the gate's warpgroup writes SwiGLU x routing weight.

FP8 weights need no conversion (``direct``): the producer copies each 16-byte chunk of a
weight row straight to its swizzled place in the stage's A tile (``a_chunk_offset``; stage s
holds A tiles 2 s and 2 s + 1, the CTA's rows 0-63 and 64-127 -- gated, w1's and w3's 64),
the math warpgroups only wait, multiply and promote, and the promotion's weight scale is the
128 x 128 block's one scale, so its products with the token scales are per column (one FMUL
per column, one FFMA per element). Without the conversion's own A tiles a stage more fits.

A tile row of a math warpgroup is converted by the warp that holds its accumulator rows
(row t / 2 of thread t: warp w converts rows 16 w .. 16 w + 15, the rows of its WGMMA
fragment), so an A tile of parity p is rewritten only after that warp's own wait retired the
chain that read it; one named barrier per warpgroup and block orders its four warps' stores
before their WGMMAs.

Constraints: sm_90a; FP4/FP8 weights with the FP8 activation simulation; K a multiple of 256
(an even number of K blocks); output features a multiple of 128; block_n <= 128 (registers:
an accumulator and two block accumulators of 64 x block_n f32 per math warpgroup); ablations
"no_dequant" (A tiles not written) and "no_mma" (no WGMMA; outputs wrong by design).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync

from .sm90_primitives import cp_async_arrive, store_shared_b32x4, store_shared_f32x4
from .grouped_gemm_config import BLOCK_K, BLOCK_M, GroupedGemmSm90Config
from .grouped_gemm_layout import weight_offset
from .grouped_gemm_sm90_convert import copy_bytes, e8m0_f32
from .grouped_gemm_sm90_wgmma import DEQUANT_BARRIER
from .grouped_gemm_sm90_wgmma_fp8 import (CHUNK, GroupedGemmWgmmaFp8Sm90, _fence_operands,
                                          convert_half_row)

HANDOFF_BARRIER = 5     # gated: the up projection's sums are in shared memory (both warpgroups)
# Columns (token rows of the tile) promoted under one branch: a group past the tile's rows is
# skipped; each branch splits the promotion's basic block, which costs more than the skip saves
# at 16 columns (docs/performance.md, twenty-sixth session).
PROMOTE_COLUMNS = 32
X_SCALE_PAD = 4          # f32 slots after each lane's token scales (x_scale_slot)
A_TILE_BYTES = BLOCK_M * BLOCK_K     # one e4m3 A tile


def a_chunk_offset(buf, row, chunk):
    """Byte offset in the A tiles of 16-byte chunk ``chunk`` (K columns 16 chunk ..
    16 chunk + 15) of row ``row`` of tile ``buf``: K-major rows of 128 bytes with the
    WGMMA's 128-byte swizzle (the chunk index XOR the row mod 8), as
    ``make_smem_layout_a`` lays out e4m3 tiles of K = 128 (tests/ replay it against CuTe's
    layout). Works on ints and kernel integers alike."""
    return buf * A_TILE_BYTES + row * BLOCK_K + ((chunk ^ (row & 7)) << 4)


def x_scale_slot(token, block_n):
    """The slot of a tile's token ``token`` among a stage's ``x_scale_slots(block_n)``: the
    scales a promoting lane t needs -- columns 8 j + 2 (t % 4) + {0, 1} -- lie together,
    ``block_n / 4`` of them in column order from slot ``(t % 4) (block_n / 4 +
    X_SCALE_PAD)``; the pad puts the four lanes' vector loads in distinct banks. Works on ints
    and kernel integers alike."""
    return (token % 8 // 2) * (block_n // 4 + X_SCALE_PAD) + token // 8 * 2 + token % 2


def x_scale_slots(block_n):
    """A stage's token scale slots (``x_scale_slot``)."""
    return block_n + 4 * X_SCALE_PAD


class GroupedGemmWgmmaFp8CoopSm90(GroupedGemmWgmmaFp8Sm90):
    """Static configuration of one compiled kernel (see the module docstring)."""

    MATH_WARPGROUPS = 2

    def __init__(self, weight_format: str, gated: bool, swiglu_limit: float,
                 config: GroupedGemmSm90Config, scale_group: int = 1):
        super().__init__(weight_format, gated, swiglu_limit, config, scale_group)
        # Math warpgroup w multiplies one (matrix, 64-row block): gated, matrix w of the
        # CTA's 64 rows; ungated, rows [64 w, 64 w + 64) of the one matrix.
        self.cta_rows = BLOCK_M if gated else 2 * BLOCK_M
        # FP8 weights are copied into the stages' A tiles as they are (``direct``): two per
        # stage (the CTA's rows 0-63, 64-127). FP4: A tiles per (math warpgroup, parity of
        # the K block), converted by the math warpgroups themselves.
        self.direct = weight_format == "fp8"
        self.a_parity = 2
        self.a_buffers = (2 * self.num_stages if self.direct
                          else self.math_wgs * self.a_parity)

    @cute.jit
    def storage_struct(self, sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout):
        """Shared memory: per stage the rows' promotion scales (written by the math
        warpgroups), the token scales, one scale word per weight row and matrix, the raw
        weight bytes (FP4; FP8 weights go to the A tiles) and the token codes; the A tiles;
        gated, the up projection's accumulators handed to the gate's warpgroup for the
        epilogue."""
        stages, mats, bn, rows = self.num_stages, self.mats, self.block_n, self.cta_rows
        handoff = BLOCK_M * bn if self.gated else 4
        raw_bytes = 16 if self.direct else stages * mats * rows * self.row_bytes

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[Int64, 2 * stages]
            sWs: cute.struct.Align[cute.struct.MemRange[Float32, stages * mats * rows], 16]
            sXs: cute.struct.Align[cute.struct.MemRange[Float32, stages * x_scale_slots(bn)],
                                   16]
            sScale: cute.struct.Align[cute.struct.MemRange[Int32, stages * mats * rows], 16]
            sUp: cute.struct.Align[cute.struct.MemRange[Float32, handoff], 16]
            sRaw: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, raw_bytes], 128]
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
        """WG0: every K block's copies into the next free stage (no conversion here)."""
        raw = storage.sRaw.data_ptr().toint()
        scales = storage.sScale.data_ptr().toint()
        xs = storage.sXs.data_ptr().toint()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                             self.num_stages)
        for kb in cutlass.range(num_k, unroll=1):
            pipe.producer_acquire(state)
            self.issue_block(mX, mXs, mWa, mSa, mWb, mSb, expert, m_tile, row0, rows, kb,
                             state.index, raw, scales, xs, sB, tidx,
                             storage.sA.data_ptr().toint())
            cp_async_arrive(pipe.producer_get_barrier(state))
            pipe.producer_commit(state)
            state.advance()
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def issue_block(self, mX: cute.Tensor, mXs: cute.Tensor, mWa: cute.Tensor,
                    mSa: cute.Tensor, mWb: cute.Tensor, mSb: cute.Tensor, expert: Int32,
                    m_tile: Int32, row0: Int32, rows: Int32, kb: Int32, stage: Int32,
                    raw: Int32, scales: Int32, xs: Int32, sB: cute.Tensor, tidx: Int32,
                    a_tiles: Int32):
        """Thread ``tidx``'s cp.async copies of K block ``kb`` into ``stage``: 16-byte weight
        chunks ``tidx + 128 i`` of each matrix's ``cta_rows`` rows (FP8: to their places in
        the stage's A tiles at ``a_tiles``), row ``tidx``'s scale word (FP8: thread 0 the
        row block's word), 16-byte token chunks ``tidx + 128 i`` and token ``tidx``'s
        scale."""
        bn, cta_rows = self.block_n, self.cta_rows
        n_out = mWa.shape[1]
        k_in = mX.shape[1]
        atom16 = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), cutlass.Uint8,
            num_bits_per_copy=128)
        atom4 = cute.make_copy_atom(cpasync.CopyG2SOp(), cutlass.Uint8, num_bits_per_copy=32)
        w_row0 = (expert * n_out + m_tile * cta_rows).to(Int64)
        num_k = k_in // BLOCK_K
        chunks = self.row_bytes // 16             # 16-byte chunks per row and K block
        rows_per_copy = 128 // chunks
        for mat in cutlass.range_constexpr(self.mats):
            w_base = (mWa if mat == 0 else mWb).iterator.toint()
            s_base = (mSa if mat == 0 else mSb).iterator.toint()
            # Copy i: row i * rows_per_copy + tidx / chunks, chunk tidx % chunks: consecutive
            # threads copy consecutive chunks of a row, so each copy instruction reads whole
            # 32-byte sectors. Copy i's row lies i * rows_per_copy rows further on: as the
            # tile's first row is a multiple of 64 and this thread's is below rows_per_copy
            # (a divisor of 64), the offset between them is that of row i * rows_per_copy
            # from row 0, in either layout -- a constant step, not a new address per copy.
            src = w_base + weight_offset(w_row0 + tidx // chunks, kb, num_k, self.row_bytes,
                                         self.weight_layout) + (tidx % chunks) * 16
            dst = raw + (stage * self.mats + mat) * cta_rows * self.row_bytes + tidx * 16
            if const_expr(self.direct):
                # Row mat * cta_rows + r of the stage's two A tiles (r = tidx / 8 + 16 i;
                # each tile is BLOCK_M rows of BLOCK_K bytes, so the rows run on across
                # them); the swizzle depends on r mod 8 = (tidx / 8) mod 8 only.
                r = tidx // chunks
                dst = a_tiles + a_chunk_offset(2 * stage, mat * cta_rows + r, tidx % chunks)
            for i in cutlass.range_constexpr(cta_rows * chunks // 128):
                step = weight_offset(i * rows_per_copy, 0, num_k, self.row_bytes,
                                     self.weight_layout)
                copy_bytes(atom16, 16, src + step, dst + i * 128 * 16)
            # FP4: the row's 4 scale bytes of this K block; FP8: the aligned 4 bytes holding
            # this K block's byte of the (one) row block's scale row.
            slot = (stage * self.mats + mat) * cta_rows + tidx
            if const_expr(self.weight_format == "fp4"):
                if tidx < cta_rows:
                    src = s_base + (w_row0 + tidx) * (k_in // 32) + (kb * 4).to(Int64)
                    copy_bytes(atom4, 4, src, scales + slot * 4)
            else:
                if tidx == 0:
                    blk_row = (expert * (n_out // 128) + m_tile * cta_rows // 128).to(Int64)
                    src = s_base + blk_row * (k_in // 128) + ((kb // 4) * 4).to(Int64)
                    copy_bytes(atom4, 4, src, scales + slot * 4)
        # Token codes: bn rows x 8 chunks; rows past the tile's count are not copied (their
        # columns are never stored).
        sB_vec = cute.flat_divide(sB, (1, CHUNK))[0, None, None, None, None]
        x_base = mX.iterator.toint()
        atom_x = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), self.dtype,
            num_bits_per_copy=128)
        # Copy i: token row 16 i + tidx / 8, chunk tidx % 8 (only rows < rows <= bn); a
        # running source address.
        tr, c = tidx // 8, tidx % 8
        src = x_base + (row0 + tr).to(Int64) * k_in + (kb * BLOCK_K + c * CHUNK).to(Int64)
        for i in cutlass.range_constexpr((bn + 15) // 16):
            if tr + 16 * i < rows:
                s = cute.make_tensor(cute.make_ptr(self.dtype, src, cute.AddressSpace.gmem,
                                                   assumed_align=16), cute.make_layout((CHUNK,)))
                cute.copy(atom_x, s, sB_vec[None, tr + 16 * i, c, stage])
            src = src + Int64(16 * k_in)
        if tidx < rows:                   # rows <= bn <= 128
            src = mXs.iterator.toint() + ((row0 + tidx).to(Int64) * (k_in // BLOCK_K) + kb) * 4
            copy_bytes(atom4, 4, src,
                       xs + (stage * x_scale_slots(bn) + x_scale_slot(tidx, bn)) * 4)

    @cute.jit
    def convert_rows(self, raw: Int32, scales: Int32, ws: Int32, stage: Int32, mat: Int32,
                     row_block: Int32, kb: Int32, wg_tidx: Int32, a_tiles: Int32, buf: Int32):
        """Row ``row_block + wg_tidx / 2`` of matrix ``mat``, K half ``wg_tidx % 2``: raw
        bytes -> e4m3 codes in A tile ``buf`` at ``a_tiles`` (row ``wg_tidx / 2`` of it);
        the row's promotion scale -> ``ws``."""
        r, half = wg_tidx // 2, wg_tidx % 2
        first = (stage * self.mats + mat) * self.cta_rows       # the matrix's first row slot
        slot = first + row_block + r
        row_addr = raw + slot * self.row_bytes
        # FP4: the row's scale word; FP8: the row block's, copied by producer thread 0.
        word_slot = first
        if const_expr(self.weight_format == "fp4"):
            word_slot = slot
        word = cute.make_tensor(cute.make_ptr(Int32, scales + word_slot * 4,
                                              cute.AddressSpace.smem, assumed_align=4),
                                cute.make_layout((1,)))[0]

        # As 32-bit words at the swizzled address: a bitcast to 16 e4m3 values compiled to
        # byte extracts and re-packs before the store.
        def store(chunk, words):
            if const_expr(not self.leave_out["no_dequant"]):
                store_shared_b32x4(a_tiles + a_chunk_offset(buf, r, chunk),
                                   [words[e] for e in range(4)])
        row_scale = convert_half_row(self.weight_format, word, kb, half, row_addr, store)
        if half == 0:
            cute.make_tensor(cute.make_ptr(Float32, ws + slot * 4, cute.AddressSpace.smem,
                                           assumed_align=4), cute.make_layout((1,)))[0] = \
                row_scale

    @cute.jit
    def consume(self, mRw: cute.Tensor, mOut: cute.Tensor, m_tile: Int32, row0: Int32,
                rows: Int32, num_k: Int32, wg_tidx: Int32, storage, sA: cute.Tensor,
                sB: cute.Tensor, pipe: pipeline.PipelineAsync, tiled_mma: cute.TiledMma,
                math_wg: Int32):
        """Math warpgroup ``math_wg``: per iteration two K blocks, each converted (FP4),
        then its chain issued; the first promoted under the second's chain; then the
        epilogue (gated: the up projection's warpgroup hands its sums to the gate's)."""
        raw = storage.sRaw.data_ptr().toint()
        scales = storage.sScale.data_ptr().toint()
        ws = storage.sWs.data_ptr().toint()
        xs = storage.sXs.data_ptr().toint()
        thr_mma = tiled_mma.get_slice(wg_tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        shape_c = thr_mma.partition_shape_C((BLOCK_M, self.block_n))
        acc = thr_mma.make_fragment_C(shape_c)
        blk = [thr_mma.make_fragment_C(shape_c) for _ in range(2)]
        acc.fill(0.0)
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((BLOCK_M, self.block_n)))
        a_tiles = storage.sA.data_ptr().toint()
        num_kk = cute.size(tCrA, mode=[2])
        dequant_barrier = DEQUANT_BARRIER + 2 * math_wg
        mat, row_block = Int32(0), math_wg * BLOCK_M
        if const_expr(self.gated):
            mat, row_block = math_wg, Int32(0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                             self.num_stages)
        # As "wgmma_fp8": every wait retires a chain of its own iteration (a ring across
        # iterations makes ptxas serialize all WGMMAs, C7514).
        for kb2 in cutlass.range(num_k // 2, unroll=1):
            stages = []
            for p in cutlass.range_constexpr(2):
                pipe.consumer_wait(state)
                a_buf = state.index * 2 + math_wg
                if const_expr(not self.direct):
                    a_buf = math_wg * 2 + p
                    self.convert_rows(raw, scales, ws, state.index, mat, row_block,
                                      2 * kb2 + p, wg_tidx, a_tiles, a_buf)
                # Ordinary stores (A tiles) and cp.async stores (token codes, FP8 weights)
                # are read by the WGMMAs (async proxy); the warpgroup's four warps wrote the
                # A tiles.
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=dequant_barrier, number_of_threads=128)
                _fence_operands([blk[p]])        # the last promotion's reads come first
                cute.nvgpu.warpgroup.fence()
                for kk in cutlass.range_constexpr(0 if self.leave_out["no_mma"] else num_kk):
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, kk > 0)
                    cute.gemm(tiled_mma, blk[p], tCrA[None, None, kk, a_buf],
                              tCrB[None, None, kk, state.index], blk[p])
                cute.nvgpu.warpgroup.commit_group()
                stages.append(state.clone())
                state.advance()
            for p in cutlass.range_constexpr(2):
                self.promote_rows(acc, blk[p], tCcC, ws, scales, xs, stages[p].index, mat,
                                  row_block, rows, 2 * kb2 + p, 1 - p)
                pipe.consumer_release(stages[p])
        if const_expr(self.gated):
            self.gated_epilogue(mRw, mOut, m_tile, row0, rows, thr_mma, acc, wg_tidx, math_wg,
                                storage.sUp.data_ptr().toint())
        else:
            self.epilogue(mRw, mOut, m_tile, row0, rows, thr_mma, acc, acc, math_wg)

    @cute.jit
    def gated_epilogue(self, mRw: cute.Tensor, mOut: cute.Tensor, m_tile: Int32, row0: Int32,
                       rows: Int32, thr_mma: cute.ThrMma, acc: cute.Tensor, wg_tidx: Int32,
                       math_wg: Int32, up: Int32):
        """The up projection's warpgroup (1) stores its sums in shared memory, element i of
        thread t at ``4 (128 (i / 4) + t) + i % 4`` (16-byte stores, consecutive threads on
        consecutive addresses); the gate's (0), after a barrier of both, reads the same
        positions and writes the SwiGLU x routing weight outputs."""
        count = cute.size(acc)
        if math_wg == 1:
            for q in cutlass.range_constexpr(count // 4):
                store_shared_f32x4(up + (q * 128 + wg_tidx) * 16,
                                   [acc[4 * q + e] for e in range(4)])
        cute.arch.barrier(barrier_id=HANDOFF_BARRIER, number_of_threads=256)
        if math_wg == 0:
            acc_up = cute.make_rmem_tensor(acc.layout, Float32)
            for q in cutlass.range_constexpr(count // 4):
                words = cute.make_tensor(
                    cute.make_ptr(Float32, up + (q * 128 + wg_tidx) * 16,
                                  cute.AddressSpace.smem, assumed_align=16),
                    cute.make_layout((4,))).load()
                for e in cutlass.range_constexpr(4):
                    acc_up[4 * q + e] = words[e]
            self.epilogue(mRw, mOut, m_tile, row0, rows, thr_mma, acc, acc_up, 0)

    @cute.jit
    def promote_rows(self, acc: cute.Tensor, blk: cute.Tensor, tCcC: cute.Tensor, ws: Int32,
                     scales: Int32, xs: Int32, stage: Int32, mat: Int32, row_block: Int32,
                     rows: Int32, kb: Int32, wait: cutlass.Constexpr):
        """Waits for all but ``wait`` WGMMA chains, then ``acc[m, n] += blk[m, n] *
        w_scale[row_block + m] * x_scale[n]`` for K block ``kb``'s stage of matrix ``mat``
        (FP8 weights: one ``w_scale``, the block's, from the stage's scale word at
        ``scales``, so the products ``w_scale * x_scale[n]`` are one per column).

        Columns ``n`` go in groups of ``PROMOTE_COLUMNS`` (8 where that does not divide
        ``block_n``): a group wholly past the tile's
        ``rows`` is skipped (its outputs are never stored; its token codes were not copied),
        a warp-uniform branch. Element ``i`` of the WGMMA accumulator fragment holds row
        ``16 warp + t / 4 + 8 ((i / 2) % 2)`` and column ``8 (i / 4) + 2 (t % 4) + i % 2``
        of lane t: the thread's two row scales are loaded once, and its token scales of a
        group lie together (``x_scale_slot``): one or two vector loads, the first group's
        issued before the wait."""
        bn = self.block_n
        # Groups of 8 columns (one accumulator block) where PROMOTE_COLUMNS does not divide bn.
        group = PROMOTE_COLUMNS if bn % PROMOTE_COLUMNS == 0 else 8
        per_group = cute.size(acc) * group // bn       # elements of a group
        loads = group // 4                             # its token scales per thread
        align = 16 if bn % 16 == 0 and loads % 4 == 0 else 8     # bytes (x_scale_slot)
        first = (stage * self.mats + mat) * self.cta_rows + row_block
        w_scales = cute.make_tensor(
            cute.make_ptr(Float32, ws + first * 4, cute.AddressSpace.smem, assumed_align=16),
            cute.make_layout((BLOCK_M,)))
        # Element i's row is element (i % 4)'s.
        if const_expr(self.direct):
            word = cute.make_tensor(
                cute.make_ptr(Int32, scales + (stage * self.mats + mat) * self.cta_rows * 4,
                              cute.AddressSpace.smem, assumed_align=4), cute.make_layout((1,)))[0]
            block_scale = e8m0_f32((word >> (8 * (kb % 4))) & 0xFF)
            row_scale = [block_scale] * 4
        else:
            row_scale = [w_scales[tCcC[v][0]] for v in range(4)]
        lane_pair = tCcC[0][1] // 2                    # t % 4
        x_base = xs + (stage * x_scale_slots(bn) + x_scale_slot(2 * lane_pair, bn)) * 4
        x_first = cute.make_tensor(
            cute.make_ptr(Float32, x_base, cute.AddressSpace.smem,
                          assumed_align=align), cute.make_layout((loads,))).load()
        cute.nvgpu.warpgroup.wait_group(wait)
        _fence_operands([blk])                         # read only after the wait
        for g in cutlass.range_constexpr(bn // group):
            if g * group < rows:
                x = x_first
                if const_expr(g > 0):
                    x = cute.make_tensor(
                        cute.make_ptr(Float32, x_base + g * loads * 4, cute.AddressSpace.smem,
                                      assumed_align=align), cute.make_layout((loads,))).load()
                for i in cutlass.range_constexpr(per_group):
                    e = g * per_group + i
                    acc[e] = acc[e] + blk[e] * (row_scale[e % 4] * x[(i // 4) * 2 + i % 2])
