"""sparse_attention: reference semantics (CPU), argument errors, one test body run over every
implementation (``xla`` on CPU, ``cute`` under the ``gpu`` marker), and the Hopper kernel's
configurations vs the reference (GPU). Kernel compilation and CUDA lowering on CPU are in
test_kernels_*.py."""
import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax.ffi import sparse_attention, sparse_attention_reference
from dsv4_jax.ffi.sparse_attention import (SparseAttentionSm90Config, bounded_extra_idx,
                                           sparse_attention_cute)

SCALE = 512 ** -0.5
# The shared tests below take the ``implementation`` fixture (tests/conftest.py): once per
# implementation of the op.


def numpy_attention(q, kv, idx, sink, extra_kv=None, extra_idx=None, scale=SCALE):
    """Independent float64 formula of the contract (ffi/sparse_attention.py), one token at
    a time."""
    q, kv, sink = (np.asarray(x, np.float64) for x in (q, kv, sink))
    t, h, d = q.shape
    o = np.zeros((t, h, d))
    lse = np.full((t, h), -np.inf)
    for ti in range(t):
        rows = [kv[i] for i in np.asarray(idx[ti]) if 0 <= i < kv.shape[0]]
        if extra_kv is not None:
            xkv = np.asarray(extra_kv, np.float64)
            rows += [xkv[i] for i in np.asarray(extra_idx[ti]) if 0 <= i < xkv.shape[0]]
        if not rows:
            continue
        keys = np.stack(rows)                              # [n, d], values = keys
        logits = q[ti] @ keys.T * scale                    # [h, n]
        m = logits.max(-1, keepdims=True)
        e = np.exp(logits - m)
        o[ti] = (e @ keys) / (e.sum(-1, keepdims=True) + np.exp(sink[:, None] - m))
        lse[ti] = m[:, 0] + np.log(e.sum(-1))
    return o, lse


