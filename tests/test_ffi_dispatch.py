"""ffi/ infrastructure on CPU: the op registry, implementation dispatch, the kernel policy as
a value (and the environment variables parsed into it), the kernel disk cache."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import dsv4_jax as dj
from dsv4_jax.ffi import (GroupedGemmPolicy, KernelPolicy, dispatch, op_names, op_spec,
                          sparse_attention, sparse_attention_reference)

SCALE = 512 ** -0.5
S = jax.ShapeDtypeStruct
CUSTOM_CALL = "CuteDSLRT_NvJaxCutlassCall_v2"


def _arrays(t=2, h=64, d=512, k=4, n=8):
    key = jax.random.key(0)
    q = jax.random.normal(key, (t, h, d), jnp.float32).astype(jnp.bfloat16)
    kv = jax.random.normal(jax.random.fold_in(key, 1), (n, d), jnp.float32).astype(jnp.bfloat16)
    idx = jnp.arange(t * k, dtype=jnp.int32).reshape(t, k) % n
    return q, kv, idx, jnp.zeros((h,), jnp.float32)


def _lower_for_cuda(f, *shapes):
    with dispatch.cuda_target():
        return jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def test_unknown_implementation_is_rejected():
    with pytest.raises(ValueError, match="implementation must be"):
        sparse_attention(*_arrays(), scale=SCALE, implementation="triton")


def test_default_on_cpu_is_the_reference():
    args = _arrays()
    o, lse = jax.jit(lambda *a: sparse_attention(*a, scale=SCALE))(*args)
    o_ref, lse_ref = sparse_attention_reference(*args, scale=SCALE)
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o_ref, np.float32))


def test_explicit_cute_without_gpu_raises_clearly():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        sparse_attention(*_arrays(), scale=SCALE, implementation="cute")


def test_explicit_cute_with_unsupported_shape_names_the_reason():
    with pytest.raises(ValueError, match="head_dim 256"):
        sparse_attention(*_arrays(d=256), scale=SCALE, implementation="cute")
    with pytest.raises(ValueError, match="num_heads 48"):
        sparse_attention(*_arrays(h=48), scale=SCALE, implementation="cute")


def test_unsupported_shapes_fall_back_to_the_reference_for_cuda():
    shapes = [S(x.shape, x.dtype) for x in _arrays(h=48)]
    assert CUSTOM_CALL not in _lower_for_cuda(lambda *a: sparse_attention(*a, scale=SCALE),
                                              *shapes)


def test_every_op_is_registered_under_its_public_name():
    assert op_names() == ("grouped_gemm", "hc_pre", "hc_split_sinkhorn", "hc_stream_mixes",
                          "index_topk",
                          "moe_expert_rows", "moe_experts", "moe_router", "sparse_attention")
    for name in op_names():
        spec = op_spec(name)
        assert spec.name == name
        assert spec.implementations == ("xla", "cute")
        assert spec.reference.__name__ == f"{name}_reference"
        assert getattr(dj.ffi, name).__name__ == name
    with pytest.raises(ValueError, match="unknown op 'moe'; the ops are grouped_gemm, "):
        op_spec("moe")


@pytest.mark.parametrize("value, op, expected", [
    ("xla", "sparse_attention", "xla"), ("cute", "sparse_attention", "cute"),
    ("sparse_attention=xla,moe_experts=cute", "sparse_attention", "xla"),
    ("sparse_attention=xla,moe_experts=cute", "moe_experts", "cute"),
    ("moe_experts=cute", "sparse_attention", None), ("", "sparse_attention", None),
    ("auto", "moe_experts", None),
])
def test_environment_parses_into_a_policy(value, op, expected):
    policy = KernelPolicy.from_environment({"DSV4_IMPLEMENTATION": value})
    assert policy.implementation_for(op) == expected


@pytest.mark.parametrize("env, message", [
    ({"DSV4_IMPLEMENTATION": "fast"}, r"DSV4_IMPLEMENTATION='fast': the value 'fast' must be"),
    ({"DSV4_IMPLEMENTATION": "moe=xla"},
     r"DSV4_IMPLEMENTATION='moe=xla': unknown op 'moe'; the ops are grouped_gemm, hc_pre, hc_split_"),
    ({"DSV4_IMPLEMENTATION": "moe_experts=triton"},
     r"moe_experts: implementation must be one of \('xla', 'cute'\)"),
    ({"DSV4_MOE_ALGORITHM": "simt"}, r"DSV4_MOE_ALGORITHM='simt': must be one of \('wgmma'"),
    ({"DSV4_MOE_PREFILL_ALGORITHM": "mma_sync"},
     r"DSV4_MOE_PREFILL_ALGORITHM='mma_sync': must be one of \('wgmma', 'wgmma_fp8', "
     r"'wgmma_coop', 'wgmma_fp8_coop'\)"),
    ({"DSV4_MOE_SPLIT_K": "0"}, r"DSV4_MOE_SPLIT_K='0': must be an integer in \[1, 8\]"),
    ({"DSV4_MOE_SPLIT_K": "x"}, "DSV4_MOE_SPLIT_K='x'"),
    ({"DSV4_MOE_SPLIT_K": "99"}, "DSV4_MOE_SPLIT_K='99'"),
])
def test_bad_environment_values_name_the_variable_and_the_valid_ones(env, message):
    with pytest.raises(ValueError, match=message):
        KernelPolicy.from_environment(env)


def test_kernel_variables_parse_into_the_grouped_gemm_policy():
    policy = KernelPolicy.from_environment({"DSV4_MOE_ALGORITHM": "mma_sync",
                                            "DSV4_MOE_PREFILL_ALGORITHM": "wgmma_fp8",
                                            "DSV4_MOE_SPLIT_K": "4"})
    assert policy.grouped_gemm == GroupedGemmPolicy("mma_sync", "wgmma_fp8", 4)
    assert KernelPolicy.from_environment({}) == KernelPolicy()


@pytest.mark.parametrize("build, error, message", [
    (lambda: KernelPolicy(implementation="triton"), ValueError,
     "KernelPolicy: implementation must be 'xla', 'cute' or None, got 'triton'"),
    (lambda: KernelPolicy(ops={"moe": "xla"}), ValueError, "unknown op 'moe'; the ops are"),
    (lambda: KernelPolicy(ops={"moe_experts": "fast"}), ValueError,
     r"moe_experts: implementation must be one of \('xla', 'cute'\) or None, got 'fast'"),
    (lambda: KernelPolicy(ops=3), TypeError, "KernelPolicy: ops must map op names"),
    (lambda: KernelPolicy(sparse_attention=(64, 2)), TypeError,
     "KernelPolicy: sparse_attention must be a SparseAttentionSm90Config or None, got tuple"),
    (lambda: GroupedGemmPolicy(decode_algorithm="simt"), ValueError,
     r"GroupedGemmPolicy: decode_algorithm must be one of \('wgmma', 'mma_sync', 'mma_fp8', "
     r"'wgmma_rs', 'mma_fp8_stream', 'wgmma_fp8', 'wgmma_coop', 'wgmma_fp8_coop', "
     r"'auto'\), got "
     r"'simt'"),
    (lambda: GroupedGemmPolicy(prefill_algorithm="mma_fp8"), ValueError,
     r"prefill_algorithm must be one of \('wgmma', 'wgmma_fp8', 'wgmma_coop', "
     r"'wgmma_fp8_coop'\), got 'mma_fp8'"),
    (lambda: GroupedGemmPolicy(split_k=0), ValueError,
     r"split_k must be None \(automatic\) or an integer in \[1, 8\], got 0"),
    (lambda: GroupedGemmPolicy(token_stages=1), ValueError,
     r"token_stages must be None \(automatic\) or an integer in \[2, 8\], got 1"),
    (lambda: GroupedGemmPolicy(token_stages=4.0), ValueError,
     r"token_stages must be None \(automatic\) or an integer in \[2, 8\], got 4.0"),
    (lambda: KernelPolicy.coerce(3.0), TypeError, "implementation must be None, 'xla', 'cute'"),
    (lambda: dj.DSV4(dj.Config.tiny(), implementation={"moe": "xla"}).init, ValueError,
     "unknown op 'moe'"),
])
def test_bad_policies_fail_on_construction_naming_the_value(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_policy_is_a_hashable_value_and_a_mapping_is_normalised():
    a = KernelPolicy(ops={"sparse_attention": "xla", "moe_experts": "cute"})
    b = KernelPolicy(ops=[("moe_experts", "cute"), ("sparse_attention", "xla")])
    assert a == b and hash(a) == hash(b)
    assert KernelPolicy.coerce("xla") == KernelPolicy(implementation="xla")
    assert KernelPolicy.coerce({"moe_experts": "xla"}).implementation_for("moe_experts") == "xla"
    assert KernelPolicy.coerce(a) is a


def test_xla_policy_puts_the_model_on_its_references_even_when_lowering_for_cuda():
    cfg = dj.Config.tiny(quantized=True)
    params = dj.abstract_params(cfg)
    cache = jax.eval_shape(lambda: dj.Cache.init(cfg, 1, 128))
    tok = S((1, 1), jnp.int32)
    for implementation, has_kernel in (
            (None, True), (KernelPolicy.from_environment({"DSV4_IMPLEMENTATION": "xla"}), False)):
        model = dj.DSV4(cfg, implementation=implementation, runtime_checks=False)
        text = _lower_for_cuda(lambda p, t, c: model.apply({"params": p}, t, c), params, tok,
                               cache)
        assert (CUSTOM_CALL in text) == has_kernel


def test_cpu_default_path_does_not_import_cutlass():
    # `import dsv4_jax` and the reference path must work (and stay cheap) where CuTe DSL
    # cannot load: a fresh interpreter, one call on CPU, no cutlass module imported.
    import subprocess
    import sys
    code = ("import sys, jax.numpy as jnp\n"
            "from dsv4_jax.ffi import sparse_attention\n"
            "o, lse = sparse_attention(jnp.zeros((1, 64, 512), jnp.bfloat16),\n"
            "    jnp.zeros((2, 512), jnp.bfloat16), jnp.zeros((1, 2), jnp.int32),\n"
            "    jnp.zeros((64,), jnp.float32), scale=0.1)\n"
            "assert not any(m == 'cutlass' or m.startswith('cutlass.') for m in sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
