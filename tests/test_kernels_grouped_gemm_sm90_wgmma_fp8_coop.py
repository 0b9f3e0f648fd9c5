"""The "wgmma_fp8_coop" prefill kernel (kernels/grouped_gemm_sm90_wgmma_fp8_coop.py) without a
GPU: its configuration rules and fallbacks, and its sm_90a build (FP8 WGMMAs issued by two
math warpgroups that also convert, registers handed over, no spills, no serialized WGMMAs).
Its conversion is "wgmma_fp8"'s (replayed in tests/test_kernels_grouped_gemm_sm90_wgmma_fp8.py);
its numbers against the reference and bit for bit against "wgmma_fp8" are GPU tests:
tests/test_moe.py and tests/test_grouped_gemm.py (``-k fp8_coop``)."""
from __future__ import annotations

import dataclasses
import re

import pytest

from dsv4_jax.kernels import grouped_gemm_config as support

pytest.importorskip("cutlass")
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass.tensor_utils import LayoutEnum  # noqa: E402

from dsv4_jax.kernels.grouped_gemm_sm90_wgmma_fp8_coop import (  # noqa: E402
    a_chunk_offset, x_scale_slot, x_scale_slots)
from grouped_gemm_compile import compile_variant as _compile, ptxas_log  # noqa: E402

FLASH_EXPERTS = 256
FLASH_ROWS = 4096 * 6
FP8_COOP = dataclasses.replace(support.PREFILL_CONFIG, algorithm="wgmma_fp8_coop")


def _pick(fmt="fp4", **kw):
    args = dict(prefill_algorithm="wgmma_fp8_coop", k_ins=(4096, 2048), n_outs=(2048, 4096))
    return support.choose_config(FLASH_ROWS, FLASH_EXPERTS, fmt, **(args | kw))


# A tiles of the FP4 build (2 warpgroups x 2 parities) and of the FP8 build at 6 stages
# (two per stage, the producer's direct copies).
A_TILES = 12


def _collect_offsets(layout, out: list):
    """(Plain Python, traced inline: ``range`` loops unroll.)"""
    for buf in range(A_TILES):
        for row in range(support.BLOCK_M):
            for chunk in range(support.BLOCK_K // 16):
                out.append(((buf, row, chunk), cute.crd2idx((row, 16 * chunk, buf), layout)))


@cute.jit
def _a_tile_offsets(out: cutlass.Constexpr):
    """CuTe's byte offsets (swizzle applied) of every 16-byte chunk of the kernel's e4m3 A
    tiles, appended to ``out`` as ((buf, row, chunk), offset) at trace time."""
    layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (support.BLOCK_M, 128,
                                                                  support.BLOCK_K),
                                           cutlass.Float8E4M3FN, A_TILES)
    _collect_offsets(layout, out)


