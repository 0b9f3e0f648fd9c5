"""The mHC split and Sinkhorn normalisation of one sub-block for Hopper (sm_90a), in CuTe DSL.

Computes ``hc_split_sinkhorn`` (``ffi/hc_sinkhorn.py``) for every token:

    pre[t]  = sigmoid(mix[t, 0:n] * scale[0] + base[0:n]) + eps
    post[t] = 2 sigmoid(mix[t, n:2n] * scale[1] + base[n:2n])
    M       = (mix[t, 2n:] * scale[2] + base[2n:]).view(n, n)
    M       = softmax_rows(M) + eps;  M = M / (colsum(M) + eps)
    iters - 1 times:  M = M / (rowsum(M) + eps);  M = M / (colsum(M) + eps)

Why a kernel: the computation is a few hundred flops per token, but as XLA ops it is a chain
of small reductions and divisions, dozens of launches per sub-block (docs/performance.md).

Numerics (both dataflows alike): sums run in index order; each row or column is scaled by
one IEEE reciprocal of its sum (as XLA computes a division by a broadcast sum); sigmoid and
exp use ``exp2`` (the reference's numbers to a few ulps).

Dataflow, n n <= 32 (``lanes_per_token``; DSV4's n = 4): P = n n rounded up to a power of
two lanes per token, lane l of a token's group holding element (l / n, l % n) of its matrix
(lanes past n n hold a copy of element (0, 0)); each lane loads its mix, and lanes l < n
also mix l of pre and post. A row (column) sum gathers the row's (column's) n elements from
their lanes with ``shfl.idx`` and adds them in index order; each lane takes the reciprocal of
its own row's (column's) sum. A decode step's few tokens then run the Sinkhorn chain on n n
lanes each: one reciprocal per lane and step instead of n per thread (the one-thread
dataflow's instruction count bounded the kernel, docs/performance.md). Lanes of tokens past
the end compute the last token's values and store nothing: every lane takes part in every
shuffle. Stores are coalesced: comb [T, n n] element by element.

Dataflow, n n > 32: one thread per token loads its (2 + n) n mixes and the shared scale and
base -- all loads first, then all stores (the outputs may alias the inputs as far as the
compiler knows) --, keeps the n x n matrix in registers through the iterations (unrolled: n
and iters are compile-time), and writes pre [T, n], post [T, n] and comb [T, n n].

Constraints: f32 mixes ``[T, (2 + n) n]``, scale ``[3]``, base ``[(2 + n) n]``; n <= 8.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .hc_sinkhorn_config import HcSinkhornSm90Config, lanes_per_token

LOG2_E = 1.4426950408889634


def _exp(x: Float32) -> Float32:
    return cute.math.exp2(x * Float32(LOG2_E))


def _sigmoid(x: Float32) -> Float32:
    return Float32(1.0) / (Float32(1.0) + _exp(-x))


def split_lanes(mix, mScale: cute.Tensor, mBase: cute.Tensor, warp_lane: Int32, n: int,
                lanes: int, iters: int, eps: float):
    """The split of one token on its ``lanes`` lanes (the shuffle dataflow of the module
    docstring; trace-time helper shared with ``hc_pre_sm90``). ``mix(i)`` is the token's
    mix i. Returns this lane's ``(pre, post, comb)`` values: gate ``lane`` (meaningful on
    lanes < n) and comb element ``lane`` (on lanes < n n). Every lane of the group must run
    it (shuffles)."""
    eps = Float32(eps)
    lane = warp_lane % lanes
    first = warp_lane - lane                 # the warp lane of this token's element 0
    # Plain Python (not a cute.jit body): runtime choices are selects.
    element = Int32(cutlass.select_(lane < n * n, lane, Int32(0)))
    row, col = element // n, element % n
    x = mix(2 * n + element) * mScale[2] + mBase[2 * n + element]
    head = Int32(cutlass.select_(lane < n, lane, Int32(0)))
    pre = _sigmoid(mix(head) * mScale[0] + mBase[head]) + eps
    post = Float32(2.0) * _sigmoid(mix(n + head) * mScale[1] + mBase[n + head])

    def gather(value, in_row: bool):
        """The n elements of this lane's row (or column), in index order."""
        return [cute.arch.shuffle_sync(value, first + (row * n + k if in_row else k * n + col))
                for k in range(n)]

    def total(values):
        acc = values[0]
        for v in values[1:]:
            acc = acc + v
        return acc

    top = gather(x, True)                    # row softmax + eps
    peak = top[0]
    for v in top[1:]:
        peak = cute.arch.fmax(peak, v)
    e = _exp(x - peak)
    x = e * (Float32(1.0) / total(gather(e, True))) + eps
    x = x * (Float32(1.0) / (total(gather(x, False)) + eps))
    for _ in range(iters - 1):              # unrolled at trace time
        x = x * (Float32(1.0) / (total(gather(x, True)) + eps))
        x = x * (Float32(1.0) / (total(gather(x, False)) + eps))
    return pre, post, x


