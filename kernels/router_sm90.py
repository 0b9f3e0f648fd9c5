"""The MoE router of one layer for Hopper (sm_90a), in CuTe DSL: one launch for what XLA
runs as a dot, a sort and a few small fusions (docs/architecture.md §3.7,
docs/performance.md).

Computes ``moe_router`` (``ffi/router.py``) for every token t of x ``[T, d]`` (bf16):

    logits[t] = x[t] @ weight.T                                   (f32 sums of exact products)
    scores[t] = score_func(logits[t])
    idx[t]    = top-k of scores[t] + bias (ties: the lower expert)  |  table[token_ids[t]]
    w[t]      = scores[t][idx[t]] / (their sum, unless softmax) * route_scale

Dataflow: a cluster of C CTAs (256 threads each) per group of TB tokens; CTA r owns the
experts [r E / C, (r + 1) E / C) (E_c of them) over the whole row.
1. Logits: each thread takes 8 consecutive columns per pass (the CTA's passes cover the
   row). It issues its 16-byte weight loads of up to ``MAX_WEIGHT_LOADS`` / E_c passes (read
   once per cluster, not kept in L1) and its TB x loads before any arithmetic -- a launch at
   decode is bound by the bytes each SM has in flight -- then adds x * w into E_c TB sums.
   The sums (padded to a multiple of 32) are reduce-scattered over the warp by butterfly
   shuffles and summed over the warps in warp order through shared memory.
2. After a cluster barrier, in CTA 0, warp t routes token t of the group: lane l reads the
   logits of experts l, l + 32, ... from their CTAs' shared memory (distributed shared
   memory), computes the scores (softmax: the max and the sum by warp shuffles), and then
   either runs k rounds of a warp argmax over score + bias (order keys of the f32 values:
   the largest key and then the lowest expert holding it by ``redux.sync``; the winner's
   lane marks it taken and gives its score by one shuffle) or reads the token's table row
   and fetches each chosen expert's score from its lane. Lane j < k stores the j-th expert
   and its weight; the normalising sum adds the k scores in rank order.
Tokens of the last group past T load the last token's row and store nothing.

Numerics: f32 throughout; the logits' sums run in another order than XLA's (per thread in
column order, then lanes and warps), and exp / log1p / sqrt are the libdevice functions, so
scores differ from the reference by a few f32 ulps and a near-tie of the k-th expert may
resolve the other way (tests/test_router.py bounds both).

Constraints (``router_config``): bf16 x and weight, f32 bias; E a multiple of C and at most
512; k <= 32; d a multiple of 8; TB E / C <= 32.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .router_config import MAX_WEIGHT_LOADS, THREADS, RouterSm90Config
from .sm90_primitives import (launch, load_cluster_f32, load_global_b32x4, order_key,
                              warp_max_s32, warp_min_s32, widen_bf16x2)
from .token_groups_sm90 import TokenGroupKernel

WARPS = THREADS // 32
NEG_INF = float("-inf")


class RouterSm90(TokenGroupKernel):
    """Static configuration of one compiled kernel (see the module docstring)."""

    def __init__(self, experts: int, dim: int, tokens: int, k: int, score_func: str,
                 route_scale: float, hashed: bool, vocab: int, config: RouterSm90Config):
        self.e, self.dim, self.tokens, self.k = experts, dim, tokens, k
        self.warps = WARPS
        self.score_func, self.route_scale = score_func, float(route_scale)
        self.hashed, self.vocab = hashed, vocab
        self.cluster = config.cluster
        self.tb = config.tokens_for(tokens)
        self.groups = -(-tokens // self.tb)
        self.per_cta = experts // self.cluster
        self.sums = self.tb * self.per_cta
        self.padded = -(-self.sums // 32) * 32
        self.units = dim // 8                              # 8-column units of a row
        self.passes = -(-self.units // THREADS)
        self.passes_per_chunk = max(1, MAX_WEIGHT_LOADS // self.per_cta)
        self.candidates = -(-experts // 32)                # experts per lane in the top-k

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mBias: cute.Tensor,
                 mTable: cute.Tensor, mTokens: cute.Tensor, mRouteW: cute.Tensor,
                 mRouteIdx: cute.Tensor, stream: cuda.CUstream):
        padded = self.padded

        @cute.struct
        class SharedStorage:
            warp_sums: cute.struct.MemRange[Float32, WARPS * padded]
            logits: cute.struct.MemRange[Float32, padded]

        self.shared_storage = SharedStorage
        launched = self.kernel(mX, mW, mBias, mTable, mTokens, mRouteW, mRouteIdx)
        launch(launched, [self.cluster, self.groups, 1], THREADS,
               [self.cluster, 1, 1] if self.cluster > 1 else None, stream)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mBias: cute.Tensor,
               mTable: cute.Tensor, mTokens: cute.Tensor, mRouteW: cute.Tensor,
               mRouteIdx: cute.Tensor):
        tidx, rank, warp, lane, t0, storage, sums = self.start()
        for first in cutlass.range_constexpr(0, self.passes, self.passes_per_chunk):
            self.logit_chunk(sums, mX, mW, rank, t0, tidx,
                             range(first, min(first + self.passes_per_chunk, self.passes)))
        self.cta_sums(sums, storage.warp_sums, storage.logits, warp, lane)
        logits = storage.logits.get_tensor(cute.make_layout((self.padded,)))
        if const_expr(self.cluster > 1):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.barrier()
        if rank == 0 and warp < self.tb:
            if t0 + warp < self.tokens:
                self.route(logits, storage.logits.data_ptr().toint(), mBias, mTable, mTokens,
                           mRouteW, mRouteIdx, t0 + warp, warp, lane)
        if const_expr(self.cluster > 1):
            # No CTA leaves while CTA 0 may still read its shared memory.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    def logit_chunk(self, sums: cute.Tensor, mX: cute.Tensor, mW: cute.Tensor, rank: Int32,
                    t0: Int32, tidx: Int32, passes: range):
        """Passes ``passes`` of the CTA's experts and the group's tokens into the sums (sum
        t E_c + j: token slot t, expert j of the CTA): pass p covers columns [8 u, 8 u + 8),
        u = tidx + 256 p. Every weight load of the chunk is issued before the first use (a
        trace-time helper: units past the row read its last unit with x taken as 0)."""
        first = (rank * self.per_cta).to(Int64)
        w_base, x_base = mW.iterator.toint(), mX.iterator.toint()
        cols, valid = [], []
        for p in passes:
            u = tidx + p * THREADS
            if (p + 1) * THREADS <= self.units:
                cols.append((8 * u).to(Int64))
                valid.append(None)
            else:
                cols.append((8 * cutlass.min(u, self.units - 1)).to(Int64))
                valid.append(u < self.units)
        ws = [[load_global_b32x4(w_base + ((first + j) * self.dim + col) * 2)
               for j in range(self.per_cta)] for col in cols]
        xs = [[load_global_b32x4(x_base + (self.source_token(t0, t).to(Int64) * self.dim
                                           + col) * 2) for t in range(self.tb)]
              for col in cols]
        for c in range(len(cols)):
            xf = []
            for t in range(self.tb):
                row = [v for word in xs[c][t] for v in widen_bf16x2(word)]
                if valid[c] is not None:
                    row = [Float32(cutlass.select_(valid[c], v, Float32(0.0))) for v in row]
                xf.append(row)
            for j in range(self.per_cta):
                wf = [v for word in ws[c][j] for v in widen_bf16x2(word)]
                for t in range(self.tb):
                    acc = sums[t * self.per_cta + j]
                    for e in range(8):
                        acc = acc + xf[t][e] * wf[e]
                    sums[t * self.per_cta + j] = acc

    @cute.jit
    def logit(self, logits: cute.Tensor, logits_addr: Int32, slot: Int32, expert: Int32
              ) -> Float32:
        """The logit of ``expert`` for group slot ``slot``, from its CTA's shared memory."""
        index = slot * self.per_cta + expert % self.per_cta
        value = Float32(0.0)
        if const_expr(self.cluster > 1):
            value = load_cluster_f32(logits_addr + 4 * index, expert // self.per_cta)
        else:
            value = logits[index]
        return value

    @cute.jit
    def scores(self, logits: cute.Tensor, logits_addr: Int32, slot: Int32, lane: Int32):
        """This lane's experts' scores (experts lane + 32 i; those past E give -inf)."""
        raw = []
        for i in cutlass.range_constexpr(self.candidates):
            e = lane + 32 * i
            clamped = cutlass.min(e, self.e - 1)
            raw.append(self.logit(logits, logits_addr, slot, clamped))
        out = []
        if const_expr(self.score_func == "softmax"):
            top = Float32(NEG_INF)
            for i in cutlass.range_constexpr(self.candidates):
                if lane + 32 * i < self.e:
                    top = cute.arch.fmax(top, raw[i])
            for stage in cutlass.range_constexpr(5):
                top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=16 >> stage))
            ex = [Float32(cutlass.select_(lane + 32 * i < self.e,
                                          cute.math.exp(raw[i] - top), Float32(0.0)))
                  for i in range(self.candidates)]
            total = ex[0]
            for i in cutlass.range_constexpr(1, self.candidates):
                total = total + ex[i]
            for stage in cutlass.range_constexpr(5):
                total = total + cute.arch.shuffle_sync_bfly(total, offset=16 >> stage)
            out = [ex[i] / total for i in range(self.candidates)]
        elif const_expr(self.score_func == "sigmoid"):
            out = [Float32(1.0) / (Float32(1.0) + cute.math.exp(-raw[i]))
                   for i in range(self.candidates)]
        else:
            # softplus as jax.nn.softplus: max(l, 0) + log1p(exp(-|l|)).
            out = [cute.math.sqrt(cute.arch.fmax(raw[i], Float32(0.0))
                                  + cute.math.log1p(cute.math.exp(-cute.math.absf(raw[i]))))
                   for i in range(self.candidates)]
        return out

    @cute.jit
    def route(self, logits: cute.Tensor, logits_addr: Int32, mBias: cute.Tensor,
              mTable: cute.Tensor, mTokens: cute.Tensor, mRouteW: cute.Tensor,
              mRouteIdx: cute.Tensor, t: Int32, slot: Int32, lane: Int32):
        """Token t's experts and weights on one warp (step 2 of the module docstring)."""
        s = self.scores(logits, logits_addr, slot, lane)
        chosen, weights = [], []
        if const_expr(self.hashed):
            token = mTokens[t]
            token = cutlass.max(cutlass.min(token, self.vocab - 1), 0)
            mine = Int32(0)
            if lane < self.k:
                mine = mTable[token, cutlass.min(lane, self.k - 1)]
            for j in cutlass.range_constexpr(self.k):
                expert = cute.arch.shuffle_sync(mine, j)
                expert = cutlass.max(cutlass.min(expert, self.e - 1), 0)
                held = s[0]
                for i in cutlass.range_constexpr(1, self.candidates):
                    held = Float32(cutlass.select_(expert // 32 == i, s[i], held))
                chosen.append(expert)
                weights.append(cute.arch.shuffle_sync(held, expert % 32))
        else:
            keys = []
            for i in cutlass.range_constexpr(self.candidates):
                e = cutlass.min(lane + 32 * i, self.e - 1)
                keys.append(order_key(s[i] + mBias[e]))
            free = [Int32(cutlass.select_(lane + 32 * i < self.e, 1, 0))
                    for i in range(self.candidates)]
            for _ in cutlass.range_constexpr(self.k):
                best_key, best_e, best_s = self.lane_best(keys, s, free, lane)
                top = warp_max_s32(best_key)
                winner = warp_min_s32(Int32(cutlass.select_(best_key == top, best_e,
                                                            Int32(self.e))))
                for i in cutlass.range_constexpr(self.candidates):
                    free[i] = Int32(cutlass.select_(lane + 32 * i == winner, 0, free[i]))
                chosen.append(winner)
                weights.append(cute.arch.shuffle_sync(best_s, winner % 32))
        total = weights[0]
        for j in cutlass.range_constexpr(1, self.k):
            total = total + weights[j]
        for j in cutlass.range_constexpr(self.k):
            if lane == j:
                w = weights[j]
                if const_expr(self.score_func != "softmax"):
                    w = w / total
                mRouteW[t, j] = w * Float32(self.route_scale)
                mRouteIdx[t, j] = chosen[j]

    @cute.jit
    def lane_best(self, keys: list, s: list, free: list, lane: Int32):
        """This lane's best free expert: (order key of score + bias, expert, score); the
        lower expert wins a tie (its candidates run in expert order). A lane without a
        free expert offers the smallest key and expert E."""
        best_key, best_e, best_s = Int32(-2 ** 31), Int32(self.e), Float32(0.0)
        for i in cutlass.range_constexpr(self.candidates):
            take = (free[i] != 0) & ((best_e == self.e) | (keys[i] > best_key))
            best_key = Int32(cutlass.select_(take, keys[i], best_key))
            best_e = Int32(cutlass.select_(take, lane + 32 * i, best_e))
            best_s = Float32(cutlass.select_(take, s[i], best_s))
        return best_key, best_e, best_s


@cute.jit
def router_launcher(stream: cuda.CUstream, x: cute.Tensor, weight: cute.Tensor,
                    bias: cute.Tensor, table: cute.Tensor, token_ids: cute.Tensor,
                    route_w: cute.Tensor, route_idx: cute.Tensor, *,
                    experts: cutlass.Constexpr, dim: cutlass.Constexpr,
                    tokens: cutlass.Constexpr, k: cutlass.Constexpr,
                    score_func: cutlass.Constexpr, route_scale: cutlass.Constexpr,
                    hashed: cutlass.Constexpr, vocab: cutlass.Constexpr,
                    cluster: cutlass.Constexpr = 16, tokens_per_cluster: cutlass.Constexpr = 4):
    """``cutlass_call`` entry point: (stream, *inputs, *outputs, **static config)."""
    RouterSm90(experts, dim, tokens, k, score_func, route_scale, hashed, vocab,
               RouterSm90Config(cluster, tokens_per_cluster))(
        x, weight, bias, table, token_ids, route_w, route_idx, stream)


__all__ = ["RouterSm90", "router_launcher"]
