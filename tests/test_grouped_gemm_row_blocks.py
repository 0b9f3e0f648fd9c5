"""Two 64-row output blocks per CTA (``GroupedGemmSm90Config.row_blocks``) in the decode kernels
that quantise their tokens ("mma_fp8", "wgmma_rs"): the config and policy refuse what they
cannot run, only ungated launches that ask get them (opt-in: measured slower), the kernels
compile for sm_90a with twice the MMAs and fewer instructions per weight byte, and -- on the
GPU -- they give the same bits as one block per CTA (every output row takes the same MMAs and
sums), alone, K split, paired and on ragged groups."""
import dataclasses
import os
import re
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax.ffi import cases, grouped_gemm_pair, grouped_gemm_reference
from dsv4_jax.ffi.grouped_gemm_sm90 import (grouped_gemm_cute, launch_support, pair_config,
                                            resolve_config)
from dsv4_jax.ffi.policy import GroupedGemmPolicy
from dsv4_jax.kernels import grouped_gemm_config as support

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

ROUTED = dict(num_groups=256, k_ins=(4096, 2048), n_outs=(2048, 4096))   # Flash's experts


@pytest.mark.parametrize("algorithm, row_blocks", [
    ("wgmma_rs", 0), ("wgmma_rs", 3), ("wgmma_rs", True), ("mma_fp8", 2.0),
    ("mma_sync", 2), ("mma_fp8_stream", 2), ("wgmma", 2)])
def test_config_refuses_row_blocks_its_kernel_does_not_take(algorithm, row_blocks):
    block_n = 8 if algorithm != "wgmma" else 64
    with pytest.raises(ValueError, match=r"row_blocks must be an int in \[1, [12]\] for "):
        support.GroupedGemmSm90Config(block_n=block_n, algorithm=algorithm,
                                      row_blocks=row_blocks)


@pytest.mark.parametrize("gated, n_out, reason", [
    (True, 256, r"row_blocks 2 \(ungated launches of output features a multiple of 128; "
                r"got 256, gated True\)"),
    (False, 192, r"got 192, gated False")])
def test_support_names_what_two_blocks_need(gated, n_out, reason):
    config = support.GroupedGemmSm90Config(block_n=8, num_stages=3, algorithm="wgmma_rs",
                                           row_blocks=2)
    ok, why = config.is_supported(weight_format="fp4", gated=gated, n_out=n_out, k_in=512,
                                  x_dtype="bfloat16", num_tiles=4)
    assert not ok and re.search(reason, why), why


def test_two_blocks_take_the_ring_of_two_matrices():
    one = support.GroupedGemmSm90Config(block_n=8, num_stages=3, algorithm="wgmma_rs")
    two = dataclasses.replace(one, row_blocks=2)
    assert two.smem_bytes("fp4", False) == one.smem_bytes("fp4", True) > one.smem_bytes(
        "fp4", False)


@pytest.mark.parametrize("tokens, gated, want", [(8, False, 2), (1, False, 2), (8, True, 1)])
def test_choose_config_gives_two_blocks_to_ungated_launches_only(tokens, gated, want):
    """Asked for two blocks, the routed w2 gets them; the gated launch never (its two
    matrices already share the token operand); the default is one."""
    def choose(**kw):
        return support.choose_config(6 * tokens, ROUTED["num_groups"], "fp4",
                                     k_ins=ROUTED["k_ins"], n_outs=ROUTED["n_outs"],
                                     split_k=None, gated=gated, **kw)
    assert choose().row_blocks == 1
    config = choose(row_blocks=2)
    assert config.row_blocks == want
    ok, why = launch_support(config, "fp4", "bfloat16", 6 * tokens, 256,
                             [(gated, 2048 if gated else 4096, 4096 if gated else 2048)])
    assert ok, why


def test_two_blocks_need_outputs_of_whole_blocks():
    assert support.choose_config(8, 1, "fp8", k_ins=(1024,), n_outs=(4096, 192), split_k=None,
                                 row_blocks=2).row_blocks == 1
    assert support.choose_config(8, 1, "fp8", k_ins=(1024,), n_outs=(4096,), split_k=None,
                                 row_blocks=2).row_blocks == 2


@pytest.mark.parametrize("bad", [None, 0, 3, True, "2", 2.0])
def test_policy_row_blocks_must_be_1_or_2(bad):
    with pytest.raises(ValueError, match="row_blocks must be 1 or 2, got"):
        GroupedGemmPolicy(row_blocks=bad)


