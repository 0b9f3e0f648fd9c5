"""The instruction mix of a decode GEMM's K loop, on the CPU: the launch the model picks for
the routed experts at T tokens (balanced routing over 256 experts) is compiled for sm_90a as
the device compiles it, and the PTX instructions of its K loop's body -- one K block per
iteration, inside inline assembly too -- are counted by opcode. Per warp and K block,
against the issue slots a warp has at the HBM rate (4 schedulers per SM, one instruction a
cycle each, the SM's share of ``--tbps``, ``timing.PEAK_TBPS`` by default, for the K
block's weight bytes): above 1, the loop cannot keep up with HBM however its latencies
overlap (docs/performance.md).

    python3 benchmarks/loop_instruction_mix.py [--tokens 8] [--clock-ghz 1.755] [--tbps 4.3]

PTX is not SASS (ptxas fuses and expands some), and the count is static: a branch that
some warps skip (the token quantisation of warps without a tile row) counts in full. So the
counts estimate; no GPU needed. Where a ``ptxas`` that takes the PTX is on the PATH, each
launch also gets its registers and the CTAs an SM keeps resident (by registers, shared
memory and warps): fewer instructions per byte bought with registers can cost more in
latency hiding than they save (two row blocks per CTA: docs/performance.md, thirty-sixth
session). The instructions outside the loop (prologue, split sums, epilogue; static too)
show the per-CTA share.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import os
import re
import sys
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("CUTE_DSL_KEEP", "ptx")           # the PTX text in the artifacts
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

importlib.import_module("dsv4_jax.ffi.cute_call")     # pins the arch before cutlass loads
from dsv4_jax.ffi.grouped_gemm_sm90 import resolve_config, use_row_tiles  # noqa: E402
from dsv4_jax.kernels import grouped_gemm_config as support  # noqa: E402
from dsv4_jax.kernels.grouped_gemm_layout import BLOCK_K, ROW_BYTES  # noqa: E402
from grouped_gemm_compile import compile_variant, run_ptxas  # noqa: E402
from timing import PEAK_TBPS  # noqa: E402

EXPERTS, TOP_K, DIM, INTER = 256, 6, 4096, 2048        # Flash's routed experts
SMS, SCHEDULERS, CTAS_PER_SM = support.NUM_SMS, 4, 2
# sm_90 per SM: registers, warps, shared memory for CTAs (each also reserves 1 KiB).
REGISTERS_PER_SM, WARPS_PER_SM, SMEM_PER_SM, SMEM_RESERVED = 65536, 64, 228 * 1024, 1024
THREADS = 128                                          # the warp kernels' CTA


SKIP = ("//", "$", "{", "}", ".reg", ".pragma")        # not instructions


def loop_body(ptx: str) -> list[str]:
    """The instructions of the longest backward branch's range (the K loop)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines)
              if (m := re.match(r"^\s*(\$L\w+):", l))}
    back = [(labels[m.group(1)], i) for i, l in enumerate(lines)
            if re.search(r"\bbra", l) and (m := re.search(r"(\$L\w+)", l))
            and m.group(1) in labels and labels[m.group(1)] < i]
    start, end = max(back, key=lambda span: span[1] - span[0])
    return [l.strip() for l in lines[start:end + 1] if l.strip() and not l.strip().startswith(SKIP)]


def kernel_instructions(ptx: str) -> int:
    """The instructions of the PTX's kernel entry (its body between the braces)."""
    body = ptx[ptx.index(".entry"):]
    body = body[body.index("{") + 1:body.rindex("}")]
    return sum(1 for l in body.splitlines()
               if l.strip() and not l.strip().startswith(SKIP + (".", ")", "(")))


