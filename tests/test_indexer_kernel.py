"""The indexer's score kernel (``kernels/index_scores_sm90.py``) and ``index_topk``'s kernel
path: its configuration and block rule, compilation for sm_90a and the model's lowering on
CPU; on the GPU, the kernel's scores bit for bit against the reference's where the head sum is
exact in f32, the op's ids equal to the reference's, and near-equality on generic data."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import dsv4_jax as dj
from dsv4_jax.ffi import dispatch, index_topk
from dsv4_jax.ffi import indexer_sm90
from dsv4_jax.ffi.indexer_reference import _scores, select_reference
from dsv4_jax.ffi.policy import KernelPolicy
from dsv4_jax.kernels.index_scores_config import (BLOCK_N, DECODE_CONFIG, DEFAULT_CONFIG,
                                                  PAIR_CONFIG, SMEM_BYTES, TARGET_CTAS,
                                                  IndexScoresSm90Config, choose_config)
from dsv4_jax.params import abstract_params

BF16 = jnp.bfloat16
H, D = 64, 128
_LAUNCH = "call @call_wrapper"
_SPLIT_LAUNCH = ":7 = stablehlo.custom_call"   # the split top-k: counts, 4 scratch, values, ids


def exact_inputs(b, s, n, seed=0, visible=None):
    """Inputs whose head sums are exact in f32, so any addition order gives the reference's
    bits: q and keys in {0, +-0.5, +-1} (dot products multiples of 1/4, |dot| <= 128, exact
    in bf16 up to 64), weights in {0, +-1/4, +-1/2, +-1} (exact products); the 64 terms of a
    sum then span under 24 bits."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-2, 3, (b, s, H, D)) * 0.5
    keys = rng.integers(-2, 3, (b, n, D)) * 0.5
    weights = rng.choice([0.0, 0.25, -0.25, 0.5, -0.5, 1.0, -1.0], (b, s, H))
    if visible is None:
        visible = rng.integers(0, n + 1, (b, s))
        visible.flat[0] = n
    return (jnp.asarray(q, BF16), jnp.asarray(weights, BF16), jnp.asarray(keys, BF16),
            jnp.asarray(visible, jnp.int32))


def generic_inputs(b, s, n, seed=0):
    """Normal q, keys and weights: sums need not be exact in f32."""
    kq, kk, kw = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, s, H, D), BF16)
    keys = jax.random.normal(kk, (b, n, D), BF16)
    weights = jax.random.normal(kw, (b, s, H), BF16)
    return q, weights, keys, jnp.full((b, s), n, jnp.int32)


# ----------------------------------------------------------------------------- CPU
def test_config_limits_and_grid():
    assert DEFAULT_CONFIG.smem_bytes() <= SMEM_BYTES
    assert DEFAULT_CONFIG.tokens_per_cta == 4
    with pytest.raises(ValueError, match="tokens_per_warpgroup must be 1 or 2, got 3"):
        IndexScoresSm90Config(tokens_per_warpgroup=3)
    with pytest.raises(ValueError, match=r"num_stages must be in \[2, 4\], got 5"):
        IndexScoresSm90Config(num_stages=5)
    # prefill: the queries fill the GPU, the entries are not split
    assert DEFAULT_CONFIG.grid(1, 4096, 32768) == (1024, 1, 1)
    # decode: one query per row, the entries split among ~TARGET_CTAS CTAs
    groups, splits, batch = DEFAULT_CONFIG.grid(8, 1, 262144)
    assert (groups, batch) == (1, 8) and splits * 8 >= TARGET_CTAS and splits * 7 < TARGET_CTAS
    assert DEFAULT_CONFIG.grid(1, 1, 300) == (1, 3, 1)            # never more than the blocks
    # a decode row: both warpgroups on its query, half a block each; a speculative row (two
    # queries): one query per warpgroup; a longer one the default
    assert choose_config(1) == DECODE_CONFIG and DECODE_CONFIG.split_n
    assert DECODE_CONFIG.tokens_per_cta == 1 and DECODE_CONFIG.skip_invisible
    assert choose_config(2) == PAIR_CONFIG and PAIR_CONFIG.tokens_per_cta == 2
    assert choose_config(3) == DEFAULT_CONFIG and DEFAULT_CONFIG.skip_invisible
    assert DECODE_CONFIG.smem_bytes() <= SMEM_BYTES and PAIR_CONFIG.smem_bytes() <= SMEM_BYTES
    # split_n: one query per CTA, each math warpgroup half of every block
    split = IndexScoresSm90Config(1, 2, True, True)
    assert (split.tokens_per_cta, split.n_tile) == (1, BLOCK_N // 2)
    assert split.grid(1, 3, 1024) == (3, 8, 1)
    with pytest.raises(ValueError, match="split_n needs tokens_per_warpgroup 1, got 2"):
        IndexScoresSm90Config(2, 3, True, True)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(heads=32), "32 heads of width 128"),
    (dict(dim=64), "64 heads of width 64"),
    (dict(dtype="float32"), "q float32 (the kernel takes bfloat16)"),
    (dict(key_dtype="float32"), "keys float32"),
    (dict(key_dtype="uint8", key_row_bytes=64), "uint8 key rows of 64 bytes"),
    (dict(entries=0), "empty"),
    (dict(batch=70000), "more CTAs than the grid takes"),
])
def test_support_names_the_reason(kwargs, reason):
    supported = dict(heads=64, dim=128, dtype="bfloat16", key_dtype="bfloat16", batch=2,
                     tokens=3, entries=500, width=500)
    assert DEFAULT_CONFIG.is_supported(**supported) == (True, "")
    ok, why = DEFAULT_CONFIG.is_supported(**(supported | kwargs))
    assert not ok and reason in why


