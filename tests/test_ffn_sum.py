"""The MoE output handed to the next mHC pre as its parts (``ffi.ffn_sum.FfnSum``,
``KernelPolicy(ffn_sum_in_hc_pre=True)``): the model's logits and caches are the same bits
with it on and off, on the ops' references (CPU); ``tests/test_hc_pre.py`` has the op's and
the kernel's cases, ``tests/test_decode_lowering.py`` the lowered step's."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import dsv4_jax as dj
from dsv4_jax.ffi.ffn_sum import FfnSum
from dsv4_jax.ffi.moe import moe_experts
from dsv4_jax.ffi.policy import KernelPolicy


@pytest.mark.parametrize("quantized", [True, False])
def test_the_model_is_the_same_bits_with_the_sum_in_the_mhc_pre(quantized):
    """A 4-token prefill then a decode step: logits and the new cache equal bit for bit."""
    cfg = dj.Config.tiny(quantized=quantized)
    tokens = jnp.array([[1, 2, 3, 4], [5, 6, 7, 8]], jnp.int32)
    results = []
    for on in (False, True):
        model = dj.DSV4(cfg, implementation=KernelPolicy(implementation="xla",
                                                         ffn_sum_in_hc_pre=on))
        cache = dj.Cache.init(cfg, 2, 64)
        params = model.init(jax.random.key(0), tokens, cache)["params"]
        step = jax.jit(lambda p, t, c, m=model: m.apply({"params": p}, t, c, logits_at="last"))
        logits, cache = step(params, tokens, cache)
        logits2, cache = step(params, tokens[:, :1], cache)
        results.append(jax.tree_util.tree_leaves((logits, logits2, cache)))
    for a, b in zip(*results):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_moe_experts_unsummed_gives_the_parts_of_its_sum():
    """``moe_experts(..., summed=False)`` on the reference: the assignment rows, identity
    positions and validity, whose ``FfnSum`` total (with a zero shared row) is the op's sum
    cast like the model casts it."""
    cfg = dj.Config.tiny(quantized=False)
    t, k, d, e, inter = 3, 2, cfg.dim, 4, 32
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
    idx = jnp.asarray([[0, 1], [2, 3], [1, 2]], jnp.int32)
    w = jnp.asarray(rng.random((t, k)), jnp.float32)
    weight = lambda o, i: (jnp.asarray(rng.standard_normal((e, o, i)) * 0.1,  # noqa: E731
                                       jnp.bfloat16), None)
    w1, w3, w2 = weight(inter, d), weight(inter, d), weight(d, inter)
    kw = dict(swiglu_limit=0.0, quantized=False, simulate=False, implementation="xla")
    rows, position, valid = moe_experts(x, idx, w, w1, w3, w2, summed=False, **kw)
    assert rows.shape == (t * k, d) and position.dtype == jnp.int32 and bool(valid.all())
    np.testing.assert_array_equal(position, np.arange(t * k))
    parts = FfnSum(rows, position, valid, jnp.zeros((t, d), jnp.bfloat16), k)
    want = moe_experts(x, idx, w, w1, w3, w2, **kw).astype(jnp.bfloat16)
    np.testing.assert_array_equal(parts.total(), want)


def test_the_policy_takes_a_bool():
    with pytest.raises(TypeError, match="ffn_sum_in_hc_pre must be a bool, got int"):
        KernelPolicy(ffn_sum_in_hc_pre=1)