def ptxas_registers(ptx: str) -> int | None:
    """Registers per thread that ``ptxas -arch=sm_90a`` gives the kernel; None without a
    ptxas on the PATH that assembles it (``grouped_gemm_compile.run_ptxas``)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = run_ptxas(ptx, tmp)
    if result is None:
        return None
    code, log = result
    found = re.search(r"Used (\d+) registers", log)
    return int(found.group(1)) if code == 0 and found else None


def resident_ctas(registers: int, smem_bytes: int) -> dict[str, int]:
    """CTAs of ``THREADS`` threads an SM keeps at once, by each limit and overall
    (registers are allocated in 8s per thread)."""
    limits = {"registers": REGISTERS_PER_SM // (-(-registers // 8) * 8 * THREADS),
              "shared memory": SMEM_PER_SM // (smem_bytes + SMEM_RESERVED),
              "warps": WARPS_PER_SM // (THREADS // 32)}
    return {"resident": min(limits.values()), **limits}


def opcode(line: str) -> str:
    word = line.split()[1] if line.startswith("@") else line.split()[0]
    return word.split(".")[0].rstrip(";")


# (name, gated, K, N) of the routed experts' two launches. The gated one takes its rows as
# codes where XLA gathers them (GroupedGemmPolicy.token_codes "gathered"; row tiles read their
# token and quantise it); w2 quantises its own.
LAUNCHES = [("w1/w3", True, DIM, INTER), ("w2", False, INTER, DIM)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--clock-ghz", type=float, default=1.755)
    p.add_argument("--tbps", type=float, default=PEAK_TBPS,
                   help="the HBM rate the issue slots are priced at (default: the H200's; "
                        "an H100's HBM3 is ~3.35)")
    p.add_argument("--row-blocks", type=int, default=None,
                   help="64-row blocks per CTA of the ungated launch (default: as resolved)")
    a = p.parse_args()
    rows = a.tokens * TOP_K
    print(f"routed experts, Flash FP4, T = {a.tokens} ({rows} rows over {EXPERTS} experts)")
    for name, gated, k, n in LAUNCHES:
        # As the MoE op resolves them (``moe_sm90.moe_configs``): both launches' features.
        config = resolve_config(None, rows, EXPERTS, "fp4", (DIM, INTER), True, (INTER, DIM),
                                gated=gated)
        codes = gated and not use_row_tiles(rows, EXPERTS, config)
        if config.spec.quantizes_tokens:
            config = dataclasses.replace(config, token_codes=codes)
        if a.row_blocks is not None and not gated:
            config = dataclasses.replace(config, row_blocks=a.row_blocks)
        ptx = compile_variant("fp4", gated, config, a=rows, k=k, n=n, e=EXPERTS).artifacts.PTX
        body = loop_body(ptx)
        mix = collections.Counter(opcode(l) for l in body)
        # One K block of a CTA: 64 weight rows per matrix and row block (plus a 4-byte scale
        # word each).
        block_bytes = (2 if gated else config.row_blocks) * 64 * (ROW_BYTES["fp4"] + 4)
        ns = CTAS_PER_SM * block_bytes / (a.tbps * 1e12 / SMS) * 1e9
        slots_per_warp = ns * a.clock_ghz * SCHEDULERS / (CTAS_PER_SM * 4)
        print(f"{name}: {config.algorithm}, split {config.split_k}, {config.num_stages} stages, "
              f"token codes {config.token_codes}, row blocks {config.row_blocks}: "
              f"{len(body)} instructions per warp and K block of {BLOCK_K}; issue slots at "
              f"the HBM rate {slots_per_warp:.0f} "
              f"({len(body) / slots_per_warp:.2f}x)")
        print("  " + ", ".join(f"{op} {count}" for op, count in mix.most_common(16)))
        smem = config.smem_bytes("fp4", gated)
        outside = kernel_instructions(ptx) - len(body)
        registers = ptxas_registers(ptx)
        if registers is None:
            print(f"  outside the loop {outside} instructions; shared memory "
                  f"{smem / 1024:.1f} KiB (no ptxas here: registers not counted)")
        else:
            ctas = resident_ctas(registers, smem)
            print(f"  outside the loop {outside} instructions; {registers} registers, "
                  f"{smem / 1024:.1f} KiB shared: {ctas['resident']} resident CTAs per SM "
                  f"(by registers {ctas['registers']}, shared memory "
                  f"{ctas['shared memory']}, warps {ctas['warps']})")


if __name__ == "__main__":
    main()
