"""The grouped-GEMM op (``dsv4_jax.ffi.grouped_gemm``): the reference against a float64 formula
of the contract in every weight format and row layout, bad input, dispatch, and -- on the GPU
-- the kernel against the reference at the DSV4 shapes the model runs through it (the dense
FP8 linears, ``wo_a``'s groups, the shared expert's gated GEMM)."""
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax import quant
from dsv4_jax.ffi import grouped_gemm, grouped_gemm_reference
from dsv4_jax.ffi.policy import GroupedGemmPolicy

LIMIT = 10.0


def _weight(key, fmt, groups, n, k):
    """Random ``(weight, scale)`` of logical shape [groups, n, k] in ``fmt`` (values ~ k^-1/2)."""
    w = jax.random.normal(key, (groups, n, k), jnp.float32) * k ** -0.5
    if fmt == "fp8":
        return quant.quantize_fp8_weight(w)
    if fmt == "fp4":
        return quant.quantize_fp4_weight(w)
    return w.astype(jnp.bfloat16 if fmt == "bf16" else jnp.float32), None


def _f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _formula(x, ids, w, w_up, rw, simulate, groups):
    """float64 products of the op's operands, rounded where the contract rounds."""
    dt = x.dtype
    xin = quant.act_quant_dequant(x) if simulate else x
    xin = _f64(xin.astype(jnp.bfloat16) if simulate else xin)
    rows = x.shape[0]
    if ids is None:
        ids = np.repeat(np.arange(groups), rows // groups)
    ids = np.asarray(ids)
    valid = (ids >= 0) & (ids < groups)

    def gemm(pair):
        wd = _f64(quant.dequant_weight(*pair, jnp.float32))
        y = np.einsum("mk,mnk->mn", xin, wd[np.where(valid, ids, 0)])
        return _f64(jnp.asarray(y, jnp.float32).astype(dt))       # rounded as the op rounds
    y = gemm(w)
    if w_up is not None:
        u = gemm(w_up)
        g = np.minimum(y, LIMIT)
        h = g / (1 + np.exp(-g)) * np.clip(u, -LIMIT, LIMIT)
        y = (1.0 if rw is None else _f64(rw)[:, None]) * h
    return np.where(valid[:, None], y, 0.0)


CASES = [  # fmt, rows, groups, ids kind, gated, simulate
    ("fp8", 5, 1, "none", False, True), ("fp8", 6, 3, "none", True, True),
    ("fp4", 4, 6, "random", True, True), ("fp4", 40, 3, "random", False, False),
    ("bf16", 9, 1, "none", True, False), ("f32", 12, 2, "random", False, False),
    ("fp8", 30, 4, "dropped", True, False),
]


@pytest.mark.parametrize("fmt, rows, groups, kind, gated, simulate", CASES)
def test_reference_matches_the_contract(fmt, rows, groups, kind, gated, simulate):
    n, k = 256, 512
    keys = jax.random.split(jax.random.key(rows * 7 + groups), 5)
    dt = jnp.float32 if fmt == "f32" else jnp.bfloat16
    x = (jax.random.normal(keys[0], (rows, k)) * 2).astype(dt)
    w = _weight(keys[1], fmt, groups, n, k)
    w_up = _weight(keys[2], fmt, groups, n, k) if gated else None
    rw = jax.random.uniform(keys[3], (rows,), jnp.float32, 0.1, 1.0) if gated else None
    ids = None
    if kind != "none":
        ids = jax.random.randint(keys[4], (rows,), 0, groups).astype(jnp.int32)
        if kind == "dropped":
            ids = ids.at[::5].set(-1)
    got = jax.jit(lambda *a: grouped_gemm_reference(
        a[0], a[1], w, w_up=w_up, row_weights=a[2], swiglu_limit=LIMIT,
        simulate=simulate))(x, ids, rw)
    want = _formula(x, ids, w, w_up, rw, simulate, groups)
    assert got.shape == (rows, n) and got.dtype == dt
    scale = np.abs(want).mean()
    tol = 2e-5 if dt == jnp.float32 else 2 ** -7
    np.testing.assert_allclose(_f64(got), want, rtol=tol, atol=tol * scale)


def test_dense_linear_is_bitwise_the_model_arithmetic():
    """One group, rows in order: the FP8 linear's einsum on exactly dequantised weights and
    FP8-simulated activations (the model's numbers before the op)."""
    x = jax.random.normal(jax.random.key(0), (3, 7, 512), jnp.float32).astype(jnp.bfloat16)
    w, s = _weight(jax.random.key(1), "fp8", 1, 384, 512)
    got = grouped_gemm(x.reshape(-1, 512), None, (w, s), simulate=True).reshape(3, 7, -1)
    xin, win = quant.gemm_operands(x, quant.dequant_fp8_weight(w[0], s[0]), True)
    want = jnp.einsum("...i,oi->...o", xin, win, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST).astype(x.dtype)
    np.testing.assert_array_equal(_f64(got), _f64(want))


def _args(**change):
    w = _weight(jax.random.key(1), "fp8", 2, 256, 512)
    args = dict(x=jnp.zeros((4, 512), jnp.bfloat16), ids=jnp.zeros((4,), jnp.int32), w=w,
                w_up=None, rw=None)
    args.update(change)
    return args


W8 = _weight(jax.random.key(1), "fp8", 2, 256, 512)
W4 = _weight(jax.random.key(1), "fp4", 2, 256, 512)
BAD = [
    (dict(x=jnp.zeros((4, 2, 512), jnp.bfloat16)), ValueError, r"x must be \[rows, K\]"),
    (dict(x=jnp.zeros((4, 512), jnp.int8)), TypeError, "x must be bf16 or f32"),
    (dict(ids=jnp.zeros((5,), jnp.int32)), ValueError, r"group_ids must be \[M=4\]"),
    (dict(ids=jnp.zeros((4,), jnp.float32)), TypeError, "group_ids must be int32"),
    (dict(ids=None, x=jnp.zeros((3, 512), jnp.bfloat16)), ValueError,
     "M=3 is not a multiple of G=2"),
    (dict(w=W8[0]), ValueError, r"w must be a \(weight \[G, N, K\], scale\) pair"),
    (dict(w=(W8[0], None)), ValueError, "w is FP8 .* needs its E8M0 scale"),
    (dict(w=(W8[0][:, :, :256], W8[1])), ValueError, r"w weight must be \[E=2, 256, 512\]"),
    (dict(w=(W8[0], W8[1][:, :1])), ValueError, r"w scale must be \[2, 2, 4\] for FP8"),
    (dict(w_up=W4), TypeError, "w and w_up must share one format, got fp8, fp4"),
    (dict(rw=jnp.ones((4,))), ValueError, "row_weights belong to the gated form"),
    (dict(w_up=W8, rw=jnp.ones((3,))), ValueError, r"row_weights must be floating \[M=4\]"),
    (dict(ids=jnp.array([0, 1, 2, 0], jnp.int32)), ValueError, r"group id 2 outside \[0, 2\)"),
]


@pytest.mark.parametrize("change, error, message", BAD)
def test_bad_input_names_the_argument(change, error, message):
    a = _args(**change)
    with pytest.raises(error, match=message):
        grouped_gemm(a["x"], a["ids"], a["w"], w_up=a["w_up"], row_weights=a["rw"],
                     simulate=True)


def test_dispatch_on_cpu():
    a = _args()
    with pytest.raises(ValueError, match="implementation must be one of"):
        grouped_gemm(a["x"], a["ids"], a["w"], simulate=True, implementation="triton")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        grouped_gemm(a["x"], a["ids"], a["w"], simulate=True, implementation="cute")
    f32 = _weight(jax.random.key(2), "f32", 2, 256, 512)          # no kernel for f32 weights
    with pytest.raises(ValueError, match="does not support weights not all in one of"):
        grouped_gemm(a["x"], a["ids"], f32, implementation="cute")
    got = grouped_gemm(a["x"], a["ids"], a["w"], simulate=True)
    want = grouped_gemm_reference(a["x"], a["ids"], a["w"], simulate=True)
    np.testing.assert_array_equal(_f64(got), _f64(want))


def test_traced_out_of_range_ids_give_zero_rows():
    x = jax.random.normal(jax.random.key(3), (4, 512), jnp.float32).astype(jnp.bfloat16)
    ids = jnp.array([0, -1, 1, 7], jnp.int32)
    y = jax.jit(lambda x, i: grouped_gemm(x, i, W8, simulate=True))(x, ids)
    np.testing.assert_array_equal(_f64(y)[[1, 3]], 0.0)
    assert np.all(np.abs(_f64(y)[[0, 2]]).sum(axis=1) > 0)


# ----------------------------------------------------------------------------- GPU
def _rel_err(got, want):
    got, want = _f64(got), _f64(want)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


@functools.lru_cache(maxsize=4)
def _flash_weight(fmt, groups, n, k, seed):
    return jax.block_until_ready(_weight(jax.random.key(seed), fmt, groups, n, k))


# The model's shapes (DSV4-Flash): dense FP8 linears (one group), wo_a (8 groups, rows in
# equal blocks, no activation simulation), the shared expert's gated GEMM and its w2.
GPU_SHAPES = {"wq_a": (1, 1024, 4096, False), "wq_b": (1, 32768, 1024, False),
              "wkv": (1, 512, 4096, False), "wo_b": (1, 4096, 8192, False),
              "wo_a": (8, 1024, 4096, False), "shared_w13": (1, 2048, 4096, True),
              "shared_w2": (1, 4096, 2048, False)}
GPU_CASES = [(name, t, fmt, sim) for name in GPU_SHAPES for t in (1, 8, 64, 512)
             for fmt, sim in (("fp8", True), ("fp8", False))
             if not (name == "wo_a" and sim)] + [
    (name, 4096, "fp8", True) for name in ("wq_b", "wo_b", "shared_w13")] + [
    ("wkv", 8, "bf16", False), ("wq_a", 64, "bf16", False)]


@pytest.mark.gpu
@pytest.mark.parametrize("name, tokens, fmt, simulate", GPU_CASES)
def test_cute_matches_the_reference(name, tokens, fmt, simulate):
    groups, n, k, gated = GPU_SHAPES[name]
    w = _flash_weight(fmt, groups, n, k, 1)
    w_up = _flash_weight(fmt, groups, n, k, 2) if gated else None
    rows = tokens * groups
    x = jax.random.normal(jax.random.key(tokens), (rows, k), jnp.float32).astype(jnp.bfloat16)
    kw = dict(swiglu_limit=LIMIT, simulate=simulate)
    f = jax.jit(lambda x, w, u: grouped_gemm(x, None, w, w_up=u, implementation="cute", **kw))
    got, again = f(x, w, w_up), f(x, w, w_up)
    want = jax.jit(lambda x, w, u: grouped_gemm_reference(x, None, w, w_up=u, **kw))(x, w, w_up)
    assert np.all(np.isfinite(_f64(got)))
    np.testing.assert_array_equal(_f64(got), _f64(again))          # repeatable, fully written
    assert _rel_err(got, want) < 1e-2, _rel_err(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("name, tokens", [("wq_b", 4096), ("wo_b", 512), ("shared_w13", 4096),
                                          ("shared_w2", 4096), ("wo_a", 512), ("wkv", 4096),
                                          ("wo_a", 2048)])
@pytest.mark.parametrize("algorithm", ["wgmma_coop", "wgmma_fp8_coop"])
def test_cute_coop_prefill_matches_the_reference(name, tokens, algorithm):
    """The dense FP8 linears at prefill sizes on the two-warpgroup kernels (wkv: 512 output
    features; wo_a multiplies bf16 rows, so "wgmma_fp8_coop" falls back to "wgmma_coop";
    "wgmma_coop" at 2048 rows per group and more, ungated: 256-row tiles)."""
    groups, n, k, gated = GPU_SHAPES[name]
    w = _flash_weight("fp8", groups, n, k, 1)
    w_up = _flash_weight("fp8", groups, n, k, 2) if gated else None
    x = jax.random.normal(jax.random.key(tokens), (tokens * groups, k),
                          jnp.float32).astype(jnp.bfloat16)
    kw = dict(swiglu_limit=LIMIT, simulate=name != "wo_a")
    policy = GroupedGemmPolicy(prefill_algorithm=algorithm)
    f = jax.jit(lambda x, w, u: grouped_gemm(x, None, w, w_up=u, implementation="cute",
                                             policy=policy, **kw))
    got, again = f(x, w, w_up), f(x, w, w_up)
    want = jax.jit(lambda x, w, u: grouped_gemm_reference(x, None, w, w_up=u, **kw))(x, w, w_up)
    np.testing.assert_array_equal(_f64(got), _f64(again))
    assert _rel_err(got, want) < 1e-2, _rel_err(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["auto", "mma_fp8", "wgmma_rs", "mma_sync", "wgmma"])
def test_cute_decode_algorithms_match_the_reference(algorithm):
    w = _flash_weight("fp8", 1, 1024, 4096, 1)
    x = jax.random.normal(jax.random.key(5), (8, 4096), jnp.float32).astype(jnp.bfloat16)
    policy = GroupedGemmPolicy(decode_algorithm=algorithm)
    got = jax.jit(lambda x, w: grouped_gemm(x, None, w, simulate=True, implementation="cute",
                                            policy=policy))(x, w)
    want = grouped_gemm_reference(x, None, w, simulate=True)
    assert _rel_err(got, want) < 1e-2
