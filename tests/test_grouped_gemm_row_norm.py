"""The grouped GEMM's ``row_norm`` (an RMSNorm before the linear, ``wq_b`` after ``q_norm``):
the reference is the GEMM of ``rms_norm``'s rows bit for bit, bad input names ``row_norm``,
under ``row_norm_in_kernel`` a decode launch normalises its rows itself (no XLA norm in the
lowering; prefill sizes and the default policy keep XLA's), both token-quantising kernels
compile with it for sm_90a, and -- on the GPU -- the kernel against the reference and
against itself on XLA-normed rows at the model's shapes."""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax import quant
from dsv4_jax.ffi import dispatch, grouped_gemm, grouped_gemm_pair, grouped_gemm_reference
from dsv4_jax.ffi.norm import rms_norm
from dsv4_jax.ffi.policy import GroupedGemmPolicy
from dsv4_jax.kernels import grouped_gemm_config as support

EPS = 1e-6
IN_KERNEL = GroupedGemmPolicy(row_norm_in_kernel=True)
_LAUNCH = re.compile(r"call @call_wrapper(_\d+)?\(")


def _weight(seed, fmt, groups, n, k):
    w = jax.random.normal(jax.random.key(seed), (groups, n, k), jnp.float32) * k ** -0.5
    return quant.quantize_fp8_weight(w) if fmt == "fp8" else quant.quantize_fp4_weight(w)


def _rows(seed, rows, k, spread=1.0):
    """Rows of unequal scales (the norm matters): row i times spread^(i / rows)."""
    x = jax.random.normal(jax.random.key(seed), (rows, k), jnp.float32)
    return (x * spread ** (jnp.arange(rows)[:, None] / rows) * 3.0).astype(jnp.bfloat16)


def _norm_weight(seed, k):
    return (1.0 + 0.5 * jax.random.normal(jax.random.key(seed), (k,))).astype(jnp.bfloat16)


def _f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


@pytest.mark.parametrize("ids", [None, [0, 2, 1, 1, -1, 2]])
def test_reference_is_the_gemm_of_the_normed_rows(ids):
    groups = 1 if ids is None else 3
    x, g = _rows(1, 6, 512, spread=50.0), _norm_weight(2, 512)
    ids = None if ids is None else jnp.array(ids, jnp.int32)
    w, w_next = _weight(3, "fp8", groups, 256, 512), _weight(4, "fp8", groups, 128, 512)
    normed = rms_norm(x, g, EPS)
    got = jax.jit(lambda x, g, i: grouped_gemm(x, i, w, simulate=True, row_norm=(g, EPS)))(
        x, g, ids)
    want = jax.jit(lambda x, i: grouped_gemm_reference(x, i, w, simulate=True))(normed, ids)
    np.testing.assert_array_equal(_f64(got), _f64(want))
    pair = jax.jit(lambda x, g, i: grouped_gemm_pair(x, i, w, w_next, simulate=True,
                                                     row_norm=(g, EPS)))(x, g, ids)
    for y, m in zip(pair, (w, w_next)):
        want = jax.jit(lambda x, i: grouped_gemm_reference(x, i, m, simulate=True))(normed, ids)
        np.testing.assert_array_equal(_f64(y), _f64(want))


W = _weight(5, "fp8", 1, 256, 512)
BAD = [
    (jnp.ones((512,), jnp.bfloat16), TypeError, r"row_norm must be None or a \(weight \[K\], "
     r"eps\) pair, got ArrayImpl"),
    ((jnp.ones((256,), jnp.bfloat16), EPS), ValueError,
     r"row_norm weight must be floating \[K=512\]; row_norm weight has shape \(256,\)"),
    ((jnp.ones((512,), jnp.int32), EPS), ValueError, r"row_norm weight must be floating"),
    ((jnp.ones((512,), jnp.bfloat16), -1.0), TypeError, r"row_norm eps must be a Python float "
     r">= 0 \(static\), got -1.0"),
    ((jnp.ones((512,), jnp.bfloat16), jnp.float32(1e-6)), TypeError, r"row_norm eps must be"),
]


