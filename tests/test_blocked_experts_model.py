"""The model on blocked FP4 experts (``Config.expert_layout="blocked"``): parameters in that
layout give the same logits as the row layout they came from, ``load`` gives it for FP4
experts by default, ``save`` writes it back as rows, the config refuses it where no packed
FP4 experts exist, and the
model's decode and prefill steps lowered for CUDA run the MoE kernels straight on the tiles
(no transpose of them into rows)."""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import dsv4_jax as dj
from dsv4_jax import quant
from dsv4_jax.checkpoints.orbax_io import read_config
from dsv4_jax.checkpoints.testing import tiny_config, write_tiny_checkpoint
from dsv4_jax.ffi.policy import KernelPolicy
from dsv4_jax.params import abstract_params, unblock_expert_weights
from model_lowering import lower_step

CUSTOM_CALL = "stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2"
OTHER_OPS_ON_REFERENCES = {"sparse_attention": "xla", "grouped_gemm": "xla",
                           "hc_pre": "xla", "hc_split_sinkhorn": "xla", "hc_stream_mixes": "xla",
                           "moe_router": "xla"}


def _expert_weights(params):
    return {path: leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)
            if "['experts']" in jax.tree_util.keystr(path)
            and jax.tree_util.keystr(path).endswith("['weight']")}


def test_block_expert_weights_converts_only_the_fp4_expert_weights():
    cfg = dj.Config.tiny(quantized=True)
    params = dj.init_params(cfg, 0)
    blocked = dj.block_expert_weights(jax.tree.map(jnp.copy, params))
    want = abstract_params(cfg.replace(expert_layout="blocked"))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), blocked) == jax.tree.map(
        lambda a: (a.shape, a.dtype), want)
    experts = _expert_weights(blocked)
    assert experts and all(w.ndim == 5 for w in experts.values())
    again = dj.block_expert_weights(blocked)            # already blocked: unchanged
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(blocked)))


def test_block_expert_weights_without_donation_keeps_the_inputs():
    params = dj.init_params(dj.Config.tiny(quantized=True), 0)
    kept = dj.block_expert_weights(params, donate=False)
    donated = dj.block_expert_weights(jax.tree.map(jnp.copy, params))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(params))
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(donated)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for (path, row), blocked in zip(_expert_weights(params).items(),
                                    _expert_weights(kept).values()):
        np.testing.assert_array_equal(np.asarray(quant.unblock_fp4_weight(blocked)),
                                      np.asarray(row), err_msg=jax.tree_util.keystr(path))


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (simulated) devices")
@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_sharded_expert_weights_are_blocked_shard_by_shard_where_they_lie(axis_type):
    types = (jax.sharding.AxisType.Explicit if axis_type == "explicit"
             else jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((4,), ("x",), axis_types=types, devices=jax.devices()[:4])
    w = jax.random.randint(jax.random.key(0), (8, 128, 512), -128, 128, jnp.int32)
    w = w.astype(jnp.int8)
    want = np.asarray(quant.block_fp4_weight(w))

    def tree(spec):
        return {"layers_0": {"ffn": {"experts": {"w2": {
            "weight": jax.device_put(w, NamedSharding(mesh, spec))}}}}}
    for spec in (P("x"), P(), P(None, None, "x")):
        params = tree(spec)
        assert dj.can_block_expert_weights(params)
        got = dj.block_expert_weights(params, donate=False)  # w's buffers may be shared
        got = got["layers_0"]["ffn"]["experts"]["w2"]["weight"]
        assert got.sharding == NamedSharding(mesh, spec)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(spec))
        rows = unblock_expert_weights({"ffn": {"experts": {"w2": {"weight": got}}}})  # save's
        rows = rows["ffn"]["experts"]["w2"]["weight"]
        assert rows.sharding == NamedSharding(mesh, spec)
        np.testing.assert_array_equal(np.asarray(rows), np.asarray(w), err_msg=str(spec))
    split_rows = tree(P(None, "x"))                     # 32-row shards: not whole tiles
    assert not dj.can_block_expert_weights(split_rows)
    with pytest.raises(ValueError, match=re.escape(
            "block_expert_weights: ['layers_0']['ffn']['experts']['w2']['weight'] "
            "(8, 128, 512) on P(None, 'x') has shards (8, 32, 512), not whole 64-row x "
            "128-code tiles")):
        dj.block_expert_weights(split_rows)


@pytest.mark.parametrize("tokens", [1, 5])
def test_blocked_experts_give_the_logits_of_rows(tokens):
    cfg = dj.Config.tiny(quantized=True)
    params = dj.init_params(cfg, 1)
    blocked_cfg = cfg.replace(expert_layout="blocked")
    blocked = dj.block_expert_weights(jax.tree.map(jnp.copy, params))
    tok = (3 + 11 * jnp.arange(2 * tokens, dtype=jnp.int32).reshape(2, tokens)) % cfg.vocab_size

    def logits(c, p):
        cache = dj.Cache.init(c, 2, 64)
        out, _ = dj.DSV4(c).apply({"params": p}, tok, cache)
        return np.asarray(out, np.float32)
    np.testing.assert_array_equal(logits(blocked_cfg, blocked), logits(cfg, params))


