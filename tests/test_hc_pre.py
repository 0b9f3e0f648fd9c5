"""The fused mHC pre op (``dsv4_jax.ffi.hc_pre``): the reference against an independent float64
formula, the op's XLA chain, bad input, the kernel's support rules and its sm_90a compile on
CPU, and -- on the GPU -- the kernel against the reference."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import np_reference as ref
from dsv4_jax.ffi import hc_pre, hc_pre_reference
from dsv4_jax.ffi.ffn_sum import FfnSum
from dsv4_jax.ffi.hc_pre_reference import BF16_X6_MIN_ROWS, hc_post, stream_mixes
from dsv4_jax.kernels.hc_pre_config import MAX_TOKENS, HcPreSm90Config, choose_config

N, ITERS, HC_EPS, NORM_EPS = 4, 20, 1e-6, 1e-6
STATIC = dict(n=N, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)


def _inputs(tokens, dim, seed=0, n=N, dtype=jnp.bfloat16):
    """Streams of unequal scale (the mixes see their RMS), weights of the model's init scale."""
    rng = np.random.default_rng(seed)
    mixes = (2 + n) * n
    x = rng.standard_normal((tokens, n, dim)) * rng.uniform(0.5, 4.0, (tokens, n, 1))
    fn = rng.standard_normal((mixes, n * dim)) * (n * dim) ** -0.5
    return (jnp.asarray(x, dtype), jnp.asarray(fn, jnp.float32),
            jnp.asarray(rng.random(3) + 0.5, jnp.float32),
            jnp.asarray(rng.standard_normal(mixes) * 0.5, jnp.float32),
            jnp.asarray(1 + 0.1 * rng.standard_normal(dim), jnp.bfloat16))


def _float64(x, fn, scale, base, weight, n=N):
    """The contract in float64 (the collapse not rounded): out, post, comb per token."""
    x64 = np.asarray(x, np.float64)
    outs, posts, combs = [], [], []
    for row in x64:
        flat = row.reshape(-1)
        mix = (np.asarray(fn, np.float64) @ flat) / np.sqrt(np.mean(flat * flat) + NORM_EPS)
        pre, post, comb = ref.sinkhorn(mix, np.asarray(scale, np.float64),
                                       np.asarray(base, np.float64), n=n, iters=ITERS,
                                       eps=HC_EPS)
        outs.append(ref.rms_norm(pre @ row, weight, NORM_EPS))
        posts.append(post)
        combs.append(comb)
    return np.stack(outs), np.stack(posts), np.stack(combs)


