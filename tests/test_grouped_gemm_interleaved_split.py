"""A K split whose CTAs read interleaved K blocks (``GroupedGemmSm90Config.interleaved_split``):
the config, the support check and the policy refuse what the kernels cannot run, the
launches that split K over FP4 weights get it by default, the kernels compile for sm_90a,
and -- on the GPU -- they match the reference as the contiguous split does (the same sums;
each split adds its blocks in another order), alone, gated with token codes and routed."""
import dataclasses
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax.ffi import cases, grouped_gemm_reference
from dsv4_jax.ffi.grouped_gemm_sm90 import grouped_gemm_cute, launch_support, resolve_config
from dsv4_jax.ffi.policy import GroupedGemmPolicy
from dsv4_jax.kernels import grouped_gemm_config as support

ROUTED = dict(k_ins=(4096, 2048), n_outs=(2048, 4096))   # Flash's experts


@pytest.mark.parametrize("algorithm, value", [
    ("mma_fp8_stream", True), ("wgmma", True), ("wgmma_rs", 1), ("mma_fp8", "yes")])
def test_config_refuses_interleaving_its_kernel_does_not_take(algorithm, value):
    block_n = 8 if algorithm in support.WARP_ALGORITHMS else 64
    with pytest.raises(ValueError, match=r"interleaved_split must be a bool, and False unless "
                                         r"the algorithm is one of"):
        support.GroupedGemmSm90Config(block_n=block_n, algorithm=algorithm,
                                      interleaved_split=value)


@pytest.mark.parametrize("fmt, k, split", [("fp8", 2048, 2), ("fp4", 2048, 1),
                                           ("fp4", 384, 2), ("bf16", 2048, 2)])
def test_support_names_what_interleaving_needs(fmt, k, split):
    config = support.GroupedGemmSm90Config(block_n=8, num_stages=3, algorithm="mma_sync",
                                           split_k=split, interleaved_split=True)
    ok, why = config.is_supported(weight_format=fmt, gated=False, n_out=256, k_in=k,
                                  x_dtype="bfloat16", num_tiles=4)
    assert not ok and re.search(rf"interleaved_split \(FP4 weights of K blocks a multiple of "
                                rf"split_k {split} x the scale group; got '{fmt}', input "
                                rf"features {k}\)", why), why


@pytest.mark.parametrize("tokens, gated, want", [(1, False, True), (1, True, True),
                                                 (8, False, True), (8, True, True),
                                                 (64, False, False), (64, True, False)])
def test_the_policy_interleaves_the_routed_launches_that_split(tokens, gated, want):
    """By default the routed FP4 launches that split K (T = 1, 8) interleave; unsplit ones
    (T = 64) cannot; the policy turns it off."""
    config = resolve_config(None, 6 * tokens, 256, "fp4", ROUTED["k_ins"], True,
                            ROUTED["n_outs"], gated=gated)
    assert config.interleaved_split == want and (config.split_k > 1) == want, config
    off = resolve_config(GroupedGemmPolicy(interleaved_split=False), 6 * tokens, 256, "fp4",
                         ROUTED["k_ins"], True, ROUTED["n_outs"], gated=gated)
    assert not off.interleaved_split
    assert dataclasses.replace(off, interleaved_split=config.interleaved_split) == config
    ok, why = launch_support(config, "fp4", "bfloat16", 6 * tokens, 256,
                             [(gated, 2048 if gated else 4096, 4096 if gated else 2048)])
    assert ok, why


def test_fp8_launches_do_not_interleave():
    config = resolve_config(None, 8, 1, "fp8", (8192,), True, (4096,))
    assert config.split_k > 1 and not config.interleaved_split


@pytest.mark.parametrize("bad", [None, 1, "True"])
def test_policy_interleaved_split_must_be_a_bool(bad):
    with pytest.raises(TypeError, match="interleaved_split must be a bool, got"):
        GroupedGemmPolicy(interleaved_split=bad)


