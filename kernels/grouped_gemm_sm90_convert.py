"""Device helpers shared by the MoE kernels (sm_90a, CuTe DSL).

FP4 e2m1 and FP8 e4m3 codes become exact bf16 values times an E8M0 block scale in a few
integer instructions (``tests/test_kernels_grouped_gemm_sm90.py`` replays both on every code);
``fp4x8_to_e4m3x8`` makes FP4 codes FP8 tensor-core operands (``fp4x8_to_e4m3x8_table``
with ``e4m3_fold_table``: with a power-of-two factor folded in); ``mma_m16n8k16_bf16`` and
``mma_m16n8k32_e4m3`` are the warp-level tensor-core MMAs with their PTX fragment layouts;
``copy_bytes`` is one cp.async of raw bytes, ``load_global_words`` one read-only load
into registers; ``gated_output`` is the SwiGLU epilogue; ``bf16x8_sum_squares`` and
``bf16x8_rms_normed`` are a row's RMSNorm in the kernels that quantise their tokens.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

from .grouped_gemm_config import BF16_2POW120, FP4_BF16_HI, FP4_BF16_LO

LOG2_E = 1.4426950408889634


def _asm(out_count: int, args: list, text: str, constraints: str, loc=None, ip=None):
    return llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * out_count) if out_count > 1 else T.i32(),
        [Int32(a).ir_value(loc=loc, ip=ip) for a in args], text, constraints,
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def fp4x8_to_bf16x8(word: Int32, multiplier: Int32, *, loc=None, ip=None):
    """Eight packed e2m1 codes (low nibble first) -> four bf16x2 words, times ``multiplier``.

    Byte permutes as 8-entry lookup tables: with the magnitude bits of four codes as the
    selector, one ``prmt`` gives the four high bytes and one the four low bytes of the bf16
    magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6); a third ``prmt`` in sign-replicate mode over
    0x80 bytes marks the negative codes (0xFF, else 0x80: bit 6 is the sign), which one
    ``lop3`` moves to bit 7 of the high bytes. Two permutes interleave low and high bytes
    into bf16x2 words and one bf16x2 multiply applies the power-of-two block scale (exact).
    """
    text = (
        "{\n"
        ".reg .b32 m, w, ha, hb, la, lb, c8, h, l, p;\n"
        f"mov.b32 ha, {FP4_BF16_HI[0]:#010x};\n"
        f"mov.b32 hb, {FP4_BF16_HI[1]:#010x};\n"
        f"mov.b32 la, {FP4_BF16_LO[0]:#010x};\n"
        f"mov.b32 lb, {FP4_BF16_LO[1]:#010x};\n"
        "mov.b32 c8, 0x80808080;\n"
        "and.b32 m, $4, 0x77777777;\n"
        "mov.b32 w, $4;\n"
        + "".join(
            ("" if i == 0 else "shr.u32 m, m, 16;\nshr.u32 w, w, 16;\n")
            + "prmt.b32 h, ha, hb, m;\n"
            "prmt.b32 l, la, lb, m;\n"
            "prmt.b32 p, c8, c8, w;\n"
            "shl.b32 p, p, 1;\n"
            "lop3.b32 h, h, p, c8, 0xF8;\n"              # h | (p & c8)
            f"prmt.b32 ${2 * i}, l, h, 0x5140;\n"
            f"prmt.b32 ${2 * i + 1}, l, h, 0x7362;\n"
            f"mul.rn.bf16x2 ${2 * i}, ${2 * i}, $5;\n"
            f"mul.rn.bf16x2 ${2 * i + 1}, ${2 * i + 1}, $5;\n"
            for i in range(2))
        + "}")
    res = _asm(4, [word, multiplier], text, "=r,=r,=r,=r,r,r", loc, ip)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip))
                 for i in range(4))


@dsl_user_op
def fp8x4_to_bf16x4(word: Int32, multiplier: Int32, *, loc=None, ip=None):
    """Four e4m3 codes -> two bf16x2 words (codes 0, 1 and 2, 3; low half first), times
    ``multiplier``.

    A byte permute puts each pair of codes in the low bytes of a word's halves; << 4 gives
    ``(code & 0x7F) << 4`` with the sign at bit 11, and ``y + 15 (y & 0x08000800)`` moves
    it to bit 15 (one ``mad``, which ptxas may issue on the FMA pipe, instead of two masks
    and an ``or`` on the integer pipe). Those bits are the code's value times 2^-120 (e4m3
    subnormals become bf16 subnormals): multiplying by 2^120 and by ``multiplier`` is exact.
    """
    text = (
        "{\n"
        ".reg .b32 p, y, t, k, z;\n"
        f"mov.b32 k, {BF16_2POW120 * 0x10001:#010x};\n"
        "mov.b32 z, 0;\n"
        + "".join(
            f"prmt.b32 p, $2, z, {0x4140 + 0x0202 * i:#06x};\n"
            "shl.b32 y, p, 4;\n"
            "and.b32 t, y, 0x08000800;\n"
            f"mad.lo.u32 ${i}, t, 15, y;\n"
            f"mul.rn.bf16x2 ${i}, ${i}, k;\n"
            f"mul.rn.bf16x2 ${i}, ${i}, $3;\n"
            for i in range(2))
        + "}")
    res = _asm(2, [word, multiplier], text, "=r,=r,r,r", loc, ip)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip))
                 for i in range(2))


@dsl_user_op
def fp4x8_to_e4m3x8(word: Int32, *, loc=None, ip=None):
    """Eight packed e2m1 codes (low nibble first) -> two words of four e4m3 codes: codes
    0, 2, 4, 6 (the low nibbles) and codes 1, 3, 5, 7, each ``sign << 7 | magnitude << 2``.

    That e4m3 byte is the code's value times 2^-6 for every code: exponent field e and
    mantissa bit m of an e2m1 normal become e4m3 exponent e (2^(e - 7)) with mantissa m, and
    the e2m1 subnormal 0.5 (e = 0, m = 1) becomes the e4m3 subnormal 2^-7. The caller
    multiplies the 2^6 back in f32. 7 integer instructions.
    """
    text = (
        "{\n"
        ".reg .b32 a, b;\n"
        "shl.b32 a, $2, 2;\n"
        "shl.b32 b, $2, 4;\n"
        "and.b32 a, a, 0x1C1C1C1C;\n"
        "and.b32 b, b, 0x80808080;\n"
        "or.b32 $0, a, b;\n"
        "shr.u32 a, $2, 2;\n"
        "and.b32 a, a, 0x1C1C1C1C;\n"
        "and.b32 b, $2, 0x80808080;\n"
        "or.b32 $1, a, b;\n"
        "}")
    res = _asm(2, [word], text, "=r,=r,r", loc, ip)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip))
                 for i in range(2))


@dsl_user_op
def e4m3_fold_table(factor: Float32, *, loc=None, ip=None):
    """The 8 e2m1 magnitudes (0, .5, 1, 1.5, 2, 3, 4, 6) times ``factor`` (a power of two) as
    e4m3 bytes, round-to-nearest, in two words (bytes 0-3, 4-7): the ``prmt`` table of
    ``fp4x8_to_e4m3x8_table``. Exact while every product is an e4m3 value (factor in
    [2^-8, 2^6]); 11 instructions per table, i.e. per 32 codes."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 2),
        [Float32(factor).ir_value(loc=loc, ip=ip)],
        "{\n.reg .f32 z, v1, v3, v4, v5, v6, v7;\n.reg .b16 p0, p1, p2, p3;\n"
        "mov.f32 z, 0f00000000;\n"
        "mul.f32 v1, $2, 0f3F000000;\n"
        "mul.f32 v3, $2, 0f3FC00000;\n"
        "add.f32 v4, $2, $2;\n"
        "mul.f32 v5, $2, 0f40400000;\n"
        "mul.f32 v6, $2, 0f40800000;\n"
        "mul.f32 v7, $2, 0f40C00000;\n"
        "cvt.rn.satfinite.e4m3x2.f32 p0, v1, z;\n"       # a -> upper byte, b -> lower byte
        "cvt.rn.satfinite.e4m3x2.f32 p1, v3, $2;\n"
        "cvt.rn.satfinite.e4m3x2.f32 p2, v5, v4;\n"
        "cvt.rn.satfinite.e4m3x2.f32 p3, v7, v6;\n"
        "mov.b32 $0, {p0, p1};\n"
        "mov.b32 $1, {p2, p3};\n}",
        "=r,=r,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip))
                 for i in range(2))


