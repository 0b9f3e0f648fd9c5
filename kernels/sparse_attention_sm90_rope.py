"""The query preparation of ``SparseAttentionSm90`` (``q_prep``), a mixin: the heads'
weightless RMSNorm and RoPE of the queries before they attend, the inverse RoPE of the
output after -- what the model otherwise runs as three XLA launches around the kernel
(``ffi.rope``; docs/performance.md). It reads ``self.num_heads`` and ``self.norm_eps``.

Dataflow (prologue, on the 256 threads of the two math warpgroups, before their first
QK^T): thread i takes quarter i % 4 (128 channels, 16 chunks of 16 B) of head i / 4 of the
CTA's 64 heads; it loads them from global memory (the producer warpgroup does not copy Q),
adds the bf16-rounded squares, sums the head over its four lanes, and rounds as
``ffi.rope.head_rms_norm`` does: ms = bf16(sum / d), r = bf16(rsqrt(bf16(ms + eps))),
q = bf16(q r). The last quarter rotates its last ROPE_DIM channels (interleaved pairs, f32
math, bf16 result, ``ffi.rope.rotate_pairs``) by the token's cos/sin. The chunks go to the
swizzled Q tile, then a proxy fence and a named barrier over the math warpgroups.

Epilogue: an output value of the last ROPE_DIM channels is rounded to bf16 with its pair's
other value, rotated back (the conjugate angle) in f32 and rounded again; the accumulator
pairs (2 i, 2 i + 1) are adjacent registers of one thread (WGMMA's C layout), the split
merge's lane holds 4 consecutive channels.

Numerics: the heads' sums run in another order than XLA's (a rare one-ulp bf16 difference
of ms, hence of the head); rsqrt and the rotation's f32 products may round differently
from XLA's by an f32 ulp, which bf16 rounding hides but for rare one-ulp differences.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .sm90_primitives import load_global_b32x4, round_bf16, widen_bf16x2
from .sparse_attention_config import HEAD_BLOCK, HEAD_DIM, ROPE_DIM

Q_BARRIER = 10                  # named barrier of the prepared Q tile (1-9: the kernel's)
QUARTER = HEAD_DIM // 4         # channels per thread in the prologue
ROPE_FIRST = HEAD_DIM - ROPE_DIM
SUMS = 4                        # independent partial sums per thread (a shorter add chain)


class QueryRope:
    """``prepare_q`` and ``rotate_back`` (see the module docstring)."""

    @cute.jit
    def prepare_q(self, mQ: cute.Tensor, mCos: cute.Tensor, mSin: cute.Tensor, t: Int32,
                  hb: Int32, sQ: cute.Tensor, tid: Int32):
        """Math thread ``tid`` (0 .. 255): its quarter of a head, normalised and rotated,
        into the Q tile; returns after the barrier that makes the whole tile visible."""
        head, quarter = tid // 4, tid % 4
        base = mQ.iterator.toint() + ((t * self.num_heads + hb * HEAD_BLOCK + head).to(Int64)
                                      * HEAD_DIM + quarter * QUARTER) * 2
        words = []
        for j in cutlass.range_constexpr(QUARTER // 8):
            words.extend(load_global_b32x4(base + j * 16))
        x = []
        for w in words:
            x.extend(widen_bf16x2(w))
        sums = [Float32(0.0)] * SUMS
        for e in cutlass.range_constexpr(QUARTER):
            sums[e % SUMS] = sums[e % SUMS] + round_bf16(x[e] * x[e])
        total = (sums[0] + sums[1]) + (sums[2] + sums[3])
        total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
        total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
        ms = round_bf16(total * Float32(1.0 / HEAD_DIM))
        r = round_bf16(cute.math.rsqrt(round_bf16(ms + Float32(self.norm_eps))))
        sQ_vec = cute.flat_divide(sQ, (1, 8))[0, None, None, None]
        chunk = cute.make_rmem_tensor((8,), self.dtype)
        y = [Float32(0.0)] * QUARTER
        for j in cutlass.range_constexpr(QUARTER // 8):
            for e in cutlass.range_constexpr(8 * j, 8 * j + 8):
                y[e] = round_bf16(x[e] * r)
                chunk[e - 8 * j] = y[e].to(self.dtype)
            if const_expr(8 * j >= QUARTER - ROPE_DIM):
                if quarter == 3:
                    # Rotate pairs (2 p, 2 p + 1) of the head's last ROPE_DIM channels.
                    for k in cutlass.range_constexpr(4):
                        e = 8 * j + 2 * k
                        p = (e - (QUARTER - ROPE_DIM)) // 2
                        cos, sin = mCos[t, p], mSin[t, p]
                        chunk[2 * k] = (y[e] * cos - y[e + 1] * sin).to(self.dtype)
                        chunk[2 * k + 1] = (y[e] * sin + y[e + 1] * cos).to(self.dtype)
            sQ_vec[None, head, quarter * (QUARTER // 8) + j].store(chunk.load())
        # Generic stores, read by the warpgroup MMAs through the async proxy.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=Q_BARRIER, number_of_threads=256)

    @cute.jit
    def rotate_back(self, value: Float32, partner: Float32, col: Int32, t: Int32,
                    mCos: cute.Tensor, mSin: cute.Tensor) -> Float32:
        """The output value of channel ``col`` (``partner``: its pair's other value) after
        the inverse RoPE, as ``ffi.rope.rotate_pairs(..., inverse=True)`` on the bf16
        output: both rounded to bf16, rotated by the conjugate angle in f32 (bf16-rounded
        by the caller's store); channels before the RoPE ones as they are."""
        out = value
        if col >= ROPE_FIRST:
            p = (col - ROPE_FIRST) // 2
            cos, sin = mCos[t, p], -mSin[t, p]
            mine, other = round_bf16(value), round_bf16(partner)
            if col % 2 == 0:
                out = mine * cos - other * sin
            else:
                out = other * sin + mine * cos
        return out
