"""Checkpoint loading on tiny checkpoints in the exact official format.

Round trips (HF -> params/logits bitwise, orbax save/load, the convert CLI), dequantization,
deterministic greedy decoding from a loaded checkpoint, shardings, per-expert stacking and
nibble order, FP8 experts, and every kind of bad input with the error it must raise.
"""
import argparse
import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import dsv4_jax as dj
from dsv4_jax.checkpoints import CheckpointError, convert
from dsv4_jax.checkpoints.names import checkpoint_inventory
from dsv4_jax.checkpoints.safetensors_io import SafetensorsFile, write_safetensors
from dsv4_jax.checkpoints.testing import tiny_config, write_tiny_checkpoint
from dsv4_jax import quant

# Three layers keep every structural feature (SWA + hash routing, CSA + indexer + hash
# routing, HCA + biased routing, MTP) and compile faster than Config.tiny's four.
CFG = tiny_config(n_layers=3, compress_ratios=(0, 4, 128, 0))
PROMPT = jnp.array([[3, 14, 15, 92]], jnp.int32)
INDEX = "model.safetensors.index.json"


# ----------------------------------------------------------------------------- helpers
def flat(tree):
    return [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in
            jax.tree_util.tree_leaves_with_path(tree)]


def assert_bitwise_equal(a, b):
    fa, fb = flat(a), flat(b)
    assert [k for k, _ in fa] == [k for k, _ in fb]
    for (k, x), (_, y) in zip(fa, fb):
        assert (x.dtype, x.shape) == (y.dtype, y.shape), k
        assert x.tobytes() == y.tobytes(), f"{k} differs"


def edit_checkpoint(src, dst, drop=(), put=None):
    """Copy an HF checkpoint, dropping / replacing / adding tensors (index kept consistent);
    new names go to the first shard."""
    shutil.copytree(src, dst)
    put = dict(put or {})
    with open(os.path.join(dst, INDEX)) as f:
        index = json.load(f)
    weight_map = index["weight_map"]
    first = sorted(set(weight_map.values()))[0]
    for name in put:
        weight_map.setdefault(name, first)
    for name in drop:
        del weight_map[name]
    for shard in sorted(set(weight_map.values())):
        file = os.path.join(dst, shard)
        with SafetensorsFile(file) as st:
            tensors = {n: st.read(n) for n in st.tensors if n not in drop}
        tensors.update({n: a for n, a in put.items() if weight_map[n] == shard})
        write_safetensors(file, tensors)
    with open(os.path.join(dst, INDEX), "w") as f:
        json.dump(index, f)
    return dst