@dsl_user_op
def fp4x8_to_e4m3x8_table(word: Int32, table_lo: Int32, table_hi: Int32, *, loc=None,
                          ip=None):
    """Eight packed e2m1 codes (low nibble first) -> two words of four e4m3 codes in order
    (codes 0-3, 4-7), each looked up in an 8-byte magnitude table (``e4m3_fold_table``) --
    so the per-32 FP4 scale can be folded into the codes -- with the code's sign.

    Per 4 codes: one ``prmt`` looks the magnitudes up (selector: the codes without their
    sign bits), one ``prmt`` in sign-replicate mode over 0x80 bytes gives 0x80 for a positive
    code and 0xFF for a negative one, whose bit 0 a shift moves to bit 7 and one ``lop3``
    ORs in. 11 integer instructions per 8 codes."""
    text = (
        "{\n.reg .b32 m, mh, wh, c, r, k;\n"
        "mov.b32 k, 0x80808080;\n"
        "and.b32 m, $2, 0x77777777;\n"
        "prmt.b32 c, $3, $4, m;\n"
        "prmt.b32 r, k, k, $2;\n"
        "shl.b32 r, r, 7;\n"
        "lop3.b32 $0, c, r, 0x80808080, 0xF8;\n"        # c | (r & 0x80808080)
        "shr.u32 mh, m, 16;\n"
        "shr.u32 wh, $2, 16;\n"
        "prmt.b32 c, $3, $4, mh;\n"
        "prmt.b32 r, k, k, wh;\n"
        "shl.b32 r, r, 7;\n"
        "lop3.b32 $1, c, r, 0x80808080, 0xF8;\n}")
    res = _asm(2, [word, table_lo, table_hi], text, "=r,=r,r,r,r", loc, ip)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip))
                 for i in range(2))


