"""The blocked FP4 weight layout (``quant.block_fp4_weight``: [..., out/64, in/128, 64, 64]
bytes, every 64-row x K-block tile contiguous): the format is recognised from the array, the
references read it as the rows it holds, the checks name a wrong one, the kernels' address
formula (``grouped_gemm_layout.weight_offset``) finds every byte where the conversion put it,
every FP4 kernel compiles for it, and -- on the GPU -- every FP4 kernel gives the same bits
on blocked weights as on rows, alone and inside the routed experts."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax import quant
from dsv4_jax.ffi import cases, grouped_gemm_reference, moe_experts
from dsv4_jax.ffi.grouped_gemm_sm90 import (grouped_gemm_cute, kernel_weight_layout,
                                            launch_support, support)
from dsv4_jax.ffi.moe_reference import moe_experts_reference
from dsv4_jax.ffi.policy import GroupedGemmPolicy
from dsv4_jax.kernels import grouped_gemm_config as kernels
from dsv4_jax.kernels.grouped_gemm_layout import BLOCK_K, ROW_BYTES, weight_offset


def _fp4(groups, n, k, seed=0):
    keys = jax.random.split(jax.random.key(seed), 2)
    return cases.random_weight("fp4", *keys, groups, n, k)


def test_block_and_unblock_are_inverse_and_tiles_are_contiguous():
    w, _ = _fp4(3, 128, 512)
    b = quant.block_fp4_weight(w)
    assert b.shape == (3, 2, 4, 64, 64) and b.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(quant.unblock_fp4_weight(b)), np.asarray(w))
    # Tile (e, i, j) is rows 64 i .. 64 i + 63, bytes 64 j .. 64 j + 63 of expert e.
    np.testing.assert_array_equal(np.asarray(b[2, 1, 3]), np.asarray(w[2, 64:128, 192:256]))


@pytest.mark.parametrize("shape", [(4, 96, 256), (4, 128, 96), (128, 100)])
def test_block_names_shapes_it_cannot_tile(shape):
    with pytest.raises(ValueError, match=r"block_fp4_weight: packed FP4 \[\.\.\., out, in/2\] "
                                         r"needs out a multiple of 64 and in a multiple of 128; "
                                         r"got shape"):
        quant.block_fp4_weight(jnp.zeros(shape, jnp.int8))


def test_weight_offset_finds_every_byte_where_blocking_put_it():
    """The kernels' address formula, replayed on ints over the blocked bytes, reads each row's
    K blocks as the row layout holds them."""
    groups, n, k = 2, 128, 512
    w, _ = _fp4(groups, n, k, seed=3)
    rows_bytes = np.asarray(w).reshape(-1)
    blocked_bytes = np.asarray(quant.block_fp4_weight(w)).reshape(-1)
    row_bytes, num_k = ROW_BYTES["fp4"], k // BLOCK_K
    for row in range(groups * n):
        for kb in range(num_k):
            at_rows = weight_offset(row, kb, num_k, row_bytes, "rows")
            at_blocked = weight_offset(row, kb, num_k, row_bytes, "blocked")
            np.testing.assert_array_equal(blocked_bytes[at_blocked:at_blocked + row_bytes],
                                          rows_bytes[at_rows:at_rows + row_bytes])


def test_the_format_is_read_from_the_array():
    w, s = _fp4(2, 128, 256)
    b = quant.block_fp4_weight(w)
    assert quant.weight_format(b, s) is quant.FP4_BLOCKED
    assert quant.weight_format(w, s) is quant.FP4
    assert quant.FP4_BLOCKED.name == "fp4" and quant.FP4_BLOCKED.label == "fp4 (blocked)"
    assert quant.matrix_dims(b) == quant.matrix_dims(w) == (2, 128, 128)
    np.testing.assert_array_equal(np.asarray(quant.dequant_weight(b, s, jnp.float32)),
                                  np.asarray(quant.dequant_weight(w, s, jnp.float32)))
    assert kernel_weight_layout(b, b) == "blocked" and kernel_weight_layout(w) == "rows"
    assert kernel_weight_layout(w, b) is None


@pytest.mark.parametrize("rows, routed, gated", [(5, True, False), (40, True, True),
                                                 (16, False, False)])
def test_grouped_gemm_reference_reads_blocked_weights_as_rows(rows, routed, gated):
    groups, n, k = 4, 128, 256
    w = _fp4(groups, n, k, seed=1)
    up = _fp4(groups, n, k, seed=2) if gated else None
    x = jax.random.normal(jax.random.key(4), (rows, k), jnp.float32).astype(jnp.bfloat16)
    ids = (jax.random.randint(jax.random.key(5), (rows,), 0, groups) if routed else None)
    block = lambda m: None if m is None else (quant.block_fp4_weight(m[0]), m[1])  # noqa: E731
    want = grouped_gemm_reference(x, ids, w, w_up=up, simulate=True)
    got = grouped_gemm_reference(x, ids, block(w), w_up=block(up), simulate=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_moe_reference_reads_blocked_weights_as_rows():
    c = cases.moe_case("tiny", "fp4", 6, "random")
    blocked = tuple((quant.block_fp4_weight(w), s) for w, s in c.args[3:])
    want = moe_experts_reference(*c.args, **c.kw)
    got = moe_experts_reference(*c.args[:3], *blocked, **c.kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_checks_name_a_wrong_blocked_weight():
    w, s = _fp4(2, 128, 256)
    x = jnp.zeros((4, 256), jnp.bfloat16)
    wide = jnp.zeros((4, 512), jnp.bfloat16)                      # K = 512, w has 256
    with pytest.raises(ValueError, match=r"grouped_gemm: w weight must be \[E=2, 2, 4, 64, 64\] "
                                         r"\(FP4 blocked: \[E, out/64, in/128, 64, 64\] "
                                         r"bytes\); w has shape \(2, 2, 2, 64, 64\)"):
        grouped_gemm_reference(wide, None, (quant.block_fp4_weight(w), s), simulate=True)
    with pytest.raises(ValueError, match=r"grouped_gemm: w scale must be \[2, 128, 8\]"):
        grouped_gemm_reference(x, None, (quant.block_fp4_weight(w), s[:, :, :4]))
    with pytest.raises(TypeError, match=r"grouped_gemm: w and w_up must share one format, got "
                                        r"fp4, fp4 \(blocked\)"):
        grouped_gemm_reference(x, None, (w, s), w_up=(quant.block_fp4_weight(w), s))
    c = cases.moe_case("tiny", "fp4", 2, "random")
    w1, w3, w2 = c.args[3:]
    with pytest.raises(TypeError, match=r"moe_experts: w1, w3, w2 must share one format, got "
                                        r"fp4, fp4 \(blocked\), fp4"):
        moe_experts(*c.args[:3], w1, (quant.block_fp4_weight(w3[0]), w3[1]), w2, **c.kw,
                    implementation="reference")


def test_support_refuses_mixed_layouts_and_non_fp4_blocked_configs():
    w = _fp4(4, 128, 256)
    b = (quant.block_fp4_weight(w[0]), w[1])
    ok, why = support(8, 256, "bfloat16", w, b, ragged=True, simulate=True, policy=None)
    assert not ok and why == "weights in different layouts (rows and blocked FP4)"
    assert support(8, 256, "bfloat16", b, b, ragged=True, simulate=True, policy=None)[0]
    config = kernels.GroupedGemmSm90Config(block_n=8, num_stages=3, algorithm="mma_sync",
                                           weight_layout="blocked")
    ok, why = config.is_supported(weight_format="fp8", gated=False, n_out=256, k_in=512,
                                  x_dtype="bfloat16", num_tiles=4)
    assert not ok and why == "weight layout 'blocked' with 'fp8' weights (packed FP4 only)"
    with pytest.raises(ValueError, match=r"weight_layout must be one of \('rows', 'blocked'\), "
                                         r"got 'tiles'"):
        kernels.GroupedGemmSm90Config(weight_layout="tiles")


# Every kernel that reads FP4 weights: (algorithm, block_n, split_k, gated).
FP4_KERNELS = [("mma_sync", 8, 2, False), ("mma_fp8", 8, 2, True), ("wgmma_rs", 8, 2, False),
               ("wgmma_rs", 8, 1, True), ("mma_fp8_stream", 8, 1, False),
               ("wgmma", 64, 1, True), ("wgmma_coop", 128, 1, False),
               ("wgmma_fp8", 64, 1, True), ("wgmma_fp8_coop", 128, 1, True)]


@pytest.mark.parametrize("algorithm, block_n, split, gated", FP4_KERNELS)
def test_compiles_for_sm90a(algorithm, block_n, split, gated):
    from grouped_gemm_compile import compile_variant
    config = kernels.GroupedGemmSm90Config(block_n=block_n, num_stages=3, algorithm=algorithm,
                                           split_k=split, weight_layout="blocked")
    ptx = compile_variant("fp4", gated, config, a=48, k=1024, n=256, e=8).artifacts.PTX
    assert ".entry" in ptx and "cp.async" in ptx or "ld.global" in ptx


# ----------------------------------------------------------------------------- GPU
def _f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm, block_n, split, gated", FP4_KERNELS)
def test_blocked_weights_give_the_bits_of_rows(algorithm, block_n, split, gated):
    """The same kernel on the same values: rows and blocked weights must agree bit for bit
    (only the addresses differ), and rows match the reference."""
    groups, n, k, rows = 8, 256, 1024, 8 * 20 if block_n == 8 else 300
    w = _fp4(groups, n, k, seed=11)
    up = _fp4(groups, n, k, seed=12) if gated else None
    x = jax.random.normal(jax.random.key(13), (rows, k), jnp.float32).astype(jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(14), (rows,), 0, groups)
    rw = jax.random.uniform(jax.random.key(15), (rows,), jnp.float32) if gated else None
    simulate = algorithm not in ("mma_sync", "wgmma", "wgmma_coop")
    config = kernels.GroupedGemmSm90Config(
        block_n=block_n, num_stages=3, algorithm=algorithm, split_k=split,
        token_codes=gated and algorithm in ("mma_fp8", "wgmma_rs"))
    ok, why = launch_support(config, "fp4", "bfloat16", rows, groups, [(gated, n, k)])
    assert ok, why
    block = lambda m: None if m is None else (quant.block_fp4_weight(m[0]), m[1])  # noqa: E731

    def run(x, ids, w, up, rw):
        return grouped_gemm_cute(x, ids, w, w_up=up, row_weights=rw, swiglu_limit=10.0,
                                 simulate=simulate, config=config)
    run = jax.jit(run)
    got = run(x, ids, block(w), block(up), rw)
    base = run(x, ids, w, up, rw)
    np.testing.assert_array_equal(_f32(got), _f32(base))
    want = jax.jit(lambda x, ids, w, up, rw: grouped_gemm_reference(
        x, ids, w, w_up=up, row_weights=rw, swiglu_limit=10.0, simulate=simulate))(
        x, ids, w, up, rw)
    cases.check_against_reference(_f32(got), _f32(want), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 512])
def test_routed_experts_on_blocked_weights_give_the_bits_of_rows(tokens):
    """The MoE op at Flash dims under the default policy (the model's kernels and splits)."""
    c = cases.moe_case("flash", "fp4", tokens, "random")
    blocked = tuple((quant.block_fp4_weight(w), s) for w, s in c.args[3:])
    run = cases.moe_experts_jit("cute", c.kw, GroupedGemmPolicy())
    got = run(*c.args[:3], *blocked)
    base = run(*c.args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(base))
