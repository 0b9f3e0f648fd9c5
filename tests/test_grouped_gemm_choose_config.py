"""``choose_config`` on CPU: which kernel, tiles, stages and K split each launch gets -- the
decode/prefill crossovers, "auto"'s per-launch choice, the FP8 kernels' fallbacks, the K
split of small launches and the few-CTA rule (the measurements behind each rule:
docs/performance.md)."""
import dataclasses

import pytest

from dsv4_jax.kernels import grouped_gemm_config as support


def test_k_split_for_few_rows():
    """At most two tiles of rows, when asked: the warp kernels split K; each split starts a
    scale group and the splits cover every K block once."""
    assert support.choose_config(6, 256, "fp4").split_k == 1        # only when a policy asks
    assert support.choose_config(6, 256, "fp4", split_k=4).split_k == 4
    assert support.choose_config(48, 256, "fp4", split_k=4).split_k == 1
    assert support.choose_config(6, 256, "fp4", decode_algorithm="wgmma",
                                 split_k=4).split_k == 1
    for num_k in (2, 3, 8, 16, 24, 32, 56):
        for group in (1, 2, 4):
            per = support.split_k_blocks(num_k, 4, group)
            assert per % group == 0 and 4 * per >= num_k and per < num_k + group
    with pytest.raises(ValueError, match="split_k"):
        support.GroupedGemmSm90Config(block_n=64, num_stages=3, algorithm="wgmma", split_k=2)


def test_tile_size_follows_the_rows_per_expert_crossover():
    """Warp kernels (8-row tiles) up to 16 rows per expert, 64-row WGMMA tiles up to 40,
    then 128 (the H200 crossover in kernels/grouped_gemm_config.py); bf16 weights cap tiles at 64."""
    e = 256
    picks = {rows: support.choose_config(rows, e, "fp4", gated=True) for rows in
             (6, 16 * e, 16 * e + 1, 40 * e, 40 * e + 1, 96 * e)}
    assert [(c.algorithm, c.block_n) for c in picks.values()] == [
        ("wgmma_rs", 8), ("mma_fp8", 8), ("wgmma_fp8_coop", 64), ("wgmma_fp8_coop", 64),
        ("wgmma_fp8_coop", 128), ("wgmma_fp8_coop", 128)]
    assert support.choose_config(96 * e, e, "bf16").block_n == 64
    assert support.choose_config(12 * e, e, "fp4", fp8_activations=False).algorithm \
        == "mma_sync"


def test_auto_decode_picks_the_warp_kernel_per_launch():
    """"auto" (the default): "wgmma_rs" for every decode launch of at most AUTO_MAX_ROWS rows.
    With the split automatic, a gated launch of WARP_TOKENS + 1 ... MANY_ROWS_SPLIT_MAX_ROWS
    rows splits K 4 ways, an ungated one of AUTO_MAX_ROWS + 1 ... MANY_ROWS_SPLIT_MAX_ROWS
    rows (at most AUTO_MAX_ROWS per group) 2 ways. A gated launch of more than AUTO_MAX_ROWS
    rows that does not split (a pinned split, K too short, more rows) runs "mma_fp8", as
    does an ungated one of more than AUTO_MAX_ROWS rows per group. The two launches of a
    call keep the same tiles; the FP8 kernels' fallback still applies."""
    assert support.DEFAULT_DECODE_ALGORITHM == support.AUTO_DECODE_ALGORITHM == "auto"
    limit = support.AUTO_MAX_ROWS

    def pick(rows, gated, fmt="fp4", k_ins=(4096, 2048), split_k=None, **kw):
        return support.choose_config(rows, 256, fmt, gated=gated, k_ins=k_ins,
                                     n_outs=(2048, 4096), split_k=split_k, **kw)
    for rows in (1, 6, support.WARP_TOKENS):
        up, down = pick(rows, True), pick(rows, False)
        assert up.algorithm == down.algorithm == "wgmma_rs", rows
        assert dataclasses.replace(up, algorithm=down.algorithm) == down, rows
    split = support.SPLIT_STAGES
    # Two tiles of rows: the gated launch splits K 4 ways, w2 by auto_split_k (here none).
    for rows in (support.WARP_TOKENS + 1, 12, limit):
        up, down = pick(rows, True), pick(rows, False)
        assert (up.algorithm, up.split_k, up.num_stages) == ("wgmma_rs", 4, split), rows
        assert (down.algorithm, down.split_k) == ("wgmma_rs", 1), rows
        assert pick(rows, True, split_k=1).split_k == 1, rows
    for rows in (limit + 1, 48, support.MANY_ROWS_SPLIT_MAX_ROWS):
        up, down = pick(rows, True), pick(rows, False)
        assert (up.algorithm, up.split_k, up.num_stages) == ("wgmma_rs", 4, split), rows
        assert (down.algorithm, down.split_k, down.num_stages) == ("wgmma_rs", 2, split), rows
        assert up.block_n == down.block_n == support.WARP_TOKENS, rows
        # A pinned split, or a K too short to split (K = 512: one FP4 scale group).
        assert pick(rows, True, split_k=1).algorithm == "mma_fp8", rows
        assert pick(rows, True, k_ins=(512, 512)).algorithm == "mma_fp8", rows
        assert pick(rows, False, split_k=1).split_k == 1, rows
    for rows in (support.MANY_ROWS_SPLIT_MAX_ROWS + 1, 384):
        up, down = pick(rows, True), pick(rows, False)
        assert (up.algorithm, up.split_k, up.num_stages) == ("mma_fp8", 1, 4), rows
        assert (down.algorithm, down.split_k, down.num_stages) == ("wgmma_rs", 1, 4), rows
    # Splits start scale groups and none is left without work: Pro's w2 (K = 3072: 6 FP4
    # scale groups) splits 3 ways, 2 groups each.
    assert pick(48, True, k_ins=(7168, 3072)).split_k == 3
    dense = lambda rows, gated=False: support.choose_config(   # noqa: E731
        rows, 1, "fp8", n_outs=(1024,), k_ins=(4096,), split_k=None, gated=gated)
    assert [dense(r).algorithm for r in (8, limit, 64)] == ["wgmma_rs", "wgmma_rs", "mma_fp8"]
    assert (dense(32, True).algorithm, dense(32, True).split_k) == ("mma_fp8", 1)
    assert pick(48, True, "bf16").algorithm == pick(48, False, "bf16").algorithm == "mma_sync"
    assert pick(48, False, "bf16").split_k == 1
    assert pick(6, False, fp8_activations=False).algorithm == "mma_sync"
    assert pick(8192, True).algorithm == "wgmma_fp8_coop"
    with pytest.raises(ValueError, match="decode_algorithm"):
        support.choose_config(8, 256, "fp4", decode_algorithm="automatic")