@dsl_user_op
def fence_f32(value: Float32, *, loc=None, ip=None) -> Float32:
    """``value`` through an empty volatile asm: the compiler may not move its uses above
    the side-effecting instructions before it (e.g. a ``wgmma.wait_group``), so ptxas sees
    no read of a WGMMA accumulator that may still be in flight (which it would serialize)."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(value).ir_value(loc=loc, ip=ip)], "",
                                   "=f,0", has_side_effects=True, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def byte_perm(a: Int32, b: Int32, selector: int, *, loc=None, ip=None) -> Int32:
    """``prmt.b32``: byte i of the result is byte ``selector`` nibble i of (b:a)."""
    return Int32(_asm(1, [a, b], f"prmt.b32 $0, $1, $2, {selector:#06x};", "=r,r,r", loc, ip))


@dsl_user_op
def e8m0_f32(e8: Int32, *, loc=None, ip=None) -> Float32:
    """f32 2^(e8 - 127) of an E8M0 byte (0 gives the subnormal 2^-127): ``max(e8 << 23,
    0x00400000)`` as bits."""
    bits = _asm(1, [e8], "{\n.reg .b32 a;\nshl.b32 a, $1, 23;\nmax.u32 $0, a, 0x00400000;\n}",
                "=r,r", loc, ip)
    return Float32(llvm.bitcast(T.f32(), bits, loc=loc, ip=ip))


def _mma_f32(shape_types: str, a, b, c, loc, ip):
    """``mma.sync.aligned.<shape_types>`` with 4 A, 2 B and 4 f32 C/D registers per lane."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        [Int32(v).ir_value(loc=loc, ip=ip) for v in (*a, *b)]
        + [Float32(v).ir_value(loc=loc, ip=ip) for v in c],
        f"mma.sync.aligned.{shape_types} "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip))
                 for i in range(4))


