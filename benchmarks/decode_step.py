"""Model-level speed at real DSV4-Flash dims on one GPU: the generate path, a synced decode
step and a prefill chunk, per layer.

    python benchmarks/decode_step.py --generate --batches 1,8,64 --ctxs 4096,65536
    python benchmarks/decode_step.py --decode --batches 8 --impls auto
    python benchmarks/decode_step.py --prefill --chunks 2048,4096 --no-profile
    python benchmarks/decode_step.py --tiny                 # dry run of every code path (CPU)

Generate (``--generate``, the path users run): ``dj.generate``'s jitted while loop on a cache
holding ``ctx`` tokens per row (``step_figures.py``): wall time per step, device time and
kernel launches per step from a profiled loop, the bytes a step must read and its HBM floor,
per layer and for the big stack, at every ``--ctxs`` x ``--batches``; then the op table of
one profiled loop of the big stack at ``--profile-batch`` (first ctx).

Reduced stacks of real layers (``Config.flash(quantized=True)`` with ``--layers`` layers, no MTP
block): weights in checkpoint precision (FP8 + E8M0, packed FP4 experts) generated on the
device. With the default ``--layers 2,6`` the small stack is the two SWA-only layers and the
big one adds two CSA and two HCA layers, so per layer = (t_6 - t_2) / 4 is the cost of an
average compressed-attention layer (attention + MoE), embedding/head excluded.

Decode: the cache holds ``--ctx`` tokens per row (its lengths set directly; the entries are
zeros, which costs the same as real ones), one token per row per step, ``--steps`` timed steps
(median) after two warm-up steps. Prefill: one chunk of ``C`` tokens (batch 1) into an empty
cache; tokens/s per layer = C / ((t_big - t_small) / (L_big - L_small)).

``--impls``: kernel policies compared in the same run, written as ``DSV4_IMPLEMENTATION``
values -- ``auto`` (the CuTe kernels where they apply), ``moe_experts=xla`` (the MoE on its
XLA reference, attention kernel kept: the pre-kernel model), ``xla`` (every op on its
reference); a ``+ALGORITHM`` suffix sets the grouped GEMM's decode algorithm
(``auto+wgmma``: the WGMMA kernel on decode tiles too); a ``/unpaired`` suffix runs the
linears that share an input (``ffi.grouped_gemm_pair``) in a launch each, ``/pdl`` the
grouped GEMM's decode kernels as programmatic dependent launches (``GroupedGemmPolicy.pdl``).
Each becomes a ``KernelPolicy``. The per-kernel breakdown profiles one
step of the big stack per impl (``jax.profiler``) and lists the top device ops by total time.
Tables go to stdout and, with ``--out``, to a markdown file.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import os
import statistics
import sys
import time

import dsv4_jax as dj  # first: XLA flags
import jax
import jax.numpy as jnp

from dsv4_jax.ffi.policy import (ALGORITHM_ENV_VAR, IMPLEMENTATION_ENV_VAR,
                                 PREFILL_ALGORITHM_ENV_VAR, KernelPolicy)
from dsv4_jax.params import abstract_params
import critical_path
import step_figures as figures


def gib(n) -> float:
    return n / 2 ** 30


def stack_config(base: dj.Config, layers: int, mtp: bool = False) -> dj.Config:
    # No hash-routed layers: they send equal token ids to equal experts, so a batch would
    # touch fewer experts than in the model's 40 score-routed layers.
    return base.replace(n_layers=layers, n_mtp_layers=int(mtp), n_hash_layers=0,
                        compress_ratios=base.compress_ratios[:layers] + ((0,) if mtp else ()))


def device_params(cfg: dj.Config, only: str | None = None):
    """Parameters generated on the default device, leaf by leaf (no host copy); ``only``: the
    top-level entries starting with it."""
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: dev, abstract_params(cfg))
    params = dj.init_params(cfg, 0, shardings=shardings)
    return params if only is None else {k: v for k, v in params.items() if k.startswith(only)}


def sub_stack(params: dict, layers: int) -> dict:
    """The first ``layers`` layers of a bigger stack's parameters (same arrays, no copy)."""
    return {k: v for k, v in params.items()
            if not k.startswith("layers_") or int(k.split("_")[1]) < layers}


