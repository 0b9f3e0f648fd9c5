"""sparse_attention with the query preparation (``rope=``, ``q_norm_eps=``): the reference is
the model's three passes around attention (``ffi.rope``), bad arguments are named, the
kernel takes the preparation whole or not at all, and on the GPU its prologue and epilogue
give what the same kernel gives on queries prepared by XLA, rotated back by XLA."""
import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import dsv4_jax as dj
from dsv4_jax.ffi import sparse_attention, sparse_attention_reference
from dsv4_jax.ffi.policy import KernelPolicy
from dsv4_jax.ffi.rope import head_rms_norm, rope_table, rotate_tail
from dsv4_jax.ffi.sparse_attention import (SparseAttentionSm90Config, _support,
                                           sparse_attention_cute)
from test_sparse_attention import SCALE, _check_close, make_case

EPS = 1e-6
INV_FREQ = (1.0 / 10000.0 ** (np.arange(0, 64, 2, dtype=np.float32) / 64)).astype(np.float32)


def _rope(t, seed=0):
    positions = jnp.asarray(np.random.default_rng(seed).integers(0, 70000, t), jnp.int32)
    return rope_table(positions, INV_FREQ)


def _args(c):
    return (c["q"], c["kv"], c["idx"], c["sink"])


def test_reference_is_the_models_passes_around_attention():
    """Heads' norm, RoPE, attention, inverse RoPE -- bit for bit; and not vacuous: the
    queries' and the output's RoPE channels change the result."""
    c = make_case(1, 5, 64, 40, 30, 200, 100)
    rope = _rope(5)
    got = sparse_attention_reference(*_args(c), extra_kv=c["extra_kv"],
                                     extra_idx=c["extra_idx"], rope=rope, q_norm_eps=EPS,
                                     scale=SCALE)
    q = rotate_tail(head_rms_norm(c["q"], EPS), rope[0][:, None], rope[1][:, None])
    o, lse = sparse_attention_reference(q, *_args(c)[1:], extra_kv=c["extra_kv"],
                                        extra_idx=c["extra_idx"], scale=SCALE)
    want = (rotate_tail(o, rope[0][:, None], rope[1][:, None], inverse=True), lse)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    plain = sparse_attention_reference(head_rms_norm(c["q"], EPS), *_args(c)[1:],
                                       extra_kv=c["extra_kv"], extra_idx=c["extra_idx"],
                                       scale=SCALE)
    assert not np.array_equal(np.asarray(plain[1]), np.asarray(got[1]))


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(rope="cos"), TypeError, "rope must be a (cos, sin) pair"),
    (dict(rope=(jnp.zeros((3, 32)),) * 2), ValueError, "rope cos must be [T=5, r/2]"),
    (dict(rope=(jnp.zeros((5, 32), jnp.bfloat16),) * 2), TypeError, "rope cos must be float32"),
    (dict(rope=(jnp.zeros((5, 32)), jnp.zeros((5, 16)))), ValueError,
     "rope cos and sin must have one shape"),
    (dict(q_norm_eps="1e-6"), TypeError, "q_norm_eps must be a Python float or None"),
])
def test_bad_preparation_arguments_raise_naming_them(kwargs, error, words):
    c = make_case(2, 5, 64, 16, 0, 50, 0)
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        sparse_attention(*_args(c), scale=SCALE, implementation="xla", **kwargs)


def test_the_kernel_takes_the_preparation_whole():
    c = make_case(3, 4, 64, 16, 0, 50, 0)
    rope = _rope(4)
    ok = lambda **kw: _support(*_args(c), scale=SCALE, **kw)  # noqa: E731
    assert ok(rope=rope, q_norm_eps=EPS) == (True, "")
    for kw in (dict(rope=rope), dict(q_norm_eps=EPS),
               dict(rope=(rope[0][:, :16], rope[1][:, :16]), q_norm_eps=EPS)):
        supported, why = ok(**kw)
        assert not supported and "query preparation" in why, why


