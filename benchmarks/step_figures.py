"""Model-level decode figures on the path users run: ``dj.generate``'s while loop, its wall and
device time per step, kernel launches per step, and the bytes a step must read against the
HBM floor. Used by ``decode_step.py``.

* Generate path: ``build_programs(plain_method(model, Greedy())).loop`` -- the jitted
  ``lax.while_loop`` that ``dj.generate`` runs after prefill -- on a cache whose rows already
  hold ``ctx`` tokens, with no stop token (every row runs its whole budget). One program
  (compiled for the longest budget) runs two budgets; wall per step = the difference of the
  two runs over the difference of their step counts (the loop's fixed cost cancels).
* Device time and launches: one loop of ``PROFILE_STEPS`` steps traced with the JAX profiler;
  device time per step = the GPU streams' kernel time / steps, launches per step = their
  kernel events / steps (kernels inside CUDA graphs are events too).
* Bytes: what a decode step must read at least -- every weight of the layers except the
  routed experts, the experts a batch of ``B`` tokens touches in expectation
  (``E (1 - (1 - k / E)^B)`` of them), the LM head, and the cache entries attention and the
  indexer read; floor = bytes / 4.3 TB/s.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time

import numpy as np
import jax
import jax.numpy as jnp

import dsv4_jax as dj
from dsv4_jax.decoding import build_programs, run_prefill
from dsv4_jax.generation import plain_method
from dsv4_jax.speculative import speculative_method
from dsv4_jax.params import abstract_params

HBM_BYTES_PER_S = 4.3e12
PROFILE_STEPS = 8


def filled_cache(cfg, batch: int, ctx: int, max_len: int, kv_dtype: str | None = None,
                 mesh=None):
    """A cache whose rows hold ``ctx`` tokens (lengths set; entries zero -- the same cost);
    with ``mesh``, split over its batch axes as ``Cache.init`` splits it."""
    cache = dj.Cache.init(cfg, batch, max_len, kv_dtype=kv_dtype, mesh=mesh)
    lengths = jnp.full((batch,), ctx, jnp.int32)
    if mesh is not None:
        lengths = jax.device_put(lengths, cache.lengths.sharding)
    return cache.replace(lengths=lengths)


def generate_loop(cfg, policy, batch: int, ctx: int, steps: int, speculative: bool = False,
                  kv_dtype: str | None = None, mesh=None):
    """The jitted ``loop`` program of ``dj.generate`` and its arguments on a filled cache:
    ``run(params, budget)``; ``run.prepare(params, budget)`` makes the arguments (the cache,
    a device allocation) and returns ``go()``, the loop alone, so that timings and traces
    leave them out; ``run.hlo(params)`` is the compiled program's HLO text.
    ``speculative``: MTP drafting (``speculative_method``; its state comes from a one-token
    prefill on the filled cache). ``mesh``: the model and cache on a device mesh (``batch``
    one the mesh splits evenly, ``mesh_rules.padded_rows``)."""
    model = dj.DSV4(cfg, implementation=policy, mesh=mesh, runtime_checks=False)
    method = (speculative_method if speculative else plain_method)(model, dj.Greedy())
    programs = build_programs(method)
    first = (5 + 7919 * jnp.arange(batch, dtype=jnp.int32)) % cfg.vocab_size
    stop = jnp.array([-7], jnp.int32)                  # never sampled: rows run the budget
    key = jax.random.key(0)

    def args(params, budget):
        cache = filled_cache(cfg, batch, ctx, ctx + 2 * steps + 8, kv_dtype, mesh)
        budget = jnp.int32(budget)
        if not speculative:
            return (params, first, jnp.zeros((batch,), jnp.float32), first, cache, key, stop,
                    budget)
        tok, tok_lp, state, _, _, cache = run_prefill(
            programs, params, first[:, None], jnp.ones((batch,), jnp.int32), cache, key, stop,
            budget)
        return params, tok, tok_lp, state, cache, key, stop, budget

    def prepare(params, budget):
        ready = jax.block_until_ready(args(params, budget))
        return lambda: programs.loop(*ready, steps=steps)[0]

    def run(params, budget):
        return prepare(params, budget)()

    run.prepare = prepare

    run.hlo = lambda params: programs.loop.lower(*args(params, 2), steps=steps).compile(
    ).as_text()
    return run


def time_generate(cfg, policy, params, batch: int, ctx: int, steps: int, repeats: int = 3,
                  speculative: bool = False, kv_dtype: str | None = None, mesh=None):
    """Wall seconds per generated token of the generate loop (median over ``repeats`` of the
    two-budget difference; one token per step without speculation) and the compile +
    first-run seconds."""
    run = generate_loop(cfg, policy, batch, ctx, steps, speculative, kv_dtype, mesh)
    (per_step, _), first_s = time_interleaved(
        {"": lambda budget: run.prepare(params, budget)}, batch, steps, repeats)[""]
    return per_step, first_s, run


def time_interleaved(runs: dict, batch: int, steps: int, repeats: int = 3,
                     tries: int = 3) -> dict:
    """``{name: ((median s per step, [s per step of each repeat]), compile + first-run s)}``
    of generate loops ``runs`` (``prepare(budget) -> go``: ``generate_loop``'s
    ``run.prepare`` with its parameters bound; ``batch`` rows each): every repeat times each
    run's short and long budget in turn, so a drift of the machine (clocks, a neighbour)
    falls on all of them alike; only ``go()`` is timed (the fresh cache each loop consumes is
    made before the clock starts), the fastest of ``tries`` runs per budget (a host's or a
    neighbour's delays only ever add time); per step = the two budgets' difference over
    their step counts."""
    short = max(2, steps // 4)
    first = {}
    for name, prepare in runs.items():
        t0 = time.perf_counter()
        out = jax.block_until_ready(prepare(steps)())
        first[name] = time.perf_counter() - t0
        assert int(jnp.sum(out >= 0)) == batch * steps, "a row stopped before its budget"
    per_step = {name: [] for name in runs}
    for _ in range(repeats):
        for name, prepare in runs.items():
            times = {budget: min(_seconds(prepare(budget)) for _ in range(tries))
                     for budget in (short, steps)}
            per_step[name].append((times[steps] - times[short]) / (steps - short))
    return {name: ((statistics.median(v), v), first[name]) for name, v in per_step.items()}


def _seconds(go) -> float:
    """Wall seconds of ``go()`` until its outputs are ready."""
    t0 = time.perf_counter()
    jax.block_until_ready(go())
    return time.perf_counter() - t0


def busy_us(intervals) -> float:
    """Length of the union of ``(start, end)`` intervals: the time a device had at least one
    op running. Kernels that run at once (concurrent commands of a CUDA graph, several
    streams) count once, where a sum of their durations counts each."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def trace_device_ops(run_once, samples: dict | None = None, copies=None,
                     by_device: dict | None = None, prepare=None, busy: dict | None = None,
                     by_op=None, op_launches=None):
    """``run_once()`` (with ``prepare``: ``run_once(prepare())``, its inputs made before the
    trace starts) under the JAX profiler: ``Counter`` of total us and of calls per device
    op name (GPU streams; on a CPU-only run the XLA ops of the host threads). ``samples``, if
    given, receives the trace arguments of each name's first event (the HLO op that launched
    a kernel); ``copies`` (a ``Counter``) the total us of each copy by
    ``"<module>/<op> <size> B"``; ``by_device`` (a dict) a ``Counter`` of total us per op
    name for each device (the trace's process name, e.g. ``/device:GPU:1``); ``busy`` (a
    dict) each device's busy us (``busy_us`` of its ops' intervals); ``by_op`` and
    ``op_launches`` (``Counter``s) the total us and the launches of each HLO op (the event's
    ``hlo_op``: a CuTe kernel's custom call, an XLA fusion)."""
    log_dir = tempfile.mkdtemp(prefix="dsv4_profile_")
    inputs = () if prepare is None else (prepare(),)
    run_once(*inputs)
    inputs = () if prepare is None else (prepare(),)
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        run_once(*inputs)
    files = glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True)
    totals, counts = collections.Counter(), collections.Counter()
    if not files:
        return totals, counts
    with gzip.open(files[0]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, n in names.items() if "/device:GPU" in n}
    pids = gpu or {pid for pid, n in names.items() if "/host:CPU" in n}
    intervals = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in pids and "dur" in e:
            if not gpu and not e.get("args", {}).get("hlo_op"):
                continue
            totals[e["name"]] += e["dur"]
            counts[e["name"]] += 1
            intervals[names[e["pid"]]].append((e["ts"], e["ts"] + e["dur"]))
            if by_device is not None:
                by_device.setdefault(names[e["pid"]], collections.Counter())[e["name"]] += \
                    e["dur"]
            args = e.get("args", {})
            if by_op is not None and args.get("hlo_op"):
                by_op[args["hlo_op"]] += e["dur"]
            if op_launches is not None and args.get("hlo_op"):
                op_launches[args["hlo_op"]] += 1
            if samples is not None:
                samples.setdefault(e["name"], args)
            if copies is not None and e["name"].startswith("Memcpy"):
                size = args.get("memcpy_details", "").rpartition("size:")[2].split(" ")[0]
                copies[f"{args.get('hlo_module')}/{args.get('hlo_op')} {size} B"] += e["dur"]
    if busy is not None:
        busy.update({device: busy_us(spans) for device, spans in intervals.items()})
    return totals, counts