@dsl_user_op
def mma_m16n8k32_e4m3(a, b, c, *, loc=None, ip=None):
    """``mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32`` (sm_89+): d = A B + C.

    Fragments, lane = 4 g + t, each register four e4m3 codes (lowest byte first):
    ``a = (A[g, 4t:4t+4], A[g+8, 4t:4t+4], A[g, 4t+16:4t+20], A[g+8, 4t+16:4t+20])``,
    ``b = (B[4t:4t+4, g], B[4t+16:4t+20, g])``; ``c``/d (f32) as ``mma_m16n8k16_bf16``.
    """
    return _mma_f32("m16n8k32.row.col.f32.e4m3.e4m3.f32", a, b, c, loc, ip)


@cute.jit
def e8m0_bf16x2(e8: Int32) -> Int32:
    """bf16 2^(e8 - 127) in both halves of a word (e8 = 0 gives the subnormal 2^-127)."""
    mult = Int32(0x00400040)
    if e8 > 0:
        mult = (e8 << 7) | (e8 << 23)
    return mult


@dsl_user_op
def mma_m16n8k16_bf16(a, b, c, *, loc=None, ip=None):
    """``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``: d = A B + C for one warp.

    PTX fragments, lane = 4 g + t (g = lane / 4, t = lane % 4), each register a bf16 pair
    (low half first): ``a = (A[g, 2t:2t+2], A[g+8, 2t:2t+2], A[g, 2t+8:2t+10],
    A[g+8, 2t+8:2t+10])``, ``b = (B[2t:2t+2, g], B[2t+8:2t+10, g])``; ``c``/d (f32) =
    ``(C[g, 2t], C[g, 2t+1], C[g+8, 2t], C[g+8, 2t+1])`` with A 16x16, B 16x8, C 16x8.
    """
    return _mma_f32("m16n8k16.row.col.f32.bf16.bf16.f32", a, b, c, loc, ip)


@dsl_user_op
def load_global_words(addr: Int64, count: cutlass.Constexpr, *, keep_in_l1: bool = False,
                      loc=None, ip=None):
    """``count`` (1, 2 or 4) 32-bit words from a read-only global address aligned to their
    size, straight into registers (``ld.global.nc``): ``keep_in_l1`` False bypasses L1
    (bytes no other instruction of the SM reads), True keeps the line for the neighbouring
    loads that read the rest of its sectors."""
    hint = "" if keep_in_l1 else ".L1::no_allocate"
    vec = {1: "", 2: ".v2", 4: ".v4"}[count]
    outs = "$0" if count == 1 else "{" + ", ".join(f"${i}" for i in range(count)) + "}"
    text = f"ld.global.nc{hint}{vec}.b32 {outs}, [${count}];"
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * count) if count > 1 else T.i32(),
        [Int64(addr).ir_value(loc=loc, ip=ip)], text, "=r," * count + "l",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    if count == 1:
        return (Int32(res),)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip))
                 for i in range(count))


def cp_async_atom(nbytes: int, bypass_l1: bool = False) -> cute.CopyAtom:
    """A cp.async copy atom of ``nbytes`` raw bytes; ``bypass_l1`` (16 bytes only): ``.cg``,
    for bytes the SM reads once (weights) or shares through shared memory (token rows)."""
    op = (cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL) if bypass_l1
          else cpasync.CopyG2SOp())
    return cute.make_copy_atom(op, cutlass.Uint8, num_bits_per_copy=8 * nbytes)


