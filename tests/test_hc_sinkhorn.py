"""The mHC split op (``dsv4_jax.ffi.hc_split_sinkhorn``): the reference against an independent
float64 formula, bad input, the kernel compiled for sm_90a on CPU, and -- on the GPU -- the
kernel against the reference."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import np_reference as ref
from dsv4_jax.ffi import hc_split_sinkhorn, hc_split_sinkhorn_reference

N, ITERS, EPS = 4, 20, 1e-6


def _inputs(tokens, seed=0, n=N):
    rng = np.random.default_rng(seed)
    mixes = (rng.standard_normal((tokens, (2 + n) * n)) * 2).astype(np.float32)
    return (jnp.asarray(mixes), jnp.asarray(rng.random(3) + 0.5, jnp.float32),
            jnp.asarray(rng.standard_normal((2 + n) * n), jnp.float32))


def test_reference_matches_the_float64_formula():
    mixes, scale, base = _inputs(7)
    pre, post, comb = jax.jit(lambda m: hc_split_sinkhorn_reference(
        m, scale, base, n=N, iters=ITERS, eps=EPS))(mixes)
    for i in range(7):
        p, q, c = ref.sinkhorn(np.asarray(mixes[i], np.float64), np.asarray(scale, np.float64),
                               np.asarray(base, np.float64))
        np.testing.assert_allclose(pre[i], p, rtol=1e-5)
        np.testing.assert_allclose(post[i], q, rtol=1e-5)
        np.testing.assert_allclose(comb[i], c, rtol=1e-4, atol=1e-6)


def test_leading_dims_and_dispatch_on_cpu():
    mixes, scale, base = _inputs(6)
    got = hc_split_sinkhorn(mixes.reshape(2, 3, -1), scale, base, n=N, iters=ITERS, eps=EPS)
    want = hc_split_sinkhorn_reference(mixes, scale, base, n=N, iters=ITERS, eps=EPS)
    assert got[2].shape == (2, 3, N, N) and got[0].shape == (2, 3, N)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g).reshape(np.asarray(w).shape), w)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        hc_split_sinkhorn(mixes, scale, base, n=N, iters=ITERS, eps=EPS,
                          implementation="cute")


@pytest.mark.parametrize("change, error, message", [
    (dict(mixes=jnp.zeros((2, 23))), ValueError, r"mixes must be \[\.\.\., \(2 \+ n\) n = 24\]"),
    (dict(mixes=jnp.zeros((2, 24), jnp.int32)), TypeError, "mixes must be floating"),
    (dict(scale=jnp.zeros((2,))), ValueError, r"scale must be \[3\]"),
    (dict(base=jnp.zeros((23,))), ValueError, r"base must be \[24\]"),
    (dict(iters=0), ValueError, "iters must be a positive int, got 0"),
])
def test_bad_input_names_the_argument(change, error, message):
    mixes, scale, base = _inputs(2)
    args = dict(mixes=mixes, scale=scale, base=base, iters=ITERS) | change
    with pytest.raises(error, match=message):
        hc_split_sinkhorn(args["mixes"], args["scale"], args["base"], n=N,
                          iters=args["iters"], eps=EPS)


@pytest.mark.parametrize("n", [4, 6])
def test_kernel_compiles_for_sm90a(n):
    """n = 4 (DSV4): the shuffle dataflow, one reciprocal per lane and normalisation; n = 6
    (n n > 32): one thread per token, one per row and column."""
    pytest.importorskip("cutlass")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    from dsv4_jax.kernels import hc_sinkhorn_sm90 as kernel
    t = cute.sym_int()
    mixes = (2 + n) * n
    f32 = lambda shape: make_fake_compact_tensor(cutlass.Float32, shape, assumed_align=16)
    compiled = cute.compile(kernel.hc_sinkhorn_launcher, make_fake_stream(), f32((t, mixes)),
                            f32((3,)), f32((mixes,)), f32((t, n)), f32((t, n)), f32((t, n * n)),
                            n=n, iters=ITERS, eps=EPS)
    ptx = compiled.artifacts.PTX
    assert ".target sm_90a" in ptx and "div.rn.f32" not in ptx
    if kernel.lanes_per_token(n) > 1:
        # Per lane: its row's and column's reciprocal per normalisation, its two gates; the
        # n elements of a row or column gathered by shuffles; one comb, pre, post store.
        assert ptx.count("rcp.rn.f32") == 2 * ITERS + 2
        assert ptx.count("shfl.sync.idx") == n * (3 + 2 * (ITERS - 1))
        assert ptx.count("st.global") == 3
    else:
        # One IEEE reciprocal per row and column of each normalisation and per gate (the
        # rest are multiplications), every output written once.
        assert ptx.count("rcp.rn.f32") == 2 * n * ITERS + 2 * n
        assert ptx.count("st.global") == 2 * n + n * n


def test_lanes_per_token():
    from dsv4_jax.kernels.hc_sinkhorn_sm90 import lanes_per_token
    assert [lanes_per_token(n) for n in range(1, 9)] == [1, 4, 16, 16, 32, 1, 1, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("n,tokens", [(4, 1), (4, 8), (4, 300), (4, 4096), (2, 37), (3, 37),
                                      (6, 37)])
def test_cute_matches_the_reference(n, tokens):
    mixes, scale, base = _inputs(tokens, seed=tokens, n=n)
    kw = dict(n=n, iters=ITERS, eps=EPS)
    got = jax.jit(lambda m: hc_split_sinkhorn(m, scale, base, implementation="cute", **kw))(mixes)
    want = jax.jit(lambda m: hc_split_sinkhorn_reference(m, scale, base, **kw))(mixes)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=1e-7)
