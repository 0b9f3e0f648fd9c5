"""The decode GEMMs of one Flash layer, each kernel launch alone: time against the HBM floor
of its weight bytes (and its TF/s, for prefill sizes), for the configuration the model picks
and for variants of it.

    source .device/setup.sh && python3 benchmarks/decode_gemms.py [--tokens 1,8] \
        [--gemms all|wq_b,routed_w13,...] [--sweep] [--ablations [a,b]] [--row-blocks]
        [--token-stages 4,8] [--blocked] [--budget 400] [--out f.md]
    python3 benchmarks/decode_gemms.py --tiny          # dry run (CPU): variants, no launch
    bash benchmarks/run_on_device.sh gemm_ncu wq_b 1   # Nsight Compute of one launch (--ncu)

GEMMs (``gemm_shapes``, from ``Config.flash(quantized=True)``): the attention's wq_a, wkv,
wq_b, the indexer's wq_b, the grouped wo_a (BF16 activations: "mma_sync"), wo_b, the shared
expert's gated w1/w3 and w2 (FP8 weights, 128 x 128 E8M0 blocks), the routed experts' gated
w1/w3 and w2 (FP4, 1 x 32 E8M0, T k rows over 256 experts, balanced routing). Every launch
is set up as the op sets it up (``cases.grouped_launch``: the schedule outside the timed
call, and the FP8 activation quantisation too for the algorithms that take codes; "mma_fp8"
quantises in the kernel), so a time is the kernel (a K split adds its sums inside it).

Timing: one jitted function runs the launch on R distinct weight sets (dense: R copies of the
weight, R x bytes >= 256 MB so that nothing stays in the L2; routed: one expert stack and R
routings). Device time: the GPU ops of one traced execution (``step_figures.trace_device_ops``:
the kernel) divided by R -- what a launch costs
inside the model's CUDA graphs. Wall time: ``timing.median_seconds`` over 20 executions divided
by R; outside graphs each custom call also costs host time, which the wall column shows. Floor =
weight + scale bytes (routed: the touched experts') / ``timing.PEAK_TBPS``; a 1 GiB device
copy is timed first as the achievable bandwidth.

Variants: "model" (``resolve_config`` under the default ``GroupedGemmPolicy``, as the model
calls it; the routed launches with both launches' features, as the MoE op resolves them, the
gated one on token codes where the op gathers its rows -- then also "kernel quantises");
``--algorithms``: the config under each named decode algorithm (the policy's
``decode_algorithm``; where it does not apply, ``choose_config``'s fallback); ``--sweep``:
pipeline stages x K split (those that fit shared memory and whole scale groups); on
prefill tiles (``--tokens 4096``) kernel x tile rows x stages (``--prefill-algorithms``,
``--block-ns``); ``--ablations``: the model's config with each of its kernel's
benchmark-only ablations (outputs wrong by design: where the time goes); ``--base ALG``:
the first row, the sweep and the ablations under decode algorithm ALG instead of the
model's. ``--blocked``: every variant of an FP4 GEMM also on the same weights in the blocked
layout (``quant.block_fp4_weight``; label "[blocked]"). ``--budget``: seconds after which no further variant is started (rows already
timed are kept).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import time

import dsv4_jax  # noqa: F401  (first: XLA flags)
import jax
import jax.numpy as jnp

from dsv4_jax import quant
from dsv4_jax.config import Config
from dsv4_jax.ffi import cases
from dsv4_jax.ffi.grouped_gemm_sm90 import resolve_config, use_row_tiles
from dsv4_jax.ffi.moe_sm90 import with_token_codes
from dsv4_jax.ffi.policy import GroupedGemmPolicy
from dsv4_jax.kernels.grouped_gemm_config import (INTERLEAVED_SPLIT_ALGORITHMS, KERNELS,
                                                  MAX_SPLIT_K, SMEM_BYTES, interleaves)
from dsv4_jax.kernels.grouped_gemm_layout import BLOCK_K, stream_batch_blocks, warp_scale_group
from step_figures import trace_device_ops
from timing import PEAK_TBPS, back_to_back_seconds, median_seconds

SET_BYTES = 256 * 2 ** 20        # dense weights: copies until R x bytes reaches this
MAX_SETS = 64
STAGES = (1, 2, 3, 4, 6, 8)
SPLITS = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """One decode GEMM: ``groups`` weights [N, K] in ``fmt``; ``rows_per_token`` rows per
    token (wo_a: one per output group; routed: k); ``routed``: rows pick groups by routing;
    ``simulate``: FP8 activation simulation (every quantised linear but wo_a)."""
    name: str
    groups: int
    n: int
    k: int
    fmt: str
    gated: bool = False
    rows_per_token: int = 1
    routed: bool = False
    simulate: bool = True


def gemm_shapes(cfg: Config) -> dict[str, GemmShape]:
    d, inter = cfg.dim, cfg.moe_inter_dim
    shapes = [
        GemmShape("wq_a", 1, cfg.q_lora_rank, d, "fp8"),
        GemmShape("wkv", 1, cfg.head_dim, d, "fp8"),
        GemmShape("wq_b", 1, cfg.n_heads * cfg.head_dim, cfg.q_lora_rank, "fp8"),
        GemmShape("index_wq_b", 1, cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank,
                  "fp8"),
        GemmShape("wo_a", cfg.o_groups, cfg.o_lora_rank,
                  cfg.n_heads * cfg.head_dim // cfg.o_groups, "fp8",
                  rows_per_token=cfg.o_groups, simulate=False),
        GemmShape("wo_b", 1, d, cfg.o_groups * cfg.o_lora_rank, "fp8"),
        GemmShape("shared_w13", 1, inter, d, "fp8", gated=True),
        GemmShape("shared_w2", 1, d, inter, "fp8"),
        GemmShape("routed_w13", cfg.n_routed_experts, inter, d, "fp4", gated=True,
                  rows_per_token=cfg.n_activated_experts, routed=True),
        GemmShape("routed_w2", cfg.n_routed_experts, d, inter, "fp4",
                  rows_per_token=cfg.n_activated_experts, routed=True),
    ]
    return {s.name: s for s in shapes}


def variants(shape: GemmShape, rows: int, sweep: bool, ablations: bool | tuple[str, ...],
             algorithms: tuple[str, ...] = (), base: str = "",
             stages: tuple[int, ...] = STAGES, splits: tuple[int, ...] = SPLITS,
             block_ns: tuple[int, ...] = (), prefill_algorithms: tuple[str, ...] = (),
             row_blocks: bool = False, token_stages: tuple[int, ...] = (),
             interleaving: bool = False):
    """``[(label, config)]``: the model's config first (``base``: the config under that
    decode algorithm instead), then the config each of ``algorithms`` gets as the policy's
    decode algorithm, the sweep and the ablations (of the first config; True: all the
    kernel's, or those named that it has; the K split's only where it splits; "no_dequant"
    only where weights are converted: FP4, or FP8 into bf16 MMAs). On prefill tiles the sweep is kernel x ``block_ns`` x
    stages: the model's kernel and
    ``prefill_algorithms``, tiles of ``block_ns`` token rows (default: the model's), the
    ``stages`` that fit shared memory for this launch. ``row_blocks``: also the first config
    on the other number of 64-row blocks per CTA (1 or 2; ungated launches of kernels that
    take two, outputs of whole 128-row blocks). ``token_stages``: also the first config with
    each of these token stages (kernels that quantise or copy their tokens: how many K blocks
    of token rows are loaded ahead). ``interleaving``: also the first config with its K
    split's interleaving (``interleaved_split``) toggled, where the launch may take it, and
    in the sweep each split both ways (else the sweep's splits interleave as the model's
    config does, where they may)."""
    # The routed experts' launches resolve as the MoE op resolves them: with the features of
    # both launches of its call (w1/w3: K = d, N = inter; w2 the reverse), which set their
    # shared K split and stages (ffi/moe_sm90.moe_configs).
    k_ins, n_outs = (((shape.k, shape.n), (shape.n, shape.k)) if shape.routed
                     else ((shape.k,), (shape.n,)))

    def config(**policy):
        return resolve_config(GroupedGemmPolicy(**policy), rows, shape.groups, shape.fmt,
                              k_ins, shape.simulate, n_outs, gated=shape.gated)
    model = config(**({"decode_algorithm": base} if base else {}))
    quantising = model
    if shape.routed:
        # Token codes as the MoE op sets them (its gated launch first, then w2).
        model = with_token_codes(model, model, GroupedGemmPolicy(),
                                 gathered=not use_row_tiles(rows, shape.groups, model),
                                 explicit=False)[0 if shape.gated else 1]
    out = [(f"policy {base}" if base else "model", model)]
    if quantising != model:
        out.append(("kernel quantises (token_codes none)", quantising))
    if (row_blocks and not shape.gated and model.spec.max_row_blocks > 1
            and not any(n % 128 for n in n_outs)):
        other = dataclasses.replace(model, row_blocks=3 - model.row_blocks)
        out.append((f"row blocks {other.row_blocks}", other))
    for count in token_stages:
        if model.spec.quantizes_tokens and count != model.token_stages:
            out.append((f"token stages {count}",
                        dataclasses.replace(model, token_stages=count)))
    if interleaving:
        other = dataclasses.replace(model, interleaved_split=not model.interleaved_split)
        if other.interleaved_split:
            other = other if (other.algorithm in INTERLEAVED_SPLIT_ALGORITHMS and all(
                interleaves(shape.fmt, k, other.split_k) for k in k_ins)) else None
        if other is not None:
            out.append((f"interleaved split {other.interleaved_split}", other))
    for algorithm in algorithms:
        other = config(decode_algorithm=algorithm)
        if other not in [c for _, c in out]:
            out.append((f"decode_algorithm {algorithm}", other))
    if model.spec.tiles != "decode":
        if sweep:
            out += prefill_sweep(shape, model, stages, block_ns or (model.block_n,),
                                 (model.algorithm,) + prefill_algorithms, out)
    elif sweep:
        most = (shape.k // BLOCK_K) // warp_scale_group(shape.fmt, shape.k // BLOCK_K)
        for stage_count in stages:
            for split in splits:
                if split > min(most, MAX_SPLIT_K):
                    continue
                if stage_count < model.spec.min_stages:
                    continue
                can = (model.algorithm in INTERLEAVED_SPLIT_ALGORITHMS
                       and all(interleaves(shape.fmt, k, split) for k in k_ins))
                config = dataclasses.replace(model, num_stages=stage_count, split_k=split,
                                             interleaved_split=model.interleaved_split and can)
                if interleaving and can:
                    other = dataclasses.replace(config,
                                                interleaved_split=not config.interleaved_split)
                    if other != model:
                        out.append((f"stages {stage_count}, split {split}, interleaved "
                                    f"{other.interleaved_split}", other))
                if (model.algorithm == "mma_fp8_stream" and stage_count != model.num_stages
                        and stream_batch_blocks(shape.fmt, shape.gated, stage_count)
                        == stream_batch_blocks(shape.fmt, shape.gated, model.num_stages)):
                    continue                  # the same kernel: its batch is capped
                if config == model or config.smem_bytes(shape.fmt, shape.gated) > SMEM_BYTES:
                    continue
                out.append((f"stages {stage_count}, split {split}", config))
    if ablations:
        chosen = KERNELS[model.algorithm].ablations if ablations is True else ablations
        # An entry may join several ("no_load+no_mma"): each must apply.
        out += [(a, dataclasses.replace(model, ablation=a)) for a in chosen
                if all(part in KERNELS[model.algorithm].ablations
                       and (part != "no_dequant" or shape.fmt == "fp4"
                            or not model.spec.fp8_activations)  # bf16 MMAs convert FP8 too
                       and (part not in ("no_reduce", "no_cluster") or model.split_k > 1)
                       for part in a.split("+"))]
    return out


def flops(shape: GemmShape, tokens: int) -> int:
    """The launch's multiply-adds x 2: every row (a token's, or one per routed expert and
    group) times each matrix's N x K."""
    return 2 * tokens * shape.rows_per_token * shape.n * shape.k * (2 if shape.gated else 1)