def raw_tensor(directory, name):
    """A tensor straight from the file bytes (independent of the loader's reader)."""
    with open(os.path.join(directory, INDEX)) as f:
        shard = json.load(f)["weight_map"][name]
    with open(os.path.join(directory, shard), "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    entry = json.loads(data[8:8 + n])[name]
    begin, end = entry["data_offsets"]
    dt = {"I8": np.int8, "F8_E8M0": ml_dtypes.float8_e8m0fnu}[entry["dtype"]]
    return np.frombuffer(data[8 + n + begin:8 + n + end], dt).reshape(entry["shape"])


def jit_apply(cfg):
    """One compilation per config: every call below is a [1, 1] step (prompt tokens are fed
    one at a time). Optimisation level 0 halves the CPU compile time; each comparison is
    between runs of one executable, so it changes nothing that is checked."""
    return jax.jit(dj.DSV4(cfg).apply,
                   compiler_options={"xla_backend_optimization_level": 0})


def prompt_logits(apply, params, cfg=CFG):
    """f32 logits [len(PROMPT), vocab] of the prompt, and the cache after it."""
    cache, out = dj.Cache.init(cfg, 1, 64), []
    for i in range(PROMPT.shape[1]):
        logits, cache = apply({"params": params}, PROMPT[:, i:i + 1], cache)
        out.append(np.asarray(logits[0, -1]))
    return np.stack(out), cache


def greedy(apply, params, steps=5):
    logits, cache = prompt_logits(apply, params)
    tokens = [int(np.argmax(logits[-1]))]
    for _ in range(steps - 1):
        logits, cache = apply({"params": params}, jnp.array([[tokens[-1]]], jnp.int32), cache)
        tokens.append(int(jnp.argmax(logits[0, -1])))
    return tokens


def load_rows(path, **kw):
    """``dj.load`` in the files' row layout: these tests compare with the written tensors.
    The default (blocked FP4 experts) is tested in test_blocked_experts_model.py, and the
    multi-device script below runs it."""
    return dj.load(path, expert_layout="rows", **kw)


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    assert hf_checkpoint.config == CFG
    return hf_checkpoint.path, hf_checkpoint.params


@pytest.fixture(scope="module")
def loaded(ckpt):
    return load_rows(ckpt[0])


@pytest.fixture(scope="module")
def apply_q():
    return jit_apply(CFG)


@pytest.fixture(scope="module")
def orbax_dir(loaded, tmp_path_factory):
    model, params = loaded
    return dj.save(str(tmp_path_factory.mktemp("orbax") / "ckpt"), params, model.config)


# ----------------------------------------------------------------------------- format
def test_tiny_checkpoint_is_in_the_official_format(ckpt):
    from safetensors import safe_open
    path, params = ckpt
    with open(os.path.join(path, INDEX)) as f:
        weight_map = json.load(f)["weight_map"]
    assert sorted(set(weight_map.values())) == [f"model-0000{k}-of-00003.safetensors"
                                                for k in (1, 2, 3)]
    assert len(weight_map) == len(checkpoint_inventory(CFG))
    assert not any(n.startswith("model.") or n.startswith("mtp.0.embed") or n == "mtp.0.head.weight"
                   for n in weight_map)
    want = {   # name: (dtype, shape) as in the published files (docs/architecture.md §6)
        "embed.weight": ("BF16", [1024, 256]), "hc_head_fn": ("F32", [4, 1024]),
        "layers.0.attn.wq_a.weight": ("F8_E4M3", [128, 256]),
        "layers.0.attn.wq_a.scale": ("F8_E8M0", [1, 2]),
        "layers.0.attn.wo_a.scale": ("F8_E8M0", [2, 8]),
        "layers.1.attn.indexer.wq_b.scale": ("F8_E8M0", [4, 1]),
        "layers.1.attn.compressor.ape": ("F32", [4, 1024]),
        "layers.0.ffn.gate.tid2eid": ("I64", [1024, 2]),
        "layers.2.ffn.gate.bias": ("F32", [8]),
        "layers.0.ffn.experts.7.w2.weight": ("I8", [256, 64]),
        "layers.0.ffn.experts.7.w2.scale": ("F8_E8M0", [256, 4]),
        "mtp.0.e_proj.weight": ("F8_E4M3", [256, 256]), "mtp.0.ffn.gate.bias": ("F32", [8]),
    }
    for name, (dtype, shape) in want.items():
        with safe_open(os.path.join(path, weight_map[name]), "np") as f:   # the official parser
            sl = f.get_slice(name)
            assert (sl.get_dtype(), sl.get_shape()) == (dtype, shape), name
    with safe_open(os.path.join(path, weight_map["layers.0.ffn.gate.tid2eid"]), "np") as f:
        np.testing.assert_array_equal(f.get_tensor("layers.0.ffn.gate.tid2eid"),
                                      params["layers_0"]["ffn"]["gate"]["tid2eid"])


def test_reader_reads_files_written_by_the_safetensors_library(tmp_path):
    from safetensors.numpy import save_file
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32),
               "ids": rng.integers(-9, 9, (7,)).astype(np.int64),
               "packed": rng.integers(-128, 127, (2, 3)).astype(np.int8),
               "empty": np.zeros((0, 4), np.float32)}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"format": "np"})
    with SafetensorsFile(tmp_path / "x.safetensors") as f:
        assert f.metadata == {"format": "np"} and set(f.tensors) == set(tensors)
        for name, want in tensors.items():
            got = f.read(name)
            assert got.dtype == want.dtype and np.array_equal(got, want), name
        np.testing.assert_array_equal(f.read("a", (slice(1, 3), slice(None))), tensors["a"][1:3])


@pytest.mark.slow
def test_pro_inventory_is_the_published_145116_tensors():
    assert len(checkpoint_inventory(dj.Config.pro(quantized=True))) == 145_116


