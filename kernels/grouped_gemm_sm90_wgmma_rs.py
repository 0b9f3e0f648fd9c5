"""Grouped expert GEMM for decode tiles on warpgroup FP8 MMAs: ``algorithm="wgmma_rs"`` (sm_90a).

"mma_fp8" (``grouped_gemm_sm90_mma_fp8``) with its warp-level ``mma.sync`` e4m3 MMAs replaced by
one warpgroup MMA per matrix and step, ``wgmma.mma_async.m64n8k32.f32.e4m3.e4m3`` with the
weights as the register-sourced A operand and the tokens read from shared memory by descriptor.
Why: at decode the warp kernels are bound by instructions, not bytes (Nsight Compute of the
routed w1/w3 launch at T = 8: ~29 instructions per ``HMMA``, docs/performance.md). On sm_90
``mma.sync`` with e4m3 operands is no FP8 MMA: ptxas unpacks both operands to f16
(``F2FP.F16.E4M3.UNPACK_B``, 5 per HMMA) and adds the halves of each K = 32 in f32. The
warpgroup MMA takes the e4m3 codes as they are and no lane loads, permutes or unpacks the
token operand.

Everything else is "mma_fp8"'s: CTA = 4 warps = one warpgroup of 64 weight rows per matrix
and one tile of <= 8 token rows, the cp.async ring with one CTA barrier per K block, the
in-kernel 1 x 128 token quantisation, the K split, the epilogue. Lane 4g + t of warp w holds
the A fragment rows 16w + g, 16w + g + 8 -- the same per-warp layout as ``mma.sync``'s
m16n8k32 (CuTe's ``ALayout_64x32``) -- so the weight words and their conversion
(``fp4x8_to_e4m3x8``, exact, values x 2^-6) are "mma_fp8"'s, and so are the accumulator
fragments (rows g, g + 8; tokens 2t, 2t + 1).

Tokens: the quantising threads store each step's B operand as the canonical K-major layout
without swizzle -- two 8 x 16-byte core matrices (MMA columns 0-15, 16-31), 128 bytes apart
(the descriptor's leading and stride offsets) -- in the K order the weights' registers
imply: FP4, MMA column 4t + j of step i is K column 32i + 8t + 2j and column 16 + 4t + j is
32i + 8t + 2j + 1 (a lane's word holds 8 consecutive codes: even ones in its first register,
odd ones in its third); FP8, columns 4t + j and 16 + 4t + j are 32i + 8t + j and
32i + 8t + 4 + j. Then a proxy fence: the tensor cores read what generic stores wrote.

Per K block and step: the lane converts its weight words (FP4: 2 per matrix), one
``wgmma.fence``, an MMA per matrix into fresh f32 registers and a commit; then it waits for
the previous step's MMAs (this step's run on meanwhile) and adds their results as
"mma_fp8" does: FP4 scaled by the rows' E8M0 scale block into the K block's sums (FP8 added
as they are), which the tokens' scales then add into the accumulators.

Constraints: those of "mma_fp8" (weights FP4 or FP8, block_n = 8). Ablations: "mma_fp8"'s;
"no_mma" keeps the conversion and replaces the MMAs by one integer op per register.
Outputs differ from the reference only by the order of f32 additions and by the FP8 tensor
cores' internal sum over K = 32 products before each promotion to f32.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .grouped_gemm_layout import BLOCK_K, WARP_TOKENS, rs_token_offset
from .grouped_gemm_sm90_convert import byte_perm, e8m0_f32, fence_f32
from .grouped_gemm_sm90_mma_fp8 import GroupedGemmMmaFp8Sm90, _store_words2
from .grouped_gemm_sm90_mma_sync import STEPS

CORE_BYTES = 128            # one 8 x 16-byte core matrix of the token operand
STEP_BYTES = 2 * CORE_BYTES  # a step's token operand (``rs_token_offset``)


class GroupedGemmWgmmaRsSm90(GroupedGemmMmaFp8Sm90):
    """Static configuration of one compiled kernel (see the module docstring)."""

    @cute.jit
    def quantize_block(self, x_words, stage: Int32, r: Int32, unit: Int32, store):
        """"mma_fp8"'s 1 x 128 quantisation of one K block of tile row ``r`` by a half warp,
        the codes stored as the steps' B operands (see the module docstring)."""
        scale, codes = self.quantized_codes(x_words)
        if store:
            first, second = codes[0], codes[1]
            if const_expr(self.weight_format == "fp4"):
                first = byte_perm(codes[0], codes[1], 0x6420)
                second = byte_perm(codes[0], codes[1], 0x7531)
            _store_words2(stage + rs_token_offset(r, unit, 0), (first,))
            _store_words2(stage + rs_token_offset(r, unit, 1), (second,))
            if unit == 0:
                _store_words2(stage + WARP_TOKENS * BLOCK_K + r * 4, (scale,))
            # The warpgroup MMAs read these codes through the async proxy.
            cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def compute(self, acc: cute.Tensor, base: Int32, kb: Int32, warp: Int32, lane: Int32):
        """This lane's share of K block ``kb``'s warpgroup MMAs, scaled into ``acc``."""
        g, t = lane // 4, lane % 4
        stage, tokens, sx, scale_words, in_group = self.block_inputs(base, kb, warp, lane)
        block = cute.make_rmem_tensor((4 * self.mats,), Float32)
        block.fill(0.0)
        # One descriptor per K block; step i's is it plus the step's offset (its address
        # field counts 16 bytes: no carry out of it, shared memory is < 2^18 bytes).
        desc = token_descriptor(tokens)
        # Step i's conversions and MMAs run while step i - 1's MMAs finish; its results are
        # read after a wait that leaves only step i's in flight.
        pending = []
        for i in cutlass.range_constexpr(STEPS + 1):
            issued = []
            if const_expr(i < STEPS):
                frags = [self.a_registers(stage, mat, i, g, t) for mat in range(self.mats)]
                issued = self.multiply(frags, tokens + i * STEP_BYTES,
                                       desc + (i * STEP_BYTES >> 4))
            if const_expr(i > 0):
                if const_expr(not self.leaves_out("no_mma")):
                    cute.nvgpu.warpgroup.wait_group(1 if i < STEPS else 0)
                    pending = [[fence_f32(d[j]) for j in range(4)] for d in pending]
                self.add_step(block, pending, scale_words, i - 1)
            pending = issued
        self.add_block(acc, block, sx,
                       [(scale_words[mat][0] >> (8 * in_group)) & 0xFF
                        for mat in range(self.mats)]
                       if self.weight_format == "fp8" else [])

    def add_step(self, block: cute.Tensor, parts, scale_words, i: int):
        """Step ``i``'s results ``parts`` (per matrix) into the K block's sums: FP4 times
        their rows' E8M0 scale block i (rows g: d0, d1; g + 8: d2, d3), FP8 as they are."""
        for mat in range(self.mats):
            d = parts[mat]
            if const_expr(self.weight_format == "fp4"):
                sw = [e8m0_f32((scale_words[mat][half] >> (8 * i)) & 0xFF) for half in range(2)]
                for j in range(4):
                    block[4 * mat + j] = block[4 * mat + j] + sw[j // 2] * d[j]
            else:
                for j in range(4):
                    block[4 * mat + j] = block[4 * mat + j] + d[j]

    def multiply(self, frags, tokens: Int32, desc: Int64):
        """One step's MMAs, a matrix each: A registers ``frags[mat]``, B the step's token
        operand at ``tokens`` (descriptor ``desc``); issued after a ``wgmma.fence`` that the
        A registers pass through (their conversion stays before it), each result in fresh
        f32 registers, read only after the warpgroup's wait."""
        if const_expr(self.leaves_out("no_mma")):
            return [[(a[j] ^ tokens).to(Float32) for j in range(4)] for a in frags]
        words = wgmma_fence([w for a in frags for w in a])
        parts = [wgmma_m64n8k32_e4m3_rs(words[4 * m:4 * m + 4], desc)
                 for m in range(len(frags))]
        cute.nvgpu.warpgroup.commit_group()
        return parts


def token_descriptor(addr: Int32) -> Int64:
    """The wgmma shared-memory descriptor of one step's token operand at ``addr``: K-major,
    no swizzle, core matrices adjacent in K (leading offset) and in N (stride offset; one
    core matrix row at N = 8) 128 bytes apart."""
    off = CORE_BYTES >> 4
    lo = ((addr >> 4) & 0x3FFF) | (off << 16)
    return (Int64(off) << 32) | lo.to(Int64)


@dsl_user_op
def wgmma_fence(words, *, loc=None, ip=None):
    """``wgmma.fence.sync.aligned`` with ``words`` (the next MMAs' A registers) passed
    through it: their writes stay before the fence, their MMAs after it."""
    n = len(words)
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * n),
        [Int32(w).ir_value(loc=loc, ip=ip) for w in words], "wgmma.fence.sync.aligned;",
        ",".join(["=r"] * n + [str(i) for i in range(n)]), has_side_effects=True,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(n)]


@dsl_user_op
def wgmma_m64n8k32_e4m3_rs(a, desc: Int64, *, loc=None, ip=None):
    """``wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3`` with A from registers (``a``:
    4 words of e4m3 codes, ``ALayout_64x32``) and B by descriptor; D = A B (scale-d 0) in 4
    fresh f32 registers. Asynchronous: read D only after ``wgmma.wait_group`` (through
    ``fence_f32``)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        [Int32(v).ir_value(loc=loc, ip=ip) for v in a] + [Int64(desc).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, $8, p, 1, 1;\n}",
        "=f,=f,=f,=f,r,r,r,r,l", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]
