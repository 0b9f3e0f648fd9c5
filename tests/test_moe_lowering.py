"""The model's jitted decode and prefill steps, lowered for CUDA on this CPU machine, contain the
routed-experts kernel's custom call (the Hopper MoE GEMM), and lose it when the MoE op is
forced to its XLA reference -- the MoE op is wired into the model, not just into unit tests."""
import pytest

import jax
import jax.numpy as jnp

import dsv4_jax as dj
from dsv4_jax.ffi import dispatch
from dsv4_jax.ffi.moe_sm90 import moe_support
from dsv4_jax.ffi.policy import GroupedGemmPolicy, KernelPolicy
from dsv4_jax.params import abstract_params

CUSTOM_CALL = "stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2"
# The kernel classes, named in their ELF: kernels/grouped_gemm_sm90_wgmma.py, kernels/grouped_gemm_sm90_mma_sync.py,
# kernels/grouped_gemm_sm90_mma_fp8.py, kernels/grouped_gemm_sm90_wgmma_fp8.py,
# kernels/grouped_gemm_sm90_wgmma_coop.py, kernels/grouped_gemm_sm90_wgmma_fp8_coop.py.
MOE_KERNEL = {"wgmma": "GroupedGemmWgmmaSm90", "mma_sync": "GroupedGemmMmaSyncSm90",
              "mma_fp8": "GroupedGemmMmaFp8Sm90", "wgmma_fp8": "GroupedGemmWgmmaFp8Sm90",
              "wgmma_coop": "GroupedGemmWgmmaCoopSm90",
              "wgmma_fp8_coop": "GroupedGemmWgmmaFp8CoopSm90",
              "wgmma_rs": "GroupedGemmWgmmaRsSm90"}
BATCH = 2
OTHER_OPS_ON_REFERENCES = {"sparse_attention": "xla", "grouped_gemm": "xla",
                           "hc_pre": "xla", "hc_split_sinkhorn": "xla", "hc_stream_mixes": "xla",
                           "moe_router": "xla"}
# A prefill step whose MoE takes WGMMA tiles: more than 128 rows per expert (8 experts, k = 2,
# 2 rows of tokens), past the few-CTA rule that gives small launches warp tiles.
PREFILL_TOKENS = 264


def _config(expert_dtype):
    if expert_dtype == "fp4":
        return dj.Config.tiny(quantized=True)
    # The FP8 kernel needs input features that are multiples of 512 (4-byte scale rows).
    return dj.Config.tiny(quantized=True, expert_dtype="fp8", dim=512, moe_inter_dim=512)


def _lower(cfg, tokens, platform="cuda", implementation=None, batch=BATCH):
    model = dj.DSV4(cfg, implementation=implementation, runtime_checks=False)
    params = abstract_params(cfg)
    cache = jax.eval_shape(lambda: dj.Cache.init(cfg, batch, 256))
    tok = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
    step = jax.jit(lambda p, t, c: model.apply({"params": p}, t, c, logits_at="last"),
                   donate_argnums=(2,))
    with dispatch.cuda_target():
        return step.trace(params, tok, cache).lower(lowering_platforms=(platform,)).as_text()


def _kernel_supports(cfg, tokens):
    """What the op asks the kernel for this model's MoE rows (so a changed limit fails here)."""
    p = abstract_params(cfg)["layers_2"]["ffn"]["experts"]
    rows = jax.ShapeDtypeStruct((BATCH * tokens * cfg.n_activated_experts, cfg.dim),
                                jnp.bfloat16)
    pairs = [(p[n]["weight"], p[n]["scale"]) for n in ("w1", "w3", "w2")]
    return moe_support(rows.shape[0], "bfloat16", *pairs, simulate=cfg.quant_simulation,
                       policy=None)


# Prefill tiles run the default prefill kernel, whatever the decode policy names: FP8 WGMMAs
# ("wgmma_fp8_coop") where every launch has an even number of 128-column K blocks (the FP8
# tiny config), else the bf16 two-warpgroup kernel (the FP4 tiny config: 128 features).
PREFILL_KERNEL = {"fp4": "wgmma_coop", "fp8": "wgmma_fp8_coop"}


