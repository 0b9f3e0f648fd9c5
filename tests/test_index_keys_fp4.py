"""The MXFP4 index keys of the compact cache (``Cache.init(kv_dtype="fp8+fp4")``,
``dsv4_jax.kv_entry``): the row format against the keys' FP4 simulation, the indexer op
reading rows, bad input, the model's lowering; on the GPU the score kernel reading rows
against the reference on their values, bit for bit."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import dsv4_jax as dj
from dsv4_jax import kv_entry, quant
from dsv4_jax.ffi import index_topk, indexer_sm90
from dsv4_jax.ffi.indexer_reference import _scores
from dsv4_jax.kernels import index_scores_config
from dsv4_jax.kernels.index_scores_config import DECODE_CONFIG, DEFAULT_CONFIG, PAIR_CONFIG
from model_lowering import cute_calls, lower_decode_step

BF16 = jnp.bfloat16
H, D = 64, 128


def bits(x):
    return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(x, BF16), jnp.uint16))


def spread_keys(seed, shape, d=D):
    """BF16 keys whose 32-dim blocks span many magnitudes, with a zero block, -0 and a block
    below the FP4 scale floor's reach."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    scale = jnp.exp(3.0 * jax.random.normal(k2, (*shape, d // 32, 1))).repeat(32, -1)
    x = (jax.random.normal(k1, (*shape, d)) * scale.reshape(*shape, d)).astype(BF16)
    x = x.reshape(-1, d).at[0, :32].set(0).at[0, 40].set(-0.0).at[1, 32:64].multiply(1e-30)
    return x.reshape(*shape, d)


# ----------------------------------------------------------------------------- the format

def test_index_key_layout_is_the_kernels():
    assert kv_entry.index_key_bytes(128) == index_scores_config.FP4_KEY_BYTES == 72
    assert index_scores_config.FP4_KEY_SCALE_OFFSET == 64
    assert kv_entry.index_key_bytes(32) == 24          # 16 code bytes, 1 scale, padding
    with pytest.raises(ValueError, match="multiple of 32; got 100"):
        kv_entry.index_key_bytes(100)


def test_decode_of_encode_is_the_fp4_simulation_bit_for_bit():
    x = spread_keys(0, (9, 7))
    rows = kv_entry.encode_index_keys(x)
    assert rows.shape == (9, 7, 72) and rows.dtype == jnp.uint8
    want = quant.fp4_simulate(x, 32)
    np.testing.assert_array_equal(bits(kv_entry.decode_index_keys(rows, D)), bits(want))
    # simulated keys (what the model stores) round-trip unchanged
    again = kv_entry.decode_index_keys(kv_entry.encode_index_keys(want), D)
    np.testing.assert_array_equal(bits(again), bits(want))
    assert np.all(np.asarray(rows[..., 68:]) == 0)
    with pytest.raises(ValueError, match="rows of 64 bytes are no MXFP4 index key layout"):
        kv_entry.decode_index_keys(rows[..., :64], D)


def test_row_bytes_sit_where_the_layout_says():
    x = jnp.zeros((D,), jnp.float32)
    # block 0: amax 24 -> scale 2^ceil(log2(24 / 6)) = 4 (E8M0 129); 24 -> code 6 (0x7),
    # -2 -> code -0.5 (0x9), in one byte, the lower dim in the low nibble
    x = x.at[0].set(24.0).at[1].set(-2.0)
    # block 1: amax 1 -> scale 2^ceil(log2(1/6)) = 2^-2 (E8M0 125); 1 -> code 4 (0x6)
    x = x.at[34].set(1.0)
    row = np.asarray(kv_entry.encode_index_keys(x))
    assert row[0] == 0x97 and row[64] == 129
    assert row[17] == 0x06 and row[65] == 125
    assert row[66] == row[67] == 1 and row.shape == (72,)   # empty blocks: the floor 2^-126


# ----------------------------------------------------------------------------- the op (CPU)

