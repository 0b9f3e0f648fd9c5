"""Benchmark the routed-experts op (``ffi.moe_experts``): the CuTe kernel vs the XLA reference.

    python benchmarks/bench_moe.py [--shapes flash,pro] [--tokens 1,8,64,512,4096,16384]
                                   [--routings balanced,skewed] [--weights fp4|fp8|bf16]
                                   [--xla-max-tokens 4096] [--no-xla] [--runs 20]
                                   [--algorithms mma_fp8,mma_sync] [--quick] [--tiny]
                                   [--out table.md]

Shapes: Flash E=256 experts, d=4096, inter=2048, k=6; Pro E=384, d=7168, inter=3072, k=6.
Weights (FP4 + E8M0 1x32 by default, FP8 + E8M0 128x128 with ``--weights fp8``) and inputs are
generated on the device with jax.random. Routings: ``balanced`` -- each token picks k distinct
experts uniformly; ``skewed`` -- expert e is picked with probability ~ 1/(e+1) (a few hot
experts hold most rows, many get none).

Kernel algorithms (``DSV4_MOE_ALGORITHM``) for decode-size inputs (the warp kernels' range
of ``choose_config``: rows <= ``WARP_ROWS_PER_EXPERT`` E): each of ``--algorithms`` is timed;
"ours" is the fastest, the per-algorithm times are listed. Larger inputs run the WGMMA
prefill tiles whatever the choice, so they are timed once.

Timing: one jitted function runs R calls on R distinct input sets (own tokens and routing, so
consecutive calls touch different experts and nothing stays in the 60 MB L2); the median over
``--runs`` executions (after two warm-up executions, each finished with block_until_ready)
divided by R is the time per call. XLA is timed the same way in the same process; above
``--xla-max-tokens`` it is skipped, and an out-of-memory shows as ``oom``.

Figures: bytes = the touched experts' weights and scales (distinct experts of the routing x
bytes per expert; the T x d activations are not counted) -> GB/s and % of 4.3 TB/s (H200 HBM);
FLOPs = 2 T k 3 d inter (useful, no padding) -> TF/s and % of 790 TF/s (dense BF16; the FP8
peak is twice that). Memory: the executable's temporary bytes (``memory_analysis``) and the
device's peak bytes in use so far (monotone over the run).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time

import dsv4_jax  # noqa: F401  (first: XLA flags)
import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import quant
from dsv4_jax.ffi.moe import ALGORITHM_ENV_VAR, moe_experts
from dsv4_jax.kernels.grouped_gemm_config import WARP_ROWS_PER_EXPERT

PEAK_TBPS = 4.3
PEAK_TFLOPS = 790.0
SWIGLU_LIMIT = 10.0
SHAPES = {"flash": dict(experts=256, dim=4096, inter=2048, k=6),
          "pro": dict(experts=384, dim=7168, inter=3072, k=6),
          "tiny": dict(experts=8, dim=256, inter=128, k=2)}


def expert_weights(key, experts, dim, inter, fmt):
    """Stacked ``w1, w3 [E, inter, d]``, ``w2 [E, d, inter]`` in ``fmt``, made on the device."""
    out = []
    for j, (o, i) in enumerate(((inter, dim), (inter, dim), (dim, inter))):
        kw, ks = jax.random.split(jax.random.fold_in(key, j))
        if fmt == "fp4":
            w = jax.random.randint(kw, (experts, o, i // 2), -128, 128, jnp.int32).astype(jnp.int8)
            s = jnp.exp2(jax.random.randint(ks, (experts, o, i // 32), -8, -5).astype(jnp.float32))
            out.append((w, s.astype(quant.E8M0_DTYPE)))
        elif fmt == "fp8":
            w = jnp.clip(jax.random.normal(kw, (experts, o, i)) * 64, -448, 448).astype(
                quant.FP8_DTYPE)
            s = jnp.exp2(jax.random.randint(ks, (experts, -(-o // 128), -(-i // 128)), -14,
                                            -11).astype(jnp.float32))
            out.append((w, s.astype(quant.E8M0_DTYPE)))
        else:
            out.append(((jax.random.normal(kw, (experts, o, i)) * i ** -0.5).astype(
                jnp.bfloat16), None))
    return tuple(out)


def bytes_per_expert(weights) -> int:
    return sum(int(a.size) * a.dtype.itemsize // a.shape[0] for pair in weights
               for a in pair if a is not None)


def routing(key, tokens, experts, k, kind):
    """``(ids [T, k] int32, weights [T, k] f32)``: distinct experts per token."""
    ks, kw = jax.random.split(key)
    logits = jax.random.gumbel(ks, (tokens, experts))
    if kind == "skewed":
        logits = logits - jnp.log1p(jnp.arange(experts, dtype=jnp.float32))
    ids = jax.lax.top_k(logits, k)[1].astype(jnp.int32)
    w = jax.random.uniform(kw, (tokens, k), jnp.float32, 0.1, 1.0)
    return ids, w / jnp.sum(w, axis=1, keepdims=True)


def make_sets(key, tokens, shape, kind, n_sets):
    sets = []
    for s in range(n_sets):
        kx, kr = jax.random.split(jax.random.fold_in(key, s))
        x = jax.random.normal(kx, (tokens, shape["dim"]), jnp.float32).astype(jnp.bfloat16)
        sets.append((x, *routing(kr, tokens, shape["experts"], shape["k"], kind)))
    return sets


def calls_per_execution(tokens: int) -> int:
    return 8 if tokens <= 64 else (2 if tokens <= 512 else 1)


def compile_runner(impl, weights, sets):
    """Jitted R calls of the op (one per input set); returns (compiled, temp bytes)."""
    def run(weights, sets):
        return [moe_experts(x, i, w, *weights, swiglu_limit=SWIGLU_LIMIT,
                            quantized=weights[0][1] is not None, simulate=True,
                            implementation=impl) for x, i, w in sets]
    compiled = jax.jit(run).lower(weights, sets).compile()
    try:
        temp = compiled.memory_analysis().temp_size_in_bytes
    except Exception:                 # not every backend reports it
        temp = float("nan")
    return compiled, temp


def median_time(compiled, args, runs):
    """Median wall time of one execution (two warm-ups first, each run waited for)."""
    for _ in range(2):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def is_oom(err: Exception) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def device_peak_gib() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", float("nan")) / 2 ** 30


def bench_case(name, shape, weights, tokens, kind, args, on_gpu):
    reps = calls_per_execution(tokens)
    sets = make_sets(jax.random.key(1000 + tokens), tokens, shape, kind, reps)
    ids = np.asarray(jnp.stack([s[1] for s in sets]))
    touched = float(np.mean([len(np.unique(r)) for r in ids]))
    nbytes = touched * bytes_per_expert(weights)
    flops = 2 * tokens * shape["k"] * 3 * shape["dim"] * shape["inter"]
    row = dict(shape=name, weights=args.weights, T=tokens, routing=kind, touched=touched,
               reps=reps, nbytes=nbytes, flops=flops)
    decode = tokens * shape["k"] <= WARP_ROWS_PER_EXPERT * shape["experts"]
    algorithms = args.algorithms.split(",") if decode else ["wgmma"]
    runs = ([("cute", a) for a in algorithms] if on_gpu else []) + (
        [] if args.no_xla else [("xla", "")])
    row["by_algorithm"] = {}
    for impl, algorithm in runs:
        if impl == "xla" and tokens > args.xla_max_tokens:
            row[impl] = "skip"
            continue
        os.environ[ALGORITHM_ENV_VAR] = algorithm or "wgmma"     # read when traced
        try:
            compiled, temp = compile_runner(impl, weights, sets)
            seconds = median_time(compiled, (weights, sets), args.runs) / reps
            del compiled
        except Exception as err:      # XLA at large T: report, keep going
            if not is_oom(err):
                raise
            seconds, temp = "oom", float("nan")
        if impl == "cute":
            row["by_algorithm"][algorithm] = seconds
            best = min((v for v in row["by_algorithm"].values() if isinstance(v, float)),
                       default=seconds)
            if best == seconds:
                row["cute"], row["cute_temp_gib"] = seconds, temp / 2 ** 30
        else:
            row["xla"], row["xla_temp_gib"] = seconds, temp / 2 ** 30
        gc.collect()
    os.environ.pop(ALGORITHM_ENV_VAR, None)
    row["peak_gib"] = device_peak_gib()
    return row


def _fmt_time(v):
    return f"{v * 1e6:.1f}" if isinstance(v, float) else v


def table(rows) -> str:
    lines = ["| shape | weights | T | routing | experts touched | ours (us) | per algorithm (us) "
             "| XLA (us) | speedup | GB/s | % of 4.3 TB/s | TF/s | % of 790 "
             "| temp GiB ours / XLA | peak GiB |",
             "|" + "---|" * 15]
    for r in rows:
        ours = r.get("cute", "n/a")
        main = ours if isinstance(ours, float) else r.get("xla")
        timed = isinstance(main, float)
        gbps = r["nbytes"] / main / 1e9 if timed else float("nan")
        tfs = r["flops"] / main / 1e12 if timed else float("nan")
        speedup = (f"{r['xla'] / ours:.1f}x" if isinstance(ours, float)
                   and isinstance(r.get("xla"), float) else "")
        of = "" if isinstance(ours, float) or not timed else " (XLA)"   # rates of whose time
        by_algorithm = " / ".join(f"{a} {_fmt_time(v)}"
                                  for a, v in r.get("by_algorithm", {}).items())
        lines.append(
            f"| {r['shape']} | {r['weights']} | {r['T']} | {r['routing']} | {r['touched']:.1f} "
            f"| {_fmt_time(ours)} | {by_algorithm} | {_fmt_time(r.get('xla', 'n/a'))} "
            f"| {speedup} "
            f"| {gbps:.0f}{of} | {100 * gbps / (PEAK_TBPS * 1e3):.1f}% | {tfs:.1f}{of} "
            f"| {100 * tfs / PEAK_TFLOPS:.1f}% | {r.get('cute_temp_gib', float('nan')):.2f} / "
            f"{r.get('xla_temp_gib', float('nan')):.2f} | {r['peak_gib']:.1f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="flash,pro")
    p.add_argument("--tokens", default="1,8,64,512,4096,16384")
    p.add_argument("--routings", default="balanced,skewed")
    p.add_argument("--weights", default="fp4", choices=("fp4", "fp8", "bf16"))
    p.add_argument("--xla-max-tokens", type=int, default=4096,
                   help="skip the XLA reference above this many tokens")
    p.add_argument("--no-xla", action="store_true")
    p.add_argument("--runs", type=int, default=20, help="timed executions per case (>= 20)")
    p.add_argument("--algorithms", default="mma_fp8,mma_sync",
                   help="kernel algorithms timed for decode-size inputs (DSV4_MOE_ALGORITHM)")
    p.add_argument("--quick", action="store_true",
                   help="Flash only, T 1/64/4096, balanced routing, 20 runs")
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes (a dry run of this script on a CPU)")
    p.add_argument("--out", help="write the table (with date, device, command) to this file")
    a = p.parse_args(argv)
    if a.quick:
        a.shapes, a.tokens, a.routings = "flash", "1,64,4096", "balanced"
    if a.tiny:
        a.shapes = "tiny"
    return a


def main(argv=None):
    args = parse_args(argv)
    dev = jax.devices()[0]
    on_gpu = dev.platform == "gpu"
    header = (f"moe_experts benchmark, {datetime.date.today()}, {dev.device_kind}, "
              f"jax {jax.__version__}, `python {' '.join(sys.argv)}`")
    print("# " + header + ("" if on_gpu else "  (no GPU: XLA only)"), flush=True)
    rows = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        weights = expert_weights(jax.random.key(0), shape["experts"], shape["dim"],
                                 shape["inter"], args.weights)
        jax.block_until_ready(weights)
        for tokens in (int(t) for t in args.tokens.split(",")):
            for kind in args.routings.split(","):
                row = bench_case(name, shape, weights, tokens, kind, args, on_gpu)
                rows.append(row)
                print(f"{name} T={tokens} {kind}: ours {_fmt_time(row.get('cute', 'n/a'))} us,"
                      f" xla {_fmt_time(row.get('xla', 'n/a'))} us, "
                      f"{row['touched']:.0f} experts touched", flush=True)
        del weights
        gc.collect()
    text = table(rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"{header}\n\n{text}\n")


if __name__ == "__main__":
    main()