def generate_profile(run, params, steps: int = PROFILE_STEPS, samples: dict | None = None,
                     copies=None, by_device: dict | None = None, by_op=None,
                     op_launches=None):
    """Device us per step -- the devices' busy time (``busy_us``, summed over devices), not
    the sum of op durations, which counts ops that run at once twice --, launches per step
    and the op table of a ``steps``-step loop (``samples``, ``copies``, ``by_device``,
    ``by_op``, ``op_launches``: as ``trace_device_ops``)."""
    busy = {}
    totals, counts = trace_device_ops(lambda go: jax.block_until_ready(go()), samples, copies,
                                      by_device, prepare=lambda: run.prepare(params, steps),
                                      busy=busy, by_op=by_op, op_launches=op_launches)
    per = steps - 1                                   # the loop runs budget - 1 model steps
    return sum(busy.values()) / per, sum(counts.values()) / per, totals, counts


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = ")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_LAYER = re.compile(r"layers_\d+")


def op_sources(hlo_text: str) -> dict[str, str]:
    """Kernel name (HLO instruction name with '.' as '_') -> the JAX op path of its
    ``op_name`` metadata (e.g. ``jit(loop)/while/body/DSV4/layers_3/...``)."""
    out = {}
    for line in hlo_text.splitlines():
        m, op = _INSTRUCTION.match(line), _OP_NAME.search(line)
        if m and op:
            out[m.group(1).replace(".", "_")] = op.group(1)
    return out


