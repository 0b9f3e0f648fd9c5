"""``benchmarks/decode_gemms.py`` without a GPU: the GEMMs it times are the Flash layer's, and
its variants start with the model's config and stay within what the kernels take."""
import os
import sys

import pytest

import jax
import jax.numpy as jnp

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import decode_gemms  # noqa: E402
from dsv4_jax import quant  # noqa: E402
from dsv4_jax.config import Config  # noqa: E402
from dsv4_jax.ffi.grouped_gemm_sm90 import use_row_tiles  # noqa: E402
from dsv4_jax.ffi.moe_sm90 import with_token_codes, moe_configs  # noqa: E402
from dsv4_jax.kernels import grouped_gemm_config as support  # noqa: E402


def test_the_flash_layer_gemms():
    shapes = decode_gemms.gemm_shapes(Config.flash(quantized=True))
    dims = {name: (s.groups, s.n, s.k, s.fmt, s.gated) for name, s in shapes.items()}
    assert dims == {
        "wq_a": (1, 1024, 4096, "fp8", False), "wkv": (1, 512, 4096, "fp8", False),
        "wq_b": (1, 32768, 1024, "fp8", False), "index_wq_b": (1, 8192, 1024, "fp8", False),
        "wo_a": (8, 1024, 4096, "fp8", False), "wo_b": (1, 4096, 8192, "fp8", False),
        "shared_w13": (1, 2048, 4096, "fp8", True), "shared_w2": (1, 4096, 2048, "fp8", False),
        "routed_w13": (256, 2048, 4096, "fp4", True), "routed_w2": (256, 4096, 2048, "fp4", False)}
    assert not shapes["wo_a"].simulate and shapes["wo_a"].rows_per_token == 8
    assert shapes["routed_w13"].routed and shapes["routed_w13"].rows_per_token == 6


def test_variants_start_with_the_model_config_and_fit():
    shape = decode_gemms.gemm_shapes(Config.flash(quantized=True))["wo_b"]
    out = decode_gemms.variants(shape, 1, sweep=True, ablations=True,
                                algorithms=("mma_sync",))
    labels = [label for label, _ in out]
    model = out[0][1]
    assert labels[0] == "model" and (model.algorithm, model.split_k) == ("wgmma_rs", 8)
    assert "decode_algorithm mma_sync" in labels
    assert {c.ablation for _, c in out} >= set(support.KERNELS["mma_fp8"].ablations) - {
        "no_dequant"}                                          # FP8 weights: nothing to convert
    for label, config in out:
        assert config.smem_bytes(shape.fmt, shape.gated) <= support.SMEM_BYTES, label
        assert config.split_k <= shape.k // support.BLOCK_K // 4, label
    assert len({c for _, c in out}) == len(out)                # no variant twice


@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_routed_launches_take_the_configs_the_moe_op_gives_them(tokens):
    """The routed rows' "model" configs are the MoE op's own (``moe_configs``: both launches'
    features cap the K splits; "auto" picks each launch's kernel, split and stages; the
    gated launch takes token codes where the op gathers its rows: not at T = 1's row
    tiles)."""
    cfg = Config.flash(quantized=True)
    shapes = decode_gemms.gemm_shapes(cfg)
    rows = tokens * cfg.n_activated_experts
    e = cfg.n_routed_experts
    w = lambda n, k: (jax.ShapeDtypeStruct((e, n, k // 2), jnp.uint8),  # noqa: E731
                      jax.ShapeDtypeStruct((e, n, k // 32), quant.E8M0_DTYPE))
    d, inter = cfg.dim, cfg.moe_inter_dim
    want = moe_configs(rows, w(inter, d), w(d, inter), simulate=True, policy=None)
    want = with_token_codes(*want, None, gathered=not use_row_tiles(rows, e, want[0]),
                        explicit=False)
    assert want[0].token_codes == (tokens > 1) and not want[1].token_codes
    got = tuple(decode_gemms.variants(shapes[name], rows, sweep=False, ablations=False)[0][1]
                for name in ("routed_w13", "routed_w2"))
    assert got == want


def test_prefill_sweep_tries_each_kernel_tile_and_stage_count_that_fits():
    """On prefill tiles the sweep is kernel x tile rows x stages, each fitting shared memory
    for its own launch, none twice; FLOPs count every row and both gated matrices."""
    shapes = decode_gemms.gemm_shapes(Config.flash(quantized=True))
    wo_a = shapes["wo_a"]
    out = decode_gemms.variants(wo_a, 4096 * wo_a.rows_per_token, sweep=True, ablations=False,
                                stages=(2, 3, 4), block_ns=(128, 256),
                                prefill_algorithms=("wgmma",))
    model = out[0][1]
    assert (model.algorithm, model.block_n, model.num_stages) == ("wgmma_coop", 256, 2)
    got = {(c.algorithm, c.block_n, c.num_stages) for _, c in out[1:]}
    assert got == {("wgmma_coop", 128, 2), ("wgmma_coop", 128, 3), ("wgmma", 128, 2),
                   ("wgmma", 128, 3), ("wgmma", 128, 4), ("wgmma", 256, 2)}
    for label, config in out:
        assert config.smem_bytes(wo_a.fmt, wo_a.gated) <= support.SMEM_BYTES, label
    assert len({c for _, c in out}) == len(out)
    assert decode_gemms.flops(wo_a, 4096) == 2 * 4096 * 8 * 1024 * 4096
    assert decode_gemms.flops(shapes["routed_w13"], 1) == 2 * 6 * 2 * 2048 * 4096


def test_ablations_apply_on_prefill_tiles_where_the_kernel_has_them():
    """``--ablations`` on prefill tiles: the model's config with each of its kernel's
    ablations; "no_dequant" only where weights are converted (FP4 weights; FP8 weights into
    bf16 WGMMAs), not for FP8 weights on FP8 WGMMAs, which the producer copies as they
    are."""
    shapes = decode_gemms.gemm_shapes(Config.flash(quantized=True))

    def ablations(name):
        shape = shapes[name]
        out = decode_gemms.variants(shape, 4096 * shape.rows_per_token, sweep=False,
                                    ablations=True)
        assert out[0][0] == "model" and out[0][1].spec.tiles == "any", out[0]
        return out[0][1].algorithm, {c.ablation for _, c in out[1:]}

    assert ablations("routed_w13") == ("wgmma_fp8_coop", {"no_dequant", "no_mma"})
    assert ablations("wo_b") == ("wgmma_fp8_coop", {"no_mma"})
    algorithm, got = ablations("wo_a")
    assert algorithm == "wgmma_coop" and got == set(support.KERNELS["wgmma_coop"].ablations)
