"""Benchmark the stream mixes of one sub-block's mHC pre at prefill sizes
(``dsv4_jax.ffi.hc_stream_mixes``): the kernel against XLA's dot (the reference's
BF16_BF16_F32_X6 algorithm), device time and launches per call.

    python benchmarks/bench_hc_mixes.py [--dims flash,pro] [--tokens 512,4096,16384]
                                        [--configs 2x8,4x8] [--runs 50] [--markdown out.md]
    python benchmarks/bench_hc_mixes.py --tiny          # dry run (CPU: the reference only)

``--configs`` TxS: the kernel at T tiles per warp and S K slices, a column each.
Device: the sum of the device ops of one traced call (``step_figures.trace_device_ops``)
and their count (the kernel's launch and the fusion that adds its slices); wall:
``timing.median_seconds``. Floor: the streams and fn read once and the mixes written, at
``PEAK_TBPS``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4_jax.config import Config
from dsv4_jax.ffi import hc_stream_mixes
from dsv4_jax.ffi.hc_mixes_sm90 import hc_stream_mixes_cute
from dsv4_jax.kernels.hc_mixes_config import HcMixesSm90Config
import op_columns
from timing import PEAK_TBPS, emit_table

DIMS = {"flash": Config.flash, "pro": Config.pro}


def make_inputs(tokens, n, dim, seed=0):
    kx, kf = jax.random.split(jax.random.key(seed))
    mixes = (2 + n) * n
    x = jax.random.normal(kx, (tokens, n, dim), jnp.float32).astype(jnp.bfloat16)
    fn = jax.random.normal(kf, (mixes, n * dim), jnp.float32) * (n * dim) ** -0.5
    return jax.block_until_ready((x, fn))


def floor_us(tokens, n, dim):
    mixes = (2 + n) * n
    nbytes = tokens * n * dim * 2 + mixes * n * dim * 4 + tokens * mixes * 4
    return nbytes / (PEAK_TBPS * 1e12) * 1e6


def op_fn(impl, eps):
    """The jitted op for ``impl``: "xla", "cute" or a kernel config "TxS"."""
    if impl not in ("xla", "cute"):
        tiles, slices = (int(v) for v in impl.split("x"))
        config = HcMixesSm90Config(tiles, slices)
        return jax.jit(lambda x, fn: hc_stream_mixes_cute(x, fn, norm_eps=eps, config=config))
    return jax.jit(lambda x, fn: hc_stream_mixes(x, fn, norm_eps=eps, implementation=impl))


def main(argv=None):
    args = op_columns.parser(__doc__, "512,4096,16384").parse_args(argv)
    impls = op_columns.columns(args)
    lines = op_columns.table_head("bench_hc_mixes", ["dims", "tokens"], impls)
    for name in args.dims.split(","):
        cfg = Config.tiny() if args.tiny else DIMS[name]()
        for tokens in (int(t) for t in args.tokens.split(",")):
            inputs = make_inputs(tokens, cfg.hc_mult, cfg.dim)
            cells = [op_columns.cell(lambda: op_fn(impl, cfg.norm_eps), inputs, args.runs)
                     for impl in impls]
            lines.append(f"| {name} | {tokens} | " + " | ".join(cells)
                         + f" | {floor_us(tokens, cfg.hc_mult, cfg.dim):.2f} |")
            print(lines[-1], flush=True)
    emit_table(lines, args.markdown)


if __name__ == "__main__":
    main()