# ----------------------------------------------------------------------------- round trips
def test_load_reproduces_params_and_logits_bitwise(ckpt, loaded, apply_q):
    _, params = ckpt
    model, got = loaded
    assert model.config == CFG
    assert_bitwise_equal(got, params)
    want, _ = prompt_logits(apply_q, params)
    have, _ = prompt_logits(apply_q, got)
    assert np.isfinite(have).all() and have.std() > 0.1
    assert have.tobytes() == want.tobytes()


def test_orbax_save_load_round_trip(loaded, orbax_dir, apply_q):
    model, params = loaded
    model2, restored = load_rows(orbax_dir)
    assert model2.config == model.config
    assert_bitwise_equal(restored, params)
    a, _ = prompt_logits(apply_q, params)
    b, _ = prompt_logits(apply_q, restored)
    assert a.tobytes() == b.tobytes()
    with pytest.raises(FileExistsError, match="not empty"):
        dj.save(orbax_dir, params, model.config)
    dj.save(orbax_dir, params, model.config, overwrite=True)
    assert_bitwise_equal(load_rows(orbax_dir)[1], params)


def test_convert_cli_writes_a_loadable_orbax_checkpoint(ckpt, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    convert.add_arguments(parser)
    dst = str(tmp_path / "converted")
    assert convert.main(parser.parse_args([ckpt[0], dst, "--no-progress"])) == 0
    assert "wrote" in capsys.readouterr().out
    model, params = load_rows(dst)
    assert model.config == CFG
    assert_bitwise_equal(params, ckpt[1])
    assert convert.main(parser.parse_args([ckpt[0], dst])) == 1       # exists, no --overwrite
    assert "not empty" in capsys.readouterr().err


def test_dequantize_gives_exact_plain_weights_and_close_logits(ckpt, loaded):
    path = ckpt[0]
    _, qparams = loaded
    model, params = load_rows(path, dequantize=True, quant_simulation=False)
    assert not model.config.quantized and model.config.dtype == "bfloat16"
    q, d = dict(flat(qparams)), dict(flat(params))
    formats = (("fp4", quant.dequant_fp4_weight), ("fp8", quant.dequant_fp8_weight))
    reference = {fmt: jax.jit(lambda w, s, fn=fn: fn(w, s).astype(jnp.bfloat16))
                 for fmt, fn in formats}
    n_dequant = 0
    for key, value in d.items():
        if key.endswith("['weight']") and key.replace("['weight']", "['scale']") in q:
            w, s = q[key], q[key.replace("['weight']", "['scale']")]
            want = np.asarray(reference["fp4" if w.dtype == np.int8 else "fp8"](w, s))
            n_dequant += 1
        else:
            want = q[key]
        assert value.dtype == want.dtype and value.tobytes() == want.tobytes(), key
    # 4 blocks x (5 attention + 3 shared + 3 stacked expert) + CSA indexer.wq_b + MTP e/h_proj
    assert n_dequant == 4 * 11 + 1 + 2
    ref_model, ref_params = load_rows(path, quant_simulation=False)
    a, _ = prompt_logits(jit_apply(model.config), params)
    b, _ = prompt_logits(jit_apply(ref_model.config), ref_params)
    print("dequantized vs quantized logits, max |diff| / max |logit|:",
          np.max(np.abs(a - b)) / np.max(np.abs(b)))
    assert np.max(np.abs(a - b)) <= 1e-3 * np.max(np.abs(b))


def test_orbax_dequantize_and_float32_match_the_hf_path(ckpt, orbax_dir):
    hf = load_rows(ckpt[0], dequantize=True, dtype="float32")
    ob = load_rows(orbax_dir, dequantize=True, dtype="float32")
    assert hf[0].config == ob[0].config and ob[0].config.dtype == "float32"
    assert_bitwise_equal(hf[1], ob[1])
    emb = ckpt[1]["embed"]["weight"]
    assert hf[1]["embed"]["weight"].dtype == jnp.float32
    assert np.array_equal(np.asarray(hf[1]["embed"]["weight"]), np.asarray(emb, np.float32))


def test_greedy_decoding_from_a_loaded_checkpoint_is_deterministic(loaded, apply_q):
    _, params = loaded
    first = greedy(apply_q, params)
    assert greedy(apply_q, params) == first
    assert all(0 <= t < CFG.vocab_size for t in first)


# ----------------------------------------------------------------------------- placement
def test_shardings_place_every_leaf(ckpt, orbax_dir):
    mesh = jax.make_mesh((1,), ("x",))
    one = NamedSharding(mesh, P())
    for source in (ckpt[0], orbax_dir):
        _, params = load_rows(source, shardings=one)
        assert all(x.sharding == one for x in jax.tree.leaves(params))
        assert_bitwise_equal(params, ckpt[1])
    tree = jax.tree.map(lambda _: one, ckpt[1])
    _, params = load_rows(ckpt[0], shardings=tree)
    assert all(x.sharding == one for x in jax.tree.leaves(params))
    rows = NamedSharding(mesh, P("x"))
    _, params = load_rows(ckpt[0], shardings=lambda path, sds: rows if path[-1] == "weight" else one)
    assert params["layers_0"]["ffn"]["experts"]["w1"]["weight"].sharding == rows
    assert params["layers_0"]["ffn"]["experts"]["w1"]["scale"].sharding == one
    assert_bitwise_equal(params, ckpt[1])
    with pytest.raises(ValueError, match="mesh axes must be 'data' and/or 'expert'"):
        load_rows(ckpt[0], mesh=mesh)                 # mesh= uses the rule table's axis names
    del tree["layers_1"]["attn"]["wkv"]
    with pytest.raises(ValueError, match=r"layers_1/attn/wkv/scale"):
        load_rows(ckpt[0], shardings=tree)


MULTI_DEVICE_SCRIPT = """
import sys, numpy as np, jax, dsv4_jax as dj
from jax.sharding import NamedSharding, PartitionSpec as P
from dsv4_jax.checkpoints import hf
reads = []
_call = hf.LeafReader.__call__
def spy(self, index):
    reads.append((self.plan.name, index))
    return _call(self, index)
hf.LeafReader.__call__ = spy
mesh = jax.make_mesh((4,), ("x",))
def rule(path, sds):        # experts split over the expert axis, big matrices over rows
    if "experts" in path:
        return NamedSharding(mesh, P("x"))
    if sds.ndim == 2 and sds.shape[0] % 4 == 0:
        return NamedSharding(mesh, P("x", None))
    return NamedSharding(mesh, P())
for kw in ({}, {"dequantize": True}):
    _, want = dj.load(sys.argv[1], **kw)
    reads.clear()
    _, got = dj.load(sys.argv[1], shardings=rule, **kw)
    for (k, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(got),
                              jax.tree_util.tree_leaves_with_path(want)):
        assert len(a.sharding.device_set) == 4, k
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), k
    experts = [i[0] for n, i in reads if n == "layers_0/ffn/experts/w1/weight"]
    assert sorted((s.start, s.stop) for s in experts) == [(0, 2), (2, 4), (4, 6), (6, 8)], experts
print("ok")
"""


def test_sharded_load_over_four_devices_reads_each_devices_slice(ckpt, tmp_path):
    """Four host devices (a fresh process: the device count is fixed at JAX start-up)."""
    import subprocess
    import sys
    script = tmp_path / "sharded.py"
    script.write_text(MULTI_DEVICE_SCRIPT)
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, str(script), ckpt[0]], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_expert_stacking_keeps_expert_order_and_nibble_order(ckpt, loaded):
    path = ckpt[0]
    _, params = loaded
    _, plain = load_rows(path, dequantize=True)
    for layer, e in (("0", 3), ("2", 7)):
        w = raw_tensor(path, f"layers.{layer}.ffn.experts.{e}.w1.weight")
        s = raw_tensor(path, f"layers.{layer}.ffn.experts.{e}.w1.scale")
        stacked = params[f"layers_{layer}"]["ffn"]["experts"]["w1"]
        assert np.asarray(stacked["weight"][e]).tobytes() == w.tobytes()
        want = quant.dequant_fp4_weight(jnp.asarray(w), jnp.asarray(s))
        got = plain[f"layers_{layer}"]["ffn"]["experts"]["w1"]["weight"][e]
        assert np.array_equal(np.asarray(got, np.float32), np.asarray(want))
        # element 0 is the low nibble of byte 0, element 1 its high one (docs/architecture.md §5.3)
        b = int(w.view(np.uint8)[0, 0])
        scale0 = float(np.asarray(s[0, 0], np.float32))
        assert float(got[0, 0]) == quant.FP4_CODE_VALUES[b & 0xF] * scale0
        assert float(got[0, 1]) == quant.FP4_CODE_VALUES[b >> 4] * scale0


