"""Where the MoE kernel's time goes: the gated (w1/w3) launch alone at Flash dims, with
benchmark-only ablations (no_dequant, no_mma) and stage/tile variants, next to a 1 GiB
device copy for the achievable HBM bandwidth. Decode sizes also run the warp-level
"mma_sync" kernel, all its ablations (``KERNELS["mma_sync"].ablations``) and stage depths.

    source .device/setup.sh && python3 benchmarks/moe_kernel_ablation.py [TOKENS] [--warp-only]
        [--only wgmma_coop,wgmma_fp8_coop]
    python3 benchmarks/moe_kernel_ablation.py --tiny        # dry run (CPU): variants, no launch

TOKENS: comma-separated token counts (default 1,8,64,4096); --warp-only: only the
"mma_sync" variants (decode sizes); --only: only the variants of these algorithms. Prefill sizes also run "wgmma_fp8" (FP8 WGMMAs) and
"wgmma_coop" (two math warpgroups), their ablations and stage depths; sizes between (64 < T
< 2048, e.g. 128,256,512,1024) run every kernel on the same rows: the decode/prefill
crossover for ``choose_config``. Every variant is a ``GroupedGemmSm90Config`` value (from
``resolve_config`` under a ``GroupedGemmPolicy``, or replaced fields of one); inputs are
``dsv4_jax.ffi.cases.moe_case(dims, "fp4", T, "random")``, times
``timing.back_to_back_seconds``.
"""
from __future__ import annotations

import argparse
import dataclasses

import dsv4_jax  # noqa: F401  (first: XLA flags)
import jax
import jax.numpy as jnp

from dsv4_jax.ffi import cases
from dsv4_jax.ffi.grouped_gemm_sm90 import resolve_config
from dsv4_jax.ffi.policy import GroupedGemmPolicy
from dsv4_jax.kernels.grouped_gemm_config import KERNELS, PREFILL_FP8_CONFIG
from timing import back_to_back_seconds, rates

FMT = "fp4"