def module_of(op_name: str, depth: int = 3) -> str:
    """The model module an op belongs to: ``layers_*/attn/indexer`` for
    ``.../DSV4/layers_3/layers_3.block/attn/indexer/top_k`` (layers merged, at most ``depth``
    parts; the last part of an op path is the primitive itself)."""
    parts = op_name.split("/DSV4/", 1)[-1].split("/")[:-1]
    keep = []
    for p in parts:
        if any(c in p for c in "(),>=") or p in ("cond", "branch_0_fun", "branch_1_fun"):
            break                                   # past the modules: an einsum, a jit
        if p.endswith(".block") or p.startswith("DSV4."):
            continue
        keep.append(_LAYER.sub("layers_*", p).replace("layers_*._", ""))
    return "/".join(keep[:depth]) or "(step)"


# CuTe kernel class names -> the op they belong to.
CUTE_KERNELS = (("GroupedGemm", "grouped GEMM"), ("SparseAttention", "sparse attention"),
                ("HcPre", "mHC pre"), ("HcSinkhorn", "mHC split"), ("RouterSm90", "router"),
                ("IndexScores", "indexer scores"),
                ("IndexTopk", "indexer top-k"))


def kernel_sources(totals, hlo_text: str) -> dict[str, str]:
    """Each traced kernel's op path (CuTe kernels by their class: their launches sit in
    ``call_wrapper`` functions; unknown names -- copies XLA adds -- as ``(unknown)``)."""
    sources = op_sources(hlo_text)
    out = {}
    for name in totals:
        if "kernel_cutlass" in name:
            label = next((label for key, label in CUTE_KERNELS if key in name), "other")
            out[name] = f"kernel: {label}/x"
        else:
            out[name] = sources.get(name.replace(".", "_"), "(unknown)/x")
    return out


