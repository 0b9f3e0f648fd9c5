"""The model's decode step lowered for a Hopper GPU (on this CPU machine): every FP8 linear,
the shared expert and the routed experts run the grouped-GEMM kernels, and no weight-sized
tensor is converted -- no BF16 (or f32) copy of any weight is written during a step."""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import dsv4_jax as dj
from dsv4_jax.ffi import dispatch
from dsv4_jax.ffi.policy import GroupedGemmPolicy, KernelPolicy
from dsv4_jax.params import abstract_params
from model_lowering import cute_calls, lower_decode_step

CUSTOM_CALL = "stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2"
# cutlass_call lowers each kernel once into a private function; every launch calls it.
_LAUNCH = re.compile(r"call @call_wrapper(_\d+)?\(")
# Every FP8 linear within the kernels' limits: input features multiples of 512 (4-byte FP8
# scale rows), outputs of 128; wo_a's groups hold whole 128-row scale blocks.
CFG = dj.Config.tiny(quantized=True, dim=512, q_lora_rank=512, moe_inter_dim=512,
                     o_lora_rank=256)
BATCH = 2
_CONVERT = re.compile(r"stablehlo\.convert %\S+ : \(tensor<([0-9x]+)x(\w+)>\)")


def _lower(implementation, tokens=1):
    model = dj.DSV4(CFG, implementation=implementation, runtime_checks=False)
    params = abstract_params(CFG)
    cache = jax.eval_shape(lambda: dj.Cache.init(CFG, BATCH, 128))
    tok = jax.ShapeDtypeStruct((BATCH, tokens), jnp.int32)
    step = jax.jit(lambda p, t, c: model.apply({"params": p}, t, c, logits_at="last"),
                   donate_argnums=(2,))
    with dispatch.cuda_target():
        return step.trace(params, tok, cache).lower(lowering_platforms=("cuda",)).as_text()


def _smallest_weight() -> int:
    """Elements of the smallest quantised weight matrix (one expert's for the experts)."""
    leaves = jax.tree_util.tree_leaves_with_path(abstract_params(CFG))
    sizes = [int(np.prod(v.shape[-2:])) for path, v in leaves
             if str(path[-1]).strip("[]'\"") == "weight"
             and v.dtype in (jnp.float8_e4m3fn, jnp.int8)]
    return min(sizes)


def weight_sized_converts(text: str) -> list[str]:
    """The ``stablehlo.convert`` ops of ``text`` whose operand has at least half the elements
    of the smallest quantised weight (activations of a decode step are far smaller)."""
    limit = _smallest_weight() // 2
    out = []
    for dims, dtype in _CONVERT.findall(text):
        if int(np.prod([int(d) for d in dims.split("x")])) >= limit:
            out.append(f"{dims}x{dtype}")
    return out


def kernel_launches(text: str) -> int:
    return len(_LAUNCH.findall(text))


def test_decode_step_converts_no_weight():
    text = _lower(None)
    assert weight_sized_converts(text) == []
    # The dense linears, the shared expert, the routed experts and attention are kernels.
    assert kernel_launches(text) >= CFG.n_layers * 7


def test_the_check_sees_the_converts_of_the_reference_linears():
    """With the grouped GEMM on its reference the FP8 weights are dequantised in the step:
    the check above would see them (it is not vacuous)."""
    text = _lower(KernelPolicy(ops={"grouped_gemm": "xla"}))
    converts = weight_sized_converts(text)
    assert any(c.endswith("f8E4M3FN") for c in converts), converts


@pytest.mark.parametrize("tokens", [1, 64])
def test_fp8_linears_lower_to_the_grouped_gemm_kernels(tokens):
    """Decode (the warp kernels' 8-row tiles) and prefill (WGMMA tiles): the dense linears'
    launches are there, and gone when the grouped GEMM runs its reference."""
    others = {"moe_experts": "xla", "sparse_attention": "xla", "hc_pre": "xla",
              "hc_split_sinkhorn": "xla", "hc_stream_mixes": "xla", "moe_router": "xla"}
    text = _lower(KernelPolicy(ops=others), tokens)
    assert kernel_launches(text) >= CFG.n_layers * 6     # wq_a wq_b wkv wo_a wo_b shared
    assert CUSTOM_CALL not in _lower(KernelPolicy(ops=others | {"grouped_gemm": "xla"}), tokens)


@pytest.mark.parametrize("tokens", [1, 64])
def test_every_mhc_pre_is_a_kernel_launch_and_one_clusters_split_another(tokens):
    """Two sub-blocks per layer (attention, MoE), each an mHC pre launch; for one cluster's
    tokens (a decode step of 2 rows) the split is a launch of its own on the mixes it
    stores, which only the next mHC pre waits for, and with the split on its reference
    the mHC pre is alone; 128 rows take the fused launch (mixes, split, collapse, norm).
    With the mHC pre on its XLA chain, the split kernel is inside the chain; no launch with
    both on their references."""
    others = {"moe_experts": "xla", "sparse_attention": "xla", "grouped_gemm": "xla",
              "moe_router": "xla", "hc_stream_mixes": "xla"}
    text = _lower(KernelPolicy(ops=others), tokens)
    apart = BATCH * tokens <= 2
    assert kernel_launches(text) == (4 if apart else 2) * CFG.n_layers
    assert "HcPreSm90" in text and ("HcSinkhornSm90" in text) == apart
    text = _lower(KernelPolicy(ops=others | {"hc_split_sinkhorn": "xla"}), tokens)
    assert kernel_launches(text) == 2 * CFG.n_layers
    assert "HcPreSm90" in text and "HcSinkhornSm90" not in text
    text = _lower(KernelPolicy(ops=others | {"hc_pre": "xla"}), tokens)
    assert kernel_launches(text) == 2 * CFG.n_layers
    assert "HcSinkhornSm90" in text and "HcPreSm90" not in text
    assert CUSTOM_CALL not in _lower(
        KernelPolicy(ops=others | {"hc_pre": "xla", "hc_split_sinkhorn": "xla"}), tokens)


