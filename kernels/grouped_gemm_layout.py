"""The grouped GEMM kernels' tile geometry, and the warp decode kernels' shared-memory
layouts and lane mappings ("mma_sync", "mma_fp8", "mma_fp8_stream", "wgmma_rs"); no cutlass.

The functions are integer arithmetic that works on ints and on kernel integers alike: the
kernels call them while they trace, and the CPU tests (``tests/test_kernels_grouped_gemm_sm90*``)
replay them to check every copy, read and bank pattern. The launch configurations, limits and
``choose_config`` are ``grouped_gemm_config``'s.
"""
from __future__ import annotations

BLOCK_M = 64             # weight rows per math warpgroup = WGMMA M
BLOCK_K = 128            # K elements per pipeline stage
# Bytes of one weight row per stage, by format (packed FP4: two codes per byte).
ROW_BYTES = {"fp4": BLOCK_K // 2, "fp8": BLOCK_K, "bf16": BLOCK_K * 2}
# Weight layouts in HBM: "rows" (each row's bytes contiguous, [G, N, row bytes]) or
# "blocked" (packed FP4 only: [G, N / 64, K / 128, 64, 64] bytes -- every 64-row x K-block
# tile a contiguous 4 KB block, written once at load time; ``quant.block_fp4_weight``).
# A kernel reads 64 rows of one K block at a time: rows put those bytes 64 B apart at a row
# stride, half of each 128-byte line, the other half one K block later; blocks put them in
# 32 whole lines (the access pattern measured, docs/performance.md).
WEIGHT_LAYOUTS = ("rows", "blocked")
BLOCKED_ROWS = BLOCK_M


def weight_offset(row, kb, num_k, row_bytes: int, layout: str):
    """Byte offset of K block ``kb`` of weight row ``row`` (counted over all groups: group
    e's row r is ``e N + r``) in a weight of ``num_k`` K blocks of ``row_bytes`` bytes per
    row. Works on ints and on non-negative kernel integers (64-bit ``row``) alike."""
    if layout == "blocked":
        tile = ring_group(row, BLOCKED_ROWS) * num_k + kb
        return tile * (BLOCKED_ROWS * row_bytes) + ring_slot(row, BLOCKED_ROWS) * row_bytes
    return row * (num_k * row_bytes) + kb * row_bytes


# "mma_sync": 4 warps per CTA, 16 weight rows each (the MMA's M); lane 4g + t holds rows g
# and g + 8 and, of every K block of 128, the 32 columns [32t, 32t + 32) (one FP4 scale
# block), 8 per MMA step i: columns 32t + 8i .. 32t + 8i + 7 (``warp_lane_columns``).
WARP_ROWS = 16
WARP_COUNT = BLOCK_M // WARP_ROWS
WARP_TOKENS = 8           # token rows per tile (the MMA's N)


def warp_weight_slots(weight_format: str, gated: bool) -> int:
    """"mma_sync": 16-byte weight slots per lane and stage: ``ROW_BYTES / 4`` bytes of each
    of the lane's two rows (g, g + 8) per matrix (``warp_lane_weight_byte``)."""
    mats = 2 if gated else 1
    return 2 * mats * (ROW_BYTES[weight_format] // 4 // 16)


# "mma_sync": the token rows of one K block (8 rows x 128 bf16), shared by the CTA's warps.
WARP_TOKEN_STAGE_BYTES = WARP_TOKENS * BLOCK_K * 2
# "mma_sync": one warp's scale buffer: 16 bytes (4 K blocks of FP4 scales) per weight row of
# both matrices; FP8 uses one word per matrix of it.
WARP_SCALE_BUFFER_BYTES = 2 * WARP_ROWS * 16


def warp_scale_group(weight_format: str, num_k: int) -> int:
    """"mma_sync": K blocks whose scales one copy fetches: FP4 rows hold 4 scale bytes per
    K block, copied 16 bytes (4 K blocks) at a time where the row length allows (8 or 4
    bytes else, keeping copies aligned); FP8 holds one byte per K block, 4 per word."""
    if weight_format == "fp8":
        return 4
    return 4 if num_k % 4 == 0 else 2 if num_k % 2 == 0 else 1


def warp_scale_buffers(num_stages: int, group: int = 1) -> int:
    """"mma_sync": scale buffers per warp so that the copy of group c + buffers (issued
    ``num_stages - 1`` K blocks ahead) only starts once group c's last K block was computed:
    (buffers - 1) * group > num_stages - 2. Shared memory is sized for groups of 1."""
    return (num_stages - 2) // group + 2


def ring_slot(index, count: int):
    """``index % count`` for a non-negative ``index`` (an int or a kernel integer) and a static
    ``count``: a mask where ``count`` is a power of two (a signed kernel integer's ``%`` pays
    a sign fix-up of four instructions that a mask does not)."""
    if count & (count - 1) == 0:
        return index & (count - 1)
    return index % count


def ring_group(index, size: int):
    """``index // size`` for a non-negative ``index`` and a static ``size``: a shift where
    ``size`` is a power of two (no sign fix-up, as ``ring_slot``)."""
    if size & (size - 1) == 0:
        return index >> (size.bit_length() - 1)
    return index // size


def warp_token_unit(row, unit):
    """"mma_sync": where 16-byte unit ``unit`` (0-15) of token row ``row`` sits in a token
    stage (row r at 256 r bytes): XOR-swizzled so that the reads of one MMA step -- lane
    4g + t reads unit 4t + i of row g -- are free of shared-memory bank conflicts (each
    quarter warp, rows 2a and 2a + 1, hits 8 distinct 16-byte bank groups). Works on ints
    and on kernel integers alike."""
    return unit ^ (((unit >> 2) & 2) | (row & 1))


def warp_smem_bytes(weight_format: str, gated: bool, num_stages: int) -> int:
    """"mma_sync": per CTA, a ring of ``num_stages`` stages (each warp's weight slots + the
    shared token rows) and every warp's scale buffers."""
    weights = WARP_COUNT * 32 * 16 * warp_weight_slots(weight_format, gated)
    return (num_stages * (weights + WARP_TOKEN_STAGE_BYTES)
            + WARP_COUNT * warp_scale_buffers(num_stages) * WARP_SCALE_BUFFER_BYTES)


# "mma_fp8": the tile's token rows of one K block as e4m3 codes (8 rows x 128 bytes), then
# their f32 scales (one per row: the K block is the activation's 1 x 128 quantisation block).
FP8_TOKEN_STAGE_BYTES = WARP_TOKENS * BLOCK_K + WARP_TOKENS * 4


def fp8_warp_smem_bytes(weight_format: str, gated: bool, num_stages: int,
                        token_stages: int = 2) -> int:
    """"mma_fp8": per CTA, the ``token_stages`` token stages it quantises into, a ring of
    ``num_stages`` stages of each warp's weight rows and every warp's scale buffers."""
    mats = 2 if gated else 1
    weights = WARP_COUNT * mats * WARP_ROWS * ROW_BYTES[weight_format]
    return (token_stages * FP8_TOKEN_STAGE_BYTES + num_stages * weights
            + WARP_COUNT * warp_scale_buffers(num_stages) * WARP_SCALE_BUFFER_BYTES)


# "mma_fp8_stream": K blocks of token codes + scales staged per chunk (one CTA barrier each;
# every per-CTA K range of the Flash decode launches fits one), the bytes of one K block
# (8 rows x 128 codes, then 8 f32 scales), and the weight words a lane may hold in flight.
STREAM_CHUNK_BLOCKS = 16
STREAM_KBLOCK_BYTES = WARP_TOKENS * BLOCK_K + WARP_TOKENS * 4
STREAM_LANE_WORDS = 64


def stream_batch_blocks(weight_format: str, gated: bool, num_stages: int) -> int:
    """"mma_fp8_stream": K blocks whose weight loads a warp issues together -- the config's
    ``num_stages``, at most what ``STREAM_LANE_WORDS`` registers hold (per lane and K
    block: 8 words per matrix for FP4, 16 for FP8)."""
    per_block = (2 if gated else 1) * (16 if weight_format == "fp8" else 8)
    return max(1, min(num_stages, STREAM_LANE_WORDS // per_block))


def stream_token_unit(row, unit):
    """"mma_fp8_stream": where 16-byte unit ``unit`` (0-7) of token row ``row`` sits in its
    128 bytes of a staged K block. A step's 8-byte reads (lane 4g + t: unit 2 step + t / 2
    of row g) then hit distinct banks in each half warp (rows g = 0-3 or 4-7 XOR their
    unit pairs by 0, 4, 2, 6). Works on ints and kernel integers alike."""
    return unit ^ (((row & 1) << 2) | (row & 2))


def warp_copy_unit(t, chunk):
    """The warp kernels' weight copies: the 16-byte unit of a weight row's K block that lane
    ``4g + t`` copies as its ``chunk`` (``ROW_BYTES / 64`` chunks per row: FP4 one, FP8 two,
    BF16 four): ``4 chunk + t``, so that each copy instruction of the warp reads whole 32-byte
    sectors of its rows (a lane copying the units it converts, t chunks + chunk, would split
    every sector between two instructions). Works on ints and kernel integers alike."""
    return 4 * chunk + t


def warp_copy_reader(unit, chunks: int):
    """"mma_sync": ``(t, chunk)`` of the lane ``4g + t`` (same g) that converts weight ``unit``
    of a row's K block -- the slot a copy of that unit goes to (``warp_lane_weight_byte``:
    lane t converts units t chunks .. t chunks + chunks - 1)."""
    return unit // chunks, unit % chunks


def fp8_warp_unit(row_kind: str, row, unit):
    """"mma_fp8": where 16-byte unit ``unit`` of a row sits in its row of a stage; ``row_kind``
    "fp4" (a warp's weight row q: 4 units), "fp8" (8 units) or "tokens" (token row g: 8
    units of e4m3 codes). The reads of
    one MMA step -- lane 4g + t reads, of rows g (and g + 8), 4 bytes of unit ``step`` (FP4)
    or 8 bytes of unit 2 step + t / 2 (FP8 weights, tokens) -- then hit distinct banks:
    rows of 64 bytes swizzle by (row / 2) mod 4, rows of 128 bytes by 2 (row mod 4).
    Works on ints and on kernel integers alike."""
    if row_kind == "fp4":
        return unit ^ ((row >> 1) & 3)
    return unit ^ ((row & 3) << 1)


def fp8_row_copy(lane, i):
    """The warp kernels' FP8 weight copies: ``(row, unit)`` that ``lane`` copies in copy
    instruction ``i`` (0-3) of a matrix -- unit lane % 8 of warp row 4 i + lane / 8, so each
    instruction reads 4 whole 128-byte K-block rows (4 lines; copies of 8 half-rows cost a
    shared-memory wavefront per line: docs/performance.md). Works on ints and on kernel
    integers alike."""
    return 4 * i + lane // 8, lane % 8


def mma_sync_fp8_unit(row, unit):
    """"mma_sync", FP8 weights: where 16-byte ``unit`` (0-7) of warp row ``row``'s K block
    sits in its 128-byte stage row: odd rows swap their units' pairs, so that the reads of a
    quarter-warp (rows 2a and 2a + 1, lane 4g + t reading unit 2 t + c) hit 8 distinct bank
    groups. Works on ints and on kernel integers alike."""
    return unit ^ (row & 1)


def rs_token_offset(row, unit, second):
    """"wgmma_rs": byte offset in a token stage of the 4-byte word ``second`` (0, 1) of the
    e4m3 codes of K columns 8 unit .. 8 unit + 7 of token row ``row``: MMA step unit / 4's
    B operand (K-major, no swizzle: core matrices of MMA columns 0-15 and 16-31, 128 bytes
    apart, row ``row`` at 16 row), columns 4 (unit % 4) .. + 3 of its core matrix
    ``second`` (``rs_token_columns``). Works on ints and kernel integers alike."""
    return (unit // 4) * 256 + second * 128 + row * 16 + 4 * (unit % 4)


def rs_token_columns(unit, second, weight_format: str):
    """"wgmma_rs": the K columns (within the K block) of the 4 codes of the word
    ``rs_token_offset(row, unit, second)``, byte 0 first: the order the weights' registers
    imply (``fp4x8_to_e4m3x8``: FP4 even codes in the first register, odd in the third;
    FP8 bytes 0-3 and 4-7)."""
    if weight_format == "fp4":
        return [8 * unit + 2 * j + second for j in range(4)]
    return [8 * unit + 4 * second + j for j in range(4)]


def warp_lane_columns(t, kb, step):
    """"mma_sync": first of the 8 K columns lane ``4g + t`` multiplies in MMA step ``step``
    (0-3) of K block ``kb``; works on ints and on kernel integers alike.

    Those 8 columns are codes c0..c7 of the lane's weight rows and token row g; the MMA
    pair ``h`` takes ``a = ((c[4h], c[4h+1]) of rows g, g+8, (c[4h+2], c[4h+3]) of rows
    g, g+8)`` and ``b = ((x[4h], x[4h+1]), (x[4h+2], x[4h+3]))``: every logical K index of
    the MMA maps to one column, so the K permutation cancels in the product."""
    return kb * BLOCK_K + 32 * t + 8 * step


def warp_lane_weight_byte(t, kb, weight_format: str):
    """"mma_sync": offset in a weight row of the ``ROW_BYTES / 4`` bytes lane ``4g + t``
    stages for K block ``kb``: the codes of ``warp_lane_columns(t, kb, 0..3)``, in order."""
    return kb * ROW_BYTES[weight_format] + t * (ROW_BYTES[weight_format] // 4)