def test_reference_matches_the_float64_formula():
    args = _inputs(5, 64, dtype=jnp.float32)
    out, post, comb = jax.jit(lambda *a: hc_pre_reference(*a, **STATIC))(*args)
    want = _float64(*args)
    np.testing.assert_allclose(out, want[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(post, want[1], rtol=1e-5)
    np.testing.assert_allclose(comb, want[2], rtol=1e-4, atol=1e-6)


def _mixes_hlo(dtype, platform, rows=BF16_X6_MIN_ROWS):
    x = jax.ShapeDtypeStruct((rows, N, 256), dtype)
    fn = jax.ShapeDtypeStruct(((2 + N) * N, N * 256), jnp.float32)
    return jax.jit(lambda a, b: stream_mixes(a, b, NORM_EPS)).trace(
        x, fn).lower(lowering_platforms=(platform,)).as_text()


def test_stream_mixes_of_bf16_streams_run_the_bf16x6_dot_on_gpus():
    """bf16 streams of ``BF16_X6_MIN_ROWS`` rows lowered for a GPU: one dot, XLA's
    BF16_BF16_F32_X6 algorithm (fn split into three bf16 parts inside the GEMM; no f32
    GEMM); fewer rows, f32 streams and CPUs keep the f32 GEMM at HIGHEST precision."""
    gpu = _mixes_hlo(jnp.bfloat16, "cuda")
    assert gpu.count("stablehlo.dot_general") == 1
    assert ("lhs_precision_type = bf16, rhs_precision_type = bf16, accumulation_type = f32"
            in gpu and "num_primitive_operations = 6" in gpu), gpu
    for text in (_mixes_hlo(jnp.float32, "cuda"), _mixes_hlo(jnp.bfloat16, "cpu"),
                 _mixes_hlo(jnp.bfloat16, "cuda", BF16_X6_MIN_ROWS - 1)):
        assert "num_primitive_operations" not in text
        assert "HIGHEST" in text


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 255, 256, 1000, 4096])
def test_stream_mixes_on_the_gpu_match_the_float64_formula(tokens):
    """The GPU's mixes of bf16 streams (the f32 GEMM below ``BF16_X6_MIN_ROWS`` rows, the
    BF16_BF16_F32_X6 dot from there) against float64: within a few f32 roundings of each
    mix's sum of |products| (the f32 GEMM's own error bound)."""
    x, fn = _inputs(tokens, 4096, seed=tokens)[:2]
    got = np.asarray(jax.jit(lambda a, b: stream_mixes(a, b, NORM_EPS))(x, fn),
                     np.float64)
    flat, fn64 = np.asarray(x, np.float64).reshape(tokens, -1), np.asarray(fn, np.float64)
    rsqrt = 1 / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + NORM_EPS)
    want = flat @ fn64.T * rsqrt
    bound = np.abs(flat) @ np.abs(fn64).T * rsqrt
    assert np.max(np.abs(got - want) / bound) < 2 ** -20


def test_leading_dims_and_the_xla_chain_on_cpu():
    """The op (its XLA chain, the split as its own op) equals the reference bit for bit."""
    x, fn, scale, base, weight = _inputs(6, 64)
    got = hc_pre(x.reshape(2, 3, N, 64), fn, scale, base, weight, **STATIC)
    want = hc_pre_reference(x, fn, scale, base, weight, **STATIC)
    assert got[0].shape == (2, 3, 64) and got[0].dtype == jnp.bfloat16
    assert got[1].shape == (2, 3, N) and got[2].shape == (2, 3, N, N)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g).reshape(np.asarray(w).shape), w)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        hc_pre(x, fn, scale, base, weight, **STATIC, implementation="cute")


def _pending(tokens, dim, seed=1, n=N, dtype=jnp.bfloat16):
    """A previous sub-block's output, post gates in (0, 2) and a doubly-stochastic-like comb."""
    rng = np.random.default_rng(seed)
    comb = rng.random((tokens, n, n)) + 0.1
    return (jnp.asarray(rng.standard_normal((tokens, dim)) * 2, dtype),
            jnp.asarray(2 * rng.random((tokens, n)), jnp.float32),
            jnp.asarray(comb / comb.sum(-1, keepdims=True), jnp.float32))


def _ffn_sum(tokens, dim, k, seed=0, shared=None):
    """An ``FfnSum`` of bf16 rows in a shuffled order, the last row dropped (its bytes NaN:
    they must count as +0)."""
    rng = np.random.default_rng(seed)
    a = tokens * k
    order = rng.permutation(a)
    rows = rng.standard_normal((a, dim)) * 3
    rows[order[-1]] = np.nan
    valid = np.ones(a, bool)
    valid[order[-1]] = False
    if shared is None:
        shared = jnp.asarray(rng.standard_normal((tokens, dim)), jnp.bfloat16)
    return FfnSum(jnp.asarray(rows, jnp.bfloat16), jnp.asarray(order, jnp.int32),
                  jnp.asarray(valid), shared, k)