def test_mma_fp8_falls_back_where_it_does_not_apply():
    def pick(rows, fmt, **kw):
        return support.choose_config(rows, 256, fmt, decode_algorithm="mma_fp8", **kw).algorithm
    assert pick(8, "fp4") == "mma_fp8"
    assert pick(8, "bf16") == "mma_sync"
    assert pick(8, "fp4", fp8_activations=False) == "mma_sync"
    assert pick(8192, "fp4") == "wgmma_fp8_coop"
    config = support.GroupedGemmSm90Config(block_n=8, num_stages=4, algorithm="mma_fp8")
    ok, why = config.is_supported(weight_format="bf16", gated=True, n_out=256, k_in=512,
                                  x_dtype="bfloat16", num_tiles=8)
    assert not ok and "mma_fp8" in why
    with pytest.raises(ValueError, match="ablation"):
        support.GroupedGemmSm90Config(block_n=8, algorithm="mma_fp8", ablation="no_token_load")


def test_small_decode_launches_split_k_to_fill_the_gpu():
    """A decode launch with fewer than 2 CTAs per SM (a dense linear of a small matrix, few
    64-row output blocks, one tile of rows) splits K to about 4 CTAs per SM, at most one
    split per scale group and no split without work; launches with enough CTAs do not."""
    auto = dict(split_k=None, k_ins=(4096,))
    assert support.choose_config(8, 1, "fp8", n_outs=(512,), **auto).split_k == 8   # wkv
    assert support.choose_config(1, 1, "fp8", n_outs=(4096,), k_ins=(8192,),
                                 split_k=None).split_k == 8                          # wo_b
    assert support.choose_config(8, 1, "fp8", n_outs=(32768,), k_ins=(1024,),
                                 split_k=None).split_k == 1                          # wq_b
    assert support.choose_config(6, 256, "fp4", n_outs=(2048, 4096), k_ins=(4096, 2048),
                                 split_k=None).split_k == 2                  # MoE, T = 1
    assert support.choose_config(6, 256, "fp4", n_outs=(4096,), k_ins=(2048,),
                                 split_k=None).split_k == 1           # 384 CTAs: no split
    assert support.choose_config(8, 1, "fp8", n_outs=(4096,), k_ins=(2048,),
                                 split_k=None).split_k == 4                  # shared w2
    # 7 groups per split would leave the eighth split without work: 6 splits of 3 groups.
    assert support.auto_split_k(1, 1, "fp8", (16 * 4 * 128,), (70 * 64,)) == 6
    # "mma_sync" (wo_a: bf16 tokens, 8 groups of one row) aims at 2 CTAs per SM, not 4.
    wo_a = support.choose_config(8, 8, "fp8", decode_algorithm="mma_sync", n_outs=(1024,),
                                 k_ins=(4096,), split_k=None)
    assert (wo_a.algorithm, wo_a.split_k) == ("mma_sync", 2)
    # Split launches take SPLIT_STAGES (their clusters must fit at once in a GPC), unsplit
    # few-tile launches FEW_TILES_STAGES, fewer while two gated CTAs would not fit in an SM
    # (wq_b: 8 token stages leave room for 5, so it keeps 4).
    assert wo_a.num_stages == support.SPLIT_STAGES == 3
    wq_b = support.choose_config(8, 1, "fp8", n_outs=(32768,), k_ins=(1024,), split_k=None)
    assert (wq_b.split_k, wq_b.token_stages) == (1, support.FEW_TILES_TOKEN_STAGES)
    assert support.FEW_TILES_STAGES == 4 and wq_b.num_stages == 4
    assert 2 * wq_b.smem_bytes("fp8", True) <= support.SMEM_BYTES
    # A deeper ring of 6 would not fit twice (choose_config would cut it to 5).
    assert 2 * dataclasses.replace(wq_b, num_stages=6).smem_bytes("fp8", True) > support.SMEM_BYTES
    # Splits start scale groups: K = 512 (4 blocks, one FP8 group) cannot split.
    assert support.choose_config(8, 1, "fp8", n_outs=(512,), k_ins=(512,),
                                 split_k=None).split_k == 1


