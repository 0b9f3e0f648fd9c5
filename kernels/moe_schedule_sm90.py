"""The routed experts' schedule for Hopper (sm_90a), in CuTe DSL: the assignment rows sorted
by expert and each expert's rows cut into tiles, in one launch -- what
``ffi.grouped_gemm_sm90.schedule`` computes in XLA with a sort, a bincount, two cumsums and
a search (several small launches per MoE layer at decode; docs/performance.md).

For ``M`` rows of group ids ``key`` (ids outside ``[0, G)`` are dropped: their rows sort
last) and tiles of at most ``block_n`` rows, it writes exactly what ``schedule`` returns --
``order`` [M] (sorted position -> row; a stable sort), ``valid`` [M] (1 where the sorted
row has a group), ``tile_group`` / ``tile_row0`` / ``tile_rows`` [S] (unused slots: -1, 0,
0) -- and ``position`` [M], the inverse of ``order`` (row -> sorted position), which the
sum into tokens gathers by.

Dataflow (one CTA of ``THREADS`` threads; thread g owns group g -- the dropped rows' bucket
is group G):
1. The rows' keys (G for a dropped id) into shared memory; each group's count by
   shared-memory atomics.
2. Exclusive block scans of the counts (a group's first sorted row) and of the tiles per
   group, ``ceil(count / block_n)`` (its first tile slot): shuffles within each warp, then
   warp 0 scans the warps' totals.
3. Row a's sorted position is its group's first row plus the number of rows before a in
   the same group (a loop over the keys before it), so rows keep their order within a
   group, as in XLA's stable sort.
4. Thread g writes its group's tiles; the slots past the last tile are marked unused.

Constraints (``moe_schedule_config.supports``): ``M <= MAX_ROWS`` (step 3 loops over up to M
keys per row), ``G < THREADS``.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .moe_schedule_config import THREADS, supports
from .sm90_primitives import launch

WARPS = THREADS // 32
SCANS = 2                      # the rows and the tiles of each group


class MoeScheduleSm90:
    """Static configuration of one compiled kernel (see the module docstring)."""

    def __init__(self, rows: int, groups: int, block_n: int, slots: int):
        ok, why = supports(rows, groups)
        if not ok:
            raise ValueError(why)
        self.rows, self.groups, self.block_n, self.slots = rows, groups, block_n, slots

    @cute.jit
    def __call__(self, mKey: cute.Tensor, mOrder: cute.Tensor, mPosition: cute.Tensor,
                 mValid: cute.Tensor, mTileGroup: cute.Tensor, mTileRow0: cute.Tensor,
                 mTileRows: cute.Tensor, stream: cuda.CUstream):
        rows = self.rows

        @cute.struct
        class SharedStorage:
            keys: cute.struct.MemRange[Int32, rows]
            counts: cute.struct.MemRange[Int32, THREADS]
            first_rows: cute.struct.MemRange[Int32, THREADS]
            warp_totals: cute.struct.MemRange[Int32, SCANS * WARPS]

        self.shared_storage = SharedStorage
        launch(self.kernel(mKey, mOrder, mPosition, mValid, mTileGroup, mTileRow0, mTileRows),
               [1, 1, 1], THREADS, None, stream)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mKey: cute.Tensor, mOrder: cute.Tensor, mPosition: cute.Tensor,
               mValid: cute.Tensor, mTileGroup: cute.Tensor, mTileRow0: cute.Tensor,
               mTileRows: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        g_count, bn = self.groups, self.block_n
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        keys = storage.keys.get_tensor(cute.make_layout((self.rows,)))
        counts = storage.counts.get_tensor(cute.make_layout((THREADS,)))
        first_rows = storage.first_rows.get_tensor(cute.make_layout((THREADS,)))
        totals = storage.warp_totals.get_tensor(cute.make_layout((SCANS * WARPS,)))

        # 1. Keys and counts.
        counts[tidx] = Int32(0)
        for a in cutlass.range(tidx, self.rows, THREADS, unroll=1):
            g = mKey[a]
            keys[a] = Int32(cutlass.select_((g >= 0) & (g < g_count), g, g_count))
        cute.arch.barrier()
        for a in cutlass.range(tidx, self.rows, THREADS, unroll=1):
            cute.arch.atomic_add(counts.iterator + keys[a], Int32(1), scope="cta")
        cute.arch.barrier()

        # 2. A group's first sorted row and first tile slot.
        count = counts[tidx]
        tiles = Int32(cutlass.select_(tidx < g_count, (count + bn - 1) // bn, 0))
        first_row, first_tile, all_tiles = self.exclusive_scan(count, tiles, totals, warp,
                                                               lane)
        first_rows[tidx] = first_row
        cute.arch.barrier()

        # 3. Each row's sorted position: stable within its group.
        for a in cutlass.range(tidx, self.rows, THREADS, unroll=1):
            key = keys[a]
            rank = Int32(0)
            for b in cutlass.range(a, unroll=1):
                rank = rank + Int32(cutlass.select_(keys[b] == key, 1, 0))
            pos = first_rows[key] + rank
            mOrder[pos] = a
            mPosition[a] = pos
            mValid[pos] = Int32(cutlass.select_(key < g_count, 1, 0))

        # 4. The tiles, then the unused slots.
        for i in cutlass.range(tiles, unroll=1):
            slot = first_tile + i
            mTileGroup[slot] = tidx
            mTileRow0[slot] = first_row + i * bn
            mTileRows[slot] = cutlass.min(bn, count - i * bn)
        for slot in cutlass.range(all_tiles + tidx, self.slots, THREADS, unroll=1):
            mTileGroup[slot] = Int32(-1)
            mTileRow0[slot] = Int32(0)
            mTileRows[slot] = Int32(0)

    @cute.jit
    def exclusive_scan(self, rows: Int32, tiles: Int32, totals: cute.Tensor, warp: Int32,
                       lane: Int32):
        """Exclusive sums over the threads in thread order of ``rows`` and ``tiles``, and the
        sum of all ``tiles``: inclusive sums within each warp by shuffles, the warps' totals
        scanned by warp 0 through shared memory (``totals``: ``SCANS`` x ``WARPS``)."""
        inclusive = [rows, tiles]
        for j in cutlass.range_constexpr(SCANS):
            for shift in cutlass.range_constexpr(5):
                up = cute.arch.shuffle_sync_up(inclusive[j], 1 << shift)
                inclusive[j] = inclusive[j] + Int32(cutlass.select_(lane >= (1 << shift), up,
                                                                    0))
            if lane == 31:
                totals[j * WARPS + warp] = inclusive[j]
        cute.arch.barrier()
        if warp == 0:
            for j in cutlass.range_constexpr(SCANS):
                total = totals[j * WARPS + lane]
                for shift in cutlass.range_constexpr(5):
                    up = cute.arch.shuffle_sync_up(total, 1 << shift)
                    total = total + Int32(cutlass.select_(lane >= (1 << shift), up, 0))
                totals[j * WARPS + lane] = total
        cute.arch.barrier()
        # The warps before this one: warp 0 reads its own slot and takes none of it.
        previous = Int32(cutlass.select_(warp > 0, warp - 1, 0))
        before = [Int32(cutlass.select_(warp > 0, totals[j * WARPS + previous], 0))
                  for j in range(SCANS)]
        return (inclusive[0] - rows + before[0], inclusive[1] - tiles + before[1],
                totals[SCANS * WARPS - 1])


@cute.jit
def moe_schedule_launcher(stream: cuda.CUstream, key: cute.Tensor, order: cute.Tensor,
                          position: cute.Tensor, valid: cute.Tensor, tile_group: cute.Tensor,
                          tile_row0: cute.Tensor, tile_rows: cute.Tensor, *,
                          rows: cutlass.Constexpr, groups: cutlass.Constexpr,
                          block_n: cutlass.Constexpr, slots: cutlass.Constexpr):
    """``cutlass_call`` entry point: (stream, *inputs, *outputs, **static config)."""
    MoeScheduleSm90(rows, groups, block_n, slots)(key, order, position, valid, tile_group,
                                                   tile_row0, tile_rows, stream)


__all__ = ["MoeScheduleSm90", "moe_schedule_launcher"]
