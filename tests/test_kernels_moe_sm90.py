"""The Hopper MoE kernel on CPU: the FP4/FP8 -> bf16 bit tricks replayed on every code, the
on-device expert schedule, shape support, and compilation for sm_90a (WGMMA in the PTX)."""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax import quant
from dsv4_jax.ffi import moe as moe_op
from dsv4_jax.kernels import moe_sm90 as support

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream  # noqa: E402

from dsv4_jax.kernels import moe_sm90_kernel as kernel  # noqa: E402


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32`` (default mode): byte i of the result is byte s & 7 of {b, a},
    or the replicated sign bit of that byte when s & 8."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        s = (selector >> (4 * i)) & 0xF
        byte = pool[s & 7]
        if s & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


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


def test_fp8_shift_trick_decodes_every_code():
    """e4m3 bits << 4 (sign to bit 15) read as bf16, times 2^120: the code's value."""
    codes = np.arange(256, dtype=np.uint32)
    want = np.asarray(jnp.asarray(codes.astype(np.uint8)).view(jnp.float8_e4m3fn)
                      .astype(jnp.float32))
    bits = ((codes & 0x80) << 8) | ((codes & 0x7F) << 4)
    mult = np.float32(2.0 ** 120)
    assert (support.BF16_2POW120 << 16) == np.float32(2.0 ** 120).view(np.uint32)
    got = (bits << 16).view(np.float32) * mult
    finite = np.isfinite(want)               # 0x7F / 0xFF are NaN in e4m3fn: never stored
    np.testing.assert_array_equal(got[finite], want[finite])


@pytest.mark.parametrize("block_n", [8, 128])
def test_schedule_covers_every_valid_row_once(block_n):
    rng = np.random.default_rng(block_n)
    num_experts, rows = 16, 300
    ids = rng.integers(0, num_experts, rows).astype(np.int32)
    ids[:40] = 3                                           # one crowded expert
    ids[[5, 17, 99]] = [-1, num_experts, 1 << 20]          # dropped
    order, valid, tile_expert, tile_row0, tile_rows = map(
        np.asarray, jax.jit(moe_op.moe_schedule, static_argnums=(1, 2))(
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
    for bad in (dict(block_n=12), dict(block_n=512), dict(num_stages=1), dict(ablation="x")):
        with pytest.raises(ValueError, match="MoeGemmSm90Config"):
            support.MoeGemmSm90Config(**bad)
    for fmt in support.WEIGHT_FORMATS:
        for rows in (6, 48, 384, 24576):
            config = support.choose_config(rows, 256, fmt)
            assert config.smem_bytes(fmt, True) <= support.SMEM_BYTES, (fmt, rows, config)


def _compile(fmt, gated, config, a=64, k=512, n=256, e=4):
    def fake(dtype, shape):
        return make_fake_compact_tensor(dtype, shape, assumed_align=16)
    u8, bf16, i32 = cutlass.Uint8, cutlass.BFloat16, cutlass.Int32
    weights = {"fp4": (fake(u8, (e, n, k // 2)), fake(u8, (e, n, k // 32))),
               "fp8": (fake(u8, (e, n, k)), fake(u8, (e, n // 128, k // 128))),
               "bf16": (fake(bf16, (e, n, k)), fake(u8, (4,)))}[fmt]
    slots = support.num_tile_slots(a, e, config.block_n)
    return cute.compile(kernel.moe_gemm_launcher, make_fake_stream(), fake(bf16, (a, k)),
                        fake(i32, (slots,)), fake(i32, (slots,)), fake(i32, (slots,)),
                        *weights, *weights, fake(cutlass.Float32, (a,)), fake(bf16, (a, n)),
                        weight_format=fmt, gated=gated, swiglu_limit=10.0,
                        block_n=config.block_n, num_stages=config.num_stages)


VARIANTS = {"fp4-gated-decode": ("fp4", True, support.DECODE_CONFIG),
            "fp8-down-prefill": ("fp8", False, support.PREFILL_CONFIG),
            "bf16-gated-decode": ("bf16", True, support.choose_config(8, 4, "bf16"))}


@pytest.fixture(scope="module")
def compiled():
    return {name: _compile(*args) for name, args in VARIANTS.items()}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compiles_for_sm90a_with_wgmma(compiled, variant):
    fmt, gated, config = VARIANTS[variant]
    ptx = compiled[variant].artifacts.PTX
    assert ".target sm_90a" in ptx
    # Per stage of K = 128: 8 k-steps of 16 per matrix.
    wgmma = re.findall(rf"wgmma\.mma_async\S*m64n{config.block_n}k16\S*bf16", ptx)
    assert len(wgmma) == 8 * (2 if gated else 1)
    assert "cp.async" in ptx and "mbarrier" in ptx
    conversions = {"fp4": "prmt.b32", "fp8": "mul.rn.bf16x2", "bf16": None}[fmt]
    if conversions:
        assert conversions in ptx
    assert compiled[variant].dump_to_object("moe")[:4] == b"\x7fELF"