def test_the_kernel_block_rule():
    budget = indexer_sm90.KERNEL_SCORE_BUDGET_BYTES
    assert indexer_sm90.choose_kernel_block(8, 1, 262144, 512) == 262144    # decode: one
    assert indexer_sm90.choose_kernel_block(1, 4096, 32768, 512) == 32768   # fits: one
    for n in (32768 + 1024, 131072, 131072 + 77):
        block = indexer_sm90.choose_kernel_block(1, 4096, n, 512)
        blocks = -(-n // block)
        assert block % BLOCK_N == 0 and 2 * 4096 * block <= budget
        assert blocks == -(-n // (budget // (2 * 4096)))        # no more blocks than needed
        assert blocks * block - n < blocks * BLOCK_N            # equal widths, no waste
    # never below k: the first merge is one block
    assert indexer_sm90.choose_kernel_block(64, 65536, 10000, 1000) == 1024


@pytest.mark.parametrize("tokens_per_warpgroup, num_stages, skip_invisible, split_n", [
    (1, 3, False, False), (2, 3, False, False), (2, 3, True, False), (1, 2, True, False),
    (1, 2, True, True)])
def test_kernel_compiles_for_sm90a(tokens_per_warpgroup, num_stages, skip_invisible, split_n):
    """Per query of a math warpgroup: 8 WGMMAs (K = 128), 16 bf16x2 weight products per row
    pair (``split_n``: 8, half the entries), a 28-shuffle reduce-scatter (14) and one score
    store (``skip_invisible``: one more, the -inf of a skipped block); no local memory."""
    pytest.importorskip("cutlass")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    from dsv4_jax.kernels import index_scores_sm90 as kernel
    b, s, n, w = (cute.sym_int() for _ in range(4))
    bf = lambda shape: make_fake_compact_tensor(cutlass.BFloat16, shape, assumed_align=16)
    i32 = lambda shape: make_fake_compact_tensor(cutlass.Int32, shape, assumed_align=4)
    compiled = cute.compile(kernel.index_scores_launcher, make_fake_stream(),
                            bf((b, s, H, D)), bf((b, s, H)), bf((b, n, D)), i32((b, s)),
                            i32((1,)), bf((b, s, w)), splits=3,
                            tokens_per_warpgroup=tokens_per_warpgroup, num_stages=num_stages,
                            skip_invisible=skip_invisible, split_n=split_n)
    ptx = compiled.artifacts.PTX
    tpw = tokens_per_warpgroup
    n_tiles = BLOCK_N // 8 // (2 if split_n else 1)
    assert ".target sm_90a" in ptx
    assert ptx.count("wgmma.mma_async") == 8 * tpw
    assert ptx.count("mul.rn.bf16x2") == 2 * n_tiles * tpw
    assert ptx.count("shfl.sync.bfly") >= (28 if not split_n else 14) * tpw
    assert ptx.count("st.global") == tpw * (2 if skip_invisible else 1)
    assert "ld.local" not in ptx and "st.local" not in ptx
    # Q tiles (8 rows per pass, 64 rows per query; split_n: one query per CTA) and the key
    # block, 16 B each
    queries = 1 if split_n else 2 * tpw
    assert ptx.count("cp.async.cg.shared.global") == 8 * queries + BLOCK_N // 8


@pytest.mark.parametrize("has_running", [False, True])
def test_topk_kernel_compiles_for_sm90a(has_running):
    """Three shared-memory atomics (two histograms, the slot counter), one ballot per round,
    two global stores (values, ids); no local memory."""
    pytest.importorskip("cutlass")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    from dsv4_jax.kernels import index_topk_sm90 as kernel
    r, w, kr = (cute.sym_int() for _ in range(3))
    bf = lambda shape: make_fake_compact_tensor(cutlass.BFloat16, shape, assumed_align=16)
    i32 = lambda shape: make_fake_compact_tensor(cutlass.Int32, shape, assumed_align=4)
    compiled = cute.compile(kernel.index_topk_launcher, make_fake_stream(), bf((r, w)),
                            bf((r, kr)), i32((r, kr)), i32((1,)), bf((r, 512)), i32((r, 512)),
                            k=512, has_running=has_running)
    ptx = compiled.artifacts.PTX
    assert ".target sm_90a" in ptx
    assert ptx.count("atom.shared") == 3 and ptx.count("vote.sync.ballot") == 1
    assert ptx.count("st.global") == 2
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_split_topk_kernel_compiles_for_sm90a():
    """Four kernels (two histograms, collect, finish); 16-byte score loads in each of the three
    segment passes; three global atomics (two histogram adds, the slot counter); no local
    memory."""
    pytest.importorskip("cutlass")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    from dsv4_jax.kernels import index_topk_split_sm90 as kernel
    r, w, s = (cute.sym_int() for _ in range(3))
    bf = lambda shape: make_fake_compact_tensor(cutlass.BFloat16, shape, assumed_align=16)
    i32 = lambda shape: make_fake_compact_tensor(cutlass.Int32, shape, assumed_align=4)
    for vector in (True, False):
        compiled = cute.compile(kernel.index_topk_split_launcher, make_fake_stream(),
                                bf((r, w)), i32((r, kernel.COUNT_WORDS)), i32((1,)),
                                i32((r, 512)), i32((r, 512)), i32((r, s)), i32((r, s, 512)),
                                bf((r, 512)), i32((r, 512)), k=512, vector=vector)
        ptx = compiled.artifacts.PTX
        assert ".target sm_90a" in ptx and ptx.count(".entry") == 4
        assert ptx.count("ld.global.v4") == (3 if vector else 0)
        assert ptx.count("atom.global") == 3
        assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("rows, n, block, launches, split", [
    (8, 20000, None, 2, True), (8, 1000, None, 2, False), (256, 1000, None, 2, False),
    (8, 20000, 4096, 2, False)])
def test_the_merge_follows_the_row_count(rows, n, block, launches, split):
    """The score kernel and the top-k kernel from TOP_K_ROWS query rows on (a prefill chunk)
    and for fewer rows over one block of fewer than SPLIT_MIN_WIDTH entries (a decode step at
    a short context); the score kernel and the split top-k kernels for fewer rows over one
    block of at least SPLIT_MIN_WIDTH entries (a decode step at a long context); the score
    kernel twice (the first block, then the loop's) and XLA's top-k in parts for a few rows
    over several blocks."""
    pytest.importorskip("cutlass")
    S = jax.ShapeDtypeStruct
    args = (S((1, rows, H, D), BF16), S((1, rows, H), BF16), S((1, n, D), BF16),
            S((1, rows), jnp.int32))
    fn = jax.jit(lambda *a: index_topk(*a, 512, block=block, implementation="cute"))
    with dispatch.cuda_target():
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(_LAUNCH) == launches
    assert (_SPLIT_LAUNCH in text) == split


def _lower_model(index_impl, max_len=256):
    """A quantised tiny model with the indexer's real head count, lowered for a Hopper GPU
    (the decode step of a batch of 2 over a ``max_len``-token cache)."""
    cfg = dj.Config.tiny(quantized=True, index_n_heads=H, index_head_dim=D)
    others = {"moe_experts": "xla", "sparse_attention": "xla", "grouped_gemm": "xla",
              "hc_pre": "xla", "hc_split_sinkhorn": "xla", "hc_stream_mixes": "xla",
              "moe_router": "xla", "index_topk": index_impl}
    model = dj.DSV4(cfg, implementation=KernelPolicy(ops=others), runtime_checks=False)
    params = abstract_params(cfg)
    cache = jax.eval_shape(lambda: dj.Cache.init(cfg, 2, max_len))
    tok = jax.ShapeDtypeStruct((2, 1), jnp.int32)
    step = jax.jit(lambda p, t, c: model.apply({"params": p}, t, c, logits_at="last"))
    with dispatch.cuda_target():
        text = step.trace(params, tok, cache).lower(lowering_platforms=("cuda",)).as_text()
    return cfg, text


def test_the_models_step_lowers_to_the_indexer_kernels():
    """Per CSA layer of the decode step, one score launch (the table is one block) and one
    top-k launch (the tiny table is short: the one-CTA kernel, not the split), none when the
    op runs its reference."""
    pytest.importorskip("cutlass")
    cfg, text = _lower_model("cute")
    csa = sum(1 for i in range(cfg.n_layers) if cfg.layer_kind(i) == "csa")
    assert csa >= 1 and text.count(_LAUNCH) == 2 * csa and _SPLIT_LAUNCH not in text
    assert _LAUNCH not in _lower_model("xla")[1]


def test_a_long_caches_decode_step_lowers_to_the_split_topk():
    """With a long cache (CSA tables of SPLIT_MIN_WIDTH entries) each CSA layer's decode step
    runs the score kernel and the split top-k."""
    pytest.importorskip("cutlass")
    cfg, text = _lower_model("cute", max_len=4 * indexer_sm90.SPLIT_MIN_WIDTH)
    csa = sum(1 for i in range(cfg.n_layers) if cfg.layer_kind(i) == "csa")
    assert text.count(_LAUNCH) == 2 * csa and _SPLIT_LAUNCH in text


# ----------------------------------------------------------------------------- GPU
def _reference_block(q, weights, keys, limit, lo, width):
    n = keys.shape[1]
    padded = jnp.pad(keys, ((0, 0), (0, max(0, lo + width - n)), (0, 0)))
    return _scores(q, weights, padded[:, lo:lo + width], lo, limit)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("config", [IndexScoresSm90Config(), DEFAULT_CONFIG, PAIR_CONFIG,
                                    DECODE_CONFIG, IndexScoresSm90Config(1, 3, False, True)],
                         ids=["2x3", "2x3-skip", "1x2-skip", "1x2-skip-splitn", "1x3-splitn"])
@pytest.mark.parametrize("b, s, n, lo, width", [
    (1, 1, 1024, 0, 1024),        # decode, one block per CTA split
    (8, 1, 5000, 0, 5000),        # decode batch 8, N not a multiple of the block
    (3, 5, 1000, 0, 1000),        # S not a multiple of the CTA's 4 queries
    (2, 9, 700, 128, 384),        # a later block: lo > 0, ending past N
    (1, 64, 4096, 0, 4096),       # a prefill chunk
    (1, 300, 2048, 1024, 1024),   # many query groups, one split each
])
def test_scores_equal_the_reference_bit_for_bit(b, s, n, lo, width, config):
    """Random visible counts (one row sees everything): with ``skip_invisible`` the CTAs
    past their queries' counts write -inf without loading keys, the same scores."""
    q, weights, keys, visible = exact_inputs(b, s, n, seed=b + s)
    limit = jnp.minimum(visible, n)
    got = jax.jit(lambda *a: indexer_sm90.index_scores_cute(*a, jnp.int32(lo), width, config))(
        q, weights, keys, limit)
    want = jax.jit(lambda *a: _reference_block(*a, lo, width))(q, weights, keys, limit)
    assert got.shape == (b, s, width) and got.dtype == BF16
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(want).any()
    np.testing.assert_array_equal(got, want)
    # the sign of zero too (+0 / -0 sums)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.gpu
@pytest.mark.parametrize("b, s, n, k, block", [
    (8, 1, 3000, 512, None),      # decode: one block, one top-k
    (1, 1, 1024, 512, None),
    (2, 7, 1000, 100, 256),       # several blocks merged, the last one partial
    (1, 33, 600, 700, None),      # k > N: every visible entry, then -1
    (1, 256, 8192, 512, 2048),    # a prefill chunk over four blocks
])
def test_ids_equal_the_reference(b, s, n, k, block):
    args = exact_inputs(b, s, n, seed=n)
    got = jax.jit(lambda *a: index_topk(*a, k, block=block, implementation="cute"))(*args)
    want = jax.jit(lambda *a: index_topk(*a, k, block=block, implementation="xla"))(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def tied_scores(rows, width, seed):
    """bf16 scores of eight levels (many ties), +0 and -0, and -inf entries."""
    rng = np.random.default_rng(seed)
    levels = np.array([-np.inf, -2.0, -0.0, 0.0, 0.5, 1.0, 3.0, 1e30], np.float32)
    return jnp.asarray(levels[rng.integers(0, 8, (rows, width))], BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("lead, width, kk, running", [
    ((3,), 1000, 512, False),          # a first step
    ((2, 3), 700, 300, True),          # a merge, k not a power of two, [B, S] rows
    ((2,), 262144, 512, False),        # a decode step over a 1M-token context
    ((64,), 4096, 512, True),
    ((1, 5), 2000, 16, True),
])
def test_topk_kernel_equals_the_reference_selection(lead, width, kk, running):
    """Values bit for bit and ids equal to ``select_reference`` (ties to the earlier
    candidate; -0 below +0), with and without a running set from an earlier block."""
    score = tied_scores(int(np.prod(lead)), width, width).reshape(*lead, width)
    state, lo = None, jnp.int32(0)
    if running:
        state = select_reference(tied_scores(int(np.prod(lead)), kk + 5, 1).reshape(
            *lead, kk + 5), kk, jnp.int32(0))
        lo = jnp.int32(kk + 5)
    got = jax.jit(lambda x, st: indexer_sm90.select_cute(x, kk, lo, st))(score, state)
    want = jax.jit(lambda x, st: select_reference(x, kk, lo, st))(score, state)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    got_v, want_v = (np.asarray(v).view(np.uint16) for v in (got[0], want[0]))
    np.testing.assert_array_equal(got_v, want_v)


def sparse_finite_scores(rows, width, finite, seed):
    """Rows with only ``finite`` real scores, the rest -inf (a context shorter than k in a
    large table): the -inf ties must go to the lowest positions."""
    rng = np.random.default_rng(seed)
    score = np.full((rows, width), -np.inf, np.float32)
    for r in range(rows):
        pos = rng.choice(width, finite, replace=False)
        score[r, pos] = rng.integers(-8, 9, finite) * 0.25
    return jnp.asarray(score, BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("lead, width, kk, kind", [
    ((1,), 262144, 512, "tied"),       # a decode step at a 1M-token context
    ((8,), 262144, 512, "tied"),       # batch 8
    ((2,), 262144, 1024, "normal"),    # Pro's k, few ties
    ((2, 3), 4100, 300, "tied"),       # [B, S] rows, k not a power of two, a partial segment
    ((3,), 1001, 512, "tied"),         # W not a multiple of 8: element loads
    ((2,), 600, 600, "normal"),        # k == W: every entry
    ((4,), 65536, 512, "sparse"),      # fewer real scores than k: the -inf ties by position
])
def test_split_topk_equals_the_reference_selection(lead, width, kk, kind):
    """Values bit for bit and ids equal to ``select_reference`` (ties to the earlier entry;
    -0 below +0)."""
    rows = int(np.prod(lead))
    if kind == "tied":
        score = tied_scores(rows, width, width)
    elif kind == "sparse":
        score = sparse_finite_scores(rows, width, 300, width)
    else:
        score = jax.random.normal(jax.random.key(width), (rows, width), BF16)
    score = score.reshape(*lead, width)
    lo = jnp.int32(7)
    got = jax.jit(lambda x: indexer_sm90.select_split_cute(x, kk, lo))(score)
    want = jax.jit(lambda x: select_reference(x, kk, lo))(score)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    got_v, want_v = (np.asarray(v).view(np.uint16) for v in (got[0], want[0]))
    np.testing.assert_array_equal(got_v, want_v)


@pytest.mark.gpu
def test_generic_inputs_differ_by_at_most_an_f32_rounding():
    """Normal inputs: the kernel's head sum adds in another order than XLA's, so a score may
    differ by one bf16 step where the f32 sum sat on a rounding boundary; nearly all are
    equal, and the selected sets nearly coincide."""
    b, s, n, k = 2, 16, 4096, 512
    q, weights, keys, visible = generic_inputs(b, s, n)
    limit = jnp.minimum(visible, n)
    got = np.asarray(jax.jit(lambda *a: indexer_sm90.index_scores_cute(
        *a, jnp.int32(0), n))(q, weights, keys, limit), np.float32)
    want = np.asarray(jax.jit(lambda *a: _reference_block(*a, 0, n))(q, weights, keys, limit),
                      np.float32)
    ulp = np.abs(want) * 2.0 ** -7 + 1e-30
    assert (np.abs(got - want) <= ulp).all()
    assert (got == want).mean() > 0.99
    ids = np.asarray(index_topk(q, weights, keys, visible, k, implementation="cute"))
    ref = np.asarray(index_topk(q, weights, keys, visible, k, implementation="xla"))
    overlap = np.mean([len(set(a) & set(r)) / k for a, r in zip(ids.reshape(-1, k),
                                                                 ref.reshape(-1, k))])
    assert overlap > 0.99