def prefill_sweep(shape: GemmShape, model, stages, block_ns, algorithms, taken):
    """Prefill-tile variants of ``model``: every kernel, tile and stage count that the config
    accepts and that fits shared memory for this launch (gated or not), not already in
    ``taken``."""
    out, seen = [], [c for _, c in taken]
    for algorithm in dict.fromkeys(algorithms):
        for block_n in block_ns:
            for stage_count in stages:
                try:
                    config = dataclasses.replace(model, algorithm=algorithm, block_n=block_n,
                                                 num_stages=stage_count)
                except ValueError:
                    continue
                if (config in seen
                        or config.smem_bytes(shape.fmt, shape.gated) > SMEM_BYTES):
                    continue
                seen.append(config)
                out.append((f"{algorithm} block_n {block_n}, stages {stage_count}", config))
    return out


def weight_sets(shape: GemmShape, key, count: int, start: int = 0):
    """``count`` independent ``(w, w_up)`` pairs of ``(weight, scale)``: sets ``start ..
    start + count - 1`` of ``key``."""
    sets = []
    for i in range(start, start + count):
        k = jax.random.fold_in(key, i)
        keys = jax.random.split(k, 4)
        w = cases.random_weight(shape.fmt, keys[0], keys[1], shape.groups, shape.n, shape.k)
        up = (cases.random_weight(shape.fmt, keys[2], keys[3], shape.groups, shape.n, shape.k)
              if shape.gated else None)
        sets.append((w, up))
    return jax.block_until_ready(sets)


