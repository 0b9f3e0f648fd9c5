"""DeepSeek-V4-Flash or -Pro at real size, random weights in checkpoint precision, on a GPU mesh.

Parameters are generated directly on the devices with their shardings (no host copy): routed
experts (packed FP4 + E8M0) split over the ``expert`` axis, embedding/head over the vocabulary,
the rest replicated. Then one prefill chunk, a synced decode loop (one jitted step per Python
iteration) and the path users run, ``dj.generate``'s jitted while loop (time per step from a
long and a short budget); reports per-device memory (planned by ``dsv4_jax.plan.memory_plan``
for this mesh, then measured), compile times and tokens/s. Figures go to stdout and ``$OUT/<model>_multi_gpu.json``.
The batch splits as ``dsv4_jax.mesh_rules.row_axes`` splits it (a small batch over the data
axis only, replicated over the expert axis; ``--replicate-max-rows`` moves the bound), padded
to a batch the mesh splits evenly (tokens/s counts the real rows only).

Decode figures at several batches (``--batches``) skip the prompt: the generate loop runs on a
cache whose rows hold ``--ctx`` tokens (lengths set, entries zero: the same cost), one
compiled loop per batch, the parameters generated once. ``--profile`` then traces one loop per
batch: device time and kernel launches per step, and the share of the collectives (the
expert-parallel all-to-all, the head's and embedding's gathers) -- run it with
``DSV4_COMMAND_BUFFERS=default``, or the profiler sees CUDA graphs, not kernels. A long
prompt (``--long-prompt N``) is prefilled in ``--chunk``-token chunks (one row, replicated
over the expert axis; with ``--replicate-max-rows 0`` one row per device, the real prompt
and copies of it as padding), timed chunk by chunk, and then decoded from the cache it left
(the generate loop at the prompt's context; ``--max-len`` sizes the cache, e.g. a 128k
prompt in a cache for 1M tokens).

    source .device/setup.sh && python3 benchmarks/flash_multi_gpu.py --batch 8
    python3 benchmarks/flash_multi_gpu.py --batches 1,8,64 --ctx 4096 --steps 24
    DSV4_COMMAND_BUFFERS=default python3 benchmarks/flash_multi_gpu.py --batches 8 --ctx 4096 \
        --profile
    python3 benchmarks/flash_multi_gpu.py --long-prompt 131072 --chunk 8192
    python3 benchmarks/flash_multi_gpu.py --long-prompt 1040384 --chunk 8192 --steps 16  # ~1M
    python3 benchmarks/flash_multi_gpu.py --layers 4          # a reduced stack (say so!)
    python3 benchmarks/flash_multi_gpu.py --model pro --batch 64 --prompt 1024 --max-len 4096
    # no GPU: lower and compile on 8 simulated CPU devices with abstract parameters
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python3 benchmarks/flash_multi_gpu.py --model pro --layers 2 --dry-run
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

import dsv4_jax as dj  # noqa: F401  (first: XLA flags)
import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import mesh_rules, plan, sharding
from dsv4_jax.decoding import build_programs, run_prefill
from dsv4_jax.ffi.policy import GroupedGemmPolicy, KernelPolicy
from dsv4_jax.generation import plain_method
from dsv4_jax.mesh_rules import padded_rows
from dsv4_jax.params import default_expert_layout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_figures as figures  # noqa: E402  (a sibling module of this script)


def gib(n):
    return round(n / 2 ** 30, 2)


def device_memory():
    out = []
    for d in jax.devices():
        s = d.memory_stats() or {}
        out.append(dict(device=d.id, in_use_gib=gib(s.get("bytes_in_use", 0)),
                        peak_gib=gib(s.get("peak_bytes_in_use", 0)),
                        limit_gib=gib(s.get("bytes_limit", 0))))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", "--config", dest="model", default="flash",
                    choices=("flash", "pro", "tiny"),
                    help="tiny: a dry run of this script on any machine")
    ap.add_argument("--layers", type=int, default=None,
                    help="reduce the stack to its first N layers (default: all; MTP kept)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256, help="prefill tokens per row")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--data", type=int, default=1, help="mesh data axis")
    ap.add_argument("--expert", type=int, default=None,
                    help="mesh expert axis (default: the devices not used by --data)")
    ap.add_argument("--dry-run", action="store_true",
                    help="lower and compile with abstract parameters and cache; allocate nothing")
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=None,
                    help="decode figures at these batches from a cache of --ctx tokens per row "
                         "(no prompt)")
    ap.add_argument("--ctx", type=lambda v: [int(x) for x in v.split(",")], default=[4096],
                    help="tokens per row for --batches (a list: each context in turn)")
    ap.add_argument("--profile", action="store_true",
                    help="with --batches: trace one loop per batch (device time, launches, "
                         "collectives); needs DSV4_COMMAND_BUFFERS=default")
    ap.add_argument("--long-prompt", type=int, default=0,
                    help="prefill one prompt of this many tokens in --chunk chunks")
    ap.add_argument("--chunk", type=int, default=4096, help="prefill chunk per row")
    ap.add_argument("--replicate-max-rows", type=lambda v: [int(x) for x in v.split(",")],
                    default=None,
                    help="rows per data group up to which the batch is replicated over the "
                         "expert axis (mesh_rules.REPLICATE_MAX_ROWS; 0: always split); "
                         "with --batches a list runs each bound in turn (the last one stays "
                         "for --long-prompt)")
    ap.add_argument("--pdl", type=lambda v: list(dict.fromkeys(v.split(","))),
                    default=["off"],
                    help="the grouped GEMM's decode kernels as programmatic dependent launches "
                         "(GroupedGemmPolicy.pdl): 'on', 'off', or both ('on,off'): with "
                         "--batches both loops are compiled and timed in turn, repeat by "
                         "repeat")
    ap.add_argument("--expert-layout", choices=("rows", "blocked"), default=None,
                    help="the routed FP4 experts' layout (Config.expert_layout); default: "
                         "what dj.load gives, 'blocked' for packed FP4 experts")
    ap.add_argument("--repeats", type=int, default=3,
                    help="--batches: timings per loop (two budgets each); the median is "
                         "reported, and every repeat")
    args = ap.parse_args()
    for value in args.pdl:
        if value not in PDL:
            ap.error(f"--pdl: {value!r} is not one of {sorted(PDL)}")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.steps < 3:                          # the first two are warm-up, not timed
        ap.error(f"--steps must be >= 3, got {args.steps}")
    if args.replicate_max_rows is not None:     # before anything is traced
        mesh_rules.REPLICATE_MAX_ROWS = args.replicate_max_rows[0]
    out_dir = os.environ.get("OUT", ".")
    report = dict(jax=jax.__version__, devices=[str(d) for d in jax.devices()], args=vars(args))

    def log(**kw):
        report.update(kw)
        print(json.dumps(kw), flush=True)
        with open(os.path.join(out_dir, f"{args.model}_multi_gpu.json"), "w") as f:
            json.dump(report, f, indent=1)

    cfg = getattr(dj.Config, args.model)(quantized=True)
    if args.layers:
        cfg = plan.reduced_config(cfg, cfg.compress_ratios[:args.layers])
    mesh = sharding.make_mesh(data=args.data, expert=args.expert)
    b, p = padded_rows(mesh, args.batch), args.prompt               # rows run (padded)
    need = plan.check_fits(cfg, mesh)
    # The plan of this run (its mesh, rows and lengths), to set against the memory measured
    # below; plan.memory_table sizes other device counts with the same functions.
    log(config=f"{args.model} layers={cfg.n_layers} params={dj.param_count(cfg) / 1e9:.1f}B",
        mesh=dict(mesh.shape), rows_run=b, params_per_device_gib=gib(need),
        plan_gib={f"{what}_{moe}": {k: gib(v) for k, v in plan.memory_plan(
            cfg, mesh, batch=b, seq=s, max_len=args.max_len, moe=moe).items()
            if k in ("params", "cache", "activations", "total")}
            for what, s in (("prefill", p), ("decode", 1)) for moe in ("kernel", "xla")})
    if args.dry_run:
        for what, s in (("prefill", p), ("decode", 1)):
            t = time.perf_counter()
            lowered = plan.abstract_step(cfg, mesh, b, s, args.max_len)
            lower_s = time.perf_counter() - t
            ma = lowered.compile().memory_analysis()
            log(**{f"{what}_dry_run": dict(
                lower_s=round(lower_s, 1), compile_s=round(time.perf_counter() - t - lower_s, 1),
                argument_gib=gib(ma.argument_size_in_bytes), temp_gib=gib(ma.temp_size_in_bytes),
                output_gib=gib(ma.output_size_in_bytes))})
        return

    t = time.perf_counter()
    params = dj.init_params(cfg, 0, shardings=sharding.param_shardings(cfg, mesh))
    layout = args.expert_layout or default_expert_layout(cfg, params)
    if layout == "blocked":                     # as dj.load gives them (same bytes, in place)
        cfg = cfg.replace(expert_layout="blocked")
        params = dj.block_expert_weights(params)
    jax.block_until_ready(params)
    log(init_s=round(time.perf_counter() - t, 1), expert_layout=cfg.expert_layout,
        memory_after_init=device_memory())

    if args.batches:
        for bound in args.replicate_max_rows or [mesh_rules.REPLICATE_MAX_ROWS]:
            mesh_rules.REPLICATE_MAX_ROWS = bound      # each loop below traces anew
            decode_figures(args, cfg, mesh, params, log)
        if not args.long_prompt:
            return
    if args.long_prompt:
        return long_prompt(args, cfg, mesh, params, log)

    model = dj.DSV4(cfg, mesh=mesh, runtime_checks=False)
    tokens = jax.random.randint(jax.random.key(1), (b, p), 2, cfg.vocab_size, jnp.int32)
    cache = dj.Cache.init(cfg, b, args.max_len, mesh=mesh)
    prefill = jax.jit(lambda prm, t, c: model.apply({"params": prm}, t, c, logits_at="last"),
                      donate_argnames=("c",))
    step = jax.jit(lambda prm, t, c: model.apply({"params": prm}, t, c, logits_at="last"),
                   donate_argnames=("c",))

    t = time.perf_counter()
    compiled = prefill.lower(params, tokens, cache).compile()
    log(prefill_compile_s=round(time.perf_counter() - t, 1))
    t = time.perf_counter()
    logits, cache = compiled(params, tokens, cache)
    jax.block_until_ready(logits)
    prefill_s = time.perf_counter() - t
    log(prefill_s=round(prefill_s, 3), prefill_tokens_per_s=round(args.batch * p / prefill_s, 1),
        logits_finite=bool(jnp.all(jnp.isfinite(logits))), memory_after_prefill=device_memory())

    nxt = jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
    t = time.perf_counter()
    compiled_step = step.lower(params, nxt, cache).compile()
    log(decode_compile_s=round(time.perf_counter() - t, 1))
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        logits, cache = compiled_step(params, nxt, cache)
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
        jax.block_until_ready(nxt)
        times.append(time.perf_counter() - t)
    med = statistics.median(times[2:])
    log(decode_step_median_s=round(med, 4), decode_tokens_per_s=round(args.batch / med, 1),
        decode_steps=len(times), memory_after_decode=device_memory(),
        generated_ids_sample=np.asarray(nxt[:, 0]).tolist())

    # The path users run: dj.generate's jitted while loop from this cache (no stop token, so
    # every row runs its budget); per step = the difference of a long and a short budget.
    programs = build_programs(plain_method(model, dj.Greedy()))
    first, stop, key = nxt[:, 0], jnp.array([-7], jnp.int32), jax.random.key(0)

    def generate(budget):
        out, _, _, _ = programs.loop(params, first, jnp.zeros(first.shape, jnp.float32), first,
                                     jax.tree.map(jnp.copy, cache), key, stop,
                                     jnp.int32(budget), steps=args.steps)
        return jax.block_until_ready(out)

    t = time.perf_counter()
    generate(args.steps)
    log(generate_compile_and_first_s=round(time.perf_counter() - t, 1))
    short, per_step = max(2, args.steps // 4), []
    for _ in range(3):
        took = {}
        for budget in (short, args.steps):
            t = time.perf_counter()
            generate(budget)
            took[budget] = time.perf_counter() - t
        per_step.append((took[args.steps] - took[short]) / (args.steps - short))
    gen = statistics.median(per_step)
    log(generate_step_median_s=round(gen, 4), generate_tokens_per_s=round(args.batch / gen, 1),
        memory_after_generate=device_memory())


# "psum": XLA names its one-shot all-reduce kernel (a fusion) after the psum it implements.
COLLECTIVE_NAMES = ("nccl", "all-to-all", "all_to_all", "all-gather", "all_gather",
                    "reduce-scatter", "reduce_scatter", "all-reduce", "all_reduce", "psum")
COLLECTIVES = "collectives (all-reduce, all-to-all, gathers)"      # kernel_group's label


def kernel_group(name: str) -> str:
    """A traced kernel's group: the collectives, a CuTe kernel's op, or XLA's own kernels."""
    low = name.lower()
    if any(c in low for c in COLLECTIVE_NAMES):
        return COLLECTIVES
    if "kernel_cutlass" in name:
        return next((label for key, label in figures.CUTE_KERNELS if key in name), "other CuTe")
    return "XLA fusions, copies"


