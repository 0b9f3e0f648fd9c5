"""Small sm_90a primitives shared by the CuTe DSL kernels."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op


def _results(kind, count: int, args: list, text: str, constraints: str, side_effects: bool,
             loc, ip):
    """An inline-asm instruction with ``count`` results of ``kind`` (``Float32`` or
    ``Int32``), as a tuple."""
    ir_type = T.f32() if kind is Float32 else T.i32()
    res = llvm.inline_asm(llvm.StructType.get_literal([ir_type] * count),
                          [a.ir_value(loc=loc, ip=ip) for a in args], text, constraints,
                          has_side_effects=side_effects, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return tuple(kind(llvm.extractvalue(ir_type, res, [i], loc=loc, ip=ip))
                 for i in range(count))


def _f32x4(args: list, text: str, constraints: str, side_effects: bool, loc, ip):
    """An inline-asm instruction with four f32 results, as a tuple of ``Float32``."""
    return _results(Float32, 4, args, text, constraints, side_effects, loc, ip)


def launch(launched, grid: list, threads: int, cluster: list | None, stream,
           use_pdl: bool = False) -> None:
    """Launch a ``cute.kernel`` call on ``grid`` x ``threads``, as clusters of ``cluster``
    CTAs when given (None: no cluster launch); ``use_pdl``: as a programmatic dependent
    launch (it may begin before the previous kernel ends; the kernel waits for it with
    ``griddepcontrol.wait``)."""
    if cluster is None:
        launched.launch(grid=grid, block=[threads, 1, 1], stream=stream, use_pdl=use_pdl)
    else:
        launched.launch(grid=grid, block=[threads, 1, 1], cluster=cluster, stream=stream,
                        use_pdl=use_pdl)


def warp_reduce_scatter(values: list, lane: Int32) -> list:
    """Warp totals of ``values`` (32 q of them, the same count on every lane), scattered:
    lane l gets the totals of values [l q, (l + 1) q), by five butterfly stages that each
    halve the values a lane carries (a trace-time helper for kernel bodies)."""
    vals = list(values)
    for stage in range(5):
        offset = 16 >> stage
        upper = (lane & offset) != 0
        count = len(vals) // 2
        vals = [Float32(cutlass.select_(upper, vals[count + i], vals[i]))
                + cute.arch.shuffle_sync_bfly(
                    Float32(cutlass.select_(upper, vals[i], vals[count + i])), offset=offset)
                for i in range(count)]
    return vals


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


@dsl_user_op
def store_shared_b32x4(addr: Int32, words, *, loc=None, ip=None) -> None:
    """``st.shared.v4.b32``: four 32-bit ``words`` at the 16-byte aligned shared address
    ``addr`` (bytes as they are: no element type for the compiler to re-pack)."""
    llvm.inline_asm(None, [Int32(addr).ir_value(loc=loc, ip=ip)]
                    + [Int32(w).ir_value(loc=loc, ip=ip) for w in words],
                    "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r,~{memory}",
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def store_shared_f32x4(addr: Int32, values, *, loc=None, ip=None) -> None:
    """``st.shared.v4.f32``: four f32 ``values`` at the 16-byte aligned shared address
    ``addr``."""
    llvm.inline_asm(None, [Int32(addr).ir_value(loc=loc, ip=ip)]
                    + [Float32(v).ir_value(loc=loc, ip=ip) for v in values],
                    "st.shared.v4.f32 [$0], {$1, $2, $3, $4};", "r,f,f,f,f,~{memory}",
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def load_cluster_f32x4(addr: Int32, rank: Int32, *, loc=None, ip=None):
    """Four f32 at shared address ``addr`` of the cluster's CTA ``rank`` (``mapa`` +
    ``ld.shared::cluster.v4``). Ordered after the cluster barrier it follows (side effects):
    the remote CTA's stores before its arrive are then visible."""
    return _f32x4([Int32(addr), Int32(rank)],
                  "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, $4, $5;\n"
                  "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [remote];\n}",
                  "=f,=f,=f,=f,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def load_cluster_f32(addr: Int32, rank: Int32, *, loc=None, ip=None) -> Float32:
    """One f32 at shared address ``addr`` of the cluster's CTA ``rank``; ordered as
    ``load_cluster_f32x4``."""
    return Float32(llvm.inline_asm(
        T.f32(), [Int32(addr).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, $1, $2;\n"
        "ld.shared::cluster.f32 $0, [remote];\n}",
        "=f,r,r,~{memory}", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def load_global_f32x4(addr: Int64, *, loc=None, ip=None):
    """Four f32 from a read-only, 16-byte aligned global address (``ld.global.nc``, not
    kept in L1: bytes the SM reads once)."""
    return _f32x4([Int64(addr)], "ld.global.nc.L1::no_allocate.v4.f32 {$0, $1, $2, $3}, [$4];",
                  "=f,=f,=f,=f,l", False, loc, ip)


@dsl_user_op
def load_global_bf16x4(addr: Int64, *, loc=None, ip=None):
    """Four bf16 from a read-only, 8-byte aligned global address, widened to f32 (exact)."""
    return _f32x4([Int64(addr)],
                  "{\n.reg .b32 lo, hi;\nld.global.nc.v2.b32 {lo, hi}, [$4];\n"
                  "shl.b32 $0, lo, 16;\nand.b32 $1, lo, 0xffff0000;\n"
                  "shl.b32 $2, hi, 16;\nand.b32 $3, hi, 0xffff0000;\n}",
                  "=f,=f,=f,=f,l", False, loc, ip)


@dsl_user_op
def load_global_b32x4(addr: Int64, *, loc=None, ip=None):
    """16 bytes (e.g. eight bf16) from a read-only, 16-byte aligned global address as four
    raw 32-bit words (``ld.global.nc``, not kept in L1); widen them where they are used
    (``widen_bf16x2``), so that many loads can be in flight before the first use."""
    return _results(Int32, 4, [Int64(addr)],
                    "ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$4];",
                    "=r,=r,=r,=r,l", False, loc, ip)


@dsl_user_op
def widen_bf16x2(word: Int32, *, loc=None, ip=None):
    """The two bf16 of a 32-bit word (low half first) as f32 (exact)."""
    return _results(Float32, 2, [Int32(word)],
                    "{\nshl.b32 $0, $2, 16;\nand.b32 $1, $2, 0xffff0000;\n}", "=f,=f,r",
                    False, loc, ip)


def _i32(args: list, text: str, constraints: str, loc, ip) -> Int32:
    return Int32(llvm.inline_asm(T.i32(), [a.ir_value(loc=loc, ip=ip) for a in args], text,
                                 constraints, has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def order_key(value: Float32, *, loc=None, ip=None) -> Int32:
    """A signed 32-bit key in the order of the f32 ``value`` (not NaN; -0 below +0): the
    bits of a positive value, the magnitude bits flipped for a negative one."""
    return _i32([Float32(value)],
                "{\n.reg .b32 b, m;\nmov.b32 b, $1;\nshr.s32 m, b, 31;\n"
                "and.b32 m, m, 0x7fffffff;\nxor.b32 $0, b, m;\n}", "=r,f", loc, ip)


@dsl_user_op
def warp_max_s32(value: Int32, *, loc=None, ip=None) -> Int32:
    """The largest ``value`` of the (full) warp, on every lane (``redux.sync``)."""
    return _i32([Int32(value)], "redux.sync.max.s32 $0, $1, 0xffffffff;", "=r,r", loc, ip)


@dsl_user_op
def warp_min_s32(value: Int32, *, loc=None, ip=None) -> Int32:
    """The smallest ``value`` of the (full) warp, on every lane (``redux.sync``)."""
    return _i32([Int32(value)], "redux.sync.min.s32 $0, $1, 0xffffffff;", "=r,r", loc, ip)


@dsl_user_op
def round_bf16(value: Float32, *, loc=None, ip=None) -> Float32:
    """``value`` rounded to bf16 (to nearest even) and widened back to f32."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(value).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b32 w;\ncvt.rn.bf16x2.f32 w, $1, $1;\nand.b32 $0, w, 0xffff0000;\n}",
        "=f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def store_global_bf16x4(addr: Int64, values, *, loc=None, ip=None) -> None:
    """Four f32 ``values`` rounded to bf16 (to nearest even) at an 8-byte aligned global
    address."""
    llvm.inline_asm(
        None, [Int64(addr).ir_value(loc=loc, ip=ip)]
        + [Float32(v).ir_value(loc=loc, ip=ip) for v in values],
        "{\n.reg .b32 lo, hi;\ncvt.rn.bf16x2.f32 lo, $2, $1;\ncvt.rn.bf16x2.f32 hi, $4, $3;\n"
        "st.global.v2.b32 [$0], {lo, hi};\n}",
        "l,f,f,f,f,~{memory}", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def split_bf16x3(v0: Int32, v1: Int32, *, loc=None, ip=None):
    """Two f32 (as bits) -> three bf16x2 words (hi, mid, lo; v0 in the low halves) with
    ``v = hi + mid + lo`` exactly: hi = v truncated to bf16, mid = the remainder truncated,
    lo = what is left (at most 8 significant bits: a bf16 exactly). 11 instructions."""
    return _results(Int32, 3, [Int32(v0), Int32(v1)],
                    "{\n.reg .b32 h0, h1, r0, r1, m0, m1, l0, l1;\n"
                    "and.b32 h0, $3, 0xffff0000;\n"
                    "and.b32 h1, $4, 0xffff0000;\n"
                    "sub.f32 r0, $3, h0;\n"
                    "sub.f32 r1, $4, h1;\n"
                    "and.b32 m0, r0, 0xffff0000;\n"
                    "and.b32 m1, r1, 0xffff0000;\n"
                    "sub.f32 l0, r0, m0;\n"
                    "sub.f32 l1, r1, m1;\n"
                    "prmt.b32 $0, h0, h1, 0x7632;\n"
                    "prmt.b32 $1, m0, m1, 0x7632;\n"
                    "prmt.b32 $2, l0, l1, 0x7632;\n}",
                    "=r,=r,=r,r,r", False, loc, ip)
