"""Config presets, validation, HF config.json round trip, parameter counts from abstract shapes."""
import dataclasses
import json

import pytest

import dsv4_jax as dj
from dsv4_jax.config import Config

FLASH_HF = {   # deepseek-ai/DeepSeek-V4-Flash config.json (April release), docs/architecture.md §2
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 256,
    "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2048,
    "num_hash_layers": 3, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "hidden_act": "silu", "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "bos_token_id": 0, "eos_token_id": 1,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
}


def test_flash_preset_matches_published_config():
    c = Config.flash()
    assert (c.dim, c.n_layers, c.n_heads, c.q_lora_rank, c.o_groups, c.index_topk) == \
        (4096, 43, 64, 1024, 8, 512)
    assert len(c.compress_ratios) == 44 and c.compress_ratios[:4] == (0, 0, 4, 128)
    assert c.compress_ratios[42:] == (4, 0)                     # last layer CSA, MTP SWA-only
    assert sum(r == 4 for r in c.compress_ratios) == 21 and sum(r == 128 for r in c.compress_ratios) == 20
    assert c.n_hash_layers == 3 and c.n_mtp_layers == 1 and c.route_scale == 1.5


def test_pro_preset_matches_published_config():
    c = Config.pro()
    assert (c.dim, c.n_layers, c.n_heads, c.q_lora_rank, c.o_groups, c.index_topk) == \
        (7168, 61, 128, 1536, 16, 1024)
    assert len(c.compress_ratios) == 62 and c.compress_ratios[:3] == (128, 128, 4)
    assert sum(r == 128 for r in c.compress_ratios) == 31 and sum(r == 4 for r in c.compress_ratios) == 30
    assert c.compress_ratios[-1] == 0 and c.n_routed_experts == 384 and c.route_scale == 2.5


def test_tiny_keeps_every_structural_feature():
    c = Config.tiny()
    ratios = c.compress_ratios[:c.n_layers]
    assert {0, 4, 128} <= set(ratios)
    assert (c.head_dim, c.rope_head_dim, c.index_head_dim) == (512, 64, 128)
    assert 0 < c.n_hash_layers < c.n_layers                     # hash and biased routing
    assert c.n_mtp_layers == 1 and c.n_shared_experts == 1


def test_config_is_frozen_hashable_and_documented():
    c = Config.tiny()
    assert hash(c) == hash(Config.tiny()) and c == Config.tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.dim = 3
    for f in dataclasses.fields(Config):
        assert Config.field_doc(f.name), f.name


def test_from_hf_reads_flash_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FLASH_HF))
    c = Config.from_hf(tmp_path)
    assert c == Config.flash(quantized=True)
    assert Config.from_hf(tmp_path, quant_simulation=False).quant_simulation is False
    assert Config.from_hf_dict(c.to_hf_dict()) == c


@pytest.mark.parametrize("changes, needle", [
    (dict(n_heads=6, o_groups=4), "o_groups"),
    (dict(compress_ratios=(0, 4, 128, 4)), "compress_ratios"),
    (dict(compress_ratios=(0, 4, 64, 4, 0)), "compress_ratios"),
    (dict(compress_ratios=(0, 4, 128, 4, 4)), "MTP"),
    (dict(n_activated_experts=9), "n_activated_experts"),
    (dict(index_head_dim=96), "index_head_dim"),
    (dict(dtype="float16"), "dtype"),
    (dict(dim=200), "multiples of 128"),
])
def test_inconsistent_config_raises_value_error(changes, needle):
    with pytest.raises(ValueError, match=needle):
        Config.tiny(**changes)


def test_unknown_or_mistyped_override_raises_type_error(tmp_path):
    with pytest.raises(TypeError, match="quant_simulaton"):
        Config.tiny(quant_simulaton=False)
    with pytest.raises(TypeError, match="quant_simulation"):
        Config.tiny(quant_simulation="no")
    (tmp_path / "config.json").write_text(json.dumps(FLASH_HF))
    with pytest.raises(TypeError, match="bogus"):
        Config.from_hf(tmp_path, bogus=1)


def test_from_hf_rejects_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**FLASH_HF, "architectures": ["LlamaForCausalLM"],
                                                      "model_type": "llama"}))
    with pytest.raises(ValueError, match="architecture"):
        Config.from_hf(tmp_path)


def test_published_parameter_counts_from_abstract_shapes():
    """Logical parameters (FP4 bytes count 2, E8M0 scales and the hash table excluded),
    counted on ``jax.eval_shape`` trees -- nothing is allocated.

    Measured: Flash 284.33B without the MTP block (290.94B with it); Pro 1572.997B without
    MTP, 1598.84B with it. DeepSeek's published totals follow the V3 convention (the MTP
    module is not counted): 284B matches to 0.12%; "1.6T" is given to two significant
    figures, and the count with the MTP block is within 0.07% of it. The storage is checked
    against the official Pro tensor inventory: 145,116 tensors and 805.33 GiB.
    """
    flash = Config.flash(quantized=True)
    pro = Config.pro(quantized=True)
    n_flash = dj.param_count(flash, include_mtp=False)
    assert abs(n_flash / 284e9 - 1) < 0.01, n_flash
    n_pro_main = dj.param_count(pro, include_mtp=False)
    n_pro = dj.param_count(pro)
    assert abs(n_pro / 1.6e12 - 1) < 0.01, n_pro
    assert round(n_pro_main / 1e11) / 10 == 1.6, n_pro_main
    import jax
    leaves = jax.tree_util.tree_leaves_with_path(dj.abstract_params(pro))
    pro_bytes = sum(x.size * x.dtype.itemsize for _, x in leaves)
    # tid2eid is I64 in the checkpoint and int32 here: add the 4 missing bytes per entry.
    pro_bytes += 3 * 129280 * 6 * 4
    # The listed size includes the 64 shards' safetensors headers (~14 MB of JSON).
    assert abs(pro_bytes / 2 ** 30 - 805.33) < 0.05, pro_bytes / 2 ** 30
    # Routed experts are stacked here, one tensor per expert in the checkpoint.
    n_tensors = sum(pro.n_routed_experts if any(getattr(k, "key", None) == "experts" for k in p)
                    else 1 for p, _ in leaves)
    assert n_tensors == 145116