@cute.jit
def copy_bytes(atom: cute.CopyAtom, nbytes: cutlass.Constexpr, src: Int64, dst: Int32):
    """One cp.async of ``nbytes`` raw bytes: global address ``src`` -> shared ``dst``."""
    s = cute.make_tensor(cute.make_ptr(cutlass.Uint8, src, cute.AddressSpace.gmem,
                                       assumed_align=nbytes), cute.make_layout((nbytes,)))
    d = cute.make_tensor(cute.make_ptr(cutlass.Uint8, dst, cute.AddressSpace.smem,
                                       assumed_align=nbytes), cute.make_layout((nbytes,)))
    cute.copy(atom, s, d)


@cute.jit
def gated_output(acc_gate: Float32, acc_up: Float32, route_w: Float32,
                 limit: cutlass.Constexpr) -> Float32:
    """``route_w * silu(min(g, l)) * clamp(u, -l, l)`` in f32 with ``g``, ``u`` the GEMM
    outputs rounded to bf16 (the reference's rounding points); ``limit`` 0: no clamp."""
    gate = acc_gate.to(cutlass.BFloat16).to(Float32)
    up = acc_up.to(cutlass.BFloat16).to(Float32)
    if const_expr(limit > 0):
        up = cute.arch.fmax(cute.arch.fmin(up, Float32(limit)), Float32(-limit))
        gate = cute.arch.fmin(gate, Float32(limit))
    silu = gate / (Float32(1.0) + cute.math.exp2(-gate * LOG2_E))
    return route_w * (silu * up)


# The official activation quantisation's constants as f32 bits: the amax floor 1e-4 and
# 1 / 448 (quant.act_quant: scale = 2^ceil(log2(max(amax, 1e-4) * f32(1 / 448)))).
ACT_AMAX_FLOOR_BITS = 0x38D1B717
ACT_INV_FP8_MAX_BITS = 0x3B124925


@dsl_user_op
def bf16x8_abs_max_bits(words, *, loc=None, ip=None) -> Int32:
    """The largest |x| of four bf16x2 words as f32 bits: magnitudes of non-negative floats
    order as integers, so it is an integer max of the values' bits without their signs."""
    text = ("{\n.reg .b32 lo, hi, m;\n"
            "mov.b32 $0, 0;\n"
            + "".join(f"shl.b32 lo, ${1 + i}, 16;\n"
                      f"and.b32 lo, lo, 0x7FFFFFFF;\n"
                      f"and.b32 hi, ${1 + i}, 0x7FFF0000;\n"
                      "max.u32 m, lo, hi;\n"
                      "max.u32 $0, $0, m;\n" for i in range(4))
            + "}")
    return Int32(_asm(1, list(words), text, "=r,r,r,r,r", loc, ip))


@dsl_user_op
def act_scale_bits(amax_bits: Int32, *, loc=None, ip=None):
    """``(scale, 1 / scale)`` as f32 bits for a block whose largest |x| has bits
    ``amax_bits``: scale = 2^ceil(log2(max(amax, 1e-4) * f32(1/448))) from the product's
    bits (exponent + 1 when a mantissa bit is set), exactly ``quant.pow2_ceil_scale``."""
    text = ("{\n.reg .f32 a, t;\n.reg .b32 b, e, m;\n"
            "mov.b32 a, $2;\n"
            f"max.f32 a, a, 0f{ACT_AMAX_FLOOR_BITS:08X};\n"
            f"mul.rn.f32 t, a, 0f{ACT_INV_FP8_MAX_BITS:08X};\n"
            "mov.b32 b, t;\n"
            "shr.u32 e, b, 23;\n"
            "and.b32 e, e, 0xFF;\n"
            "and.b32 m, b, 0x7FFFFF;\n"
            "min.u32 m, m, 1;\n"
            "add.u32 e, e, m;\n"
            "shl.b32 $0, e, 23;\n"
            "mov.b32 m, 254;\n"
            "sub.u32 e, m, e;\n"
            "shl.b32 $1, e, 23;\n}")
    res = _asm(2, [amax_bits], text, "=r,=r,r", loc, ip)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip))
                 for i in range(2))