def test_fp8_experts_are_detected_when_config_json_omits_expert_dtype(tmp_path):
    cfg = CFG.replace(expert_dtype="fp8")
    path = str(tmp_path / "base")
    params = write_tiny_checkpoint(path, cfg, shards=2)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    del hf["expert_dtype"]                    # as the April config.json files
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    model, got = load_rows(path)
    assert model.config.expert_dtype == "fp8"
    assert_bitwise_equal(got, params)
    hf["expert_dtype"] = "fp4"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight is F8_E4M3"):
        load_rows(path)


def test_f32_power_of_two_scales_load_as_e8m0(ckpt, tmp_path):
    path, params = ckpt
    name = "layers.1.attn.wq_b.scale"
    s = np.asarray(params["layers_1"]["attn"]["wq_b"]["scale"]).astype(np.float32)
    edited = edit_checkpoint(path, str(tmp_path / "f32"), put={name: s})
    assert_bitwise_equal(load_rows(edited)[1], params)
    bad = edit_checkpoint(path, str(tmp_path / "bad"), put={name: s * np.float32(1.5)})
    with pytest.raises(CheckpointError, match=name + ".*not a power of two"):
        load_rows(bad)


# ----------------------------------------------------------------------------- bad input
def test_missing_and_unexpected_tensors_are_all_listed(ckpt, tmp_path):
    path, params = ckpt
    extra = np.zeros((4,), ml_dtypes.bfloat16)
    edited = edit_checkpoint(path, str(tmp_path / "e"),
                             drop=("layers.1.attn.wq_b.scale", "layers.0.ffn.experts.5.w3.weight"),
                             put={"layers.0.attn.extra.weight": extra,
                                  "layers.9.attn_norm.weight": extra,
                                  "mtp.0.head.weight": extra})     # ignored, as the reference does
    with pytest.raises(CheckpointError) as err:
        load_rows(edited)
    msg = str(err.value)
    assert "2 missing tensors" in msg and "2 unexpected tensors" in msg
    for name in ("layers.1.attn.wq_b.scale", "layers.0.ffn.experts.5.w3.weight",
                 "layers.0.attn.extra.weight", "layers.9.attn_norm.weight"):
        assert name in msg