def test_a_pending_ffn_sum_is_its_total():
    """A pending out given as an ``FfnSum`` is its ``total()`` -- the routed rows of each
    token in expert order, a dropped row as +0, then the shared row, in f32 -- bit for bit,
    in the reference and the op's chain."""
    x, fn, scale, base, weight = _inputs(6, 64)
    _, post, comb = _pending(6, 64)
    parts = _ffn_sum(6, 64, 3, seed=2)
    rows = np.where(np.asarray(parts.valid)[:, None], np.asarray(parts.rows, np.float32), 0)
    per_token = rows[np.asarray(parts.position)].reshape(6, 3, 64)
    total = (per_token[:, 0] + per_token[:, 1]) + per_token[:, 2]
    total = jnp.asarray(total + np.asarray(parts.shared, np.float32)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(parts.total(), total)
    want = hc_pre_reference(x, fn, scale, base, weight, total, post, comb, **STATIC)
    for got in (hc_pre_reference(x, fn, scale, base, weight, parts, post, comb, **STATIC),
                hc_pre(x, fn, scale, base, weight, **STATIC, pending=(parts, post, comb))):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_a_bad_ffn_sum_names_the_part():
    x, fn, scale, base, weight = _inputs(6, 64)
    _, post, comb = _pending(6, 64)
    parts = _ffn_sum(6, 64, 3)
    short = FfnSum(parts.rows[:-1], parts.position, parts.valid, parts.shared, 3)
    with pytest.raises(ValueError, match=r"FfnSum rows must be \[18, 64\] for shared of "
                                         r"shape \(6, 64\) and k = 3; it has shape \(17, 64\)"):
        hc_pre(x, fn, scale, base, weight, **STATIC, pending=(short, post, comb))
    ints = FfnSum(parts.rows, parts.position, parts.valid.astype(jnp.int32), parts.shared, 3)
    with pytest.raises(TypeError, match="FfnSum position must be int32 and valid bool"):
        hc_pre(x, fn, scale, base, weight, **STATIC, pending=(ints, post, comb))


def test_pending_is_hc_post_then_the_pre():
    """With ``pending`` the op is the previous sub-block's hc_post followed by the pre, bit
    for bit, and returns the updated streams fourth (the reference and the op's chain)."""
    x, fn, scale, base, weight = _inputs(6, 64)
    pending = _pending(6, 64)
    x_new = hc_post(*pending[:1], x, *pending[1:])
    want = hc_pre_reference(x_new, fn, scale, base, weight, **STATIC)
    for got in (hc_pre_reference(x, fn, scale, base, weight, *pending, **STATIC),
                hc_pre(x, fn, scale, base, weight, **STATIC, pending=pending)):
        assert len(got) == 4
        for g, w in zip(got, want + (x_new,)):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("pending, error, message", [
    ((jnp.zeros((6, 63), jnp.bfloat16),) + _pending(6, 64)[1:], ValueError,
     r"pending out must be \[6, 64\] for x of shape \(6, 4, 64\); it has shape \(6, 63\)"),
    (_pending(6, 64)[:2] + (jnp.zeros((6, 4)),), ValueError, r"pending comb must be \[6, 4, 4\]"),
    ((jnp.zeros((6, 64)),) + _pending(6, 64)[1:], TypeError,
     "pending out must have x's dtype bfloat16"),
    (_pending(6, 64)[:2], TypeError, "pending must be"),
])
def test_bad_pending_names_the_argument(pending, error, message):
    x, fn, scale, base, weight = _inputs(6, 64)
    with pytest.raises(error, match=message):
        hc_pre(x, fn, scale, base, weight, **STATIC, pending=pending)


@pytest.mark.parametrize("change, error, message", [
    (dict(x=jnp.zeros((2, 3, 64))), ValueError, r"x must be \[\.\.\., n = 4, d\]; x has shape "
                                                r"\(2, 3, 64\)"),
    (dict(x=jnp.zeros((2, 4, 64), jnp.int32)), TypeError, "x must be floating"),
    (dict(fn=jnp.zeros((24, 255))), ValueError, r"fn must be \[\(2 \+ n\) n = 24, n d = 256\]"),
    (dict(scale=jnp.zeros((2,))), ValueError, r"scale must be \[3\]"),
    (dict(base=jnp.zeros((23,))), ValueError, r"base must be \[24\]"),
    (dict(weight=jnp.zeros((63,))), ValueError, r"weight must be \[d = 64\]"),
    (dict(iters=0), ValueError, "iters must be a positive int, got 0"),
])
def test_bad_input_names_the_argument(change, error, message):
    x, fn, scale, base, weight = _inputs(2, 64)
    args = dict(x=x, fn=fn, scale=scale, base=base, weight=weight, iters=ITERS) | change
    with pytest.raises(error, match=message):
        hc_pre(args["x"], args["fn"], args["scale"], args["base"], args["weight"], n=N,
               iters=args["iters"], hc_eps=HC_EPS, norm_eps=NORM_EPS)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(x_dtype="float32"), "x of dtype float32"),
    (dict(fn_dtype="bfloat16"), "fn of dtype bfloat16"),
    (dict(n=6), "n = 6 streams"),
    (dict(dim=4100), "dim = 4100"),
    (dict(tokens=MAX_TOKENS + 1), f"{MAX_TOKENS + 1} tokens"),
])
def test_support_names_what_the_kernel_does_not_take(kwargs, reason):
    supported = dict(n=N, dim=4096, tokens=8, x_dtype="bfloat16", fn_dtype="float32",
                     weight_dtype="bfloat16")
    assert HcPreSm90Config().is_supported(**supported) == (True, "")
    ok, why = HcPreSm90Config().is_supported(**(supported | kwargs))
    assert not ok and reason in why, why