@pytest.mark.parametrize("quantized", [True, False])
def test_the_model_is_the_same_bits_with_the_rope_in_the_op(quantized):
    """``KernelPolicy(attention_rope=True)`` on the references: a 4-token prefill then a
    decode step give the same logits and caches bit for bit as the passes in XLA."""
    cfg = dj.Config.tiny(quantized=quantized)
    tokens = jnp.array([[1, 2, 3, 4], [5, 6, 7, 8]], jnp.int32)
    params = dj.init_params(cfg, 0)
    results = []
    for on in (False, True):
        model = dj.DSV4(cfg, implementation=KernelPolicy(implementation="xla",
                                                         attention_rope=on))
        step = jax.jit(lambda p, t, c, m=model: m.apply({"params": p}, t, c, logits_at="last"))
        logits, cache = step(params, tokens, dj.Cache.init(cfg, 2, 64))
        logits2, cache = step(params, tokens[:, :1], cache)
        results.append(jax.tree_util.tree_leaves((logits, logits2, cache)))
    for a, b in zip(*results):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(TypeError, match="attention_rope must be a bool, got int"):
        KernelPolicy(attention_rope=1)


# ---------------------------------------------------------------------------- kernel (GPU)

Sm90 = SparseAttentionSm90Config
GPU_CASES = [  # (T, H, K, K2, N, M, config): as test_sparse_attention's GPU_CASES
    (1, 64, 128, 512, 300, 2000, Sm90()),                # Flash decode: split + combine
    (8, 64, 128, 512, 1000, 2000, Sm90()),
    (3, 128, 128, 1024, 500, 5000, Sm90(64, 2, False)),  # both head blocks
    (64, 128, 128, 1024, 9000, 70000, Sm90()),           # one wave, split QK^T
    (5, 64, 100, 300, 777, 999, Sm90(48, 3, False)),
    (130, 64, 128, 512, 20000, 20000, Sm90(64, 2, True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("t, h, k, k2, n, m, config", GPU_CASES)
def test_kernel_prepares_like_xla(t, h, k, k2, n, m, config):
    """The kernel with the preparation against (a) the reference with it and (b) the same
    kernel on queries prepared by XLA, its output rotated back by XLA: (b) equal but for
    rare one-ulp roundings (the heads' sums and the rotations' f32 products)."""
    c = make_case(20 + t, t, h, k, k2, n, m)
    c["q"] = (c["q"].astype(jnp.float32) * 3.0).astype(jnp.bfloat16)
    rope = _rope(t, seed=t)
    config = dataclasses.replace(config, poison=float("nan"))
    extra = dict(extra_kv=c["extra_kv"], extra_idx=c["extra_idx"], scale=SCALE, config=config)
    run = jax.jit(lambda q, r: sparse_attention_cute(q, *_args(c)[1:], rope=r, q_norm_eps=EPS,
                                                     **extra))
    o, lse = run(c["q"], rope)
    ref = sparse_attention_reference(*_args(c), extra_kv=c["extra_kv"],
                                     extra_idx=c["extra_idx"], rope=rope, q_norm_eps=EPS,
                                     scale=SCALE)
    _check_close(o, lse, *ref)
    q = rotate_tail(head_rms_norm(c["q"], EPS), rope[0][:, None], rope[1][:, None])
    o2, lse2 = jax.jit(lambda q: sparse_attention_cute(q, *_args(c)[1:], **extra))(q)
    o2 = rotate_tail(o2, rope[0][:, None], rope[1][:, None], inverse=True)
    o, o2 = np.asarray(o, np.float32), np.asarray(o2, np.float32)
    differ = o != o2
    assert differ.mean() < 0.01, differ.mean()
    # A head's rsqrt one bf16 ulp apart (its sum of squares added in another order) scales
    # its logits by 2^-8: its row moves by a fraction of its scale, a token far less.
    for t_ in range(o.shape[0]):
        err = np.linalg.norm(o[t_] - o2[t_]) / (np.linalg.norm(o2[t_]) + 1e-30)
        assert err < 5e-3, (t_, err)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse2), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_public_op_runs_the_prepared_kernel():
    c = make_case(5, 8, 64, 128, 512, 1000, 2000)
    rope = _rope(8)
    f = jax.jit(lambda q, r: sparse_attention(q, *_args(c)[1:], extra_kv=c["extra_kv"],
                                              extra_idx=c["extra_idx"], rope=r,
                                              q_norm_eps=EPS, scale=SCALE))
    assert "CuteDSLRT_NvJaxCutlassCall" in f.lower(c["q"], rope).as_text()
    ref = sparse_attention_reference(*_args(c), extra_kv=c["extra_kv"],
                                     extra_idx=c["extra_idx"], rope=rope, q_norm_eps=EPS,
                                     scale=SCALE)
    _check_close(*f(c["q"], rope), *ref)