# --impls variants: the grouped-GEMM policy fields they change.
VARIANTS = {"": {}, "unpaired": {"pair_linears": False}, "pdl": {"pdl": True},
            "codes": {"token_codes": "gathered"}, "nocodes": {"token_codes": "none"},
            "rownorm": {"row_norm_in_kernel": True},
            "rows1": {"row_blocks": 1}, "rows2": {"row_blocks": 2},
            "ts2": {"token_stages": 2}, "ts8": {"token_stages": 8},
            "interleave": {"interleaved_split": True},
            "nointerleave": {"interleaved_split": False},
            "routedcodes": {"token_codes": "routed"}}
# Variants of the parameters (the policy unchanged): the routed experts' FP4 weights in the
# blocked layout (and the config that says so).
# Not donated: the other impls run on the originals.
PARAM_VARIANTS = {"blocked": (functools.partial(dj.block_expert_weights, donate=False),
                              {"expert_layout": "blocked"})}
# Variants of the KernelPolicy itself (not of its grouped-GEMM policy).
POLICY_VARIANTS = {"ffnsum": {"ffn_sum_in_hc_pre": True},
                   "noffnsum": {"ffn_sum_in_hc_pre": False},
                   "qrope": {"attention_rope": True}}


def policy_of(value: str) -> KernelPolicy:
    """The ``KernelPolicy`` an ``--impls`` entry names (``impl[+algorithm][/variant]``;
    ``+algorithm`` sets the grouped GEMM's decode kernel, ``+prefill:algorithm`` its prefill
    kernel; ``/unpaired``: a launch per linear, ``/pdl``: the decode kernels as programmatic
    dependent launches; ``/codes``, ``/nocodes``, ``/routedcodes``: the routed launches'
    rows quantised by XLA or by the kernels (``GroupedGemmPolicy.token_codes`` "gathered",
    "none", "routed"); ``/rownorm``: q_norm inside wq_b's kernel
    (``GroupedGemmPolicy.row_norm_in_kernel``); ``/rows1``, ``/rows2``: the ungated decode
    launches on one or two 64-row blocks per CTA (``GroupedGemmPolicy.row_blocks``);
    ``/ts2``, ``/ts8``: every decode launch that quantises its tokens with 2 or 8 token
    stages (``GroupedGemmPolicy.token_stages``); ``/interleave``, ``/nointerleave``: the
    FP4 decode launches that split K with or without interleaved K blocks
    (``GroupedGemmPolicy.interleaved_split``);
    ``/ffnsum``, ``/noffnsum``: each MoE output summed inside the next
    mHC pre, or by XLA; ``/qrope``: the queries' norm and RoPE and the output's inverse RoPE
    inside the attention op; ``/blocked``: the default policy on the routed experts' weights
    in the blocked layout, ``params_of``). Variants combine: ``auto/blocked/nointerleave``."""
    value, *variants = value.split("/")
    for variant in variants:
        if variant not in VARIANTS and variant not in POLICY_VARIANTS | PARAM_VARIANTS:
            raise ValueError(f"--impls: {value}/{variant}: the variants are "
                             f"{sorted(VARIANTS) + sorted(POLICY_VARIANTS | PARAM_VARIANTS)}")
    value, _, algorithm = value.partition("+")
    env = {} if value == "auto" else {IMPLEMENTATION_ENV_VAR: value}
    if algorithm.startswith("prefill:"):
        env[PREFILL_ALGORITHM_ENV_VAR] = algorithm.removeprefix("prefill:")
    elif algorithm:
        env[ALGORITHM_ENV_VAR] = algorithm
    policy = KernelPolicy.from_environment(env)
    for variant in variants:
        if variant in POLICY_VARIANTS:
            policy = dataclasses.replace(policy, **POLICY_VARIANTS[variant])
        elif variant in VARIANTS:
            policy = dataclasses.replace(policy, grouped_gemm=dataclasses.replace(
                policy.grouped_gemm, **VARIANTS[variant]))
    return policy


def param_variant(impl: str) -> str | None:
    """The ``PARAM_VARIANTS`` entry among an ``--impls`` entry's variants, if any."""
    found = [v for v in impl.split("/")[1:] if v in PARAM_VARIANTS]
    if len(found) > 1:
        raise ValueError(f"--impls: {impl}: at most one of {sorted(PARAM_VARIANTS)}")
    return found[0] if found else None