@pytest.mark.parametrize("row_norm, error, message", BAD)
def test_bad_row_norm_names_the_argument(row_norm, error, message):
    x = jnp.zeros((4, 512), jnp.bfloat16)
    with pytest.raises(error, match=message):
        grouped_gemm(x, None, W, simulate=True, row_norm=row_norm)
    with pytest.raises(error, match=message.replace("grouped_gemm", "grouped_gemm_pair")):
        grouped_gemm_pair(x, None, W, W, simulate=True, row_norm=row_norm)


def test_config_takes_the_norm_only_where_the_kernel_quantises():
    ok = support.GroupedGemmSm90Config(algorithm="wgmma_rs", token_stages=3, row_norm_eps=EPS)
    assert ok.smem_bytes("fp8", False) == support.GroupedGemmSm90Config(
        algorithm="wgmma_rs", token_stages=3).smem_bytes("fp8", False) + 4 * support.WARP_TOKENS
    for bad in (dict(algorithm="mma_sync"), dict(algorithm="wgmma_rs", token_codes=True),
                dict(algorithm="mma_fp8", row_norm_eps=1)):
        with pytest.raises(ValueError, match="row_norm_eps must be None or a float"):
            support.GroupedGemmSm90Config(**{"row_norm_eps": EPS, **bad})


def test_row_norm_in_kernel_must_be_a_bool():
    with pytest.raises(TypeError, match="row_norm_in_kernel must be a bool"):
        GroupedGemmPolicy(row_norm_in_kernel=1)


