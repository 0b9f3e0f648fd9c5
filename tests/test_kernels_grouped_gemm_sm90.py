"""The Hopper grouped-GEMM kernels on CPU: the FP4/FP8 -> bf16 bit tricks replayed on every code, the
on-device expert schedule, shape support, the "mma_sync" kernel's lane/fragment mapping
replayed in numpy, and compilation for sm_90a (WGMMA / mma.sync in the PTX)."""
import dataclasses
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax import quant
from dsv4_jax.ffi import grouped_gemm_sm90 as gemm
from dsv4_jax.kernels import grouped_gemm_config as support
from dsv4_jax.kernels import grouped_gemm_layout as layout

pytest.importorskip("cutlass")
from grouped_gemm_compile import compile_variant as _compile, prmt as _prmt  # noqa: E402


def _bf16_pair(word: int) -> np.ndarray:
    return (np.array([word & 0xFFFF, word >> 16], np.uint32) << 16).view(np.float32)


def _fp4_word_to_values(word: int) -> np.ndarray:
    """The kernel's FP4 lookup sequence (``fp4x8_to_bf16x8`` before the scale multiply)."""
    hi_a, hi_b = support.FP4_BF16_HI
    lo_a, lo_b = support.FP4_BF16_LO
    m, w, values = word & 0x77777777, word, []
    for half in range(2):
        if half:
            m, w = m >> 16, w >> 16
        h = _prmt(hi_a, hi_b, m & 0xFFFF)
        lo = _prmt(lo_a, lo_b, m & 0xFFFF)
        p = (_prmt(0x80808080, 0x80808080, w & 0xFFFF) << 1) & 0xFFFFFFFF
        h = h | (p & 0x80808080)
        values += [_bf16_pair(_prmt(lo, h, 0x5140)), _bf16_pair(_prmt(lo, h, 0x7362))]
    return np.concatenate(values)


def test_fp4_lookup_tables_decode_every_code():
    rng = np.random.default_rng(0)
    words = [int(x) for x in rng.integers(0, 2 ** 32, 64, dtype=np.uint64)]
    words += [0x76543210, 0xFEDCBA98]                      # every code once, in order
    for word in words:
        codes = [(word >> (4 * i)) & 0xF for i in range(8)]
        want = quant.FP4_CODE_VALUES[codes]
        got = _fp4_word_to_values(word)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))   # -0 too


def _fp8_word_to_values(word: int) -> np.ndarray:
    """The kernels' ``fp8x4_to_bf16x4`` sequence before its multiplier: byte permute, << 4,
    the sign moved from bit 11 to bit 15 by ``y + 15 (y & 0x08000800)``, times 2^120."""
    values = []
    for i in range(2):
        y = (_prmt(word, 0, 0x4140 + 0x0202 * i) << 4) & 0xFFFFFFFF
        bits = (y + 15 * (y & 0x08000800)) & 0xFFFFFFFF
        values.append(_bf16_pair(bits) * np.float32(2.0 ** 120))
    return np.concatenate(values)


def test_fp8_sequence_decodes_every_code():
    assert (support.BF16_2POW120 << 16) == np.float32(2.0 ** 120).view(np.uint32)
    codes = np.arange(256, dtype=np.uint32)
    want = np.asarray(jnp.asarray(codes.astype(np.uint8)).view(jnp.float8_e4m3fn)
                      .astype(jnp.float32))
    got = np.concatenate([_fp8_word_to_values(int(codes[i] | codes[i + 1] << 8
                                                           | codes[i + 2] << 16
                                                           | codes[i + 3] << 24))
                          for i in range(0, 256, 4)])
    finite = np.isfinite(want)               # 0x7F / 0xFF are NaN in e4m3fn: never stored
    np.testing.assert_array_equal(got[finite], want[finite])
    np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(want[finite]))  # -0


@pytest.mark.parametrize("block_n", [8, 128])
def test_schedule_covers_every_valid_row_once(block_n):
    rng = np.random.default_rng(block_n)
    num_experts, rows = 16, 300
    ids = rng.integers(0, num_experts, rows).astype(np.int32)
    ids[:40] = 3                                           # one crowded expert
    ids[[5, 17, 99]] = [-1, num_experts, 1 << 20]          # dropped
    order, valid, tile_expert, tile_row0, tile_rows = map(
        np.asarray, jax.jit(gemm.schedule, static_argnums=(1, 2))(
            jnp.asarray(ids), num_experts, block_n))
    assert tile_expert.shape == (support.num_tile_slots(rows, num_experts, block_n),)
    np.testing.assert_array_equal(np.sort(order), np.arange(rows))
    sorted_ids = ids[order]
    np.testing.assert_array_equal(valid, (sorted_ids >= 0) & (sorted_ids < num_experts))
    covered = np.zeros(rows, int)
    for e, r0, n in zip(tile_expert, tile_row0, tile_rows):
        if e < 0:
            assert n == 0
            continue
        assert 1 <= n <= block_n
        np.testing.assert_array_equal(sorted_ids[r0:r0 + n], e)
        covered[r0:r0 + n] += 1
    np.testing.assert_array_equal(covered, valid.astype(int))


