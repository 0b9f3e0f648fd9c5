"""Small sm_90a primitives shared by the CuTe DSL kernels."""
from __future__ import annotations

import cutlass.cute as cute
from cutlass._mlir.dialects import nvvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def cp_async_arrive(mbar_ptr: cute.Pointer, *, loc=None, ip=None) -> None:
    """``cp.async.mbarrier.arrive``: +1 pending on the barrier now, -1 once this thread's
    earlier cp.async copies have landed. Paired with an ordinary (release) arrive, the
    barrier phase then covers the copies and this thread's ordinary smem stores."""
    nvvm.cp_async_mbarrier_arrive(mbar_ptr.to_llvm_ptr(loc=loc, ip=ip), noinc=False,
                                  loc=loc, ip=ip)
