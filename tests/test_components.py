"""Each DSV4 component against an independent formula (tests/np_reference.py), tiny config.

Float32 activations and ``quant_simulation=False`` isolate the math from the quantisation
steps (those are checked bit for bit in test_quant.py); tolerances are f32 vs f64.
"""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

import dsv4_jax as dj
from dsv4_jax.cache import init_layer_cache
from dsv4_jax.ffi import sparse_attention_reference
from dsv4_jax.ffi.hc_pre_reference import pending_total
from dsv4_jax.ffi.rope import head_rms_norm
from dsv4_jax import quant
from dsv4_jax.models import layers, mhc, moe
from dsv4_jax.models.attention import Attention, GroupedOutput, update_ring, window_indices
from dsv4_jax.models.compressor import Compressor, commit_compressor
from dsv4_jax.models.transformer import Block, DSV4

import np_reference as ref

CFG = dj.Config.tiny(dtype="float32", quant_simulation=False)


@pytest.fixture(scope="module")
def params():
    return dj.init_params(CFG, 0)


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


# ----------------------------------------------------------------------------- norms, RoPE
def test_rms_norm_and_head_norm():
    x = np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal(512).astype(np.float32)
    np.testing.assert_allclose(layers.rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6),
                               ref.rms_norm(x, w), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(head_rms_norm(jnp.asarray(x), 1e-6), ref.rms_norm(x),
                               rtol=2e-5, atol=1e-6)


def test_rope_tables_plain_and_yarn():
    plain = layers.rope_inv_freq(CFG, compressed=False)
    np.testing.assert_allclose(plain, ref.rope_freqs(64, 10000.0), rtol=1e-6)
    yarn = layers.rope_inv_freq(CFG, compressed=True)
    base = ref.rope_freqs(64, 160000.0)
    np.testing.assert_allclose(yarn, ref.rope_freqs(64, 160000.0, 65536, 16.0), rtol=1e-6)
    # computed correction range: pairs 0..15 unscaled, 25..31 divided by the factor 16
    np.testing.assert_allclose(yarn[:16], base[:16], rtol=1e-6)
    np.testing.assert_allclose(yarn[25:], base[25:] / 16, rtol=1e-6)
    assert np.all(yarn[16:25] < base[16:25]) and np.all(yarn[16:25] > base[16:25] / 16)


def test_rope_interleaved_pairs_and_inverse():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 3, 512)).astype(np.float32)
    pos = np.array([0, 1, 7, 1000, 70000])
    freqs = layers.rope_inv_freq(CFG, compressed=True)
    y = np.asarray(layers.rope_tail(jnp.asarray(x), jnp.asarray(pos)[:, None], freqs, 64))
    np.testing.assert_array_equal(y[..., :448], x[..., :448])         # no-RoPE dims untouched
    want = ref.rope(x[..., 448:], pos[:, None], freqs.astype(np.float64))
    np.testing.assert_allclose(y[..., 448:], want, rtol=1e-4, atol=2e-4)
    back = layers.rope_tail(jnp.asarray(y), jnp.asarray(pos)[:, None], freqs, 64, inverse=True)
    np.testing.assert_allclose(back, x, atol=1e-4)


# ----------------------------------------------------------------------------- mHC
def test_mhc_sinkhorn_pre_post_comb():
    rng = np.random.default_rng(3)
    mixes, scale, base = rng.standard_normal((6, 24)), rng.random(3) + 0.5, rng.standard_normal(24)
    pre, post, comb = mhc.split_sinkhorn(jnp.asarray(mixes, jnp.float32),
                                         jnp.asarray(scale, jnp.float32),
                                         jnp.asarray(base, jnp.float32), 4, 20, 1e-6)
    for i in range(6):
        p, q, c = ref.sinkhorn(mixes[i], scale, base)
        np.testing.assert_allclose(pre[i], p, rtol=1e-5)
        np.testing.assert_allclose(post[i], q, rtol=1e-5)
        np.testing.assert_allclose(comb[i], c, rtol=1e-4, atol=1e-6)
    # the last step normalises columns: combᵀ (what the residual uses) is row-stochastic
    np.testing.assert_allclose(np.asarray(comb).sum(axis=-2), 1.0, atol=1e-5)