def test_config_rejects_what_it_cannot_launch():
    with pytest.raises(ValueError, match=r"cluster must be one of \(1, 2, 4, 8, 16\), got 3"):
        HcPreSm90Config(cluster=3)
    with pytest.raises(ValueError, match=r"tokens_per_cluster must be in \[1, 4\], got 5"):
        HcPreSm90Config(tokens_per_cluster=5)
    with pytest.raises(TypeError, match="split_apart must be a bool, got int"):
        HcPreSm90Config(split_apart=1)
    assert [HcPreSm90Config().tokens_for(t) for t in (1, 3, 8)] == [1, 3, 4]


def test_choose_config_aims_at_64_ctas():
    """16-CTA clusters for one or two groups of 4 tokens, smaller ones as groups add up
    (never below 2), and only sizes that split the columns in 4-column units."""
    got = {t: choose_config(t, 4096) for t in (1, 8, 16, 64, 128)}
    assert {t: (c.cluster, c.tokens_per_cluster) for t, c in got.items()} == {
        1: (16, 4), 8: (16, 4), 16: (16, 4), 64: (4, 4), 128: (2, 4)}
    assert choose_config(1, 7168).cluster == 16 and choose_config(1, 72).cluster == 2
    assert choose_config(1, 66).cluster == 1
    # A pending hc_post: groups of 2 tokens, and the 4-token config is refused.
    assert choose_config(8, 4096, pending=True) == HcPreSm90Config(16, 2)
    assert choose_config(64, 4096, pending=True) == HcPreSm90Config(2, 2)
    # One cluster's tokens (2 with a pending hc_post, else 4): the split apart.
    assert choose_config(2, 4096, pending=True) == HcPreSm90Config(16, 2, split_apart=True)
    assert [choose_config(t, 4096).split_apart for t in (1, 4, 5)] == [True, True, False]
    ok, why = HcPreSm90Config(16, 4).is_supported(
        n=N, dim=4096, tokens=8, x_dtype="bfloat16", fn_dtype="float32",
        weight_dtype="bfloat16", pending=True)
    assert not ok and "tokens_per_cluster = 4 with a pending hc_post" in why, why


