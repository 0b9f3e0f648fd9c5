"""Where the time of one GPU test case of the MoE op goes, phase by phase (weights, the op's
first call = compile + run, its second call, the reference), printed as each phase ends, so
that a case that stalls shows the phase it stalls in.

    source .device/setup.sh && python3 benchmarks/moe_case_phases.py flash-fp4-3-one_expert \
        pro-fp8-8-random [--algorithm mma_sync] [--prefill-algorithm wgmma_fp8] [--split-k 4]
    python3 benchmarks/moe_case_phases.py --tiny          # dry run (CPU): tiny dims, XLA

Cases are ``dims-format-tokens-routing`` as in ``tests/test_moe.py``'s test ids, built by
the same ``dsv4_jax.ffi.cases.moe_case``, with the checks of the tests'
``cases.check_against_reference`` (finite, repeatable, relative error under 1e-2 against
``cases.moe_reference_chunked``) reported (``cases.compare_to_reference``). ``--tiny``: the cases at the tiny
dims (default: a few of them), the op's XLA reference where there is no GPU.
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile
import time

# The CuTe DSL environment of the GPU tests (tests/conftest.py), read once when cutlass is
# imported, so that a case builds its kernels as it does there: the sm_90a target, the PTX
# kept in a fresh folder (the kernel disk cache is keyed by these variables too).
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("CUTE_DSL_KEEP", "ptx")
if "CUTE_DSL_DUMP_DIR" not in os.environ:
    os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(prefix="dsv4_cute_dump_")
    atexit.register(shutil.rmtree, os.environ["CUTE_DSL_DUMP_DIR"], ignore_errors=True)

import dsv4_jax  # noqa: E402,F401  (first: XLA flags)
import jax  # noqa: E402

from dsv4_jax.ffi import cases  # noqa: E402
from dsv4_jax.ffi.moe_sm90 import moe_configs  # noqa: E402
from dsv4_jax.ffi.policy import GroupedGemmPolicy  # noqa: E402
from policy_flags import add_policy_flags, policy_of_flags  # noqa: E402

TOL = 1e-2                                 # tests/test_moe.py's tolerance
TINY_CASES = ("tiny-fp4-3-random", "tiny-fp8-8-dropped", "tiny-bf16-8-few_experts",
              "tiny-fp4-64-one_expert")


def phases(case_name: str, implementation: str, policy: GroupedGemmPolicy) -> None:
    dims, fmt, t, routing = case_name.split("-")
    start = time.perf_counter()

    def mark(what):
        print(f"{case_name}: {what} at {time.perf_counter() - start:7.2f} s", flush=True)

    case = cases.moe_case(dims, fmt, int(t), routing)
    mark("weights")
    p = case.weights
    rows = case.idx.size
    configs = moe_configs(rows, p["w1"], p["w2"], simulate=fmt != "bf16", policy=policy)
    mark(f"rows {rows}, configs {configs}")
    compiled = cases.moe_experts_jit(implementation, case.kw, policy).lower(
        *case.args).compile()
    mark(f"op compiled ({implementation})")
    got = jax.block_until_ready(compiled(*case.args))
    mark("op first run")
    again = jax.block_until_ready(compiled(*case.args))
    mark("op second run")
    want = jax.block_until_ready(cases.moe_reference_chunked(*case.args, **case.kw))
    mark("reference")
    print(f"{case_name}: {cases.compare_to_reference(got, want, TOL, again=again)}",
          flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cases", nargs="*", help="dims-format-tokens-routing, e.g. flash-fp4-8-random")
    add_policy_flags(p)
    p.add_argument("--tiny", action="store_true",
                   help="the cases at tiny dims (default: a few), XLA where there is no GPU")
    args = p.parse_args(argv)
    policy = policy_of_flags(args)
    names = args.cases
    if args.tiny:
        names = ["-".join(["tiny", *n.split("-")[1:]]) for n in names] or list(TINY_CASES)
    if not names:
        p.error("name at least one case (or --tiny)")
    on_gpu = jax.devices()[0].platform == "gpu"
    if not on_gpu and not args.tiny:
        raise SystemExit("moe_case_phases.py: no GPU; --tiny runs a dry run of the script")
    for name in names:
        phases(name, "cute" if on_gpu else "xla", policy)


if __name__ == "__main__":
    main()