@pytest.mark.parametrize("kw, why", [
    (dict(quantized=False), "quantized=False"),
    (dict(quantized=True, expert_dtype="fp8"), "expert_dtype='fp8'")])
def test_config_refuses_blocked_without_fp4_experts(kw, why):
    with pytest.raises(ValueError, match=r"expert_layout 'blocked' is a layout of packed FP4 "
                                         r"experts .*" + re.escape(why)):
        dj.Config.tiny(expert_layout="blocked", **kw)
    with pytest.raises(ValueError, match=r"expert_layout must be one of \('rows', 'blocked'\)"):
        dj.Config.tiny(quantized=True, expert_layout="tiles")


def test_load_blocks_fp4_experts_by_default_and_save_writes_rows(tmp_path):
    cfg = tiny_config()
    write_tiny_checkpoint(tmp_path / "hf", cfg)
    model, blocked = dj.load(tmp_path / "hf")
    rows_model, rows = dj.load(tmp_path / "hf", expert_layout="rows")
    assert model.config.expert_layout == "blocked"
    assert rows_model.config == model.config.replace(expert_layout="rows")
    for (path, w), b in zip(_expert_weights(rows).items(), _expert_weights(blocked).values()):
        np.testing.assert_array_equal(np.asarray(quant.block_fp4_weight(w)), np.asarray(b),
                                      err_msg=jax.tree_util.keystr(path))
    # save writes the checkpoints' row layout whatever the parameters' layout
    dj.save(tmp_path / "orbax", blocked, model.config)
    assert read_config(str(tmp_path / "orbax")).expert_layout == "rows"
    _, rows_again = dj.load(tmp_path / "orbax", expert_layout="rows")
    _, blocked_again = dj.load(tmp_path / "orbax")
    for want, got in ((rows, rows_again), (blocked, blocked_again)):
        assert jax.tree.structure(want) == jax.tree.structure(got)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a placement given for the files' rows holds for the tiles too
    one = NamedSharding(jax.make_mesh((1,), ("x",)), P())
    _, placed = dj.load(tmp_path / "hf", shardings=one)
    assert all(leaf.sharding == one for leaf in jax.tree.leaves(placed))
    for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(blocked)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if len(jax.devices()) >= 2:                 # w2's 64 bytes per row split in two halves
        split_k = NamedSharding(jax.make_mesh((2,), ("x",), devices=jax.devices()[:2]),
                                P(None, None, "x"))
        rows_placed, _ = dj.load(tmp_path / "hf", shardings=lambda path, sds: (
            split_k if "experts" in path and path[-1] == "weight" else one))
        assert rows_placed.config.expert_layout == "rows"        # shards not whole tiles
    # the blocked parameters are left as they were
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(blocked))
    plain_model, _ = dj.load(tmp_path / "hf", dequantize=True)
    assert plain_model.config.expert_layout == "rows"
    with pytest.raises(ValueError, match=r"expert_layout 'blocked' is a layout of packed FP4"):
        dj.load(tmp_path / "hf", dequantize=True, expert_layout="blocked")
    with pytest.raises(ValueError, match=r"load: expert_layout must be None, 'rows' or "
                                         r"'blocked', got 'tiles'"):
        dj.load(tmp_path / "hf", expert_layout="tiles")


def _lower(cfg, tokens, ops, batch=2):
    model = dj.DSV4(cfg, implementation=KernelPolicy(ops=ops), runtime_checks=False)
    cache = jax.eval_shape(lambda: dj.Cache.init(cfg, batch, 512))
    return lower_step(model, cfg, cache, batch, tokens)


@pytest.mark.parametrize("tokens", [1, 264])
def test_model_steps_run_the_moe_kernels_on_the_tiles(tokens):
    cfg = dj.Config.tiny(quantized=True, expert_layout="blocked")
    text = _lower(cfg, tokens, OTHER_OPS_ON_REFERENCES)
    assert CUSTOM_CALL in text and "GroupedGemm" in text
    # The kernels read the tiles: no transpose of a 5-D byte array (unblocking) is lowered,
    # as the reference's is.
    five_d_bytes = re.compile(r"stablehlo\.transpose.*tensor<\d+x\d+x\d+x64x64xu?i8>")
    assert not five_d_bytes.search(text)
    reference = _lower(cfg, tokens, OTHER_OPS_ON_REFERENCES | {"moe_experts": "xla"})
    assert CUSTOM_CALL not in reference and five_d_bytes.search(reference)