def _compile_ptx(dim, tokens, cluster=8, pending=False, summed_k=0, split_apart=False):
    pytest.importorskip("cutlass")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    from dsv4_jax.kernels import hc_pre_sm90 as kernel
    mixes = (2 + N) * N
    f32 = lambda s: make_fake_compact_tensor(cutlass.Float32, s, assumed_align=16)  # noqa
    bf16 = lambda s: make_fake_compact_tensor(cutlass.BFloat16, s, assumed_align=16)  # noqa
    i32 = lambda s: make_fake_compact_tensor(cutlass.Int32, s, assumed_align=16)  # noqa
    rows = lambda dtype, shape: dtype(shape if pending else (4,))  # noqa: E731
    parts = lambda dtype, shape: dtype(shape if summed_k else (4,))  # noqa: E731
    compiled = cute.compile(
        kernel.hc_pre_launcher, make_fake_stream(), bf16((tokens, N * dim)),
        f32((mixes, N * dim)), f32((3,)), f32((mixes,)), bf16((dim,)),
        rows(bf16, (tokens, dim)), rows(f32, (tokens, N)), rows(f32, (tokens, N * N)),
        parts(bf16, (tokens * summed_k, dim)), parts(i32, (tokens * summed_k,)),
        parts(i32, (tokens * summed_k,)),
        bf16((tokens, dim)), f32((4,) if split_apart else (tokens, N)),
        f32((4,) if split_apart else (tokens, N * N)), rows(bf16, (tokens, N * dim)),
        f32((tokens, mixes) if split_apart else (4,)), n=N, dim=dim, tokens=tokens,
        iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, pending=pending, summed_k=summed_k,
        cluster=cluster, tokens_per_cluster=2 if pending else 4, split_apart=split_apart)
    return compiled.artifacts.PTX