def test_support_rejects_what_the_kernel_cannot_take():
    cfg = support.DECODE_CONFIG
    ok = dict(weight_format="fp4", gated=True, n_out=2048, k_in=4096, x_dtype="bfloat16",
              num_tiles=100)
    assert cfg.is_supported(**ok) == (True, "")
    for change, words in [({"x_dtype": "float32"}, "bf16"), ({"k_in": 4000}, "128"),
                          ({"n_out": 100}, "64"), ({"weight_format": "int4"}, "format"),
                          ({"weight_format": "fp8", "k_in": 256}, "FP8"),
                          ({"num_tiles": 70000}, "grid")]:
        supported, why = cfg.is_supported(**{**ok, **change})
        assert not supported and words in why, (change, why)
    for bad in (dict(block_n=12), dict(block_n=512), dict(num_stages=1), dict(ablation="x"),
                dict(algorithm="simt"), dict(algorithm="mma_sync", block_n=16),
                dict(algorithm="wgmma", ablation="no_scale_load"),
                dict(algorithm="wgmma", ablation="no_mma+no_mma"),
                dict(algorithm="wgmma", ablation="no_mma+"),
                dict(algorithm="mma_fp8", block_n=8, ablation="no_token_load"),
                dict(algorithm="wgmma_fp8", block_n=64, ablation="no_load")):
        with pytest.raises(ValueError, match="GroupedGemmSm90Config"):
            support.GroupedGemmSm90Config(**bad)
    # One ablation mechanism: every kernel takes its spec's stages, joined by "+".
    for algorithm, spec in support.KERNELS.items():
        if len(spec.ablations) > 1:
            block_n = 8 if spec.tiles == "decode" else 64
            joined = support.GroupedGemmSm90Config(block_n=block_n, algorithm=algorithm,
                                                   ablation="+".join(spec.ablations[-2:]))
            assert [joined.leaves_out(a) for a in spec.ablations] == [
                a in spec.ablations[-2:] for a in spec.ablations]
    for fmt in support.WEIGHT_FORMATS:
        for rows in (6, 48, 384, 24576):
            for gated in (True, False):        # each launch's stages fit that launch
                config = support.choose_config(rows, 256, fmt, gated=gated)
                assert config.smem_bytes(fmt, gated) <= support.SMEM_BYTES, (fmt, rows, config)
        config = support.choose_config(8, 256, fmt, decode_algorithm="mma_sync")
        assert config.algorithm == "mma_sync" and config.block_n == 8
        assert 2 * config.smem_bytes(fmt, True) <= support.SMEM_BYTES, (fmt, config)
        assert support.choose_config(8192, 256, fmt, decode_algorithm="mma_sync").algorithm \
            == ("wgmma" if fmt == "bf16" else "wgmma_fp8_coop")
    with pytest.raises(ValueError, match="decode_algorithm"):
        support.choose_config(8, 256, "fp4", decode_algorithm="simt")