def blocked_sets(weights):
    """The weight sets with their FP4 weights in the blocked layout (a set repeated -- the
    routed stack -- is blocked once)."""
    done = {}

    def block(m):
        if m is None:
            return None
        if id(m[0]) not in done:
            done[id(m[0])] = quant.block_fp4_weight(m[0])
        return done[id(m[0])], m[1]
    return jax.block_until_ready([(block(w), block(up)) for w, up in weights])


def inputs(shape: GemmShape, tokens: int, key, sets: int):
    """Per set ``(x [rows, K] bf16, group ids [rows], row weights [rows])``."""
    out = []
    for i in range(sets):
        kx, kr = jax.random.split(jax.random.fold_in(key, 1000 + i))
        if shape.routed:
            x = cases.token_inputs(kx, tokens, shape.k)
            idx, w = cases.routing("balanced", tokens, shape.groups, shape.rows_per_token, kr)
            out.append(cases.assignment_rows(x, idx, w))
        else:
            rows = tokens * shape.rows_per_token
            xr = cases.token_inputs(kx, rows, shape.k)
            ids = jnp.repeat(jnp.arange(shape.groups, dtype=jnp.int32), tokens)
            out.append((xr, ids, jnp.ones((rows,), jnp.float32)))
    return out


def time_variant(shape, config, weights, rows_sets, dry: bool, ncu: bool = False):
    """``(device seconds, wall seconds)`` per launch over the sets (None in a dry run; with
    ``ncu``, three untimed executions for a profiler outside, and NaNs)."""
    calls = []
    for (w, up), (x, ids, rw) in zip(weights, rows_sets):
        fn, args = cases.grouped_launch(x, ids, w, w_up=up, row_weights=rw, config=config,
                                        simulate=shape.simulate)
        calls.append((fn, args))
    if dry:
        return None
    fns = [fn for fn, _ in calls]
    run = jax.jit(lambda all_args: [f(*a) for f, a in zip(fns, all_args)])
    all_args = [a for _, a in calls]
    if ncu:
        for _ in range(3):
            jax.block_until_ready(run(all_args))
        return float("nan"), float("nan")
    wall = median_seconds(run, all_args, runs=20) / len(calls)
    totals, _ = trace_device_ops(lambda: jax.block_until_ready(run(all_args)))
    return sum(totals.values()) * 1e-6 / len(calls), wall


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,8", help="comma-separated tokens per step")
    p.add_argument("--gemms", default="all", help="comma-separated names or 'all'")
    p.add_argument("--sweep", action="store_true", help="stages x K split variants")
    p.add_argument("--stages", default=",".join(map(str, STAGES)),
                   help="the sweep's pipeline stages (comma-separated)")
    p.add_argument("--splits", default=",".join(map(str, SPLITS)),
                   help="the sweep's K splits (comma-separated)")
    p.add_argument("--block-ns", default="",
                   help="prefill tiles: the sweep's token rows per tile (comma-separated; "
                        "default the model's)")
    p.add_argument("--prefill-algorithms", default="",
                   help="prefill tiles: kernels the sweep tries besides the model's")
    p.add_argument("--ablations", nargs="?", const="all", default="",
                   help="the kernel's ablations (all, or comma-separated names: those the "
                        "kernel has; a name may join several by +)")
    p.add_argument("--algorithms", default="",
                   help="comma-separated decode algorithms to time as the policy's choice")
    p.add_argument("--base", default="",
                   help="decode algorithm of the first row, the sweep and the ablations "
                        "(default: the model's config)")
    p.add_argument("--row-blocks", action="store_true",
                   help="also the model's config on the other number of 64-row blocks per "
                        "CTA (ungated launches)")
    p.add_argument("--blocked", action="store_true",
                   help="FP4 GEMMs: every variant also on blocked-layout weights")
    p.add_argument("--budget", type=float, default=float("inf"),
                   help="seconds after which no new variant starts")
    p.add_argument("--out", default=None, help="markdown table path")
    p.add_argument("--tiny", action="store_true", help="dry run on CPU (nothing launched)")
    p.add_argument("--ncu", action="store_true",
                   help="one variant only (--ncu-index; the model's config by default), "
                        "three untimed executions (for Nsight Compute: run_on_device.sh "
                        "gemm_ncu)")
    p.add_argument("--token-stages", default="",
                   help="also the model's config with these token stages (comma-separated)")
    p.add_argument("--interleaved-split", action="store_true",
                   help="also the model's config with its K split's interleaving toggled")
    p.add_argument("--ncu-index", type=int, default=0,
                   help="with --ncu: the variant to run (0: the model's config)")
    args = p.parse_args(argv)
    if args.ncu_index and not args.ncu:
        raise SystemExit("decode_gemms.py: --ncu-index picks the variant --ncu runs; give --ncu")
    # --ncu: the one variant profiled; else all of them.
    profiled = slice(args.ncu_index, args.ncu_index + 1) if args.ncu else slice(None)
    cfg = Config.tiny(quantized=True) if args.tiny else Config.flash(quantized=True)
    shapes = gemm_shapes(cfg)
    names = list(shapes) if args.gemms == "all" else args.gemms.split(",")
    unknown = [n for n in names if n not in shapes]
    if unknown:
        raise SystemExit(f"decode_gemms.py: --gemms {unknown} not in {list(shapes)}")
    dry = jax.devices()[0].platform != "gpu"
    if dry and not args.tiny:
        raise SystemExit("decode_gemms.py: no GPU; --tiny runs a dry run of the script")
    start = time.perf_counter()
    lines = [f"decode_gemms, {datetime.date.today()}, {jax.devices()[0].device_kind}, "
             f"`python decode_gemms.py {' '.join(sys.argv[1:] if argv is None else argv)}`", ""]
    if not dry and not args.ncu:
        x = jnp.ones((256 * 1024 * 1024,), jnp.float32)
        t = back_to_back_seconds(jax.jit(lambda x: x * 2.0), x, per_group=10)
        lines += [f"1 GiB device copy (read + write): {2 * x.nbytes / t / 1e9:.0f} GB/s "
                  f"({2 * x.nbytes / t / 1e12 / PEAK_TBPS:.0%} of {PEAK_TBPS} TB/s)", ""]
        del x
        print(lines[-2], flush=True)
    lines += ["| gemm | T | variant | device us | floor us | of HBM | vs model | wall us | TF/s |",
              "|---|---|---|---|---|---|---|---|---|"]
    key = jax.random.key(0)
    for name in names:
        shape = shapes[name]
        first = weight_sets(shape, key, 1)
        one = cases.bytes_per_group(*[m for m in first[0] if m])
        count = 8 if shape.routed else min(MAX_SETS, max(2, -(-SET_BYTES // int(
            one * shape.groups))))
        weights = (first * count if shape.routed        # one expert stack, R routings
                   else first + weight_sets(shape, key, count - 1, start=1))
        layouts = [("", weights)]
        if args.blocked and shape.fmt == "fp4":
            layouts.append((" [blocked]", blocked_sets(weights)))
        for tokens in (int(t) for t in args.tokens.split(",")):
            rows_sets = inputs(shape, tokens, key, count)
            groups = (sum(cases.touched_groups(ids) for _, ids, _ in rows_sets) / count
                      if shape.routed else shape.groups)
            floor = groups * one / (PEAK_TBPS * 1e12)
            model_t = None
            for label, config in variants(
                    shape, tokens * shape.rows_per_token, args.sweep,
                    args.ablations == "all" or tuple(a for a in args.ablations.split(",") if a),
                    tuple(a for a in args.algorithms.split(",") if a), args.base,
                    tuple(int(v) for v in args.stages.split(",")),
                    tuple(int(v) for v in args.splits.split(",")),
                    tuple(int(v) for v in args.block_ns.split(",") if v),
                    tuple(a for a in args.prefill_algorithms.split(",") if a),
                    args.row_blocks,
                    tuple(int(v) for v in args.token_stages.split(",") if v),
                    args.interleaved_split)[
                        profiled]:
                if time.perf_counter() - start > args.budget:
                    print(f"budget of {args.budget:.0f} s spent: {name} T={tokens} {label} "
                          "and later variants not run", flush=True)
                    break
                for suffix, layout_weights in layouts:
                    try:
                        times = time_variant(shape, config, layout_weights, rows_sets, dry,
                                             args.ncu)
                    except Exception as e:      # a variant that fails is reported, not fatal
                        print(f"{name} T={tokens} {label}{suffix}: FAILED "
                              f"{type(e).__name__}: {str(e)[:300]}", flush=True)
                        continue
                    if times is None:
                        print(f"{name} T={tokens} {label}{suffix}: {config} built, not "
                              f"launched", flush=True)
                        continue
                    t, wall = times
                    model_t = t if model_t is None else model_t      # the first row's
                    row = (f"| {name} | {tokens} | {label}{suffix} ({config.algorithm}, "
                           f"{config.num_stages} st, split {config.split_k}) | {t * 1e6:.1f} | "
                           f"{floor * 1e6:.1f} | {floor / t:.0%} | {t / model_t:.2f} | "
                           f"{wall * 1e6:.1f} | {flops(shape, tokens) / t / 1e12:.0f} |")
                    lines.append(row)
                    print(row, flush=True)
        del weights, layouts
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