class HcSinkhornSm90:
    """Static configuration of one compiled kernel (see the module docstring)."""

    def __init__(self, n: int, iters: int, eps: float, config: HcSinkhornSm90Config):
        self.n = n
        self.iters = iters
        self.eps = float(eps)
        self.threads = config.threads
        self.lanes = lanes_per_token(n)

    @cute.jit
    def __call__(self, mMix: cute.Tensor, mScale: cute.Tensor, mBase: cute.Tensor,
                 mPre: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor,
                 stream: cuda.CUstream):
        tokens = mMix.shape[0]
        if cutlass.const_expr(self.lanes > 1):
            per_cta = self.threads // self.lanes
            self.kernel_lanes(mMix, mScale, mBase, mPre, mPost, mComb).launch(
                grid=[(tokens + per_cta - 1) // per_cta, 1, 1],
                block=[self.threads, 1, 1], stream=stream)
        else:
            self.kernel(mMix, mScale, mBase, mPre, mPost, mComb).launch(
                grid=[(tokens + self.threads - 1) // self.threads, 1, 1],
                block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel_lanes(self, mMix: cute.Tensor, mScale: cute.Tensor, mBase: cute.Tensor,
                     mPre: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor):
        """P lanes per token (see the module docstring)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        tokens = mMix.shape[0]
        t = bidx * (self.threads // self.lanes) + tidx // self.lanes
        lane = tidx % self.lanes
        src = t
        if t >= tokens:
            src = tokens - 1
        pre, post, x = split_lanes(lambda i: mMix[src, i], mScale, mBase, tidx % 32, self.n,
                                   self.lanes, self.iters, self.eps)
        n = self.n
        if t < tokens:
            if lane < n * n:
                mComb[t, lane] = x
            if lane < n:
                mPre[t, lane] = pre
                mPost[t, lane] = post

    @cute.kernel
    def kernel(self, mMix: cute.Tensor, mScale: cute.Tensor, mBase: cute.Tensor,
               mPre: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        t = bidx * self.threads + tidx
        n = self.n
        eps = Float32(self.eps)
        if t < mMix.shape[0]:
            # Every load before any store: the outputs may alias the inputs as far as the
            # compiler knows, so a store between loads would serialise their round trips.
            s_pre, s_post, s_comb = mScale[0], mScale[1], mScale[2]
            mix = [mMix[t, i] for i in range((2 + n) * n)]
            base = [mBase[i] for i in range((2 + n) * n)]
            pre = [_sigmoid(mix[i] * s_pre + base[i]) + eps for i in range(n)]
            post = [Float32(2.0) * _sigmoid(mix[n + i] * s_post + base[n + i])
                    for i in range(n)]
            m = [[mix[2 * n + i * n + j] * s_comb + base[2 * n + i * n + j]
                  for j in range(n)] for i in range(n)]
            for i in cutlass.range_constexpr(n):            # row softmax + eps
                top = m[i][0]
                for j in cutlass.range_constexpr(1, n):
                    top = cute.arch.fmax(top, m[i][j])
                for j in cutlass.range_constexpr(n):
                    m[i][j] = _exp(m[i][j] - top)
                total = m[i][0]
                for j in cutlass.range_constexpr(1, n):
                    total = total + m[i][j]
                inv = Float32(1.0) / total
                for j in cutlass.range_constexpr(n):
                    m[i][j] = m[i][j] * inv + eps
            self.normalise_columns(m, eps)
            for _ in cutlass.range_constexpr(self.iters - 1):
                for i in cutlass.range_constexpr(n):
                    total = m[i][0]
                    for j in cutlass.range_constexpr(1, n):
                        total = total + m[i][j]
                    inv = Float32(1.0) / (total + eps)
                    for j in cutlass.range_constexpr(n):
                        m[i][j] = m[i][j] * inv
                self.normalise_columns(m, eps)
            for i in cutlass.range_constexpr(n):
                mPre[t, i] = pre[i]
                mPost[t, i] = post[i]
                for j in cutlass.range_constexpr(n):
                    mComb[t, i * n + j] = m[i][j]

    def normalise_columns(self, m, eps: Float32):
        """Trace-time helper (plain Python: its loops unroll as the caller traces it)."""
        n = self.n
        for j in range(n):
            total = m[0][j]
            for i in range(1, n):
                total = total + m[i][j]
            inv = Float32(1.0) / (total + eps)
            for i in range(n):
                m[i][j] = m[i][j] * inv


@cute.jit
def hc_sinkhorn_launcher(stream: cuda.CUstream, mix: cute.Tensor, scale: cute.Tensor,
                         base: cute.Tensor, pre: cute.Tensor, post: cute.Tensor,
                         comb: cute.Tensor, *, n: cutlass.Constexpr, iters: cutlass.Constexpr,
                         eps: cutlass.Constexpr, threads: cutlass.Constexpr = 128):
    """``cutlass_call`` entry point: (stream, *inputs, *outputs, **static config)."""
    HcSinkhornSm90(n, iters, eps, HcSinkhornSm90Config(threads))(mix, scale, base, pre, post,
                                                                 comb, stream)
