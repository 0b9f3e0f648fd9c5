"""Two linears of one input as one op (``dsv4_jax.ffi.grouped_gemm_pair``): the reference is
the two grouped GEMMs bit for bit, bad input names ``w_next``, the decode lowering is one
launch (two with ``pair_linears=False`` or at prefill sizes), and -- on the GPU -- the paired
launch against the reference at the model's shapes (``wq_a`` + ``wkv``, ``wq_b`` + the
indexer's ``wq_b``), FP4 and ragged groups included."""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax import quant
from dsv4_jax.ffi import (grouped_gemm, grouped_gemm_pair, grouped_gemm_pair_reference,
                          grouped_gemm_reference)
from dsv4_jax.ffi import dispatch
from dsv4_jax.ffi.policy import GroupedGemmPolicy

_LAUNCH = re.compile(r"call @call_wrapper(_\d+)?\(")


def _weight(seed, fmt, groups, n, k):
    w = jax.random.normal(jax.random.key(seed), (groups, n, k), jnp.float32) * k ** -0.5
    return quant.quantize_fp8_weight(w) if fmt == "fp8" else quant.quantize_fp4_weight(w)


def _rows(seed, rows, k):
    return jax.random.normal(jax.random.key(seed), (rows, k), jnp.float32).astype(jnp.bfloat16)


def _f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


@pytest.mark.parametrize("fmt, groups, ids, simulate", [
    ("fp8", 1, None, True), ("fp8", 2, None, False), ("fp4", 3, [0, 2, 1, 1, -1, 2], True)])
def test_reference_is_the_two_grouped_gemms(fmt, groups, ids, simulate):
    x = _rows(1, 6, 512)
    ids = None if ids is None else jnp.array(ids, jnp.int32)
    w, w_next = _weight(2, fmt, groups, 256, 512), _weight(3, fmt, groups, 128, 512)
    # Traced ids: the dropped one (-1) gives zero rows in both.
    got = jax.jit(lambda x, i: grouped_gemm_pair(x, i, w, w_next, simulate=simulate))(x, ids)
    for y, m in zip(got, (w, w_next)):
        want = jax.jit(lambda x, i: grouped_gemm_reference(x, i, m, simulate=simulate))(x, ids)
        np.testing.assert_array_equal(_f64(y), _f64(want))
        assert y.shape == want.shape and y.dtype == x.dtype


W = _weight(4, "fp8", 2, 256, 512)
BAD = [
    (dict(w_next=W[0]), ValueError, r"w_next must be a \(weight \[G, N_next, K\], scale\)"),
    (dict(w_next=_weight(5, "fp8", 2, 128, 1024)), ValueError,
     r"grouped_gemm_pair: w_next weight must be \[E=2, 128, 512\]"),
    (dict(w_next=_weight(5, "fp8", 1, 128, 512)), ValueError,
     r"grouped_gemm_pair: w_next weight must be \[E=2, 128, 512\]"),
    (dict(w_next=(W[0], W[1][:, :1])), ValueError, r"w_next scale must be \[2, 2, 4\]"),
    (dict(x=jnp.zeros((3, 512), jnp.bfloat16)), ValueError, "M=3 is not a multiple of G=2"),
    (dict(ids=jnp.array([0, 1, 2, 0], jnp.int32)), ValueError,
     r"grouped_gemm_pair: group id 2 outside \[0, 2\)"),
]


@pytest.mark.parametrize("change, error, message", BAD)
def test_bad_input_names_the_argument(change, error, message):
    args = dict(x=jnp.zeros((4, 512), jnp.bfloat16), ids=None, w=W,
                w_next=_weight(5, "fp8", 2, 128, 512))
    args.update(change)
    with pytest.raises(error, match=message):
        grouped_gemm_pair(args["x"], args["ids"], args["w"], args["w_next"], simulate=True)


def _lowered_launches(rows, policy):
    x = jax.ShapeDtypeStruct((rows, 4096), jnp.bfloat16)
    w, w_next = _weight(6, "fp8", 1, 1024, 4096), _weight(7, "fp8", 1, 512, 4096)
    f = jax.jit(lambda x, w, v: grouped_gemm_pair(x, None, w, v, simulate=True, policy=policy))
    with dispatch.cuda_target():
        text = f.trace(x, w, w_next).lower(lowering_platforms=("cuda",)).as_text()
    return len(_LAUNCH.findall(text))


@pytest.mark.parametrize("rows, policy, launches", [
    (1, GroupedGemmPolicy(), 1), (8, GroupedGemmPolicy(), 1),
    (8, GroupedGemmPolicy(pair_linears=False), 2), (512, GroupedGemmPolicy(), 2)])
def test_decode_pairs_lower_to_one_launch(rows, policy, launches):
    """The warp kernels take the pair; prefill tiles (WGMMA) and ``pair_linears=False`` run a
    launch per weight."""
    assert _lowered_launches(rows, policy) == launches


def test_pair_linears_must_be_a_bool():
    with pytest.raises(TypeError, match="pair_linears must be a bool"):
        GroupedGemmPolicy(pair_linears=1)


# ----------------------------------------------------------------------------- GPU
def _rel_err(got, want):
    got, want = _f64(got), _f64(want)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


# name: (fmt, groups, N, N_next, K)
GPU_PAIRS = {"wq_a+wkv": ("fp8", 1, 1024, 512, 4096),
             "wq_b+indexer_wq_b": ("fp8", 1, 32768, 8192, 1024),
             "fp4_experts": ("fp4", 4, 2048, 512, 4096)}
GPU_CASES = [(name, t, True) for name in GPU_PAIRS for t in (1, 8)] + [
    (name, t, False) for name in GPU_PAIRS for t in (3, 16)] + [
    ("wq_a+wkv", 64, True), ("wq_a+wkv", 512, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("name, tokens, simulate", GPU_CASES)
def test_cute_pair_matches_the_reference(name, tokens, simulate):
    fmt, groups, n, n_next, k = GPU_PAIRS[name]
    w, w_next = _weight(8, fmt, groups, n, k), _weight(9, fmt, groups, n_next, k)
    x = _rows(tokens, tokens * groups, k)
    ids = None
    if groups > 1:         # ragged: rows in any order, one dropped
        ids = jax.random.randint(jax.random.key(tokens), (tokens * groups,), 0, groups)
        ids = ids.at[0].set(-1).astype(jnp.int32)
    f = jax.jit(lambda x, i, w, v: grouped_gemm_pair(x, i, w, v, simulate=simulate,
                                                     implementation="cute"))
    got, again = f(x, ids, w, w_next), f(x, ids, w, w_next)
    want = grouped_gemm_pair_reference(x, ids, w, w_next, simulate=simulate)
    single = [jax.jit(lambda x, i, m: grouped_gemm(x, i, m, simulate=simulate,
                                                   implementation="cute"))(x, ids, m)
              for m in (w, w_next)]
    for y, y2, ref, one in zip(got, again, want, single):
        assert y.shape == ref.shape and np.all(np.isfinite(_f64(y)))
        np.testing.assert_array_equal(_f64(y), _f64(y2))      # repeatable, fully written
        assert _rel_err(y, ref) < 1e-2, _rel_err(y, ref)
        # The paired launch and a launch per weight differ only in the f32 sum order.
        assert _rel_err(y, one) < 2e-3, _rel_err(y, one)
    if ids is not None:
        np.testing.assert_array_equal(_f64(got[0][0]), 0.0)  # the dropped row