def test_mhc_pre_collapse_and_post_uses_comb_transposed():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 4, 256)).astype(np.float32)
    fn = rng.standard_normal((24, 1024)).astype(np.float32) * 0.03
    mixes = np.asarray(mhc.stream_mixes(jnp.asarray(x), jnp.asarray(fn), 1e-6))
    flat = x.reshape(2, 3, 1024).astype(np.float64)
    want = flat @ fn.T.astype(np.float64) / np.sqrt((flat ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(mixes, want, rtol=1e-4, atol=1e-5)
    pre = rng.random((2, 3, 4)).astype(np.float32)
    y = np.asarray(mhc.collapse(jnp.asarray(x), jnp.asarray(pre)))
    np.testing.assert_allclose(y, np.einsum("bsj,bsjd->bsd", pre, x), rtol=1e-5, atol=1e-5)
    out = rng.standard_normal((2, 3, 256)).astype(np.float32)
    post = rng.random((2, 3, 4)).astype(np.float32)
    comb = rng.random((2, 3, 4, 4)).astype(np.float32)
    got = np.asarray(mhc.hc_post(jnp.asarray(out), jnp.asarray(x), jnp.asarray(post),
                                 jnp.asarray(comb)))
    want = np.zeros_like(x, np.float64)
    for k in range(4):
        want[:, :, k] = post[:, :, k, None] * out
        for j in range(4):
            want[:, :, k] += comb[:, :, j, k, None] * x[:, :, j]      # comb[j, k]: transposed
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_embedding_streams_and_final_head(params):
    model = DSV4(CFG)
    tokens = jnp.array([[3, 500, 17]])
    x = model.apply({"params": params}, tokens, method=DSV4.embed_streams)
    emb = np.asarray(params["embed"]["weight"])[np.asarray(tokens)]
    for j in range(CFG.hc_mult):
        np.testing.assert_array_equal(x[:, :, j], emb)
    h = np.random.default_rng(5).standard_normal((1, 3, 4, CFG.dim)).astype(np.float32)
    logits = model.apply({"params": params}, model.apply({"params": params}, jnp.asarray(h),
                                                         method=DSV4.final_norm),
                         method=DSV4.logits)
    fn, base = f64(params["hc_head_fn"]), f64(params["hc_head_base"])
    scale = f64(params["hc_head_scale"])
    flat = h.reshape(1, 3, -1).astype(np.float64)
    mix = flat @ fn.T / np.sqrt((flat ** 2).mean(-1, keepdims=True) + 1e-6)
    pre = 1 / (1 + np.exp(-(mix * scale + base))) + 1e-6              # sigmoid + eps, no Sinkhorn
    hh = np.einsum("bsj,bsjd->bsd", pre, h)
    want = ref.rms_norm(hh, f64(params["norm"]["weight"])) @ f64(params["head"]["weight"]).T
    assert rel_err(logits, want) < 1e-5


# ----------------------------------------------------------------------------- attention parts
def test_window_indices_and_ring_against_brute_force():
    w, s = 8, 5
    lengths = jnp.array([0, 3, 13])
    idx = np.asarray(window_indices(lengths, s, w))
    ring = np.arange(3 * w).reshape(3, w, 1).astype(np.float32) + 1000   # slot ids
    new = np.arange(3 * s).reshape(3, s, 1).astype(np.float32)
    pool = np.concatenate([ring, new], axis=1)[..., 0]                   # [B, W+S] per row
    for b, length in enumerate([0, 3, 13]):
        for i in range(s):
            t = length + i
            want = []
            for p in ref.window_positions(t, w):
                want.append(new[b, p - length, 0] if p >= length else ring[b, p % w, 0])
            got = [pool[b, g] for g in idx[b, i] if g >= 0]
            assert got == want, (b, i)
    num_new = jnp.array([5, 2, 4])
    out = np.asarray(update_ring(jnp.asarray(ring), jnp.asarray(new), lengths, num_new))
    for b, (length, n) in enumerate([(0, 5), (3, 2), (13, 4)]):
        for slot in range(w):
            ps = [p for p in range(length + n) if p % w == slot]
            if not ps:
                assert out[b, slot, 0] == ring[b, slot, 0]
                continue
            p = max(ps)
            want = new[b, p - length, 0] if p >= length else ring[b, slot, 0]
            assert out[b, slot, 0] == want


def test_sparse_attention_reference_against_loops():
    rng = np.random.default_rng(6)
    t, h, d, n, m = 5, 4, 512, 20, 9
    q = rng.standard_normal((t, h, d)).astype(np.float32)
    kv = rng.standard_normal((n, d)).astype(np.float32)
    extra = rng.standard_normal((m, d)).astype(np.float32)
    idx = rng.integers(-1, n + 3, (t, 7)).astype(np.int32)             # holes and out of range
    idx[2] = -1
    eidx = rng.integers(-1, m, (t, 4)).astype(np.int32)
    eidx[2] = -1                                                       # token 2: nothing at all
    eidx[3] = [1, 1, 1, -1]                                            # duplicates count each
    sink = rng.standard_normal(h).astype(np.float32)
    o, lse = sparse_attention_reference(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(idx),
                                        jnp.asarray(sink), extra_kv=jnp.asarray(extra),
                                        extra_idx=jnp.asarray(eidx), scale=0.05)
    for i in range(t):
        keys = [kv[j] for j in idx[i] if 0 <= j < n] + [extra[j] for j in eidx[i] if 0 <= j < m]
        keys = np.stack(keys) if keys else np.zeros((0, d))
        np.testing.assert_allclose(o[i], ref.attention_with_sink(q[i], keys, sink, 0.05),
                                   rtol=1e-4, atol=1e-5)
        if len(keys):
            want_lse = np.log(np.exp(0.05 * q[i].astype(np.float64) @ keys.T).sum(-1))
            np.testing.assert_allclose(lse[i], want_lse, rtol=1e-5)
    assert np.all(np.asarray(o)[2] == 0) and np.all(np.isneginf(np.asarray(lse)[2]))


@pytest.mark.parametrize("ratio,seq", [(4, 23), (128, 300)])
def test_compressor_pooling_against_formula_and_chunking(ratio, seq):
    comp = Compressor(CFG, ratio, 512)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((1, seq, CFG.dim)), jnp.float32)
    lc = init_layer_cache(CFG, 1 if ratio == 4 else 2, 1, 512, jnp.float32)
    zero = jnp.zeros((1,), jnp.int32)
    p = comp.init(jax.random.key(0), x[:, :1], lc.kv_state, lc.score_state, zero,
                  jnp.ones((1,), jnp.int32), layers.rope_inv_freq(CFG, True))["params"]
    p = jax.tree.map(lambda v: v + 0.0, p)
    freqs = layers.rope_inv_freq(CFG, True)
    def step(xs, kv, sc, length, n):
        chunk = comp.apply({"params": p}, xs, kv, sc, length, n, freqs)
        ids, new_kv, new_sc = commit_compressor(chunk, length, n)
        return chunk.entries, ids, new_kv, new_sc
    apply = jax.jit(step)
    run = lambda xs, kv, sc, length, n: apply(xs, kv, sc, jnp.array([length]), jnp.array([n]))
    ent, ids, _, _ = run(x, lc.kv_state, lc.score_state, 0, seq)
    ids = np.asarray(ids[0])
    got = {int(j): np.asarray(ent[0, q]) for q, j in enumerate(ids) if j >= 0}
    a = f64(x[0]) @ f64(p["wkv"]["weight"]).T
    z = f64(x[0]) @ f64(p["wgate"]["weight"]).T
    pooled = ref.compress_prefill(a, z, f64(p["ape"]), ratio, ratio == 4)
    assert sorted(got) == list(range(seq // ratio))
    freqs64 = freqs.astype(np.float64)
    for j, entry in got.items():
        want = ref.rms_norm(pooled[j], f64(p["norm"]["weight"]))
        want[448:] = ref.rope(want[448:], j * ratio, freqs64)
        np.testing.assert_allclose(entry, want, rtol=2e-4, atol=2e-4)
    # the same entries come out of uneven chunks (decode-style state carrying)
    kv, sc, length, chunked = lc.kv_state, lc.score_state, 0, {}
    for n in [1, 2, 5, 1, 3, seq]:
        n = min(n, seq - length)
        if n <= 0:
            break
        e, i, kv, sc = run(x[:, length:length + n], kv, sc, length, n)
        for q, j in enumerate(np.asarray(i[0])):
            if j >= 0:
                chunked[int(j)] = np.asarray(e[0, q])
        length += n
    assert sorted(chunked) == sorted(got)
    for j in got:
        np.testing.assert_allclose(chunked[j], got[j], rtol=1e-5, atol=1e-5)


def np_attention_layer(p, ratio, x):
    """docs/architecture.md §3.3-3.6 for one layer, prefill from 0, float64 loops. x [S, d]."""
    s = x.shape[0]
    h, c, g = CFG.n_heads, CFG.head_dim, CFG.o_groups
    freqs = (layers.rope_inv_freq(CFG, ratio > 0)).astype(np.float64)
    pos = np.arange(s)
    qr = ref.rms_norm(x @ f64(p["wq_a"]["weight"]).T, f64(p["q_norm"]["weight"]))
    q = ref.rms_norm((qr @ f64(p["wq_b"]["weight"]).T).reshape(s, h, c))
    q[..., 448:] = ref.rope(q[..., 448:], pos[:, None], freqs)
    kv = ref.rms_norm(x @ f64(p["wkv"]["weight"]).T, f64(p["kv_norm"]["weight"]))
    kv[:, 448:] = ref.rope(kv[:, 448:], pos, freqs)
    entries = np.zeros((0, c))
    if ratio:
        cp = p["compressor"]
        pooled = ref.compress_prefill(x @ f64(cp["wkv"]["weight"]).T, x @ f64(cp["wgate"]["weight"]).T,
                                      f64(cp["ape"]), ratio, ratio == 4)
        entries = ref.rms_norm(pooled, f64(cp["norm"]["weight"]))
        for j in range(len(entries)):
            entries[j, 448:] = ref.rope(entries[j, 448:], j * ratio, freqs)
    if ratio == 4:
        ip, nh = p["indexer"], CFG.index_n_heads
        had = quant.hadamard_matrix(128).astype(np.float64) / np.sqrt(128)
        qi = (qr @ f64(ip["wq_b"]["weight"]).T).reshape(s, nh, 128)
        qi[..., 64:] = ref.rope(qi[..., 64:], pos[:, None], freqs)
        qi = qi @ had
        icp = ip["compressor"]
        ik = ref.compress_prefill(x @ f64(icp["wkv"]["weight"]).T, x @ f64(icp["wgate"]["weight"]).T,
                                  f64(icp["ape"]), 4, True)
        ik = ref.rms_norm(ik, f64(icp["norm"]["weight"]))
        for j in range(len(ik)):
            ik[j, 64:] = ref.rope(ik[j, 64:], 4 * j, freqs)
        ik = ik @ had
        wts = x @ f64(ip["weights_proj"]["weight"]).T * (128 ** -0.5 * nh ** -0.5)
    sink = f64(p["attn_sink"])
    o = np.zeros((s, h, c))
    for t in range(s):
        keys = [kv[u] for u in ref.window_positions(t, CFG.window_size)]
        visible = (t + 1) // ratio if ratio else 0
        if ratio == 128:
            keys += [entries[j] for j in range(visible)]
        elif ratio == 4 and visible:
            score = np.array([(wts[t] * np.maximum(qi[t] @ ik[j], 0)).sum() for j in range(visible)])
            top = np.argsort(-score, kind="stable")[:CFG.index_topk]
            keys += [entries[j] for j in top]
        o[t] = ref.attention_with_sink(q[t], np.stack(keys), sink, c ** -0.5)
    o[..., 448:] = ref.rope(o[..., 448:], pos[:, None], freqs, inverse=True)
    o = o.reshape(s, g, h // g * c)
    wo_a = f64(p["wo_a"]["weight"]).reshape(g, CFG.o_lora_rank, -1)
    u = np.einsum("sgd,grd->sgr", o, wo_a).reshape(s, -1)
    return u @ f64(p["wo_b"]["weight"]).T


@pytest.mark.parametrize("layer_id,seq", [(0, 140), (1, 96), (2, 300)])
def test_attention_layer_against_spec_formula(params, layer_id, seq):
    """SWA-only (window truncation at 128), CSA (indexer top-16 of 24 entries), HCA (2 entries)."""
    ratio = CFG.compress_ratios[layer_id]
    p = params[f"layers_{layer_id}"]["attn"]
    x = np.random.default_rng(8 + layer_id).standard_normal((seq, CFG.dim)).astype(np.float32)
    lc = init_layer_cache(CFG, layer_id, 1, 512, jnp.float32)
    out, _, _ = jax.jit(Attention(CFG, layer_id).apply)(
        {"params": p}, jnp.asarray(x)[None], lc, jnp.zeros((1,), jnp.int32), jnp.array([seq]))
    want = np_attention_layer(p, ratio, x.astype(np.float64))
    assert rel_err(out[0], want) < 1e-4, rel_err(out[0], want)


def test_grouped_output_projection_by_loops(params):
    w = params["layers_0"]["attn"]["wo_a"]
    o = np.random.default_rng(9).standard_normal((1, 2, 2, 1024)).astype(np.float32)
    got = np.asarray(GroupedOutput(CFG).apply({"params": w}, jnp.asarray(o)))
    wm = np.asarray(w["weight"])
    for gi in range(2):
        rows = wm[gi * CFG.o_lora_rank:(gi + 1) * CFG.o_lora_rank]     # group gi's wo_a block
        np.testing.assert_allclose(got[0, :, gi], o[0, :, gi] @ rows.T, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- MoE
@pytest.mark.parametrize("hashed", [True, False])
def test_router_sqrt_softplus_bias_hash_normalise_scale(params, hashed):
    layer = 0 if hashed else 2
    gp = params[f"layers_{layer}"]["ffn"]["gate"]
    rng = np.random.default_rng(10)
    x = rng.standard_normal((6, CFG.dim)).astype(np.float32)
    ids = rng.integers(0, CFG.vocab_size, 6)
    wts, idx = moe.Gate(CFG, hashed).apply({"params": gp}, jnp.asarray(x), jnp.asarray(ids))
    scores = np.sqrt(np.log1p(np.exp(x.astype(np.float64) @ f64(gp["weight"]).T)))
    for i in range(6):
        if hashed:
            want_idx = np.asarray(gp["tid2eid"])[ids[i]]
        else:                                    # bias only for selection
            want_idx = np.argsort(-(scores[i] + f64(gp["bias"])))[:CFG.n_activated_experts]
        assert sorted(np.asarray(idx[i]).tolist()) == sorted(want_idx.tolist())
        w = scores[i][np.asarray(idx[i])]
        np.testing.assert_allclose(wts[i], w / w.sum() * CFG.route_scale, rtol=1e-5)


def np_expert(x, w1, w3, w2, weight=1.0, limit=10.0):
    gate, up = x @ w1.T, x @ w3.T
    up, gate = np.clip(up, -limit, limit), np.minimum(gate, limit)
    return (weight * gate / (1 + np.exp(-gate)) * up) @ w2.T           # weight before w2


@pytest.mark.parametrize("tokens", [2, 11])          # 4 < 8 experts: gather; 22 >= 8: grouped
def test_routed_experts_against_loop(params, tokens):
    ep = params["layers_2"]["ffn"]["experts"]
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((tokens, CFG.dim)) * 3).astype(np.float32)  # exercise the clamp
    idx = np.stack([rng.permutation(8)[:2] for _ in range(tokens)]).astype(np.int32)
    w = rng.random((tokens, 2)).astype(np.float32)
    pw = {k: (ep[k]["weight"], None) for k in ("w1", "w2", "w3")}
    got = moe.routed_experts(jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx), pw, CFG)
    want = np.zeros((tokens, CFG.dim))
    for i in range(tokens):
        for k in range(2):
            e = idx[i, k]
            want[i] += np_expert(x[i].astype(np.float64), f64(ep["w1"]["weight"][e]),
                                 f64(ep["w3"]["weight"][e]), f64(ep["w2"]["weight"][e]), w[i, k])
    assert rel_err(got, want) < 1e-5


def test_moe_adds_shared_expert(params):
    fp = params["layers_3"]["ffn"]
    x = np.random.default_rng(12).standard_normal((1, 3, CFG.dim)).astype(np.float32)
    ids = jnp.array([[1, 2, 3]])
    got = moe.MoE(CFG, 3).apply({"params": fp}, jnp.asarray(x), ids)
    wts, idx = moe.Gate(CFG, False).apply({"params": fp["gate"]}, jnp.asarray(x[0]), ids[0])
    sh = fp["shared_experts"]
    for i in range(3):
        want = np_expert(x[0, i].astype(np.float64), f64(sh["w1"]["weight"]), f64(sh["w3"]["weight"]),
                         f64(sh["w2"]["weight"]))
        for k in range(2):
            e = int(idx[i, k])
            ep = fp["experts"]
            want += np_expert(x[0, i].astype(np.float64), f64(ep["w1"]["weight"][e]),
                              f64(ep["w3"]["weight"][e]), f64(ep["w2"]["weight"][e]), float(wts[i, k]))
        assert rel_err(got[0, i], want) < 1e-5


# ----------------------------------------------------------------------------- MTP
def test_mtp_block_composition(params):
    """MTP logits = head(norm(hc_head_mtp(Block_n(e_proj(enorm(emb)) + h_proj(hnorm(H))))))."""
    model = DSV4(CFG)
    rng = np.random.default_rng(13)
    hidden = jnp.asarray(rng.standard_normal((1, 5, 4, CFG.dim)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (1, 5)), jnp.int32)
    cache = dj.Cache.init(CFG, 1, 256)
    logits, new_cache, _ = jax.jit(lambda p, h, i, c: model.apply(
        {"params": p}, h, i, c, method=DSV4.mtp_forward))(params, hidden, ids, cache)
    mp = params["mtp_0"]
    emb = f64(params["embed"]["weight"])[np.asarray(ids)]
    e = ref.rms_norm(emb, f64(mp["enorm"]["weight"])) @ f64(mp["e_proj"]["weight"]).T
    hs = ref.rms_norm(f64(hidden), f64(mp["hnorm"]["weight"])) @ f64(mp["h_proj"]["weight"]).T
    x0 = jnp.asarray(e[:, :, None, :] + hs, jnp.float32)
    block_params = {k: v for k, v in mp.items()
                    if k not in ("e_proj", "h_proj", "enorm", "hnorm", "norm") and "hc_head" not in k}
    x1, _, _, moe = jax.jit(Block(CFG, CFG.n_layers).apply)(
        {"params": block_params}, x0, ids, cache.mtp[0], cache.mtp_lengths, jnp.array([5]))
    # The block leaves its last hc_post (its MoE output as parts: ffi.ffn_sum.FfnSum).
    x1 = mhc.hc_post(pending_total(moe[0]), x1, *moe[1:])
    flat = f64(x1).reshape(1, 5, -1)
    mix = flat @ f64(mp["hc_head_fn"]).T / np.sqrt((flat ** 2).mean(-1, keepdims=True) + 1e-6)
    pre = 1 / (1 + np.exp(-(mix * f64(mp["hc_head_scale"]) + f64(mp["hc_head_base"])))) + 1e-6
    hh = np.einsum("bsj,bsjd->bsd", pre, f64(x1))
    want = ref.rms_norm(hh, f64(mp["norm"]["weight"])) @ f64(params["head"]["weight"]).T
    assert rel_err(logits, want) < 1e-4
    assert int(new_cache.mtp_lengths[0]) == 5 and int(new_cache.lengths[0]) == 0
