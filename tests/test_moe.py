"""The routed-experts op (``dsv4_jax.ffi.moe``): the reference is the pre-op model arithmetic bit
for bit, out-of-range ids, bad input, dispatch; one test body runs over every implementation
(``"cute"`` on the GPU against the reference, real DSV4-Flash/Pro dims included)."""
import functools
import itertools
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import moe_cases
from dsv4_jax import quant
from dsv4_jax.ffi import cases
from dsv4_jax.ffi import moe as op
from dsv4_jax.ffi.moe_sm90 import moe_support
from dsv4_jax.ffi.policy import GroupedGemmPolicy
from dsv4_jax.kernels.grouped_gemm_config import WARP_ROWS_PER_EXPERT
from dsv4_jax.models import moe

HIGHEST = jax.lax.Precision.HIGHEST
LIMIT = 10.0


# ----------------------------------------------------------------------------- pre-op formulas
def _pre_op_expert_rows(xa, ea, wa, params, simulate, quantized, limit):
    """Frozen copy of ``models/moe.py``'s ``expert_rows`` before the op existed (commit
    4e6140e): the numbers the op's reference must reproduce bit for bit."""
    dt = xa.dtype

    def operands(x, w):
        if quantized and simulate:
            return quant.act_quant_dequant(x).astype(jnp.bfloat16), w.astype(jnp.bfloat16)
        if x.dtype == jnp.bfloat16:
            return x, w.astype(jnp.bfloat16)
        return x.astype(jnp.float32), w.astype(jnp.float32)

    def dequant(weight, scale):
        if scale is None:
            return weight
        f = quant.dequant_fp4_weight if weight.dtype in (jnp.int8, jnp.uint8) else \
            quant.dequant_fp8_weight
        return f(weight, scale).astype(dt)

    def swiglu(gate, up):
        gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
        return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)

    def dot_rows(x, w):
        a, b = operands(x, w)
        return jnp.einsum("ad,aod->ao", a, b, preferred_element_type=jnp.float32,
                          precision=HIGHEST).astype(dt)

    def dot_grouped(x, w, sizes):
        a, b = operands(x, w)
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([1], [2]), ([], [])),
            lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        return jax.lax.ragged_dot_general(a, b, sizes, dims, precision=HIGHEST,
                                          preferred_element_type=jnp.float32).astype(dt)

    n_exp = params["w1"][0].shape[0]
    if xa.shape[0] < n_exp:
        def w(name):
            weight, scale = params[name]
            return dequant(weight[ea], None if scale is None else scale[ea])
        h = swiglu(dot_rows(xa, w("w1")), dot_rows(xa, w("w3")))
        return dot_rows((wa[:, None] * h).astype(dt), w("w2"))
    order = jnp.argsort(ea, stable=True)
    sizes = jnp.bincount(ea, length=n_exp).astype(jnp.int32)
    deq = {n: dequant(*params[n]) for n in ("w1", "w2", "w3")}
    xs = xa[order]
    h = swiglu(dot_grouped(xs, deq["w1"], sizes), dot_grouped(xs, deq["w3"], sizes))
    out = dot_grouped((wa[order][:, None] * h).astype(dt), deq["w2"], sizes)
    return jnp.zeros_like(out).at[order].set(out)


@functools.lru_cache(maxsize=None)
def _weights(fmt, seed=0):
    return {n: (jnp.asarray(w), None if s is None else jnp.asarray(s))
            for n, (w, s) in moe_cases.expert_weights(fmt, seed).items()}


def _rows(fmt, tokens):
    x, idx, w = moe_cases.routing(tokens)
    t = jnp.repeat(jnp.arange(tokens), idx.shape[1])
    dt = jnp.float32 if fmt == "f32" else jnp.bfloat16
    return jnp.asarray(x, dt)[t], jnp.asarray(idx).reshape(-1), jnp.asarray(w).reshape(-1)


def _kwargs(fmt, simulate):
    return dict(swiglu_limit=LIMIT, quantized=fmt in ("fp4", "fp8"), simulate=simulate)


def _call_rows(fmt, simulate, xa, ea, wa, impl="xla"):
    p = _weights(fmt)
    return op.moe_expert_rows(xa, ea, wa, p["w1"], p["w3"], p["w2"], **_kwargs(fmt, simulate),
                              implementation=impl)