@pytest.mark.parametrize("k, split, ok", [(2048, 2, True), (4096, 4, True), (2048, 4, True),
                                          (512, 2, False), (1024, 2, True), (2048, 1, False)])
def test_interleaves_needs_whole_scale_groups_per_split(k, split, ok):
    assert support.interleaves("fp4", k, split) == ok


@pytest.mark.parametrize("algorithm", support.INTERLEAVED_SPLIT_ALGORITHMS)
def test_compiles_for_sm90a(algorithm):
    from grouped_gemm_compile import compile_variant
    config = support.GroupedGemmSm90Config(block_n=8, num_stages=3, algorithm=algorithm,
                                           split_k=2, interleaved_split=True)
    ptx = compile_variant("fp4", False, config, a=48, k=2048, n=512, e=16).artifacts.PTX
    assert ".entry" in ptx and "cp.async" in ptx


# ----------------------------------------------------------------------------- GPU
def _f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


# name: (algorithm, groups, N, K, rows, routed, gated, split)
GPU_CASES = {
    "routed_w2_t8": ("wgmma_rs", 32, 4096, 2048, 48, True, False, 2),
    "routed_w13_t8": ("wgmma_rs", 32, 2048, 4096, 48, True, True, 4),
    "routed_w2_t1": ("wgmma_rs", 32, 4096, 2048, 6, True, False, 2),
    "mma_fp8_ragged": ("mma_fp8", 8, 512, 1024, 20, True, False, 2),
    "mma_fp8_gated": ("mma_fp8", 8, 256, 2048, 20, True, True, 4),
    "mma_sync_ragged": ("mma_sync", 8, 256, 1024, 20, True, False, 2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_an_interleaved_split_matches_the_reference(name):
    algorithm, groups, n, k, rows, routed, gated, split = GPU_CASES[name]
    key = jax.random.key(len(name))
    w = cases.random_weight("fp4", *jax.random.split(jax.random.fold_in(key, 1)), groups, n,
                            k)
    w_up = (cases.random_weight("fp4", *jax.random.split(jax.random.fold_in(key, 2)), groups,
                                n, k) if gated else None)
    x = jax.random.normal(jax.random.fold_in(key, 3), (rows, k), jnp.float32)
    x = x.astype(jnp.bfloat16)
    ids = (jax.random.randint(jax.random.fold_in(key, 4), (rows,), 0, groups) if routed
           else None)
    rw = jax.random.uniform(jax.random.fold_in(key, 5), (rows,), jnp.float32) if gated else None
    contiguous = support.GroupedGemmSm90Config(
        block_n=8, num_stages=3, algorithm=algorithm, split_k=split,
        token_codes=gated and algorithm != "mma_sync")
    interleaved = dataclasses.replace(contiguous, interleaved_split=True)
    ok, why = launch_support(interleaved, "fp4", "bfloat16", rows, groups, [(gated, n, k)])
    assert ok, why

    def run(x, ids, w, w_up, rw, config):
        return grouped_gemm_cute(x, ids, w, w_up=w_up, row_weights=rw, swiglu_limit=10.0,
                                 simulate=algorithm != "mma_sync", config=config)
    run = jax.jit(run, static_argnums=5)
    got, again, base = (run(x, ids, w, w_up, rw, c)
                        for c in (interleaved, interleaved, contiguous))
    want = jax.jit(lambda x, ids, w, w_up, rw: grouped_gemm_reference(
        x, ids, w, w_up=w_up, row_weights=rw, swiglu_limit=10.0,
        simulate=algorithm != "mma_sync"))(x, ids, w, w_up, rw)
    cases.check_against_reference(_f32(got), _f32(want), 1e-2, again=_f32(again))
    cases.check_against_reference(_f32(base), _f32(want), 1e-2)
    # The same products, summed in another order: equal to f32 rounding.
    np.testing.assert_allclose(_f32(got), _f32(base), rtol=2e-2, atol=2e-2)
