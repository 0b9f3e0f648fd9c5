"""The "wgmma_fp8" prefill kernel (kernels/grouped_gemm_sm90_wgmma_fp8.py) without a GPU: numpy replays of
its FP4 -> e4m3 conversion with the scales folded in (every code, every nibble position,
every exact fold factor, rounding past them, whole rows against the dequantised weights),
its configuration and support rules, and its sm_90a compilation (PTX instruction counts);
and every MoE kernel family through ptxas (no serialized WGMMAs, no spills)."""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from dsv4_jax import quant
from dsv4_jax.kernels import grouped_gemm_config as support

pytest.importorskip("cutlass")
from grouped_gemm_compile import (compile_variant as _compile, prmt as _prmt,  # noqa: E402
                                  ptxas_log)

E4M3 = ml_dtypes.float8_e4m3fn
MAGNITUDES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def _fold_table(factor: float) -> tuple[int, int]:
    """numpy replay of ``e4m3_fold_table``: the 8 magnitudes x factor, RN to e4m3 bytes."""
    codes = (MAGNITUDES * np.float32(factor)).astype(E4M3).view(np.uint8).astype(np.uint32)
    return (int(codes[0] | codes[1] << 8 | codes[2] << 16 | codes[3] << 24),
            int(codes[4] | codes[5] << 8 | codes[6] << 16 | codes[7] << 24))


def _lop3_f8(a: int, b: int, c: int) -> int:
    return (a | (b & c)) & 0xFFFFFFFF


def _fp4x8_to_e4m3x8_table(word: int, t_lo: int, t_hi: int) -> tuple[int, int]:
    """numpy replay of ``fp4x8_to_e4m3x8_table`` (the same instructions, in order)."""
    k = 0x80808080
    m = word & 0x77777777
    sign = (_prmt(k, k, word & 0xFFFF) << 7) & 0xFFFFFFFF
    out0 = _lop3_f8(_prmt(t_lo, t_hi, m & 0xFFFF), sign, 0x80808080)
    mh, wh = m >> 16, word >> 16
    sign = (_prmt(k, k, wh) << 7) & 0xFFFFFFFF
    out1 = _lop3_f8(_prmt(t_lo, t_hi, mh), sign, 0x80808080)
    return out0, out1


def _e4m3_values(*words: int) -> np.ndarray:
    raw = np.array(words, np.uint32).view(np.uint8)
    return raw.view(E4M3).astype(np.float64)


@pytest.mark.parametrize("log2_factor", range(-8, 7))
def test_fold_conversion_is_exact_for_every_code(log2_factor):
    """Each e2m1 code in each of the 8 nibble positions becomes value x factor, sign kept
    (negative zero included), for every factor the fold uses on an in-range row."""
    t_lo, t_hi = _fold_table(2.0 ** log2_factor)
    for code in range(16):
        for pos in range(8):
            got = _e4m3_values(*_fp4x8_to_e4m3x8_table(code << (4 * pos), t_lo, t_hi))
            want = np.zeros(8)
            want[pos] = quant.FP4_CODE_VALUES[code] * 2.0 ** log2_factor
            np.testing.assert_array_equal(got, want, err_msg=f"code {code} nibble {pos}")
            assert np.signbit(got[pos]) == (code >= 8), (code, pos)


@pytest.mark.parametrize("log2_factor", [-9, -10, -12, -20, -127])
def test_fold_rounds_to_nearest_past_the_exact_range(log2_factor):
    """Sub-blocks more than 2^14 below the row's largest: round-to-nearest-even e4m3."""
    factor = np.float32(2.0 ** log2_factor)
    t_lo, t_hi = _fold_table(factor)
    for code in range(16):
        got = _e4m3_values(*_fp4x8_to_e4m3x8_table(code, t_lo, t_hi))[0]
        want = float(np.float32(quant.FP4_CODE_VALUES[code] * factor).astype(E4M3))
        assert got == want, (code, got, want)