def _lowered(rows, pair, policy=IN_KERNEL):
    x = jax.ShapeDtypeStruct((rows, 1024), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((1024,), jnp.bfloat16)
    w, w_next = _weight(6, "fp8", 1, 4096, 1024), _weight(7, "fp8", 1, 1024, 1024)
    if pair:
        f = jax.jit(lambda x, g: grouped_gemm_pair(x, None, w, w_next, simulate=True,
                                                   row_norm=(g, EPS), policy=policy))
    else:
        f = jax.jit(lambda x, g: grouped_gemm(x, None, w, simulate=True, row_norm=(g, EPS),
                                              policy=policy))
    with dispatch.cuda_target():
        return f.trace(x, g).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("rows, pair, in_kernel", [(1, True, True), (8, True, True),
                                                   (1, False, True), (64, False, True),
                                                   (512, True, False), (512, False, False)])
def test_decode_launches_normalise_their_rows(rows, pair, in_kernel):
    """At decode the token-quantising kernels take the norm: one launch and no rsqrt of
    XLA's; prefill tiles (codes quantised by XLA) keep XLA's norm before their launches."""
    pytest.importorskip("cutlass")
    text = _lowered(rows, pair)
    assert ("rsqrt" not in text) == in_kernel
    launches = 1 if pair and rows < 512 else 2 if pair else 1
    assert len(_LAUNCH.findall(text)) == launches
    default = _lowered(rows, pair, GroupedGemmPolicy())        # XLA's norm, same launches
    assert "rsqrt" in default and len(_LAUNCH.findall(default)) == launches


@pytest.mark.parametrize("algorithm, split", [("wgmma_rs", 1), ("mma_fp8", 2)])
def test_norm_kernels_compile_for_sm90a(algorithm, split):
    """The norm's pass: 8 K blocks' row loads in flight at once (kept in L1), 64 FMAs of
    squares, the half warp's sum by 4 shuffles, one rsqrt and a CTA barrier more; every
    quantised block first multiplied by its inverse RMS and the weight (2 f32 products a
    value) and rounded to bf16."""
    pytest.importorskip("cutlass")
    from grouped_gemm_compile import compile_variant
    plain = support.choose_config(1, 1, "fp8", decode_algorithm=algorithm, split_k=split)
    normed = support.GroupedGemmSm90Config(
        block_n=8, num_stages=plain.num_stages, algorithm=algorithm, split_k=split,
        token_stages=plain.token_stages, row_norm_eps=EPS)
    ptx = {name: compile_variant("fp8", False, c, a=1, k=1024, n=4096, e=1).artifacts.PTX
           for name, c in (("plain", plain), ("normed", normed))}
    count = {name: {op: len(re.findall(pattern, text)) for op, pattern in (
        ("rsqrt", r"rsqrt\.approx\.f32"), ("bar", r"bar\.sync"), ("fma", r"fma\.rn\.f32 "),
        ("cvt", r"cvt\.rn\.bf16x2\.f32"), ("l1_loads", r"ld\.global\.nc\.v4\.b32"))}
        for name, text in ptx.items()}
    passes = plain.token_stages              # the prologue's passes and the loop's
    assert count["normed"]["rsqrt"] == count["plain"]["rsqrt"] + 1
    assert count["normed"]["bar"] == count["plain"]["bar"] + 1
    assert count["normed"]["cvt"] == count["plain"]["cvt"] + 4 * passes
    assert count["normed"]["fma"] >= count["plain"]["fma"] + 64
    # 8 blocks of the norm's pass, and the weight's words with every block of x.
    assert count["normed"]["l1_loads"] == count["plain"]["l1_loads"] + 8 + passes + 1


# ----------------------------------------------------------------------------- GPU
def _rel_err(got, want):
    got, want = _f64(got), _f64(want)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


# name: (N, N_next or 0, K): wq_b after q_norm, alone (SWA / HCA layers) and with the
# indexer's wq_b (CSA layers), Flash dims; a small K of 4 blocks (a partial norm pass).
GPU_SHAPES = {"wq_b": (32768, 0, 1024), "wq_b+indexer_wq_b": (32768, 8192, 1024),
              "small": (512, 256, 512)}
GPU_CASES = [(name, t, "auto") for name in ("wq_b", "wq_b+indexer_wq_b") for t in (1, 8)] + [
    ("wq_b+indexer_wq_b", 3, "mma_fp8"), ("small", 3, "auto"), ("small", 8, "mma_fp8"),
    ("wq_b", 16, "auto"), ("small", 64, "auto")]


@pytest.mark.gpu
@pytest.mark.parametrize("name, tokens, algorithm", GPU_CASES)
def test_cute_norm_matches_the_reference(name, tokens, algorithm):
    n, n_next, k = GPU_SHAPES[name]
    policy = GroupedGemmPolicy(decode_algorithm=algorithm, row_norm_in_kernel=True)
    w, w_next = _weight(8, "fp8", 1, n, k), _weight(9, "fp8", 1, max(n_next, 128), k)
    x, g = _rows(tokens, tokens, k, spread=100.0), _norm_weight(tokens + 1, k)

    def run(x, g, norm):
        row_norm = (g, EPS) if norm else None
        if n_next:
            return grouped_gemm_pair(x, None, w, w_next, simulate=True, row_norm=row_norm,
                                     implementation="cute", policy=policy)
        return (grouped_gemm(x, None, w, simulate=True, row_norm=row_norm,
                             implementation="cute", policy=policy),)

    f = jax.jit(lambda x, g: run(x, g, True))
    got, again = f(x, g), f(x, g)
    normed = jax.jit(rms_norm, static_argnums=2)(x, g, EPS)
    on_normed = jax.jit(lambda x: run(x, None, False))(normed)
    for i, (y, y2, ref_in) in enumerate(zip(got, again, on_normed)):
        m = w if i == 0 else w_next
        want = grouped_gemm_reference(normed, None, m, simulate=True)
        assert y.shape == want.shape and np.all(np.isfinite(_f64(y)))
        np.testing.assert_array_equal(_f64(y), _f64(y2))        # repeatable, fully written
        assert _rel_err(y, want) < 1e-2, _rel_err(y, want)
        # Against the same kernel on XLA's normed rows: only the sum of squares' order (an
        # ulp of the inverse RMS, now and then a bf16 rounding of the normed row, rarely an
        # FP8 code) differs.
        assert _rel_err(y, ref_in) < 2e-3, _rel_err(y, ref_in)
