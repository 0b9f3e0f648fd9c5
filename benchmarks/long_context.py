"""Long context on one GPU, real DSV4-Flash layers: a prefill chunk against the prefix it
lands on, ``dj.generate`` with a long prompt (chunked prefill), and the decode step against
the context length.

    python benchmarks/long_context.py --prefixes 0,32768,131072 --chunk 4096
    python benchmarks/long_context.py --prompt 131072 --decode-ctxs 4096,262144,1048576
    python benchmarks/long_context.py --tiny                     # dry run (CPU)

Stack: ``decode_step.stack_config`` of ``--layers`` real Flash layers (default 6: two SWA,
two CSA with the indexer, two HCA), weights in checkpoint precision generated on the device.

* Chunk vs prefix (``--prefixes``): one ``--chunk``-token call (batch 1) into a cache whose
  row already holds P tokens (lengths set; entries zero: the same work) and has room for the
  chunk; median of ``--runs`` after one warm-up. Memory: the compiled program's temporary
  bytes (``memory_analysis``), its arguments (parameters + cache) and the device's peak bytes
  in use so far (monotone: prefixes run in increasing order). ``--profile-prefixes``: one
  more call traced, its device time per model module (``step_figures.attribute``).
* Long prompt (``--prompt N``): ``dj.generate`` on one random N-token prompt, 4 new tokens,
  ``prefill_chunk=--chunk``; the second of two calls (the first compiles): prefill seconds,
  tokens/s, and the device peak.
* Decode vs context (``--decode-ctxs``, ``--batches``): ``dj.generate``'s while loop on a
  cache holding ctx tokens per row (``step_figures.time_generate``): wall ms per step of the
  stack, and the ratio to the first ctx.

``--kv-dtype fp8``: every cache above with the compressed entries as FP8 rows.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import dsv4_jax as dj  # first: XLA flags
import numpy as np
import jax
import jax.numpy as jnp

from dsv4_jax.ffi.policy import KernelPolicy
import step_figures as figures
from decode_step import device_params, emit_tables, gib, make_step, stack_config


def device_peak() -> float:
    return gib((jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0))


def chunk_at_prefix(cfg, policy, params, chunk: int, prefix: int, runs: int,
                    kv_dtype: str | None = None) -> dict:
    """One chunk into a cache holding ``prefix`` tokens: median seconds and memory."""
    step = make_step(cfg, policy)
    tokens = jax.random.randint(jax.random.key(1), (1, chunk), 2, cfg.vocab_size, jnp.int32)
    max_len = prefix + chunk

    def cache():
        return figures.filled_cache(cfg, 1, prefix, max_len, kv_dtype)

    compiled = step.lower(params, tokens, cache()).compile()
    memory = compiled.memory_analysis()

    def once():
        return jax.block_until_ready(compiled(params, tokens, cache())[0])

    times = []
    for i in range(runs + 1):
        fresh = jax.block_until_ready(cache())            # donated: a fresh one per call
        t0 = time.perf_counter()
        logits, _ = compiled(params, tokens, fresh)
        jax.block_until_ready(logits)
        if i:
            times.append(time.perf_counter() - t0)
    return dict(seconds=statistics.median(times), finite=bool(jnp.all(jnp.isfinite(logits))),
                temp_gib=gib(memory.temp_size_in_bytes),
                args_gib=gib(memory.argument_size_in_bytes), peak_gib=device_peak()), \
        (once, compiled.as_text())


def profile_chunk(title: str, once, hlo_text: str) -> str:
    """One traced chunk: device time per model module (kernels attributed through the
    compiled HLO's op paths, layers merged) and per CuTe kernel class."""
    totals, counts = figures.trace_device_ops(once)
    rows = figures.attribute(totals, counts, hlo_text, steps=1, depth=4)
    total = sum(totals.values())
    lines = [f"**{title}**: device ops {total / 1e3:.2f} ms, {sum(counts.values())} launches",
             "", "| module | ms | launches |", "|---|---|---|"]
    for name, us, n in sorted(rows, key=lambda r: -r[1]):
        if us >= 0.005 * total:
            lines.append(f"| `{name}` | {us / 1e3:.2f} | {n:.0f} |")
    return "\n".join(lines)


def run_prefixes(args, cfg, policy, params, out):
    lines = [f"### One {args.chunk}-token chunk into a cache holding P tokens, batch 1, "
             f"{cfg.n_layers} {args.model_name} layers", "",
             "| P | ms | x P=0 | tokens/s | temporaries (GiB) | arguments (GiB) | "
             "device peak so far (GiB) |", "|---|---|---|---|---|---|---|"]
    base, profiles = None, []
    for prefix in sorted(args.prefixes):
        r, (once, hlo_text) = chunk_at_prefix(cfg, policy, params, args.chunk, prefix,
                                              args.runs, args.kv_dtype)
        if prefix in args.profile_prefixes:
            profiles.append(profile_chunk(f"{args.chunk}-token chunk at P = {prefix}", once,
                                          hlo_text))
            print(profiles[-1], flush=True)
        del once
        base = base or r["seconds"]
        print(f"prefix {prefix}: {r}", flush=True)
        lines.append(f"| {prefix} | {r['seconds'] * 1e3:.1f} | {r['seconds'] / base:.2f} | "
                     f"{args.chunk / r['seconds']:.0f} | {r['temp_gib']:.2f} | "
                     f"{r['args_gib']:.2f} | {r['peak_gib']:.1f} |")
    out.append("\n".join(lines))
    out.extend(profiles)


def run_prompt(args, cfg, policy, params, out):
    model = dj.DSV4(cfg, implementation=policy)
    rng = np.random.default_rng(0)
    prompt = rng.integers(2, cfg.vocab_size, args.prompt).tolist()
    opts = dj.GenerationOptions(max_new_tokens=4, stop_tokens=(), prefill_chunk=args.chunk,
                                kv_dtype=args.kv_dtype)
    for _ in range(2):                                    # the first call compiles
        result = dj.generate(model, params, [prompt], options=opts)
    s = result.stats["prefill_s"]
    line = (f"### `dj.generate`, one {args.prompt}-token prompt, prefill_chunk {args.chunk}, "
            f"{cfg.n_layers} {args.model_name} layers\n\nprefill {s:.2f} s, "
            f"{args.prompt / s:.0f} tokens/s; 4 new tokens; device peak so far "
            f"{device_peak():.1f} GiB")
    print(line, flush=True)
    out.append(line)


def run_decode_ctxs(args, cfg, policy, params, out):
    lines = [f"### Decode step vs context, `dj.generate`'s loop, {cfg.n_layers} "
             f"{args.model_name} layers",
             "", "| batch | ctx | ms per step | x first ctx |", "|---|---|---|---|"]
    for batch in args.batches:
        base = None
        for ctx in args.decode_ctxs:
            per_token, _, _ = figures.time_generate(cfg, policy, params, batch, ctx, args.steps,
                                                    kv_dtype=args.kv_dtype)
            base = base or per_token
            print(f"decode batch {batch} ctx {ctx}: {per_token * 1e3:.3f} ms", flush=True)
            lines.append(f"| {batch} | {ctx} | {per_token * 1e3:.3f} | "
                         f"{per_token / base:.2f} |")
    lines.append(f"\ndevice peak so far {device_peak():.1f} GiB")
    out.append("\n".join(lines))


def ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--prefixes", type=ints, default=[])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--profile-prefixes", type=ints, default=[],
                   help="trace the chunk at these prefixes: device time per module")
    p.add_argument("--prompt", type=int, default=0, help="generate with a prompt this long")
    p.add_argument("--decode-ctxs", type=ints, default=[])
    p.add_argument("--batches", type=ints, default=[1, 8])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--kv-dtype", choices=("fp8", "fp8+fp4"), default=None,
                   help="the compressed entries as FP8 rows (Cache.init's kv_dtype)")
    p.add_argument("--tiny", action="store_true", help="Config.tiny, small sizes (CPU)")
    p.add_argument("--out", help="write the tables to this markdown file")
    args = p.parse_args(argv)
    args.model_name = "tiny" if args.tiny else "Flash"
    if args.tiny:
        args.chunk, args.layers = min(args.chunk, 256), min(args.layers, 4)
    return args


def main(argv=None):
    args = parse_args(argv)
    dev = jax.devices()[0]
    base = dj.Config.tiny(quantized=True) if args.tiny else dj.Config.flash(quantized=True)
    cfg = stack_config(base, args.layers)
    header = (f"long_context, {datetime.date.today()}, {dev.device_kind}, jax {jax.__version__}, "
              f"`python {' '.join(sys.argv)}`")
    print("# " + header, flush=True)
    params = jax.block_until_ready(device_params(cfg))
    policy = KernelPolicy()
    out = []
    if args.prefixes:
        run_prefixes(args, cfg, policy, params, out)
    if args.prompt:
        run_prompt(args, cfg, policy, params, out)
    if args.decode_ctxs:
        run_decode_ctxs(args, cfg, policy, params, out)
    emit_tables(header, out, args.out)


if __name__ == "__main__":
    main()
