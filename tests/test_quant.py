"""Quantisation numerics against the official reference vectors and hand-built examples.

The vectors (``tests/data/reference_vectors.npz``, see tests/data/README.md) come from
DeepSeek's TileLang kernels; act_quant, the KV FP8 simulation, the MXFP4 simulation, the
Hadamard rotation and FP4 weight decoding must match every bit.
"""
import pathlib

import ml_dtypes
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from dsv4_jax import quant
from dsv4_jax.models.mhc import split_sinkhorn

VECTORS = pathlib.Path(__file__).resolve().parent / "data" / "reference_vectors.npz"


@pytest.fixture(scope="module")
def vec():
    return dict(np.load(VECTORS))


def bf16(u16):
    return jnp.asarray((u16.astype(np.uint32) << 16).view(np.float32)).astype(jnp.bfloat16)


def bits16(x):
    return np.asarray(jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16))


def assert_bits_equal(got, want, what):
    mismatch = np.count_nonzero(got != want)
    assert mismatch == 0, f"{what}: {mismatch} of {want.size} values differ"


def test_act_quant_codes_and_scales_bit_exact(vec):
    q, s = quant.act_quant(bf16(vec["act_quant_x"]), 128)
    assert_bits_equal(np.asarray(q).view(np.uint8), vec["act_quant_q_e4m3"], "e4m3 codes")
    e8m0 = np.asarray(s.astype(quant.E8M0_DTYPE)).view(np.uint8)
    assert_bits_equal(e8m0, vec["act_quant_s_e8m0"], "e8m0 scales")


def test_kv_fp8_simulation_bit_exact(vec):
    y = quant.fp8_simulate(bf16(vec["kv_sim_x"]), 64)
    assert_bits_equal(bits16(y), vec["kv_sim_y"], "kv fp8 simulation")


def test_fp4_simulation_bit_exact(vec):
    y = quant.fp4_simulate(bf16(vec["fp4_sim_x"]), 32)
    assert_bits_equal(bits16(y), vec["fp4_sim_y"], "mxfp4 simulation")


def test_hadamard_rotation_bit_exact(vec):
    y = quant.hadamard_rotate(bf16(vec["fp4_sim_x"]))
    assert_bits_equal(bits16(y), vec["hadamard_y"], "hadamard")


def test_fp4_weight_decoding_bit_exact(vec):
    w = quant.dequant_fp4_weight(jnp.asarray(vec["fp4_weight_packed_i8"]),
                                 jnp.asarray(vec["fp4_weight_scale_e8m0"]))
    assert_bits_equal(np.asarray(w).view(np.uint32),
                      vec["fp4_weight_dequant_f32"].view(np.uint32), "fp4 weight")


