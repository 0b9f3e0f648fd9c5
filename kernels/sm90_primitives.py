"""Small sm_90a primitives shared by the CuTe DSL kernels."""
from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def cp_async_arrive(mbar_ptr: cute.Pointer, *, loc=None, ip=None) -> None:
    """``cp.async.mbarrier.arrive``: +1 pending on the barrier now, -1 once this thread's
    earlier cp.async copies have landed. Paired with an ordinary (release) arrive, the
    barrier phase then covers the copies and this thread's ordinary smem stores."""
    nvvm.cp_async_mbarrier_arrive(mbar_ptr.to_llvm_ptr(loc=loc, ip=ip), noinc=False,
                                  loc=loc, ip=ip)


def row_copy_atom(dtype) -> cute.CopyAtom:
    """16-byte ``cp.async`` copies that bypass L1 (.cg): rows staged in shared memory for the
    CTA are read from global memory once."""
    return cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                               dtype, num_bits_per_copy=128)


def half_warp_rows(tidx: Int32):
    """``(row0, chunk)`` of a warpgroup thread copying 256-byte row segments, a half warp
    per segment: thread (warp w, lane l) copies 16-byte chunk l % 16 of rows 2 w + l // 16
    + 8 i (a warp instruction covers two whole segments)."""
    warp, lane = tidx // 32, tidx % 32
    return 2 * warp + lane // 16, lane % 16


@cute.jit
def copy16(atom: cute.CopyAtom, dtype: cute.typing.Type, addr: Int64, dst: cute.Tensor):
    """One 16-byte ``atom`` copy from global address ``addr`` to ``dst``."""
    src = cute.make_tensor(cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=16),
                           cute.make_layout((128 // dtype.width,)))
    cute.copy(atom, src, dst)
