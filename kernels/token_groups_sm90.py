"""What the decode-size cluster kernels share (``hc_pre_sm90``, ``router_sm90``): a cluster
of CTAs per group of ``tb`` tokens, each thread's partial sums added over its warp and then
over the CTA's warps in warp order."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .sm90_primitives import warp_reduce_scatter


class TokenGroupKernel:
    """Mixin of a kernel object that sets ``tokens`` (all of them), ``tb`` (tokens per
    group: grid y), ``padded`` (partial sums per thread, a multiple of 32), ``warps`` (per
    CTA) and ``shared_storage`` (a struct with a ``warp_sums`` field of ``warps x padded``
    f32 and a CTA-sums field of ``padded``)."""

    def start(self):
        """The kernel's opening, at trace time: ``(tidx, rank, warp, lane, t0, storage,
        sums)`` -- the CTA's rank in its cluster (grid x), the group's first token, the shared
        storage and the zeroed register sums; the next launch may begin (PDL)."""
        # A programmatic dependent launch after this one (the grouped GEMM's decode kernels
        # under GroupedGemmPolicy(pdl=True)) may begin now: it issues its weight copies and
        # then waits for this kernel to finish before it reads anything this kernel writes.
        # Other launches start when this kernel ends, as without it.
        cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        rank, group, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        t0 = group * self.tb
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sums = cute.make_rmem_tensor((self.padded,), Float32)
        sums.fill(0.0)
        return tidx, rank, warp, lane, t0, storage, sums

    @cute.jit
    def source_token(self, t0: Int32, t) -> Int32:
        """Token of group slot t; slots past the end read the last token."""
        src = t0 + t
        if src >= self.tokens:
            src = self.tokens - 1
        return src

    @cute.jit
    def cta_sums(self, sums: cute.Tensor, warp_field, cta_field, warp: Int32, lane: Int32):
        """The warp's sums: lane l gets the warp total of sums [l q, (l + 1) q) (q =
        padded / 32) by butterfly shuffles, stored in warp row of ``warp_field``; then
        thread i < padded adds sum i over the warps in warp order into ``cta_field`` (read
        after a barrier)."""
        vals = warp_reduce_scatter([sums[i] for i in range(self.padded)], lane)
        q = self.padded // 32
        warp_sums = warp_field.get_tensor(cute.make_layout((self.warps * self.padded,)))
        for i in cutlass.range_constexpr(q):
            warp_sums[warp * self.padded + lane * q + i] = vals[i]
        cute.arch.barrier()
        tidx = warp * 32 + lane
        cta = cta_field.get_tensor(cute.make_layout((self.padded,)))
        if tidx < self.padded:
            total = warp_sums[tidx]
            for w in cutlass.range_constexpr(1, self.warps):
                total = total + warp_sums[w * self.padded + tidx]
            cta[tidx] = total