def test_sinkhorn_matches_reference_vectors(vec):
    pre, post, comb = split_sinkhorn(jnp.asarray(vec["hc_mixes"]), jnp.asarray(vec["hc_scale"]),
                                     jnp.asarray(vec["hc_base"]), 4, 20, 1e-6)
    np.testing.assert_allclose(pre, vec["hc_pre"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(post, vec["hc_post"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(comb, vec["hc_comb"], rtol=1e-5, atol=1e-7)


def test_sparse_attention_matches_reference_vectors(vec):
    from dsv4_jax.ffi import sparse_attention_reference
    q, kv = bf16(vec["attn_q"])[0], bf16(vec["attn_kv"])[0]
    o, _ = sparse_attention_reference(q, kv, jnp.asarray(vec["attn_idx"][0]),
                                      jnp.asarray(vec["attn_sink"]),
                                      scale=float(vec["attn_scale"]))
    want = np.asarray(bf16(vec["attn_o"])[0], np.float32)
    err = np.linalg.norm(np.asarray(o, np.float32) - want) / np.linalg.norm(want)
    assert err < 1e-2, err


# ------------------------------------------------------------------ hand-built examples
def test_fp8_weight_dequant_by_hand():
    # 2x2 blocks of 128: block (i, j) has scale 2^(i - j); code 1.5 everywhere except one.
    codes = np.full((256, 256), 1.5, np.float32)
    codes[130, 3] = -448.0
    e = np.array([[127, 126], [128, 127]], np.uint8)          # 2^0, 2^-1, 2^1, 2^0
    w = quant.dequant_fp8_weight(jnp.asarray(codes).astype(quant.FP8_DTYPE),
                                 jax.lax.bitcast_convert_type(jnp.asarray(e), quant.E8M0_DTYPE))
    w = np.asarray(w)
    assert w[0, 0] == 1.5 and w[0, 200] == 0.75 and w[200, 0] == 3.0 and w[200, 200] == 1.5
    assert w[130, 3] == -896.0


def test_fp4_nibble_order_and_e8m0_by_hand():
    # byte 0x71: low nibble 1 (0.5) is element 0, high nibble 7 (6.0) is element 1;
    # 0xF8: low 8 (-0.0), high 15 (-6); scales 2^(128-127) = 2 and 2^(125-127) = 1/4.
    packed = np.zeros((2, 16), np.uint8)
    packed[0, 0], packed[0, 1] = 0x71, 0xF8
    packed[1, 0] = 0x2A                                       # low 10 (-1), high 2 (1.0)
    scale = np.array([[128], [125]], np.uint8)
    w = np.asarray(quant.dequant_fp4_weight(jnp.asarray(packed.view(np.int8)),
                                            jnp.asarray(scale)))
    np.testing.assert_array_equal(w[0, :4], [1.0, 12.0, -0.0, -12.0])
    np.testing.assert_array_equal(w[1, :2], [-0.25, 0.25])
    assert np.signbit(w[0, 2])


def test_fp4_pack_unpack_round_trip():
    vals = np.array(quant.FP4_CODE_VALUES)[np.random.default_rng(0).integers(0, 16, (3, 64))]
    packed = quant.pack_fp4(jnp.asarray(vals))
    np.testing.assert_array_equal(np.asarray(quant.unpack_fp4(packed)), vals)


def test_fp4_to_fp8_conversion_is_lossless():
    rng = np.random.default_rng(1)
    vals = np.array(quant.FP4_CODE_VALUES)[rng.integers(0, 16, (256, 256))]
    # Sub-block exponents within 2^6 of their 128x128 block maximum: exactly representable.
    e = rng.integers(120, 127, (256, 256 // 32)).astype(np.uint8)
    packed, scale = quant.pack_fp4(jnp.asarray(vals)), jnp.asarray(e)
    want = np.asarray(quant.dequant_fp4_weight(packed, scale))
    q8, s8 = quant.fp4_to_fp8_weight(packed, scale)
    got = np.asarray(quant.dequant_fp8_weight(q8, s8))
    np.testing.assert_array_equal(got, want)
    # New scale = max sub-scale / 2^6 per block.
    s8 = np.asarray(s8.astype(jnp.float32))
    blk = 2.0 ** (e.astype(np.float64) - 127).reshape(2, 128, 2, 4).max(axis=(1, 3))
    np.testing.assert_array_equal(s8, blk / 64)


def test_act_quant_scale_is_power_of_two_ceiling():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((8, 256)) * 10, jnp.bfloat16)
    q, s = quant.act_quant(x, 128)
    amax = np.abs(np.asarray(x, np.float32)).reshape(8, 2, 128).max(-1)
    want = 2.0 ** np.ceil(np.log2(np.maximum(amax, 1e-4) / 448.0))
    np.testing.assert_array_equal(np.asarray(s), want.astype(np.float32))
    deq = np.asarray(quant.act_quant_dequant(x, 128))
    ref = (np.asarray(q.astype(jnp.float32)).reshape(8, 2, 128) * want[..., None]).reshape(8, 256)
    np.testing.assert_array_equal(deq, ref)
    assert np.max(np.abs(np.asarray(q.astype(jnp.float32)))) <= 448


def test_quantize_fp8_weight_round_trip_on_grid():
    raw = np.clip(np.random.default_rng(3).standard_normal((128, 256)) * 100, -440, 440)
    codes = np.array(jnp.asarray(raw).astype(quant.FP8_DTYPE).astype(jnp.float32))
    codes[0, 0], codes[0, 200] = 448.0, -448.0               # each block's amax is exactly 448
    w = codes * 2.0 ** -5
    q, s = quant.quantize_fp8_weight(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(quant.dequant_fp8_weight(q, s)), w)
    assert ml_dtypes.float8_e8m0fnu == np.dtype(s.dtype)


def test_quantize_fp4_weight_round_trip_on_grid_and_error_bound():
    rng = np.random.default_rng(4)
    codes = np.array(quant.FP4_CODE_VALUES)[rng.integers(0, 16, (8, 64))]
    codes[:, 0] = 6.0                                        # every 32-block reaches amax 6
    codes[:, 32] = -6.0
    w = codes * 2.0 ** -3
    packed, scale = quant.quantize_fp4_weight(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(quant.dequant_fp4_weight(packed, scale)), w)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    p2, s2 = quant.quantize_fp4_weight(jnp.asarray(x))
    err = np.abs(np.asarray(quant.dequant_fp4_weight(p2, s2)) - x)
    # e2m1 spacing is at most 2 at amax/scale 6, i.e. half-spacing 1/6 of the block amax
    amax = np.abs(x).reshape(8, 2, 32).max(-1).repeat(32, axis=-1)
    assert np.all(err <= amax / 6 * 1.0001 * 2)