def test_dense_launches_with_few_wgmma_ctas_take_warp_tiles():
    """64 rows of a 1024-wide dense linear: one 64-row WGMMA tile gives 16 CTAs, so the
    warp kernels' 8-row tiles run (128 CTAs); a 32768-wide one keeps WGMMA tiles."""
    pick = lambda n: support.choose_config(64, 1, "fp8", n_outs=(n,), k_ins=(4096,))
    assert pick(1024).algorithm == "mma_fp8" and pick(1024).block_n == 8
    assert pick(32768).algorithm == "wgmma_fp8_coop"
    assert support.choose_config(64, 1, "fp8", k_ins=(4096,)).algorithm \
        == "wgmma_fp8_coop"     # no N


def test_bf16_token_launches_keep_wgmma_tiles_with_few_ctas():
    """The grouped wo_a (8 groups of 1024 x 4096 FP8, bf16 tokens: no FP8 simulation) at 32
    and 64 rows per group: "mma_sync" would convert every weight again per 8-row tile, so
    the 64-row WGMMA tiles run although they give fewer CTAs than SMs; up to 16 rows per
    group it stays on the warp kernel (the WGMMA tiles' size follows the rows per group)."""
    pick = lambda rows: support.choose_config(  # noqa: E731
        rows, 8, "fp8", fp8_activations=False, n_outs=(1024,), k_ins=(4096,), split_k=None)
    assert (pick(8 * 16).algorithm, pick(8 * 16).block_n) == ("mma_sync", 8)
    for rows, block in ((8 * 32, 64), (8 * 64, 128)):
        assert (pick(rows).algorithm, pick(rows).block_n) == ("wgmma_coop", block), rows
    assert "mma_sync" not in support.FEW_CTAS_ALGORITHMS
    assert set(support.FEW_CTAS_ALGORITHMS) < set(support.WARP_ALGORITHMS)


def test_prefill_stages_fit_the_launch_not_its_gated_sibling():
    """WGMMA tiles take as many stages as fit the launch itself: the grouped wo_a (bf16
    tokens, one matrix) 3, where a gated launch of the same tiles fits only 2; the gated
    shared w1/w3 keeps what two matrices fit."""
    woa = support.choose_config(512 * 8, 8, "fp8", fp8_activations=False, n_outs=(1024,),
                                k_ins=(4096,))
    assert (woa.algorithm, woa.block_n, woa.num_stages) == ("wgmma_coop", 128, 3)
    assert woa.smem_bytes("fp8", False) <= support.SMEM_BYTES
    assert dataclasses.replace(woa, num_stages=4).smem_bytes("fp8", False) > support.SMEM_BYTES
    assert woa.smem_bytes("fp8", True) > support.SMEM_BYTES       # gated, 3 would not fit
    w13 = support.choose_config(4096, 1, "fp8", n_outs=(2048,), k_ins=(4096,), gated=True)
    assert w13.smem_bytes("fp8", True) <= support.SMEM_BYTES
    assert dataclasses.replace(w13, num_stages=w13.num_stages + 1).smem_bytes(
        "fp8", True) > support.SMEM_BYTES


def test_wide_tiles_for_bf16_token_launches_of_many_rows_per_group():
    """"wgmma_coop" (bf16 tokens) takes 256-row tiles from WIDE_ROWS_PER_GROUP rows per group
    on, ungated (one accumulator per math thread); gated launches and the FP8 kernels keep
    128 (their block sums leave no registers for more)."""
    pick = lambda rows, groups, **kw: support.choose_config(  # noqa: E731
        rows, groups, "fp8", n_outs=(1024,), k_ins=(4096,), **kw)
    wide = support.WIDE_ROWS_PER_GROUP
    woa = pick(wide * 8, 8, fp8_activations=False)
    assert (woa.algorithm, woa.block_n, woa.num_stages) == ("wgmma_coop", 256, 2)
    assert woa.is_supported(weight_format="fp8", gated=False, n_out=1024, k_in=4096,
                            x_dtype="bfloat16", num_tiles=64) == (True, "")
    assert pick(wide * 8 - 8, 8, fp8_activations=False).block_n == 128
    assert pick(wide, 1, fp8_activations=False, gated=True).block_n == 128
    assert pick(wide * 8, 8).algorithm == "wgmma_fp8_coop"
    assert pick(wide * 8, 8).block_n == 128