def _convert_row(packed: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, float]:
    """The kernel's conversion of one weight row's K block (64 packed bytes, 4 E8M0 scales):
    e4m3 values [128] and the row scale 2^(s_max - 127 - 6)."""
    s_max = int(scales.max())
    words = packed.view("<u4")
    out = []
    for i in range(4):                                  # sub-block i: words 4i .. 4i + 3
        fold = max(int(scales[i]) - s_max + 127 + 6, 0)
        factor = np.float32(2.0 ** (fold - 127)) if fold else np.float32(2.0 ** -127)
        t_lo, t_hi = _fold_table(factor)
        for w in words[4 * i:4 * i + 4]:
            out.extend(_e4m3_values(*_fp4x8_to_e4m3x8_table(int(w), t_lo, t_hi)))
    return np.array(out), 2.0 ** (s_max - 127 - 6)


def _dequantised(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    lo, hi = packed & 0xF, packed >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(-1)
    return quant.FP4_CODE_VALUES[codes] * 2.0 ** (np.repeat(scales.astype(np.float64), 32) - 127)


@pytest.mark.parametrize("spread", [0, 3, 9, 14])
def test_fold_reproduces_the_dequantised_row(spread):
    """Row scale x folded codes == the dequantised FP4 weights, bit for bit, whenever a row's
    four scales of a K block lie within 2^14 (random rows, E8M0 exponents near real ones)."""
    rng = np.random.default_rng(spread)
    for _ in range(50):
        packed = rng.integers(0, 256, 64, dtype=np.uint8)
        base = int(rng.integers(100, 130))
        scales = (base + rng.integers(0, spread + 1, 4)).astype(np.uint8)
        scales[rng.integers(0, 4)] = base + spread                # the spread is reached
        values, row_scale = _convert_row(packed, scales)
        np.testing.assert_array_equal(values * row_scale, _dequantised(packed, scales))


def test_fold_error_past_the_exact_range_is_below_bf16_rounding():
    """A sub-block 2^20 below the row's largest loses only codes under 2^-9 of its own
    scale x 2^20; the error stays far below a bf16 ulp of the row's dot products."""
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, 64, dtype=np.uint8)
    scales = np.array([120, 100, 120, 110], np.uint8)
    values, row_scale = _convert_row(packed, scales)
    want = _dequantised(packed, scales)
    err = np.abs(values * row_scale - want).max()
    assert 0 < err <= 2.0 ** (120 - 127 - 14)
    np.testing.assert_array_equal((values * row_scale)[:32], want[:32])   # the top block


# ------------------------------------------------------------------ configuration and support
def test_prefill_algorithm_selection():
    cfg = support.choose_config(4096 * 6, 256, "fp4", prefill_algorithm="wgmma_fp8",
                                k_ins=(4096, 2048))
    assert cfg.algorithm == "wgmma_fp8" and cfg.block_n == support.FP8_WGMMA_MAX_BLOCK_N
    assert cfg.smem_bytes("fp4", True) <= support.SMEM_BYTES
    assert support.choose_config(4096 * 6, 256, "fp4").algorithm == "wgmma_fp8_coop"  # default
    # Fallbacks to "wgmma": BF16 weights, simulation off, an odd number of K blocks.
    for kw in (dict(weight_format="bf16"), dict(fp8_activations=False),
               dict(k_ins=(4096, 384))):
        args = dict(num_rows=4096, num_groups=16, weight_format="fp4",
                    prefill_algorithm="wgmma_fp8") | kw
        assert support.choose_config(**args).algorithm == "wgmma", kw
    # Decode tiles keep their own algorithm.
    assert support.choose_config(8, 256, "fp4", prefill_algorithm="wgmma_fp8").algorithm \
        == support.auto_decode_algorithm(8, 256, gated=False)
    with pytest.raises(ValueError, match="prefill_algorithm"):
        support.choose_config(4096, 16, "fp4", prefill_algorithm="mma_sync")