@pytest.mark.parametrize("expert_dtype, tokens, algorithm", [
    ("fp4", 1, ""), ("fp4", PREFILL_TOKENS, "wgmma"), ("fp8", 1, ""), ("fp4", 1, "wgmma"),
    ("fp4", 1, "mma_sync"), ("fp8", 1, "mma_sync"), ("fp8", PREFILL_TOKENS, ""),
    ("fp4", 1, "mma_fp8")],
    ids=["fp4-decode", "fp4-prefill", "fp8-decode", "fp4-decode-wgmma", "fp4-decode-mma-sync",
         "fp8-decode-mma-sync", "fp8-prefill", "fp4-decode-mma-fp8"])
def test_model_step_lowers_to_the_moe_kernel(expert_dtype, tokens, algorithm):
    cfg = _config(expert_dtype)
    gemm = GroupedGemmPolicy(decode_algorithm=algorithm) if algorithm else GroupedGemmPolicy()
    # Decode: "auto" runs "wgmma_rs" for both launches of this step's few rows.
    algorithm = PREFILL_KERNEL[expert_dtype] if tokens > 1 else (algorithm or "wgmma_rs")
    ok, why = _kernel_supports(cfg, tokens)
    assert ok, f"the MoE kernel no longer supports the test config: {why}"
    # The other ops (attention, the dense linears, the mHC split) on their references: every
    # custom call left is the MoE's.
    policy = KernelPolicy(ops=OTHER_OPS_ON_REFERENCES, grouped_gemm=gemm)
    text = _lower(cfg, tokens, implementation=policy)
    assert CUSTOM_CALL in text and MOE_KERNEL[algorithm] in text
    assert not [name for alg, name in MOE_KERNEL.items() if alg != algorithm and name in text]
    policy = KernelPolicy(ops=OTHER_OPS_ON_REFERENCES | {"moe_experts": "xla"},
                          grouped_gemm=gemm)
    assert CUSTOM_CALL not in _lower(cfg, tokens, implementation=policy)


@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_model_prefill_lowers_to_the_fp8_wgmma_kernel_when_asked(expert_dtype):
    """``GroupedGemmPolicy(prefill_algorithm="wgmma_fp8")``: the prefill step's MoE runs the
    FP8 WGMMA kernel (input features of 512 and 512: even numbers of 128-column blocks)."""
    cfg = dj.Config.tiny(quantized=True, expert_dtype=expert_dtype, dim=512, moe_inter_dim=512)
    policy = KernelPolicy(ops=OTHER_OPS_ON_REFERENCES,
                          grouped_gemm=GroupedGemmPolicy(prefill_algorithm="wgmma_fp8"))
    ok, why = _kernel_supports(cfg, PREFILL_TOKENS)
    assert ok, why
    text = _lower(cfg, PREFILL_TOKENS, implementation=policy)
    assert MOE_KERNEL["wgmma_fp8"] in text
    assert not [name for alg, name in MOE_KERNEL.items() if alg != "wgmma_fp8" and name in text]


@pytest.mark.parametrize("batch, kernel", [(BATCH, False), (8, True)])
def test_model_decode_step_sorts_its_rows_in_the_schedule_kernel(batch, kernel):
    """A decode step whose routed rows take sorted tiles (batch 8: 16 rows over the tiny
    model's 8 experts) schedules them in the schedule kernel, with no sort left in XLA;
    batch 2's rows are tiles of their own (no schedule at all)."""
    cfg = _config("fp4")
    text = _lower(cfg, 1, implementation=KernelPolicy(ops=OTHER_OPS_ON_REFERENCES),
                  batch=batch)
    assert (CUSTOM_CALL in text and "MoeScheduleSm90" in text) == kernel
    assert "stablehlo.sort" not in text


def test_model_step_lowered_for_cpu_has_no_kernel():
    assert CUSTOM_CALL not in _lower(_config("fp4"), 1, platform="cpu")


@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_model_implementation_xla_reaches_the_moe_op(expert_dtype):
    """``DSV4(implementation="xla")`` puts every op, the routed experts included, on its
    reference: lowered for CUDA, the decode step has no custom call (the MoE once ignored it)."""
    cfg = _config(expert_dtype)
    assert CUSTOM_CALL in _lower(cfg, 1)
    assert CUSTOM_CALL not in _lower(cfg, 1, implementation="xla")