def params_of(impl: str, params: dict, converted: dict) -> dict:
    """The parameters an ``--impls`` entry runs on: ``params``, or for a ``PARAM_VARIANTS``
    variant their conversion, made once and kept in ``converted``."""
    variant = param_variant(impl)
    if variant is None:
        return params
    if variant not in converted:
        converted[variant] = jax.block_until_ready(PARAM_VARIANTS[variant][0](params))
    return converted[variant]


def config_of(impl: str, cfg: dj.Config) -> dj.Config:
    """The config an ``--impls`` entry runs: ``cfg``, or the one its parameters need."""
    variant = param_variant(impl)
    return cfg.replace(**PARAM_VARIANTS[variant][1]) if variant else cfg


def make_step(cfg, policy: KernelPolicy):
    model = dj.DSV4(cfg, implementation=policy, runtime_checks=False)
    return jax.jit(lambda p, t, c: model.apply({"params": p}, t, c, logits_at="last"),
                   donate_argnums=(2,))


def filled_cache(cfg, batch, ctx, max_len):
    cache = dj.Cache.init(cfg, batch, max_len)
    return cache.replace(lengths=jnp.full((batch,), ctx, jnp.int32))


def time_decode(cfg, policy, params, batch, ctx, steps):
    """Median seconds of one decode step at ``ctx`` tokens (the cache advances each step)."""
    step = make_step(cfg, policy)
    cache = filled_cache(cfg, batch, ctx, ctx + steps + 8)
    # Distinct tokens per row: equal rows would route to the same experts.
    tok = (5 + 7919 * jnp.arange(batch, dtype=jnp.int32)[:, None]) % cfg.vocab_size
    t0 = time.perf_counter()
    compiled = step.lower(params, tok, cache).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        logits, cache = compiled(params, tok, cache)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
        jax.block_until_ready(tok)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    finite = bool(jnp.all(jnp.isfinite(logits)))
    return statistics.median(times), compile_s, finite, (compiled, params, tok, cache)


def time_prefill(cfg, policy, params, chunk, runs):
    """Median seconds of one ``chunk``-token prefill (batch 1) into an empty cache."""
    step = make_step(cfg, policy)
    tokens = jax.random.randint(jax.random.key(1), (1, chunk), 2, cfg.vocab_size, jnp.int32)
    empty = dj.Cache.init(cfg, 1, chunk)
    t0 = time.perf_counter()
    compiled = step.lower(params, tokens, empty).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for i in range(runs + 1):
        cache = dj.Cache.init(cfg, 1, chunk)       # donated: a fresh one per call
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        logits, _ = compiled(params, tokens, cache)
        jax.block_until_ready(logits)
        if i >= 1:
            times.append(time.perf_counter() - t0)
    finite = bool(jnp.all(jnp.isfinite(logits)))
    fresh = dj.Cache.init(cfg, 1, chunk)
    return statistics.median(times), compile_s, finite, (compiled, params, tokens, fresh)


# ----------------------------------------------------------------------------- profile
KERNEL_GROUPS = (("grouped GEMM kernel", "GroupedGemm"),
                 ("sparse attention kernel", "SparseAttention"),
                 ("mHC pre kernel", "HcPre"),
                 ("mHC split kernel", "HcSinkhorn"),
                 ("router kernel", "RouterSm90"),
                 ("indexer score kernel", "IndexScores"),
                 ("indexer top-k kernel", "IndexTopk"))


def profile_ops(run_once, top: int = 15):
    """Trace ``run_once()`` with the JAX profiler; top device ops by total time.

    Returns ``(rows [(name, total us, count)], total us of device ops)``
    (``step_figures.trace_device_ops``), then a row per kernel of ``KERNEL_GROUPS`` that ran:
    all its launches together.
    """
    totals, counts = figures.trace_device_ops(run_once)
    total = sum(totals.values())
    rows = [(n, us, counts[n]) for n, us in totals.most_common(top)]
    # The kernels' shares of the step (their symbols carry the CuTe kernel class names);
    # the MoE's XLA glue (schedule, quantisation, gathers, per-token sum) is not in it.
    for label, key in KERNEL_GROUPS:
        us = sum(t for n, t in totals.items() if key in n)
        n = sum(c for name, c in counts.items() if key in name)
        if n:
            rows.append((f"all {label} launches", us, n))
    return rows, total


