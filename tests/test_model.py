"""Whole-model behaviour on the tiny config: decode/chunked prefill == full forward, batch rows
independent, long sequences, cache donation, bad input."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

import dsv4_jax as dj

CFG32 = dj.Config.tiny(dtype="float32", quant_simulation=False)
MAX_LEN = 640


@pytest.fixture(scope="module")
def model32():
    return dj.DSV4(CFG32), dj.init_params(CFG32, 0)


@pytest.fixture(scope="module")
def apply32(model32):
    model, params = model32
    return jax.jit(lambda t, c, n=None: model.apply({"params": params}, t, c, num_new=n))


def tokens_for(seed, batch, seq, vocab):
    return jax.random.randint(jax.random.key(seed), (batch, seq), 0, vocab, jnp.int32)


def max_abs(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.max(jnp.where(a == b, 0.0, jnp.abs(a - b))))     # equal infinities match


def test_decode_and_chunked_prefill_match_full_forward(apply32):
    """fp32: 300 tokens cross two HCA blocks and saturate the CSA top-16 (75 entries)."""
    seq = 300
    toks = tokens_for(1, 1, seq, CFG32.vocab_size)
    full, full_cache = apply32(toks, dj.Cache.init(CFG32, 1, MAX_LEN))
    assert int(full_cache.lengths[0]) == seq

    cache, chunks, start = dj.Cache.init(CFG32, 1, MAX_LEN), [], 0
    for size in (37, 100, 1, 62, 100):
        logits, cache = apply32(toks[:, start:start + size], cache)
        chunks.append(logits)
        start += size
    assert max_abs(jnp.concatenate(chunks, axis=1), full) < 1e-4

    cache, steps = dj.Cache.init(CFG32, 1, MAX_LEN), []
    for i in range(seq):
        logits, cache = apply32(toks[:, i:i + 1], cache)
        steps.append(logits)
    assert max_abs(jnp.concatenate(steps, axis=1), full) < 1e-4
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(full_cache)):
        assert max_abs(a, b) < 1e-4


def test_rows_with_different_lengths_match_each_row_alone(apply32):
    """Row 1 is padded in the prefill (num_new) and lags by 25 tokens; padding changes nothing.
    (The lengths are chunk sizes of the test above: the same programs serve both.)"""
    a = tokens_for(2, 1, 80, CFG32.vocab_size)
    b = tokens_for(3, 1, 80, CFG32.vocab_size)
    la, lb = 62, 37
    # each row alone
    alone = []
    for toks, n in ((a, la), (b, lb)):
        pre, cache = apply32(toks[:, :n], dj.Cache.init(CFG32, 1, MAX_LEN))
        steps = [pre[:, -1]]
        for i in range(n, n + 5):
            logits, cache = apply32(toks[:, i:i + 1], cache)
            steps.append(logits[:, 0])
        alone.append((jnp.stack(steps, 1), cache))
    # together: one padded prefill (row 1 padded with junk ids), then 5 joint decode steps
    junk = jnp.full((1, la - lb), 999, jnp.int32)
    batch = jnp.concatenate([a[:, :la], jnp.concatenate([b[:, :lb], junk], 1)], 0)
    pre, cache = apply32(batch, dj.Cache.init(CFG32, 2, MAX_LEN), jnp.array([la, lb]))
    assert cache.lengths.tolist() == [la, lb]
    together = [jnp.stack([pre[0, la - 1], pre[1, lb - 1]])]
    for i in range(5):
        step = jnp.stack([a[0, la + i:la + i + 1], b[0, lb + i:lb + i + 1]])
        logits, cache = apply32(step, cache)
        together.append(logits[:, 0])
    together = jnp.stack(together, 1)
    for row in range(2):
        assert max_abs(together[row], alone[row][0][0]) < 1e-4
        for x, y in zip(jax.tree.leaves(cache), jax.tree.leaves(alone[row][1])):
            if x.ndim:
                assert max_abs(x[row], y[0]) < 1e-4     # padding changed no state


def test_long_sequence_is_finite_and_not_degenerate():
    """BF16 with the quantisation simulation (the reference numerics), 640 tokens: five HCA
    entries and 160 CSA entries are emitted; the logits stay finite and informative."""
    cfg = dj.Config.tiny()
    model, params = dj.DSV4(cfg), dj.init_params(cfg, 0)
    step = jax.jit(lambda t, c: model.apply({"params": params}, t, c))
    toks = tokens_for(4, 1, 640, cfg.vocab_size)
    cache, outs = dj.Cache.init(cfg, 1, 640), []
    for start in range(0, 640, 128):
        logits, cache = step(toks[:, start:start + 128], cache)
        outs.append(logits)
    logits = jnp.concatenate(outs, 1)[0]
    assert bool(jnp.all(jnp.isfinite(logits)))
    assert float(jnp.std(logits, axis=-1).min()) > 0.3            # no collapsed position
    assert len(set(np.asarray(jnp.argmax(logits, -1)).tolist())) > 100
    hca = cache.layers[2].compressed[0]
    assert int(jnp.sum(jnp.any(hca != 0, axis=-1))) == 5
    csa = cache.layers[1].compressed[0]
    assert int(jnp.sum(jnp.any(csa != 0, axis=-1))) == 160


def test_donated_decode_step_reuses_cache_buffers(model32):
    model, params = model32
    cache = dj.Cache.init(CFG32, 2, MAX_LEN)
    step = jax.jit(lambda p, t, c: model.apply({"params": p}, t, c), donate_argnames=("c",))
    compiled = step.lower(params, jnp.zeros((2, 1), jnp.int32), cache).compile()
    cache_bytes = cache.nbytes()
    aliased = compiled.memory_analysis().alias_size_in_bytes
    assert aliased >= 0.99 * cache_bytes, (aliased, cache_bytes)
    n_cache = len(jax.tree.leaves(cache))
    assert compiled.as_text().count("may-alias") + compiled.as_text().count("must-alias") >= n_cache
    old = jax.tree.leaves(cache)
    _, new_cache = compiled(params, jnp.ones((2, 1), jnp.int32), cache)
    assert all(x.is_deleted() for x in old)                       # the buffers were donated
    assert int(new_cache.lengths[0]) == 1


# ----------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors(model32):
    model, params = model32
    cache = dj.Cache.init(CFG32, 2, 64)
    run = lambda t, c=cache, **kw: model.apply({"params": params}, t, c, **kw)
    with pytest.raises(ValueError, match="tokens: id 1024"):
        run(jnp.array([[1, 1024], [0, 0]]))
    with pytest.raises(ValueError, match="tokens: id -3"):
        run(jnp.array([[1, 2], [0, -3]]))
    with pytest.raises(ValueError, match="batch 3 does not match the cache batch 2"):
        run(jnp.zeros((3, 1), jnp.int32))
    with pytest.raises(TypeError, match="cache dtype bfloat16 does not match"):
        run(jnp.zeros((2, 1), jnp.int32), dj.Cache.init(CFG32, 2, 64, jnp.bfloat16))
    with pytest.raises(TypeError, match="integer ids"):
        run(jnp.zeros((2, 1), jnp.float32))
    with pytest.raises(ValueError, match="writing past max_len"):
        run(jnp.zeros((2, 65), jnp.int32))
    with pytest.raises(ValueError, match="num_new"):
        run(jnp.zeros((2, 4), jnp.int32), num_new=jnp.array([5, 1]))
    with pytest.raises(ValueError, match="num_new must be an int array of shape"):
        run(jnp.zeros((2, 4), jnp.int32), num_new=jnp.array([4]))
    # padded positions are not validated: junk ids beyond num_new are fine
    run(jnp.array([[5, 5], [5, 4096]]), num_new=jnp.array([2, 1]))


def test_bad_inputs_are_caught_inside_jit(model32):
    model, params = model32
    step = jax.jit(lambda t, c: model.apply({"params": params}, t, c))
    cache = dj.Cache.init(CFG32, 1, 8)
    with pytest.raises(Exception, match="tokens: id 2000"):
        jax.block_until_ready(step(jnp.array([[2000]]), cache))
    _, full = step(jnp.zeros((1, 8), jnp.int32)[:, :8], cache)
    with pytest.raises(Exception, match="writing past max_len"):
        jax.block_until_ready(step(jnp.zeros((1, 1), jnp.int32), full))


def test_cache_init_rejects_bad_sizes():
    with pytest.raises(ValueError, match="batch"):
        dj.Cache.init(CFG32, 0, 64)
    with pytest.raises(ValueError, match="max_len"):
        dj.Cache.init(CFG32, 1, -5)


def test_commit_keeps_exactly_the_chosen_tokens(model32):
    """A 3-token call with pending state, committed with n = [1, 3] / [2, 0], equals calls that
    only ever saw those tokens (the rolled-back tokens leave no trace)."""
    model, params = model32
    rng = jax.random.key(9)
    prefix = jax.random.randint(rng, (2, 126), 0, CFG32.vocab_size)     # next block ends at 127/128
    extra = jax.random.randint(jax.random.fold_in(rng, 1), (2, 3), 0, CFG32.vocab_size)
    fwd = jax.jit(lambda t, c, n: model.apply({"params": params}, t, c, num_new=n))
    _, base = fwd(prefix, dj.Cache.init(CFG32, 2, 256), jnp.array([126, 126]))
    spec = jax.jit(lambda t, c: model.apply({"params": params}, t, c, return_pending=True))
    logits3, _, pending = spec(extra, base)
    for keep in ([1, 3], [2, 0]):
        committed = dj.models.transformer.commit(base, pending, jnp.array(keep))
        direct_logits, direct = fwd(extra, base, jnp.array(keep))
        for a, b in zip(jax.tree.leaves(committed), jax.tree.leaves(direct)):
            assert max_abs(a, b) == 0.0
        for row, n in enumerate(keep):
            if n:
                assert max_abs(logits3[row, :n], direct_logits[row, :n]) < 1e-5


def test_reset_rows_starts_new_sequences_in_place(apply32):
    toks = tokens_for(7, 2, 20, CFG32.vocab_size)
    _, cache = apply32(toks, dj.Cache.init(CFG32, 2, MAX_LEN))
    reset = cache.reset_rows(jnp.array([True, False]))
    fresh = dj.Cache.init(CFG32, 2, MAX_LEN)
    for r, f, c in zip(jax.tree.leaves(reset), jax.tree.leaves(fresh), jax.tree.leaves(cache)):
        assert max_abs(r[0], f[0]) == 0.0 and max_abs(r[1], c[1]) == 0.0
    assert reset.lengths.tolist() == [0, 20]
