"""The FP8 compressed-entry cache (``Cache.init(kv_dtype="fp8"|"fp8+fp4")``, ``kv_entry``):
the row format against the FP8 simulation, the op reading FP8 rows, the model and
``generate`` with an FP8 cache against a BF16 one (bit for bit under the simulation), bad
input; on the GPU the kernel reading FP8 rows against the kernel reading their BF16 values."""
import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import dsv4_jax as dj
from dsv4_jax import kv_entry, plan, quant
from dsv4_jax.ffi import sparse_attention, sparse_attention_reference
from dsv4_jax.ffi.sparse_attention import (SparseAttentionSm90Config, bounded_extra_idx,
                                           sparse_attention_cute)
from dsv4_jax.kernels import sparse_attention_config as kernel_config
from model_lowering import cute_calls, lower_decode_step

SCALE = 512 ** -0.5


def bits(x):
    x = jnp.asarray(x)
    return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16 if x.dtype.itemsize == 2
                                                   else jnp.uint32))


def entries(seed, shape, d=512):
    """BF16 entries whose 64-dim blocks span many magnitudes, with zeros, -0 and tiny blocks
    (below the scale floor)."""
    key1, key2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(key1, (*shape, d)) * jnp.exp(
        3.0 * jax.random.normal(key2, (*shape, d // 64, 1))).repeat(64, -1).reshape(*shape, d)
    x = x.astype(jnp.bfloat16).reshape(-1, d)
    x = x.at[0, :64].set(0).at[0, 70].set(-0.0).at[1, 64:128].multiply(1e-7)
    return x.reshape(*shape, d)


def simulated(x, rope=64):
    n = x.shape[-1] - rope
    return jnp.concatenate([quant.fp8_simulate(x[..., :n], 64), x[..., n:]], -1)


# ----------------------------------------------------------------------------- the format

def test_entry_layout_is_the_kernels():
    assert kv_entry.entry_bytes(512, 64) == kernel_config.FP8_ENTRY_BYTES == 584
    assert kernel_config.FP8_NOPE_DIM == kernel_config.FP8_ROPE_OFFSET == 448
    assert kernel_config.FP8_SCALE_OFFSET == 448 + 2 * 64
    assert kv_entry.rope_dim_of(584, 512) == 64
    assert kv_entry.rope_dim_of(1024, 512) is None


def test_decode_of_encode_is_the_fp8_simulation_bit_for_bit():
    x = entries(0, (7, 5))
    rows = kv_entry.encode(x, 64)
    assert rows.shape == (7, 5, 584) and rows.dtype == jnp.uint8
    np.testing.assert_array_equal(bits(kv_entry.decode(rows, 512)), bits(simulated(x)))
    # simulated entries (what the model stores) round-trip unchanged
    again = kv_entry.decode(kv_entry.encode(simulated(x), 64), 512)
    np.testing.assert_array_equal(bits(again), bits(simulated(x)))
    # f32 entries decode to the f32 values of the same simulation
    x32 = x.astype(jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(kv_entry.decode(kv_entry.encode(x32, 64), 512, jnp.float32)[..., :448]),
        np.asarray(quant.fp8_simulate(x32[..., :448], 64)))


def test_row_bytes_sit_where_the_layout_says():
    x = jnp.zeros((512,), jnp.float32)
    x = x.at[0].set(448.0 * 4).at[64].set(-1.0).at[448].set(1.5).at[511].set(-2.0)
    row = np.asarray(kv_entry.encode(x, 64))
    # block 0: scale 4 = 2^2 (E8M0 byte 129), code 448 = 0x7e; block 1: -1 -> scale
    # 2^ceil(log2(1/448)) = 2^-8, code -256 = 0xf8
    assert row[0] == 0x7E and row[576] == 129
    assert row[64] == 0xF8 and row[577] == 127 - 8
    # RoPE dims: BF16 little-endian (1.5 = 0x3fc0, -2 = 0xc000)
    assert tuple(row[448:450]) == (0xC0, 0x3F) and tuple(row[574:576]) == (0x00, 0xC0)
    assert row[583] == 0 and row.shape == (584,)


def test_the_options_offer_the_caches_kv_dtypes():
    from dsv4_jax import generation_options
    assert generation_options.KV_DTYPES == kv_entry.KV_DTYPES


def test_bad_layouts_and_kv_dtypes_raise_naming_them():
    with pytest.raises(ValueError, match="head_dim - rope_dim"):
        kv_entry.entry_bytes(512, 60)
    with pytest.raises(ValueError, match="no FP8 entry layout"):
        kv_entry.decode(jnp.zeros((2, 600), jnp.uint8), 512)
    cfg = dj.Config.tiny()
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        dj.Cache.init(cfg, 1, 256, kv_dtype="fp16")
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        dj.Cache.init(cfg, 1, 256, kv_dtype=jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="must be bfloat16, got float32"):
        dj.Cache.init(cfg, 1, 256, jnp.float32, kv_dtype="fp8")


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8+fp4"])
def test_fp8_cache_holds_uint8_rows_for_the_compressed_tables_and_fp4_keys_only(kv_dtype):
    cfg = dj.Config.tiny()
    plain, fp8 = dj.Cache.init(cfg, 2, 512), dj.Cache.init(cfg, 2, 512, kv_dtype=kv_dtype)
    assert plain.kv_dtype is None and fp8.kv_dtype == kv_dtype
    saved = 0
    for a, b in zip(plain.layers, fp8.layers):
        assert b.window.dtype == a.window.dtype == jnp.bfloat16
        if a.compressed is not None:
            assert b.compressed.shape == a.compressed.shape[:2] + (584,)
            assert b.compressed.dtype == jnp.uint8
            saved += a.compressed.nbytes - b.compressed.nbytes
        if a.index_keys is not None and kv_dtype == "fp8+fp4":   # 64 codes, 4 scales, 4 pad
            assert b.index_keys.shape == a.index_keys.shape[:2] + (72,)
            assert b.index_keys.dtype == jnp.uint8
            saved += a.index_keys.nbytes - b.index_keys.nbytes
        elif a.index_keys is not None:
            assert b.index_keys.dtype == jnp.bfloat16
    assert plain.nbytes() - fp8.nbytes() == saved > 0
    reset = fp8.reset_rows(jnp.array([True, False]))
    assert reset.kv_dtype == kv_dtype


def test_plan_sizes_the_fp8_cache():
    """Flash per 1k tokens of one sequence: CSA layers add 256 entries and 256 indexer keys,
    HCA layers 8 entries; an entry 1024 bytes in BF16, 584 in FP8; a key 256 bytes, 72 as
    MXFP4 (``fp8+fp4``)."""
    flash = dj.Config.flash(quantized=True)
    mesh = dj.sharding.make_mesh(data=1, expert=1)
    ratios = flash.compress_ratios[:flash.n_layers]
    csa, hca = ratios.count(4), ratios.count(128)
    for kv_dtype, entry, key in ((None, 1024, 256), ("fp8", 584, 256), ("fp8+fp4", 584, 72)):
        per_1k = (plan.cache_bytes_per_device(flash, mesh, 1, 2048, kv_dtype)
                  - plan.cache_bytes_per_device(flash, mesh, 1, 1024, kv_dtype))
        assert per_1k == csa * 256 * (entry + key) + hca * 8 * entry, kv_dtype


# ----------------------------------------------------------------------------- the op (CPU)

def op_case(seed, t, h, k, k2, n, m):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((t, h, 512)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((n, 512)), jnp.bfloat16)
    idx = rng.integers(-1, n + 3, (t, k)).astype(np.int32)
    xidx = rng.integers(-1, m + 3, (t, k2)).astype(np.int32)
    xidx[:, 0] = m                      # == pool size: unused
    if t > 1:
        idx[t // 2], xidx[t // 2] = -1, -1     # a token with nothing to attend
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    rows = kv_entry.encode(entries(seed, (m,)), 64)
    return q, kv, jnp.asarray(idx), sink, rows, jnp.asarray(xidx)


@pytest.mark.parametrize("t", [3, 300])          # one chunk and the reference's token map
def test_reference_reads_fp8_rows_as_their_bf16_values(t):
    q, kv, idx, sink, rows, xidx = op_case(1, t, 4, 16, 24, 50, 70)
    fp8 = sparse_attention_reference(q, kv, idx, sink, extra_kv=rows, extra_idx=xidx,
                                     scale=SCALE)
    bf16 = sparse_attention_reference(q, kv, idx, sink, extra_kv=kv_entry.decode(rows, 512),
                                      extra_idx=xidx, scale=SCALE)
    for a, b in zip(fp8, bf16):
        np.testing.assert_array_equal(bits(a), bits(b))
    assert np.all(np.asarray(fp8[1][t // 2]) == -np.inf)


def test_the_kernel_refuses_a_split_qk_config_for_fp8_rows():
    """An explicit ``qk_split=True`` with an FP8 second pool is refused before any compile
    (it would deadlock on the GPU), in one line naming the reason."""
    q, kv, idx, sink, rows, xidx = op_case(3, 2, 64, 128, 16, 256, 128)
    with pytest.raises(ValueError, match="qk_split=True with an FP8 second pool"):
        sparse_attention_cute(q, kv, idx, sink, extra_kv=rows, extra_idx=xidx, scale=SCALE,
                              config=SparseAttentionSm90Config(64, 2, True))


def test_the_policys_attention_config_reaches_the_models_kernel():
    """``KernelPolicy.sparse_attention`` is the config the model's attention launches with:
    a split QK^T over FP8 tables is refused when the decode step is lowered."""
    cfg = dj.Config.tiny(n_heads=64, o_groups=8)
    cache = jax.eval_shape(lambda: dj.Cache.init(cfg, 2, 256, kv_dtype="fp8"))
    for config, ok in ((SparseAttentionSm90Config(64, 2, False), True),
                       (SparseAttentionSm90Config(64, 2, True), False)):
        policy = dj.KernelPolicy(implementation="xla", ops={"sparse_attention": "cute"},
                                 sparse_attention=config)
        model = dj.DSV4(cfg, implementation=policy, runtime_checks=False)
        if ok:
            assert cute_calls(lower_decode_step(model, cfg, cache))
        else:
            with pytest.raises(ValueError, match="qk_split=True with an FP8 second pool"):
                lower_decode_step(model, cfg, cache)


def test_op_rejects_fp8_rows_of_another_width():
    q, kv, idx, sink, rows, xidx = op_case(2, 2, 4, 8, 8, 10, 10)
    with pytest.raises(ValueError, match=r"uint8 extra_kv must be \[M, W\] FP8 entry rows"):
        sparse_attention(q, kv, idx, sink, extra_kv=rows[:, :576], extra_idx=xidx,
                         scale=SCALE, implementation="xla")
    with pytest.raises(TypeError, match="extra_kv dtype must equal q dtype"):
        sparse_attention(q, kv, idx, sink, extra_kv=rows.astype(jnp.int8)[:, :512],
                         extra_idx=xidx, scale=SCALE, implementation="xla")


def test_kernel_support_takes_the_official_rows_only():
    cfg = SparseAttentionSm90Config()
    common = dict(dtype="bfloat16", head_dim=512, num_heads=64, num_tokens=1,
                  window_slots=128, pool_rows=256, extra_slots=512, extra_rows=1000)
    assert cfg.is_supported(**common, extra_entry_bytes=584) == (True, "")
    ok, why = cfg.is_supported(**common, extra_entry_bytes=592)
    assert not ok and "592" in why
    # The FP8 producer's late commit and the split QK^T's look-ahead would deadlock: a launch
    # with one split resolves to the ping-pong QK^T, and an explicit split is refused.
    assert cfg.resolve(1, extra_fp8=True).qk_split is False
    assert cfg.resolve(1).qk_split is True
    ok, why = SparseAttentionSm90Config(64, 2, True).is_supported(**common, extra_entry_bytes=584)
    assert not ok and "qk_split=True with an FP8 second pool" in why


# ----------------------------------------------------------------------------- the model (CPU)

def prefill_then_decode(model, params, toks, prefill, cache):
    fwd = jax.jit(lambda t, c: model.apply({"params": params}, t, c))
    logits, cache = fwd(toks[:, :prefill], cache)
    steps = [logits]
    for i in range(prefill, toks.shape[1]):
        logits, cache = fwd(toks[:, i:i + 1], cache)
        steps.append(logits)
    return np.asarray(jnp.concatenate(steps, 1), np.float32), cache


def test_model_with_an_fp8_cache_gives_the_bf16_caches_logits():
    """Under the FP8 simulation the FP8 rows hold exactly the BF16 cache's entries: prefill
    (CSA and HCA entries emitted, the CSA top-k sparse) and decode across block boundaries
    give the same logits bit for bit, and the decoded tables equal the BF16 tables (the
    official weight format; the cache path does not depend on how the weights are stored)."""
    cfg = dj.Config.tiny(quantized=True)
    model = dj.DSV4(cfg, implementation="xla", runtime_checks=False)
    params = dj.init_params(cfg, 0)
    toks = jax.random.randint(jax.random.key(3), (2, 140), 0, cfg.vocab_size)
    out = {}
    for kv_dtype in (None, "fp8", "fp8+fp4"):
        cache = dj.Cache.init(cfg, 2, 256, kv_dtype=kv_dtype)
        out[kv_dtype] = prefill_then_decode(model, params, toks, 129, cache)
    for compact in ("fp8", "fp8+fp4"):
        np.testing.assert_array_equal(out[compact][0], out[None][0])
        for a, b in zip(out[None][1].layers, out[compact][1].layers):
            if a.compressed is not None:
                np.testing.assert_array_equal(bits(kv_entry.decode(b.compressed, 512)),
                                              bits(a.compressed))
                assert np.any(np.asarray(a.compressed) != 0)
            if a.index_keys is not None and compact == "fp8+fp4":
                np.testing.assert_array_equal(
                    bits(kv_entry.decode_index_keys(b.index_keys, a.index_keys.shape[-1])),
                    bits(a.index_keys))
                assert np.any(np.asarray(a.index_keys) != 0)


def test_decode_step_lowers_to_the_kernel_reading_the_fp8_tables():
    """The model's decode step for a Hopper GPU (lowered on CPU): each CSA/HCA layer's
    attention kernel takes its FP8 table as it is -- no decoded BF16 copy of a table."""
    cfg = dj.Config.tiny(n_heads=64, o_groups=8)
    others = {op: "xla" for op in ("grouped_gemm", "moe_experts", "hc_pre",
                                   "hc_split_sinkhorn", "moe_router", "index_topk")}
    model = dj.DSV4(cfg, implementation=dj.KernelPolicy(ops=others), runtime_checks=False)
    cache = jax.eval_shape(lambda: dj.Cache.init(cfg, 2, 256, kv_dtype="fp8"))
    text = lower_decode_step(model, cfg, cache)
    calls = cute_calls(text)
    for ratio in (4, 128):                          # the CSA and the HCA tables
        rows = 2 * 256 // ratio
        assert any(f"tensor<{rows}x584xui8>" in line for line in calls), ratio
        assert f"tensor<{rows}x512xbf16>" not in text, ratio


def test_generate_with_an_fp8_cache_gives_the_same_tokens():
    cfg = dj.Config.tiny()
    model, params = dj.DSV4(cfg, implementation="xla"), dj.init_params(cfg, 0)
    prompts = [list(range(3, 140)), [5, 6, 7]]
    plain = dj.generate(model, params, prompts, 12)
    fp8 = dj.generate(model, params, prompts, 12, kv_dtype="fp8")
    assert fp8.tokens == plain.tokens
    # speculative decoding commits the verified tokens into the FP8 tables too: the tokens of
    # speculative decoding over the BF16 cache. (Not plain's: in BF16 the verify step and the
    # decode step are two programs whose GEMMs round apart by an ulp at times, and a near-tie
    # in a router's top-k turns that into another token; test_generate checks speculative ==
    # plain in float32, with a prompt past the window.)
    spec = dj.generate(model, params, prompts, 12, speculative=True)
    spec_fp8 = dj.generate(model, params, prompts, 12, kv_dtype="fp8", speculative=True)
    assert spec_fp8.tokens == spec.tokens
    assert dj.generate(model, params, prompts, 12, kv_dtype="fp8+fp4").tokens == plain.tokens
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        dj.generate(model, params, prompts, 12, kv_dtype="int8")


# ----------------------------------------------------------------------------- the kernel (GPU)

Sm90 = SparseAttentionSm90Config
GPU_CASES = [  # (T, H, K, K2, N, M, config)
    (1, 64, 128, 512, 300, 2000, Sm90()),                  # Flash decode: splits + combine
    (2, 64, 128, 8192, 300, 9000, Sm90()),                 # HCA at 1M: 128 blocks per token
    (3, 128, 128, 1024, 500, 5000, Sm90(48, 3, False)),    # Pro heads, 48-entry blocks
    (5, 64, 100, 300, 777, 999, Sm90(64, 2, False)),       # a block straddles both pools
    (300, 64, 128, 16, 256, 128, Sm90()),   # the tiny model's prefill: one split, 3 blocks
    (64, 64, 128, 512, 2000, 20000, Sm90()),               # prefill-sized: QK^T split
    (130, 64, 128, 512, 20000, 20000, Sm90(64, 2, False)),  # two waves
]


@pytest.mark.gpu
@pytest.mark.parametrize("t, h, k, k2, n, m, config", GPU_CASES)
def test_kernel_on_fp8_rows_equals_the_kernel_on_their_bf16_values(t, h, k, k2, n, m, config):
    """The kernel widens each row to exactly the BF16 row the BF16 pool holds, so both launches
    compute the same thing in the same order: equal bit for bit (and near the reference)."""
    q, kv, idx, sink, rows, xidx = op_case(10 + t, t, h, k, k2, n, m)
    # FP8 rows never split QK^T (``resolve``); the BF16 launch is pinned to the same schedule,
    # or a QK^T split there would sum in another order
    pinned = config if config.qk_split is not None else dataclasses.replace(config, qk_split=False)
    poisoned = dataclasses.replace(pinned, poison=float("nan"))
    f = jax.jit(lambda q, kv, i, s, x, xi: sparse_attention_cute(
        q, kv, i, s, extra_kv=x, extra_idx=xi, scale=SCALE, config=poisoned))
    o8, lse8 = f(q, kv, idx, sink, rows, xidx)
    o16, lse16 = f(q, kv, idx, sink, kv_entry.decode(rows, 512), xidx)
    np.testing.assert_array_equal(bits(o8), bits(o16))
    np.testing.assert_array_equal(bits(lse8), bits(lse16))
    # and the reference at bf16 level, per token (test_sparse_attention's criterion)
    ref_o, ref_lse = (np.asarray(x, np.float32) for x in sparse_attention_reference(
        q, kv, idx, sink, extra_kv=rows, extra_idx=xidx, scale=SCALE))
    o8, lse8 = np.asarray(o8, np.float32), np.asarray(lse8)
    for tok in range(t):
        norm = np.linalg.norm(ref_o[tok])
        assert np.linalg.norm(o8[tok] - ref_o[tok]) <= 2e-2 * norm, tok
    np.testing.assert_array_equal(np.isneginf(lse8), np.isneginf(ref_lse))
    used = ~np.isneginf(ref_lse)
    np.testing.assert_allclose(lse8[used], ref_lse[used], rtol=1e-3, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("t, h, k, k2, n, m", [(2, 64, 128, 8192, 300, 9000),
                                              (300, 64, 128, 160, 256, 200)])
def test_kernel_on_fp8_rows_stops_at_each_tokens_bound(t, h, k, k2, n, m):
    """``extra_len`` with FP8 rows (an HCA layer over an FP8 cache): the producer's late
    commit runs over the bounded block count; bit for bit the BF16 launch with the same
    bound, and the reference with the ids past the bound set to -1."""
    q, kv, idx, sink, rows, xidx = op_case(40 + t, t, h, k, k2, n, m)
    rng = np.random.default_rng(t)
    bound = rng.integers(0, k2 + 1, t).astype(np.int32)
    bound[:2] = (0, 65)
    bound = jnp.asarray(bound)
    config = Sm90(64, 2, False, poison=float("nan"))
    f = jax.jit(lambda q, kv, i, s, x, xi, xl: sparse_attention_cute(
        q, kv, i, s, extra_kv=x, extra_idx=xi, extra_len=xl, scale=SCALE, config=config))
    o8, lse8 = f(q, kv, idx, sink, rows, xidx, bound)
    o16, lse16 = f(q, kv, idx, sink, kv_entry.decode(rows, 512), xidx, bound)
    np.testing.assert_array_equal(bits(o8), bits(o16))
    np.testing.assert_array_equal(bits(lse8), bits(lse16))
    masked = bounded_extra_idx(xidx, bound)
    ref_o, ref_lse = (np.asarray(x, np.float32) for x in sparse_attention_reference(
        q, kv, idx, sink, extra_kv=rows, extra_idx=masked, scale=SCALE))
    o8, lse8 = np.asarray(o8, np.float32), np.asarray(lse8)
    for tok in range(t):
        assert np.linalg.norm(o8[tok] - ref_o[tok]) <= 2e-2 * np.linalg.norm(ref_o[tok]), tok
    np.testing.assert_array_equal(np.isneginf(lse8), np.isneginf(ref_lse))


@pytest.mark.gpu
def test_model_on_gpu_with_an_fp8_cache_gives_the_bf16_caches_logits():
    """The attention kernel in the model (64 heads) reading the FP8 table: the same logits
    as with the BF16 table, prefill and decode, bit for bit, once both launch with the
    schedule FP8 rows take (no QK^T split; by default a BF16 prefill launch splits it)."""
    cfg = dj.Config.tiny(n_heads=64, o_groups=8, quantized=True)
    policy = dj.KernelPolicy(sparse_attention=Sm90(64, 2, False))
    model = dj.DSV4(cfg, implementation=policy, runtime_checks=False)
    params = dj.init_params(cfg, 0)
    toks = jax.random.randint(jax.random.key(0), (2, 160), 0, cfg.vocab_size)
    out = {}
    for kv_dtype in (None, "fp8"):
        out[kv_dtype], _ = prefill_then_decode(model, params, toks, 150,
                                               dj.Cache.init(cfg, 2, 256, kv_dtype=kv_dtype))
    np.testing.assert_array_equal(out["fp8"], out[None])