def profile_table(title, rows, total, step_s):
    lines = [f"**{title}** -- device ops {total / 1e3:.2f} ms per traced step "
             f"(wall step {step_s * 1e3:.2f} ms)", "",
             "| # | op | total (us) | calls | % of step |", "|---|---|---|---|---|"]
    for i, (name, us, n) in enumerate(rows, 1):
        short = name if len(name) <= 80 else name[:77] + "..."
        lines.append(f"| {i} | `{short}` | {us:.0f} | {n:g} | {100 * us / max(total, 1e-9):.1f}% |")
    return "\n".join(lines)


def profile_section(out: list, title: str, once):
    """Time one ``once()`` (wall), then trace another: its table goes to ``out`` and stdout."""
    t0 = time.perf_counter()
    once()
    step_s = time.perf_counter() - t0
    rows, total = profile_ops(once)
    out.append(profile_table(title, rows, total, step_s))
    print(out[-1], flush=True)


def attribution_table(title, rows, layers_in_diff):
    lines = [f"**{title}**", "", "| module | us per step | launches per step |",
             "|---|---|---|"]
    for name, us, n in rows:
        lines.append(f"| `{name}` | {us:.1f} | {n:.1f} |")
    total_us, total_n = sum(r[1] for r in rows), sum(r[2] for r in rows)
    lines.append(f"| total | {total_us:.1f} | {total_n:.1f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- sections
def run_generate(args, base, params_big, out):
    small, big = args.layers
    n = big - small
    lines = [f"### Generate path (`dj.generate`'s while loop), per layer = (t_{big} - t_{small})"
             f" / {n}; device time (the GPU's busy time: kernels that run at once count "
             f"once) and launches from a profiled loop of {figures.PROFILE_STEPS - 1} steps",
             "",
             "| impl | ctx | batch | wall/layer (ms) | device/layer (ms) | launches/layer | "
             f"floor/layer (ms) | of floor | wall L={big} (ms) | device L={big} (ms) | "
             f"launches L={big} | bytes L={big} (MB) | floor L={big} (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keep, table, converted = {}, {}, {}
    for ctx in args.ctxs:
        for batch in args.batches:
            # Every impl's two stacks are compiled first and then timed in turn, repeat by
            # repeat, so that a drift of the machine falls on all of them alike.
            runs, params = {}, {}
            for impl in args.impls:
                for layers in (small, big):
                    params[impl, layers] = sub_stack(params_of(impl, params_big, converted),
                                                     layers)
                    runs[impl, layers] = figures.generate_loop(
                        config_of(impl, stack_config(base, layers)), policy_of(impl), batch,
                        ctx, args.steps)
            timed = figures.time_interleaved(
                {key: (lambda budget, run=run, p=params[key]: run.prepare(p, budget))
                 for key, run in runs.items()}, batch, args.steps)
            for impl in args.impls:
                fig = {}
                for layers in (small, big):
                    run, (wall, _), first_s = runs[impl, layers], *timed[impl, layers]
                    by_op, op_launches = collections.Counter(), collections.Counter()
                    dev_us, launches, totals, counts = figures.generate_profile(
                        run, params[impl, layers], by_op=by_op, op_launches=op_launches)
                    fig[layers] = (wall, dev_us / 1e6, launches)
                    print(f"generate {impl} ctx={ctx} batch={batch} L={layers}: wall "
                          f"{wall * 1e3:.3f} ms/step, device {dev_us / 1e3:.3f} ms/step, "
                          f"{launches:.0f} launches/step (compile+first {first_s:.0f} s)",
                          flush=True)
                    if layers == big and batch in args.attribute_batches and ctx == args.ctxs[0]:
                        hlo = run.hlo(params[impl, layers])
                        rows = figures.attribute(totals, counts, hlo, figures.PROFILE_STEPS - 1)
                        if args.out:
                            stem = os.path.splitext(args.out)[0]
                            figures.write_op_table(f"{stem}_ops_b{batch}.tsv", totals,
                                                   counts, hlo, figures.PROFILE_STEPS - 1)
                            # With the HLO, critical_path.py's input: the step's longest
                            # chain when its launches run concurrently.
                            figures.write_hlo_op_table(f"{stem}_hloops_b{batch}.tsv", by_op,
                                                       op_launches, figures.PROFILE_STEPS - 1)
                            with open(f"{stem}_hlo_b{batch}.txt", "w") as f:
                                f.write(hlo)
                            instrs = critical_path.instructions(critical_path.loop_body(hlo))
                            op_us = {op: t / (figures.PROFILE_STEPS - 1)
                                     for op, t in by_op.items()}
                            print(critical_path.report(instrs, op_us, 1.0, 20), flush=True)
                            print(critical_path.what_ifs(instrs, op_us, 1.0,
                                                         critical_path.STANDARD_WHAT_IFS),
                                  flush=True)
                        out.append(attribution_table(
                            f"kernels by module, generate loop, {impl}, batch {batch}, ctx "
                            f"{ctx}, L={big} (layers merged), per step", rows, big - small))
                        print(out[-1], flush=True)
                    if layers == big and batch == args.profile_batch and ctx == args.ctxs[0]:
                        keep[impl] = (totals, counts, fig[big][0])
                cfg_big = stack_config(base, big)
                bytes_big = figures.step_bytes(cfg_big, range(big), batch, ctx)
                bytes_per = figures.step_bytes(cfg_big, range(small, big), batch, ctx) / n
                floor_per = bytes_per / figures.HBM_BYTES_PER_S
                per = [(fig[big][i] - fig[small][i]) / n for i in range(3)]
                table[impl, ctx, batch] = (
                    f"| {impl} | {ctx} | {batch} | {per[0] * 1e3:.3f} | {per[1] * 1e3:.3f} | "
                    f"{per[2]:.0f} | {floor_per * 1e3:.3f} | {floor_per / max(per[0], 1e-12):.0%}"
                    f" | {fig[big][0] * 1e3:.2f} | {fig[big][1] * 1e3:.2f} | {fig[big][2]:.0f} | "
                    f"{bytes_big / 1e6:.0f} | {bytes_big / figures.HBM_BYTES_PER_S * 1e3:.3f} |")
            del runs
    lines += [table[impl, ctx, batch] for impl in args.impls for ctx in args.ctxs
              for batch in args.batches]
    out.append("\n".join(lines))
    print(out[-1], flush=True)
    if args.speculative:
        run_speculative(args, base, params_big, out)
    if not args.no_profile:
        for impl, (totals, counts, wall) in keep.items():
            per = figures.PROFILE_STEPS - 1
            rows = [(name, us / per, c / per) for name, us in totals.most_common(args.top)
                    for c in [counts[name]]]
            for label, key in KERNEL_GROUPS:
                us = sum(t for name, t in totals.items() if key in name)
                c = sum(v for name, v in counts.items() if key in name)
                if c:
                    rows.append((f"all {label} launches", us / per, c / per))
            out.append(profile_table(
                f"generate loop, {impl}, batch {args.profile_batch}, ctx {args.ctxs[0]}, "
                f"L={big}, per step", rows, sum(totals.values()) / per, wall))
            print(out[-1], flush=True)


def run_speculative(args, base, params_big, out):
    """The MTP speculative loop of the big stack + its MTP block: time per generated token
    (random weights: drafts are rejected, one token per step) against the plain loop."""
    big, impl = args.layers[1], args.impls[0]
    rows_cfg = stack_config(base, big, mtp=True)
    params = dict(sub_stack(params_big, big), **device_params(rows_cfg, only="mtp_"))
    cfg, params = config_of(impl, rows_cfg), params_of(impl, params, {})
    lines = [f"### Speculative (MTP) loop, L={big} + the MTP block, per generated token "
             "(random weights: drafts are seldom accepted)", "",
             "| ctx | batch | plain (ms) | speculative (ms) |", "|---|---|---|---|"]
    for ctx in args.ctxs[:1]:
        for batch in [b for b in args.batches if b <= 8]:
            t = {}
            for spec in (False, True):
                wall, _, run = figures.time_generate(cfg, policy_of(impl), params,
                                                     batch, ctx, args.steps, speculative=spec)
                t[spec] = wall
                del run
            print(f"speculative ctx={ctx} batch={batch}: plain {t[False] * 1e3:.2f} ms, "
                  f"speculative {t[True] * 1e3:.2f} ms per token", flush=True)
            lines.append(f"| {ctx} | {batch} | {t[False] * 1e3:.2f} | {t[True] * 1e3:.2f} |")
    out.append("\n".join(lines))
    print(out[-1], flush=True)


def run_decode(args, base, params_big, out):
    small, big = args.layers
    lines = [f"### Decode, ctx {args.ctx}, per layer = (t_{big} - t_{small}) / {big - small}",
             "", "| impl | batch | step L=%d (ms) | step L=%d (ms) | per layer (ms) | "
             "tokens/s (L=%d) | finite |" % (small, big, big), "|---|---|---|---|---|---|---|"]
    keep, converted = {}, {}
    for impl in args.impls:
        policy = policy_of(impl)
        impl_params = params_of(impl, params_big, converted)
        for batch in args.batches:
            t = {}
            for layers in (small, big):
                cfg = config_of(impl, stack_config(base, layers))
                med, comp, finite, state = time_decode(cfg, policy,
                                                       sub_stack(impl_params, layers),
                                                       batch, args.ctx, args.steps)
                t[layers] = med
                print(f"decode {impl} batch={batch} L={layers}: {med * 1e3:.2f} ms "
                      f"(compile {comp:.0f} s, finite {finite})", flush=True)
                if layers == big and batch == args.profile_batch:
                    keep[impl] = state
                del state
            per = (t[big] - t[small]) / (big - small)
            lines.append(f"| {impl} | {batch} | {t[small] * 1e3:.2f} | {t[big] * 1e3:.2f} | "
                         f"{per * 1e3:.3f} | {batch / t[big]:.1f} | {finite} |")
    out.append("\n".join(lines))
    print(out[-1], flush=True)
    if not args.no_profile:
        for impl, (compiled, params, tok, cache) in keep.items():
            state = {"cache": cache}

            def once():
                logits, state["cache"] = compiled(params, tok, state["cache"])
                jax.block_until_ready(logits)
            profile_section(out, f"decode step, {impl}, batch {args.profile_batch}, L={big}",
                            once)


def run_prefill(args, base, params_big, out):
    small, big = args.layers
    lines = [f"### Prefill, batch 1, one chunk into an empty cache, per layer = "
             f"(t_{big} - t_{small}) / {big - small}", "",
             "| impl | chunk | L=%d (ms) | L=%d (ms) | per layer (ms) | tokens/s per layer | "
             "tokens/s (L=%d) |" % (small, big, big), "|---|---|---|---|---|---|---|"]
    keep, converted = {}, {}
    # A "+algorithm" suffix only changes decode tiles: prefill chunks run the same kernels
    # (a "+prefill:algorithm" suffix changes them).
    for impl in dict.fromkeys(i if "+prefill:" in i else i.partition("+")[0]
                              for i in args.impls):
        policy = policy_of(impl)
        impl_params = params_of(impl, params_big, converted)
        for chunk in args.chunks:
            if impl.partition("+")[0].partition("/")[0] != "auto" and chunk > args.xla_max_chunk:
                lines.append(f"| {impl} | {chunk} | skip | skip | | | |")
                continue
            t = {}
            for layers in (small, big):
                # Each stack on its own: whether the small one fits is a result of its own
                # (the 8192-token chunk of a 2-layer stack) when the big one does not.
                try:
                    cfg = config_of(impl, stack_config(base, layers))
                    med, comp, finite, state = time_prefill(cfg, policy,
                                                            sub_stack(impl_params, layers),
                                                            chunk, args.prefill_runs)
                except Exception as err:             # out of memory at long chunks: say so
                    if ("RESOURCE_EXHAUSTED" not in str(err)
                            and "memory" not in str(err).lower()):
                        raise
                    print(f"prefill {impl} chunk={chunk} L={layers}: out of memory",
                          flush=True)
                    continue
                t[layers] = med
                print(f"prefill {impl} chunk={chunk} L={layers}: {med * 1e3:.1f} ms "
                      f"(compile {comp:.0f} s, finite {finite})", flush=True)
                if layers == big and chunk == args.profile_chunk:
                    keep[impl] = state
                del state
            cells = {n: f"{t[n] * 1e3:.1f}" if n in t else "oom" for n in (small, big)}
            if len(t) < 2:
                lines.append(f"| {impl} | {chunk} | {cells[small]} | {cells[big]} | | | |")
                continue
            per = (t[big] - t[small]) / (big - small)
            lines.append(f"| {impl} | {chunk} | {cells[small]} | {cells[big]} | "
                         f"{per * 1e3:.2f} | {chunk / per:.0f} | {chunk / t[big]:.0f} |")
    out.append("\n".join(lines))
    print(out[-1], flush=True)
    if not args.no_profile:
        for impl, (compiled, params, tokens, cache) in keep.items():
            def once():
                fresh = jax.tree.map(jnp.copy, cache)          # donated each call
                logits, _ = compiled(params, tokens, fresh)
                jax.block_until_ready(logits)
            profile_section(out, f"prefill chunk {args.profile_chunk}, {impl}, L={big}", once)


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",")]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--generate", action="store_true",
                   help="the generate path section (default: all three)")
    p.add_argument("--decode", action="store_true", help="synced step section")
    p.add_argument("--prefill", action="store_true", help="prefill section")
    p.add_argument("--ctxs", type=ints, default=[4096], help="generate: cache lengths")
    p.add_argument("--speculative", action="store_true",
                   help="generate: also the MTP speculative loop of the big stack")
    p.add_argument("--top", type=int, default=25, help="rows of the op tables")
    p.add_argument("--layers", type=ints, default=[2, 6], help="small,big stack sizes")
    p.add_argument("--batches", type=ints, default=[1, 8, 64])
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10, help="timed decode steps")
    p.add_argument("--chunks", type=ints, default=[512, 2048, 4096, 16384])
    p.add_argument("--prefill-runs", type=int, default=3)
    p.add_argument("--xla-max-chunk", type=int, default=2048,
                   help="longest prefill chunk run with a non-auto impl (XLA's MoE runs out "
                        "of memory beyond)")
    p.add_argument("--impls", default="auto,auto+wgmma,moe_experts=xla",
                   help="kernel policies to compare, as DSV4_IMPLEMENTATION values (auto = "
                        "the kernels; +ALGORITHM: the decode algorithm)")
    p.add_argument("--profile-batch", type=int, default=8)
    p.add_argument("--attribute-batches", type=ints, default=[1, 8],
                   help="generate: batches whose kernels are attributed to modules")
    p.add_argument("--profile-chunk", type=int, default=4096)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--tiny", action="store_true", help="Config.tiny, small sizes (CPU dry run)")
    p.add_argument("--out", help="write the tables to this markdown file")
    a = p.parse_args(argv)
    if not a.decode and not a.prefill and not a.generate:
        a.decode = a.prefill = a.generate = True
    a.impls = a.impls.split(",")
    if a.tiny:
        a.ctx, a.steps, a.batches = min(a.ctx, 256), min(a.steps, 4), [1, 2]
        a.ctxs = [min(c, 256) for c in a.ctxs]
        a.chunks, a.profile_batch, a.profile_chunk = [16, 64], 2, 64
        a.prefill_runs, a.layers = 1, [2, 4]
    return a