def test_wrong_shape_or_dtype_names_the_tensor(ckpt, tmp_path):
    path, params = ckpt
    edited = edit_checkpoint(path, str(tmp_path / "e"), put={
        "layers.0.attn.wkv.weight": np.zeros((512, 128), ml_dtypes.float8_e4m3fn),
        "embed.weight": np.zeros((1024, 256), np.float32)})
    with pytest.raises(CheckpointError) as err:
        load_rows(edited)
    msg = str(err.value)
    assert "layers.0.attn.wkv.weight: expected F8_E4M3[512, 256], got F8_E4M3[512, 128]" in msg
    assert "embed.weight: expected BF16[1024, 256], got F32[1024, 256]" in msg


def test_out_of_range_expert_ids_are_rejected(ckpt, tmp_path):
    path, params = ckpt
    table = np.asarray(params["layers_1"]["ffn"]["gate"]["tid2eid"]).astype(np.int64)
    table[5, 1] = CFG.n_routed_experts
    edited = edit_checkpoint(path, str(tmp_path / "e"), put={"layers.1.ffn.gate.tid2eid": table})
    with pytest.raises(CheckpointError, match=r"layers\.1\.ffn\.gate\.tid2eid: expert id 8"):
        load_rows(edited)


def _header_bytes(header: dict) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw


