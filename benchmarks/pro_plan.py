"""DSV4-Pro on 8 devices, planned on abstract shapes: prints markdown tables (no arguments).

Runs on 8 simulated CPU devices (sets XLA_FLAGS before JAX starts; nothing Pro-sized is
allocated): every parameter's per-device shard, per-device parameters + cache (32k context)
+ one step's activations against an H200, the expert-parallel all-to-all sizes, and the
compiler's memory analysis of reduced Pro stacks (real dimensions, one layer) on the mesh.

    python benchmarks/pro_plan.py > pro_plan.md       # ~1 min on 2 CPU cores
"""
from __future__ import annotations

import os
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dsv4_jax as dj  # noqa: E402  (first: XLA flags)
from dsv4_jax import plan, sharding  # noqa: E402
from dsv4_jax.mesh_rules import padded_rows  # noqa: E402

GIB = 2 ** 30
MAX_LEN = 32768
MESHES = ((1, 8), (2, 4), (8, 1))
# (label, batch, tokens per row): decode at batch 1/8/64 and one prefill chunk of 8 x 1024
STEPS = (("decode b=1", 1, 1), ("decode b=8", 8, 1), ("decode b=64", 64, 1),
         ("prefill 8x1024", 8, 1024))
ALLOC_LIMIT = 0.93 * plan.H200_BYTES       # XLA_PYTHON_CLIENT_MEM_FRACTION of run_multi_gpu.sh


def gib(n) -> str:
    return f"{n / GIB:.2f}"


def table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def padded(batch: int, mesh) -> int:
    """The batch the mesh runs for ``batch`` rows (``mesh_rules.padded_rows``)."""
    return padded_rows(mesh, batch)


def main():
    cfg = dj.Config.pro(quantized=True)
    abstract = dj.abstract_params(cfg)
    print(f"# DSV4-Pro plan on 8 devices ({dj.param_count(cfg) / 1e12:.3f}T parameters, "
          f"checkpoint precision, max_len {MAX_LEN})\n")

    mesh = sharding.make_mesh(data=1, expert=8)
    rows = plan.group_shard_table(plan.shard_table(cfg, mesh, abstract))
    print("## Parameter shards on mesh data=1 x expert=8 (block index folded: `layers_*`)\n")
    print(table(("parameter", "global shape", "dtype", "spec", "shard per device", "leaves",
                 "MiB per device (all leaves)"),
                [(f"`{r['path']}`", r["shape"], r["dtype"], r["spec"], r["shard"], r["count"],
                  f"{r['total_bytes'] / 2**20:.1f}")
                 for r in sorted(rows, key=lambda r: -r["total_bytes"])]))
    total = sum(r["total_bytes"] for r in rows)
    print(f"\nSum of the shards: {gib(total)} GiB per device.\n")

    print(f"## Per-device memory (GiB) against one H200 ({gib(plan.H200_BYTES)} GiB; "
          f"allocator limit at fraction 0.93: {gib(ALLOC_LIMIT)} GiB)\n")
    out = []
    for shape in MESHES:
        m = sharding.make_mesh(*shape)
        for label, batch, seq in STEPS:
            b = padded(batch, m)
            for moe in ("kernel", "xla"):
                p = plan.memory_plan(cfg, m, batch=b, seq=seq, max_len=MAX_LEN, moe=moe,
                                     device_bytes=int(ALLOC_LIMIT), abstract=abstract)
                out.append((f"{shape[0]}x{shape[1]}", label, b, moe, gib(p["params"]),
                            gib(p["cache"]), gib(p["activations"]), gib(p["total"]),
                            "yes" if p["fits"] else "no"))
    print(table(("data x expert", "step", "rows run", "MoE path", "params", f"cache ({MAX_LEN})",
                 "activations (estimate)", "total", "fits 0.93 x H200"), out))

    print("\n## Expert-parallel all-to-all per device (mesh 1 x 8, worst-case capacity)\n")
    out = []
    for label, batch, seq in STEPS:
        b = padded(batch, mesh)
        a = plan.all_to_all_sizes(cfg, mesh, b, seq)
        out.append((label, b, a["tokens"], a["assignments"], a["slots"],
                    f"{a['dispatch_buffer_bytes'] / 2**20:.3f}",
                    f"{a['combine_buffer_bytes'] / 2**20:.3f}",
                    f"{a['sent_bytes_per_layer'] / 2**20:.3f}",
                    f"{a['useful_bytes_per_layer'] / 2**20:.3f}",
                    f"{a['sent_bytes_per_step'] / 2**20:.1f}"))
    print(table(("step", "rows", "tokens t / device", "assignments a", "slots n a",
                 "dispatch buffer MiB", "combine buffer MiB", "sent MiB / layer",
                 "of which real MiB", f"sent MiB / step ({cfg.n_layers} layers)"), out))

    print("\n## Compiled on the 8-CPU-device mesh: reduced Pro stacks (real dims, XLA path)\n")
    out = []
    for ratios, batch, seq in (((4,), 8, 1), ((128,), 8, 1), ((4,), 64, 1), ((4,), 8, 1024)):
        rc = plan.reduced_config(cfg, ratios)
        t = time.perf_counter()
        compiled = plan.abstract_step(rc, mesh, batch, seq, MAX_LEN).compile()
        seconds = time.perf_counter() - t
        ma = compiled.memory_analysis()
        est = plan.step_activation_estimate(rc, mesh, batch, seq, MAX_LEN, moe="xla")
        out.append((rc.layer_kind(0), f"{batch}x{seq}", f"{seconds:.1f}",
                    gib(ma.argument_size_in_bytes), gib(ma.temp_size_in_bytes),
                    gib(est["total"])))
    print(table(("layer", "batch x tokens", "lower+compile s (CPU)", "arguments GiB",
                 "temp GiB (compiler)", "formula, XLA path GiB"), out))


if __name__ == "__main__":
    main()