CASES = [(f, s, t) for f in moe_cases.FORMATS for s in (True, False) for t in moe_cases.TOKENS
         if s or f in ("fp4", "fp8")]


@pytest.mark.parametrize("fmt, simulate, tokens", CASES)
def test_reference_equals_the_pre_op_formulas_bitwise(fmt, simulate, tokens):
    """2 tokens (4 rows < 8 experts): gather schedule; 11 tokens (22 rows): grouped."""
    xa, ea, wa = _rows(fmt, tokens)
    _weights(fmt)                                 # cached outside the traces
    got = jax.jit(lambda *a: _call_rows(fmt, simulate, *a))(xa, ea, wa)
    want = jax.jit(lambda *a: _pre_op_expert_rows(
        *a, _weights(fmt), simulate, fmt in ("fp4", "fp8"), LIMIT))(xa, ea, wa)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert got.dtype == xa.dtype and got.shape == xa.shape


def test_model_routed_experts_equal_the_outputs_saved_before_the_op():
    """``tests/data/moe_routed_experts.npz`` was written by the pre-op ``routed_experts``
    (``python tests/moe_cases.py`` at commit 4e6140e, x86-64 CPU, jax 0.10.2). Bitwise on that
    setup; a CPU whose GEMMs sum in another order may differ by an ulp, hence the tolerance."""
    golden = np.load(moe_cases.GOLDEN)
    got = moe_cases.model_outputs(moe.routed_experts, jit=True)
    assert sorted(got) == sorted(golden.files)
    for name, value in got.items():
        want = golden[name]
        tol = 1e-6 if name.startswith("f32") else 2.0 ** -8
        np.testing.assert_allclose(value, want, rtol=tol, atol=tol * np.abs(want).mean(),
                                   err_msg=name)


@pytest.mark.parametrize("tokens", moe_cases.TOKENS)
def test_out_of_range_ids_are_dropped_inside_jit(tokens):
    fmt = "fp4"
    p = _weights(fmt)
    x, idx, w = moe_cases.routing(tokens)
    bad = idx.copy()
    bad[0, 0], bad[-1, 1] = -1, moe_cases.E + 3              # dropped assignments
    f = jax.jit(lambda x, i, w: op.moe_experts(x, i, w, p["w1"], p["w3"], p["w2"],
                                               **_kwargs(fmt, True)))
    xj = jnp.asarray(x, jnp.bfloat16)
    got = f(xj, jnp.asarray(bad), jnp.asarray(w))
    # Same as keeping those assignments with weight 0 (their rows are then exactly 0).
    w0 = w.copy()
    w0[0, 0] = w0[-1, 1] = 0.0
    want = f(xj, jnp.asarray(idx), jnp.asarray(w0))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.all(np.isfinite(np.asarray(got)))
    rows = jax.jit(lambda *a: _call_rows(fmt, True, *a))(
        xj[:2], jnp.array([-1, moe_cases.E], jnp.int32), jnp.ones((2,), jnp.float32))
    np.testing.assert_array_equal(np.asarray(rows, np.float32), 0.0)


def test_concrete_out_of_range_ids_raise():
    p = _weights("fp4")
    x, idx, w = moe_cases.routing(2)
    idx[1, 0] = moe_cases.E
    with pytest.raises(ValueError, match=r"expert id 8 outside \[0, 8\)"):
        op.moe_experts(jnp.asarray(x, jnp.bfloat16), jnp.asarray(idx), jnp.asarray(w),
                       p["w1"], p["w3"], p["w2"], **_kwargs("fp4", True))
    xa, ea, wa = _rows("fp4", 2)
    with pytest.raises(ValueError, match=r"expert id -1 outside"):
        _call_rows("fp4", True, xa, ea.at[0].set(-1), wa)


def _bad(**change):
    """Valid FP4 token-form arguments with some replaced (``None`` values given explicitly)."""
    p = _weights("fp4")
    x, idx, w = moe_cases.routing(3)
    args = dict(x=jnp.asarray(x, jnp.bfloat16), idx=jnp.asarray(idx), w=jnp.asarray(w),
                w1=p["w1"], w3=p["w3"], w2=p["w2"])
    args.update(change)
    return args


