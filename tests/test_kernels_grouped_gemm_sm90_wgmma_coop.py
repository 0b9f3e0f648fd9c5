"""The "wgmma_coop" prefill kernel (kernels/grouped_gemm_sm90_wgmma_coop.py) without a GPU: its
configuration rules and fallbacks, and its sm_90a build (two math warpgroups, 128 weight rows
per CTA, registers moved to the math warpgroups, no spills). Its numbers against the reference
are GPU tests: tests/test_moe.py and tests/test_grouped_gemm.py (``-k coop``)."""
from __future__ import annotations

import dataclasses
import re

import pytest

from dsv4_jax.kernels import grouped_gemm_config as support

pytest.importorskip("cutlass")
from grouped_gemm_compile import compile_variant as _compile, ptxas_log  # noqa: E402

COOP = dataclasses.replace(support.PREFILL_CONFIG, algorithm="wgmma_coop")
FLASH_EXPERTS = 256


def test_prefill_tiles_take_coop_when_asked():
    rows = 4096 * 6
    picked = support.choose_config(rows, FLASH_EXPERTS, "fp4", prefill_algorithm="wgmma_coop",
                                   n_outs=(2048, 4096))
    assert (picked.algorithm, picked.block_n, picked.num_stages) == ("wgmma_coop", 128, 3)
    mid = support.choose_config(30 * FLASH_EXPERTS, FLASH_EXPERTS, "fp4",
                                prefill_algorithm="wgmma_coop")
    assert (mid.algorithm, mid.block_n) == ("wgmma_coop", 64)
    # FP8 weights: the gated launch's 2 x 128 rows of 128 bytes per stage leave room for two
    # stages only; the ungated launch (one matrix) keeps three.
    fp8 = support.choose_config(rows, FLASH_EXPERTS, "fp8", prefill_algorithm="wgmma_coop",
                                gated=True)
    assert (fp8.algorithm, fp8.num_stages) == ("wgmma_coop", 2)
    assert fp8.smem_bytes("fp8", True) <= support.SMEM_BYTES
    down = support.choose_config(rows, FLASH_EXPERTS, "fp8", prefill_algorithm="wgmma_coop")
    assert (down.algorithm, down.num_stages) == ("wgmma_coop", 3)
    assert down.smem_bytes("fp8", False) <= support.SMEM_BYTES
    # Without the FP8 simulation coop still runs (it multiplies bf16 rows).
    assert support.choose_config(rows, FLASH_EXPERTS, "fp4", prefill_algorithm="wgmma_coop",
                                 fp8_activations=False).algorithm == "wgmma_coop"
    # Decode-size rows keep the warp kernels.
    assert support.choose_config(8, FLASH_EXPERTS, "fp4", prefill_algorithm="wgmma_coop"
                                 ).algorithm == support.auto_decode_algorithm(8, FLASH_EXPERTS,
                                                                              gated=False)


@pytest.mark.parametrize("fmt, n_outs", [("bf16", ()), ("fp4", (2048, 4160))])
def test_coop_falls_back_to_wgmma_where_it_does_not_apply(fmt, n_outs):
    """BF16 weights (two A tiles per warpgroup do not fit next to BF16 stages) and output
    features not a multiple of 128 run the one-warpgroup kernel."""
    picked = support.choose_config(4096 * 6, FLASH_EXPERTS, fmt, prefill_algorithm="wgmma_coop",
                                   n_outs=n_outs)
    assert picked.algorithm == "wgmma"


def test_support_names_what_coop_cannot_take():
    ok, why = COOP.is_supported(weight_format="fp4", gated=True, n_out=192, k_in=512,
                                x_dtype="bfloat16", num_tiles=8)
    assert not ok and "multiple of 128" in why and "192" in why
    ok, why = COOP.is_supported(weight_format="bf16", gated=True, n_out=256, k_in=512,
                                x_dtype="bfloat16", num_tiles=8)
    assert not ok and "'wgmma_coop' takes fp4/fp8" in why
    assert COOP.is_supported(weight_format="fp4", gated=True, n_out=256, k_in=512,
                             x_dtype="bfloat16", num_tiles=8) == (True, "")


@pytest.mark.parametrize("fmt, gated, block_n", [("fp4", True, 128), ("fp4", False, 128),
                                                 ("fp4", True, 64), ("fp8", False, 256)])
def test_coop_compiles_for_sm90a_without_spills(tmp_path, fmt, gated, block_n):
    """Each math warpgroup issues the WGMMAs of its own 64 rows (8 k-steps of 16 per matrix
    and K block, m64 n block_n); the producer hands registers over (setmaxnreg down, then
    up); each warpgroup syncs on its own named barriers; no spills, no serialized WGMMAs."""
    config = dataclasses.replace(COOP, block_n=block_n)
    compiled = _compile(fmt, gated, config, a=512, k=512, n=256, e=4)
    ptx = compiled.artifacts.PTX
    mats = 2 if gated else 1
    assert len(re.findall(rf"wgmma\.mma_async\S*m64n{block_n}k16\S*bf16", ptx)) == 8 * mats
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40;", ptx)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232;", ptx)
    # Named barriers with a register id (1 + 2w, 2 + 2w): one per warpgroup and use.
    assert len(re.findall(r"bar\.sync\s+%r\d+, 128", ptx)) >= 2
    log = ptxas_log(tmp_path, compiled)
    assert "C7514" not in log and "serialized" not in log, log
    assert "0 bytes spill stores, 0 bytes spill loads" in log, log
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    assert registers * 384 <= 65536, log


@pytest.mark.parametrize("ablation", support.KERNELS["wgmma_coop"].ablations)
def test_coop_ablations_compile_and_leave_out_their_stage(ablation):
    ptx = _compile("fp4", True, dataclasses.replace(COOP, ablation=ablation), a=512,
                   k=1024).artifacts.PTX
    count = len(re.findall(r"wgmma\.mma_async", ptx))
    assert count == (0 if ablation == "no_mma" else 16)
    assert "cp.async" in ptx