def fp4_case(seed, b, s, n):
    """Index queries on the FP4 grid (as the model feeds the op), keys as rows."""
    rng = np.random.default_rng(seed)
    q = quant.fp4_simulate(jnp.asarray(rng.standard_normal((b, s, H, D)), BF16), 32)
    weights = jnp.asarray(rng.choice([0.0, 0.25, -0.25, 0.5, -1.0], (b, s, H)), BF16)
    rows = kv_entry.encode_index_keys(spread_keys(seed, (b, n)))
    visible = rng.integers(0, n + 1, (b, s)).astype(np.int32)
    visible.flat[0] = n
    return q, weights, rows, jnp.asarray(visible)


@pytest.mark.parametrize("block", [None, 128])
def test_reference_reads_rows_as_their_values(block):
    q, weights, rows, visible = fp4_case(1, 2, 3, 300)
    keys = kv_entry.decode_index_keys(rows, D)
    got = index_topk(q, weights, rows, visible, 50, block=block, implementation="xla")
    want = index_topk(q, weights, keys, visible, 50, block=block, implementation="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.any(np.asarray(got) >= 0)


def test_bad_rows_get_one_line_errors():
    q, weights, rows, visible = fp4_case(2, 1, 2, 40)
    with pytest.raises(ValueError, match=r"keys must be uint8 MXFP4 rows \[B = 1, N, 72\]"):
        index_topk(q, weights, rows[..., :64], visible, 8, implementation="xla")
    q48 = jnp.zeros((1, 2, H, 48), BF16)
    with pytest.raises(TypeError, match="uint8 MXFP4 rows for D a multiple of 32"):
        index_topk(q48, weights, jnp.zeros((1, 40, 48), jnp.uint8), visible, 8,
                   implementation="xla")
    ok, why = indexer_sm90.support(q, weights, jnp.zeros((1, 40, 80), jnp.uint8), visible)
    assert not ok and "uint8 key rows of 80 bytes" in why


def test_decode_step_lowers_the_score_kernel_on_the_rows():
    """The model's decode step for a Hopper GPU (lowered on CPU) with the compact cache: each
    CSA layer's score kernel takes its MXFP4 key table as it is (no decoded BF16 copy)."""
    cfg = dj.Config.tiny(n_heads=64, o_groups=8, index_n_heads=64)
    policy = dj.KernelPolicy(implementation="xla", ops={"index_topk": "cute"})
    model = dj.DSV4(cfg, implementation=policy, runtime_checks=False)
    cache = jax.eval_shape(lambda: dj.Cache.init(cfg, 2, 4096, kv_dtype="fp8+fp4"))
    text = lower_decode_step(model, cfg, cache)
    calls = cute_calls(text)
    rows = 4096 // 4
    assert any(f"tensor<2x{rows}x72xui8>" in line for line in calls)
    assert f"tensor<2x{rows}x128xbf16>" not in text


def test_kernel_compiles_for_sm90a_on_rows():
    """Per key row and thread: two 4-byte cp.async (its chunk's codes, the scale word) and,
    one block later, 8 widened values in one 16-byte store; no 16-byte key copies, no local
    memory. (The decode config: one query per warpgroup, two stages.)"""
    pytest.importorskip("cutlass")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    from dsv4_jax.kernels import index_scores_sm90 as kernel
    b, s, n, w = (cute.sym_int() for _ in range(4))
    bf = lambda shape: make_fake_compact_tensor(cutlass.BFloat16, shape, assumed_align=16)
    i32 = lambda shape: make_fake_compact_tensor(cutlass.Int32, shape, assumed_align=4)
    u8 = lambda shape: make_fake_compact_tensor(cutlass.Uint8, shape, assumed_align=8)
    compiled = cute.compile(kernel.index_scores_launcher, make_fake_stream(),
                            bf((b, s, H, D)), bf((b, s, H)), u8((b, n, 72)), i32((b, s)),
                            i32((1,)), bf((b, s, w)), splits=3, tokens_per_warpgroup=1,
                            num_stages=2, skip_invisible=True, fp4_keys=True)
    ptx = compiled.artifacts.PTX
    rows = index_scores_config.BLOCK_N // 8          # rows per producer thread and block
    assert ".target sm_90a" in ptx
    assert ptx.count("cp.async.ca.shared.global") == 2 * rows
    # the widening (emitted twice: in the loop and for the last block): 4 table lookups and
    # 4 interleaves, one BF16x2 scale multiply per pair, no conversion instruction
    assert ptx.count("prmt.b32") == 2 * rows * 8
    assert ptx.count("mul.rn.bf16x2") == 2 * rows * 4 + 2 * (index_scores_config.BLOCK_N // 8)
    assert "cvt.f32.f16" not in ptx
    assert ptx.count("st.shared.v4.b32") == 2 * rows
    assert ptx.count("cp.async.cg.shared.global") == 8 * 2      # the two Q tiles only
    assert ptx.count("wgmma.mma_async") == 8
    assert "ld.local" not in ptx and "st.local" not in ptx


# ----------------------------------------------------------------------------- the kernel (GPU)

@pytest.mark.gpu
@pytest.mark.parametrize("config", [DEFAULT_CONFIG, PAIR_CONFIG, DECODE_CONFIG],
                         ids=["2x3", "1x2", "1x2-splitn"])
@pytest.mark.parametrize("b, s, n, lo, width", [
    (1, 1, 1024, 0, 1024),        # decode, one block per CTA split
    (8, 1, 5000, 0, 5000),        # decode batch 8, N not a multiple of the block
    (2, 9, 700, 128, 384),        # a later block: lo > 0, ending past N
    (1, 64, 4096, 0, 4096),       # a prefill chunk: many blocks per CTA
])
def test_kernel_on_rows_equals_the_reference_on_their_values(b, s, n, lo, width, config):
    """The producer widens each row to exactly the BF16 keys the rows decode to: the scores
    equal the reference's on those keys bit for bit (the head sums of these inputs are
    exact in f32, so the kernel's addition order does not show)."""
    rng = np.random.default_rng(n + s)
    q = jnp.asarray(rng.integers(-2, 3, (b, s, H, D)) * 0.5, BF16)
    weights = jnp.asarray(rng.choice([0.0, 0.25, -0.5, 1.0], (b, s, H)), BF16)
    # codes on the e2m1 grid times one power of two per 32-dim block (2^-1 .. 2^1): dot
    # products stay exact in f32
    codes = rng.choice(quant.FP4_CODE_VALUES, (b, n, D))
    scale = 2.0 ** rng.integers(-1, 2, (b, n, D // 32)).repeat(32, -1)
    keys = jnp.asarray(codes * scale, BF16)
    rows = kv_entry.encode_index_keys(keys)
    np.testing.assert_array_equal(bits(kv_entry.decode_index_keys(rows, D)), bits(keys))
    visible = rng.integers(0, n + 1, (b, s)).astype(np.int32)
    visible.flat[0] = n
    limit = jnp.minimum(jnp.asarray(visible), n)
    got = jax.jit(lambda *a: indexer_sm90.index_scores_cute(*a, jnp.int32(lo), width, config))(
        q, weights, rows, limit)
    padded = jnp.pad(keys, ((0, 0), (0, max(0, lo + width - n)), (0, 0)))
    want = _scores(q, weights, padded[:, lo:lo + width], lo, limit)[0]
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(want).any()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.gpu
@pytest.mark.parametrize("b, s, n, k", [(1, 1, 65536, 512), (8, 1, 3000, 512),
                                        (1, 256, 8192, 512)])
def test_op_on_rows_gives_the_ids_of_the_op_on_their_values(b, s, n, k):
    q, weights, rows, visible = fp4_case(n, b, s, n)
    keys = kv_entry.decode_index_keys(rows, D)
    got = jax.jit(lambda *a: index_topk(*a, k, implementation="cute"))(q, weights, rows, visible)
    want = jax.jit(lambda *a: index_topk(*a, k, implementation="cute"))(q, weights, keys, visible)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
