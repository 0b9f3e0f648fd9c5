"""Benchmark the mHC pre of one sub-block (``dsv4_jax.ffi.hc_pre``: stream mixes, split,
collapse, RMSNorm) at DSV4 dims: the fused kernel against the XLA chain it replaces (with the
split kernel inside), device time and launches per call.

    python benchmarks/bench_hc_pre.py [--dims flash,pro] [--tokens 1,8,64,256] [--runs 50]
                                      [--markdown out.md]
    python benchmarks/bench_hc_pre.py --tiny        # dry run (CPU: the chain only)
    python benchmarks/bench_hc_pre.py --configs 4x4,8x4,16x4   # the kernel at these
                                     # cluster x tokens-per-cluster configs (a column each;
                                     # "16x2/apart": the split a launch of its own)
    python benchmarks/bench_hc_pre.py --pending ffn --iters 20,1   # with the previous
                                     # sub-block's hc_post (its out an FfnSum of the model's
                                     # k rows; "out": one row), at these Sinkhorn iterations

Device: the sum of the device ops of one traced call (``step_figures.trace_device_ops``)
and their count; wall: ``timing.median_seconds`` (each call waited for, warm-up excluded).
Floor: the bytes read once (x, the f32 mixing weights, the norm weight) and written, at
``PEAK_TBPS``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4_jax.config import Config
from dsv4_jax.ffi import hc_pre
from dsv4_jax.ffi.ffn_sum import FfnSum
from dsv4_jax.ffi.hc_pre_sm90 import hc_pre_cute
from dsv4_jax.kernels.hc_pre_config import HcPreSm90Config
import op_columns
from timing import PEAK_TBPS, emit_table

DIMS = {"flash": Config.flash, "pro": Config.pro}


def make_inputs(tokens, n, dim, seed=0):
    kx, kf, kb = jax.random.split(jax.random.key(seed), 3)
    mixes = (2 + n) * n
    x = jax.random.normal(kx, (tokens, n, dim), jnp.float32).astype(jnp.bfloat16)
    fn = jax.random.normal(kf, (mixes, n * dim), jnp.float32) * (n * dim) ** -0.5
    base = jax.random.normal(kb, (mixes,), jnp.float32) * 0.5
    return jax.block_until_ready((x, fn, jnp.ones((3,), jnp.float32), base,
                                  jnp.ones((dim,), jnp.bfloat16)))


def make_pending(kind, tokens, n, dim, k, seed=1):
    """The previous sub-block's ``(out, post, comb)``: ``"out"`` one bf16 row per token,
    ``"ffn"`` an ``FfnSum`` of k routed rows (in order, all valid) and the shared row."""
    ko, kp, kc, kr = jax.random.split(jax.random.key(seed), 4)
    out = jax.random.normal(ko, (tokens, dim), jnp.float32).astype(jnp.bfloat16)
    post = 2 * jax.random.uniform(kp, (tokens, n), jnp.float32)
    comb = jax.random.uniform(kc, (tokens, n, n), jnp.float32) + 0.1
    comb = comb / comb.sum(-1, keepdims=True)
    if kind == "ffn":
        rows = jax.random.normal(kr, (tokens * k, dim), jnp.float32).astype(jnp.bfloat16)
        out = FfnSum(rows, jnp.arange(tokens * k, dtype=jnp.int32),
                     jnp.ones((tokens * k,), bool), out, k)
    return out, post, comb


def floor_us(tokens, n, dim):
    nbytes = tokens * n * dim * 2 + (2 + n) * n * n * dim * 4 + dim * 2 + tokens * dim * 2
    return nbytes / (PEAK_TBPS * 1e12) * 1e6


def op_fn(impl, cfg, iters=None, pending=None):
    """The jitted op for ``impl``: "xla", "cute" or a kernel config "CxTB[/apart]" (cluster
    x tokens per cluster; "/apart": the split a launch of its own), at ``iters`` Sinkhorn
    iterations (None: the config's), with the hc_post of ``pending`` (``make_pending``)
    first where given."""
    static = dict(n=cfg.hc_mult, iters=cfg.hc_sinkhorn_iters if iters is None else iters,
                  hc_eps=cfg.hc_eps, norm_eps=cfg.norm_eps)
    if impl not in ("xla", "cute"):
        sizes, _, apart = impl.partition("/")
        config = HcPreSm90Config(*(int(v) for v in sizes.split("x")),
                                 split_apart=apart == "apart")
        return jax.jit(lambda *a: hc_pre_cute(*a, *(pending or ()), **static, config=config))
    return jax.jit(lambda *a: hc_pre(*a, **static, implementation=impl, pending=pending))


def main(argv=None):
    p = op_columns.parser(__doc__, "1,8,64,256")
    p.add_argument("--pending", choices=("none", "out", "ffn"), default="none")
    p.add_argument("--iters", default="", help="Sinkhorn iterations, a row each "
                   "(default: the config's)")
    args = p.parse_args(argv)
    impls = op_columns.columns(args)
    lines = op_columns.table_head("bench_hc_pre", ["dims", "tokens", "pending", "iters"],
                                  impls)
    for name in args.dims.split(","):
        cfg = Config.tiny() if args.tiny else DIMS[name]()
        for tokens in (int(t) for t in args.tokens.split(",")):
            inputs = make_inputs(tokens, cfg.hc_mult, cfg.dim)
            pending = None if args.pending == "none" else make_pending(
                args.pending, tokens, cfg.hc_mult, cfg.dim, cfg.n_activated_experts)
            for iters in [int(i) for i in args.iters.split(",") if i] or [None]:
                cells = [op_columns.cell(lambda: op_fn(impl, cfg, iters, pending), inputs,
                                         args.runs) for impl in impls]
                lines.append(f"| {name} | {tokens} | {args.pending} | "
                             f"{cfg.hc_sinkhorn_iters if iters is None else iters} | "
                             + " | ".join(cells)
                             + f" | {floor_us(tokens, cfg.hc_mult, cfg.dim):.2f} |")
                print(lines[-1], flush=True)
    emit_table(lines, args.markdown)


if __name__ == "__main__":
    main()