def attribute(totals, counts, hlo_text: str, steps: int, depth: int = 3):
    """``[(module, us per step, launches per step)]`` of a traced loop, by the op path of each
    kernel."""
    us, n = collections.Counter(), collections.Counter()
    for name, path in kernel_sources(totals, hlo_text).items():
        key = path.split("/")[0] if path.startswith(("kernel:", "(unknown)")) else \
            module_of(path, depth)
        us[key] += totals[name] / steps
        n[key] += counts[name] / steps
    return sorted(((k, us[k], n[k]) for k in us), key=lambda r: -r[2])


def write_hlo_op_table(path: str, by_op, op_launches, steps: int) -> None:
    """us and launches per step of each HLO op (``trace_device_ops``'s ``by_op`` and
    ``op_launches``), the TSV ``critical_path.py`` reads."""
    with open(path, "w") as f:
        f.write("hlo_op\tus_per_step\tlaunches_per_step\n")
        for op, t in by_op.most_common():
            f.write(f"{op}\t{t / steps:.3f}\t{op_launches[op] / steps:.2f}\n")


def write_op_table(path: str, totals, counts, hlo_text: str, steps: int) -> None:
    """Every traced kernel: name, us and launches per step, op path (TSV, by time)."""
    sources = kernel_sources(totals, hlo_text)
    with open(path, "w") as f:
        f.write("kernel\tus_per_step\tlaunches_per_step\top_path\n")
        for name, t in totals.most_common():
            f.write(f"{name}\t{t / steps:.2f}\t{counts[name] / steps:.2f}\t{sources[name]}\n")


# ----------------------------------------------------------------------------- bytes
def _nbytes(leaf) -> int:
    return int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize


def layer_weight_bytes(cfg, layer: int) -> tuple[int, int]:
    """(bytes of layer ``layer``'s weights other than the routed experts, bytes of one routed
    expert's three projections with scales)."""
    params = abstract_params(cfg)[f"layers_{layer}"]
    flat = jax.tree_util.tree_leaves_with_path(params)
    dense = sum(_nbytes(v) for p, v in flat if "experts" not in jax.tree_util.keystr(p)
                or "shared_experts" in jax.tree_util.keystr(p))
    experts = sum(_nbytes(v) for p, v in flat if "['experts']" in jax.tree_util.keystr(p))
    return dense, experts // cfg.n_routed_experts


def touched_experts(cfg, tokens: int) -> float:
    """Expected distinct routed experts of ``tokens`` independent tokens."""
    e, k = cfg.n_routed_experts, cfg.n_activated_experts
    return e * (1 - (1 - k / e) ** tokens)


def cache_read_bytes(cfg, layer: int, batch: int, ctx: int) -> int:
    """Cache bytes one decode step of layer ``layer`` reads: the window, the compressed
    entries attention attends (CSA: the top-k, HCA: all) and the indexer keys it scores."""
    c, item = cfg.head_dim, jnp.dtype(cfg.dtype).itemsize
    kind = cfg.layer_kind(layer)
    entries = cfg.window_size
    keys = 0
    if kind == "csa":
        n = ctx // 4
        entries += min(cfg.index_topk, n)
        keys = n * cfg.index_head_dim * item
    elif kind == "hca":
        entries += ctx // 128
    return batch * (entries * c * item + keys)


def step_bytes(cfg, layers, batch: int, ctx: int) -> int:
    """Bytes the decode step of the given layers must read (no embedding or head)."""
    total = 0
    for i in layers:
        dense, per_expert = layer_weight_bytes(cfg, i)
        total += dense + int(touched_experts(cfg, batch) * per_expert)
        total += cache_read_bytes(cfg, i, batch, ctx)
    return total


def head_bytes(cfg) -> int:
    return cfg.vocab_size * cfg.dim * jnp.dtype(cfg.dtype).itemsize