def make_case(seed, t, h, k, k2, n, m, *, d=512, holes=0.3, logit_scale=1.0, empty_token=True,
              dtype=jnp.bfloat16):
    """Random inputs with -1 holes, out-of-range indices, duplicates and an all-unused token."""
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((t, h, d)) * logit_scale).astype(np.float32)
    kv = rng.standard_normal((n, d)).astype(np.float32)
    idx = rng.integers(0, n, (t, k)).astype(np.int32)
    idx[rng.random((t, k)) < holes] = -1
    idx[:, -1] = n + 5                     # past the pool: unused, never read
    if k > 2:
        idx[:, 1] = idx[:, 0]              # a duplicated entry counts twice
        idx[:, 2] = -1000                  # any negative value is unused
    sink = rng.standard_normal(h).astype(np.float32)
    extra_kv = extra_idx = None
    if k2:
        extra_kv = rng.standard_normal((m, d)).astype(np.float32)
        extra_idx = rng.integers(0, m, (t, k2)).astype(np.int32)
        extra_idx[rng.random((t, k2)) < holes] = -1
        extra_idx[:, 0] = m                # == pool size: unused
    if empty_token and t > 1:
        idx[t // 2] = -1
        if k2:
            extra_idx[t // 2] = -1
    cast = lambda x: None if x is None else jnp.asarray(x, dtype)
    return dict(q=cast(q), kv=cast(kv), idx=jnp.asarray(idx), sink=jnp.asarray(sink),
                extra_kv=cast(extra_kv),
                extra_idx=None if extra_idx is None else jnp.asarray(extra_idx))


# ---------------------------------------------------------------------------- reference (CPU)

def reference_and_numpy(c):
    """The pure-JAX reference and the float64 formula on one case: ((o, lse), (o, lse))."""
    ref = sparse_attention_reference(c["q"], c["kv"], c["idx"], c["sink"],
                                     extra_kv=c["extra_kv"], extra_idx=c["extra_idx"], scale=SCALE)
    return ref, numpy_attention(c["q"], c["kv"], c["idx"], c["sink"], c["extra_kv"],
                                c["extra_idx"])


@pytest.mark.parametrize("k2", [0, 7])
def test_reference_matches_independent_formula(k2):
    c = make_case(0, t=4, h=3, k=9, k2=k2, n=11, m=6, d=16, dtype=jnp.float32)
    (o, lse), (o_np, lse_np) = reference_and_numpy(c)
    # The reference casts P to the input dtype (f32 here), so it is exact up to rounding.
    np.testing.assert_allclose(np.asarray(o), o_np, rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(np.isinf(np.asarray(lse)), np.isinf(lse_np))
    finite = np.isfinite(lse_np)
    np.testing.assert_allclose(np.asarray(lse)[finite], lse_np[finite], rtol=1e-5)


def test_reference_empty_token_is_zero_and_minus_inf():
    c = make_case(1, t=3, h=2, k=5, k2=4, n=7, m=5, d=8, dtype=jnp.float32)
    o, lse = sparse_attention_reference(c["q"], c["kv"], c["idx"], c["sink"],
                                        extra_kv=c["extra_kv"], extra_idx=c["extra_idx"],
                                        scale=SCALE)
    assert np.all(np.asarray(o)[1] == 0) and np.all(np.isneginf(np.asarray(lse)[1]))
    assert not np.any(np.isnan(np.asarray(o)))


def test_reference_long_prefill_chunks_match_single_chunk():
    c = make_case(2, t=300, h=2, k=6, k2=3, n=40, m=9, d=8, dtype=jnp.float32)
    (o, lse), (o_np, lse_np) = reference_and_numpy(c)
    np.testing.assert_allclose(np.asarray(o), o_np, rtol=2e-5, atol=2e-6)


# ---------------------------------------------------------------------------- bad input (CPU)

def _args(**over):
    base = dict(q=jnp.zeros((2, 64, 512), jnp.bfloat16), kv=jnp.zeros((5, 512), jnp.bfloat16),
                idx=jnp.zeros((2, 3), jnp.int32), sink=jnp.zeros((64,), jnp.float32))
    base.update(over)
    return base


@pytest.mark.parametrize("over, error, words", [
    (dict(q=jnp.zeros((2, 512), jnp.bfloat16)), ValueError, "q must be [T, H, D]"),
    (dict(q=jnp.zeros((2, 64, 512), jnp.int32)), TypeError, "q must be bf16"),
    (dict(kv=jnp.zeros((5, 256), jnp.bfloat16)), ValueError, "kv must be [N, 512]"),
    (dict(kv=jnp.zeros((5, 512), jnp.float32)), TypeError, "kv dtype must equal q dtype"),
    (dict(idx=jnp.zeros((2, 3), jnp.int64 if jax.config.jax_enable_x64 else jnp.float32)),
     TypeError, "idx must be int32"),
    (dict(idx=jnp.zeros((3, 3), jnp.int32)), ValueError, "idx must be [T=2, K]"),
    (dict(sink=jnp.zeros((63,), jnp.float32)), ValueError, "sink must have shape (64,)"),
])
def test_bad_arguments_raise_naming_the_argument(over, error, words):
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")):
        sparse_attention(**_args(**over), scale=SCALE)


def test_bad_extra_pool_arguments():
    with pytest.raises(ValueError, match="given together"):
        sparse_attention(**_args(), extra_kv=jnp.zeros((4, 512), jnp.bfloat16), scale=SCALE)
    with pytest.raises(TypeError, match="extra_idx must be int32"):
        sparse_attention(**_args(), extra_kv=jnp.zeros((4, 512), jnp.bfloat16),
                         extra_idx=jnp.zeros((2, 4), jnp.float32), scale=SCALE)


def test_bad_extra_len_arguments():
    extra = dict(extra_kv=jnp.zeros((4, 512), jnp.bfloat16),
                 extra_idx=jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="extra_len bounds extra_idx, which is not given"):
        sparse_attention(**_args(), extra_len=jnp.zeros((2,), jnp.int32), scale=SCALE)
    with pytest.raises(ValueError, match=r"extra_len must be \[T=2\]; extra_len has shape "
                                         r"\(2, 1\)"):
        sparse_attention(**_args(), **extra, extra_len=jnp.zeros((2, 1), jnp.int32),
                         scale=SCALE)
    with pytest.raises(TypeError, match="extra_len must be int32"):
        sparse_attention(**_args(), **extra, extra_len=jnp.zeros((2,), jnp.float32),
                         scale=SCALE)


# ---------------------------------------------------------------------------- checks

def _relative_error(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30)


def _check_against_reference(c, o, lse):
    o_ref, lse_ref = sparse_attention_reference(
        c["q"], c["kv"], c["idx"], c["sink"], extra_kv=c["extra_kv"],
        extra_idx=c["extra_idx"], scale=SCALE)
    _check_close(o, lse, o_ref, lse_ref)


def _check_close(o, lse, o_ref, lse_ref):
    """bf16-level agreement, per token too; identical empty tokens (o = 0, lse = -inf)."""
    o, lse, o_ref, lse_ref = (np.asarray(x, np.float32) for x in (o, lse, o_ref, lse_ref))
    assert not np.isnan(o).any() and not np.isnan(lse).any(), "NaN (or unwritten poison)"
    assert _relative_error(o, o_ref) < 1e-2, _relative_error(o, o_ref)
    for t in range(o.shape[0]):       # a per-token check catches a wrong tile among many
        if np.linalg.norm(o_ref[t]) > 0:
            assert _relative_error(o[t], o_ref[t]) < 2e-2, (t, _relative_error(o[t], o_ref[t]))
    empty = np.isneginf(lse_ref)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert np.all(o[np.broadcast_to(empty[..., None], o.shape)] == 0)
    np.testing.assert_allclose(lse[~empty], lse_ref[~empty], rtol=1e-3, atol=1e-2)



# ---------------------------------------------------------------------------- every implementation

SHARED_CASES = [  # (T, H, K, K2, N, M, logit_scale, holes): shapes every implementation takes
    (1, 64, 128, 512, 300, 2000, 1.0, 0.3),      # decode with both pools
    (5, 64, 100, 300, 777, 999, 1.0, 0.3),       # slot counts that are not a block multiple
    (8, 64, 128, 0, 1000, 0, 1.0, 0.3),          # window only (no extra pool)
    (4, 128, 128, 512, 600, 600, 30.0, 0.9),     # two head blocks, large logits, mostly unused
]


@pytest.mark.parametrize("t, h, k, k2, n, m, logit_scale, holes", SHARED_CASES)
def test_op_matches_the_independent_formula(implementation, t, h, k, k2, n, m, logit_scale,
                                            holes):
    c = make_case(30 + t + k2, t, h, k, k2, n, m, logit_scale=logit_scale, holes=holes)
    f = jax.jit(lambda q, kv, i, s, x, xi: sparse_attention(
        q, kv, i, s, extra_kv=x, extra_idx=xi, scale=SCALE, implementation=implementation))
    o, lse = f(c["q"], c["kv"], c["idx"], c["sink"], c["extra_kv"], c["extra_idx"])
    _check_close(o, lse, *numpy_attention(c["q"], c["kv"], c["idx"], c["sink"], c["extra_kv"],
                                          c["extra_idx"]))


BOUNDED_CASES = [  # (T, H, K, K2, N, M): HCA-like lists bounded per token
    (1, 64, 128, 8330, 300, 9000),     # decode at a long cache: flash-decoding splits
    (3, 64, 128, 600, 300, 700),       # a few decode rows
    (64, 64, 128, 1100, 500, 1200),    # a prefill chunk: one split, bounds across blocks
]


@pytest.mark.parametrize("t, h, k, k2, n, m", BOUNDED_CASES)
def test_extra_len_leaves_the_tail_of_each_list_unused(implementation, t, h, k, k2, n, m):
    """``extra_len`` = the same op on ids set to -1 from each token's bound on: bounds of 0,
    mid-block, on a block edge, at K2 and past it, and negative; ids past the bound are
    valid rows (so ignoring the bound would change the result)."""
    c = make_case(50 + t, t, h, k, k2, n, m, holes=0.2, empty_token=False)
    rng = np.random.default_rng(t)
    bound = rng.integers(0, k2 + 1, t).astype(np.int32)
    special = [0, 1, 64, k2, k2 + 100, -3]
    bound[:min(t, len(special))] = special[:t]
    bound = jnp.asarray(bound)
    f = jax.jit(lambda q, kv, i, s, x, xi, xl: sparse_attention(
        q, kv, i, s, extra_kv=x, extra_idx=xi, extra_len=xl, scale=SCALE,
        implementation=implementation))
    o, lse = f(c["q"], c["kv"], c["idx"], c["sink"], c["extra_kv"], c["extra_idx"], bound)
    masked = bounded_extra_idx(c["extra_idx"], bound)
    assert int(jnp.sum(masked != c["extra_idx"])) > t, "the bound must cut used slots"
    _check_close(o, lse, *numpy_attention(c["q"], c["kv"], c["idx"], c["sink"], c["extra_kv"],
                                          masked))


def test_out_of_range_indices_are_unused(implementation):
    c = make_case(3, t=2, h=64, k=4, k2=0, n=3, m=0, empty_token=False)
    bad = c["idx"].at[:, 0].set(3).at[:, 1].set(2 ** 30)
    o, lse = sparse_attention(c["q"], c["kv"], bad, c["sink"], scale=SCALE,
                              implementation=implementation)
    o2, lse2 = sparse_attention(c["q"], c["kv"], bad.at[:, :2].set(-1), c["sink"], scale=SCALE,
                                implementation=implementation)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o2))


# ---------------------------------------------------------------------------- kernel (GPU)

Sm90 = SparseAttentionSm90Config
GPU_CASES = [  # (T, H, K, K2, N, M, logit_scale, holes, kernel config (entries per stage,
               #  stages, split QK^T))
    (1, 64, 128, 512, 300, 2000, 1.0, 0.3, Sm90(64, 2, False)),      # Flash decode: split + combine
    (3, 128, 128, 1024, 500, 5000, 1.0, 0.3, Sm90(64, 2, False)),     # Pro decode: both head blocks
    (8, 64, 128, 0, 1000, 0, 1.0, 0.3, Sm90(64, 2, False)),           # window only (no extra pool)
    (64, 128, 128, 1024, 9000, 70000, 1.0, 0.1, Sm90(64, 2, False)),  # Pro T=64: one wave, no split
    (5, 64, 100, 300, 777, 999, 1.0, 0.3, Sm90(64, 2, False)),        # a block straddles both pools
    (2, 128, 2048, 2048, 4096, 4096, 1.0, 0.3, Sm90(64, 2, False)),   # K and K2 at 2048
    (130, 64, 128, 512, 20000, 20000, 30.0, 0.3, Sm90(64, 2, False)),  # large logits, 2 waves
    (4, 64, 128, 512, 600, 600, 30.0, 0.9, Sm90(64, 2, False)),       # mostly unused slots
    (3, 128, 128, 1024, 500, 5000, 1.0, 0.3, Sm90(48, 3, False)),     # 48-entry blocks, 3 stages
    (5, 64, 100, 300, 777, 999, 1.0, 0.3, Sm90(48, 3, False)),
    (130, 64, 128, 512, 20000, 20000, 30.0, 0.3, Sm90(48, 3, False)),
    # QK^T split between the math warpgroups (scores exchanged through smem)
    (1, 64, 128, 512, 300, 2000, 1.0, 0.3, Sm90(64, 2, True)),        # splits: one block each
    (8, 64, 128, 0, 1000, 0, 1.0, 0.3, Sm90(64, 2, True)),
    (64, 128, 128, 1024, 9000, 70000, 1.0, 0.1, Sm90(64, 2, True)),
    (5, 64, 100, 300, 777, 999, 1.0, 0.3, Sm90(64, 2, True)),
    (2, 128, 2048, 2048, 4096, 4096, 1.0, 0.3, Sm90(64, 2, True)),
    (130, 64, 128, 512, 20000, 20000, 30.0, 0.3, Sm90(64, 2, True)),
    (4, 64, 128, 512, 600, 600, 30.0, 0.9, Sm90(64, 2, True)),
    # The op's default: QK^T split without flash-decoding splits, duplicated with them
    (64, 128, 128, 1024, 9000, 70000, 1.0, 0.1, Sm90()),
    (8, 64, 128, 512, 1000, 2000, 1.0, 0.3, Sm90()),
]


@pytest.mark.gpu
@pytest.mark.parametrize("t, h, k, k2, n, m, logit_scale, holes, config", GPU_CASES)
def test_kernel_matches_reference(t, h, k, k2, n, m, logit_scale, holes, config):
    c = make_case(10 + t + k2, t, h, k, k2, n, m, logit_scale=logit_scale, holes=holes)
    f = jax.jit(lambda q, kv, i, s, x, xi: sparse_attention_cute(
        q, kv, i, s, extra_kv=x, extra_idx=xi, scale=SCALE,
        config=dataclasses.replace(config, poison=float("nan"))))
    o, lse = f(c["q"], c["kv"], c["idx"], c["sink"], c["extra_kv"], c["extra_idx"])
    _check_against_reference(c, o, lse)


@pytest.mark.gpu
def test_public_op_dispatches_to_the_kernel_under_jit():
    c = make_case(4, 8, 128, 128, 1024, 2000, 9000)
    f = jax.jit(lambda q, kv, i, s, x, xi: sparse_attention(
        q, kv, i, s, extra_kv=x, extra_idx=xi, scale=SCALE))
    args = (c["q"], c["kv"], c["idx"], c["sink"], c["extra_kv"], c["extra_idx"])
    assert "CuteDSLRT_NvJaxCutlassCall" in f.lower(*args).as_text()
    _check_against_reference(c, *f(*args))
    o, lse = sparse_attention(*args[:4], extra_kv=args[4], extra_idx=args[5], scale=SCALE,
                              implementation="cute")
    _check_against_reference(c, o, lse)


@pytest.mark.gpu
def test_repeated_calls_and_graph_replay_are_identical():
    # Six custom calls in one jit so that XLA captures them in a command buffer (CUDA graph);
    # T=2 uses the split path (two kernels per call), T=64 the single-pass one.
    cases = [make_case(20 + i, t, 128, 128, 1024, 3000, 9000)
             for i, t in enumerate((2, 64, 2, 64, 2, 64))]

    @jax.jit
    def many(cs):
        return [sparse_attention(c["q"], c["kv"], c["idx"], c["sink"], extra_kv=c["extra_kv"],
                                 extra_idx=c["extra_idx"], scale=SCALE) for c in cs]

    first = jax.device_get(many(cases))
    for _ in range(3):
        again = jax.device_get(many(cases))
        for (o1, l1), (o2, l2) in zip(first, again):
            np.testing.assert_array_equal(np.asarray(o1, np.float32), np.asarray(o2, np.float32))
            np.testing.assert_array_equal(l1, l2)
    for c, (o, lse) in zip(cases, first):
        _check_against_reference(c, o, lse)
