"""Benchmark the lightning indexer's top-k (``dsv4_jax.ffi.index_topk``) at the long-context
shapes of a DSV4-Flash CSA layer: its implementations side by side, and its parts.

    python benchmarks/bench_indexer.py [--cases prefill,decode] [--impls xla,cute]
                                       [--parts] [--ops N] [--visible V] [--markdown out.md]
    python benchmarks/bench_indexer.py --tiny        # dry run (CPU)

Cases (64 heads of width 128, top-512, every entry visible to every query):
* prefill: one 4096-token chunk (batch 1) against N = 8192 / 32768 compressed entries
  (prefixes of 32k / 128k tokens at ratio 4);
* decode: one token per row, batch 1 and 8, N = 1024 / 65536 / 262144 (contexts of 4k,
  256k, 1M tokens).
Inputs are generated on the device on the FP4 grid the model feeds the op (small multiples of
1/2: many exact ties, as in the model). Timing: wall, ``timing.median_seconds`` (each call
waited for, warm-up excluded: includes the host's launch and wait, ~0.1 ms); device, the sum
of the device ops of one traced call (``step_figures.trace_device_ops``); the table gives the
floors of the same row: FLOPs = 2 B S H N D at
``PEAK_TFLOPS`` (bf16) and bytes = the keys, queries and weights read once at ``PEAK_TBPS``.

``--impls``: the op's ``xla`` and ``cute``, and ``cute+xla-topk`` / ``cute+split-topk``
(the kernel's scores merged by XLA's top-k in parts / by the split top-k kernels whatever the
row count), ``cute@TxS`` (the op's kernels with the score kernel's ``IndexScoresSm90Config``
of T queries per math warpgroup and S key stages, e.g. ``cute@1x4``; ``cute@2x3s``: with
``skip_invisible``; ``cute@1x2sn``: and ``split_n``); a ``:fp4`` suffix (``cute:fp4``,
``xla:fp4``) gives the op the keys as MXFP4 rows (``kv_entry.encode_index_keys``: the
``kv_dtype="fp8+fp4"`` cache's). ``--visible V``: each row sees only its first V entries (a
short context in a long table; default: all). ``--ops N`` lists each call's N longest device ops.

``--parts`` also times the pieces the XLA reference is made of, one at a time: the bf16 score
einsum with its relu-weighted head sum for one block of ``choose_block`` entries, and
``lax.top_k`` over ``[rows, width]`` bf16 scores at the widths the reference and a
block-free scorer would merge.
"""
from __future__ import annotations

import argparse
import datetime
import sys

import jax
import jax.numpy as jnp

from dsv4_jax import kv_entry
from dsv4_jax.ffi import index_topk, indexer_sm90
from dsv4_jax.ffi.indexer_reference import choose_block, select_reference
from dsv4_jax.kernels.index_scores_config import IndexScoresSm90Config
from step_figures import trace_device_ops
from timing import PEAK_TBPS, PEAK_TFLOPS, emit_table, is_oom, median_seconds

HEADS, DIM, TOPK = 64, 128, 512
CASES = {
    "prefill": [(1, 4096, 8192), (1, 4096, 32768)],
    "decode": [(1, 1, 1024), (8, 1, 1024), (1, 1, 65536), (8, 1, 65536),
               (1, 1, 262144), (8, 1, 262144)],
}
TINY_CASES = {"prefill": [(1, 64, 512)], "decode": [(2, 1, 1024)]}


def make_inputs(b, s, n, heads=HEADS, dim=DIM, seed=0, visible=None):
    """FP4-grid queries and keys (multiples of 1/2 in [-3, 3]), bf16 head weights, the first
    ``visible`` entries visible (None: all)."""
    kq, kk, kw = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.randint(kq, (b, s, heads, dim), -6, 7).astype(jnp.bfloat16) * 0.5
    keys = jax.random.randint(kk, (b, n, dim), -6, 7).astype(jnp.bfloat16) * 0.5
    weights = (jax.random.normal(kw, (b, s, heads), jnp.float32) * 0.1).astype(jnp.bfloat16)
    visible = jnp.full((b, s), n if visible is None else min(visible, n), jnp.int32)
    return jax.block_until_ready((q, weights, keys, visible))


def floors_us(b, s, n, heads=HEADS, dim=DIM):
    """(FLOP floor, byte floor with bf16 keys, byte floor with MXFP4 key rows), us."""
    flops = 2.0 * b * s * heads * n * dim
    others = 2.0 * b * s * heads * (dim + 1)
    key_bytes = (2.0 * dim, float(kv_entry.index_key_bytes(dim)))
    return (flops / (PEAK_TFLOPS * 1e12) * 1e6,
            *((b * n * k + others) / (PEAK_TBPS * 1e12) * 1e6 for k in key_bytes))


# Implementations besides the op's own ("xla", "cute"): the kernel's scores with another merge.
MERGES = {"cute+xla-topk": select_reference,
          "cute+split-topk": indexer_sm90.select_split_cute}