@pytest.mark.parametrize("case, match", [
    ("truncated", "truncated"),
    ("header_past_end", "runs past the end"),
    ("bad_json", "not valid UTF-8 JSON"),
    ("size_mismatch", r"F32\[3\] needs 12 bytes"),
    ("unknown_dtype", "unknown dtype"),
    ("overlap", "overlap"),
])
def test_corrupt_safetensors_files_are_named(ckpt, tmp_path, case, match):
    path = ckpt[0]
    edited = str(tmp_path / "c")
    shutil.copytree(path, edited)
    shard = os.path.join(edited, "model-00002-of-00003.safetensors")
    if case == "truncated":
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) - 100)
    else:
        entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
        header = {
            "header_past_end": None, "bad_json": None,
            "size_mismatch": {"a": {**entry, "shape": [3]}},
            "unknown_dtype": {"a": {**entry, "dtype": "F4X"}},
            "overlap": {"a": entry, "b": {**entry, "data_offsets": [4, 12]}},
        }[case]
        if case == "header_past_end":
            data = (10 ** 6).to_bytes(8, "little") + b"{}"
        elif case == "bad_json":
            data = (5).to_bytes(8, "little") + b"{oops"
        else:
            data = _header_bytes(header) + bytes(16)
        with open(shard, "wb") as f:
            f.write(data)
    with pytest.raises(CheckpointError, match=match) as err:
        load_rows(edited)
    assert "model-00002-of-00003.safetensors" in str(err.value)


def test_index_and_directory_problems(ckpt, tmp_path):
    path = ckpt[0]
    missing_shard = str(tmp_path / "m")
    shutil.copytree(path, missing_shard)
    os.remove(os.path.join(missing_shard, "model-00003-of-00003.safetensors"))
    with pytest.raises(FileNotFoundError, match="model-00003-of-00003.safetensors"):
        load_rows(missing_shard)
    wrong_index = str(tmp_path / "w")
    shutil.copytree(path, wrong_index)
    with open(os.path.join(wrong_index, INDEX)) as f:
        index = json.load(f)
    index["weight_map"]["embed.weight"] = "model-00003-of-00003.safetensors"
    with open(os.path.join(wrong_index, INDEX), "w") as f:
        json.dump(index, f)
    with pytest.raises(CheckpointError, match=r"(?s)index.json disagrees.*"
                                              r"not found in the named file: embed\.weight"):
        load_rows(wrong_index)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_rows(str(tmp_path / "nowhere"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="neither config.json"):
        load_rows(str(tmp_path / "empty"))


def test_unknown_architecture_and_bad_overrides(ckpt, tmp_path):
    path = ckpt[0]
    with pytest.raises(TypeError, match="n_expertz"):
        load_rows(path, n_expertz=4)
    with pytest.raises(TypeError, match="quant_simulation"):
        load_rows(path, quant_simulation="no")
    with pytest.raises(ValueError, match="float16"):
        load_rows(path, dtype="float16")
    with pytest.raises(ValueError, match="expert_dtype='fp8'"):
        load_rows(path, expert_dtype="fp8")
    llama = str(tmp_path / "llama")
    shutil.copytree(path, llama)
    with open(os.path.join(llama, "config.json")) as f:
        hf = json.load(f)
    hf.update(architectures=["LlamaForCausalLM"], model_type="llama")
    with open(os.path.join(llama, "config.json"), "w") as f:
        json.dump(hf, f)
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_rows(llama)


def test_incompatible_orbax_checkpoint_names_the_leaves(orbax_dir, loaded, tmp_path):
    with pytest.raises(CheckpointError) as err:
        load_rows(orbax_dir, n_routed_experts=16)
    msg = str(err.value)
    assert "n_routed_experts: stored 8, requested 16" in msg
    assert "layers_0/ffn/experts/w1/weight: expected int8[16, 128, 128]" in msg
    edited = str(tmp_path / "o")
    shutil.copytree(orbax_dir, edited)
    cfg_file = os.path.join(edited, "dsv4_config.json")
    with open(cfg_file) as f:
        doc = json.load(f)
    doc["config"].update(n_layers=4, compress_ratios=[0, 4, 128, 4, 0])   # files hold 3 layers
    with open(cfg_file, "w") as f:
        json.dump(doc, f)
    with pytest.raises(CheckpointError, match=r"missing in the checkpoint: layers_3/"):
        load_rows(edited)
    model, params = loaded
    params = dict(params)
    params["norm"] = {"weight": jnp.zeros((128,), jnp.bfloat16)}
    with pytest.raises(ValueError, match=r"norm/weight: expected bfloat16\[256\]"):
        dj.save(str(tmp_path / "never"), params, model.config)
