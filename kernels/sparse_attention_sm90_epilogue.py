"""The output epilogue of ``SparseAttentionSm90``, a mixin: each math warpgroup normalises
its 64 x 256 accumulator tile (with the sink when the launch is not split) and stores o and
lse, or its split's fp32 partials for the merge (``sparse_attention_sm90_combine``); with
``q_prep`` the last RoPE channels rotated back first (``QueryRope.rotate_back``). It reads
``self.num_splits``, ``self.num_heads`` and ``self.q_prep``."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .sparse_attention_config import HEAD_BLOCK, HEAD_DIM

STORE_BARRIER = 4               # 4 and 5: a math warpgroup's output tile is staged
LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453


class OutputEpilogue:
    """``epilogue`` and ``store_tile`` (see the module docstring)."""

    @cute.jit
    def epilogue(self, mSink: cute.Tensor, mCos: cute.Tensor, mSin: cute.Tensor,
                 mO: cute.Tensor, mLse: cute.Tensor, mOPart: cute.Tensor,
                 mLsePart: cute.Tensor, t: Int32, hb: Int32,
                 split: Int32, half: Int32, wg_tidx: Int32, thr_mma_o: cute.ThrMma,
                 acc_o: cute.Tensor, tScS: cute.Tensor, row_max: cute.Tensor,
                 row_sum: cute.Tensor, staging: cute.Pointer):
        """Normalise (with the sink when unsplit) and store o/lse or the split's partials."""
        head0 = hb * HEAD_BLOCK
        rows = (tScS[0][0], tScS[2][0])
        inv = cute.make_rmem_tensor((2,), Float32)
        lse = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            total = row_sum[r]
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            denom = total
            if const_expr(self.num_splits == 1):
                sink_log2 = mSink[head0 + rows[r]] * LOG2_E
                denom = total + cute.math.exp2(sink_log2 - row_max[r], fastmath=True)
            inv[r] = Float32(1.0) / denom if total > 0.0 else Float32(0.0)
            lse[r] = ((row_max[r] + cute.math.log2(total, fastmath=True)) * LN_2
                      if total > 0.0 else -Float32.inf)
        tOcO = thr_mma_o.partition_C(cute.make_identity_tensor((HEAD_BLOCK, HEAD_DIM // 2)))
        col0 = half * (HEAD_DIM // 2)
        lane = cute.arch.lane_idx()
        row0 = (t * self.num_heads + head0).to(Int64)
        if const_expr(self.num_splits == 1):
            self.store_tile(acc_o, tOcO, inv, staging, half, wg_tidx, mO.element_type,
                            mO.iterator.toint() + (row0 * HEAD_DIM + col0) * 2,
                            (t, col0, mCos, mSin) if self.q_prep else None)
            if half == 0 and lane % 4 == 0:
                for r in cutlass.range_constexpr(2):
                    mLse[t, head0 + rows[r]] = lse[r]
        else:
            part_row0 = (split * mO.shape[0] * self.num_heads).to(Int64) + row0
            self.store_tile(acc_o, tOcO, inv, staging, half, wg_tidx, Float32,
                            mOPart.iterator.toint() + (part_row0 * HEAD_DIM + col0) * 4)
            if half == 0 and lane % 4 == 0:
                for r in cutlass.range_constexpr(2):
                    mLsePart[split, t, head0 + rows[r]] = lse[r]

    @cute.jit
    def store_tile(self, acc_o: cute.Tensor, tOcO: cute.Tensor, inv: cute.Tensor,
                   staging: cute.Pointer, half: Int32, wg_tidx: Int32, dtype: cutlass.Constexpr,
                   dst_addr: Int64, rotate=None):
        """Write this warpgroup's 64 x 256 output tile (row stride head_dim) at ``dst_addr``:
        scaled accumulators go to smem (16 B chunks XOR-swizzled by row against bank
        conflicts), then every thread stores whole 16 B chunks, a warp covering 512 B.
        ``rotate``: ``(t, col0, cos, sin)``, the output's inverse RoPE (``rotate_back``; the
        tile's columns start at ``col0``)."""
        width = HEAD_DIM // 2
        per_chunk = 16 // (dtype.width // 8)
        chunks = width // per_chunk
        region = staging.toint() + half * (HEAD_BLOCK * width * (dtype.width // 8))
        sO = cute.make_tensor(cute.make_ptr(dtype, region, cute.AddressSpace.smem,
                                            assumed_align=1024),
                              cute.make_layout((HEAD_BLOCK * width,)))
        if const_expr(rotate is None):
            for i in cutlass.range(cute.size(acc_o), unroll_full=True):
                r, c = tOcO[i][0], tOcO[i][1]
                swizzled = ((c // per_chunk) ^ (r % 8)) * per_chunk + c % per_chunk
                sO[r * width + swizzled] = (acc_o[i] * inv[(i // 2) % 2]).to(dtype)
        else:
            t, col0, mCos, mSin = rotate
            # Accumulators 2 j and 2 j + 1 are columns c and c + 1 of one row.
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                r, c = tOcO[i][0], tOcO[i][1]
                swizzled = ((c // per_chunk) ^ (r % 8)) * per_chunk + c % per_chunk
                scale = inv[(i // 2) % 2]
                value = self.rotate_back(acc_o[i] * scale, acc_o[i ^ 1] * scale, col0 + c, t,
                                         mCos, mSin)
                sO[r * width + swizzled] = value.to(dtype)
        cute.arch.barrier(barrier_id=STORE_BARRIER + half, number_of_threads=128)
        for k in cutlass.range_constexpr(HEAD_BLOCK * chunks // 128):
            flat = k * 128 + wg_tidx
            r, c = flat // chunks, flat % chunks
            src = cute.make_tensor(
                cute.make_ptr(dtype, region + (r * width + (c ^ (r % 8)) * per_chunk) * (
                    dtype.width // 8), cute.AddressSpace.smem, assumed_align=16),
                cute.make_layout((per_chunk,)))
            dst = cute.make_tensor(
                cute.make_ptr(dtype, dst_addr + ((r * HEAD_DIM + c * per_chunk) * (
                    dtype.width // 8)).to(Int64), cute.AddressSpace.gmem, assumed_align=16),
                cute.make_layout((per_chunk,)))
            dst.store(src.load())