P4, P8, PB = _weights("fp4"), _weights("fp8"), _weights("bf16")
BAD_INPUTS = [
    (dict(x=jnp.zeros((1, 3, 256), jnp.bfloat16)), ValueError, r"x must be \[rows, d\]"),
    (dict(x=jnp.zeros((3, 256), jnp.int32)), TypeError, "x must be bf16 or f32"),
    (dict(idx=jnp.zeros((3, 2), jnp.float32)), TypeError, "expert ids must be int32"),
    (dict(idx=jnp.zeros((4, 2), jnp.int32), w=jnp.zeros((4, 2))), ValueError,
     r"expert ids must be \[T=3, k\]"),
    (dict(w=jnp.zeros((3, 3))), ValueError, r"routing weights must be \[T, k\]"),
    (dict(w=jnp.zeros((3, 2), jnp.int32)), TypeError, "routing weights must be floating"),
    (dict(w1=P4["w1"][0]), ValueError, r"w1 must be a \(weight \[E, out, in\], scale\) pair"),
    (dict(w1=(P4["w1"][0], None)), ValueError, "w1 is FP4 .* needs its E8M0 scale"),
    (dict(w2=(PB["w2"][0], P4["w2"][1])), ValueError, "w2 is plain bfloat16 and takes no scale"),
    (dict(w1=(P4["w1"][0].astype(jnp.int16), P4["w1"][1])), TypeError,
     "w1 must be packed FP4"),
    (dict(w3=(P4["w3"][0], P4["w3"][1][:, :, :4])), ValueError,
     r"w3 scale must be \[8, 128, 8\] for FP4"),
    (dict(w1=P8["w1"], w3=(P8["w3"][0], P8["w3"][1][:, :, :1]), w2=P8["w2"]), ValueError,
     r"w3 scale must be \[8, 1, 2\] for FP8"),
    (dict(w3=(P4["w3"][0], P4["w3"][1].astype(jnp.bfloat16))), TypeError,
     "w3 scale must be E8M0"),
    (dict(w3=(P4["w3"][0][:, :64], P4["w3"][1][:, :64])), ValueError,
     r"w3 weight must be \[E=8, 128, 128\]"),
    (dict(x=jnp.zeros((3, 128), jnp.bfloat16)), ValueError, r"w1 weight must be \[E=8, 128, 64\]"),
    (dict(w2=(P4["w2"][0][:4], P4["w2"][1][:4])), ValueError, r"w2 weight must be \[E=8, d=256"),
    (dict(w2=P8["w2"]), TypeError, "w1, w3, w2 must share one format, got fp4, fp4, fp8"),
    (dict(idx=jnp.zeros((3, 9), jnp.int32), w=jnp.zeros((3, 9))), ValueError,
     "k=9 experts per token > E=8"),
]


@pytest.mark.parametrize("change, error, message", BAD_INPUTS)
def test_bad_input_names_the_argument(change, error, message):
    a = _bad(**change)
    with pytest.raises(error, match=message):
        op.moe_experts(a["x"], a["idx"], a["w"], a["w1"], a["w3"], a["w2"],
                       **_kwargs("fp4", True))


def test_row_form_checks_its_weights_too():
    xa, ea, wa = _rows("fp4", 2)
    with pytest.raises(ValueError, match=r"routing weights must be \[A\]"):
        _call_rows("fp4", True, xa, ea, wa[:3])


def test_dispatch_on_cpu():
    xa, ea, wa = _rows("fp4", 2)
    with pytest.raises(ValueError, match="implementation must be"):
        _call_rows("fp4", True, xa, ea, wa, impl="triton")
    def support(x, fmt):
        return moe_support(x.shape[0], jnp.dtype(x.dtype).name,
                           *(_weights(fmt)[n] for n in ("w1", "w3", "w2")), simulate=True,
                           policy=None)
    ok, reason = support(xa, "fp4")
    if ok:   # tiny FP4 dims are within the kernel's limits: explicit cute needs the GPU
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            _call_rows("fp4", True, xa, ea, wa, impl="cute")
    f32 = _rows("f32", 2)
    ok32, why = support(f32[0], "f32")
    assert not ok32 and why
    # Default on CPU: the reference.
    np.testing.assert_array_equal(np.asarray(_call_rows("fp4", True, xa, ea, wa, impl=None)),
                                  np.asarray(_call_rows("fp4", True, xa, ea, wa)))