@dsl_user_op
def bf16x8_sum_squares(words, total: Float32, *, loc=None, ip=None) -> Float32:
    """``total`` plus the squares of four bf16x2 words' 8 values (f32 FMAs, lowest first)."""
    text = ("{\n.reg .f32 v;\nmov.b32 $0, $1;\n"
            + "".join(f"shl.b32 v, ${2 + i}, 16;\n"
                      "fma.rn.f32 $0, v, v, $0;\n"
                      f"and.b32 v, ${2 + i}, 0xFFFF0000;\n"
                      "fma.rn.f32 $0, v, v, $0;\n" for i in range(4))
            + "}")
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(total).ir_value(loc=loc, ip=ip)]
        + [Int32(w).ir_value(loc=loc, ip=ip) for w in words], text, "=f,f,r,r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def bf16x8_rms_normed(words, weight_words, inv_rms: Float32, *, loc=None, ip=None):
    """RMSNorm's output of four bf16x2 words of a row: ``bf16(w * (x * inv_rms))`` per value,
    both products rounded in f32 as ``rms_norm`` does (no FMA), ``weight_words`` the norm
    weight's bf16 of the same columns; four bf16x2 words in the same order."""
    text = ("{\n.reg .b32 t;\n.reg .f32 r, x0, x1, w0, w1;\nmov.b32 r, $8;\n"
            + "".join(f"shl.b32 t, ${4 + i}, 16;\nmov.b32 x0, t;\n"
                      f"and.b32 t, ${4 + i}, 0xFFFF0000;\nmov.b32 x1, t;\n"
                      f"shl.b32 t, ${9 + i}, 16;\nmov.b32 w0, t;\n"
                      f"and.b32 t, ${9 + i}, 0xFFFF0000;\nmov.b32 w1, t;\n"
                      "mul.rn.f32 x0, x0, r;\nmul.rn.f32 x1, x1, r;\n"
                      "mul.rn.f32 x0, w0, x0;\nmul.rn.f32 x1, w1, x1;\n"
                      f"cvt.rn.bf16x2.f32 ${i}, x1, x0;\n" for i in range(4))
            + "}")
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [Int32(w).ir_value(loc=loc, ip=ip) for w in words]
        + [Float32(inv_rms).ir_value(loc=loc, ip=ip)]
        + [Int32(w).ir_value(loc=loc, ip=ip) for w in weight_words],
        text, "=r,=r,=r,=r,r,r,r,r,f,r,r,r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip))
                 for i in range(4))


@dsl_user_op
def bf16x8_to_e4m3x8(words, inv_scale_bits: Int32, *, loc=None, ip=None):
    """Four bf16x2 words (8 values, lowest first) times the power of two ``1 / scale``
    (exact) -> two words of e4m3 codes in the same order, round to nearest even and
    saturated to +-448: ``quant.act_quant``'s codes (|x / scale| <= 448 by the scale)."""
    text = ("{\n.reg .b32 lo, hi;\n.reg .f32 flo, fhi, inv;\n.reg .b16 h0, h1, h2, h3;\n"
            "mov.b32 inv, $6;\n"
            + "".join(f"shl.b32 lo, ${2 + i}, 16;\n"
                      f"and.b32 hi, ${2 + i}, 0xFFFF0000;\n"
                      "mov.b32 flo, lo;\n"
                      "mov.b32 fhi, hi;\n"
                      "mul.rn.f32 flo, flo, inv;\n"
                      "mul.rn.f32 fhi, fhi, inv;\n"
                      f"cvt.rn.satfinite.e4m3x2.f32 h{i}, fhi, flo;\n" for i in range(4))
            + "mov.b32 $0, {h0, h1};\n"
            "mov.b32 $1, {h2, h3};\n}")
    res = _asm(2, [*words, inv_scale_bits], text, "=r,=r,r,r,r,r,r", loc, ip)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip))
                 for i in range(2))
