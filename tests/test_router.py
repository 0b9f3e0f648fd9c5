"""The MoE router op (``dsv4_jax.ffi.moe_router``): the reference against an independent
float64 formula, bad input, the kernel's support rules and its sm_90a compile on CPU, and --
on the GPU -- the kernel against the float64 formula and the reference."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax.ffi import moe_router, moe_router_reference
from dsv4_jax.kernels.router_config import MAX_TOKENS, RouterSm90Config, choose_config

SCALE = 1.5


def _inputs(tokens, experts, dim, k, seed=0, dtype=jnp.bfloat16, vocab=97):
    """Gate weights of the model's init scale and inputs of unit RMS: logits ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, dim)), dtype)
    w = jnp.asarray(rng.standard_normal((experts, dim)) * dim ** -0.5, dtype)
    bias = jnp.asarray(rng.standard_normal(experts) * 0.1, jnp.float32)
    table = jnp.asarray(np.argsort(rng.random((vocab, experts)), axis=1)[:, :k], jnp.int32)
    ids = jnp.asarray(rng.integers(0, vocab, tokens), jnp.int32)
    return x, w, bias, table, ids


def _float64(x, w, bias, table, ids, k, score_func):
    """The contract in float64: (scores [T, E], biased [T, E] or None, idx, weights)."""
    logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    if score_func == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
    elif score_func == "sigmoid":
        scores = 1 / (1 + np.exp(-logits))
    else:
        scores = np.sqrt(np.logaddexp(logits, 0))
    if table is None:
        biased = scores + np.asarray(bias, np.float64)
        idx = np.argsort(-biased, axis=-1, kind="stable")[:, :k]
    else:
        biased, idx = None, np.asarray(table)[np.asarray(ids)]
    wts = np.take_along_axis(scores, idx, -1)
    if score_func != "softmax":
        wts = wts / wts.sum(-1, keepdims=True)
    return scores, biased, idx, wts * SCALE


def _clear_tokens(biased, k, margin):
    """Tokens whose k + 1 largest biased scores are all ``margin`` apart (no near-tie that
    f32 sums in another order could resolve the other way)."""
    top = -np.sort(-biased, axis=-1)[:, :k + 1]
    return np.all(np.diff(-top, axis=-1) > margin, axis=-1)