def variants(rows, dims, tokens, warp_only):
    """The configs timed for ``rows`` assignment rows of ``tokens`` tokens."""
    def config(**policy):
        return resolve_config(GroupedGemmPolicy(**policy), rows, dims.experts, FMT,
                              (dims.dim, dims.moe_inter_dim), simulate=True, gated=True)
    base = config(decode_algorithm="wgmma", prefill_algorithm="wgmma")   # one math warpgroup
    # Joined ablations isolate one side: no loads (the math warpgroup alone), no
    # conversion or MMA (the producer and the pipeline alone), nothing (the pipeline).
    out = [] if warp_only else [base] + [dataclasses.replace(base, ablation=a) for a in (
        "no_dequant", "no_mma", "no_load", "no_token_load", "no_load+no_token_load",
        "no_dequant+no_mma", "no_load+no_token_load+no_dequant+no_mma")]
    if tokens <= 64:
        if not warp_only:
            out += [dataclasses.replace(base, num_stages=s) for s in (3, 6)]
        warp = config(decode_algorithm="mma_sync")
        out += [warp] + [dataclasses.replace(warp, ablation=a)
                         for a in KERNELS["mma_sync"].ablations]
        out += [dataclasses.replace(warp, num_stages=s) for s in (2, 3, 6)]
        out += [dataclasses.replace(warp, algorithm="mma_fp8", num_stages=s) for s in (3, 4, 6)]
    elif tokens < 2048:
        # Between decode and prefill (8-96 rows per expert): every kernel on the same rows --
        # where the decode tiles (8 rows, each re-reads its expert's weights) stop beating
        # the 64/128-row WGMMA tiles (one tile per expert, mostly padding).
        warp = resolve_config(GroupedGemmPolicy(decode_algorithm="mma_fp8"), 64 * dims.k,
                              dims.experts, FMT, (dims.dim, dims.moe_inter_dim), simulate=True,
                              gated=True)
        out = [base, dataclasses.replace(base, block_n=64, num_stages=4), PREFILL_FP8_CONFIG,
               warp, dataclasses.replace(warp, algorithm="mma_sync"),
               config(prefill_algorithm="wgmma_coop"), config(prefill_algorithm="wgmma_fp8_coop")]
    else:
        out += [dataclasses.replace(base, block_n=64, num_stages=4)]
        # Two math warpgroups per CTA: as shipped, the same ablations, 2 stages.
        coop = config(prefill_algorithm="wgmma_coop")
        out += [coop] + [dataclasses.replace(coop, ablation=a) for a in (
            "no_dequant", "no_mma", "no_load+no_token_load",
            "no_load+no_token_load+no_dequant+no_mma")]
        out += [dataclasses.replace(coop, num_stages=2)]
        fp8 = config(prefill_algorithm="wgmma_fp8")
        out += [fp8] + [dataclasses.replace(fp8, ablation=a) for a in ("no_dequant", "no_mma")]
        out += [dataclasses.replace(fp8, num_stages=s) for s in (4, 5)]
        # FP8 WGMMAs with the conversion in two math warpgroups: as shipped, its ablations,
        # fewer stages.
        fp8_coop = config(prefill_algorithm="wgmma_fp8_coop")
        out += [fp8_coop] + [dataclasses.replace(fp8_coop, ablation=a) for a in (
            "no_dequant", "no_mma", "no_dequant+no_mma")]
        out += [dataclasses.replace(fp8_coop, num_stages=s) for s in (3, 4)]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("tokens", nargs="?", default="1,8,64,4096",
                   help="comma-separated token counts")
    p.add_argument("--warp-only", action="store_true", help="only the warp-kernel variants")
    p.add_argument("--only", default="",
                   help="comma-separated algorithms: only their variants (e.g. wgmma_coop)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny dims (without a GPU: the variants and launch arguments are "
                        "built, nothing is launched)")
    args = p.parse_args(argv)
    dims = cases.DIMS["tiny" if args.tiny else "flash"]
    dry = jax.devices()[0].platform != "gpu"
    if dry and not args.tiny:
        raise SystemExit("moe_kernel_ablation.py: no GPU; --tiny runs a dry run of the script")
    if not dry:
        x = jnp.ones((256 * 1024 * 1024,), jnp.float32)
        t = back_to_back_seconds(jax.jit(lambda x: x * 2.0), x, per_group=10)
        print(f"copy 1 GiB r+w: {2 * x.nbytes / t / 1e9:.0f} GB/s")
        del x
    for tokens in (int(t) for t in args.tokens.split(",")):
        case = cases.moe_case(dims, FMT, tokens, "random")
        p = case.weights
        xa, ea, wa = cases.assignment_rows(case.x, case.idx, case.w)
        nbytes = cases.touched_groups(case.idx) * cases.bytes_per_group(p["w1"], p["w3"])
        flops = cases.moe_flops(ea.size, dims, mats=2)
        only = set(filter(None, args.only.split(",")))
        seen = set()
        for config in variants(ea.size, dims, tokens, args.warp_only):
            if (only and config.algorithm not in only) or config in seen:
                continue
            seen.add(config)
            up, up_args = cases.grouped_launch(xa, ea, p["w1"], w_up=p["w3"], row_weights=wa,
                                               config=config, simulate=True)
            if dry:
                print(f"T={tokens:5d} up-proj {str(config):80s} built, not launched (no GPU)")
                continue
            try:
                t1 = back_to_back_seconds(up, *up_args)
            except Exception as e:
                print(tokens, config, "FAILED", type(e).__name__, str(e)[:200])
                continue
            r = rates(nbytes, flops, t1)
            print(f"T={tokens:5d} up-proj {str(config):80s} {t1 * 1e6:8.1f} us "
                  f"{r['gbps']:6.0f} GB/s {r['tflops']:6.1f} TF/s", flush=True)


if __name__ == "__main__":
    main()
