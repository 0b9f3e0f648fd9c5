"""The memory planner (``dsv4_jax.plan``) on 8 simulated CPU devices (tests/conftest.py),
abstract shapes only: the DSV4-Pro plan's shards, per-device bytes, cache, activations and
all-to-all sizes against hand arithmetic, the fit check that ``load(mesh=...)`` runs, and
the per-device-count memory table of Flash and Pro."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

import dsv4_jax as dj
from dsv4_jax import mesh_rules, plan, sharding

PRO = dj.Config.pro(quantized=True)
pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")

D, INTER, E, K, V = 7168, 3072, 384, 6, 129280
BLOCKS = 61 + 1                                  # main layers + the MTP block
# one expert's three matrices in checkpoint precision: packed FP4 (in/2 bytes per row) and
# one E8M0 byte per 32 inputs
EXPERT_BYTES = 2 * (INTER * D // 2 + INTER * D // 32) + (D * INTER // 2 + D * INTER // 32)


@pytest.fixture(scope="module")
def abstract():
    return dj.abstract_params(PRO)


@pytest.fixture(scope="module")
def mesh18():
    return sharding.make_mesh(data=1, expert=8)


def test_every_shard_of_pro_on_one_by_eight(abstract, mesh18):
    rows = plan.shard_table(PRO, mesh18, abstract)
    assert len(rows) == len(jax.tree.leaves(abstract))
    by_path = {r["path"]: r for r in rows}
    assert by_path["layers_5/ffn/experts/w1/weight"]["shard"] == (E // 8, INTER, D // 2)
    assert by_path["layers_5/ffn/experts/w1/scale"]["shard"] == (E // 8, INTER, D // 32)
    assert by_path["mtp_0/ffn/experts/w2/weight"]["shard"] == (E // 8, D, INTER // 2)
    assert by_path["head/weight"]["shard"] == (V // 8, D)
    assert by_path["embed/weight"]["shard_bytes"] == V // 8 * D * 2
    for r in rows:                       # everything else is replicated
        if "/experts/" not in r["path"] and r["path"] not in ("embed/weight", "head/weight"):
            assert r["shard"] == r["shape"], r["path"]
    experts = sum(r["shard_bytes"] for r in rows if "/experts/" in r["path"])
    assert experts == BLOCKS * (E // 8) * EXPERT_BYTES
    # total = replicated rest + 1/8 of the experts and of embedding + head
    full = sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract))
    rest = full - BLOCKS * E * EXPERT_BYTES - 2 * V * D * 2
    per_device = plan.param_bytes_per_device(PRO, mesh18, abstract)
    assert per_device == sum(r["shard_bytes"] for r in rows)
    assert per_device == rest + BLOCKS * E * EXPERT_BYTES // 8 + 2 * V * D * 2 // 8
    groups = plan.group_shard_table(rows)
    assert sum(g["count"] for g in groups) == len(rows)
    assert sum(g["total_bytes"] for g in groups) == per_device
    w1 = [g for g in groups if g["path"] == "layers_*/ffn/experts/w1/weight"]
    assert len(w1) == 1 and w1[0]["count"] == 61


def test_other_meshes_replicate_experts_over_data(abstract):
    mesh = sharding.make_mesh(data=8, expert=1)
    rows = {r["path"]: r for r in plan.shard_table(PRO, mesh, abstract)}
    assert rows["layers_0/ffn/experts/w3/weight"]["shard"] == (E, INTER, D // 2)
    assert rows["embed/weight"]["shard"] == (V // 8, D)              # vocab: all devices
    p24 = plan.param_bytes_per_device(PRO, sharding.make_mesh(2, 4), abstract)
    p18 = plan.param_bytes_per_device(PRO, sharding.make_mesh(1, 8), abstract)
    assert p24 - p18 == BLOCKS * EXPERT_BYTES * (E // 4 - E // 8)


def test_cache_of_batch_8_at_32k_is_one_row_per_device(mesh18, monkeypatch):
    """Split rows: one row per device; a batch replicated over ``expert``
    (``mesh_rules.row_axes``): every row on every device."""
    max_len, w, c = 32768, 128, 512
    window = w * c * 2
    hca = window + 2 * 128 * 512 * 4 + max_len // 128 * c * 2
    csa = (window + 2 * 8 * 1024 * 4 + max_len // 4 * c * 2
           + 2 * 8 * 256 * 4 + max_len // 4 * 128 * 2)
    n_csa = PRO.compress_ratios[:61].count(4)
    row = n_csa * csa + (61 - n_csa) * hca + window + 2 * 4          # + MTP window, lengths
    assert n_csa == 30
    assert plan.cache_bytes_per_device(PRO, mesh18, 1, max_len) == row
    assert plan.cache_bytes_per_device(PRO, mesh18, 8, max_len) == (
        8 * row if mesh_rules.REPLICATE_MAX_ROWS >= 8 else row)
    monkeypatch.setattr(mesh_rules, "REPLICATE_MAX_ROWS", 0)
    assert plan.cache_bytes_per_device(PRO, mesh18, 8, max_len) == row
    assert plan.cache_bytes_per_device(PRO, mesh18, 64, max_len) == 8 * row
    with pytest.raises(ValueError, match="batch 1 is not divisible by the 8 devices"):
        plan.cache_bytes_per_device(PRO, mesh18, 1, max_len)


def test_all_to_all_sizes_follow_the_capacity_rule(mesh18, monkeypatch):
    replicated = plan.all_to_all_sizes(PRO, mesh18, 1, 1)    # one all-reduce of k rows
    assert (replicated["tokens"], replicated["slots"], replicated["dispatch_buffer_bytes"],
            replicated["combine_buffer_bytes"]) == (1, K, 0, K * D * 2)
    assert replicated["sent_bytes_per_layer"] == int(2 * K * D * 2 * 7 / 8)
    monkeypatch.setattr(mesh_rules, "REPLICATE_MAX_ROWS", 0)       # every batch split
    for batch, seq in ((8, 1), (64, 1), (8, 1024)):
        a = plan.all_to_all_sizes(PRO, mesh18, batch, seq)
        t = batch * seq // 8
        slots = 8 * t * K                          # n blocks of a = t k slots
        assert (a["tokens"], a["assignments"], a["slots"]) == (t, t * K, slots)
        assert a["dispatch_buffer_bytes"] == slots * (D * 2 + 4 + 4)
        assert a["combine_buffer_bytes"] == slots * D * 2
        assert a["sent_bytes_per_layer"] == 7 * t * K * (2 * D * 2 + 8)
        assert a["sent_bytes_per_step"] == 61 * a["sent_bytes_per_layer"]
    none = plan.all_to_all_sizes(PRO, sharding.make_mesh(8, 1), 8, 1)
    assert none["sent_bytes_per_step"] == 0 and none["local_experts"] == E
    with pytest.raises(ValueError, match="batch 1 is not divisible"):
        plan.all_to_all_sizes(PRO, mesh18, 1, 1)


def test_decode_activation_formula_and_the_compilers_figure(mesh18):
    """Decode at batch 8 (one token per device): the MoE terms by hand, and the formula of
    the XLA path against the compiled step of a one-layer Pro stack on the 8-device mesh."""
    est = plan.step_activation_estimate(PRO, mesh18, 8, 1, 32768, moe="kernel")
    assert est["moe_exchange"] == 4 * 48 * D * 2
    assert est["moe_compute"] == 48 * (3 * INTER * 2 + D)
    xla = plan.step_activation_estimate(PRO, mesh18, 8, 1, 32768, moe="xla")
    assert xla["moe_compute"] == E // 8 * 3 * INTER * D * 2        # every local expert in BF16
    assert xla["total"] - xla["moe_compute"] == est["total"] - est["moe_compute"]
    with pytest.raises(ValueError, match="moe must be"):
        plan.step_activation_estimate(PRO, mesh18, 8, 1, 32768, moe="gpu")

    one = plan.reduced_config(PRO, (4,))
    assert (one.n_layers, one.compress_ratios, one.n_hash_layers) == (1, (4, 0), 1)
    compiled = plan.abstract_step(one, mesh18, 8, 1, 32768).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    formula = plan.step_activation_estimate(one, mesh18, 8, 1, 32768, moe="xla")["total"]
    assert 0.8 < temp / formula < 1.5, (temp, formula)


def test_pro_fits_eight_h200_only_with_experts_split_eight_ways(abstract, mesh18):
    limit = int(0.93 * plan.H200_BYTES)
    fit = plan.memory_plan(PRO, mesh18, batch=64, max_len=32768, device_bytes=limit,
                           abstract=abstract)
    assert fit["fits"] and fit["total"] == fit["params"] + fit["cache"] + fit["activations"]
    assert np.isclose(fit["headroom"], limit - fit["total"])
    bad = plan.memory_plan(PRO, sharding.make_mesh(2, 4), batch=64, max_len=32768,
                           device_bytes=limit, abstract=abstract)
    assert not bad["fits"] and bad["params"] > limit            # 96 experts per device


def test_checkpoint_that_does_not_fit_is_refused_before_allocating(monkeypatch):
    cfg = dj.Config.tiny(dtype="float32", quant_simulation=False)
    mesh = sharding.make_mesh(data=1, expert=8)
    monkeypatch.setattr(plan, "_device_memory", lambda d: 2 ** 20)             # 1 MiB devices
    with pytest.raises(ValueError, match=r"needs \d+\.\d GiB of parameters per device"):
        plan.check_fits(cfg, mesh)
    monkeypatch.setattr(plan, "_device_memory", lambda d: 2 ** 40)
    need = plan.check_fits(cfg, mesh)
    assert 0 < need < dj.param_count(cfg) * 4
    assert need == plan.param_bytes_per_device(cfg, mesh)


def test_memory_table_for_flash_and_pro(abstract):
    flash = dj.Config.flash(quantized=True)
    for cfg, total_gb, tree in ((flash, 160, None), (PRO, 865, abstract)):
        rows = plan.memory_table(cfg, abstract=tree)
        assert [r["devices"] for r in rows] == [1, 2, 4, 8]
        assert abs(rows[0]["params_gib"] * 2**30 / 1e9 - total_gb) / total_gb < 0.02
        assert rows[3]["params_gib"] < rows[0]["params_gib"] / 4          # experts dominate
        assert rows[0]["cache_gib_per_1k_tokens_per_seq"] > 0
        # sizes-only meshes: the same bytes as the devices' meshes
        for r in rows:
            mesh = sharding.make_mesh(data=1, expert=r["devices"])
            assert r["params_gib"] * 2**30 == plan.param_bytes_per_device(cfg, mesh, tree)
    # Pro's cache per 1k tokens: CSA layers add 256 compressed entries (c = 512) and 256
    # indexer keys (128), HCA layers 8 entries; BF16
    per_1k = 30 * (256 * 512 + 256 * 128) * 2 + 31 * 8 * 512 * 2
    assert rows[0]["cache_gib_per_1k_tokens_per_seq"] * 2**30 == per_1k


def test_memory_table_activations_are_the_step_formula(monkeypatch):
    """Flash on 8 devices, 8 x 4096-token prefill chunk split over the devices, cache of
    4096: the XLA-path terms of ``step_activation_estimate`` by hand (one row and 4096
    tokens per device)."""
    monkeypatch.setattr(mesh_rules, "REPLICATE_MAX_ROWS", 0)
    flash = dj.Config.flash(quantized=True)
    d, h, c, inter, v = 4096, 64, 512, 2048, 129280
    t, slots = 4096, 8 * 4096 * 6
    streams = 3 * t * 4 * d * 2
    attention = (2 * t * h * c * 2 + t * (128 + 512) * c * 2          # window + top-k entries
                 + t * 64 * (4096 // 4) * 4)                           # indexer scores, f32
    # largest block: the MTP block's FP8 linears (attention, shared expert, e/h projections)
    dense = (1024 * d + 32768 * 1024 + c * d + 8192 * d + d * 8192 + 3 * inter * d
             + 2 * d * d) * 2
    exchange = 4 * slots * d * 2
    experts = 256 // 8 * 3 * inter * d * 2                             # all local, BF16
    logits = 8 * d * 2 + 8 * (v // 8) * 4 + v * 4
    total = streams + attention + dense + exchange + experts + logits
    (row,) = plan.memory_table(flash, (8,))
    assert row["activations_gib"] * 2**30 == total
    # a batch smaller than the mesh runs padded to one row per device
    assert plan.memory_table(flash, (8,), batch=1)[0]["activations_gib"] == row["activations_gib"]
