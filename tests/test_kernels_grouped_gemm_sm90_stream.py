"""The "mma_fp8_stream" decode kernel (``kernels/grouped_gemm_sm90_mma_fp8_stream.py``): its
token layout and register budget on the CPU, its compilation for sm_90a, and -- on the GPU --
its outputs equal to "mma_fp8"'s bit for bit (same MMAs, same order) and close to the
reference, at the model's decode shapes."""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax.ffi import cases, grouped_gemm_reference
from dsv4_jax.ffi.grouped_gemm_sm90 import grouped_gemm_cute, launch_support, resolve_config
from dsv4_jax.ffi.policy import GroupedGemmPolicy
from dsv4_jax.kernels import grouped_gemm_config as support
from dsv4_jax.kernels import grouped_gemm_layout as layout

LIMIT = 10.0
STREAM = GroupedGemmPolicy(decode_algorithm="mma_fp8_stream")


def test_token_units_are_a_conflict_free_permutation():
    """Each staged token row keeps its 8 units; an MMA step's 8-byte reads (lane 4g + t:
    unit 2 step + t/2 of row g, bytes 8 (t % 2)) hit 16 distinct 8-byte bank pairs in each
    half warp."""
    for row in range(8):
        assert sorted(layout.stream_token_unit(row, u) for u in range(8)) == list(range(8))
    for step in range(4):
        for half_warp in range(2):
            lanes = range(16 * half_warp, 16 * half_warp + 16)
            addr = [(l // 4) * support.BLOCK_K + 16 * layout.stream_token_unit(
                l // 4, 2 * step + (l % 4) // 2) + 8 * (l % 2) for l in lanes]
            assert len({a // 8 % 16 for a in addr}) == 16


@pytest.mark.parametrize("fmt, gated, want", [("fp8", False, 4), ("fp8", True, 2),
                                              ("fp4", False, 6), ("fp4", True, 4)])
def test_batches_fit_the_register_budget(fmt, gated, want):
    batch = layout.stream_batch_blocks(fmt, gated, 6)
    assert batch == want
    per_block = (2 if gated else 1) * (16 if fmt == "fp8" else 8)
    assert batch * per_block <= layout.STREAM_LANE_WORDS
    assert layout.stream_batch_blocks(fmt, gated, 1) == 1


@pytest.mark.parametrize("fmt, gated, k, split", [("fp8", False, 1024, 1), ("fp8", True, 512, 2),
                                                  ("fp4", True, 512, 1), ("fp4", False, 384, 1)])
def test_compiles_for_sm90a(fmt, gated, k, split):
    """Weights by ``ld.global.nc`` into registers (no cp.async of weights: the only cp.async
    are the token codes and scales), the MMAs of one batch of K blocks, two CTA barriers
    (three with a K split)."""
    from grouped_gemm_compile import compile_variant
    config = support.choose_config(8, 4, fmt, decode_algorithm="mma_fp8_stream", split_k=split)
    assert config.algorithm == "mma_fp8_stream" and config.split_k == split
    compiled = compile_variant(fmt, gated, config, k=k)
    ptx = compiled.artifacts.PTX
    mats = 2 if gated else 1
    batch = layout.stream_batch_blocks(fmt, gated, config.num_stages)
    mma = re.findall(r"mma\.sync\.aligned\.m16n8k32\.row\.col\.f32\.e4m3\.e4m3\.f32", ptx)
    assert len(mma) == 4 * mats * batch
    # Per K block of the batch: 8 weight loads per matrix, and its scale words.
    loads = ptx.count("ld.global.nc")
    assert loads == batch * mats * (8 + (1 if fmt == "fp8" else 2))
    assert ptx.count("ld.global.nc.L1::no_allocate.v2") == (batch * mats * 8
                                                            if fmt == "fp8" else 0)
    assert len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx)) == 2
    # Two CTA barriers per token chunk; a K split one more before its sums go to shared
    # memory, where the cluster's CTA 0 adds them.
    assert ptx.count("bar.sync") == (3 if split > 1 else 2) and "wgmma" not in ptx
    assert ptx.count("barrier.cluster.arrive") == (2 if split > 1 else 0)
    assert compiled.dump_to_object("moe")[:4] == b"\x7fELF"
    for ablation in ("no_load", "no_mma"):
        compile_variant(fmt, gated, support.GroupedGemmSm90Config(
            block_n=8, num_stages=config.num_stages, algorithm="mma_fp8_stream",
            split_k=split, ablation=ablation), k=k)


def test_falls_back_where_fp8_does_not_apply():
    pick = lambda fmt, fp8: support.choose_config(  # noqa: E731
        8, 256, fmt, decode_algorithm="mma_fp8_stream", fp8_activations=fp8).algorithm
    assert pick("fp4", True) == "mma_fp8_stream"
    assert pick("bf16", True) == pick("fp8", False) == "mma_sync"


# ----------------------------------------------------------------------------- GPU
def _f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


# name: (fmt, groups, N, K, gated, rows, routed) -- the Flash decode GEMMs: dense FP8 linears
# (one group), the shared expert's gated GEMM, the routed experts (FP4, a row per
# (token, expert); 16 of the 256 experts, so that the reference fits), at 1 and 8 tokens;
# K splits as the model's rule picks them.
GPU_CASES = {
    "wq_b_t1": ("fp8", 1, 32768, 1024, False, 1, False),
    "wo_b_t8": ("fp8", 1, 4096, 8192, False, 8, False),
    "wq_a_t1": ("fp8", 1, 1024, 4096, False, 1, False),
    "shared_w13_t1": ("fp8", 1, 2048, 4096, True, 1, False),
    "shared_w13_t8": ("fp8", 1, 2048, 4096, True, 8, False),
    "routed_w13_t1": ("fp4", 16, 2048, 4096, True, 6, True),
    "routed_w13_t8": ("fp4", 16, 2048, 4096, True, 48, True),
    "routed_w2_t8": ("fp4", 16, 4096, 2048, False, 48, True),
    "small_fp8_routed": ("fp8", 8, 256, 512, True, 20, True),
}


def case_inputs(name):
    """GPU_CASES[name]'s inputs: ``(x, ids, w, arrays)`` -- ``arrays`` the second weight and
    routing weights of a gated case, jit arguments rather than constants."""
    fmt, groups, n, k, gated, rows, routed = GPU_CASES[name]
    key = jax.random.key(len(name))
    w = cases.random_weight(fmt, *jax.random.split(jax.random.fold_in(key, 1)), groups, n, k)
    w_up = (cases.random_weight(fmt, *jax.random.split(jax.random.fold_in(key, 2)), groups, n,
                                k) if gated else None)
    x = jax.random.normal(jax.random.fold_in(key, 3), (rows, k), jnp.float32)
    x = x.astype(jnp.bfloat16)
    ids = (jax.random.randint(jax.random.fold_in(key, 4), (rows,), 0, groups) if routed
           else None)
    rw = jax.random.uniform(jax.random.fold_in(key, 5), (rows,)) if gated else None
    return x, ids, w, dict(w_up=w_up, row_weights=rw)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_equals_mma_fp8_and_matches_the_reference(name):
    fmt, groups, n, k, gated, rows, _ = GPU_CASES[name]
    x, ids, w, arrays = case_inputs(name)
    static = dict(swiglu_limit=LIMIT, simulate=True)
    config = resolve_config(STREAM, rows, groups, fmt, (k,), True, (n,))
    assert config.algorithm == "mma_fp8_stream"
    ok, why = launch_support(config, fmt, "bfloat16", rows, groups, [(gated, n, k)])
    assert ok, why
    # "mma_fp8" with its tokens quantised one block ahead (2 stages) and up front (8).
    same = [support.GroupedGemmSm90Config(block_n=8, num_stages=config.num_stages,
                                          algorithm="mma_fp8", split_k=config.split_k,
                                          token_stages=stages) for stages in (2, 8)]
    run = jax.jit(lambda x, c, ids, w, kw: grouped_gemm_cute(x, ids, w, config=c, **kw,
                                                             **static), static_argnums=1)
    got, again, *fp8 = (run(x, c, ids, w, arrays) for c in (config, config, *same))
    want = jax.jit(lambda x, ids, w, kw: grouped_gemm_reference(x, ids, w, **kw, **static))(
        x, ids, w, arrays)
    cases.check_against_reference(_f32(got), _f32(want), 1e-2, again=_f32(again))
    for out in fp8:
        np.testing.assert_array_equal(_f32(got), _f32(out))


def quantisation_edge_rows(rows: int, k: int) -> jax.Array:
    """Rows whose 128-column blocks probe ``quant.act_quant``'s edges: an all-zero block (the
    1e-4 amax floor), blocks of magnitudes 2^-40 .. 2^40, a block whose largest |x| is
    exactly 448 times a power of two, and signs, subnormal bf16 values and ties of the e4m3
    rounding (values halfway between two codes after the scale)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    blocks = k // 128
    for b in range(blocks):
        view = x[:, 128 * b:128 * (b + 1)]
        kind = b % 6
        if kind == 0:
            view[:] = 0.0
        elif kind == 1:
            view *= np.float32(2.0) ** rng.integers(-40, 40, (rows, 1))
        elif kind == 2:
            view[:, 0] = 448.0 * 2.0 ** -3
            view[:, 1:] = np.clip(view[:, 1:], -50, 50)
        elif kind == 3:
            view *= np.float32(1e-39)                          # bf16 subnormals
        elif kind == 4:                                        # halfway between e4m3 codes
            view[:] = np.sign(view) * (1.0 + np.float32(1 / 16)) * 2.0 ** rng.integers(
                -3, 3, view.shape)
            view[:, 0] = 448.0
    return jnp.asarray(x).astype(jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("split, token_stages, rows", [
    (1, 2, 8), (4, 2, 8), (1, 8, 8), (4, 8, 8), (1, 8, 3), (2, 5, 1)])
def test_in_kernel_quantisation_is_act_quant_at_its_edges(split, token_stages, rows):
    """"mma_fp8" quantises the bf16 rows in the kernel; "mma_fp8_stream" multiplies
    ``quant.act_quant``'s codes with the same MMAs and sums: outputs equal bit for bit on
    rows built to hit the quantisation's edges, and both match the reference. K = 12
    blocks: with 8 token stages 7 quantised before the loop and 5 in it (no split), or all
    before it (3 per split); 3 rows: passes with idle half warps."""
    fmt, groups, n, k = "fp8", 1, 256, 1536
    key = jax.random.key(11)
    w = cases.random_weight(fmt, *jax.random.split(key), groups, n, k)
    x = quantisation_edge_rows(rows, k)
    static = dict(simulate=True)
    run = jax.jit(lambda x, c, w: grouped_gemm_cute(x, None, w, config=c, **static),
                  static_argnums=1)
    outs = [run(x, support.GroupedGemmSm90Config(
        block_n=8, num_stages=4, algorithm=alg, split_k=split,
        token_stages=token_stages if alg == "mma_fp8" else 2), w)
            for alg in ("mma_fp8", "mma_fp8_stream")]
    want = grouped_gemm_reference(x, None, w, **static)
    np.testing.assert_array_equal(_f32(outs[0]), _f32(outs[1]))
    cases.check_against_reference(_f32(outs[0]), _f32(want), 1e-2)
