"""Benchmark the routed-experts op (``ffi.moe_experts``): the CuTe kernel vs the XLA reference.

    python benchmarks/bench_moe.py [--shapes flash,pro] [--tokens 1,8,64,512,4096,16384]
                                   [--routings balanced,skewed] [--weights fp4|fp8|bf16]
                                   [--xla-max-tokens 4096] [--no-xla] [--runs 20]
                                   [--algorithms mma_fp8,mma_sync] [--prefill-algorithm wgmma]
                                   [--no-peer] [--peer-min-tokens 512] [--peer-align 16]
                                   [--peer-glue] [--peer-accum fast|precise]
                                   [--quick] [--tiny] [--out table.md]
    python benchmarks/bench_moe.py --shapes flash --tokens 512,4096,16384 --routings balanced
        (our op and the torch peer at the prefill sizes, in one run)

Shapes: ``dsv4_jax.ffi.cases.DIMS`` -- Flash and Pro from ``Config.flash()`` / ``Config.pro()``
(E=256 experts, d=4096, inter=2048, k=6; E=384, d=7168, inter=3072, k=6), ``tiny`` for a dry
run. Weights (FP4 + E8M0 1x32 by default, FP8 + E8M0 128x128 with ``--weights fp8``) and
inputs are generated on the device (``cases.expert_weights``). Routings
(``cases.routing``): ``balanced`` -- each token picks k distinct experts uniformly;
``skewed`` -- expert e is picked with probability ~ 1/(e+1) (a few hot experts hold most
rows, many get none).

Kernel algorithms for decode-size inputs (the warp kernels' range of ``choose_config``:
rows <= ``WARP_ROWS_PER_EXPERT`` E): each of ``--algorithms`` is timed as the
``GroupedGemmPolicy`` decode algorithm; "ours" is the fastest, the per-algorithm times are
listed. Larger inputs run the prefill tiles (``--prefill-algorithm``), so they are timed once.

Timing (``timing.py``): one jitted function runs R calls on R distinct input sets (own tokens
and routing, so consecutive calls touch different experts and nothing stays in the 60 MB
L2); the median over ``--runs`` executions (after two warm-up executions, each finished with
block_until_ready) divided by R is the time per call. XLA is timed the same way in the same
process; above ``--xla-max-tokens`` it is skipped, and an out-of-memory shows as ``oom``.

Figures (``cases.touched_groups``, ``bytes_per_group``, ``moe_flops``): bytes = the touched
experts' weights and scales (distinct experts of the routing x bytes per expert; the T x d
activations are not counted) -> GB/s and % of the HBM peak (``timing.PEAK_TBPS``); FLOPs =
2 T k 3 d inter (useful, no padding) -> TF/s and % of the dense BF16 peak
(``timing.PEAK_TFLOPS``; the FP8 peak is twice that). Memory: the executable's temporary bytes (``memory_analysis``) and the
device's peak bytes in use so far (monotone over the run).

The torch peer (``torch_peer.py``), in the same process and run, where torch with CUDA
imports (else one line ``torch peer skipped: <reason>``, and the run goes on; ``--no-peer``
leaves it out): PyTorch's FP8 grouped GEMM ``torch._scaled_grouped_mm`` on the routed
experts' two GEMMs, [T k, d] x [E, 2 inter, d] and [T k, inter] x [E, d, inter], rows already
sorted by expert, FP8 e4m3 operands with rowwise f32 scales, at every token count from
``--peer-min-tokens`` (default 512; 1: all). Its routing is that of our op's input sets (the
same R sets, expert counts -> cumulative int32 offsets), each expert's rows padded to a
multiple of ``--peer-align`` (``auto``: none where a probe in a child process finds that the
installed torch runs such groups right, else 16, which older torch asserts). Not timed: gathering,
quantising and scattering rows, the per-token sum (all inside our op's time); SwiGLU and the
FP8 quantisation between the GEMMs only with ``--peer-glue``. Timed with CUDA events as ours
is timed (two warm-up executions; the median over ``--runs`` executions of R back-to-back
calls on the R sets, divided by R). Columns: torch us, torch TF/s (the same useful FLOPs 2 T
k 3 d inter, padding not counted), peer ratio = ours / torch (above 1: ours is slower), the
share of padding rows in what torch executed. The peer's weights are FP8 whatever
``--weights`` says, and live in the device memory JAX leaves free (25 % by default).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import sys

import dsv4_jax  # noqa: F401  (first: XLA flags)
import jax
import numpy as np

from dsv4_jax.ffi import cases
from dsv4_jax.ffi.moe import moe_experts
from dsv4_jax.ffi.policy import GroupedGemmPolicy
from dsv4_jax.kernels.grouped_gemm_config import (DECODE_ALGORITHMS, PREFILL_ALGORITHMS,
                                                  WARP_ROWS_PER_EXPERT)
from timing import PEAK_TBPS, PEAK_TFLOPS, calls_on_sets, is_oom, median_seconds, rates
import torch_peer


def make_sets(key, tokens, dims, kind, n_sets):
    """``n_sets`` input sets ``(x, ids, weights)``, each its own tokens and routing."""
    sets = []
    for s in range(n_sets):
        kx, kr = jax.random.split(jax.random.fold_in(key, s))
        sets.append((cases.token_inputs(kx, tokens, dims.dim),
                     *cases.routing(kind, tokens, dims.experts, dims.k, kr)))
    return sets


def calls_per_execution(tokens: int) -> int:
    return 8 if tokens <= 64 else (2 if tokens <= 512 else 1)


def op_call(impl, policy):
    """One ``moe_experts`` call, weights first (``calls_on_sets``' shared arguments)."""
    def call(w1, w3, w2, x, i, w):
        return moe_experts(x, i, w, w1, w3, w2, swiglu_limit=cases.SWIGLU_LIMIT,
                           quantized=w1[1] is not None, simulate=True, implementation=impl,
                           policy=policy)
    return call


def device_peak_gib() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", float("nan")) / 2 ** 30


def bench_case(name, dims, weights, tokens, kind, args, on_gpu, peer=None):
    reps = calls_per_execution(tokens)
    sets = make_sets(jax.random.key(1000 + tokens), tokens, dims, kind, reps)
    touched = float(np.mean([cases.touched_groups(s[1]) for s in sets]))
    nbytes = touched * cases.bytes_per_group(*weights)
    row = dict(shape=name, weights=args.weights, T=tokens, routing=kind, touched=touched,
               reps=reps, nbytes=nbytes, flops=cases.moe_flops(tokens * dims.k, dims))
    decode = tokens * dims.k <= WARP_ROWS_PER_EXPERT * dims.experts
    algorithms = args.algorithms.split(",") if decode else [args.prefill_algorithm]
    runs = ([("cute", a) for a in algorithms] if on_gpu else []) + (
        [] if args.no_xla else [("xla", "")])
    row["by_algorithm"] = {}
    for impl, algorithm in runs:
        if impl == "xla" and tokens > args.xla_max_tokens:
            row[impl] = "skip"
            continue
        policy = GroupedGemmPolicy(prefill_algorithm=args.prefill_algorithm,
                                   **({"decode_algorithm": algorithm} if decode and algorithm
                                      else {}))
        try:
            compiled, temp = calls_on_sets(op_call(impl, policy), weights, sets)
            seconds = median_seconds(compiled, weights, sets, runs=args.runs) / reps
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
    if peer is not None and tokens >= args.peer_min_tokens:
        counts = [torch_peer.expert_counts(s[1], dims.experts) for s in sets]
        got = torch_peer.time_peer(peer, counts, args.runs)
        row["torch"], row["torch_rows"], row["torch_real_rows"] = (
            got["seconds"], got["rows"], got["real_rows"])
    row["peak_gib"] = device_peak_gib()
    return row


def peer_skipped(args) -> str | None:
    """Why the torch peer is left out of this run (None: it runs): ``--no-peer``, no token
    count reaches ``--peer-min-tokens``, or torch cannot run it (``torch_peer.unavailable``:
    not installed, no CUDA device, ...)."""
    if args.no_peer:
        return "--no-peer"
    if max(int(t) for t in args.tokens.split(",")) < args.peer_min_tokens:
        return f"no token count >= --peer-min-tokens {args.peer_min_tokens}"
    return torch_peer.unavailable()


def peer_align(args) -> tuple[int, str | None]:
    """The peer's rows per group: ``--peer-align``, or with ``auto`` 1 where
    ``torch_peer.probe_unpadded`` succeeds, else ``torch_peer.ALIGN``; and the probe's note."""
    if args.peer_align != "auto":
        return int(args.peer_align), None
    ok, line = torch_peer.probe_unpadded()
    return (1 if ok else torch_peer.ALIGN), (
        f"torch peer: {'unpadded groups' if ok else 'groups padded to 16'} (probe: {line})")


def start_peer(args, name, dims, align):
    """``(PeerRunner or None, the note to print)`` of one shape: its FP8 weights on the
    device, or None where they do not fit next to ours."""
    try:
        peer = torch_peer.PeerRunner(dims, align=align, glue=args.peer_glue,
                                     swiglu_limit=cases.SWIGLU_LIMIT,
                                     fast_accum=args.peer_accum == "fast")
        return peer, f"torch peer ({name}): {torch_peer.describe(peer)}"
    except Exception as err:
        if not torch_peer.is_oom(err):
            raise
        gc.collect()
        torch_peer.empty_cache()
        return None, f"torch peer skipped ({name}): out of memory ({str(err).splitlines()[0]})"


def _fmt_time(v):
    return f"{v * 1e6:.1f}" if isinstance(v, float) else v


def table(rows) -> str:
    lines = ["| shape | weights | T | routing | experts touched | ours (us) | per algorithm (us) "
             f"| XLA (us) | speedup | GB/s | % of {PEAK_TBPS} TB/s | TF/s | % of {PEAK_TFLOPS:.0f} "
             "| temp GiB ours / XLA | peak GiB | torch (us) | torch TF/s "
             "| peer ratio (ours / torch) | torch padding rows |",
             "|" + "---|" * 19]
    for r in rows:
        ours = r.get("cute", "n/a")
        main = ours if isinstance(ours, float) else r.get("xla")
        timed = isinstance(main, float)
        rate = (rates(r["nbytes"], r["flops"], main) if timed else
                dict.fromkeys(("gbps", "bw_frac", "tflops", "flops_frac"), float("nan")))
        speedup = (f"{r['xla'] / ours:.1f}x" if isinstance(ours, float)
                   and isinstance(r.get("xla"), float) else "")
        of = "" if isinstance(ours, float) or not timed else " (XLA)"   # rates of whose time
        by_algorithm = " / ".join(f"{a} {_fmt_time(v)}"
                                  for a, v in r.get("by_algorithm", {}).items())
        lines.append(
            f"| {r['shape']} | {r['weights']} | {r['T']} | {r['routing']} | {r['touched']:.1f} "
            f"| {_fmt_time(ours)} | {by_algorithm} | {_fmt_time(r.get('xla', 'n/a'))} "
            f"| {speedup} "
            f"| {rate['gbps']:.0f}{of} | {100 * rate['bw_frac']:.1f}% | {rate['tflops']:.1f}{of} "
            f"| {100 * rate['flops_frac']:.1f}% | {r.get('cute_temp_gib', float('nan')):.2f} / "
            f"{r.get('xla_temp_gib', float('nan')):.2f} | {r['peak_gib']:.1f} | "
            + peer_cells(r, ours) + " |")
    return "\n".join(lines)


def peer_cells(r, ours) -> str:
    """The torch peer's cells of a row: time, useful TF/s, ours / torch, padding rows (of
    the executed rows); blank where the peer did not run."""
    torch_s = r.get("torch")
    if torch_s is None:
        return " |  |  | "
    if not isinstance(torch_s, float):
        return f"{torch_s} |  |  | "
    tflops = r["flops"] / torch_s / 1e12
    ratio = f"{ours / torch_s:.2f}" if isinstance(ours, float) else ""
    pad = r["torch_rows"] - r["torch_real_rows"]
    return (f"{_fmt_time(torch_s)} | {tflops:.1f} | {ratio} | "
            f"{100 * pad / max(r['torch_rows'], 1):.1f}%")


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
                   help=f"decode algorithms timed for decode-size inputs, of "
                        f"{DECODE_ALGORITHMS}")
    p.add_argument("--prefill-algorithm", default="wgmma", choices=PREFILL_ALGORITHMS,
                   help="the kernel of prefill-size inputs")
    p.add_argument("--quick", action="store_true",
                   help="Flash only, T 1/64/4096, balanced routing, 20 runs")
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes, T 1/8/64/512, 3 runs (a dry run of this script on "
                        "a CPU: XLA only)")
    p.add_argument("--no-peer", action="store_true",
                   help="leave out the torch peer (torch._scaled_grouped_mm)")
    p.add_argument("--peer-min-tokens", type=int, default=512,
                   help="time the torch peer at token counts from this one (1: every count)")
    p.add_argument("--peer-align", default="auto",
                   help="pad each expert's rows of the peer to a multiple of this; auto: 1 "
                        "where a probe finds torch runs unpadded groups, else 16")
    p.add_argument("--peer-glue", action="store_true",
                   help="the peer also runs SwiGLU + the FP8 quantisation between its GEMMs "
                        "(torch ops, timed)")
    p.add_argument("--peer-accum", default="fast", choices=("fast", "precise"),
                   help="the peer's FP8 accumulation (use_fast_accum)")
    p.add_argument("--out", help="write the table (with date, device, command) to this file")
    a = p.parse_args(argv)
    if a.peer_align != "auto" and not (a.peer_align.isdigit() and int(a.peer_align) > 0):
        p.error(f"--peer-align: auto or a positive integer, got {a.peer_align!r}")
    if a.quick:
        a.shapes, a.tokens, a.routings = "flash", "1,64,4096", "balanced"
    if a.tiny:
        a.shapes, a.tokens, a.runs = "tiny", "1,8,64,512", min(a.runs, 3)
    for algorithm in a.algorithms.split(","):
        if algorithm not in DECODE_ALGORITHMS:
            p.error(f"--algorithms: {algorithm!r} is not one of {DECODE_ALGORITHMS}")
    return a