def per_device_split(by_device: dict, steps: int) -> dict:
    """Per device: all kernels' and the collectives' device us per step (``by_device`` from
    ``step_figures.trace_device_ops``)."""
    return {device: {"all": round(sum(c.values()) / steps, 1),
                     "collectives": round(sum(v for name, v in c.items()
                                              if kernel_group(name) == COLLECTIVES)
                                          / steps, 1)}
            for device, c in sorted(by_device.items())}


PDL = {"on": True, "off": False}         # --pdl values: GroupedGemmPolicy.pdl


def decode_figures(args, cfg, mesh, params, log):
    """The generate loop per step at each of ``args.batches`` from a cache of each of
    ``args.ctx`` tokens per row; with ``args.profile`` also the traced loop's device time by
    group."""
    for ctx in args.ctx:
        for batch in args.batches:
            rows = padded_rows(mesh, batch)
            t = time.perf_counter()
            runs = {pdl: figures.generate_loop(
                cfg, KernelPolicy(grouped_gemm=GroupedGemmPolicy(pdl=PDL[pdl])), rows, ctx,
                args.steps, mesh=mesh) for pdl in args.pdl}
            timed = figures.time_interleaved(
                {pdl: (lambda budget, run=run: run.prepare(params, budget))
                 for pdl, run in runs.items()},
                rows, args.steps, args.repeats)
            for pdl, run in runs.items():
                decode_figure(args, params, log, batch, rows, ctx, pdl, run, timed[pdl], t)
            del runs