def test_a_chunk_offsets_are_cutes_swizzled_layout(monkeypatch):
    """The converting threads (FP4) and the producer's copies (FP8) store 16-byte chunks at
    ``a_chunk_offset``: the same bytes the WGMMA descriptors of ``make_smem_layout_a`` read,
    for every chunk of 12 tiles."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    offsets = []
    cute.compile(_a_tile_offsets, offsets)
    assert len(offsets) == A_TILES * support.BLOCK_M * support.BLOCK_K // 16
    for (buf, row, chunk), offset in offsets:
        assert a_chunk_offset(buf, row, chunk) == offset, (buf, row, chunk)


@pytest.mark.parametrize("block_n", [8, 16, 40, 64, 128])
def test_token_scale_slots_put_each_lanes_scales_together(block_n):
    """The producer stores token n's scale at ``x_scale_slot(n)``: distinct slots of the
    stage in which lane t's accumulator columns 8 j + 2 (t % 4) + c lie together in column
    order -- what the promotion's vector loads read -- and the four lanes' loads fall in
    distinct shared-memory banks."""
    slots = [x_scale_slot(n, block_n) for n in range(block_n)]
    assert len(set(slots)) == block_n and max(slots) < x_scale_slots(block_n)
    firsts = []
    for q in range(4):
        columns = [8 * j + 2 * q + c for j in range(block_n // 8) for c in (0, 1)]
        first = slots[columns[0]]
        assert [slots[n] for n in columns] == list(range(first, first + block_n // 4))
        firsts.append(first)
    # The four lanes' loads of a group (16 bytes; 8 unless block_n is a multiple of 16) use
    # distinct banks.
    width = 4 if block_n % 16 == 0 else 2
    banks = [{(f + i) % 32 for i in range(width)} for f in firsts]
    assert all(not (a & b) for i, a in enumerate(banks) for b in banks[i + 1:]), firsts


def test_prefill_tiles_take_fp8_coop_when_asked():
    picked = _pick(gated=True)
    assert (picked.algorithm, picked.block_n) == ("wgmma_fp8_coop", 128)
    assert picked.num_stages >= 4 and picked.smem_bytes("fp4", True) <= support.SMEM_BYTES
    down = _pick()                    # the w2 launch: one matrix, one stage more fits
    assert down.num_stages == picked.num_stages + 1
    assert down.smem_bytes("fp4", False) <= support.SMEM_BYTES
    mid = support.choose_config(30 * FLASH_EXPERTS, FLASH_EXPERTS, "fp4",
                                prefill_algorithm="wgmma_fp8_coop")
    assert (mid.algorithm, mid.block_n) == ("wgmma_fp8_coop", 64)
    fp8 = _pick("fp8", gated=True)
    assert fp8.algorithm == "wgmma_fp8_coop" and fp8.smem_bytes("fp8", True) <= support.SMEM_BYTES
    # Decode-size rows keep the warp kernels.
    assert support.choose_config(8, FLASH_EXPERTS, "fp4", prefill_algorithm="wgmma_fp8_coop"
                                 ).algorithm == support.auto_decode_algorithm(8, 256, gated=False)


@pytest.mark.parametrize("kw, want", [
    (dict(fp8_activations=False), "wgmma_coop"),            # bf16 rows: the bf16 coop
    (dict(k_ins=(4096, 384)), "wgmma_coop"),                 # an odd number of K blocks
    (dict(n_outs=(2048, 4160)), "wgmma"),                    # not a multiple of 128 rows
])
def test_fp8_coop_falls_back_where_it_does_not_apply(kw, want):
    assert _pick(**kw).algorithm == want


def test_fp8_coop_falls_back_to_wgmma_for_bf16_weights():
    assert _pick("bf16").algorithm == "wgmma"


def test_support_names_what_fp8_coop_cannot_take():
    kw = dict(gated=True, x_dtype="bfloat16", num_tiles=8)
    ok, why = FP8_COOP.is_supported(weight_format="fp4", n_out=192, k_in=512, **kw)
    assert not ok and "'wgmma_fp8_coop' needs a multiple of 128" in why and "192" in why
    ok, why = FP8_COOP.is_supported(weight_format="fp4", n_out=256, k_in=384, **kw)
    assert not ok and "even number" in why and "384" in why
    ok, why = FP8_COOP.is_supported(weight_format="bf16", n_out=256, k_in=512, **kw)
    assert not ok and "'wgmma_fp8_coop' takes fp4/fp8" in why
    assert FP8_COOP.is_supported(weight_format="fp4", n_out=256, k_in=512, **kw) == (True, "")
    with pytest.raises(ValueError, match="block_n <= 128"):
        dataclasses.replace(FP8_COOP, block_n=192)


@pytest.mark.parametrize("fmt, gated, block_n", [("fp4", True, 128), ("fp8", True, 128),
                                                 ("fp4", False, 128), ("fp4", True, 64),
                                                 ("fp8", False, 8), ("fp4", False, 40)])
def test_fp8_coop_compiles_for_sm90a_without_spills(tmp_path, fmt, gated, block_n):
    """Each math warpgroup multiplies one matrix (gated) or one 64-row block: two K blocks'
    chains per iteration of 4 e4m3 WGMMAs of K = 32, and converts its own rows (FP4: 2 fold
    tables of 4 conversions per thread and K block; FP8: none); the producer hands registers
    over;
    gated, the up projection's sums cross to the gate's warpgroup through shared memory
    after a barrier of both; no spills, no serialized WGMMAs."""
    config = dataclasses.replace(_pick(fmt, gated=gated), block_n=block_n)
    compiled = _compile(fmt, gated, config, a=512, k=512, n=256, e=4)
    ptx = compiled.artifacts.PTX
    mma = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_n}k32\.f32\.e4m3\.e4m3",
                     ptx)
    assert len(mma) == 2 * 4
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)) == (
        2 * 2 * 4 if fmt == "fp4" else 0)
    # FP4: each converting thread stores its 4 chunks per K block (two blocks per
    # iteration); FP8 weights are copied by the producer into the A tiles as they are.
    assert len(re.findall(r"st\.shared\.v4\.b32", ptx)) == (8 if fmt == "fp4" else 0)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40;", ptx)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232;", ptx)
    assert len(re.findall(r"bar\.sync\s+%r\d+, 128", ptx)) >= 1     # per-warpgroup barrier
    assert bool(re.search(r"bar\.sync\s+5, 256", ptx)) == gated       # the hand-over
    log = ptxas_log(tmp_path, compiled)
    assert "C7514" not in log and "serialized" not in log, log
    assert "0 bytes spill stores, 0 bytes spill loads" in log, log
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    assert registers * 384 <= 65536, log


@pytest.mark.parametrize("ablation", support.KERNELS["wgmma_fp8_coop"].ablations)
def test_fp8_coop_ablations_compile_and_leave_out_their_stage(ablation):
    ptx = _compile("fp4", True, dataclasses.replace(_pick(gated=True), ablation=ablation), a=512,
                   k=1024).artifacts.PTX
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == (0 if ablation == "no_mma" else 8)
    assert "cp.async" in ptx