def main(argv=None):
    args = parse_args(argv)
    dev = jax.devices()[0]
    on_gpu = dev.platform == "gpu"
    header = (f"moe_experts benchmark, {datetime.date.today()}, {dev.device_kind}, "
              f"jax {jax.__version__}, `python {' '.join(sys.argv)}`")
    print("# " + header + ("" if on_gpu else "  (no GPU: XLA only)"), flush=True)
    rows, peer_lines = [], []
    skipped = peer_skipped(args)
    if skipped is not None:
        peer_lines.append(f"torch peer skipped: {skipped}")
    else:
        align, note = peer_align(args)
        peer_lines += [note] if note else []
    for line in peer_lines:
        print(line, flush=True)
    for name in args.shapes.split(","):
        dims = cases.DIMS[name]
        p = cases.expert_weights(dims, args.weights)
        weights = jax.block_until_ready((p["w1"], p["w3"], p["w2"]))
        del p
        peer = None
        if skipped is None:                         # after ours: JAX has its memory first
            peer, line = start_peer(args, name, dims, align)
            peer_lines.append(line)
            print(line, flush=True)
        for tokens in (int(t) for t in args.tokens.split(",")):
            for kind in args.routings.split(","):
                row = bench_case(name, dims, weights, tokens, kind, args, on_gpu, peer)
                rows.append(row)
                print(f"{name} T={tokens} {kind}: ours {_fmt_time(row.get('cute', 'n/a'))} us,"
                      f" xla {_fmt_time(row.get('xla', 'n/a'))} us"
                      + (f", torch {_fmt_time(row['torch'])} us" if "torch" in row else "")
                      + f", {row['touched']:.0f} experts touched", flush=True)
        if peer is not None:
            peer.release()
        del weights, peer
        gc.collect()
    text = table(rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"{header}\n\n" + "".join(f"{line}\n" for line in peer_lines)
                    + f"\n{text}\n")


if __name__ == "__main__":
    main()
