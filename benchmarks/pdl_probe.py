"""Does programmatic dependent launch shorten two decode GEMM launches that follow each other?

    source .device/setup.sh && cd benchmarks && python3 pdl_probe.py [--tokens 1,8]
    DSV4_COMMAND_BUFFERS=default python3 pdl_probe.py      # XLA's default command buffers
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 pdl_probe.py     # no command buffers

A pair is the shared expert's two launches (gated w1/w3, then w2 on its output: adjacent in
the model) or wq_a then wq_b, FP8 weights, the model's decode configs
(``grouped_gemm_sm90.resolve_config``) with ``pdl`` "" (off), "start" (the second launch may
begin while the first ends, and waits for it before reading anything) or "weights" (it also
issues its first stages' weight copies before that wait). One jitted loop runs ``--iters``
pairs back to back, each pair's input the previous pair's output (so the launches chain as in
a decode step); with dsv4_jax's flags the loop is one CUDA graph, whose capture must keep the
programmatic edge for the mode to matter. Reported per pair: wall time (median of runs of the
loop, ``timing.median_seconds``) and the device time of the traced kernels; the floor is the
two weights' bytes at ``timing.PEAK_TBPS``; and whether the loop's output has the bits of the
mode "off" (a launch that read its input early would change them) and is finite.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import dsv4_jax  # noqa: F401  (first: XLA flags)
import jax
import jax.numpy as jnp

from dsv4_jax.config import Config
from dsv4_jax.ffi import cases
from dsv4_jax.ffi import grouped_gemm_sm90 as gemm
from dsv4_jax.kernels.grouped_gemm_config import PDL_MODES
from decode_gemms import gemm_shapes
from step_figures import trace_device_ops
from timing import PEAK_TBPS, median_seconds


def pairs(cfg: Config) -> dict:
    """``name: ((n, k, gated) of the first launch, (n, k) of the second)``; the second reads
    the first's output (the shapes of ``decode_gemms.gemm_shapes``)."""
    shapes = gemm_shapes(cfg)
    return {name: ((shapes[a].n, shapes[a].k, shapes[a].gated), (shapes[b].n, shapes[b].k))
            for name, (a, b) in (("shared", ("shared_w13", "shared_w2")),
                                 ("wq", ("wq_a", "wq_b")))}


def launch_fn(tokens: int, n: int, k: int, gated: bool, pdl: str):
    """``(run(x, weights) -> y, config)``: one dense FP8 launch of the model's decode config
    with ``pdl``."""
    config = dataclasses.replace(gemm.resolve_config(None, tokens, 1, "fp8", (k,), True, (n,)),
                                 pdl=pdl)
    tiles = gemm.block_schedule(tokens, 1, config.block_n)
    rw = jnp.ones((tokens,), jnp.float32)

    def run(x, w, up):
        return gemm.launch(x, tiles, *w, weight_b=None if up is None else up[0],
                           scale_b=None if up is None else up[1],
                           route_w=rw if gated else None, swiglu_limit=10.0 if gated else 0.0,
                           config=config)
    return run, config


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,8")
    p.add_argument("--pairs", default="shared,wq")
    p.add_argument("--iters", type=int, default=32)
    a = p.parse_args(argv)
    cfg = Config.flash(quantized=True)
    known = pairs(cfg)
    unknown = [q for q in a.pairs.split(",") if q not in known]
    if unknown:
        p.error(f"--pairs: {unknown} not among {sorted(known)}")
    print(f"# pdl_probe, {jax.devices()[0].device_kind}, `{' '.join(sys.argv)}`")
    print("| pair | T | pdl | wall per pair (us) | device per pair (us) | floor (us) "
          "| same bits as off | finite |")
    print("|---|---|---|---|---|---|---|")
    key = jax.random.PRNGKey(0)
    for index, name in enumerate(a.pairs.split(",")):
        (n1, k1, gated), (n2, k2) = known[name]
        ks = jax.random.split(jax.random.fold_in(key, index), 6)
        w1 = cases.random_weight("fp8", ks[0], ks[1], 1, n1, k1)
        up = cases.random_weight("fp8", ks[2], ks[3], 1, n1, k1) if gated else None
        w2 = cases.random_weight("fp8", ks[4], ks[5], 1, n2, k2)
        nbytes = sum(v.size * v.dtype.itemsize for m in (w1, up, w2) if m is not None
                     for v in m)
        for tokens in [int(t) for t in a.tokens.split(",")]:
            x0 = cases.token_inputs(jax.random.fold_in(key, 100 + tokens), tokens, k1)
            reference = None
            for pdl in PDL_MODES:
                first, _ = launch_fn(tokens, n1, k1, gated, pdl)
                second, _ = launch_fn(tokens, n2, k2, False, pdl)

                def body(i, x):
                    y = second(first(x, w1, up), w2, None)
                    # The next pair's input is this pair's output (its first k1 columns: one
                    # slice after the second launch where the widths differ).
                    return y if y.shape == x.shape else y[:, :k1]

                x = x0
                run = jax.jit(lambda x: jax.lax.fori_loop(0, a.iters, body, x))
                out = jax.block_until_ready(run(x))
                # The same kernel with and without the programmatic edge must give the same
                # bits: a difference means a launch read its input before the previous wrote it.
                reference = out if reference is None else reference
                same = bool(jnp.array_equal(out, reference, equal_nan=True))
                finite = bool(jnp.isfinite(out).all())
                wall = median_seconds(run, x, runs=20) / a.iters
                totals, _ = trace_device_ops(lambda: jax.block_until_ready(run(x)))
                device = sum(t for nm, t in totals.items() if "GroupedGemm" in nm) / a.iters
                print(f"| {name} | {tokens} | {pdl or 'off'} | {wall * 1e6:.1f} | "
                      f"{device:.1f} | {nbytes / PEAK_TBPS / 1e6:.1f} | {same} | {finite} |",
                      flush=True)


if __name__ == "__main__":
    main()
