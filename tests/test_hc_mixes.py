"""The stream-mixes op (``dsv4_jax.ffi.hc_stream_mixes``): bad input, the kernel's support
rules and launch choice, the exact three-part split of fn (a numpy replay), its sm_90a compile
and the op's lowering (the prefill's mHC chain carries the kernel) on CPU; on the GPU the
kernel against float64, repeatable, and hc_pre's chain with it against the chain without."""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax.ffi import hc_pre, hc_stream_mixes
from dsv4_jax.ffi.dispatch import cuda_target
from dsv4_jax.ffi.hc_pre_reference import stream_mixes
from dsv4_jax.kernels.hc_mixes_config import (CHUNK, RESIDENT_CTAS, HcMixesSm90Config,
                                              choose_config)

N, NORM_EPS = 4, 1e-6
STATIC = dict(n=N, iters=20, hc_eps=1e-6, norm_eps=NORM_EPS)


def _inputs(rows, dim, seed=0, n=N, dtype=jnp.bfloat16):
    """Streams of unequal scale (the mixes see their RMS), fn of the model's init scale."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, n, dim)) * rng.uniform(0.5, 4.0, (rows, n, 1))
    fn = rng.standard_normal(((2 + n) * n, n * dim)) * (n * dim) ** -0.5
    return jnp.asarray(x, dtype), jnp.asarray(fn, jnp.float32)


def _float64(x, fn):
    """The contract in float64 and each mix's sum of |products| x rsqrt (the error scale)."""
    flat = np.asarray(x, np.float64).reshape(x.shape[0], -1)
    fn64 = np.asarray(fn, np.float64)
    rsqrt = 1 / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + NORM_EPS)
    return flat @ fn64.T * rsqrt, np.abs(flat) @ np.abs(fn64).T * rsqrt


# ------------------------------------------------------------------ the op on CPU
def test_reference_is_stream_mixes():
    x, fn = _inputs(3, 64)
    got = hc_stream_mixes(x, fn, norm_eps=NORM_EPS)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(stream_mixes(x, fn, NORM_EPS)))
    want, bound = _float64(x, fn)
    assert np.max(np.abs(np.asarray(got, np.float64) - want) / bound) < 2 ** -20


@pytest.mark.parametrize("x_shape, fn_shape, error, message", [
    ((4,), (24, 4), ValueError, r"x must be \[..., n, d\]; x has shape \(4,\)"),
    ((2, 4, 64), (24, 255), ValueError, r"fn must be \[M, n d = 256\] .* \(2, 4, 64\); fn "
                                        r"has shape \(24, 255\)"),
    ((2, 4, 64), (24, 256, 1), ValueError, "fn must be"),
])
def test_bad_input_names_the_argument(x_shape, fn_shape, error, message):
    with pytest.raises(error, match=message):
        hc_stream_mixes(jnp.zeros(x_shape, jnp.bfloat16), jnp.zeros(fn_shape, jnp.float32),
                        norm_eps=NORM_EPS)
    with pytest.raises(TypeError, match="x must be floating; x has dtype int32"):
        hc_stream_mixes(jnp.zeros((2, 4, 64), jnp.int32), jnp.zeros((24, 256)),
                        norm_eps=NORM_EPS)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(x_dtype="float32"), "x of dtype float32"),
    (dict(fn_dtype="bfloat16"), "fn of dtype bfloat16"),
    (dict(mixes=20), "20 mixes (a multiple of 8, at most 24)"),
    (dict(mixes=32), "32 mixes"),
    (dict(k=16384 + 64), "n d = 16448 columns (a multiple of 64 x slices = 512)"),
    (dict(rows=0), "no rows"),
    (dict(rows=2 ** 17), "32-bit element offsets"),
])
def test_support_names_what_the_kernel_does_not_take(kwargs, reason):
    args = dict(rows=4096, k=16384, mixes=24, x_dtype="bfloat16", fn_dtype="float32") | kwargs
    ok, why = HcMixesSm90Config(slices=8).is_supported(**args)
    assert not ok and reason in why
    assert HcMixesSm90Config(slices=8).is_supported(
        **(args | dict(rows=4096, k=16384, mixes=24, x_dtype="bfloat16",
                       fn_dtype="float32"))) == (True, "")


def test_config_rejects_what_it_cannot_launch():
    with pytest.raises(ValueError, match="tiles must be one of"):
        HcMixesSm90Config(tiles=3)
    with pytest.raises(ValueError, match="slices must be a positive int"):
        HcMixesSm90Config(slices=0)