def decode_figure(args, params, log, batch, rows, ctx, pdl, run, timed, t):
    """One batch, context and ``--pdl`` value of ``decode_figures``: its timing (``timed``,
    ``step_figures.time_interleaved``'s entry for ``run``; the loops of every ``--pdl``
    value timed in turn) and, with ``--profile``, its traced loop."""
    n_gpus = len(jax.devices())
    (per_step, samples_s), first_s = timed
    result = dict(batch=batch, rows_run=rows, ctx=ctx,
                  generate_step_ms=round(per_step * 1e3, 3),
                  generate_step_ms_each_repeat=[round(v * 1e3, 3) for v in samples_s],
                  tokens_per_s=round(batch / per_step, 1),
                  compile_and_first_s=round(first_s, 1),
                  memory=device_memory())
    if args.profile:
        samples, copies, by_device = {}, collections.Counter(), {}
        device_us, launches, totals, counts = figures.generate_profile(
            run, params, samples=samples, copies=copies, by_device=by_device)
        per = (figures.PROFILE_STEPS - 1) * n_gpus      # per step and GPU
        groups = collections.Counter()
        for name, us in totals.items():
            groups[kernel_group(name)] += us / per
        result.update(
            device_us_per_step_per_gpu=round(device_us / n_gpus, 1),
            launches_per_step_per_gpu=round(launches / n_gpus, 1),
            groups_us_per_step_per_gpu={k: round(v, 1) for k, v in groups.most_common()},
            top_kernels_us_per_step_per_gpu=[
                (name[:90], round(us / per, 1), round(counts[name] / per, 2))
                for name, us in totals.most_common(16)],
            # The HLO op behind each of the top kernels: which XLA fusion (a concatenate, a
            # copy) is which line of the model.
            top_kernel_trace_args={name[:90]: {k: str(v)[:240] for k, v in
                                               samples.get(name, {}).items()}
                                   for name, _ in totals.most_common(16)},
            copies_us_per_step_per_gpu=[(k, round(v / per, 1))
                                        for k, v in copies.most_common(12)],
            # Which GPU waits: a collective's kernel time includes its wait for the peers.
            per_gpu_us_per_step=per_device_split(by_device, figures.PROFILE_STEPS - 1))
    result.update(replicate_max_rows=mesh_rules.REPLICATE_MAX_ROWS, pdl=pdl)
    name = f"decode_b{batch}_ctx{ctx}_r{mesh_rules.REPLICATE_MAX_ROWS}_pdl{pdl}"
    log(**{name: result, f"{name}_total_s": round(time.perf_counter() - t, 1)})