def test_cpu_default_path_does_not_import_cutlass():
    code = ("import sys, jax.numpy as jnp\n"
            "from dsv4_jax.ffi import moe_experts\n"
            "w = (jnp.zeros((4, 128, 64), jnp.int8), jnp.ones((4, 128, 4), jnp.uint8))\n"
            "w2 = (jnp.zeros((4, 128, 64), jnp.int8), jnp.ones((4, 128, 4), jnp.uint8))\n"
            "y = moe_experts(jnp.ones((2, 128), jnp.bfloat16), jnp.zeros((2, 2), jnp.int32),\n"
            "    jnp.ones((2, 2), jnp.float32), w, w, w2, swiglu_limit=10.0, quantized=True,\n"
            "    simulate=True)\n"
            "assert y.shape == (2, 128)\n"
            "assert not any(m == 'cutlass' or m.startswith('cutlass.') for m in sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ----------------------------------------------------------------------------- every implementation
# Cases by name from dsv4_jax.ffi.cases: dims "tiny" (CPU runs of the XLA path), "small"
# (the smallest GPU case), "flash" and "pro" (Config.flash() / Config.pro()).
DIMS = cases.DIMS


def check_implementation(impl, dims, fmt, t, routing, simulate=True, policy=None):
    """Shared body: the op with ``impl`` (and ``policy``, a ``GroupedGemmPolicy``) vs the
    reference on the case ``dims-fmt-t-routing`` (``cases.moe_case``)."""
    case = cases.moe_case(dims, fmt, t, routing, simulate=simulate)
    f = cases.moe_experts_jit(impl, case.kw, policy)
    got = f(*case.args)
    again = f(*case.args)
    want = cases.moe_reference_chunked(*case.args, **case.kw)
    assert got.shape == case.x.shape and got.dtype == jnp.float32
    # Finite, repeatable bit for bit (so fully written), relative error under 1e-2.
    cases.check_against_reference(got, want, 1e-2, again=again)
    if routing == "dropped":                     # a token with every assignment dropped is 0
        dead = np.all(np.asarray(case.idx) < 0, axis=1)
        np.testing.assert_array_equal(np.asarray(got)[dead], 0.0)


# The dims each implementation runs the shared cases at (the ``implementation`` fixture,
# tests/conftest.py): the reference on CPU at tiny dims, the kernel at the smallest GPU dims.
IMPLEMENTATION_DIMS = {"xla": "tiny", "cute": "small"}


@pytest.mark.parametrize("fmt, t, routing", [
    ("fp4", 1, "random"), ("fp8", 3, "dropped"), ("bf16", 8, "few_experts"),
    ("fp4", 64, "one_expert")])
def test_every_implementation(implementation, fmt, t, routing):
    check_implementation(implementation, IMPLEMENTATION_DIMS[implementation], fmt, t, routing)


GPU_CASES = ([("small", f, t, r) for f in ("fp4", "fp8", "bf16") for t in (1, 3, 8, 64, 4096)
              for r in ("random", "dropped")]
             + [("small", f, t, r) for f in ("fp4", "fp8", "bf16") for t in (8, 4096)
                for r in ("one_expert", "few_experts")]
             + [("flash", f, t, r) for f in ("fp4", "fp8") for t, r in itertools.product(
                 (1, 3, 8, 64, 4096), ("random", "one_expert"))]
             + [("flash", "bf16", t, "random") for t in (8, 4096)]
             # Either side of choose_config's crossovers (16 and 40 rows per expert):
             # 12 and 24 (Flash T = 512, 1024), 32 (small T = 128: 64-row WGMMA tiles).
             + [("flash", f, t, "random") for f in ("fp4", "fp8") for t in (512, 1024)]
             + [("small", f, 128, "random") for f in ("fp4", "fp8", "bf16")]
             + [("pro", f, t, r) for f in ("fp4", "fp8") for t, r in itertools.product(
                 (1, 8, 64, 4096), ("random", "few_experts"))])


@pytest.mark.gpu
@pytest.mark.parametrize("dims, fmt, t, routing", GPU_CASES)
def test_cute_matches_the_reference(dims, fmt, t, routing):
    check_implementation("cute", dims, fmt, t, routing)


@pytest.mark.gpu
@pytest.mark.parametrize("dims, fmt", [("flash", "fp4"), ("flash", "fp8")])
def test_cute_matches_the_reference_without_simulation(dims, fmt):
    check_implementation("cute", dims, fmt, 64, "random", simulate=False)


# "wgmma_fp8" prefill tiles (FP8 WGMMAs, opt-in): run alone with -k wgmma_fp8.
PREFILL_FP8_CASES = ([("small", f, t, r) for f in ("fp4", "fp8") for t in (64, 4096)
                      for r in ("random", "dropped")]
                     + [("small", "fp4", 4096, "one_expert"), ("small", "fp8", 512, "few_experts")]
                     + [("flash", f, 4096, "random") for f in ("fp4", "fp8")]
                     + [("pro", "fp4", 4096, "random")])


@pytest.mark.gpu
@pytest.mark.parametrize("dims, fmt, t, routing", PREFILL_FP8_CASES)
def test_wgmma_fp8_prefill_matches_the_reference(dims, fmt, t, routing):
    e, _, _, k = DIMS[dims]
    assert t * (1 if routing == "one_expert" else k) > 4 * e, "not a prefill-size case"
    check_implementation("cute", dims, fmt, t, routing,
                         policy=GroupedGemmPolicy(prefill_algorithm="wgmma_fp8"))


# The two-math-warpgroup prefill kernels: "wgmma_coop" (bf16 WGMMAs, 128 weight rows per
# CTA; -k "wgmma_coop") and "wgmma_fp8_coop" (FP8 WGMMAs, the warpgroups convert; -k fp8_coop).
PREFILL_COOP_CASES = ([("small", f, t, r) for f in ("fp4", "fp8") for t in (128, 512, 4096)
                       for r in ("random", "dropped")]
                      + [("small", "fp4", 4096, "one_expert"),
                         ("small", "fp8", 512, "few_experts")]
                      + [("flash", f, 4096, "random") for f in ("fp4", "fp8")]
                      + [("flash", "fp4", 16384, "skewed"), ("pro", "fp4", 4096, "random")])


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["wgmma_coop", "wgmma_fp8_coop"])
@pytest.mark.parametrize("dims, fmt, t, routing", PREFILL_COOP_CASES)
def test_coop_prefill_matches_the_reference(dims, fmt, t, routing, algorithm):
    e, _, _, k = DIMS[dims]
    assert t * (1 if routing == "one_expert" else k) > 16 * e, "not a prefill-size case"
    check_implementation("cute", dims, fmt, t, routing,
                         policy=GroupedGemmPolicy(prefill_algorithm=algorithm))