@pytest.mark.parametrize("rows, k, slices", [
    (4096, 16384, 8),       # Flash prefill chunk: 32 CTA rows x 8 slices, one wave
    (512, 16384, 64),       # few rows: slices until a slice is 4 chunks
    (16384, 16384, 2),
    (8192, 16384, 4),
    (65536, 16384, 1),
    (300, 1024, 4),         # small dims: the chunks bound the slices
])
def test_choose_config_fills_one_wave(rows, k, slices):
    config = choose_config(rows, k)
    assert config.slices == slices
    blocks = -(-rows // config.rows_per_cta)
    assert blocks * config.slices <= max(RESIDENT_CTAS, blocks)
    assert k % (CHUNK * config.slices) == 0


def _split_bf16x3(v: np.ndarray):
    """numpy replay of ``split_bf16x3`` (the same truncations and f32 subtractions)."""
    bits = v.view(np.uint32)
    hi = (bits & 0xFFFF0000).view(np.float32)
    r = (v - hi).astype(np.float32)
    mid = (r.view(np.uint32) & 0xFFFF0000).view(np.float32)
    lo = (r - mid).astype(np.float32)
    return hi, mid, lo


def test_fn_splits_into_three_exact_bf16_parts():
    """hi + mid + lo == fn exactly, each part a bf16 (its low 16 bits zero), on random f32
    of the weights' scales and on edge values."""
    rng = np.random.default_rng(0)
    v = np.concatenate([
        (rng.standard_normal(100000) * 10.0 ** rng.uniform(-6, 2, 100000)).astype(np.float32),
        np.array([0.0, -0.0, 1.0, -1.0, 1 + 2 ** -23, 2 ** -100, 3e38, -1.17549435e-38],
                 np.float32)])
    hi, mid, lo = _split_bf16x3(v)
    for part in (hi, mid, lo):
        assert not np.any(part.view(np.uint32) & 0xFFFF)
    total = hi.astype(np.float64) + mid.astype(np.float64) + lo.astype(np.float64)
    np.testing.assert_array_equal(total, v.astype(np.float64))


# ------------------------------------------------------------------ sm_90a compile and lowering
def test_kernel_compiles_for_sm90a(tmp_path):
    """Flash dims: per chunk and lane 2 x 2 tiles 16-byte row loads (not kept in L1) and 3 x 4
    fn loads (kept in L1), 4 steps x 2 tiles x (3 x 3 mixes + 2 squares) MMAs, no local
    memory; through ptxas: no spills, registers that keep 2 CTAs per SM."""
    pytest.importorskip("cutlass")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    from grouped_gemm_compile import ptxas_log
    from dsv4_jax.kernels import hc_mixes_sm90 as kernel

    config = choose_config(4096, 16384)

    def fake(dtype, shape):
        return make_fake_compact_tensor(dtype, shape, assumed_align=16)
    rows, k = cute.sym_int(divisibility=16), cute.sym_int(divisibility=16)
    compiled = cute.compile(kernel.hc_mixes_launcher, make_fake_stream(),
                            fake(cutlass.BFloat16, (rows, k)), fake(cutlass.Float32, (24, k)),
                            fake(cutlass.Float32, (config.slices, rows, 32)), mixes=24,
                            tiles=config.tiles, slices=config.slices)
    ptx = compiled.artifacts.PTX
    assert ".target sm_90a" in ptx and ".local" not in ptx
    mma = ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
    assert mma == 4 * config.tiles * (3 * 3 + 2)
    # Twice each (the first chunk before the loop, the next one inside it).
    assert ptx.count("ld.global.nc.L1::no_allocate.v4.b32") == 2 * 2 * 2 * config.tiles
    assert ptx.count("ld.global.nc.v4.b32") == 2 * 3 * 4
    log = ptxas_log(tmp_path, compiled)
    assert "0 bytes spill stores, 0 bytes spill loads" in log, log
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    assert registers * 128 * 2 <= 65536, log


def _lowered(f, *args) -> str:
    with cuda_target():
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_prefill_chain_lowers_the_kernel():
    """hc_pre past its own kernel's rows (a prefill chunk) runs the mixes kernel; the op
    alone with implementation="xla" does not."""
    pytest.importorskip("cutlass")
    x, fn = _inputs(300, 256)
    args = (x, fn, jnp.ones(3), jnp.zeros(24), jnp.ones(256, jnp.bfloat16))
    text = _lowered(lambda *a: hc_pre(*a, **STATIC), *args)
    assert "HcMixesSm90" in text
    text = _lowered(lambda *a: hc_pre(*a, **STATIC, mixes_implementation="xla"), *args)
    assert "HcMixesSm90" not in text


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("rows, dim", [(1, 4096), (8, 4096), (129, 4096), (1000, 4096),
                                       (4096, 4096), (300, 256), (4096, 7168)])
def test_cute_matches_the_float64_formula(rows, dim):
    """Within a few f32 roundings of each mix's sum of |products| (the X6 dot's bound), and
    the same bits on a second call."""
    x, fn = _inputs(rows, dim, seed=rows + dim)
    f = jax.jit(lambda a, b: hc_stream_mixes(a, b, norm_eps=NORM_EPS, implementation="cute"))
    got, again = f(x, fn), f(x, fn)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(again))
    want, bound = _float64(x, fn)
    assert np.max(np.abs(np.asarray(got, np.float64) - want) / bound) < 2 ** -20


@pytest.mark.gpu
def test_hc_pre_chain_with_the_kernel_matches_it_without():
    """A 4096-token prefill sub-block's mHC pre: the gates and the normalised input with the
    mixes kernel against the chain on XLA's dot (the same mixes up to summation order)."""
    x, fn = _inputs(4096, 4096, seed=5)
    rng = np.random.default_rng(5)
    args = (x, fn, jnp.asarray(rng.random(3) + 0.5, jnp.float32),
            jnp.asarray(rng.standard_normal(24) * 0.5, jnp.float32),
            jnp.asarray(1 + 0.1 * rng.standard_normal(4096), jnp.bfloat16))
    got = jax.jit(lambda *a: hc_pre(*a, **STATIC, mixes_implementation="cute"))(*args)
    want = jax.jit(lambda *a: hc_pre(*a, **STATIC, mixes_implementation="xla"))(*args)
    for name, g, w, tol in zip(("out", "post", "comb"), got, want, (1e-2, 1e-5, 1e-5)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=tol, atol=tol, err_msg=name)