# ----------------------------------------------------------- "mma_sync": the lane mapping
def _mma_m16n8k16(a, b, c):
    """PTX ``mma.m16n8k16`` (f32 += bf16 x bf16) on per-lane fragments, written from the
    ISA's fragment tables: a[lane] 8 values, b[lane] 4, c[lane] 4."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for i in range(8):
            A[g + 8 * ((i // 2) % 2), 2 * t + i % 2 + 8 * (i // 4)] = a[lane][i]
        for i in range(4):
            B[2 * t + i % 2 + 8 * (i // 2), g] = b[lane][i]
    D = A @ B
    return [[c[lane][i] + D[lane // 4 + 8 * (i // 2), 2 * (lane % 4) + i % 2]
             for i in range(4)] for lane in range(32)]


def _staged_values(fmt, row_bytes_fn, scale_fn, lane, kb):
    """The 4 x 8 weight values one lane converts for K block ``kb`` of one row, in the
    converters' output order (c0..c7 per step), from the bytes it stages."""
    t = lane % 4
    start = layout.warp_lane_weight_byte(t, kb, fmt)
    raw = row_bytes_fn()[start:start + support.ROW_BYTES[fmt] // 4]
    if fmt == "fp4":
        codes = np.stack([raw & 0xF, raw >> 4], axis=1).reshape(-1)     # low nibble first
        values = quant.FP4_CODE_VALUES[codes] * scale_fn(kb * 4 + t)    # the byte it reads
    elif fmt == "fp8":
        values = (np.asarray(jnp.asarray(raw).view(jnp.float8_e4m3fn).astype(jnp.float32))
                  * scale_fn(kb // 4 * 4 + kb % 4))
    else:
        values = raw.view(np.uint16).astype(np.uint32) << 16
        values = values.view(np.float32)
    return values.reshape(4, 8)


@pytest.mark.parametrize("fmt", support.WEIGHT_FORMATS)
def test_mma_sync_lane_mapping_reproduces_the_gemm(fmt):
    """Replays one warp of ``grouped_gemm_sm90_mma_sync`` in numpy over 3 K blocks: the bytes each lane
    stages (``warp_lane_weight_byte``), the token stage the CTA writes and the units each
    lane reads of it (``warp_token_unit``, ``warp_lane_columns``), the converters' code order, the kernel's MMA operand
    assembly and the PTX fragment semantics. Their product must be W x^T."""
    rng = np.random.default_rng(7)
    k = 3 * support.BLOCK_K
    x = rng.standard_normal((8, k)).astype(np.float32)
    if fmt == "fp4":
        codes = rng.integers(0, 16, (16, k))
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
        scales = 2.0 ** rng.integers(-3, 3, (16, k // 32))
        w = quant.FP4_CODE_VALUES[codes] * np.repeat(scales, 32, axis=1)
        row_bytes = lambda r: packed[r]                                   # noqa: E731
        scale_of = lambda r: (lambda j: scales[r, j])                     # noqa: E731
    elif fmt == "fp8":
        w8 = jnp.asarray(rng.standard_normal((16, k)), jnp.float8_e4m3fn)
        raw = np.asarray(jax.lax.bitcast_convert_type(w8, jnp.uint8))
        block_scales = 2.0 ** rng.integers(-3, 3, (k // 128,))            # one row block
        w = np.asarray(w8.astype(jnp.float32)) * np.repeat(block_scales, 128)
        row_bytes = lambda r: raw[r]                                      # noqa: E731
        scale_of = lambda r: (lambda j: block_scales[j])                  # noqa: E731
    else:
        wb = jnp.asarray(rng.standard_normal((16, k)), jnp.bfloat16)
        raw = np.asarray(jax.lax.bitcast_convert_type(wb, jnp.uint8)).reshape(16, -1)
        w = np.asarray(wb.astype(jnp.float32))
        row_bytes = lambda r: raw[r]                                      # noqa: E731
        scale_of = lambda r: (lambda j: 1.0)                              # noqa: E731
    acc = [[0.0] * 4 for _ in range(32)]
    for kb in range(k // support.BLOCK_K):
        # The CTA's token stage: thread tidx copies unit tidx % 16 of row tidx // 16.
        stage = np.full((8, 16, 8), np.nan)
        for tidx in range(128):
            r, unit = divmod(tidx, 16)
            c0 = kb * support.BLOCK_K + 8 * unit
            stage[r, layout.warp_token_unit(r, unit)] = x[r, c0:c0 + 8]
        rows = {lane: [_staged_values(fmt, lambda r=lane // 4 + 8 * half: row_bytes(r),
                                      scale_of(lane // 4 + 8 * half), lane, kb)
                       for half in range(2)] for lane in range(32)}
        for step in range(4):
            cols = {lane: layout.warp_lane_columns(lane % 4, kb, step) for lane in range(32)}
            for h in range(2):
                a, b = [], []
                for lane in range(32):
                    g_row, g8_row = rows[lane][0][step], rows[lane][1][step]
                    # kernel: a = (pairs_g[2h], pairs_g8[2h], pairs_g[2h+1], pairs_g8[2h+1])
                    a.append([*g_row[4 * h:4 * h + 2], *g8_row[4 * h:4 * h + 2],
                              *g_row[4 * h + 2:4 * h + 4], *g8_row[4 * h + 2:4 * h + 4]])
                    # kernel: b = (x[2h], x[2h+1]) of the 4 words (8 bf16) it reads for
                    # the step: unit 4t + step of token row g, which must hold its columns
                    g, t = divmod(lane, 4)
                    xs = stage[g, layout.warp_token_unit(g, 4 * t + step)]
                    np.testing.assert_array_equal(xs, x[g, cols[lane]:cols[lane] + 8])
                    b.append(list(xs[4 * h:4 * h + 4]))
                acc = _mma_m16n8k16(a, b, acc)
    got = np.zeros((16, 8))
    for lane in range(32):                  # the epilogue's accumulator -> (row, token)
        g, t = divmod(lane, 4)
        for j in range(4):
            got[g + 8 * (j // 2), 2 * t + j % 2] = acc[lane][j]
    np.testing.assert_allclose(got, w @ x.T.astype(np.float64), rtol=1e-9, atol=1e-9)


def test_mma_sync_token_swizzle_is_a_conflict_free_permutation():
    """Each token row's 16 units land on 16 distinct slots of its 256 bytes (what 128
    threads write is what the lanes read back), and each quarter warp's 16-byte reads of an
    MMA step (lanes 4g + t, g in {2a, 2a + 1}, unit 4t + i of row g) hit 8 distinct bank
    groups (shared memory serves 128 bytes per wavefront)."""
    rows = range(support.WARP_TOKENS)
    for r in rows:
        assert sorted(layout.warp_token_unit(r, u) for u in range(16)) == list(range(16))
    for step in range(4):
        for quarter in range(4):
            lanes = range(8 * quarter, 8 * quarter + 8)
            addresses = [(lane // 4) * 256 + 16 * layout.warp_token_unit(
                lane // 4, 4 * (lane % 4) + step) for lane in lanes]
            assert len({a // 16 % 8 for a in addresses}) == 8, (step, quarter, addresses)


@pytest.mark.parametrize("num_stages", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("num_k", [1, 3, 4, 6, 32])
def test_mma_sync_scale_buffers_outlive_their_k_blocks(num_stages, num_k):
    """Replays the K loop's order of events: the copy of K block kb + stages - 1 is issued
    after the barrier of K block kb; a scale group's copy must not land in a buffer whose
    previous group still has K blocks to compute."""
    for fmt in ("fp4", "fp8"):
        if fmt == "fp8" and num_k % 4:
            continue
        group = layout.warp_scale_group(fmt, num_k)
        buffers = layout.warp_scale_buffers(num_stages, group)
        assert num_k % group == 0 and buffers <= layout.warp_scale_buffers(num_stages)
        holder = {}                                # buffer -> group copied into it

        def issue(block, computed_until):          # K blocks < computed_until are done
            if block < num_k and block % group == 0:
                buf = block // group % buffers
                if buf in holder:
                    assert (holder[buf] + 1) * group <= computed_until, (fmt, block, holder)
                holder[buf] = block // group
        for s in range(num_stages - 1):            # prologue
            issue(s, 0)
        for kb in range(num_k):
            issue(kb + num_stages - 1, kb)
            assert holder[kb // group % buffers] == kb // group    # compute(kb) reads it


def test_ring_slots_and_groups_are_the_modulo_and_quotient_they_replace():
    """The warp kernels' ring positions (``ring_slot``, ``ring_group``: masks and shifts for
    powers of two) equal ``%`` and ``//`` on every non-negative K block they see."""
    for count in range(1, 10):
        for index in range(200):
            assert layout.ring_slot(index, count) == index % count
            assert layout.ring_group(index, count) == index // count


# ----------------------------------------------------------- "mma_fp8": the lane mapping
def _fp4x8_to_e4m3x8(word):
    """numpy replay of ``fp4x8_to_e4m3x8`` (the same shifts and masks)."""
    w = np.uint32(word)
    lo = ((w << np.uint32(2)) & np.uint32(0x1C1C1C1C)) | ((w << np.uint32(4)) & np.uint32(0x80808080))
    hi = ((w >> np.uint32(2)) & np.uint32(0x1C1C1C1C)) | (w & np.uint32(0x80808080))
    return lo, hi


def _e4m3_bytes(word):
    b = np.frombuffer(np.uint32(word).tobytes(), np.uint8)
    return np.asarray(jnp.asarray(b).view(jnp.float8_e4m3fn).astype(jnp.float32), np.float64)


def test_fp4_to_e4m3_is_exact_for_every_code():
    """Every e2m1 code, in every nibble position: the e4m3 byte is its value x 2^-6."""
    for code in range(16):
        for pos in range(8):
            lo, hi = _fp4x8_to_e4m3x8(code << (4 * pos))
            got = _e4m3_bytes(lo if pos % 2 == 0 else hi)[pos // 2] * 64
            assert got == quant.FP4_CODE_VALUES[code], (code, pos, got)


@pytest.mark.parametrize("kind", ["fp4", "fp8", "tokens"])
def test_mma_fp8_stage_swizzle_is_a_conflict_free_permutation(kind):
    """Rows of a stage keep all their units; an MMA step's reads (FP4: 4 bytes of unit
    ``step`` of rows g; FP8 and tokens: 8 bytes of unit 2 step + t/2 of row g) hit distinct
    banks per wavefront (32 lanes of 4 bytes, or 16 lanes of 8 bytes)."""
    units, row_bytes = (4, 64) if kind == "fp4" else (8, 128)
    for row in range(16):
        assert sorted(layout.fp8_warp_unit(kind, row, u) for u in range(units)) == list(
            range(units))
    for step in range(4):
        for row_add in (0, 8):
            if kind == "fp4":
                addr = [(l // 4 + row_add) * row_bytes + 16 * layout.fp8_warp_unit(
                    kind, l // 4 + row_add, step) + 4 * (l % 4) for l in range(32)]
                assert len({a // 4 % 32 for a in addr}) == 32
            else:
                for half_warp in range(2):
                    lanes = range(16 * half_warp, 16 * half_warp + 16)
                    addr = [(l // 4 + row_add) * row_bytes + 16 * layout.fp8_warp_unit(
                        kind, l // 4 + row_add, 2 * step + (l % 4) // 2) + 8 * (l % 2)
                        for l in lanes]
                    assert len({a // 8 % 16 for a in addr}) == 16


@pytest.mark.parametrize("fmt", [f for f in support.WEIGHT_FORMATS if f != "fp8"])
def test_warp_weight_copies_read_whole_sectors_and_reach_their_reader(fmt):
    """FP4 and BF16 weights (FP8 rows are copied whole, ``fp8_row_copy``): each copy
    instruction of a warp kernel (one chunk of one row half) reads whole 32-byte sectors of
    its 8 rows; a row's chunks cover its K block once; and in "mma_sync" each
    copied unit lands in the slot of the lane that converts it (``warp_lane_weight_byte``)."""
    row_bytes = support.ROW_BYTES[fmt]
    chunks = row_bytes // 4 // 16
    covered = []
    for c in range(chunks):
        units = {layout.warp_copy_unit(t, c) for t in range(4)}
        assert all(u ^ 1 in units for u in units), (fmt, c, units)   # sector = 2 units
        covered += sorted(units)
    assert sorted(covered) == list(range(row_bytes // 16))
    kb = 3
    for unit in covered:
        t, chunk = layout.warp_copy_reader(unit, chunks)
        assert layout.warp_lane_weight_byte(t, kb, fmt) + 16 * chunk == kb * row_bytes + 16 * unit


def test_fp8_row_copies_read_whole_lines_and_fill_the_stage_without_conflicts():
    """FP8 weights in the warp kernels: each copy instruction reads 4 whole 128-byte rows
    (``fp8_row_copy``), the 4 instructions cover the warp's 16 rows once, each quarter-warp
    writes one row's 8 distinct bank groups; and in "mma_sync" the reads of a quarter-warp
    (lane 4g + t, unit 2 t + c of rows g and g + 8) hit 8 distinct bank groups."""
    copied = []
    for i in range(4):
        pairs = [layout.fp8_row_copy(lane, i) for lane in range(32)]
        assert sorted({r for r, _ in pairs}) == list(range(4 * i, 4 * i + 4))
        copied += pairs
        for quarter in range(4):
            rows = {pairs[lane][0] for lane in range(8 * quarter, 8 * quarter + 8)}
            units = {layout.mma_sync_fp8_unit(*pairs[lane]) for lane in
                     range(8 * quarter, 8 * quarter + 8)}
            assert len(rows) == 1 and units == set(range(8))
    assert sorted(copied) == [(r, u) for r in range(16) for u in range(8)]
    for half in range(2):
        for c in range(2):
            for quarter in range(4):
                lanes = range(8 * quarter, 8 * quarter + 8)
                banks = {layout.mma_sync_fp8_unit(l // 4 + 8 * half, 2 * (l % 4) + c)
                         for l in lanes}
                assert len(banks) == 8, (half, c, quarter, banks)
    for row in range(16):
        assert sorted(layout.mma_sync_fp8_unit(row, u) for u in range(8)) == list(range(8))


def _mma_m16n8k32(a, b):
    """PTX ``mma.m16n8k32`` e4m3 fragments (lists per lane of byte values) -> D 16 x 8."""
    A, B = np.zeros((16, 32)), np.zeros((32, 8))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for r in range(4):
            for j in range(4):
                A[g + 8 * (r % 2), 4 * t + j + 16 * (r // 2)] = a[lane][r][j]
        for r in range(2):
            for j in range(4):
                B[4 * t + j + 16 * r, g] = b[lane][r][j]
    return A @ B


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_mma_fp8_lane_mapping_reproduces_the_gemm(fmt):
    """Replays one warp of ``grouped_gemm_sm90_mma_fp8`` in numpy over 2 K blocks of one matrix:
    the weight units each lane copies into swizzled rows, the CTA's token stage, the words
    each lane reads back per step, the FP4 -> e4m3 conversion, the token ``prmt`` split,
    the MMA fragments, the per-step (FP4) or per-K-block (FP8) scales and 2^6 (FP4)."""
    rng = np.random.default_rng(3)
    nk = 2
    k = nk * support.BLOCK_K
    row_bytes = support.ROW_BYTES[fmt]
    x_codes = rng.integers(0, 256, (8, k), dtype=np.uint8)
    x_codes[(x_codes & 0x7F) == 0x7F] = 0                     # no e4m3 NaN codes
    x_scale = 2.0 ** rng.integers(-4, 4, (8, nk))
    x_val = (np.asarray(jnp.asarray(x_codes).view(jnp.float8_e4m3fn).astype(jnp.float32),
                        np.float64) * np.repeat(x_scale, 128, axis=1))
    if fmt == "fp4":
        raw = rng.integers(0, 256, (16, k // 2), dtype=np.uint8)
        scales = 2.0 ** rng.integers(-3, 3, (16, k // 32))
        codes = np.stack([raw & 0xF, raw >> 4], axis=2).reshape(16, k)
        w = quant.FP4_CODE_VALUES[codes] * np.repeat(scales, 32, axis=1)
    else:
        raw = rng.integers(0, 256, (16, k), dtype=np.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0
        block_scales = 2.0 ** rng.integers(-3, 3, (nk,))
        w = (np.asarray(jnp.asarray(raw).view(jnp.float8_e4m3fn).astype(jnp.float32),
                        np.float64) * np.repeat(block_scales, 128))
    chunks = row_bytes // 4 // 16
    acc = np.zeros((16, 8))
    for kb in range(nk):
        stage = np.zeros((16, row_bytes), np.uint8)              # the warp's rows, swizzled
        for lane in range(32):
            g, t = divmod(lane, 4)
            if fmt == "fp8":                  # whole rows per copy instruction
                copies = [layout.fp8_row_copy(lane, i) for i in range(4)]
            else:
                copies = [(g + 8 * half, layout.warp_copy_unit(t, c))
                          for half in range(2) for c in range(chunks)]
            for q, copied in copies:
                start = kb * row_bytes + 16 * copied
                unit = layout.fp8_warp_unit(fmt, q, copied)
                stage[q, 16 * unit:16 * unit + 16] = raw[q, start:start + 16]
        tokens = np.zeros((8, 128), np.uint8)
        for tidx in range(64):
            r, unit = divmod(tidx, 8)
            u = layout.fp8_warp_unit("tokens", r, unit)
            tokens[r, 16 * u:16 * u + 16] = x_codes[r, kb * 128 + 16 * unit:][:16]
        block = np.zeros((16, 8))
        for step in range(4):
            a, b, sw = [], [], np.zeros(16)
            for lane in range(32):
                g, t = divmod(lane, 4)
                u = layout.fp8_warp_unit("tokens", g, 2 * step + t // 2)
                xb = tokens[g, 16 * u + 8 * (t % 2):][:8]
                if fmt == "fp4":                          # prmt 0x6420 / 0x7531
                    b.append([xb[0::2], xb[1::2]])
                else:
                    b.append([xb[:4], xb[4:]])
                rows = []
                for half in range(2):
                    q = g + 8 * half
                    if fmt == "fp4":
                        off = 16 * layout.fp8_warp_unit("fp4", q, step) + 4 * t
                        word = int(np.frombuffer(stage[q, off:off + 4].tobytes(), np.uint32)[0])
                        rows.append([np.frombuffer(np.uint32(v).tobytes(), np.uint8)
                                     for v in _fp4x8_to_e4m3x8(word)])
                        sw[q] = scales[q, kb * 4 + step]
                    else:
                        off = 16 * layout.fp8_warp_unit("fp8", q, 2 * step + t // 2) + 8 * (t % 2)
                        rows.append([stage[q, off:off + 4], stage[q, off + 4:off + 8]])
                a.append([rows[0][0], rows[1][0], rows[0][1], rows[1][1]])
            as_val = lambda v: _e4m3_bytes(np.frombuffer(np.asarray(v, np.uint8).tobytes(),  # noqa
                                                         np.uint32)[0])
            d = _mma_m16n8k32([[as_val(r) for r in la] for la in a],
                              [[as_val(r) for r in lb] for lb in b])
            block += d * sw[:, None] if fmt == "fp4" else d
        mult = x_scale[:, kb][None, :] * (1.0 if fmt == "fp4" else block_scales[kb])
        acc += block * mult
    if fmt == "fp4":
        acc *= 64
    np.testing.assert_allclose(acc, w @ x_val.T, rtol=1e-9, atol=1e-9)


MMA_SYNC = {fmt: support.choose_config(8, 4, fmt, decode_algorithm="mma_sync",
                                        split_k=4)
            for fmt in support.WEIGHT_FORMATS}
VARIANTS = {"fp4-gated-decode": ("fp4", True, support.DECODE_CONFIG),
            "fp8-down-prefill": ("fp8", False, support.PREFILL_CONFIG),
            "bf16-gated-decode": ("bf16", True, support.choose_config(
                8, 4, "bf16", decode_algorithm="wgmma")),
            "fp4-gated-mma-sync": ("fp4", True, MMA_SYNC["fp4"]),
            "fp8-down-mma-sync": ("fp8", False, MMA_SYNC["fp8"]),
            "bf16-gated-mma-sync": ("bf16", True, MMA_SYNC["bf16"]),
            # More rows than two tiles: the whole K per CTA (the others: K split 4 ways, a
            # cluster per tile).
            "fp4-gated-mma-sync-whole-k": ("fp4", True, support.choose_config(
                64, 16, "fp4", decode_algorithm="mma_sync"))}


@pytest.fixture(scope="module")
def compiled():
    return {name: _compile(*args) for name, args in VARIANTS.items()}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compiles_for_sm90a(compiled, variant):
    fmt, gated, config = VARIANTS[variant]
    ptx = compiled[variant].artifacts.PTX
    assert ".target sm_90a" in ptx
    # Per stage of K = 128: 8 k-steps of 16 per matrix.
    if config.algorithm == "wgmma":
        mma = re.findall(rf"wgmma\.mma_async\S*m64n{config.block_n}k16\S*bf16", ptx)
        assert "cp.async" in ptx and "mbarrier" in ptx
    else:
        mma = re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16", ptx)
        # A cp.async ring behind one CTA barrier per K block: no mbarriers, no WGMMA, and
        # only 16-byte copies that bypass L1 (FP4 scale rows of 16 bytes at this K); a K
        # split adds one barrier before its sums go to shared memory.
        assert "cp.async.wait_group" in ptx and "cp.async.commit_group" in ptx
        assert ptx.count("bar.sync") == (2 if config.split_k > 1 else 1)
        assert "wgmma" not in ptx and "mbarrier" not in ptx
        copies = re.findall(r"cp\.async\.(c[ag])\.shared\.global(?:\.\S+)? \[[^]]+\], "
                            r"\[[^]]+\], (\d+)", ptx)
        assert copies and all(kind == "cg" and size == "16" for kind, size in copies
                              if fmt != "fp8"), copies
    assert len(mma) == 8 * (2 if gated else 1)
    if config.algorithm == "mma_sync":
        # K split: the cluster's CTA 0 adds the others' sums through distributed shared
        # memory (no f32 partial sums to global memory) and runs the epilogue, SwiGLU too.
        split = config.split_k > 1
        assert "st.global.b32" not in ptx and ("ex2" in ptx) == gated
        assert (ptx.count("mapa.shared::cluster") == (config.split_k - 1) * (2 if gated else 1)
                if split else "mapa" not in ptx)
        assert ptx.count("barrier.cluster.arrive") == (2 if split else 0)
    conversions = {"fp4": "prmt.b32", "fp8": "mul.rn.bf16x2", "bf16": None}[fmt]
    if conversions:
        assert conversions in ptx
    assert compiled[variant].dump_to_object("moe")[:4] == b"\x7fELF"


def test_grouped_gemm_takes_fp8_codes_exactly_where_the_kernel_reads_them():
    """The launch wrapper refuses activations that do not match the algorithm, before any
    kernel is built: "mma_fp8_stream" takes e4m3 codes and their scales, the others
    ("mma_fp8", which quantises in the kernel, too) bf16 rows; the op hands "mma_fp8" the
    rows as they are and "mma_fp8_stream" ``quant.act_quant``'s codes."""
    e, n, k, rows = 2, 64, 256, 8
    w = jnp.zeros((e, n, k // 2), jnp.uint8)
    s = jnp.zeros((e, n, k // 32), jnp.uint8)
    tiles = tuple(gemm.schedule(jnp.zeros((rows,), jnp.int32), e, 8)[2:])
    assert support.FP8_CODE_ALGORITHMS == ("mma_fp8_stream", "wgmma_fp8", "wgmma_fp8_coop")
    stream = support.GroupedGemmSm90Config(block_n=8, num_stages=4,
                                           algorithm="mma_fp8_stream")
    fp8 = support.GroupedGemmSm90Config(block_n=8, num_stages=4, algorithm="mma_fp8")
    bf16_rows = jnp.linspace(-3, 3, rows * k).reshape(rows, k).astype(jnp.bfloat16)
    codes, scales = quant.act_quant(bf16_rows)
    with pytest.raises(ValueError, match="grouped_gemm launch: algorithm 'mma_fp8_stream' "
                                         r"\(token_codes False\) with xs bfloat16"):
        gemm.launch(bf16_rows, tiles, w, s, config=stream)
    for config in (fp8, support.choose_config(rows, e, "fp4", decode_algorithm="mma_sync")):
        with pytest.raises(ValueError, match=f"algorithm '{config.algorithm}' "
                                             r"\(token_codes False\) with xs float8_e4m3fn"):
            gemm.launch(codes, tiles, w, s, x_scale=scales, config=config)
    # "mma_fp8" with token_codes takes the codes, and refuses bf16 rows.
    fp8_codes = dataclasses.replace(fp8, token_codes=True)
    with pytest.raises(ValueError, match=r"'mma_fp8' \(token_codes True\) with xs bfloat16"):
        gemm.launch(bf16_rows, tiles, w, s, config=fp8_codes)
    xs, x_scale = gemm.quantized_rows(bf16_rows, None, fp8, simulate=True)
    assert x_scale is None and xs is bf16_rows
    for config in (stream, fp8_codes):
        xs, x_scale = gemm.quantized_rows(bf16_rows, None, config, simulate=True)
        np.testing.assert_array_equal(np.asarray(xs, np.float32), np.asarray(codes, np.float32))
        np.testing.assert_array_equal(np.asarray(x_scale), np.asarray(scales))


@pytest.mark.parametrize("k,group", [(384, 1), (768, 2)])
def test_mma_sync_short_fp4_scale_rows_use_aligned_small_copies(k, group):
    """FP4 scale rows of 4 * K/128 bytes that 16-byte copies would misalign: the scales of
    1 or 2 K blocks per copy (4 or 8 bytes through L1), everything else still 16 bytes."""
    assert layout.warp_scale_group("fp4", k // support.BLOCK_K) == group
    ptx = _compile("fp4", False, MMA_SYNC["fp4"], k=k).artifacts.PTX
    sizes = re.findall(r"cp\.async\.ca\.shared\.global \[[^]]+\], \[[^]]+\], (\d+)", ptx)
    assert sizes and set(sizes) == {str(4 * group)}, sizes


@pytest.mark.parametrize("ablation", support.KERNELS["mma_sync"].ablations)
def test_mma_sync_ablations_compile_and_leave_out_their_stage(ablation):
    """The benchmark-only variants of moe_kernel_ablation.py build for sm_90a, and each
    leaves out what it names (K of 8 blocks so that copies after the first stages exist)."""
    config = dataclasses.replace(MMA_SYNC["fp4"], ablation=ablation)
    ptx = _compile("fp4", True, config, k=1024).artifacts.PTX
    mma = len(re.findall(r"mma\.sync\.aligned", ptx))
    assert mma == (0 if ablation == "no_mma" else 16)
    assert ptx.count("cp.async.wait_group") == 2


@pytest.mark.parametrize("ablation", support.KERNELS["wgmma"].ablations
                         + ("no_dequant+no_mma", "no_load+no_token_load+no_dequant+no_mma"))
def test_wgmma_ablations_compile_and_leave_out_their_stage(ablation):
    """The WGMMA kernel's benchmark-only variants (moe_kernel_ablation.py at prefill sizes)
    build for sm_90a; "no_mma" issues no WGMMA, the others as many as the kernel itself."""
    config = dataclasses.replace(support.PREFILL_CONFIG, ablation=ablation)
    ptx = _compile("fp4", True, config, a=512, k=1024).artifacts.PTX
    shipped = _compile("fp4", True, support.PREFILL_CONFIG, a=512, k=1024).artifacts.PTX
    count = lambda text: len(re.findall(r"wgmma\.mma_async", text))
    assert count(shipped) > 0
    assert count(ptx) == (0 if "no_mma" in ablation else count(shipped))
    # The load ablations keep the copies of the first stages: cp.async is still there.
    assert "cp.async" in ptx