def test_wgmma_fp8_support_rules():
    cfg = support.PREFILL_FP8_CONFIG
    kw = dict(gated=True, n_out=2048, x_dtype="bfloat16", num_tiles=100)
    assert cfg.is_supported(weight_format="fp4", k_in=4096, **kw) == (True, "")
    ok, why = cfg.is_supported(weight_format="fp4", k_in=384, **kw)
    assert not ok and "even number" in why
    ok, why = cfg.is_supported(weight_format="bf16", k_in=4096, **kw)
    assert not ok and "'wgmma_fp8' takes fp4/fp8" in why
    with pytest.raises(ValueError, match="block_n <= 64"):
        support.GroupedGemmSm90Config(block_n=128, num_stages=4, algorithm="wgmma_fp8")
    with pytest.raises(ValueError, match="ablation"):
        support.GroupedGemmSm90Config(block_n=64, num_stages=4, algorithm="wgmma_fp8",
                                  ablation="no_load")


# ------------------------------------------------------------------ sm_90a compilation
@pytest.mark.parametrize("fmt, gated, block_n", [("fp4", True, 64), ("fp8", False, 64),
                                                 ("fp4", False, 8), ("fp8", True, 64)])
def test_wgmma_fp8_compiles_for_sm90a(fmt, gated, block_n):
    """FP8 WGMMAs of K = 32 (4 per matrix and K block, the loop unrolled by 2), the FP4 fold
    (4 table conversions per matrix and thread), the promotion FMAs, one proxy fence."""
    config = support.GroupedGemmSm90Config(block_n=block_n, num_stages=4, algorithm="wgmma_fp8")
    compiled = _compile(fmt, gated, config, a=256, k=512, n=256, e=4)
    ptx = compiled.artifacts.PTX
    mats = 2 if gated else 1
    mma = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_n}k32\.f32\.e4m3\.e4m3",
                     ptx)
    assert len(mma) == 2 * 4 * mats
    assert "bf16" not in " ".join(re.findall(r"wgmma\S*", ptx))
    cvt = len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx))
    assert cvt == (4 * 2 * mats if fmt == "fp4" else 0)
    # Promotion: 2 sites (the two K blocks of an iteration) x the fragment per matrix.
    assert len(re.findall(r"fma\.rn\.f32", ptx)) >= 2 * mats * block_n // 2
    assert "fence.proxy.async.shared::cta" in ptx and "cp.async.wait_group" in ptx
    assert compiled.dump_to_object("moe")[:4] == b"\x7fELF"


ASSEMBLED = {
    "wgmma_fp8-fp4-gated": ("fp4", True, support.PREFILL_FP8_CONFIG, 256),
    "wgmma_fp8-fp8-down": ("fp8", False, support.PREFILL_FP8_CONFIG, 256),
    "wgmma-fp4-gated-prefill": ("fp4", True, support.PREFILL_CONFIG, 256),
    "wgmma-fp4-gated-decode": ("fp4", True, support.DECODE_CONFIG, 8),
    "mma_fp8-fp4-gated": ("fp4", True, support.choose_config(
        64, 256, "fp4", decode_algorithm="mma_fp8"), 64),
    "mma_fp8-fp4-gated-split": ("fp4", True, support.choose_config(
        6, 256, "fp4", decode_algorithm="mma_fp8", split_k=4), 6),
    "mma_sync-fp4-gated": ("fp4", True, support.choose_config(
        64, 256, "fp4", decode_algorithm="mma_sync"), 64),
    "mma_sync-fp8-down-split": ("fp8", False, support.choose_config(
        6, 256, "fp8", decode_algorithm="mma_sync", split_k=4), 6),
}


@pytest.mark.parametrize("variant", list(ASSEMBLED))
def test_moe_kernels_assemble_without_serialized_wgmma_or_spills(tmp_path, variant):
    """Every MoE kernel family through ptxas: no C7514 (all WGMMAs serialized because an
    accumulator is read while its chain may be in flight -- what the first "wgmma_fp8"
    compiled to), no spills, registers that leave at least one CTA per SM."""
    fmt, gated, config, rows = ASSEMBLED[variant]
    log = ptxas_log(tmp_path, _compile(fmt, gated, config, a=rows, k=512, n=256, e=4))
    assert "C7514" not in log and "serialized" not in log, log
    assert "0 bytes spill stores, 0 bytes spill loads" in log, log
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    threads = 256 if config.algorithm in ("wgmma", "wgmma_fp8") else 128
    assert registers <= 255 and registers * threads <= 65536, log