@pytest.mark.parametrize("dim, tokens", [(4096, 1), (4096, 8), (7168, 5)])
def test_kernel_compiles_for_sm90a(dim, tokens):
    """Flash (one pass of 256 threads covers half a CTA's K slice) and Pro (a partial last
    pass) dims: every thread's mixing-weight loads are float4 and issued per pass; the sums
    cross the warp by butterfly shuffles and the cluster through distributed shared memory
    (twice: the mixes, the norm);
    post and comb stored once, out once per pass of 4 columns; nothing in local memory."""
    ptx = _compile_ptx(dim, tokens)
    tb = min(tokens, 4)
    passes = -(-(N * dim // 8 // 4) // 256)
    assert ".target sm_90a" in ptx and ".local" not in ptx
    assert ptx.count("griddepcontrol.launch_dependents") == 1   # at its start (PDL)
    assert ptx.count("ld.global.nc.L1::no_allocate.v4.f32") == passes * (2 + N) * N
    padded = -(-tb * ((2 + N) * N + 1) // 32) * 32
    # Reduce-scatter: padded / 2 + padded / 4 + ... over five lane bits; then 5 per token
    # for the norm's sum of squares.
    assert ptx.count("shfl.sync.bfly") == sum(padded >> s for s in range(1, 6)) + 5 * tb
    assert ptx.count("ld.shared::cluster.f32") == 2 * 8
    collapse_threads = 32 * (8 - -(-tb // 2))       # the last warps run the split
    out_passes = -(-(tb * dim // 8 // 4) // collapse_threads)
    assert ptx.count("st.global") == 2 + out_passes


def test_kernel_with_the_split_apart_compiles_for_sm90a():
    """``split_apart``: the mixes are stored once (no post and comb: no Sinkhorn chain, no
    reciprocal), every warp collapses (one pass of 256 threads over the CTA's columns), the
    loads and exchanges are the fused kernel's; nothing in local memory."""
    ptx = str(_compile_ptx(4096, 8, cluster=16, pending=True, summed_k=6, split_apart=True))
    fused = _compile_ptx(4096, 8, cluster=16, pending=True, summed_k=6)
    assert ".target sm_90a" in ptx and ".local" not in ptx
    # The Sinkhorn chain (its lanes' shfl.idx gathers and reciprocals) is not in it.
    for op in ("shfl.sync.idx", "rcp.rn.f32"):
        assert 10 * ptx.count(op) < fused.count(op), op
    # x_new of 2 tokens, the mixes, out.
    assert ptx.count("st.global") == 2 + 1 + 1
    for op in ("ld.global.nc.v2.b32", "ld.global.nc.L1::no_allocate.v4.f32",
               "ld.shared::cluster.f32"):
        assert ptx.count(op) == fused.count(op), op


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, pending, cluster", [(1, True, 16), (8, True, 16),
                                                      (3, False, 4), (64, True, 2)])
def test_cute_with_the_split_apart_equals_it_fused(tokens, pending, cluster):
    """The split as a launch of its own on the stored mixes gives the fused kernel's
    outputs bit for bit (the same values through the same ``split_lanes``)."""
    from dsv4_jax.ffi import hc_pre_sm90
    dim = 4096
    args = _inputs(tokens, dim, seed=tokens)
    extra = _pending(tokens, dim, seed=tokens) if pending else ()
    if pending:
        extra = (_ffn_sum(tokens, dim, 6, seed=tokens, shared=extra[0]),) + extra[1:]
    outs = []
    for apart in (True, False):
        config = HcPreSm90Config(cluster, 2, split_apart=apart)
        outs.append(jax.jit(lambda a, p, c=config: hc_pre_sm90.hc_pre_cute(
            *a, *p, **STATIC, config=c))(args, extra))
    assert len(outs[0]) == (4 if pending else 3)
    for g, w in zip(*outs):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.gpu
@pytest.mark.parametrize("dim, tokens, cluster, per_cluster", [
    (4096, 1, 16, 4), (4096, 2, 8, 4), (4096, 8, 16, 4), (4096, 64, 4, 4), (4096, 128, 2, 4),
    (4096, 7, 4, 3), (4096, 5, 1, 1), (7168, 5, 8, 4), (7168, 64, 4, 4), (512, 3, 2, 2)])
def test_cute_matches_the_reference(dim, tokens, cluster, per_cluster):
    """post and comb to a few f32 ulps; the bf16 outputs equal but for rare one-ulp
    roundings (the sums' order differs from XLA's)."""
    from dsv4_jax.ffi import hc_pre_sm90
    args = _inputs(tokens, dim, seed=tokens + dim)
    config = HcPreSm90Config(cluster, per_cluster)
    got = jax.jit(lambda *a: hc_pre_sm90.hc_pre_cute(*a, **STATIC, config=config))(*args)
    want = jax.jit(lambda *a: hc_pre_reference(*a, **STATIC))(*args)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-4, atol=1e-6)
    g, w = (np.asarray(a, np.float32) for a in (got[0], want[0]))
    np.testing.assert_allclose(g, w, rtol=2 ** -7, atol=1e-2)
    assert np.mean(g != w) < 0.01, np.mean(g != w)


def test_kernel_with_a_pending_update_compiles_for_sm90a():
    """The pending hc_post: each K element's mix pass loads the n streams and the output
    (bf16x4) and stores the updated element once; the collapse recomputes its columns'
    streams the same way; nothing in local memory."""
    ptx = _compile_ptx(4096, 8, cluster=16, pending=True)
    assert ".target sm_90a" in ptx and ".local" not in ptx
    # Mix pass: 2 tokens x (4 streams + out); collapse: 4 streams + out; the norm weight.
    assert ptx.count("ld.global.nc.v2.b32") == 2 * (N + 1) + (N + 1) + 1
    # x_new of 2 tokens, post, comb, out.
    assert ptx.count("st.global") == 2 + 2 + 1


def test_kernel_with_a_pending_ffn_sum_compiles_for_sm90a():
    """A pending out given as its parts (``FfnSum``, k = 6): where the out row was loaded,
    the shared row and the k routed rows are (each with its position and validity), added
    in registers; the stores and the rest unchanged; nothing in local memory."""
    k = 6
    ptx = _compile_ptx(4096, 8, cluster=16, pending=True, summed_k=k)
    assert ".target sm_90a" in ptx and ".local" not in ptx
    # Mix pass: 2 tokens x (4 streams + shared + k rows); collapse: the same once; the norm
    # weight.
    assert ptx.count("ld.global.nc.v2.b32") == 2 * (N + 1 + k) + (N + 1 + k) + 1
    assert ptx.count("st.global") == 2 + 2 + 1


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, k, cluster", [(1, 6, 16), (8, 6, 16), (5, 3, 4)])
def test_cute_with_a_pending_ffn_sum_equals_it_summed(tokens, k, cluster):
    """The kernel given a pending ``FfnSum`` (rows in a shuffled order, a dropped row)
    returns exactly what it returns given the sum, ``FfnSum.total()``: it adds the parts in
    the same order (every output equal bit for bit)."""
    from dsv4_jax.ffi import hc_pre_sm90
    dim = 4096
    args = _inputs(tokens, dim, seed=tokens + k)
    out, post, comb = _pending(tokens, dim, seed=tokens)
    parts = _ffn_sum(tokens, dim, k, seed=tokens, shared=out)
    config = HcPreSm90Config(cluster, 2)
    run = jax.jit(lambda a, p: hc_pre_sm90.hc_pre_cute(*a, *p, **STATIC, config=config))
    got = run(args, (parts, post, comb))
    want = run(args, (parts.total(), post, comb))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.gpu
@pytest.mark.parametrize("dim, tokens, cluster", [(4096, 1, 16), (4096, 8, 16), (4096, 5, 4),
                                                  (7168, 3, 8), (4096, 64, 2), (512, 2, 1)])
def test_cute_with_a_pending_update_matches_the_reference(dim, tokens, cluster):
    """x_new equal to hc_post's but for rare one-ulp roundings (its n-term sum runs in
    another order than XLA's); the rest as without pending, from the kernel's x_new (a
    one-ulp x_new moves the mixes by ~1e-5 relative, so they are checked from it)."""
    from dsv4_jax.ffi import hc_pre_sm90
    args = _inputs(tokens, dim, seed=tokens + dim)
    pending = _pending(tokens, dim, seed=tokens)
    config = HcPreSm90Config(cluster, 2)
    got = jax.jit(lambda *a: hc_pre_sm90.hc_pre_cute(*a, **STATIC, config=config))(
        *args, *pending)
    g, w = (np.asarray(a, np.float32) for a in (got[3], hc_post(pending[0], args[0],
                                                                   *pending[1:])))
    np.testing.assert_allclose(g, w, rtol=2 ** -7, atol=1e-2)
    assert np.mean(g != w) < 0.01, np.mean(g != w)
    want = jax.jit(lambda *a: hc_pre_reference(*a, **STATIC))(got[3], *args[1:])
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-4, atol=1e-6)
    g, w = (np.asarray(a, np.float32) for a in (got[0], want[0]))
    np.testing.assert_allclose(g, w, rtol=2 ** -7, atol=1e-2)
    assert np.mean(g != w) < 0.01, np.mean(g != w)


@pytest.mark.gpu
def test_op_dispatches_decode_sizes_to_the_kernel():
    """implementation=None: the kernel's result for decode sizes (its one launch in the
    lowering), the XLA chain past MAX_TOKENS."""
    args = _inputs(8, 4096, seed=3)
    lowered = jax.jit(lambda *a: hc_pre(*a, **STATIC)).lower(*args).as_text()
    assert "HcPreSm90" in lowered
    got = jax.jit(lambda *a: hc_pre(*a, **STATIC))(*args)
    want = jax.jit(lambda *a: hc_pre(*a, **STATIC, implementation="cute"))(*args)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    big = _inputs(MAX_TOKENS + 1, 512, seed=4)
    assert "HcPreSm90" not in jax.jit(lambda *a: hc_pre(*a, **STATIC)).lower(*big).as_text()