def _check(got, args, k, score_func, hashed, margin=1e-5):
    """Experts equal on every token without a near-tie; weights to a few f32 ulps of the
    float64 formula on the experts the op chose."""
    x, w, bias, table, ids = args
    scores, biased, idx, wts = _float64(x, w, bias, table if hashed else None, ids, k,
                                        score_func)
    got_w, got_idx = (np.asarray(a) for a in got)
    assert got_idx.dtype == np.int32 and got_w.dtype == np.float32
    clear = np.ones(len(idx), bool) if hashed else _clear_tokens(biased, k, margin)
    assert clear.mean() > 0.9, clear.mean()
    np.testing.assert_array_equal(got_idx[clear], idx[clear])
    # Weights of the chosen experts (the near-tie tokens included) by the formula.
    chosen = np.take_along_axis(scores, got_idx, -1)
    want = chosen / (1 if score_func == "softmax" else chosen.sum(-1, keepdims=True)) * SCALE
    np.testing.assert_allclose(got_w, want, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(got_w[clear], wts[clear], rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("hashed", [False, True])
def test_reference_matches_the_float64_formula(score_func, hashed):
    args = _inputs(9, 32, 64, 4, dtype=jnp.float32)
    x, w, bias, table, ids = args
    got = jax.jit(lambda *a: moe_router_reference(*a, k=4, score_func=score_func,
                                                  route_scale=SCALE))(
        x, w, None if hashed else bias, table if hashed else None, ids if hashed else None)
    _check(got, args, 4, score_func, hashed, margin=1e-6)


def test_top_k_ties_take_the_lower_expert_first():
    x = jnp.ones((1, 8), jnp.float32)
    w = jnp.zeros((6, 8), jnp.float32)                # every score sqrt(log 2)
    bias = jnp.asarray([0.0, 1.0, 0.0, 1.0, 0.0, 0.0], jnp.float32)
    _, idx = moe_router(x, w, bias, None, None, k=4, score_func="sqrtsoftplus",
                        route_scale=1.0)
    assert np.asarray(idx).tolist() == [[1, 3, 0, 2]]


def test_the_op_is_the_reference_on_cpu():
    args = _inputs(5, 16, 64, 2)
    x, w, bias, table, ids = args
    for routing in ((bias, None, None), (None, table, ids)):
        got = moe_router(x, w, *routing, k=2, score_func="sqrtsoftplus", route_scale=SCALE)
        want = moe_router_reference(x, w, *routing, k=2, score_func="sqrtsoftplus",
                                    route_scale=SCALE)
        for g, v in zip(got, want):
            np.testing.assert_array_equal(g, v)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        moe_router(x, w, bias, None, None, k=2, score_func="sqrtsoftplus", route_scale=SCALE,
                   implementation="cute")


@pytest.mark.parametrize("change, error, message", [
    (dict(x=jnp.zeros((2, 3, 64))), ValueError, r"x must be floating \[T, d\]; x has shape "
                                                r"\(2, 3, 64\)"),
    (dict(x=jnp.zeros((2, 64), jnp.int32)), TypeError, "x must be floating"),
    (dict(weight=jnp.zeros((16, 63))), ValueError, r"weight must be \[E, d = 64\]"),
    (dict(k=17), ValueError, r"k must be an int in \[1, E = 16\], got 17"),
    (dict(score_func="relu"), ValueError, "score_func must be one of"),
    (dict(table=jnp.zeros((5, 2), jnp.int32)), ValueError, "exactly one of bias .* got both"),
    (dict(bias=None), ValueError, "exactly one of bias .* got neither"),
    (dict(bias=jnp.zeros((15,))), ValueError, r"bias must be \[E = 16\]"),
    (dict(bias=None, table=jnp.zeros((5, 3), jnp.int32)), ValueError,
     r"table must be \[vocab, k = 2\]"),
    (dict(bias=None, table=jnp.zeros((5, 2), jnp.int32)), ValueError,
     r"token_ids must be \[T = 2\] with a table; token_ids has shape None"),
    (dict(bias=None, table=jnp.zeros((5, 2)), token_ids=jnp.zeros((2,), jnp.int32)),
     TypeError, "table must be integer"),
])
def test_bad_input_names_the_argument(change, error, message):
    args = dict(x=jnp.zeros((2, 64)), weight=jnp.zeros((16, 64)), bias=jnp.zeros((16,)),
                table=None, token_ids=None, k=2, score_func="sqrtsoftplus") | change
    with pytest.raises(error, match=message):
        moe_router(args["x"], args["weight"], args["bias"], args["table"], args["token_ids"],
                   k=args["k"], score_func=args["score_func"], route_scale=SCALE)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(x_dtype="float32"), "x of dtype float32"),
    (dict(experts=264), "E = 264 experts (a multiple of the cluster"),
    (dict(k=33), "k = 33"),
    (dict(dim=4100), "dim = 4100"),
    (dict(tokens=MAX_TOKENS + 1), f"{MAX_TOKENS + 1} tokens"),
])
def test_support_names_what_the_kernel_does_not_take(kwargs, reason):
    supported = dict(experts=256, dim=4096, tokens=8, k=6, x_dtype="bfloat16",
                     weight_dtype="bfloat16")
    assert RouterSm90Config().is_supported(**supported) == (True, "")
    ok, why = RouterSm90Config().is_supported(**(supported | kwargs))
    assert not ok and reason in why, why
    ok, why = RouterSm90Config(2, 4).is_supported(**(supported | dict(experts=512 + 32)))
    assert not ok and "at most 512" in why, why
    ok, why = RouterSm90Config(8, 2).is_supported(**supported)
    assert not ok and "64 sums per thread" in why, why
    ok, why = RouterSm90Config(16, 1).is_supported(**(supported | dict(experts=384,
                                                                       dim=7168)))
    assert not ok and "96 weight loads per thread" in why, why              # Pro


def test_config_rejects_what_it_cannot_launch_and_chooses_the_widest_cluster():
    with pytest.raises(ValueError, match=r"cluster must be one of \(1, 2, 4, 8, 16\), got 3"):
        RouterSm90Config(cluster=3)
    with pytest.raises(ValueError, match=r"tokens_per_cluster must be in \[1, 4\], got 5"):
        RouterSm90Config(tokens_per_cluster=5)
    assert choose_config(1, 256) == RouterSm90Config(16, 2)        # Flash
    assert choose_config(8, 384) == RouterSm90Config(16, 1)        # Pro: 24 experts per CTA
    assert choose_config(3, 8) == RouterSm90Config(8, 4)           # the tiny model
    assert choose_config(1, 12) == RouterSm90Config(4, 4)


def _compile_ptx(experts, dim, tokens, k, score_func="sqrtsoftplus", hashed=False):
    pytest.importorskip("cutlass")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    from dsv4_jax.kernels import router_sm90 as kernel
    config = choose_config(tokens, experts)
    fake = lambda dtype, s: make_fake_compact_tensor(dtype, s, assumed_align=16)  # noqa
    vocab = 97 if hashed else 1
    compiled = cute.compile(
        kernel.router_launcher, make_fake_stream(), fake(cutlass.BFloat16, (tokens, dim)),
        fake(cutlass.BFloat16, (experts, dim)), fake(cutlass.Float32, (experts,)),
        fake(cutlass.Int32, (vocab, k if hashed else 1)),
        fake(cutlass.Int32, (tokens if hashed else 1,)), fake(cutlass.Float32, (tokens, k)),
        fake(cutlass.Int32, (tokens, k)), experts=experts, dim=dim, tokens=tokens, k=k,
        score_func=score_func, route_scale=SCALE, hashed=hashed, vocab=vocab,
        cluster=config.cluster, tokens_per_cluster=config.tokens_per_cluster)
    return config, compiled.artifacts.PTX


