"""The split-combine kernel of ``sparse_attention_config`` (flash-decoding merge), a mixin of
``SparseAttentionSm90``: it reads ``self.num_splits``, ``self.num_heads`` and ``self.q_prep``."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .sparse_attention_config import HEAD_DIM


class SplitCombine:
    """``combine_kernel``: one warp per (token, head) row, 128 threads per CTA."""

    @cute.kernel
    def combine_kernel(self, mSink: cute.Tensor, mCos: cute.Tensor, mSin: cute.Tensor,
                       mO: cute.Tensor, mLse: cute.Tensor, mOPart: cute.Tensor,
                       mLsePart: cute.Tensor):
        """Merge the splits of one (token, head) row per warp, adding the sink; with
        ``q_prep`` the row's last RoPE channels rotated back (``QueryRope.rotate_back``:
        a lane holds 4 consecutive channels, two whole pairs)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        num_tokens = mO.shape[0]
        row = bidx * 4 + warp
        if row < num_tokens * self.num_heads:
            t = row // self.num_heads
            h = row % self.num_heads
            lse_max = -Float32.inf
            for s in cutlass.range_constexpr(self.num_splits):
                lse_max = cute.arch.fmax(lse_max, mLsePart[s, t, h])
            shift = lse_max if lse_max != -Float32.inf else Float32(0.0)
            total = Float32(0.0)
            for s in cutlass.range_constexpr(self.num_splits):
                total = total + cute.math.exp(mLsePart[s, t, h] - shift, fastmath=True)
            denom = total + cute.math.exp(mSink[h] - shift, fastmath=True)
            acc = cute.make_rmem_tensor((HEAD_DIM // 32,), Float32)
            acc.fill(0.0)
            for s in cutlass.range_constexpr(self.num_splits):
                w = cute.math.exp(mLsePart[s, t, h] - shift, fastmath=True) / denom
                for v in cutlass.range_constexpr(HEAD_DIM // 128):
                    part = cute.make_tensor(
                        cute.make_ptr(Float32, (mOPart.iterator + (
                            ((s * num_tokens + t) * self.num_heads + h) * HEAD_DIM
                            + v * 128 + lane * 4)).toint(), cute.AddressSpace.gmem,
                            assumed_align=16), cute.make_layout((4,)))
                    vals = part.load()
                    for e in cutlass.range_constexpr(4):
                        acc[v * 4 + e] = acc[v * 4 + e] + w * vals[e]
            for v in cutlass.range_constexpr(HEAD_DIM // 128):
                vals = [acc[v * 4 + e] if total > 0.0 else Float32(0.0) for e in range(4)]
                for e in cutlass.range_constexpr(4):
                    val = vals[e]
                    if const_expr(self.q_prep and v == HEAD_DIM // 128 - 1):
                        val = self.rotate_back(vals[e], vals[e ^ 1], v * 128 + lane * 4 + e,
                                               t, mCos, mSin)
                    mO[t, h, v * 128 + lane * 4 + e] = val.to(mO.element_type)
            if lane == 0:
                mLse[t, h] = (shift + cute.math.log(total, fastmath=True)
                              if total > 0.0 else -Float32.inf)
