"""The "mma_fp8" decode kernel on the CPU: it compiles for sm_90a with the instructions its
docstring names (FP8 MMAs, the in-kernel token quantisation per token stage, the K split's
cluster sums), its configs (token stages, split stages), and its benchmark-only ablations."""
from __future__ import annotations

import dataclasses
import re

import pytest

from dsv4_jax.ffi.grouped_gemm_sm90 import resolve_config
from dsv4_jax.ffi.policy import GroupedGemmPolicy
from dsv4_jax.kernels import grouped_gemm_config as support
from dsv4_jax.kernels import grouped_gemm_layout as layout

pytest.importorskip("cutlass")
from grouped_gemm_compile import compile_variant as _compile  # noqa: E402


@pytest.mark.parametrize("fmt,gated,k,token_stages", [
    ("fp4", True, 512, 2), ("fp8", False, 512, 2), ("fp4", False, 384, 2),
    ("fp8", False, 1024, 8)])
def test_mma_fp8_compiles_for_sm90a(fmt, gated, k, token_stages):
    """"mma_fp8": FP8 tensor-core MMAs (4 per matrix and K block), the FP4 conversion by
    shifts (no bf16 conversion, no bf16 multiply), one CTA barrier per K block; the bf16
    token rows quantised in the kernel -- the token_stages - 1 passes before the loop and
    the loop's one, each 4 conversions of two e4m3 codes and a row's largest |x| over 16
    lanes -- from registers (a load per pass, the prologue's load of the first block
    quantised in the loop, the loop's)."""
    config = dataclasses.replace(support.choose_config(8, 4, fmt, decode_algorithm="mma_fp8"),
                                 token_stages=token_stages)
    assert config.algorithm == "mma_fp8" and config.split_k == 1
    compiled = _compile(fmt, gated, config, k=k)
    ptx = compiled.artifacts.PTX
    mma = re.findall(r"mma\.sync\.aligned\.m16n8k32\.row\.col\.f32\.e4m3\.e4m3\.f32", ptx)
    assert len(mma) == 4 * (2 if gated else 1)
    assert "mul.rn.bf16x2" not in ptx and "wgmma" not in ptx and ptx.count("bar.sync") == 1
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == token_stages * 4
    assert len(re.findall(r"shfl\.sync\.bfly", ptx)) == token_stages * 4
    assert len(re.findall(r"ld\.global\.nc\S*\.v4", ptx)) == token_stages + 1
    assert compiled.dump_to_object("moe")[:4] == b"\x7fELF"
    with pytest.raises(ValueError, match="GroupedGemmMmaFp8Sm90"):
        _compile("bf16", gated, dataclasses.replace(config, num_stages=3), k=k)


def test_few_tile_decode_launches_quantise_their_tokens_ahead():
    """The few-tile "mma_fp8" launches take FEW_TILES_TOKEN_STAGES token stages (a short K
    range quantised before its loop), unsplit launches of more rows UNSPLIT_TOKEN_STAGES,
    split ones 2; only quantising kernels take more."""
    few = support.choose_config(8, 4, "fp8", decode_algorithm="mma_fp8")
    many = support.choose_config(64, 64, "fp4", decode_algorithm="mma_fp8")
    split = support.choose_config(48, 256, "fp4", k_ins=(4096, 2048), split_k=None)
    assert few.token_stages == support.FEW_TILES_TOKEN_STAGES == support.MAX_TOKEN_STAGES
    assert many.algorithm == "mma_fp8" and many.token_stages == support.UNSPLIT_TOKEN_STAGES
    assert split.split_k > 1 and split.token_stages == 2
    assert support.choose_config(64, 64, "fp4", decode_algorithm="mma_fp8",
                                 token_stages=3).token_stages == 3
    # The policy's value reaches every such launch of the op (2: the split launches' count).
    assert resolve_config(GroupedGemmPolicy(token_stages=2), 64, 64, "fp4", (4096,), True,
                          (2048,)).token_stages == 2
    assert few.smem_bytes("fp8", True) - dataclasses.replace(few, token_stages=2).smem_bytes(
        "fp8", True) == 6 * layout.FP8_TOKEN_STAGE_BYTES
    for bad in (dict(token_stages=9), dict(token_stages=1),
                dict(algorithm="mma_sync", token_stages=4)):
        with pytest.raises(ValueError, match="token_stages"):
            dataclasses.replace(few, **bad)


@pytest.mark.parametrize("ablation", support.KERNELS["mma_fp8"].ablations)
def test_mma_fp8_ablations_compile_and_leave_out_their_stage(ablation):
    """"mma_fp8"'s benchmark-only variants (decode_gemms.py) build for sm_90a: "no_mma" issues
    no MMA, "no_dequant" converts no FP4 code, the load ablations keep the first copies."""
    config = support.GroupedGemmSm90Config(block_n=8, num_stages=4, algorithm="mma_fp8",
                                           ablation=ablation)
    shipped = dataclasses.replace(config, ablation="")
    ptx = _compile("fp4", True, config, k=1024).artifacts.PTX
    ref = _compile("fp4", True, shipped, k=1024).artifacts.PTX
    mma = lambda text: len(re.findall(r"mma\.sync\.aligned", text))
    assert mma(ref) == 8 and mma(ptx) == (0 if ablation == "no_mma" else 8)   # 4 steps x 2
    if ablation == "no_dequant":               # the conversion's masks are gone
        assert ptx.count("and.b32") < ref.count("and.b32")
    assert "cp.async" in ptx and ptx.count("cp.async.wait_group") == 2


@pytest.mark.parametrize("ablation", ["no_reduce", "no_cluster"])
def test_mma_fp8_split_ablations_leave_out_the_cluster_sums(ablation):
    """decode_gemms.py's split ablations: "no_reduce" keeps the cluster launch and drops the
    sums through distributed shared memory and both cluster barriers; "no_cluster" too."""
    config = support.GroupedGemmSm90Config(block_n=8, num_stages=4, algorithm="mma_fp8",
                                           split_k=2, ablation=ablation)
    ptx = _compile("fp8", False, config, k=1024).artifacts.PTX
    shipped = _compile("fp8", False, dataclasses.replace(config, ablation=""),
                       k=1024).artifacts.PTX
    assert shipped.count("barrier.cluster.arrive") == 2 and "mapa" in shipped
    assert "barrier.cluster" not in ptx and "mapa" not in ptx
    assert len(re.findall(r"mma\.sync\.aligned", ptx)) == len(
        re.findall(r"mma\.sync\.aligned", shipped))
