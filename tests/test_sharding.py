"""Multi-device: the sharded model equals the single-device one, and really is distributed.

Runs on 8 simulated CPU devices (tests/conftest.py sets --xla_force_host_platform_device_count).
"""
import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import dsv4_jax as dj
from dsv4_jax import mesh_rules, sharding

CFG = dj.Config.tiny(dtype="float32", quant_simulation=False)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")


@pytest.fixture(scope="module")
def params():
    return dj.init_params(CFG, 0)


def max_abs(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)       # gathered to the host
    with np.errstate(invalid="ignore"):                                # inf - inf where equal
        return float(np.max(np.where(a == b, 0.0, np.abs(a - b))))


@pytest.mark.parametrize("split", [True, False], ids=["split", "replicated"])
@pytest.mark.parametrize("data,expert", [(2, 4), (1, 8)])
def test_sharded_prefill_and_decode_equal_single_device(params, data, expert, split,
                                                        monkeypatch):
    """Rows split over every device, or (a small batch) over ``data`` only and replicated
    over ``expert`` (``mesh_rules.row_axes``): the logits and cache of one device."""
    if split:
        monkeypatch.setattr(mesh_rules, "REPLICATE_MAX_ROWS", 0)
    mesh = sharding.make_mesh(data=data, expert=expert)
    batch = 8
    toks = jax.random.randint(jax.random.key(1), (batch, 40), 0, CFG.vocab_size)
    n = jnp.array([40, 33, 40, 7, 40, 40, 21, 40])                 # padded rows too
    single = dj.DSV4(CFG, runtime_checks=False)
    multi = dj.DSV4(CFG, mesh=mesh, runtime_checks=False)
    run1 = jax.jit(lambda p, t, c, k: single.apply({"params": p}, t, c, num_new=k))
    run8 = jax.jit(lambda p, t, c, k: multi.apply({"params": p}, t, c, num_new=k))
    sp = sharding.shard(params, CFG, mesh)
    l1, c1 = run1(params, toks, dj.Cache.init(CFG, batch, 128), n)
    l8, c8 = run8(sp, toks, dj.Cache.init(CFG, batch, 128, mesh=mesh), n)
    assert max_abs(l1, l8) < 1e-4
    for step in range(3):
        t = toks[:, step:step + 1]
        one = jnp.ones((batch,), jnp.int32)
        l1, c1 = run1(params, t, c1, one)
        l8, c8 = run8(sp, t, c8, one)
        assert max_abs(l1, l8) < 1e-4
    for a, b in zip(jax.tree.leaves(c1), jax.tree.leaves(c8)):
        assert max_abs(a, b) < 1e-4
    # the new cache stays distributed over the batch as the rule splits it
    window = c8.layers[0].window
    assert {s.data.shape[0] for s in window.addressable_shards} == {
        batch // 8 if split else batch // data}


@pytest.mark.parametrize("replicate_max_rows,local_rows", [(0, 1), (8, 8)])
def test_the_indexer_selects_each_devices_own_rows(params, replicate_max_rows, local_rows,
                                                   monkeypatch):
    """On a mesh the indexer's selection runs inside a shard_map on each device's rows (one
    of 8 split rows, or all 8 replicated ones), as the attention does: outside it, the
    partitioner gathered every row's index keys to every device around the kernel's custom
    call, every CSA layer and step (the op's XLA path partitions by itself, so CPU numbers
    cannot show it; the traced operand shapes do)."""
    from dsv4_jax.models import compressor
    monkeypatch.setattr(mesh_rules, "REPLICATE_MAX_ROWS", replicate_max_rows)
    seen = []

    def recording(q, weights, table, visible, *args, **kwargs):
        seen.append((q.shape[0], table.shape[0]))
        return index_topk(q, weights, table, visible, *args, **kwargs)

    index_topk = compressor.index_topk
    monkeypatch.setattr(compressor, "index_topk", recording)
    mesh = sharding.make_mesh(data=1, expert=8)
    model = dj.DSV4(CFG, mesh=mesh, runtime_checks=False)
    cache = dj.Cache.init(CFG, 8, 256, mesh=mesh)
    jax.jit(lambda p, t, c: model.apply({"params": p}, t, c, logits_at="last")).trace(
        sharding.shard(params, CFG, mesh), jnp.zeros((8, 1), jnp.int32), cache)
    assert seen and set(seen) == {(local_rows, local_rows)}


def test_parameters_and_cache_are_really_distributed(params):
    mesh = sharding.make_mesh(data=2, expert=4)
    sp = sharding.shard(params, CFG, mesh)
    w1 = sp["layers_2"]["ffn"]["experts"]["w1"]["weight"]
    assert w1.sharding.spec == P("expert", None, None)
    assert {s.data.shape for s in w1.addressable_shards} == {(CFG.n_routed_experts // 4, 128, 256)}
    assert len({s.index[0].start for s in w1.addressable_shards}) == 4    # 4 distinct slices
    for name in ("embed", "head"):
        w = sp[name]["weight"]
        assert {s.data.shape for s in w.addressable_shards} == {(CFG.vocab_size // 8, CFG.dim)}
    wq = sp["layers_0"]["attn"]["wq_b"]["weight"]
    assert wq.sharding.is_fully_replicated                                 # attention: DP only
    cache = dj.Cache.init(CFG, 32, 256, mesh=mesh)          # 16 rows a data group: split
    comp = cache.layers[1].compressed
    assert {s.data.shape for s in comp.addressable_shards} == {(4, 64, 512)}
    assert {s.data.shape for s in cache.lengths.addressable_shards} == {(4,)}
    small = dj.Cache.init(CFG, 16, 256, mesh=mesh)          # 8: replicated over expert
    assert {s.data.shape for s in small.layers[1].compressed.addressable_shards} == {
        (8, 64, 512)}
    assert len({s.index[0].start for s in small.lengths.addressable_shards}) == 2
    # parameters can be generated directly on the mesh too
    shardings = sharding.param_shardings(CFG, mesh)
    direct = dj.init_params(CFG, 0, shardings=shardings)
    head = direct["head"]["weight"]
    assert {s.data.shape for s in head.addressable_shards} == {(CFG.vocab_size // 8, CFG.dim)}
    np.testing.assert_array_equal(np.asarray(direct["layers_0"]["attn"]["wkv"]["weight"]).shape,
                                  (512, CFG.dim))


def test_bad_meshes_and_batches_raise():
    mesh = sharding.make_mesh(data=2, expert=4)
    with pytest.raises(ValueError, match=r"expert axis \(4\) does not divide n_routed_experts \(6\)"):
        sharding.param_shardings(CFG.replace(n_routed_experts=6), mesh)
    with pytest.raises(ValueError, match=r"batch 20 is not divisible by the 8 devices it is "
                                         r"split over .*padded_rows gives 24"):
        dj.Cache.init(CFG, 20, 64, mesh=mesh)
    with pytest.raises(ValueError, match="batch 5 is not divisible by the 2 devices"):
        dj.Cache.init(CFG, 5, 64, mesh=mesh)
    model = dj.DSV4(CFG, mesh=mesh)
    cache = dj.Cache.init(CFG, 5, 64)
    with pytest.raises(ValueError, match="batch 5 is not divisible"):
        model.apply({"params": dj.abstract_params(CFG)}, jnp.zeros((5, 1), jnp.int32), cache)
    with pytest.raises(ValueError, match="devices"):
        sharding.make_mesh(data=3, expert=4)


def test_load_official_format_checkpoint_onto_a_mesh(tmp_path):
    """``load(path, mesh=...)`` places every leaf by the rule table while reading; the sharded
    model's logits equal the single-device load's."""
    from dsv4_jax.checkpoints.testing import tiny_config, write_tiny_checkpoint
    cfg = tiny_config()
    write_tiny_checkpoint(tmp_path, cfg, seed=0)
    mesh = sharding.make_mesh(data=1, expert=8)
    model8, params8 = dj.load(tmp_path, mesh=mesh, dtype="float32", quant_simulation=False,
                              progress=False)
    model1, params1 = dj.load(tmp_path, dtype="float32", quant_simulation=False, progress=False)
    w = params8["layers_1"]["ffn"]["experts"]["w2"]["weight"]
    assert {s.data.shape[0] for s in w.addressable_shards} == {cfg.n_routed_experts // 8}
    toks = jax.random.randint(jax.random.key(2), (8, 6), 0, cfg.vocab_size)
    l8, _ = jax.jit(model8.clone(runtime_checks=False).apply)(
        {"params": params8}, toks, dj.Cache.init(model8.config, 8, 64, mesh=mesh))
    l1, _ = jax.jit(model1.apply)({"params": params1}, toks, dj.Cache.init(model1.config, 8, 64))
    assert max_abs(l1, l8) < 1e-4


@pytest.mark.parametrize("data,expert,batch", [(1, 8, 8), (2, 4, 8), (1, 8, 32)])
def test_expert_exchanges_give_the_one_device_sum_bit_for_bit(data, expert, batch, monkeypatch):
    """The all-reduce of rows replicated over ``expert`` (small batches), the gathering
    exchange (decode sizes) and the capacity all-to-all (prefill sizes) hand every token the
    one-device sum of its routed rows, bit for bit: BF16 rows, quantised FP4 experts under
    the FP8 simulation, skewed routings (one device owns most assignments)."""
    from dsv4_jax.models.moe import expert_rows, routed_experts
    from dsv4_jax.models.parallel import expert_parallel
    cfg = dj.Config.tiny(quantized=True)
    params = dj.init_params(cfg, 0)["layers_2"]["ffn"]["experts"]
    experts = {name: (leaf["weight"], leaf.get("scale")) for name, leaf in params.items()}
    mesh = sharding.make_mesh(data=data, expert=expert)
    e, k = cfg.n_routed_experts, cfg.n_activated_experts
    key_x, key_i, key_w = jax.random.split(jax.random.key(batch), 3)
    x = jax.random.normal(key_x, (batch, cfg.dim), jnp.bfloat16)
    skewed = jax.random.randint(key_i, (batch, k), 0, e // expert + 2)      # mostly device 0
    ids = jnp.where(jnp.arange(batch)[:, None] % 3 == 0, skewed,
                    jax.random.permutation(key_i, e)[:k][None, :] * jnp.ones_like(skewed))
    w = jax.random.uniform(key_w, (batch, k), jnp.float32, 0.1, 1.0)
    one = routed_experts(x, w, ids, experts, cfg)
    local = {n: jax.tree.map(lambda v: None if v is None else
                             jax.device_put(v, jax.sharding.NamedSharding(mesh, P("expert"))),
                             pair, is_leaf=lambda v: v is None)
             for n, pair in experts.items()}

    def run(gather_max_tokens, replicate_max_rows):
        monkeypatch.setattr(mesh_rules, "REPLICATE_MAX_ROWS", replicate_max_rows)
        fn = jax.jit(lambda x, w, i, p: expert_parallel(
            x, w, i, p, e, mesh, lambda r, ea, wa, lp: expert_rows(r, ea, wa, lp, cfg),
            batch, gather_max_tokens=gather_max_tokens))
        return np.asarray(fn(x, w, ids, local))

    replicated, gathered, exchanged = run(0, batch), run(batch, 0), run(0, 0)
    np.testing.assert_array_equal(gathered, exchanged)
    np.testing.assert_array_equal(replicated, exchanged)
    np.testing.assert_array_equal(gathered, np.asarray(one))
    assert np.abs(gathered).max() > 0


@pytest.mark.parametrize("data,expert,replicate_max_rows,rows", [
    (1, 8, 0, 8), (2, 4, 8, 4), (1, 8, 8, 3)])
def test_generate_and_stream_on_a_mesh_pad_the_batch_and_compile_each_chunk_once(
        params, data, expert, replicate_max_rows, rows, monkeypatch):
    """``dj.generate``/``dj.stream`` on a model with a mesh: three prompts run padded to the
    ``rows`` the mesh splits evenly -- all eight devices' rows, a multiple of the ``data``
    size with the rows replicated over ``expert``, or none on one data group -- (the
    padding's results are dropped) with the one-device model's tokens; the cache is created
    on the mesh and the first chunk's carry split like it, so a second chunk of the same
    width compiles nothing (before, the first chunk's unsplit carry made the second chunk
    compile the program again)."""
    from dsv4_jax.decoding import build_programs, prepare_prompts, run_prefill
    from dsv4_jax.generation import plain_method
    monkeypatch.setattr(mesh_rules, "REPLICATE_MAX_ROWS", replicate_max_rows)
    mesh = sharding.make_mesh(data=data, expert=expert)
    multi = dj.DSV4(CFG, mesh=mesh, runtime_checks=False)
    single = dj.DSV4(CFG, runtime_checks=False)
    prompts = [list(range(3, 300)), [7, 8, 9], list(range(40, 170))]
    opts = dj.GenerationOptions(max_new_tokens=5, stop_tokens=(), prefill_chunk=128)
    sp = sharding.shard(params, CFG, mesh)
    prepared = prepare_prompts(multi, prompts, opts)
    assert prepared.tokens.shape[0] == rows and prepared.rows == 3
    on_mesh = dj.generate(multi, sp, prompts, options=opts)
    one = dj.generate(single, params, prompts, options=opts)
    assert on_mesh.tokens == one.tokens and len(on_mesh.tokens) == 3
    assert on_mesh.stats["generated_tokens"] == 15
    events = list(dj.stream(multi, sp, prompts, options=opts))
    assert all(e.tokens.shape == (3,) for e in events)
    streamed = [[int(t) for t in row if t >= 0]
                for row in np.stack([e.tokens for e in events], axis=1)]
    assert streamed == one.tokens

    tokens = np.tile(np.arange(5, 261, dtype=np.int32), (8, 1))
    method = plain_method(multi, dj.Greedy())
    traces = []

    def counted_prefill(*args):
        traces.append(1)                # runs once per trace, i.e. per compiled program
        return method.prefill(*args)

    programs = build_programs(dataclasses.replace(method, prefill=counted_prefill))
    run_prefill(programs, sp, tokens, np.full((8,), 256), dj.Cache.init(CFG, 8, 512, mesh=mesh),
                jax.random.key(0), jnp.array([-7]), jnp.int32(4), ((0, 128), (128, 128)))
    assert len(traces) == 1
