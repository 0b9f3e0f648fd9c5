"""Where the MoE kernel's time goes: the gated (w1/w3) launch alone at Flash dims, with
benchmark-only ablations (no_dequant, no_mma) and stage/tile variants, next to a 1 GiB
device copy for the achievable HBM bandwidth. Decode sizes also run the warp-level
"mma_sync" kernel, all its ablations (``GroupedGemmSm90Config.WARP_ABLATIONS``) and stage depths.

    source .device/setup.sh && python3 benchmarks/moe_kernel_ablation.py [TOKENS] [--warp-only]

TOKENS: comma-separated token counts (default 1,8,64,4096); --warp-only: only the
"mma_sync" variants (decode sizes). Prefill sizes also run "wgmma_fp8" (FP8 WGMMAs), its
ablations and stage depths; sizes between (64 < T < 2048, e.g. 128,256,512,1024) run every
kernel on the same rows: the decode/prefill crossover for ``choose_config``.
"""
import dataclasses
import sys

import numpy as np
import dsv4_jax  # noqa
import jax, jax.numpy as jnp
from moe_kernel_check import make_w, bench, launch, LIMIT
from dsv4_jax.ffi import moe as ms

def setup(T, k=6, E=256, d=4096, inter=2048, fmt="fp4", seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    w1 = make_w(ks[0], E, inter, d, fmt); w3 = make_w(ks[1], E, inter, d, fmt); w2 = make_w(ks[2], E, d, inter, fmt)
    idx = jnp.argsort(jax.random.uniform(ks[4], (T, E)), axis=-1)[:, :k].astype(jnp.int32)
    A = T * k
    xa = jax.random.normal(ks[3], (A, d), jnp.float32).astype(jnp.bfloat16)
    ea = idx.reshape(-1); wa = jnp.ones((A,), jnp.float32)
    touched = len(np.unique(np.asarray(idx)))
    return w1, w3, w2, xa, ea, wa, touched

def main(token_counts=(1, 8, 64, 4096), warp_only=False):
    x = jnp.ones((256 * 1024 * 1024,), jnp.float32)
    t = bench(lambda: x * 2.0, 10)
    print(f"copy 1 GiB r+w: {2 * x.nbytes / t / 1e9:.0f} GB/s")
    for T in token_counts:
        w1, w3, w2, xa, ea, wa, touched = setup(T)
        E = 256
        base = ms.choose_config(xa.shape[0], E, "fp4", "wgmma")
        # Joined ablations isolate one side: no loads (the math warpgroup alone), no
        # conversion or MMA (the producer and the pipeline alone), nothing (the pipeline).
        variants = [base] + [dataclasses.replace(base, ablation=a) for a in (
            "no_dequant", "no_mma", "no_load", "no_token_load", "no_load+no_token_load",
            "no_dequant+no_mma", "no_load+no_token_load+no_dequant+no_mma")]
        if warp_only:
            variants = []
        if T <= 64:
            if not warp_only:
                variants += [dataclasses.replace(base, num_stages=s) for s in (3, 6)]
            warp = ms.choose_config(xa.shape[0], E, "fp4", "mma_sync")
            variants += [warp] + [dataclasses.replace(warp, ablation=a)
                                  for a in warp.WARP_ABLATIONS[1:]]
            variants += [dataclasses.replace(warp, num_stages=s) for s in (2, 3, 6)]
            variants += [dataclasses.replace(warp, algorithm="mma_fp8", num_stages=s)
                         for s in (3, 4, 6)]
        elif T < 2048:
            # Between decode and prefill (8-96 rows per expert): every kernel on the same
            # rows -- where the decode tiles (8 rows, each re-reads its expert's weights) stop
            # beating the 64/128-row WGMMA tiles (one tile per expert, mostly padding).
            variants = [base, dataclasses.replace(base, block_n=64, num_stages=4),
                        ms.choose_config(xa.shape[0], E, "fp4", prefill_algorithm="wgmma_fp8",
                                         k_ins=(4096, 2048))]
            warp = ms.choose_config(64 * 6, E, "fp4", "mma_fp8")
            variants += [warp, dataclasses.replace(warp, algorithm="mma_sync")]
        else:
            variants += [dataclasses.replace(base, block_n=64, num_stages=4)]
            fp8 = ms.choose_config(xa.shape[0], E, "fp4", prefill_algorithm="wgmma_fp8",
                                   k_ins=(4096, 2048))
            variants += [fp8] + [dataclasses.replace(fp8, ablation=a)
                                 for a in ("no_dequant", "no_mma")]
            variants += [dataclasses.replace(fp8, num_stages=s) for s in (4, 5)]
        per_exp_up = (w1[0][0].nbytes + w1[1][0].nbytes) * 2
        for cfg in variants:
            order, valid, *tiles = ms.moe_schedule(ea, E, cfg.block_n)
            xs = xa[order]; rws = wa[order]
            g1 = jax.jit(lambda xs, sched, w1, w3, rws: launch(xs, sched, *w1, cfg, weight_b=w3[0], scale_b=w3[1], route_w=rws, swiglu_limit=LIMIT))
            try:
                t1 = bench(lambda: g1(xs, (order, *tiles), w1, w3, rws))
            except Exception as e:
                print(T, cfg, "FAILED", type(e).__name__, str(e)[:200]); continue
            gbs = touched * per_exp_up / t1 / 1e9
            tf = 2 * T * 6 * 2 * 4096 * 2048 / t1 / 1e12
            print(f"T={T:5d} up-proj {str(cfg):80s} {t1*1e6:8.1f} us {gbs:6.0f} GB/s {tf:6.1f} TF/s")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(tuple(int(t) for t in args[0].split(",")) if args else (1, 8, 64, 4096),
         warp_only="--warp-only" in sys.argv)
