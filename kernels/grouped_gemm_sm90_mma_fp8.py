"""Grouped expert GEMM for decode tiles on FP8 tensor cores: ``algorithm="mma_fp8"`` (sm_90a).

Same launcher, tiles, copies pipeline and epilogue as ``grouped_gemm_sm90_mma_sync`` ("mma_sync"), for FP4
and FP8 expert weights with the FP8 activation simulation on (the official numerics): the
bf16 activations ``x`` [rows, K] are quantised in the kernel -- e4m3 codes and one f32
scale per token and K block of 128, bit for bit ``quant.act_quant`` (or, with
``config.token_codes``, come quantised so) -- and the warps run
``mma.sync.m16n8k32`` on e4m3 operands, so that the weights need no bf16 conversion:

* FP4: 8 codes per 32-bit word become two words of e4m3 codes in 7 integer instructions
  (``fp4x8_to_e4m3x8``: each code's value x 2^-6, exact; ~21 instructions per 8 codes to
  bf16 with the scale in "mma_sync", the launch's limit there, docs/performance.md). One
  MMA step of K = 32 is one E8M0 scale block of every weight row, so each step's f32 result
  is scaled by its rows' block scales (4 FFMA) into the K block's sum, which the tokens'
  scales then add into the accumulators; 2^6 is restored in the epilogue.
* FP8: the e4m3 weight bytes are the A operand as stored; the K block's 4 steps chain in
  the tensor core and the K block's sum is scaled by the 128 x 128 block scale times the
  token scales.

Dataflow per K block (CTA = 4 warps x 16 weight rows of one expert, one tile of <= 8 token
rows; ``num_stages``-deep cp.async ring, one CTA barrier per K block, as "mma_sync"):
weights (FP4: lane 4g + t unit t of rows g, g + 8 of each matrix; FP8: whole 128-byte
rows, 4 per copy instruction, ``grouped_gemm_layout.fp8_row_copy``) into row-major,
swizzled rows of its warp's stage (``grouped_gemm_layout.fp8_warp_unit``);
weight scales every ``scale_group`` K blocks into the warp's buffers. Tokens, in
``config.token_stages`` = S stages of codes + scales (a half warp quantises one row of one
K block: its largest |x| by shuffles, 8 columns per thread): before the loop the first S - 1
blocks of the CTA's range, as (row, block) pairs over the 8 half warps with every pass's
loads issued first (``first_tokens``); in block kb, thread 16 r + u quantises row r of block
kb + S - 1 from registers loaded a block earlier and loads block kb + S's
(``tokens_ahead``). With ``config.token_codes`` the rows come quantised (e4m3 codes
[rows, K] and f32 scales [rows, K / 128], ``quant.act_quant``'s): the same threads load a
block's 8 codes and its scale and store them where they would have stored their own.
Warps without a tile row (warp w holds rows 2w, 2w + 1) skip the loop's share: their
stage rows feed only output columns that are never written. With ``config.row_norm_eps``
the rows are an RMSNorm's inputs (``mXs``: the norm weight, bf16 [K]): before the first
quantisation half warp h sums the squares of tile row h (past the count: the first row)
over all of K -- every CTA of a K split reads the whole row -- and leaves its inverse RMS
in shared memory (one CTA barrier); every block is then ``bf16(w * (x * inv_rms))`` before
it is quantised, as ``rms_norm`` rounds it (``bf16x8_rms_normed``).
Step i, lane 4g + t multiplies columns 32i + 8t .. 32i + 8t + 7: FP4 codes 0, 2, 4, 6 of
that word are MMA columns 4t .. 4t + 3 and codes 1, 3, 5, 7 columns 4t + 16 .. 4t + 19,
so the lane's 8 token bytes are split the same way (two ``prmt``); FP8 bytes 0-3 and 4-7
of the 8 go to those columns directly, for weights and tokens alike.

Constraints: those of "mma_sync"; weights FP4 or FP8 (not BF16); block_n = 8. Ablations
(benchmarks only, outputs wrong by design): no_load, no_scale_load (the weights' scales
copied for the first stages only), no_dequant (FP4 codes multiplied as they are), no_mma
(conversion kept, the MMAs replaced by one integer op), no_quant (only the first K block's
token rows loaded and quantised), and mma_sync's no_reduce / no_cluster (a split's sums not
added; the cluster launch kept / not) and no_barrier (each K block's CTA barrier left out:
warps race the copies). FP4 weights are read in either ``weight_layout`` (mma_sync's copies).
Outputs differ from the reference only by the order of f32 additions and by the FP8 tensor
cores' internal sum over K = 32 (FP4) or 128 (FP8) products before each promotion to f32.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .grouped_gemm_config import GroupedGemmSm90Config
from .grouped_gemm_layout import (BLOCK_K, FP8_TOKEN_STAGE_BYTES, WARP_COUNT, WARP_ROWS,
                                  WARP_TOKENS, fp8_warp_smem_bytes, fp8_warp_unit,
                                  ring_slot, warp_copy_unit)
from .grouped_gemm_sm90_convert import (act_scale_bits, bf16x8_abs_max_bits, bf16x8_rms_normed,
                               bf16x8_sum_squares, bf16x8_to_e4m3x8, byte_perm, e8m0_f32,
                               fp4x8_to_e4m3x8, load_global_words, mma_m16n8k32_e4m3)
from .grouped_gemm_sm90_mma_sync import STEPS, GroupedGemmMmaSyncSm90, _load_word

FP4_UNSCALE = 64.0            # fp4x8_to_e4m3x8 gives the codes' values x 2^-6
NORM_PASS_BLOCKS = 8          # K blocks whose row loads the norm's sum issues at once


class GroupedGemmMmaFp8Sm90(GroupedGemmMmaSyncSm90):
    """Static configuration of one compiled kernel (see the module docstring)."""
    TAKES_TOKEN_STRIDE = True

    def __init__(self, weight_format: str, gated: bool, swiglu_limit: float,
                 config: GroupedGemmSm90Config, scale_group: int, paired: bool = False,
                 token_stride: int = 1):
        if weight_format not in ("fp4", "fp8"):
            raise ValueError(f"GroupedGemmMmaFp8Sm90: FP4/FP8 weights, got {weight_format!r}")
        super().__init__(weight_format, gated, swiglu_limit, config, scale_group, paired,
                         token_stride)
        # Shared memory: [token stages][weight ring: stage-major, then warp][scale buffers].
        self.token_stages = config.token_stages
        self.token_codes = config.token_codes
        self.warp_stage_bytes = self.mats * WARP_ROWS * self.row_bytes
        self.weights_offset = self.token_stages * FP8_TOKEN_STAGE_BYTES
        self.scales_offset = self.weights_offset + self.num_stages * WARP_COUNT * (
            self.warp_stage_bytes)
        self.smem_bytes = fp8_warp_smem_bytes(weight_format, self.mats == 2, self.num_stages,
                                              self.token_stages)
        # Row norm: the tile rows' inverse RMS (f32 each) after the rest.
        self.row_norm_eps = config.row_norm_eps
        self.norm_offset = self.smem_bytes
        self.token_words = 4
        if config.row_norm_eps is not None:
            self.smem_bytes += WARP_TOKENS * 4
            self.token_words = 8           # a block's 4 words of x, then the weight's 4

    def token_stage(self, base, kb):
        """The codes and scales of K block ``kb``: one of ``token_stages`` stages."""
        return base + ring_slot(kb, self.token_stages) * FP8_TOKEN_STAGE_BYTES

    @cute.jit
    def first_tokens(self, mX: cute.Tensor, mXs: cute.Tensor, row0: Int32, rows: Int32,
                     kb0: Int32, kb1: Int32, base: Int32, tidx: Int32):
        """Before "mma_sync"'s K loop: the first A = ``token_stages - 1`` K blocks of the
        range quantised into their stages, as (row, block) pairs dealt over the CTA's 8 half
        warps (a pass per 8 pairs; every pass's loads issued before the first quantisation,
        so the CTA waits for one load, not one per block); then block kb0 + A's rows loaded
        into registers (the state ``tokens_ahead`` carries) by the warps that hold tile rows
        (``quantizing_warp``). Warps without a pair in a pass skip it (whole warps: their
        shuffles); a half warp without one shuffles its warp's first pair and stores
        nothing."""
        if const_expr(self.pdl == "weights"):
            # The first stages' weight and scale copies are issued: now wait for the kernel
            # before, which writes the token rows.
            cute.arch.griddepcontrol_wait()
        ahead = self.token_stages - 1
        blocks = kb1 - kb0
        if blocks > ahead:
            blocks = Int32(ahead)
        pairs = rows * blocks
        half, unit = tidx // 16, tidx % 16
        warp_pair = (tidx // 32) * 2                  # the warp's first half warp
        loaded = []
        for j in cutlass.range_constexpr(ahead):
            words = (Int32(0),) * self.token_words
            if 8 * j + warp_pair < pairs:
                p = 8 * j + half
                if p >= pairs:
                    p = 8 * j + warp_pair
                words = self.load_row_block(mX, mXs, row0 + p % rows, kb0 + p // rows,
                                            unit)
            loaded.append(words)
        if const_expr(self.row_norm_eps is not None):
            self.store_inverse_rms(mX, row0, rows, base, tidx)
            cute.arch.barrier()
        for j in cutlass.range_constexpr(ahead):
            if 8 * j + warp_pair < pairs:
                p = 8 * j + half
                if p >= pairs:
                    p = 8 * j + warp_pair
                self.quantize_block(self.normed(loaded[j], base, p % rows),
                                    self.token_stage(base, kb0 + p // rows),
                                    p % rows, unit, 8 * j + half < pairs)
        x_words = (Int32(0),) * self.token_words
        if self.quantizing_warp(rows, tidx) and kb0 + ahead < kb1:
            x_words = self.load_tokens(mX, mXs, row0, rows, kb0 + ahead, tidx)
        return x_words

    @cute.jit
    def store_inverse_rms(self, mX: cute.Tensor, row0: Int32, rows: Int32, base: Int32,
                          tidx: Int32):
        """Row norm: half warp h leaves rsqrt(mean(x^2) + eps) of tile row h (past the
        tile's count: its first row, as ``load_tokens`` reads) at slot h: thread u sums the
        squares of columns 8u .. 8u + 7 of every K block (``NORM_PASS_BLOCKS`` blocks' loads
        in flight at once, kept in L1 for the quantisation's loads of the same bytes), the
        half warp adds its 16 sums by shuffles."""
        half, unit = tidx // 16, tidx % 16
        x_row = row0 + half
        if half >= rows:
            x_row = row0
        k_in = mX.shape[1]
        num_k = k_in // BLOCK_K
        row_addr = mX.iterator.toint() + (x_row.to(Int64) * k_in + 8 * unit) * 2
        total = Float32(0.0)
        for kb_pass in cutlass.range(0, num_k, NORM_PASS_BLOCKS, unroll=1):
            words = []
            for j in cutlass.range_constexpr(NORM_PASS_BLOCKS):
                block = (Int32(0),) * 4
                if kb_pass + j < num_k:
                    block = load_global_words(row_addr + (kb_pass + j) * BLOCK_K * 2, 4,
                                              keep_in_l1=True)
                words.append(block)
            for j in cutlass.range_constexpr(NORM_PASS_BLOCKS):
                total = bf16x8_sum_squares(words[j], total)
        for offset in (8, 4, 2, 1):
            total = total + cute.arch.shuffle_sync_bfly(total, offset=offset)
        inverse = cute.math.rsqrt(total / Float32(k_in) + Float32(self.row_norm_eps))
        if unit == 0:
            _store_f32(base + self.norm_offset + half * 4, inverse)

    @cute.jit
    def normed(self, words, base: Int32, r: Int32):
        """A block's 4 bf16x2 words of tile row ``r`` as the kernel quantises them: with the
        row norm, ``bf16(w * (x * inv_rms))`` from the 8 words ``load_row_block`` gives
        (x, then the weight's) and the row's inverse RMS (``store_inverse_rms``)."""
        if const_expr(self.row_norm_eps is None):
            return words
        inverse = _load_f32(base + self.norm_offset + r * 4)
        return bf16x8_rms_normed(words[:4], words[4:], inverse)

    def quantizing_warp(self, rows: Int32, tidx: Int32):
        """Whether thread tidx's warp holds a tile row (warp w quantises rows 2w, 2w + 1):
        the others skip the tokens' loads and quantisation, whose codes would only reach
        output columns that are never written (a whole warp, for its shuffles)."""
        return (tidx // 32) * 2 < rows

    @cute.jit
    def tokens_ahead(self, x_words, mX: cute.Tensor, mXs: cute.Tensor, row0: Int32,
                     rows: Int32, kb: Int32, kb1: Int32, base: Int32, tidx: Int32):
        """In K block kb, after its barrier and before its MMAs: the token rows of block
        kb + A (A = ``token_stages - 1``) are quantised into their stage from registers
        loaded a block earlier, and block kb + A + 1's are loaded. The barrier of block kb
        orders both: the stage of kb - 1 (= kb + A's) is no longer read, and kb + A's codes
        are written A blocks before their MMAs. (With A = 1, at T = 1, a block's MMAs are
        shorter than a token load's latency: the few-tile launches take more stages,
        ``grouped_gemm_config.FEW_TILES_TOKEN_STAGES``; docs/performance.md.)"""
        ahead = self.token_stages - 1
        # Ablation "no_quant": only the blocks before the loop are quantised (the stages then
        # hold stale codes).
        if const_expr(not self.leaves_out("no_quant")):
            if kb + ahead < kb1 and self.quantizing_warp(rows, tidx):
                self.quantize_block(self.normed(x_words, base, self.tile_row(rows, tidx)),
                                    self.token_stage(base, kb + ahead), tidx // 16,
                                    tidx % 16, True)
                if kb + ahead + 1 < kb1:
                    x_words = self.load_tokens(mX, mXs, row0, rows, kb + ahead + 1, tidx)
        return x_words

    @cute.jit
    def tile_row(self, rows: Int32, tidx: Int32):
        """The tile row thread tidx's loop loads (``load_tokens``): tidx / 16, or 0 past the
        tile's count."""
        r = tidx // 16
        if r >= rows:
            r = Int32(0)
        return r

    @cute.jit
    def load_tokens(self, mX: cute.Tensor, mXs: cute.Tensor, row0: Int32, rows: Int32,
                    kb: Int32, tidx: Int32):
        """Thread tidx's 8 bf16 of K block ``kb`` of tile row r = tidx / 16 (rows past the
        tile's count in a quantising warp read its first row, whose outputs are never
        written)."""
        return self.load_row_block(mX, mXs, row0 + self.tile_row(rows, tidx), kb, tidx % 16)

    @cute.jit
    def load_row_block(self, mX: cute.Tensor, mXs: cute.Tensor, x_row: Int32, kb: Int32,
                       unit: Int32):
        """Columns 8 unit .. 8 unit + 7 of K block ``kb`` of tile row ``x_row`` -- token row
        ``x_row / token_stride`` of ``mX`` (the routed experts' assignment rows read their
        token, no gather before the launch) -- as four bf16x2 words; ``token_codes``: their
        two words of e4m3 codes and the block's f32 scale bits (twice); row norm: then the
        norm weight's 4 words of the same columns (``mXs``, bf16 [K])."""
        k_in = mX.shape[1]
        kb = self.k_read(kb, k_in // BLOCK_K)
        if const_expr(self.token_stride != 1):
            x_row = x_row // self.token_stride
        if const_expr(self.token_codes):
            codes = load_global_words(
                mX.iterator.toint() + x_row.to(Int64) * k_in + kb * BLOCK_K + 8 * unit, 2)
            scale = load_global_words(
                mXs.iterator.toint() + (x_row.to(Int64) * (k_in // BLOCK_K) + kb) * 4, 1)
            return (codes[0], codes[1], scale[0], scale[0])
        src = mX.iterator.toint() + (x_row.to(Int64) * k_in + kb * BLOCK_K + 8 * unit) * 2
        if const_expr(self.row_norm_eps is not None):
            weight = load_global_words(mXs.iterator.toint() + (kb * BLOCK_K + 8 * unit) * 2, 4,
                                       keep_in_l1=True)
            return (*load_global_words(src, 4), *weight)
        return load_global_words(src, 4)

    @cute.jit
    def quantize_block(self, x_words, stage: Int32, r: Int32, unit: Int32, store):
        """The official 1 x 128 activation quantisation of one K block of tile row ``r``
        (``quant.act_quant``, bit for bit), by a half warp: it takes the row's largest |x|
        by shuffles, and each thread writes the e4m3 codes of its 8 columns (``unit``),
        the first the f32 scale; nothing is stored unless ``store``."""
        scale, codes = self.quantized_codes(x_words)
        if store:
            dst = (stage + r * BLOCK_K + fp8_warp_unit("tokens", r, unit // 2) * 16
                   + 8 * (unit % 2))
            _store_words2(dst, codes)
            if unit == 0:
                _store_words2(stage + WARP_TOKENS * BLOCK_K + r * 4, (scale,))

    @cute.jit
    def quantized_codes(self, x_words):
        """A half warp's 1 x 128 quantisation of one K block of a row (8 columns per thread
        in ``x_words``): the row's largest |x| by shuffles, then the f32 scale bits and this
        thread's 8 e4m3 codes (two words); ``token_codes``: those, as loaded."""
        if const_expr(self.token_codes):
            return x_words[2], (x_words[0], x_words[1])
        amax = bf16x8_abs_max_bits(x_words)
        for offset in (8, 4, 2, 1):
            other = cute.arch.shuffle_sync_bfly(amax, offset=offset)
            amax = other if other > amax else amax
        scale, inverse = act_scale_bits(amax)
        return scale, bf16x8_to_e4m3x8(x_words, inverse)

    def block_inputs(self, base, kb, warp, lane):
        """Lane 4g + t's shared-memory inputs of K block ``kb``: its warp's weight stage, the
        token stage, the scales of tokens 2t and 2t + 1 (its accumulator columns), the
        weight scale words per matrix (FP4: rows g and g + 8; FP8: the matrix's word) and
        the block's place in its scale group."""
        g, t = lane // 4, lane % 4
        scales = self.scale_buffer(base, kb, warp)
        in_group = ring_slot(kb, self.scale_group)
        tokens = self.token_stage(base, kb)
        token_scales = _load_f32x2(tokens + WARP_TOKENS * BLOCK_K + 8 * t)
        scale_words = []
        for mat in range(self.mats):
            if const_expr(self.weight_format == "fp4"):
                scale_words.append([_load_word(scales + (mat * WARP_ROWS + g + 8 * half) * 16
                                               + in_group * 4) for half in range(2)])
            else:
                scale_words.append([_load_word(scales + mat * 4)])
        return (self.weight_stage(base, kb, warp), tokens,
                [token_scales[j] for j in range(2)], scale_words, in_group)

    def weight_slot(self, stage, mat, half, chunk, lane):
        """Row-major rows of the warp's stage, units swizzled (``fp8_warp_unit``): the lanes
        of an MMA step read across the units their neighbours copied."""
        g, t = lane // 4, lane % 4
        q = mat * WARP_ROWS + g + 8 * half                       # the row in the warp's stage
        unit = fp8_warp_unit(self.weight_format, q, warp_copy_unit(t, chunk))
        return stage + q * self.row_bytes + unit * 16

    def copy_slot(self, stage, mat, half, chunk, lane):
        """A lane's copies go to its own units of the rows (``weight_slot``)."""
        return self.weight_slot(stage, mat, half, chunk, lane)

    def fp8_row_slot(self, stage, mat, row, unit):
        """FP8 weights (copied whole rows at a time, ``fp8_row_copy``): 16-byte ``unit`` of
        warp row ``row`` of ``mat``, where ``weight_slot`` and the reads place it."""
        q = mat * WARP_ROWS + row
        return stage + q * self.row_bytes + fp8_warp_unit("fp8", q, unit) * 16

    @cute.jit
    def issue(self, mX: cute.Tensor, mXs: cute.Tensor, mWa: cute.Tensor, mSa: cute.Tensor,
              mWb: cute.Tensor, mSb: cute.Tensor, expert: Int32, m_tile: Int32, w_row: Int32,
              row0: Int32, rows: Int32, kb: Int32, base: Int32, warp: Int32, tidx: Int32):
        """This thread's cp.async copies of K block ``kb``: weights and their scales (the
        tokens are loaded and quantised by ``first_tokens`` / ``tokens_ahead``)."""
        lane = tidx % 32
        n_out = mWa.shape[1]
        k_in = mX.shape[1]
        num_k = k_in // BLOCK_K
        # Ablation: weights copied only for the first stages (stale bytes are still
        # multiplied).
        load = kb < self.num_stages if const_expr(self.leaves_out("no_load")) else True
        if load:
            self.issue_weights(mWa, mWb, w_row, kb, self.weight_stage(base, kb, warp), k_in,
                               lane)
        # Ablation: scales copied only for the first stages (stale scales are applied).
        load_scales = kb < self.num_stages if const_expr(self.leaves_out("no_scale_load")) \
            else True
        if ring_slot(kb, self.scale_group) == 0:
            if load_scales:
                self.issue_scales(mSa, mSb, n_out, expert, m_tile, w_row, kb, num_k,
                                  self.scale_buffer(base, kb, warp), lane)

    @cute.jit
    def compute(self, acc: cute.Tensor, base: Int32, kb: Int32, warp: Int32, lane: Int32):
        """This lane's MMAs of K block ``kb``: its sum per matrix, scaled into ``acc``."""
        g, t = lane // 4, lane % 4
        stage, tokens, sx, scale_words, in_group = self.block_inputs(base, kb, warp, lane)
        block = cute.make_rmem_tensor((4 * self.mats,), Float32)
        block.fill(0.0)
        for i in cutlass.range_constexpr(STEPS):
            # The lane's 8 token bytes of step i: columns 32i + 8t .. + 7 of token row g.
            x = _load_words2(tokens + g * BLOCK_K
                             + fp8_warp_unit("tokens", g, 2 * i + t // 2) * 16 + 8 * (t % 2))
            if const_expr(self.weight_format == "fp4"):
                b = (byte_perm(x[0], x[1], 0x6420), byte_perm(x[0], x[1], 0x7531))
            else:
                b = (x[0], x[1])
            for mat in cutlass.range_constexpr(self.mats):
                a = self.a_registers(stage, mat, i, g, t)
                self.mma_step(block, mat, i, a, b,
                              [(scale_words[mat][half] >> (8 * i)) & 0xFF for half in range(2)]
                              if self.weight_format == "fp4" else [])
        self.add_block(acc, block, sx,
                       [(scale_words[mat][0] >> (8 * in_group)) & 0xFF
                        for mat in range(self.mats)]
                       if self.weight_format == "fp8" else [])

    def a_registers(self, stage, mat: int, i: int, g, t):
        """Lane 4g + t's A registers of matrix ``mat`` and MMA step ``i``: of rows g and
        g + 8 of its warp, MMA columns 4t .. 4t + 3 and 16 + 4t .. 16 + 4t + 3 (see the
        module docstring: FP4 even codes of the lane's word, then odd ones; FP8 bytes 0-3,
        then 4-7). Plain Python: unrolled where the kernel calls it."""
        rows_ab = []                               # per row half: (first, third register)
        for half in range(2):
            q = mat * WARP_ROWS + g + 8 * half
            if const_expr(self.weight_format == "fp4"):
                word = _load_word(stage + q * self.row_bytes
                                  + fp8_warp_unit("fp4", q, i) * 16 + 4 * t)
                if const_expr(self.leaves_out("no_dequant")):
                    rows_ab.append((word, word ^ 0x5A5A5A5A))
                else:
                    rows_ab.append(fp4x8_to_e4m3x8(word))
            else:
                rows_ab.append(_load_words2(stage + q * self.row_bytes
                                            + fp8_warp_unit("fp8", q, 2 * i + t // 2) * 16
                                            + 8 * (t % 2)))
        return (rows_ab[0][0], rows_ab[1][0], rows_ab[0][1], rows_ab[1][1])

    def mma_step(self, block: cute.Tensor, mat: cutlass.Constexpr, i: cutlass.Constexpr, a, b,
                 fp4_scales):
        """MMA step ``i`` of matrix ``mat`` into the K block's sums ``block``: FP8 chained in
        the tensor core; FP4 each step's result times its rows' E8M0 scale bytes
        ``fp4_scales`` (rows g, g + 8) for scale block ``i``. Plain Python: unrolled where
        the kernel calls it."""
        if const_expr(self.leaves_out("no_mma")):
            # Keeps the operands live at one integer op + one convert per value.
            for j in range(4):
                block[4 * mat + j] = block[4 * mat + j] + (a[j] ^ b[j % 2]).to(Float32)
        elif const_expr(self.weight_format == "fp4"):
            d = mma_m16n8k32_e4m3(a, b, (Float32(0.0),) * 4)
            # Scale block i of rows g (d0, d1) and g + 8 (d2, d3).
            sw = [e8m0_f32(fp4_scales[half]) for half in range(2)]
            for j in range(4):
                block[4 * mat + j] = block[4 * mat + j] + sw[j // 2] * d[j]
        else:
            d = mma_m16n8k32_e4m3(a, b, tuple(block[4 * mat + j] for j in range(4)))
            for j in range(4):
                block[4 * mat + j] = d[j]

    def add_block(self, acc: cute.Tensor, block: cute.Tensor, sx, fp8_scales):
        """``acc += block`` x the tokens' scales ``sx`` (tokens 2t, 2t + 1), FP8 also x the
        128 x 128 block's E8M0 scale byte of each matrix (``fp8_scales``)."""
        for mat in range(self.mats):
            if const_expr(self.weight_format == "fp4"):
                mult = sx
            else:
                sw = e8m0_f32(fp8_scales[mat])
                mult = [sw * sx[j] for j in range(2)]
            for j in range(4):
                acc[4 * mat + j] = acc[4 * mat + j] + mult[j % 2] * block[4 * mat + j]

    @cute.jit
    def finish(self, acc: cute.Tensor):
        if const_expr(self.weight_format == "fp4"):
            for j in cutlass.range_constexpr(4 * self.mats):
                acc[j] = acc[j] * Float32(FP4_UNSCALE)


def _load_words2(addr):
    """Two 32-bit words from an 8-byte aligned shared-memory address."""
    return cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.smem,
                                          assumed_align=8), cute.make_layout((2,))).load()


def _load_f32x2(addr):
    return cute.make_tensor(cute.make_ptr(Float32, addr, cute.AddressSpace.smem,
                                          assumed_align=8), cute.make_layout((2,))).load()


def _store_f32(addr, value):
    dst = cute.make_tensor(cute.make_ptr(Float32, addr, cute.AddressSpace.smem,
                                         assumed_align=4), cute.make_layout((1,)))
    dst[0] = value


def _load_f32(addr):
    return cute.make_tensor(cute.make_ptr(Float32, addr, cute.AddressSpace.smem,
                                          assumed_align=4), cute.make_layout((1,)))[0]


def _store_words2(addr, words):
    """One or two 32-bit words to a shared-memory address aligned to their size."""
    dst = cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.smem,
                                         assumed_align=4 * len(words)),
                           cute.make_layout((len(words),)))
    for i in range(len(words)):
        dst[i] = words[i]