def long_prompt(args, cfg, mesh, params, log):
    """One ``args.long_prompt``-token prompt prefilled in ``args.chunk``-token chunks (the
    rows ``padded_rows`` gives one prompt: the prompt, and copies of it as padding rows if
    the mesh splits a batch of one), timed chunk by chunk, then decoded from the cache it
    left. The first chunk compiles the program (and the last, if narrower); a chunk's time
    grows with its prefix (the indexer and sparse attention read the cache), so the warm
    prefill is the sum of the chunks' times with the first one counted as the second.
    Progress is written every ``LOG_EVERY`` chunks, so a run cut by a time limit keeps it.
    Decoding: ``dj.generate``'s loop from the prefilled cache, per step = the difference of a
    short and a long budget run one after the other (the context grows by both)."""
    n_rows = padded_rows(mesh, 1)
    if args.long_prompt % args.chunk:
        raise ValueError(f"--long-prompt {args.long_prompt} is not a multiple of --chunk "
                         f"{args.chunk}")
    short = max(2, args.steps // 4)
    needed = args.long_prompt + 2 * (args.steps + short) + 1
    max_len = max(args.max_len, -(-needed // 4096) * 4096)
    if cfg.max_positions is not None:
        if needed > cfg.max_positions:
            raise ValueError(f"--long-prompt {args.long_prompt} + 4 decode budgets of --steps "
                             f"{args.steps} need {needed} positions > {cfg.max_positions}, "
                             f"the model's RoPE range")
        max_len = min(max_len, cfg.max_positions)      # rounded up, never past the range
    model = dj.DSV4(cfg, mesh=mesh, runtime_checks=False)
    programs = build_programs(plain_method(model, dj.Greedy()))
    rng = np.random.default_rng(0)
    prompt = rng.integers(2, cfg.vocab_size, args.long_prompt).astype(np.int32)
    tokens = np.tile(prompt, (n_rows, 1))
    lengths = np.full((n_rows,), args.long_prompt, np.int32)
    chunks = tuple((o, args.chunk) for o in range(0, args.long_prompt, args.chunk))
    stop, key = jnp.array([-7], jnp.int32), jax.random.key(0)
    cache = dj.Cache.init(cfg, n_rows, max_len, mesh=mesh)
    done_at = [time.perf_counter()]

    def figures_so_far():
        took = np.diff(done_at)
        warm = np.concatenate([took[1:2], took[1:]]) if len(took) > 1 else took
        marks = sorted({0, 1, len(took) // 2, len(took) - 1} & set(range(len(took))))
        return dict(
            tokens=args.long_prompt, rows_run=n_rows, chunk=args.chunk, max_len=max_len,
            chunks_done=len(took), chunks=len(chunks),
            prefill_with_compile_s=round(done_at[-1] - done_at[0], 2),
            warm_prefill_s=round(float(warm.sum()), 2),
            warm_tokens_per_s=round(len(took) * args.chunk / max(float(warm.sum()), 1e-9), 1),
            median_chunk_s=round(float(np.median(warm)), 3),
            chunk_s_at_prefix={int(chunks[i][0]): round(float(took[i]), 3) for i in marks},
            memory=device_memory())

    def progress(done, total):
        done_at.append(time.perf_counter())
        if len(done_at) % LOG_EVERY == 1:
            log(long_prompt=figures_so_far())

    first, first_lp, state, _, _, cache = run_prefill(
        programs, params, tokens, lengths, cache, key, stop, jnp.int32(args.steps),
        chunks=chunks, progress=progress)
    jax.block_until_ready(first)
    log(long_prompt=figures_so_far())

    def decode(first, first_lp, state, cache, budget):
        t = time.perf_counter()
        out, lps, state, cache = programs.loop(params, first, first_lp, state, cache, key,
                                               stop, jnp.int32(budget), steps=args.steps)
        out = jax.block_until_ready(out)
        return out, lps, state, cache, time.perf_counter() - t

    # The first call compiles; the second may compile again if the loop returns its state or
    # cache split unlike prefill did; the third and fourth run the same program warm. Every
    # call starts from the prefill's first token (the values do not change the work).
    runs = []
    for budget in (args.steps, short, short, args.steps):
        out, _, state, cache, took = decode(first, first_lp, state, cache, budget)
        runs.append(took)
    per_step = (runs[3] - runs[2]) / (args.steps - short)
    ids = np.asarray(out)
    log(decode_after_long_prompt=dict(
        context=args.long_prompt + 2 * (args.steps + short),
        calls_s=[round(t, 2) for t in runs], generate_step_ms=round(per_step * 1e3, 3),
        ids_valid=bool(((ids >= 0) & (ids < cfg.vocab_size)).all()),
        generated_ids_sample=ids[0, :8].tolist(), memory=device_memory()))


LOG_EVERY = 8       # chunks between progress records of a long prompt


if __name__ == "__main__":
    main()
