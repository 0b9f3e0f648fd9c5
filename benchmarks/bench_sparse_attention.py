"""Benchmark sparse_attention on the DSV4 decode shapes: the CuTe kernel vs the XLA reference.

    python benchmarks/bench_sparse_attention.py [--tokens 1,8,64,128] [--shapes pro,flash]
                                                [--config 64x2,64x2s] [--ablations [CONFIGS]]
                                                [--no-xla] [--markdown out.md]

Shapes: Pro = 128 heads, 128 window + 1024 compressed entries; Flash = 64 heads, 128 + 512;
hca1m = Flash heads, 128 + 8192 (an HCA layer at 1M context attends every entry).
``--pools bf16,fp8``: the compressed entries as BF16 rows and/or as 584-byte FP8 rows
(``Cache.init(kv_dtype="fp8")``), timed side by side. ``--rope``: each config also with the
query preparation inside the kernel (``rope=(cos, sin)``, ``q_norm_eps``: the heads'
RMSNorm, the RoPE and the output's inverse RoPE; ``KernelPolicy(attention_rope=True)``),
its rows labelled ``/rope``, the kernel without it timed next to it.
Each token reads its own entries (distinct rows, as in batched decode), so the unique entry
bytes are T * (K + K2) KB. Timing: one jitted function runs R calls back to back, each on its
own random data (generated on the device; identical calls would be merged by XLA), so that
one execution streams well past the L2; executions are issued back to back (dispatch
overlaps the previous execution) and the median over groups of the mean time per execution,
divided by R, is reported. The XLA reference is timed the same way in the same process.

Roofline (H200, ``timing.PEAK_TFLOPS`` bf16 dense, ``timing.PEAK_TBPS`` HBM). FLOPs = 4 T H (K + K2) 512; effective
bytes = unique entry bytes + Q + O + lse.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys

import jax
import jax.numpy as jnp

from dsv4_jax import kv_entry
from dsv4_jax.ffi.rope import rope_table
from dsv4_jax.ffi.sparse_attention import sparse_attention_cute, sparse_attention_reference
from dsv4_jax.kernels.sparse_attention_config import ABLATIONS, SparseAttentionSm90Config
from timing import PEAK_TBPS, PEAK_TFLOPS, back_to_back_seconds

SCALE = 512 ** -0.5
SHAPES = {"pro": dict(heads=128, window=128, extra=1024),
          "flash": dict(heads=64, window=128, extra=512),
          "hca1m": dict(heads=64, window=128, extra=8192)}


def make_sets(key, t, heads, window, extra, n_sets):
    """``n_sets`` distinct input sets, generated on the device; every token of every set
    gathers its own pool rows (its window ring and a top-k of its own compressed cache)."""
    keys = jax.random.split(key, 3 + 3 * n_sets)
    kv = jax.random.normal(keys[0], (n_sets * t * window, 512), jnp.bfloat16)
    extra_kv = jax.random.normal(keys[1], (n_sets * t * extra, 512), jnp.bfloat16)
    sink = jax.random.normal(keys[2], (heads,), jnp.float32)
    sets = []
    for s in range(n_sets):
        kq, kw, kx = keys[3 + 3 * s: 6 + 3 * s]
        q = jax.random.normal(kq, (t, heads, 512), jnp.bfloat16)
        rows = (s * t + jnp.arange(t, dtype=jnp.int32))[:, None]
        perm_w = jnp.argsort(jax.random.uniform(kw, (t, window)), axis=1).astype(jnp.int32)
        perm_x = jnp.argsort(jax.random.uniform(kx, (t, extra)), axis=1).astype(jnp.int32)
        sets.append((q, rows * window + perm_w, rows * extra + perm_x))
    return kv, extra_kv, sink, sets


def parse_config(text):
    """'64x2' -> (text, SparseAttentionSm90Config(64, 2)): QK^T split as the op chooses (when
    unsplit); a suffix forces it: '64x2s' splits QK^T, '64x2d' duplicates it."""
    qk_split = {"s": True, "d": False}.get(text[-1])
    block_n, stages = (int(x) for x in text.rstrip("sd").split("x"))
    return text, SparseAttentionSm90Config(block_n, stages, qk_split)


def timed(fn, args, groups=7, per_group=10):
    """Median over groups of the mean time of back-to-back executions (dispatch overlaps)."""
    return back_to_back_seconds(fn, *args, groups=groups, per_group=per_group)


def bench_one(name, t, ablations, seed, config=SparseAttentionSm90Config(), xla=True,
              fp8=False, rope=False):
    cfg = SHAPES[name]
    h, k, k2 = cfg["heads"], cfg["window"], cfg["extra"]
    entry = kv_entry.entry_bytes(512, 64) if fp8 else 1024
    per_call = t * (k * 1024 + k2 * entry)
    # Distinct data in every call (identical calls would be CSE'd), enough of them that one
    # execution streams well past the 60 MB L2 and amortises its dispatch.
    reps = 64 if t <= 8 else (16 if t <= 64 else 8)
    kv, extra_kv, sink, sets = make_sets(jax.random.key(seed), t, h, k, k2, reps)
    if fp8:
        extra_kv = kv_entry.encode(extra_kv, 64)
    # The query preparation's cos/sin table: the tokens at positions 4096 + i, the angles of
    # 64 RoPE channels at base 10000 (any angles cost the kernel the same).
    prep = {}
    if rope:
        inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, 64, 2, dtype=jnp.float32) / 64))
        prep = dict(rope=rope_table(4096 + jnp.arange(t, dtype=jnp.int32), inv_freq),
                    q_norm_eps=1e-6)

    def runner(impl, n, ablation=""):
        def run(kv, extra_kv, sink, sets):
            outs = []
            for q, idx, xidx in sets[:n]:
                if impl == "xla":
                    outs.append(sparse_attention_reference(
                        q, kv, idx, sink, extra_kv=extra_kv, extra_idx=xidx, scale=SCALE))
                else:
                    outs.append(sparse_attention_cute(
                        q, kv, idx, sink, extra_kv=extra_kv, extra_idx=xidx, scale=SCALE,
                        config=dataclasses.replace(config, ablation=ablation), **prep))
            return outs
        return jax.jit(run)

    args = (kv, extra_kv, sink, sets)
    ours = timed(runner("cute", reps), args) / reps
    xla_reps = min(reps, 8)
    xla = (timed(runner("xla", xla_reps), args, groups=5, per_group=4) / xla_reps
           if xla else float("nan"))
    flops = 4 * t * h * (k + k2) * 512
    nbytes = per_call + 2 * t * h * 512 * 2 + t * h * 4
    row = dict(shape=name, T=t, H=h, K=k, K2=k2, us=ours * 1e6, xla_us=xla * 1e6,
               speedup=xla / ours, tflops=flops / ours / 1e12, gbps=nbytes / ours / 1e9,
               roofline=max(flops / (PEAK_TFLOPS * 1e12), nbytes / (PEAK_TBPS * 1e12)) / ours,
               reps=reps)
    abl = {a: timed(runner("cute", reps, a), args) / reps * 1e6 for a in ablations}
    return row, abl


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="pro,flash")
    p.add_argument("--tokens", default="1,8,64,128")
    p.add_argument("--ablations", nargs="?", const="all", default="",
                   help="also time variants that leave one stage out (Pro T=64, Flash T=128), "
                        "for every config or the comma-separated ones named")
    p.add_argument("--config", default="64x2",
                   help="kernel configs, comma-separated: entries per stage x stages, suffix "
                        "'s' to split QK^T between the math warpgroups, 'd' to duplicate it "
                        "(64x2 = the op's choice, 64x2s, 64x2d, 48x3); the XLA reference is "
                        "timed with the first only")
    p.add_argument("--no-xla", action="store_true", help="skip timing the XLA reference")
    p.add_argument("--pools", default="bf16", help="bf16 and/or fp8 compressed entries")
    p.add_argument("--rope", action="store_true",
                   help="each config also with the query preparation in the kernel")
    p.add_argument("--markdown", help="append the table to this file")
    a = p.parse_args(argv)
    configs = [parse_config(c) for c in a.config.split(",")]
    dev = jax.devices()[0]
    print(f"# sparse_attention benchmark, {datetime.date.today()}, {dev.device_kind}, "
          f"jax {jax.__version__}, kernel config {a.config}", flush=True)
    rows, ablation_rows = [], []
    # Configs innermost: their rows for one shape are timed next to each other.
    preps = (False, True) if a.rope else (False,)
    for name, t, (cname, config), pool, rope in [
            (n, int(t), c, pool, r) for n in a.shapes.split(",") for t in a.tokens.split(",")
            for c in configs for pool in a.pools.split(",") for r in preps]:
        want = ((a.ablations == "all" or cname in a.ablations.split(","))
                and (name, t) in (("pro", 64), ("flash", 128)) and not rope)
        abl_names = [x for x in ABLATIONS if x] if want else []
        xla = not a.no_xla and config == configs[0][1] and not rope
        row, abl = bench_one(name, t, abl_names, seed=t, config=config, xla=xla,
                             fp8=pool == "fp8", rope=rope)
        cname = cname if pool == "bf16" else f"{cname}/{pool}"
        cname = f"{cname}/rope" if rope else cname
        row["config"] = cname
        rows.append(row)
        print(f"{cname:5s} {name:5s} T={t:4d}: {row['us']:8.1f} us  xla {row['xla_us']:8.1f} us  "
              f"x{row['speedup']:5.1f}  {row['tflops']:6.1f} TF/s  {row['gbps']:7.1f} GB/s  "
              f"{100 * row['roofline']:5.1f}% roofline  ({row['reps']} distinct calls per "
              f"execution)", flush=True)
        if abl:
            ablation_rows.append((f"{cname} {name}", t, row["us"], abl))
            print("   leaving out: " + ", ".join(f"{k} {v:.1f} us" for k, v in abl.items()),
                  flush=True)
    lines = ["| config | shape | T | H | K+K2 | ours (us) | XLA (us) | speedup | TF/s "
             "| eff. GB/s | % roofline |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['shape']} | {r['T']} | {r['H']} | "
                     f"{r['K']}+{r['K2']} | {r['us']:.1f} | {r['xla_us']:.1f} | "
                     f"{r['speedup']:.1f}x | {r['tflops']:.1f} | {r['gbps']:.0f} | "
                     f"{100 * r['roofline']:.1f}% |")
    if ablation_rows:
        lines += ["", "| shape | T | full (us) | " + " | ".join(
            ablation_rows[0][3]) + " |", "|---" * (3 + len(ablation_rows[0][3])) + "|"]
        for name, t, full, abl in ablation_rows:
            lines.append(f"| {name} | {t} | {full:.1f} | " + " | ".join(
                f"{v:.1f}" for v in abl.values()) + " |")
    table = "\n".join(lines)
    print(table)
    if a.markdown:
        with open(a.markdown, "a") as f:
            f.write(f"\n{dev.device_kind}, jax {jax.__version__}, "
                    f"`python {' '.join(sys.argv)}`\n\n{table}\n")


if __name__ == "__main__":
    main()
