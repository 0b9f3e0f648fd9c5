"""The mHC pre of one sub-block for Hopper (sm_90a), in CuTe DSL: one launch for what XLA
runs as a chain of small fusions (docs/architecture.md §3.2, docs/performance.md).

Computes ``hc_pre`` (``ffi/hc_pre.py``) for every token t of X ``[T, n, d]`` (bf16):

    mix[t]  = (flatten(X[t]) @ fn.T) * rsqrt(mean(flatten(X[t])^2) + norm_eps)   (f32)
    pre, post, comb = the mHC split of mix[t] (``hc_sinkhorn_sm90.split_lanes``)
    y[t]    = bf16(sum_j pre[j] X[t, j])
    out[t]  = bf16(w * (y[t] * rsqrt(mean(y[t]^2) + norm_eps)))

Dataflow: a cluster of C CTAs (256 threads each) per group of TB tokens; CTA r of the
cluster owns the contiguous K slice [r K / C, (r + 1) K / C) of the flattened streams
(K = n d) for the mix sums, and the column slice [r d / C, (r + 1) d / C) of y.
1. Mix sums: each thread takes 4 consecutive K elements per pass. It issues its 24 float4
   loads of ``fn`` (read once per cluster, not kept in L1) and its TB bf16x4 loads of X
   before any arithmetic, then adds x * fn into (2 + n) n sums per token and x^2 into one
   more. The TB ((2 + n) n + 1) sums (padded to a multiple of 32) are reduce-scattered over
   the warp by butterfly shuffles (lane l ends with sums [l q, (l + 1) q)), summed over the
   warps in warp order through shared memory, and over the cluster's CTAs in rank order
   through distributed shared memory: every CTA then holds the same totals.
   Then every thread loads the n streams' values of its collapse units (L2 hits), so that
   their latency hides under the exchange.
2. The split: the last ceil(TB / (32 / P)) warps (P = n n lanes per token,
   ``split_lanes``) run the Sinkhorn chain; CTA 0 stores ``post`` and ``comb``. They arrive
   at the norm's cluster barrier at once and wait on it at the end, so the chain runs
   beside step 3. With ``split_apart`` CTA 0 stores the mixes instead (``mix[t]`` above,
   [T, (2 + n) n] f32: the split kernel's input, the same values) and every warp runs
   step 3: the chain is left to a launch of its own.
3. Collapse and norm, on the other warps: each thread takes 4 columns of a token per pass,
   computes the token's ``pre`` gates from the totals (as the split does), rounds y to
   bf16 as the reference does and keeps it in registers; the per-token sums of y^2 are
   added over the warp, the collapse warps (named barrier 1) and the cluster as in 1; then
   the normalised, weighted row is stored as bf16.
Tokens of the last group past T load the last token's rows and store nothing.
With a pending hc_post given as a MoE output's parts (``summed_k`` = k: ``ffi.ffn_sum``),
wherever the out row's 4 columns are loaded the shared expert's are, and the token's k
routed rows' (``rows[position[t k + j]]``, +0 where not ``valid``), added in f32 in j order
and rounded to bf16 -- ``FfnSum.total``'s order and values.

Numerics: f32 throughout; the sums' order (per thread in K order, then lanes, warps and
CTAs) differs from XLA's, so mixes differ by a few f32 ulps and y, out occasionally by one
bf16 ulp (tests/test_hc_pre.py bounds it).

Constraints (``hc_pre_config``): bf16 X and norm weight, f32 fn, scale, base; n n <= 32;
d a multiple of 4 C; TB ((2 + n) n + 1) <= 128.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .hc_pre_config import THREADS, HcPreSm90Config
from .hc_sinkhorn_config import lanes_per_token
from .hc_sinkhorn_sm90 import _sigmoid, split_lanes
from .sm90_primitives import (launch, load_cluster_f32, load_global_bf16x4, load_global_f32x4,
                              round_bf16, store_global_bf16x4)
from .token_groups_sm90 import TokenGroupKernel

WARPS = THREADS // 32


class HcPreSm90(TokenGroupKernel):
    """Static configuration of one compiled kernel (see the module docstring)."""

    def __init__(self, n: int, dim: int, tokens: int, iters: int, hc_eps: float,
                 norm_eps: float, config: HcPreSm90Config, pending: bool = False,
                 summed_k: int = 0):
        self.n, self.dim, self.tokens, self.iters = n, dim, tokens, iters
        self.warps = WARPS
        self.pending = pending
        # A pending out given as its parts (``ffi.ffn_sum``): k routed rows to add first.
        self.summed_k = summed_k
        self.split_apart = config.split_apart
        self.all_streams = list(range(n))
        self.hc_eps, self.norm_eps = float(hc_eps), float(norm_eps)
        self.cluster = config.cluster
        self.tb = config.tokens_for(tokens)
        self.groups = -(-tokens // self.tb)
        self.k = n * dim
        self.mixes = (2 + n) * n
        self.per_token = self.mixes + 1                    # the mix sums and the sum of x^2
        self.sums = self.tb * self.per_token
        self.padded = -(-self.sums // 32) * 32
        self.k_units = self.k // self.cluster // 4         # float4 units of a CTA's K slice
        self.col_units = dim // self.cluster // 4          # 4-column units of its y slice
        self.out_units = self.tb * self.col_units
        self.lanes = lanes_per_token(n)
        # The last warps run the split (n n lanes per token), the others the collapse; with
        # the split apart every warp collapses.
        self.collapse_warps = WARPS - (0 if self.split_apart
                                       else -(-self.tb // (32 // self.lanes)))
        self.collapse_threads = 32 * self.collapse_warps
        self.collapse_passes = -(-self.out_units // self.collapse_threads)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mFn: cute.Tensor, mScale: cute.Tensor,
                 mBase: cute.Tensor, mW: cute.Tensor, mOutP: cute.Tensor, mPostP: cute.Tensor,
                 mCombP: cute.Tensor, mRows: cute.Tensor, mPos: cute.Tensor,
                 mValid: cute.Tensor, mOut: cute.Tensor, mPost: cute.Tensor,
                 mComb: cute.Tensor, mXNew: cute.Tensor, mMix: cute.Tensor,
                 stream: cuda.CUstream):
        padded, tb = self.padded, self.tb

        @cute.struct
        class SharedStorage:
            warp_sums: cute.struct.MemRange[Float32, WARPS * padded]
            cta_sums: cute.struct.MemRange[Float32, padded]
            totals: cute.struct.MemRange[Float32, padded]
            warp_sq: cute.struct.MemRange[Float32, WARPS * tb]
            cta_sq: cute.struct.MemRange[Float32, tb]
            total_sq: cute.struct.MemRange[Float32, tb]

        self.shared_storage = SharedStorage
        launched = self.kernel(mX, mFn, mScale, mBase, mW, mOutP, mPostP, mCombP, mRows, mPos,
                               mValid, mOut, mPost, mComb, mXNew, mMix)
        launch(launched, [self.cluster, self.groups, 1], THREADS,
               [self.cluster, 1, 1] if self.cluster > 1 else None, stream)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mX: cute.Tensor, mFn: cute.Tensor, mScale: cute.Tensor,
               mBase: cute.Tensor, mW: cute.Tensor, mOutP: cute.Tensor, mPostP: cute.Tensor,
               mCombP: cute.Tensor, mRows: cute.Tensor, mPos: cute.Tensor,
               mValid: cute.Tensor, mOut: cute.Tensor, mPost: cute.Tensor,
               mComb: cute.Tensor, mXNew: cute.Tensor, mMix: cute.Tensor):
        tidx, rank, warp, lane, t0, storage, sums = self.start()
        for i in cutlass.range_constexpr(-(-self.k_units // THREADS)):
            u = tidx + i * THREADS
            if const_expr((i + 1) * THREADS <= self.k_units):
                self.mix_pass(sums, mX, mFn, (mOutP, mPostP, mCombP, mRows, mPos, mValid),
                              mXNew, rank, t0, u)
            else:
                if u < self.k_units:
                    self.mix_pass(sums, mX, mFn,
                                  (mOutP, mPostP, mCombP, mRows, mPos, mValid), mXNew, rank,
                                  t0, u)
        # The collapse's stream values, loaded now: their latency hides under the sums'
        # exchange (every thread loads, the split warps' loads go unused).
        streams = cute.make_rmem_tensor((self.collapse_passes * self.n * 4,), Float32)
        self.load_streams(streams, mX, (mOutP, mPostP, mCombP, mRows, mPos, mValid), rank,
                          t0, tidx)
        self.cta_sums(sums, storage.warp_sums, storage.cta_sums, warp, lane)
        totals = self.cluster_sums(storage.cta_sums, storage.totals, self.padded, self.sums,
                                   tidx, THREADS)
        if const_expr(self.split_apart):
            self.store_mixes(totals, mMix, rank, t0, tidx)
            self.collapse_and_norm(storage, totals, streams, mScale, mBase, mW, mOut, rank, t0,
                                   warp, lane, tidx)
        elif warp >= self.collapse_warps:
            # The split warps publish nothing to the norm's exchange: they arrive at once,
            # and the Sinkhorn chain runs beside the collapse.
            if const_expr(self.cluster > 1):
                cute.arch.cluster_arrive()
            self.split(totals, mScale, mBase, mPost, mComb, rank, t0, warp, lane)
            if const_expr(self.cluster > 1):
                cute.arch.cluster_wait()
        else:
            self.collapse_and_norm(storage, totals, streams, mScale, mBase, mW, mOut, rank, t0,
                                   warp, lane, tidx)
        if const_expr(self.cluster > 1):
            # No CTA leaves while another may still read its shared memory.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def sync(self, threads: cutlass.Constexpr):
        """CTA barrier over all threads, or named barrier 1 over the collapse warps."""
        if const_expr(threads == THREADS):
            cute.arch.barrier()
        else:
            cute.arch.barrier(barrier_id=1, number_of_threads=threads)

    @cute.jit
    def mix_pass(self, sums: cute.Tensor, mX: cute.Tensor, mFn: cute.Tensor, pend,
                 mXNew: cute.Tensor, rank: Int32, t0: Int32, u: Int32):
        """K elements [k, k + 4) of every token into the sums; all loads first. With a
        pending hc_post the elements are the updated streams' (``updated``), stored to
        ``mXNew`` once: each K element is in one thread's pass of one CTA."""
        k = rank * (self.k // self.cluster) + 4 * u
        fn = mFn.iterator.toint()
        w = [load_global_f32x4(fn + (Int64(m * self.k) + k.to(Int64)) * 4)
             for m in range(self.mixes)]
        xs = []
        if const_expr(self.pending):
            stream, col = k // self.dim, k % self.dim
            for t in cutlass.range_constexpr(self.tb):
                src = self.source_token(t0, t)
                xs.append(self.updated(mX, pend, src, col, [stream])[0])
                if t0 + t < self.tokens:
                    store_global_bf16x4(mXNew.iterator.toint()
                                        + (src.to(Int64) * self.k + k.to(Int64)) * 2, xs[t])
        else:
            xs = [load_global_bf16x4(mX.iterator.toint()
                                     + (self.source_token(t0, t).to(Int64) * self.k
                                        + k.to(Int64)) * 2)
                  for t in range(self.tb)]
        for t in cutlass.range_constexpr(self.tb):
            x = xs[t]
            for m in cutlass.range_constexpr(self.mixes):
                acc = sums[t * self.per_token + m]
                for e in cutlass.range_constexpr(4):
                    acc = acc + x[e] * w[m][e]
                sums[t * self.per_token + m] = acc
            sq = sums[t * self.per_token + self.mixes]
            for e in cutlass.range_constexpr(4):
                sq = sq + x[e] * x[e]
            sums[t * self.per_token + self.mixes] = sq

    def updated(self, mX: cute.Tensor, pend, src: Int32, col: Int32, streams: list) -> list:
        """The pending hc_post's streams ``streams`` at columns [col, col + 4) of token
        ``src``: bf16(post[s] out + sum_j comb[j, s] X[j]) in f32, the sum in j order (a
        trace-time helper: the mix pass and the collapse compute the same values). ``pend``:
        ``(out, post, comb, rows, position, valid)``; with ``summed_k`` out is the shared
        expert's row and ``parts_total`` adds the routed rows to it."""
        mOutP, mPostP, mCombP = pend[:3]
        n = self.n
        row = mX.iterator.toint() + (src.to(Int64) * self.k + col.to(Int64)) * 2
        xj = [load_global_bf16x4(row + j * self.dim * 2) for j in range(n)]
        out = load_global_bf16x4(mOutP.iterator.toint()
                                 + (src.to(Int64) * self.dim + col.to(Int64)) * 2)
        if const_expr(self.summed_k > 0):
            out = self.parts_total(pend[3:], out, src, col)
        result = []
        for s in streams:
            post = mPostP[src, s]
            comb = [mCombP[src, j * n + s] for j in range(n)]
            values = []
            for e in range(4):
                mixed = comb[0] * xj[0][e]
                for j in range(1, n):
                    mixed = mixed + comb[j] * xj[j][e]
                values.append(round_bf16(post * out[e] + mixed))
            result.append(values)
        return result

    def parts_total(self, parts, shared, src: Int32, col: Int32) -> list:
        """Columns [col, col + 4) of token ``src``'s MoE output from its parts
        (``ffi.ffn_sum.FfnSum``): bf16(((r_0 + r_1) + ... + r_{k-1}) + shared) in f32, r_j
        its j-th assignment's row ``rows[position[src k + j]]``, +0 where that row is not
        ``valid`` -- the order and values of ``FfnSum.total``, so the same bits."""
        mRows, mPos, mValid = parts
        k = self.summed_k
        total = []
        for j in range(k):
            p = mPos[src * k + j]
            r = load_global_bf16x4(mRows.iterator.toint()
                                   + (p.to(Int64) * self.dim + col.to(Int64)) * 2)
            valid = mValid[p] != 0
            r = [Float32(cutlass.select_(valid, r[e], Float32(0.0))) for e in range(4)]
            total = r if j == 0 else [total[e] + r[e] for e in range(4)]
        return [round_bf16(total[e] + shared[e]) for e in range(4)]

    @cute.jit
    def unit(self, rank: Int32, u: Int32):
        """(group slot, first column) of 4-column unit u of this CTA's y slice."""
        return (u // self.col_units,
                rank * (self.dim // self.cluster) + 4 * (u % self.col_units))

    @cute.jit
    def load_streams(self, streams: cute.Tensor, mX: cute.Tensor, pend, rank: Int32,
                     t0: Int32, tidx: Int32):
        """The n streams' 4 values of each collapse pass's unit (addresses always valid:
        units past the end read a clamped token); with a pending hc_post, the updated
        streams' (``updated``, as the mix pass computes them)."""
        n = self.n
        for i in cutlass.range_constexpr(self.collapse_passes):
            slot, col = self.unit(rank, tidx + i * self.collapse_threads)
            src = self.source_token(t0, slot)
            if const_expr(self.pending):
                values = self.updated(mX, pend, src, col, self.all_streams)
                for j in cutlass.range_constexpr(n):
                    for e in cutlass.range_constexpr(4):
                        streams[(i * n + j) * 4 + e] = values[j][e]
            else:
                row = mX.iterator.toint() + (src.to(Int64) * self.k + col.to(Int64)) * 2
                for j in cutlass.range_constexpr(n):
                    v = load_global_bf16x4(row + j * self.dim * 2)
                    for e in cutlass.range_constexpr(4):
                        streams[(i * n + j) * 4 + e] = v[e]

    @cute.jit
    def cluster_sums(self, cta_field, total_field, size: cutlass.Constexpr,
                     count: cutlass.Constexpr, tidx: Int32,
                     threads: cutlass.Constexpr) -> cute.Tensor:
        """Thread i < count adds value i of every CTA's ``cta_field`` in rank order into
        its own ``total_field`` (read through distributed shared memory after a cluster
        barrier); returns ``total_field`` as a tensor, after a barrier over ``threads``
        (``sync``). The cluster barrier takes every thread of the cluster: callers that
        run on part of the CTA have the others arrive and wait on their own."""
        cta = cta_field.get_tensor(cute.make_layout((size,)))
        totals = total_field.get_tensor(cute.make_layout((size,)))
        cta_addr = cta_field.data_ptr().toint()
        if const_expr(self.cluster > 1):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            if tidx < count:
                addr = cta_addr + 4 * tidx
                total = load_cluster_f32(addr, Int32(0))
                for r in cutlass.range_constexpr(1, self.cluster):
                    total = total + load_cluster_f32(addr, Int32(r))
                totals[tidx] = total
        else:
            self.sync(threads)
            if tidx < count:
                totals[tidx] = cta[tidx]
        self.sync(threads)
        return totals

    @cute.jit
    def split(self, totals: cute.Tensor, mScale: cute.Tensor, mBase: cute.Tensor,
              mPost: cute.Tensor, mComb: cute.Tensor, rank: Int32, t0: Int32, warp: Int32,
              lane: Int32):
        """The mHC split of the group's tokens on the split warps, n n lanes each; CTA 0
        stores ``post`` and ``comb`` (the collapse computes its own ``pre`` gates)."""
        n, lanes = self.n, self.lanes
        slot = (warp - self.collapse_warps) * (32 // lanes) + lane // lanes
        src = slot
        if slot >= self.tb:
            src = self.tb - 1
        first = src * self.per_token
        rs = cute.math.rsqrt(totals[first + self.mixes] / Float32(self.k)
                             + Float32(self.norm_eps))
        _, post, comb = split_lanes(lambda i: totals[first + i] * rs, mScale, mBase, lane, n,
                                    lanes, self.iters, self.hc_eps)
        element = lane % lanes
        t = t0 + slot
        if slot < self.tb and rank == 0 and t < self.tokens:
            if element < n * n:
                mComb[t, element] = comb
            if element < n:
                mPost[t, element] = post

    @cute.jit
    def store_mixes(self, totals: cute.Tensor, mMix: cute.Tensor, rank: Int32, t0: Int32,
                    tidx: Int32):
        """CTA 0 stores the group's mixes, ``totals`` times the token's rsqrt of its mean
        square -- the values ``split`` would pass to ``split_lanes`` -- one per thread."""
        if rank == 0 and tidx < self.tb * self.mixes:
            slot, i = tidx // self.mixes, tidx % self.mixes
            if t0 + slot < self.tokens:
                first = slot * self.per_token
                rs = cute.math.rsqrt(totals[first + self.mixes] / Float32(self.k)
                                     + Float32(self.norm_eps))
                mMix[t0 + slot, i] = totals[first + i] * rs

    @cute.jit
    def collapse_and_norm(self, storage, totals: cute.Tensor, streams: cute.Tensor,
                          mScale: cute.Tensor, mBase: cute.Tensor, mW: cute.Tensor,
                          mOut: cute.Tensor, rank: Int32, t0: Int32, warp: Int32, lane: Int32,
                          tidx: Int32):
        """On the collapse warps: y = bf16(sum_j pre[j] X[j]) for this CTA's columns (the
        pre gates computed here from the totals, as the split computes them), then its
        RMSNorm."""
        n, tb, threads = self.n, self.tb, self.collapse_threads
        ys = cute.make_rmem_tensor((4 * self.collapse_passes,), Float32)
        ys.fill(0.0)
        sq = cute.make_rmem_tensor((tb,), Float32)
        sq.fill(0.0)
        for i in cutlass.range_constexpr(self.collapse_passes):
            u = tidx + i * threads
            if u < self.out_units:
                slot, _ = self.unit(rank, u)
                first = slot * self.per_token
                rs = cute.math.rsqrt(totals[first + self.mixes] / Float32(self.k)
                                     + Float32(self.norm_eps))
                pre = [_sigmoid(totals[first + j] * rs * mScale[0] + mBase[j])
                       + Float32(self.hc_eps) for j in range(n)]
                total = Float32(0.0)
                for e in cutlass.range_constexpr(4):
                    y = pre[0] * streams[i * n * 4 + e]
                    for j in cutlass.range_constexpr(1, n):
                        y = y + pre[j] * streams[(i * n + j) * 4 + e]
                    y = round_bf16(y)
                    ys[4 * i + e] = y
                    total = total + y * y
                for s in cutlass.range_constexpr(tb):
                    if slot == s:
                        sq[s] = sq[s] + total
        warp_sq = storage.warp_sq.get_tensor(cute.make_layout((WARPS * tb,)))
        for s in cutlass.range_constexpr(tb):
            v = sq[s]
            for stage in cutlass.range_constexpr(5):
                v = v + cute.arch.shuffle_sync_bfly(v, offset=16 >> stage)
            if lane == 0:
                warp_sq[warp * tb + s] = v
        self.sync(threads)
        cta_sq = storage.cta_sq.get_tensor(cute.make_layout((tb,)))
        if tidx < tb:
            total = warp_sq[tidx]
            for w in cutlass.range_constexpr(1, self.collapse_warps):
                total = total + warp_sq[w * tb + tidx]
            cta_sq[tidx] = total
        total_sq = self.cluster_sums(storage.cta_sq, storage.total_sq, tb, tb, tidx, threads)
        for i in cutlass.range_constexpr(self.collapse_passes):
            u = tidx + i * threads
            if u < self.out_units:
                slot, col = self.unit(rank, u)
                if t0 + slot < self.tokens:
                    r = cute.math.rsqrt(total_sq[slot] / Float32(self.dim)
                                        + Float32(self.norm_eps))
                    w = load_global_bf16x4(mW.iterator.toint() + col.to(Int64) * 2)
                    store_global_bf16x4(
                        mOut.iterator.toint() + ((t0 + slot).to(Int64) * self.dim
                                                 + col.to(Int64)) * 2,
                        [w[e] * (ys[4 * i + e] * r) for e in range(4)])


@cute.jit
def hc_pre_launcher(stream: cuda.CUstream, x: cute.Tensor, fn: cute.Tensor, scale: cute.Tensor,
                    base: cute.Tensor, weight: cute.Tensor, pending_out: cute.Tensor,
                    pending_post: cute.Tensor, pending_comb: cute.Tensor,
                    pending_rows: cute.Tensor, pending_position: cute.Tensor,
                    pending_valid: cute.Tensor, out: cute.Tensor,
                    post: cute.Tensor, comb: cute.Tensor, x_new: cute.Tensor,
                    mixes: cute.Tensor, *,
                    n: cutlass.Constexpr, dim: cutlass.Constexpr, tokens: cutlass.Constexpr,
                    iters: cutlass.Constexpr, hc_eps: cutlass.Constexpr,
                    norm_eps: cutlass.Constexpr, pending: cutlass.Constexpr = False,
                    summed_k: cutlass.Constexpr = 0,
                    cluster: cutlass.Constexpr = 8, tokens_per_cluster: cutlass.Constexpr = 4,
                    split_apart: cutlass.Constexpr = False):
    """``cutlass_call`` entry point: (stream, *inputs, *outputs, **static config). Without
    ``pending`` the pending_* inputs and x_new are placeholders the kernel never touches;
    without ``summed_k`` the rows, position and valid ones (else ``pending_out`` is the
    shared expert's row and they are the routed rows of ``ffi.ffn_sum.FfnSum``: rows bf16
    [T k, d], position and valid int32 [T k]). With ``split_apart`` post and comb are
    placeholders and mixes [T, (2 + n) n] f32 is written; without it, the reverse."""
    HcPreSm90(n, dim, tokens, iters, hc_eps, norm_eps,
              HcPreSm90Config(cluster, tokens_per_cluster, split_apart), pending, summed_k)(
        x, fn, scale, base, weight, pending_out, pending_post, pending_comb, pending_rows,
        pending_position, pending_valid, out, post, comb, x_new, mixes, stream)


__all__ = ["HcPreSm90", "hc_pre_launcher"]
