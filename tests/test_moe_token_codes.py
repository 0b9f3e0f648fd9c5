"""Token codes (``GroupedGemmPolicy.token_codes``): the decode kernels that quantise their
tokens ("mma_fp8", "wgmma_rs") take them quantised by XLA instead -- the codes they would make
themselves, so the op's outputs must not change by a bit. CPU: the policy's values, which
launches take codes, the compiled kernel without its quantisation; GPU: bit-for-bit equality
with the kernels' own quantisation."""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from grouped_gemm_compile import compile_variant, ptxas_log
from dsv4_jax.ffi import cases, dispatch
from dsv4_jax.ffi.moe_sm90 import with_token_codes, moe_configs
from dsv4_jax.ffi.policy import GroupedGemmPolicy
from dsv4_jax.kernels.grouped_gemm_config import GroupedGemmSm90Config

# A grouped-GEMM launch: the custom call of ten operands (kernels/grouped_gemm_sm90_launch.py).
LAUNCH = re.compile(r"custom_call @CuteDSLRT_NvJaxCutlassCall_v2\(%\w+(?:, %\w+){9}\)")


def test_default_is_the_gathered_rows():
    assert GroupedGemmPolicy().token_codes == "gathered"


@pytest.mark.parametrize("make, message", [
    (lambda: GroupedGemmPolicy(token_codes="all"), "token_codes must be one of"),
    (lambda: GroupedGemmSm90Config(block_n=128, algorithm="wgmma_fp8_coop", token_codes=True),
     "token_codes must be a bool, and False unless the algorithm quantises"),
    (lambda: GroupedGemmSm90Config(block_n=8, algorithm="wgmma_rs", token_codes=1),
     "token_codes must be a bool")])
def test_bad_values_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def _flash_configs(rows: int):
    d = cases.DIMS["flash"]
    w1 = (jax.ShapeDtypeStruct((d.experts, d.moe_inter_dim, d.dim // 2), jnp.uint8),
          jax.ShapeDtypeStruct((d.experts, d.moe_inter_dim, d.dim // 32), jnp.uint8))
    w2 = (jax.ShapeDtypeStruct((d.experts, d.dim, d.moe_inter_dim // 2), jnp.uint8),
          jax.ShapeDtypeStruct((d.experts, d.dim, d.moe_inter_dim // 32), jnp.uint8))
    return moe_configs(rows, w1, w2, simulate=True, policy=None)


@pytest.mark.parametrize("mode, gathered, explicit, want", [
    ("none", True, False, (False, False)),
    ("gathered", True, False, (True, False)),
    ("gathered", False, False, (False, False)),     # row tiles read their token: no gather
    ("routed", False, False, (True, True)),
    ("routed", True, True, (False, False))])        # a config the caller chose stays
def test_which_launches_take_codes(mode, gathered, explicit, want):
    gated, down = _flash_configs(48)                 # batch 8, k = 6: "wgmma_rs" both
    assert gated.spec.quantizes_tokens and down.spec.quantizes_tokens
    got = with_token_codes(gated, down, GroupedGemmPolicy(token_codes=mode), gathered=gathered,
                       explicit=explicit)
    assert (got[0].token_codes, got[1].token_codes) == want
    assert got[0].takes_codes == want[0] and got[1].takes_codes == want[1]


def test_kernels_that_take_codes_never_quantise():
    """Prefill tiles take codes already; a policy never asks them to again."""
    gated, down = _flash_configs(4096 * 6)
    assert gated.takes_codes and not gated.spec.quantizes_tokens
    got = with_token_codes(gated, down, GroupedGemmPolicy(token_codes="routed"), gathered=True,
                       explicit=False)
    assert got == (gated, down)


@pytest.mark.parametrize("fmt, gated, split", [("fp4", True, 4), ("fp8", False, 1)])
def test_compiled_kernel_copies_codes_instead_of_quantising(tmp_path, fmt, gated, split):
    """The quantisation's conversions (``cvt...e4m3x2.f32``) and its largest-|x| shuffles
    are gone from the compiled kernel, and ptxas assembles it."""
    def ptx(codes):
        config = GroupedGemmSm90Config(block_n=8, num_stages=3, algorithm="wgmma_rs",
                                       split_k=split, token_stages=4, token_codes=codes)
        return compile_variant(fmt, gated, config, a=48, k=4096, n=2048, e=256)

    plain, with_codes = ptx(False), ptx(True)
    assert plain.artifacts.PTX.count("e4m3x2.f32") > 0
    assert with_codes.artifacts.PTX.count("e4m3x2.f32") == 0
    assert (with_codes.artifacts.PTX.count("shfl.sync")
            < plain.artifacts.PTX.count("shfl.sync"))
    assert "ptxas info" in ptxas_log(tmp_path, with_codes)


@pytest.mark.parametrize("mode, want", [("none", 0), ("gathered", 1), ("routed", 2)])
def test_lowered_op_hands_codes_to_the_launches(mode, want):
    """The op lowered for CUDA: how many of its two launches get uint8 codes as their first
    operand (bf16 rows otherwise), at 32 sorted rows (T = 8, k = 4 of 16 experts)."""
    case = cases.moe_case("small", "fp4", 8, "random")
    f = cases.moe_experts_jit("cute", case.kw, GroupedGemmPolicy(token_codes=mode))
    with dispatch.cuda_target():
        text = f.trace(*case.args).lower(lowering_platforms=("cuda",)).as_text()
    firsts = [line.rsplit(": (tensor<", 1)[1].split(">")[0]
              for line in text.splitlines() if LAUNCH.search(line)]
    assert len(firsts) == 2, firsts
    assert sum(t.endswith("xui8") for t in firsts) == want, firsts
    assert sum(t.endswith("xbf16") for t in firsts) == 2 - want, firsts


GPU_CASES = [("flash", "fp4", 8, "random"), ("flash", "fp4", 3, "random"),
             ("flash", "fp8", 8, "random"), ("small", "fp4", 16, "dropped"),
             ("small", "fp8", 8, "few_experts"), ("flash", "fp4", 64, "random"),
             ("flash", "fp4", 1, "random")]


@pytest.mark.gpu
@pytest.mark.parametrize("dims, fmt, t, routing", GPU_CASES)
@pytest.mark.parametrize("mode", ["gathered", "routed"])
def test_codes_give_the_kernels_own_outputs_bit_for_bit(dims, fmt, t, routing, mode):
    case = cases.moe_case(dims, fmt, t, routing)
    got = cases.moe_experts_jit("cute", case.kw, GroupedGemmPolicy(token_codes=mode))(
        *case.args)
    want = cases.moe_experts_jit("cute", case.kw, GroupedGemmPolicy(token_codes="none"))(
        *case.args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