def test_a_pair_takes_two_blocks_only_where_each_weight_has_whole_ones():
    def weight(n):
        return (jnp.zeros((1, n, 512), jnp.float8_e4m3fn), jnp.zeros((1, n // 128 + 1, 4),
                                                                      jnp.float8_e8m0fnu))
    policy = GroupedGemmPolicy(row_blocks=2)
    assert pair_config(policy, 8, 512, weight(1024), weight(512), True).row_blocks == 2
    assert pair_config(policy, 8, 512, weight(1088), weight(192), True).row_blocks == 1


def test_policy_resolves_to_the_launch_config():
    for blocks in (1, 2):
        config = resolve_config(GroupedGemmPolicy(row_blocks=blocks), 48, 256, "fp4",
                                ROUTED["k_ins"], True, ROUTED["n_outs"])
        assert config.algorithm == "wgmma_rs" and config.row_blocks == blocks
    assert resolve_config(None, 48, 256, "fp4", ROUTED["k_ins"], True,
                          ROUTED["n_outs"]).row_blocks == 1


@pytest.mark.parametrize("algorithm, fmt, k", [("wgmma_rs", "fp4", 2048), ("wgmma_rs", "fp8", 1024),
                                               ("mma_fp8", "fp4", 512)])
def test_compiles_for_sm90a_with_fewer_instructions_per_weight_byte(algorithm, fmt, k):
    """Twice the MMAs per K block, and a K loop of fewer than 1.6x the instructions for twice
    the weight bytes (the token operand, the loop and its addresses paid once)."""
    from grouped_gemm_compile import compile_variant
    from loop_instruction_mix import loop_body
    one = support.GroupedGemmSm90Config(block_n=8, num_stages=3, algorithm=algorithm,
                                        split_k=2)
    bodies = []
    for blocks in (1, 2):
        config = dataclasses.replace(one, row_blocks=blocks)
        ptx = compile_variant(fmt, False, config, a=48, k=k, n=512, e=16).artifacts.PTX
        mma = ("wgmma.mma_async.sync.aligned.m64n8k32" if algorithm == "wgmma_rs"
               else "mma.sync.aligned.m16n8k32")
        assert ptx.count(mma) == 4 * blocks
        bodies.append(len(loop_body(ptx)))
    assert bodies[1] < 1.6 * bodies[0], bodies


# ----------------------------------------------------------------------------- GPU
def _f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


# name: (fmt, groups, N, K, rows, routed, split)
GPU_CASES = {
    "routed_w2_t8": ("fp4", 32, 4096, 2048, 48, True, 2),
    "routed_w2_t64": ("fp4", 32, 4096, 2048, 384, True, 1),
    "routed_w2_t1": ("fp4", 32, 4096, 2048, 6, True, 2),
    "wo_b_t8": ("fp8", 1, 4096, 8192, 8, False, 4),
    "small_fp8_routed": ("fp8", 8, 256, 512, 20, True, 1),
}


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["wgmma_rs", "mma_fp8"])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_two_blocks_give_the_bits_of_one(name, algorithm):
    fmt, groups, n, k, rows, routed, split = GPU_CASES[name]
    key = jax.random.key(len(name))
    w = cases.random_weight(fmt, *jax.random.split(jax.random.fold_in(key, 1)), groups, n, k)
    x = jax.random.normal(jax.random.fold_in(key, 3), (rows, k), jnp.float32)
    x = x.astype(jnp.bfloat16)
    ids = (jax.random.randint(jax.random.fold_in(key, 4), (rows,), 0, groups) if routed
           else None)
    one = support.GroupedGemmSm90Config(block_n=8, num_stages=3, algorithm=algorithm,
                                        split_k=split)
    two = dataclasses.replace(one, row_blocks=2)
    ok, why = launch_support(two, fmt, "bfloat16", rows, groups, [(False, n, k)])
    assert ok, why
    run = jax.jit(lambda x, c, ids, w: grouped_gemm_cute(x, ids, w, config=c, simulate=True),
                  static_argnums=1)
    got, again, base = (run(x, c, ids, w) for c in (two, two, one))
    want = jax.jit(lambda x, ids, w: grouped_gemm_reference(x, ids, w, simulate=True))(
        x, ids, w)
    cases.check_against_reference(_f32(got), _f32(want), 1e-2, again=_f32(again))
    np.testing.assert_array_equal(_f32(got), _f32(base))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, groups, n, n_next, k", [("fp8", 1, 32768, 8192, 1024),
                                                       ("fp4", 4, 2048, 512, 4096)])
def test_a_paired_launch_on_two_blocks_gives_the_bits_of_one(fmt, groups, n, n_next, k):
    key = jax.random.key(n_next)
    w, w_next = (cases.random_weight(fmt, *jax.random.split(jax.random.fold_in(key, i)),
                                     groups, m, k) for i, m in ((1, n), (2, n_next)))
    rows = 8 * groups
    x = jax.random.normal(jax.random.fold_in(key, 3), (rows, k), jnp.float32)
    x = x.astype(jnp.bfloat16)
    ids = None if groups == 1 else jax.random.randint(jax.random.fold_in(key, 4), (rows,),
                                                      0, groups)
    outs = []
    for blocks in (2, 1):
        policy = GroupedGemmPolicy(row_blocks=blocks, decode_algorithm="wgmma_rs")
        assert pair_config(policy, rows, k, w, w_next, True).row_blocks == blocks
        outs.append(jax.jit(lambda x, i, w, v: grouped_gemm_pair(
            x, i, w, v, simulate=True, implementation="cute", policy=policy))(
                x, ids, w, w_next))
    for two, one in zip(*outs):
        assert np.all(np.isfinite(_f32(two)))
        np.testing.assert_array_equal(_f32(two), _f32(one))