def time_op(args, impl, runs):
    """(wall us of one call, each waited for; device us of one traced call: the sum of its
    device ops, without the host's launch and wait; that call's us and calls per op).
    ``impl:fp4``: the keys as MXFP4 rows (``kv_entry``, the ``kv_dtype="fp8+fp4"`` cache's)."""
    if impl.endswith(":fp4"):
        q, weights, keys, visible = args
        args = jax.block_until_ready((q, weights, kv_entry.encode_index_keys(keys), visible))
        impl = impl[:-len(":fp4")]
    if impl in MERGES or impl.startswith("cute@"):
        select, config = MERGES.get(impl), None
        if impl.startswith("cute@"):   # cute@TxS[s][n]: tokens per warpgroup x stages,
            spec = impl[5:]            # skip invisible blocks, split each block's N
            tokens, stages = (int(x) for x in spec.rstrip("sn").split("x"))
            flags = spec[len(spec.rstrip("sn")):]
            config = IndexScoresSm90Config(tokens_per_warpgroup=tokens, num_stages=stages,
                                           skip_invisible="s" in flags, split_n="n" in flags)
        fn = jax.jit(lambda q, w, kt, v: indexer_sm90.index_topk_cute(
            q, w, kt, v, TOPK, select=select, config=config))
    else:
        fn = jax.jit(lambda q, w, kt, v: index_topk(q, w, kt, v, TOPK, implementation=impl))
    wall = median_seconds(fn, *args, runs=runs) * 1e6
    totals, counts = trace_device_ops(lambda: jax.block_until_ready(fn(*args)))
    return wall, sum(totals.values()), totals, counts


def time_parts(b, s, n, args, runs):
    """The reference's pieces: one block's scores with the head sum, and top-k merges."""
    q, weights, keys, _ = args
    width = choose_block(b, s, HEADS, n)

    def block_scores(q, w, kt):
        score = jnp.einsum("bshd,btd->bsht", q, kt, preferred_element_type=jnp.float32)
        prod = jax.nn.relu(score.astype(q.dtype)).astype(jnp.float32) * w[..., None]
        return jnp.sum(prod.astype(q.dtype).astype(jnp.float32), axis=2).astype(q.dtype)

    rows = [("scores of one block", width,
             median_seconds(jax.jit(block_scores), q, weights, keys[:, :width], runs=runs))]
    for w in sorted({min(n, TOPK + width), n}):
        scores = jax.random.normal(jax.random.key(1), (b, s, w), jnp.float32).astype(jnp.bfloat16)
        top = jax.jit(lambda x: jax.lax.top_k(x, min(TOPK, x.shape[-1]))[1])
        rows.append((f"lax.top_k over {w}", w, median_seconds(top, scores, runs=runs)))
    blocks = -(-n // width)
    return width, blocks, [(name, w, t * 1e6) for name, w, t in rows]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="prefill,decode")
    p.add_argument("--impls", default="xla")
    p.add_argument("--parts", action="store_true")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--visible", type=int, default=None,
                   help="entries each row sees (default: all)")
    p.add_argument("--ops", type=int, default=0, help="list each call's N longest device ops")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--markdown")
    args = p.parse_args(argv)
    cases = TINY_CASES if args.tiny else CASES
    impls = args.impls.split(",")
    lines = [f"bench_indexer {datetime.date.today()} {jax.devices()[0].device_kind}: "
             f"{' '.join(sys.argv[1:])}", "",
             "| case | B | S | N | " + " | ".join(f"{i}: wall / device (us)" for i in impls)
             + " | FLOP floor (us) | byte floor (us) | byte floor, FP4 keys (us) |",
             "|---|---|---|---|" + "---|" * (len(impls) + 3)]
    part_lines, op_lines = [], []
    for case in args.cases.split(","):
        for b, s, n in cases[case]:
            inputs = make_inputs(b, s, n, visible=args.visible)
            cells = []
            for impl in impls:
                try:
                    wall, device, totals, counts = time_op(inputs, impl, args.runs)
                    cells.append(f"{wall:.1f} / {device:.1f}")
                    for op, us in totals.most_common(args.ops):
                        op_lines.append(f"| {case} B={b} S={s} N={n} | {impl} | {op[:60]} | "
                                        f"{us:.1f} | {counts[op]} |")
                except Exception as err:  # noqa: BLE001 -- a row's failure is reported in it
                    cells.append("OOM" if is_oom(err) else f"error: {type(err).__name__}")
            flop_us, byte_us, fp4_us = floors_us(b, s, n)
            lines.append(f"| {case} | {b} | {s} | {n} | " + " | ".join(cells)
                         + f" | {flop_us:.1f} | {byte_us:.1f} | {fp4_us:.1f} |")
            print(lines[-1], flush=True)
            if args.parts:
                width, blocks, rows = time_parts(b, s, n, inputs, args.runs)
                for name, w, t in rows:
                    part_lines.append(f"| {case} B={b} S={s} N={n} (blocks of {width}: "
                                      f"{blocks}) | {name} | {t:.1f} |")
                    print(part_lines[-1], flush=True)
    if op_lines:
        lines += ["", "| case | impl | device op | us | calls |", "|---|---|---|---|---|"] + op_lines
    if part_lines:
        lines += ["", "| case | part | us |", "|---|---|---|"] + part_lines
    emit_table(lines, args.markdown)


if __name__ == "__main__":
    main()
