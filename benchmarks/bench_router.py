"""Benchmark the MoE router of one layer (``dsv4_jax.ffi.moe_router``: f32 logits, scores,
top-k or hash table, weights) at DSV4 dims: the kernel against the XLA chain it replaces,
device time and launches per call.

    python benchmarks/bench_router.py [--dims flash,pro] [--tokens 1,8,64,128] [--runs 50]
                                      [--routing bias,hash] [--markdown out.md]
    python benchmarks/bench_router.py --tiny        # dry run (CPU: the reference only)
    python benchmarks/bench_router.py --configs 8x4,16x4   # the kernel at these
                                     # cluster x tokens-per-cluster configs (a column each)

Device: the sum of the device ops of one traced call (``step_figures.trace_device_ops``)
and their count; wall: ``timing.median_seconds`` (each call waited for, warm-up excluded).
Floor: the bytes read once (x, the bf16 gate weight, the bias) and written, at ``PEAK_TBPS``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4_jax.config import Config
from dsv4_jax.ffi import moe_router
from dsv4_jax.ffi.router_sm90 import moe_router_cute
from dsv4_jax.kernels.router_config import RouterSm90Config
import op_columns
from timing import PEAK_TBPS, emit_table

DIMS = {"flash": Config.flash, "pro": Config.pro}
VOCAB = 4096


def make_inputs(tokens, cfg, hashed, seed=0):
    """``(x, weight, bias, table, token_ids)``; the unused routing operands are None."""
    kx, kw, kb, kt, ki = jax.random.split(jax.random.key(seed), 5)
    e, d, k = cfg.n_routed_experts, cfg.dim, cfg.n_activated_experts
    x = jax.random.normal(kx, (tokens, d), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (e, d), jnp.float32) * d ** -0.5).astype(jnp.bfloat16)
    if not hashed:
        return jax.block_until_ready((x, w, jax.random.normal(kb, (e,)) * 0.1, None, None))
    table = jnp.argsort(jax.random.uniform(kt, (VOCAB, e)), axis=-1)[:, :k].astype(jnp.int32)
    ids = jax.random.randint(ki, (tokens,), 0, VOCAB, jnp.int32)
    return jax.block_until_ready((x, w, None, table, ids))


def floor_us(tokens, cfg):
    e, d, k = cfg.n_routed_experts, cfg.dim, cfg.n_activated_experts
    nbytes = tokens * d * 2 + e * d * 2 + e * 4 + tokens * k * 8
    return nbytes / (PEAK_TBPS * 1e12) * 1e6


def op_fn(impl, cfg):
    """The jitted op for ``impl``: "xla", "cute" or a kernel config "CxTB" (cluster x
    tokens per cluster)."""
    static = dict(k=cfg.n_activated_experts, score_func=cfg.score_func,
                  route_scale=cfg.route_scale)
    if impl not in ("xla", "cute"):
        config = RouterSm90Config(*(int(v) for v in impl.split("x")))
        fn = jax.jit(lambda *a: moe_router_cute(*a, **static, config=config))
    else:
        fn = jax.jit(lambda *a: moe_router(*a, **static, implementation=impl))
    return fn


def main(argv=None):
    p = op_columns.parser(__doc__, "1,8,16")
    p.add_argument("--routing", default="bias,hash")
    args = p.parse_args(argv)
    impls = op_columns.columns(args)
    lines = op_columns.table_head("bench_router", ["dims", "routing", "tokens"], impls)
    for name in args.dims.split(","):
        cfg = Config.tiny() if args.tiny else DIMS[name]()
        for routing in args.routing.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                inputs = make_inputs(tokens, cfg, routing == "hash")
                cells = [op_columns.cell(lambda: op_fn(impl, cfg), inputs, args.runs)
                         for impl in impls]
                lines.append(f"| {name} | {routing} | {tokens} | " + " | ".join(cells)
                             + f" | {floor_us(tokens, cfg):.2f} |")
                print(lines[-1], flush=True)
    emit_table(lines, args.markdown)


if __name__ == "__main__":
    main()
