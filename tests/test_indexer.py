"""The indexer top-k op (``dsv4_jax.ffi.index_topk``): the blocked reference gives exactly the
ids of the dense one-shot formula the model used before it (every shape, block width, tie and
row length below), bad input, the dispatch of an op without a kernel, the block rule, and the
memory of a long-context compile."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import dsv4_jax as dj
from dsv4_jax.cache import init_layer_cache
from dsv4_jax.ffi import KernelPolicy, index_topk, index_topk_reference, op_spec
from dsv4_jax.models import compressor
from dsv4_jax.models.layers import rope_inv_freq
from dsv4_jax.ffi import indexer_reference
from dsv4_jax.ffi.indexer_reference import MIN_BLOCK, SCORE_BLOCK_BUDGET_BYTES, choose_block

BF16 = jnp.bfloat16
S = jax.ShapeDtypeStruct


def _dense_scores(q, weights, table):
    dt = q.dtype
    score = jnp.einsum("bshd,btd->bsht", q, table.astype(dt),
                       preferred_element_type=jnp.float32).astype(dt)
    score = (jax.nn.relu(score) * weights[..., None]).astype(dt)
    return jnp.sum(score.astype(jnp.float32), axis=2).astype(dt)


def dense_topk(q, weights, table, visible, k):
    """The Indexer's code before the op: all ``[B, S, H, N]`` scores, one ``lax.top_k``.

    Run op by op (not under ``jit``): compiled as one program, XLA's CPU dot fusion drops the
    bf16 rounding of the weighted products in some shapes (N of a few hundred here), so the
    fused program's numbers depend on the shapes; op by op every rounding it writes happens."""
    score = _dense_scores(q, weights, table)
    n_entries = table.shape[1]
    entry = jnp.arange(n_entries)
    score = jnp.where(entry[None, None, :] < visible[..., None], score, -jnp.inf)
    _, top = jax.lax.top_k(score, min(k, n_entries))
    return np.asarray(jnp.where(top < visible[..., None], top, -1).astype(jnp.int32))