def main(argv=None):
    args = parse_args(argv)
    dev = jax.devices()[0]
    base = dj.Config.tiny(quantized=True) if args.tiny else dj.Config.flash(quantized=True)
    small, big = args.layers
    header = (f"decode_step, {datetime.date.today()}, {dev.device_kind}, jax {jax.__version__}, "
              f"{'tiny' if args.tiny else 'Flash'} layers {small}/{big}, "
              f"`python {' '.join(sys.argv)}`")
    print("# " + header, flush=True)
    t0 = time.perf_counter()
    params = device_params(stack_config(base, big))
    jax.block_until_ready(params)
    stats = dev.memory_stats() or {}
    print(f"params generated in {time.perf_counter() - t0:.1f} s, "
          f"{gib(stats.get('bytes_in_use', 0)):.1f} GiB in use", flush=True)
    out = []
    if args.generate:
        run_generate(args, base, params, out)
    if args.decode:
        run_decode(args, base, params, out)
    if args.prefill:
        run_prefill(args, base, params, out)
    stats = dev.memory_stats() or {}
    out.append(f"peak device memory {gib(stats.get('peak_bytes_in_use', 0)):.1f} GiB")
    emit_tables(header, out, args.out)


def emit_tables(header: str, tables: list, path: str | None) -> None:
    """Print the tables and, with a ``path``, write them under the run's header."""
    text = "\n\n".join(tables)
    print("\n" + text)
    if path:
        with open(path, "w") as f:
            f.write(f"{header}\n\n{text}\n")


if __name__ == "__main__":
    main()