@pytest.mark.gpu
@pytest.mark.parametrize("dims, fmt, t, routing", [
    ("small", "fp4", 4096, "dropped"), ("flash", "fp4", 4096, "random"),
    ("flash", "fp8", 512, "few_experts"), ("pro", "fp4", 4096, "skewed")])
def test_wgmma_fp8_coop_equals_wgmma_fp8_bit_for_bit(dims, fmt, t, routing):
    """Both kernels run the same conversion, the same WGMMA chain per K block and the same
    promotion order; only who converts and how many rows a CTA holds differ."""
    case = cases.moe_case(dims, fmt, t, routing)
    got = cases.moe_experts_jit("cute", case.kw, GroupedGemmPolicy(
        prefill_algorithm="wgmma_fp8_coop"))(*case.args)
    want = cases.moe_experts_jit("cute", case.kw, GroupedGemmPolicy(
        prefill_algorithm="wgmma_fp8"))(*case.args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.gpu
def test_wgmma_coop_prefill_without_simulation_matches_the_reference():
    check_implementation("cute", "flash", "fp4", 4096, "random", simulate=False,
                         policy=GroupedGemmPolicy(prefill_algorithm="wgmma_coop"))


# The K split of the decode kernels (opt-in): T = 1-2 on the warp algorithms.
@pytest.mark.gpu
@pytest.mark.parametrize("dims, fmt, t, algorithm", [
    (d, f, t, a) for d in ("small", "flash") for f in ("fp4", "fp8") for t in (1, 2)
    for a in ("mma_fp8", "mma_sync", "mma_fp8_stream", "wgmma_rs")]
    + [("pro", "fp4", 1, "mma_fp8"), ("small", "bf16", 1, "")])
def test_k_split_matches_the_reference(dims, fmt, t, algorithm):
    policy = GroupedGemmPolicy(split_k=4, **({"decode_algorithm": algorithm} if algorithm
                                             else {}))
    check_implementation("cute", dims, fmt, t, "random", policy=policy)


# Decode-size inputs only (rows <= WARP_ROWS_PER_EXPERT E), where the decode algorithm
# applies: the default ("auto" for FP4/FP8 weights: "wgmma_rs", K split for 17-128 rows where
# K splits -- Flash and Pro --, else "mma_fp8" for the gated launch of more than AUTO_MAX_ROWS
# rows; "mma_sync" for BF16) on more token counts and
# routings than GPU_CASES, and the others ("mma_fp8", "mma_sync", "mma_fp8_stream" and
# "wgmma_rs" for FP4/FP8 in both launches; "wgmma": the prefill kernel with 8-row tiles, kept
# selectable) on fewer. Narrow with -k (e.g. "small", "mma_sync", "wgmma").
DECODE_CASES = ([("small", f, t, r, "") for f in ("fp4", "fp8", "bf16") for t in (1, 3, 8, 16)
                 for r in ("random", "dropped", "few_experts")]
                + [("small", f, 64, "one_expert", "") for f in ("fp4", "fp8", "bf16")]
                # Flash/Pro at T = 1, 8, 64 with the default: GPU_CASES (simulating) and the
                # test without simulation; here T = 170 (4 rows per expert; GPU_CASES has
                # Flash T = 512, 12 per expert, with the default).
                + [("flash", f, 170, r, "") for f in ("fp4", "fp8")
                   for r in ("random", "one_expert")]
                + [("small", f, t, r, "mma_fp8") for f in ("fp4", "fp8") for t in (1, 8)
                   for r in ("random", "dropped")]
                + [("flash", f, t, "random", "mma_fp8") for f in ("fp4", "fp8") for t in (1, 8)]
                + [("small", f, t, r, "mma_sync") for f in ("fp4", "fp8") for t in (1, 3, 8, 16)
                   for r in ("random", "dropped")]
                + [("small", f, 64, "one_expert", "mma_sync") for f in ("fp4", "fp8")]
                + [("flash", f, t, "random", "mma_sync") for f in ("fp4", "fp8") for t in (1, 8, 64)]
                + [("pro", "fp4", 8, "random", "mma_sync")]
                + [("small", f, t, r, "mma_fp8_stream") for f in ("fp4", "fp8")
                   for t in (1, 3, 8, 16) for r in ("random", "dropped")]
                + [("flash", f, t, "random", "mma_fp8_stream") for f in ("fp4", "fp8")
                   for t in (1, 8, 64)]
                + [("pro", "fp4", 8, "random", "mma_fp8_stream")]
                + [("small", f, t, r, "wgmma_rs") for f in ("fp4", "fp8")
                   for t in (1, 3, 8, 16) for r in ("random", "dropped")]
                + [("small", f, 64, "one_expert", "wgmma_rs") for f in ("fp4", "fp8")]
                + [("flash", f, t, "random", "wgmma_rs") for f in ("fp4", "fp8")
                   for t in (1, 8, 64)]
                + [("pro", "fp4", 8, "random", "wgmma_rs")]
                + [("small", f, t, r, "wgmma") for f in ("fp4", "fp8", "bf16") for t in (3, 8)
                   for r in ("random", "dropped")]
                + [("flash", f, 8, "random", "wgmma") for f in ("fp4", "fp8")])


@pytest.mark.gpu
@pytest.mark.parametrize("dims, fmt, t, routing, algorithm", DECODE_CASES)
def test_decode_kernels_match_the_reference(dims, fmt, t, routing, algorithm):
    e, _, _, k = DIMS[dims]
    rows = t * (1 if routing == "one_expert" else k)
    assert rows <= WARP_ROWS_PER_EXPERT * e, "not a decode-size case: the prefill kernel would run"
    policy = GroupedGemmPolicy(decode_algorithm=algorithm) if algorithm else None  # "": default
    check_implementation("cute", dims, fmt, t, routing, policy=policy)
    check_implementation("cute", dims, fmt, t, routing, simulate=False, policy=policy)