@pytest.mark.parametrize("experts, dim, tokens, score_func, hashed", [
    (256, 4096, 1, "sqrtsoftplus", False), (256, 4096, 8, "sqrtsoftplus", True),
    (384, 7168, 8, "softmax", False), (8, 512, 3, "sigmoid", False)])
def test_kernel_compiles_for_sm90a(experts, dim, tokens, score_func, hashed):
    """Flash, Pro and tiny dims: one 16-byte load per expert of the CTA and per token each
    pass; the logits cross the warp by a butterfly reduce-scatter and reach CTA 0 through
    distributed shared memory (one load per expert a lane holds); the top-k is k rounds of two
    warp reductions (hash routing: none); k weights and k ids stored; nothing in local
    memory."""
    k = 6 if experts > 8 else 2
    config, ptx = _compile_ptx(experts, dim, tokens, k, score_func, hashed)
    tb, per_cta = config.tokens_for(tokens), experts // config.cluster
    passes = -(-(dim // 8) // 256)
    assert ".target sm_90a" in ptx and ".local" not in ptx
    assert ptx.count("griddepcontrol.launch_dependents") == 1   # at its start (PDL)
    assert ptx.count("ld.global.nc.L1::no_allocate.v4.b32") == passes * (per_cta + tb)
    padded = -(-tb * per_cta // 32) * 32
    softmax = 10 if score_func == "softmax" else 0      # the row's max and sum
    assert ptx.count("shfl.sync.bfly") == sum(padded >> s for s in range(1, 6)) + softmax
    assert ptx.count("redux.sync") == (0 if hashed else 2 * k)    # the key, then the expert
    assert ptx.count("ld.shared::cluster.f32") == -(-experts // 32)
    assert ptx.count("st.global") == 2 * k


@pytest.mark.gpu
@pytest.mark.parametrize("experts, dim, tokens, k, score_func, hashed, config", [
    (256, 4096, 1, 6, "sqrtsoftplus", False, None), (256, 4096, 8, 6, "sqrtsoftplus", False, None),
    (256, 4096, 8, 6, "sqrtsoftplus", True, None), (256, 4096, 13, 6, "sqrtsoftplus", False, None),
    (256, 4096, 32, 6, "sqrtsoftplus", False, None), (256, 4096, 7, 6, "softmax", False, (16, 2)),
    (256, 4096, 5, 6, "sigmoid", False, (8, 1)), (384, 7168, 8, 6, "sqrtsoftplus", False, None),
    (8, 512, 3, 2, "sqrtsoftplus", False, None), (8, 512, 6, 2, "softmax", True, (1, 4)),
    (64, 256, 4, 32, "sqrtsoftplus", False, (2, 1)),
    (256, 4104, 3, 6, "sqrtsoftplus", False, None)])
def test_cute_matches_the_float64_formula(experts, dim, tokens, k, score_func, hashed, config):
    """The experts of every token without a near-tie equal, the weights to a few f32 ulps
    (the logits' sums run in another order than XLA's)."""
    from dsv4_jax.ffi import router_sm90
    args = _inputs(tokens, experts, dim, k, seed=tokens + experts)
    x, w, bias, table, ids = args
    routing = (None, table, ids) if hashed else (bias, None, None)
    config = None if config is None else RouterSm90Config(*config)
    got = jax.jit(lambda *a: router_sm90.moe_router_cute(
        *a, k=k, score_func=score_func, route_scale=SCALE, config=config))(x, w, *routing)
    _check(got, args, k, score_func, hashed)


@pytest.mark.gpu
def test_op_dispatches_decode_sizes_to_the_kernel():
    """implementation=None: the kernel's result for decode sizes (its one launch in the
    lowering), the reference past MAX_TOKENS."""
    x, w, bias, _, _ = _inputs(8, 256, 4096, 6, seed=3)
    run = jax.jit(lambda *a: moe_router(*a, None, None, k=6, score_func="sqrtsoftplus",
                                        route_scale=SCALE))
    assert "RouterSm90" in run.lower(x, w, bias).as_text()
    got = run(x, w, bias)
    want = moe_router(x, w, bias, None, None, k=6, score_func="sqrtsoftplus",
                      route_scale=SCALE, implementation="cute")
    for g, v in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(v))
    big, _, _, _, _ = _inputs(MAX_TOKENS + 1, 256, 4096, 6, seed=4)
    assert "RouterSm90" not in run.lower(big, w, bias).as_text()