def test_a_prefill_chunks_mhc_pre_runs_the_stream_mixes_kernel():
    """Past the mHC pre kernel's rows (a prefill chunk of 2 x 128 tokens) each sub-block's
    chain runs the stream-mixes kernel and the split kernel; on their references, neither."""
    others = {"moe_experts": "xla", "sparse_attention": "xla", "grouped_gemm": "xla",
              "moe_router": "xla"}
    text = _lower(KernelPolicy(ops=others), 128)
    assert "HcPreSm90" not in text
    assert kernel_launches(text) == 4 * CFG.n_layers
    assert "HcMixesSm90" in text and "HcSinkhornSm90" in text
    assert CUSTOM_CALL not in _lower(
        KernelPolicy(ops=others | {"hc_stream_mixes": "xla", "hc_split_sinkhorn": "xla"}), 128)


def test_ffn_sum_in_hc_pre_hands_the_moe_parts_to_the_next_mhc_pre():
    """With ``KernelPolicy(ffn_sum_in_hc_pre=True)`` (the default) every layer after the
    first starts with an mHC pre kernel that takes the previous MoE's routed rows, their
    positions and their validity (``FfnSum``), and no launch is added; off, none does."""
    k = CFG.n_activated_experts
    parts = (f"tensor<{BATCH * k}x{CFG.dim}xbf16>, tensor<{BATCH * k}xi32>, "
             f"tensor<{BATCH * k}xi32>")
    calls = lambda text: [line for line in text.splitlines()  # noqa: E731
                          if _LAUNCH.search(line)]
    on, off = _lower(None), _lower(KernelPolicy(ffn_sum_in_hc_pre=False))
    assert sum(parts in line for line in calls(on)) == CFG.n_layers - 1
    assert not any(parts in line for line in calls(off))
    assert kernel_launches(on) == kernel_launches(off)


def test_every_router_is_one_kernel_launch_at_decode():
    """One launch per MoE layer for the router (scores, top-k or hash table, weights), in
    the hash layers as in the others; none with it on its reference, nor for a prefill chunk
    (past the kernel's token limit XLA's dot and sort run)."""
    others = {"moe_experts": "xla", "sparse_attention": "xla", "grouped_gemm": "xla",
              "hc_pre": "xla", "hc_split_sinkhorn": "xla", "hc_stream_mixes": "xla"}
    text = _lower(KernelPolicy(ops=others))
    assert 0 < CFG.n_hash_layers < CFG.n_layers
    assert kernel_launches(text) == CFG.n_layers and "RouterSm90" in text
    assert CUSTOM_CALL not in _lower(KernelPolicy(ops=others | {"moe_router": "xla"}))
    assert CUSTOM_CALL not in _lower(KernelPolicy(ops=others), tokens=64)


_TO_FP8 = re.compile(r"stablehlo\.convert %\S+ : \(tensor<([0-9x]+)xf32>\) -> "
                     r"tensor<[0-9x]+xf8E4M3FN>")


def fp8_quantisations(text: str) -> list[str]:
    """Shapes of the f32 -> e4m3 converts of ``text`` (each an FP8 quantisation in XLA)."""
    return _TO_FP8.findall(text)


def test_decode_step_quantises_no_activation_outside_the_kernels():
    """"mma_fp8" quantises its bf16 rows itself (the official 1 x 128 blocks): the only FP8
    quantisations left in XLA are the KV entries' simulation (blocks of 64). With the
    algorithm that takes codes ("mma_fp8_stream") the activations' 128-blocks are there."""
    blocks = lambda text: {shape.split("x")[-1] for shape in fp8_quantisations(text)}  # noqa
    assert blocks(_lower(None)) == {"64"}
    stream = KernelPolicy(grouped_gemm=GroupedGemmPolicy(decode_algorithm="mma_fp8_stream"))
    assert "128" in blocks(_lower(stream))


def test_the_attention_kernel_takes_the_queries_as_wq_b_writes_them():
    """With ``KernelPolicy(attention_rope=True)`` the heads' norm, the query RoPE and the
    output's inverse RoPE are the attention kernel's (64 heads: a size it takes): its
    launches take the step's cos and sin tables ([T, rope_dim / 2] f32); with attention on
    its reference, or the policy off (the default), no kernel does."""
    cfg = dj.Config.tiny(n_heads=64, o_groups=8)
    table = f"tensor<{BATCH}x{cfg.rope_head_dim // 2}xf32>"
    tables = f"{table}, {table}) -> "          # the last operands
    others = {"moe_experts": "xla", "grouped_gemm": "xla", "hc_pre": "xla",
              "hc_split_sinkhorn": "xla", "hc_stream_mixes": "xla", "moe_router": "xla",
              "index_topk": "xla"}
    cache = jax.eval_shape(lambda: dj.Cache.init(cfg, BATCH, 256))
    for ops, on, launches in ((others, True, True), (others, False, False),
                              (others | {"sparse_attention": "xla"}, True, False)):
        policy = KernelPolicy(ops=ops, attention_rope=on)
        model = dj.DSV4(cfg, implementation=policy, runtime_checks=False)
        calls = cute_calls(lower_decode_step(model, cfg, cache, BATCH))
        assert any(tables in line for line in calls) == launches
