"""The "wgmma_rs" decode kernel (``kernels/grouped_gemm_sm90_wgmma_rs.py``): the K order of its
token operand against its weight registers, and its compilation for sm_90a, on the CPU; on the
GPU its outputs close to the reference and to "mma_fp8"'s, repeatable bit for bit, at the
model's decode shapes and with the in-kernel quantisation at its edges."""
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
from test_kernels_grouped_gemm_sm90_stream import GPU_CASES, quantisation_edge_rows, case_inputs

LIMIT = 10.0
RS = GroupedGemmPolicy(decode_algorithm="wgmma_rs")


def _weight_column(fmt, step, t, column):
    """K column (in the K block) of MMA column ``column`` of step ``step`` in lane 4g + t's A
    registers, as "mma_fp8" fills them (``ALayout_64x32``: register 0 holds MMA columns
    4t .. 4t + 3, register 2 columns 16 + 4t .. 16 + 4t + 3): the lane's weight word is K
    columns 32 step + 8 t .. + 7; FP4 even codes go to register 0, odd ones to register 2;
    FP8 bytes 0-3 and 4-7."""
    second, j = divmod(column - 4 * t, 16)
    assert 0 <= j < 4
    if fmt == "fp4":
        return 32 * step + 8 * t + 2 * j + second
    return 32 * step + 8 * t + 4 * second + j


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_token_operand_k_order_matches_the_weight_registers(fmt):
    """The quantising threads' stores (``rs_token_offset`` / ``rs_token_columns``) fill each
    step's K-major B operand (core matrices of 8 rows x 16 bytes, MMA columns 0-15 then
    16-31, 128 bytes apart, row n at 16 n) with the K column that the weights' A registers
    put at the same MMA column: every byte once, so the product is the GEMM's."""
    where = {}
    for row in range(support.WARP_TOKENS):
        for unit in range(16):
            for second in range(2):
                base = layout.rs_token_offset(row, unit, second)
                for byte, k in enumerate(layout.rs_token_columns(unit, second, fmt)):
                    assert base + byte not in where
                    where[base + byte] = (row, k)
    assert sorted(where) == list(range(support.WARP_TOKENS * support.BLOCK_K))
    for step in range(4):
        for n in range(support.WARP_TOKENS):
            for column in range(32):
                offset = step * 256 + (column // 16) * 128 + n * 16 + column % 16
                t = (column % 16) // 4
                assert where[offset] == (n, _weight_column(fmt, step, t, column))


@pytest.mark.parametrize("fmt, gated, k, split", [("fp8", False, 1024, 1), ("fp8", True, 512, 2),
                                                  ("fp4", True, 512, 1), ("fp4", False, 384, 2)])
def test_compiles_for_sm90a(fmt, gated, k, split):
    """4 warpgroup MMAs per matrix and K block with register A operands, no warp-level MMA,
    a proxy fence after the token stores."""
    from grouped_gemm_compile import compile_variant
    config = support.choose_config(8, 4, fmt, decode_algorithm="wgmma_rs", split_k=split)
    assert config.algorithm == "wgmma_rs" and config.split_k == split
    compiled = compile_variant(fmt, gated, config, k=k)
    ptx = compiled.artifacts.PTX
    mats = 2 if gated else 1
    mma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n8k32\.f32\.e4m3\.e4m3 "
                     r"\{[^}]*\}, \{[^}]*\}, %rd\d+", ptx)
    assert len(mma) == 4 * mats
    # Per step a fence, its MMAs and a commit, then a wait for the step before (the last
    # step: for all).
    assert ptx.count("wgmma.fence.sync.aligned") == ptx.count("wgmma.commit_group") == 4
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)
    assert sorted(waits) == ["0", "1", "1", "1"]
    assert "mma.sync" not in ptx and "fence.proxy.async.shared::cta" in ptx
    assert compiled.dump_to_object("moe")[:4] == b"\x7fELF"
    for ablation in ("no_mma", "no_dequant"):
        compile_variant(fmt, gated, support.GroupedGemmSm90Config(
            block_n=8, num_stages=config.num_stages, algorithm="wgmma_rs",
            split_k=split, ablation=ablation), k=k)


def test_falls_back_where_fp8_does_not_apply():
    pick = lambda fmt, fp8: support.choose_config(  # noqa: E731
        8, 256, fmt, decode_algorithm="wgmma_rs", fp8_activations=fp8).algorithm
    assert pick("fp4", True) == pick("fp8", True) == "wgmma_rs"
    assert pick("bf16", True) == pick("fp8", False) == "mma_sync"


# ----------------------------------------------------------------------------- GPU
def _f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_matches_the_reference_and_mma_fp8(name):
    """The Flash decode GEMMs of the "mma_fp8_stream" tests (dense FP8 linears, the shared
    expert, the routed experts at 1 and 8 tokens, a small FP8 routed case with empty
    experts), with the K splits the model's rule picks."""
    fmt, groups, n, k, gated, rows, _ = GPU_CASES[name]
    x, ids, w, arrays = case_inputs(name)
    static = dict(swiglu_limit=LIMIT, simulate=True)
    config = resolve_config(RS, rows, groups, fmt, (k,), True, (n,))
    assert config.algorithm == "wgmma_rs"
    ok, why = launch_support(config, fmt, "bfloat16", rows, groups, [(gated, n, k)])
    assert ok, why
    fp8 = support.GroupedGemmSm90Config(block_n=8, num_stages=config.num_stages,
                                        algorithm="mma_fp8", split_k=config.split_k)
    run = jax.jit(lambda x, c, ids, w, kw: grouped_gemm_cute(x, ids, w, config=c, **kw,
                                                             **static), static_argnums=1)
    got, again, other = (run(x, c, ids, w, arrays) for c in (config, config, fp8))
    want = jax.jit(lambda x, ids, w, kw: grouped_gemm_reference(x, ids, w, **kw, **static))(
        x, ids, w, arrays)
    cases.check_against_reference(_f32(got), _f32(want), 1e-2, again=_f32(again))
    # Same products, the FP8 tensor cores' own sums of each K = 32 (f16 products summed in
    # f32 for "mma_fp8"): far closer to each other than to the reference.
    cases.check_against_reference(_f32(got), _f32(other), 4e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("split, token_stages, rows", [(1, 2, 8), (4, 8, 8), (2, 5, 1)])
def test_in_kernel_quantisation_matches_mma_fp8(split, token_stages, rows):
    """The quantisation is "mma_fp8"'s (bit for bit ``quant.act_quant``, tested there): on
    rows at its edges (zero blocks, 2^+-40 magnitudes, e4m3 ties) the outputs are within
    4e-3 of "mma_fp8"'s."""
    k, n = 1536, 256          # FP8 scale words: K blocks a multiple of 4
    w = cases.random_weight("fp8", *jax.random.split(jax.random.key(11)), 1, n, k)
    x = quantisation_edge_rows(rows, k)
    outs = []
    for algorithm in ("wgmma_rs", "mma_fp8"):
        config = support.GroupedGemmSm90Config(block_n=8, num_stages=4, algorithm=algorithm,
                                               split_k=split, token_stages=token_stages)
        outs.append(_f32(jax.jit(lambda x, w: grouped_gemm_cute(
            x, None, w, config=config, simulate=True))(x, w)))
    cases.check_against_reference(outs[0], outs[1], 4e-3)