def _inputs(b, s, h, d, n, seed=0, distinct_keys=None, visible=None):
    """FP4-like small-integer queries and keys (many exact ties in the scores), weights of both
    signs (relu zeros become +0 and -0), rows at different lengths: one sees nothing, one the
    whole table, one more than the table."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-3, 4, (b, s, h, d)).astype(np.float32) * 0.5
    keys = rng.integers(-3, 4, (b, n, d)).astype(np.float32) * 0.5
    if distinct_keys is not None:                       # repeated rows: equal scores
        keys = keys[:, rng.integers(0, distinct_keys, n)]
    weights = rng.standard_normal((b, s, h)).astype(np.float32)
    if visible is None:
        visible = rng.integers(0, n + 1, (b, s))
        visible.flat[0] = 0
        visible.flat[-1] = n
        if visible.size > 2:
            visible.flat[1] = n + 5
    return (jnp.asarray(q, BF16), jnp.asarray(weights, BF16), jnp.asarray(keys, BF16),
            jnp.asarray(visible, jnp.int32))


def _check(args, k, block):
    want = dense_topk(*args, k)
    got = np.asarray(jax.jit(lambda *a: index_topk(*a, k, block=block))(*args))
    assert got.shape == want.shape and got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    return got


@pytest.mark.parametrize("b, s, h, d, n, k, block", [
    (2, 6, 8, 64, 1024, 32, 128),      # N a multiple of the block, 8 blocks
    (2, 6, 8, 64, 1000, 32, 256),      # N not a multiple: the last block padded
    (1, 5, 4, 32, 700, 300, 128),      # k > block: the first step spans 3 blocks
    (2, 3, 4, 32, 200, 500, 128),      # k > N
    (1, 4, 64, 128, 1100, 512, 256),   # the model's heads and width
    (2, 4, 8, 64, 640, 16, None),      # the automatic block: one block
    (1, 3, 4, 32, 130, 8, 1),          # a block of one entry
])
def test_ids_equal_the_dense_formula(b, s, h, d, n, k, block):
    _check(_inputs(b, s, h, d, n), k, block)


@pytest.mark.parametrize("block", [128, 256, None])
def test_ties_resolve_to_the_lower_id_as_one_top_k(block):
    args = _inputs(2, 5, 8, 64, 900, seed=1, distinct_keys=6)
    _check(args, 64, block)
    # six distinct key rows: each query's 900 scores take at most six values (plus the
    # +0/-0 pair), so the 64 selected ids are decided by ties across many blocks
    scores = np.asarray(_dense_scores(*args[:3]), np.float32)
    assert all(np.unique(row).size <= 7 for row in scores.reshape(-1, 900))


@pytest.mark.parametrize("block", [128, None])
def test_visible_entries_scored_minus_infinity_rank_before_invisible_ones(block):
    """Weights at the edge of BF16 overflow the weighted products to -inf: such visible
    entries still come before the invisible ones (by id), as in one top-k."""
    q, w, keys, _ = _inputs(1, 3, 4, 32, 700, seed=4)
    w = w.at[0, 1].set(-3e38).at[0, 2, :2].set(-3e38)
    visible = jnp.array([[650, 600, 690]], jnp.int32)
    scores = np.asarray(_dense_scores(q, w, keys), np.float32)
    assert np.isneginf(scores[0, 1, :600]).sum() > 300 and np.isneginf(scores[0, 2]).any()
    got = _check((q, w, keys, visible), 400, block)
    assert (got[0, 1] >= 0).all()


def test_short_rows_in_a_long_table_stop_early_and_stay_exact():
    """The loop runs only as many blocks as the longest row sees; rows with fewer visible
    entries than k list them all, then -1."""
    visible = np.array([[0, 3, 40, 129], [1, 2, 255, 7]])
    args = _inputs(2, 4, 8, 64, 4096, seed=2, visible=visible)
    got = _check(args, 100, 128)
    for (r, c), v in np.ndenumerate(visible):
        used = min(v, 100)
        assert (got[r, c, :used] >= 0).all() and (got[r, c, used:] == -1).all()


def test_every_block_width_gives_the_same_ids():
    args = _inputs(1, 4, 8, 64, 1537, seed=3)
    ids = [np.asarray(index_topk(*args, 200, block=blk)) for blk in (1537, 512, 300, 128)]
    for other in ids[1:]:
        np.testing.assert_array_equal(other, ids[0])


def test_an_empty_table_gives_no_slots():
    q, w, _, _ = _inputs(2, 3, 4, 32, 8)
    out = index_topk(q, w, jnp.zeros((2, 0, 32), BF16), jnp.zeros((2, 3), jnp.int32), 16)
    assert out.shape == (2, 3, 0) and out.dtype == jnp.int32


def test_dispatch_on_cpu():
    """None and "xla" run the reference here; "cute" names why it cannot run: arguments the
    kernel does not take, or no Hopper GPU in this process."""
    args = _inputs(1, 2, 4, 32, 300)
    np.testing.assert_array_equal(index_topk(*args, 8, implementation="xla"),
                                  index_topk_reference(*args, 8))
    np.testing.assert_array_equal(index_topk(*args, 8), index_topk_reference(*args, 8))
    assert op_spec("index_topk").implementations == ("xla", "cute")
    assert KernelPolicy(implementation="cute").implementation_for("index_topk") == "cute"
    pytest.importorskip("cutlass")
    with pytest.raises(ValueError, match=r"index_topk\(implementation='cute'\) does not "
                                         r"support 4 heads of width 32 \(the kernel takes "
                                         r"64 x 128\)"):
        index_topk(*args, 8, implementation="cute")
    wide = (jnp.zeros((1, 2, 64, 128), BF16), jnp.zeros((1, 2, 64), BF16),
            jnp.zeros((1, 300, 128), BF16), jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(RuntimeError, match=r"index_topk\(implementation='cute'\) needs a "
                                           r"CUDA GPU"):
        index_topk(*wide, 8, implementation="cute")


@pytest.mark.parametrize("rows, width, kk", [(1, 1000, 40), (3, 257, 64), (2, 64, 64),
                                             (300, 200, 8)])
def test_top_k_in_parts_equals_one_top_k(monkeypatch, rows, width, kk):
    """Small parts (16 entries) so that rows of a few hundred are cut: many ties (values of
    six levels), -inf entries and a last part past the row; the values and positions of one
    lax.top_k, ties to the lower position. 300 rows: no cut, one top-k."""
    monkeypatch.setattr(indexer_reference, "TOP_K_PART", 16)
    rng = np.random.default_rng(width)
    score = rng.integers(0, 6, (rows, width)).astype(np.float32)
    score[rng.random((rows, width)) < 0.2] = -np.inf
    score = jnp.asarray(score, BF16)
    want_v, want_i = jax.lax.top_k(score, kk)
    got_v, got_i = indexer_reference.top_k_in_parts(score, kk)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(want_v, np.float32))


def test_ids_with_the_rows_cut_into_parts(monkeypatch):
    """A decode-like call (one query per row, one block) whose top-k runs in parts."""
    monkeypatch.setattr(indexer_reference, "TOP_K_PART", 16)
    _check(_inputs(2, 1, 8, 64, 1000, seed=6), 32, None)


def test_the_block_rule():
    per_entry = 512 * 64 * 4
    assert choose_block(1, 1, 64, 32768) == 32768                   # decode: one block
    assert choose_block(1, 512, 64, 1000) == 1000                   # fits: one block
    block = choose_block(1, 512, 64, 32768)
    assert block % MIN_BLOCK == 0 and block * per_entry <= SCORE_BLOCK_BUDGET_BYTES
    assert (block + MIN_BLOCK) * per_entry > SCORE_BLOCK_BUDGET_BYTES
    assert choose_block(8, 4096, 64, 32768) == MIN_BLOCK             # never below the minimum
    assert choose_block(8, 4096, 64, 100) == 100


def _bad(**change):
    q, w, keys, vis = _inputs(2, 3, 4, 32, 10)
    args = dict(q=q, weights=w, keys=keys, visible=vis, k=4, block=None) | change
    return lambda: index_topk(args["q"], args["weights"], args["keys"], args["visible"],
                              args["k"], block=args["block"])


@pytest.mark.parametrize("call, error, message", [
    (_bad(q=jnp.zeros((2, 3, 4), BF16)), ValueError,
     r"index_topk: q must be \[B, S, H, D\]; q has shape \(2, 3, 4\)"),
    (_bad(weights=jnp.zeros((2, 3, 5), BF16)), ValueError,
     r"weights must be \[B, S, H\] = \(2, 3, 4\) as q \(2, 3, 4, 32\); weights has shape "
     r"\(2, 3, 5\)"),
    (_bad(keys=jnp.zeros((2, 10, 16), BF16)), ValueError,
     r"keys must be \[B = 2, N, D = 32\] as q \(2, 3, 4, 32\); keys has shape \(2, 10, 16\)"),
    (_bad(keys=jnp.zeros((1, 10, 32), BF16)), ValueError, r"keys has shape \(1, 10, 32\)"),
    (_bad(keys=jnp.zeros((10, 32), BF16)), ValueError, r"keys has shape \(10, 32\)"),
    (_bad(visible=jnp.zeros((2, 4), jnp.int32)), ValueError,
     r"visible must be \[B, S\] = \(2, 3\) as q \(2, 3, 4, 32\); visible has shape \(2, 4\)"),
    (_bad(visible=jnp.zeros((2, 3), jnp.float32)), TypeError,
     "visible must be integer; visible has dtype float32"),
    (_bad(q=jnp.zeros((2, 3, 4, 32), jnp.int32)), TypeError, "q must be floating"),
    (_bad(keys=jnp.zeros((2, 10, 32), jnp.int8)), TypeError, "keys must be floating"),
    (_bad(weights=jnp.zeros((2, 3, 4), jnp.float32)), TypeError,
     "weights must have q's dtype bfloat16; weights has dtype float32"),
    (_bad(k=0), ValueError, "k must be a positive int, got 0"),
    (_bad(k=2.0), ValueError, "k must be a positive int, got 2.0"),
    (_bad(block=0), ValueError, "block must be None or a positive int, got 0"),
    (_bad(block=True), ValueError, "block must be None or a positive int, got True"),
])
def test_bad_input_names_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_the_models_indexer_selects_the_dense_formulas_ids(monkeypatch):
    """The BF16 model's Indexer, compiled as a whole, selects what the dense formula run op by
    op selects from the same queries, weights and key table (captured from the op's call):
    every rounding of §3.5 happens inside the model's program too."""
    cfg = dj.Config.tiny()
    b, s, max_len = 2, 300, 2048
    seen = []

    def spy(*args, **kwargs):
        seen.append(args[:4])
        return index_topk(*args, **kwargs)

    monkeypatch.setattr(compressor, "index_topk", spy)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((b, s, cfg.dim)), BF16)
    qr = jnp.asarray(rng.standard_normal((b, s, cfg.q_lora_rank)), BF16)
    lengths, num_new = jnp.array([0, 40], jnp.int32), jnp.array([s, s - 40], jnp.int32)
    positions = lengths[:, None] + jnp.arange(s)[None, :]
    lcache = init_layer_cache(cfg, 1, b, max_len, BF16)
    inv_freq = rope_inv_freq(cfg, compressed=True)
    indexer = compressor.Indexer(cfg)
    params = indexer.init(jax.random.key(0), x, qr, positions, lcache, lengths, num_new,
                          inv_freq)

    def run(params):
        top, _ = indexer.apply(params, x, qr, positions, lcache, lengths, num_new, inv_freq)
        return top, seen[-1]

    top, operands = jax.jit(run)(params)
    assert operands[2].shape[1] == max_len // 4
    np.testing.assert_array_equal(np.asarray(top), dense_topk(*operands, cfg.index_topk))


def test_memory_does_not_grow_with_the_context():
    """Compiled for a long context on abstract inputs (nothing allocated): the temporaries stay
    far below the dense ``[S, H, N]`` f32 scores, and what grows with N is table-sized (the
    padded and the converted key table), never score-sized."""
    b, s, h, d, k = 1, 512, 64, 128, 512

    def temp_bytes(n):
        args = (S((b, s, h, d), BF16), S((b, s, h), BF16), S((b, n, d), BF16),
                S((b, s), jnp.int32))
        compiled = jax.jit(lambda *a: index_topk(*a, k)).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(16384), temp_bytes(65536)
    dense = b * s * h * 65536 * 4
    assert large < dense / 8, (large, dense)
    assert large - small <= 2 * b * (65536 - 16384) * d * 4, (small, large)
