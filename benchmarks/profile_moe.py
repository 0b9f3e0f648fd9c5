"""Device ops of the MoE at Flash dims, FP4 experts, one trace each (``jax.profiler``):
the gated (w1/w3) launch alone and the whole op ``moe_experts`` (schedule, activation
quantisation, gathers, both launches, the sum into tokens), for each token count.

    source .device/setup.sh && python3 benchmarks/profile_moe.py 1,8,64 \
        [--algorithm mma_sync|mma_fp8|wgmma]
    python3 benchmarks/profile_moe.py 1,8 --tiny       # dry run (CPU): the op on XLA only

Or, for Nsight Compute, the gated launch alone (``ncu ... -k regex:GroupedGemm``):

    python3 benchmarks/profile_moe.py 8 --algorithm mma_sync --launch-only

``--algorithm``: the ``GroupedGemmPolicy`` decode algorithm; inputs are
``dsv4_jax.ffi.cases.moe_case("flash", "fp4", T, "random")``, the launch alone
``cases.grouped_launch``.
"""
from __future__ import annotations

import argparse

import dsv4_jax  # noqa: F401  (first: XLA flags)
import jax

from dsv4_jax.ffi import cases
from dsv4_jax.ffi.moe_sm90 import moe_configs
from dsv4_jax.ffi.policy import GroupedGemmPolicy
from dsv4_jax.kernels.grouped_gemm_config import (DECODE_ALGORITHMS,
                                                  DEFAULT_DECODE_ALGORITHM)
from decode_step import profile_ops   # decode_step.py's trace reader (its owner keeps it there)

FMT = "fp4"


def print_ops(title, rows, total):
    print(f"{title}: device ops {total:.1f} us")
    for name, us, count in rows:
        print(f"  {us:9.1f} us {count:4d}x  {name[:100]}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("tokens", help="comma-separated token counts")
    p.add_argument("--algorithm", default=DEFAULT_DECODE_ALGORITHM,
                   choices=DECODE_ALGORITHMS,
                   help="decode algorithm (GroupedGemmPolicy)")
    p.add_argument("--launch-only", action="store_true",
                   help="run the gated launch a few times, untraced (for Nsight Compute)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny dims; without a GPU the op runs its XLA reference, no launch")
    args = p.parse_args(argv)
    dims = cases.DIMS["tiny" if args.tiny else "flash"]
    dry = jax.devices()[0].platform != "gpu"
    if dry and not args.tiny:
        raise SystemExit("profile_moe.py: no GPU; --tiny runs a dry run of the script")
    policy = GroupedGemmPolicy(decode_algorithm=args.algorithm)
    for tokens in (int(t) for t in args.tokens.split(",")):
        case = cases.moe_case(dims, FMT, tokens, "random")
        p = case.weights
        xa, ea, wa = cases.assignment_rows(case.x, case.idx, case.w)
        config, _ = moe_configs(ea.size, p["w1"], p["w2"], simulate=True, policy=policy)
        up, up_args = cases.grouped_launch(xa, ea, p["w1"], w_up=p["w3"], row_weights=wa,
                                           config=config, simulate=True)
        touched = cases.touched_groups(case.idx)
        if dry:
            print(f"T={tokens} gated launch {config} ({touched} experts): built, not "
                  f"launched (no GPU)")
        elif args.launch_only:
            for _ in range(4):
                jax.block_until_ready(up(*up_args))
            print("done", tokens, config)
            continue
        else:
            print_ops(f"T={tokens} gated launch {config} ({touched} experts)",
                      *profile_ops(lambda: jax.block_until_ready(up(*up_args))))
        impl = "xla" if dry else "cute"
        op = cases.moe_experts_jit(impl, case.kw, policy)
        print_ops(f"T={tokens} op moe_experts ({impl})", *profile_ops(
            lambda: jax.block_until_ready(op(*case.args)), top=25))


if __name__ == "__main__":
    main()
