"""Device ops of the MoE at Flash dims, FP4 experts, one trace each (``jax.profiler``):
the gated (w1/w3) launch alone and the whole op ``moe_experts`` (schedule, activation
quantisation, gathers, both launches, the sum into tokens), for each token count.

    source .device/setup.sh && python3 benchmarks/profile_moe.py 1,8,64 [mma_sync|mma_fp8|wgmma]

Or, for Nsight Compute, the gated launch alone (``ncu ... -k regex:GroupedGemm``):

    python3 benchmarks/profile_moe.py 8 mma_sync --launch-only
"""
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_step import profile_ops  # noqa: E402
from moe_kernel_ablation import setup  # noqa: E402
from moe_kernel_check import LIMIT, launch  # noqa: E402

from dsv4_jax.ffi import moe as ms  # noqa: E402


def print_ops(title, rows, total):
    print(f"{title}: device ops {total:.1f} us")
    for name, us, count in rows:
        print(f"  {us:9.1f} us {count:4d}x  {name[:100]}")


def main():
    token_counts = [int(v) for v in sys.argv[1].split(",")]
    algorithm = sys.argv[2] if len(sys.argv) > 2 else ms.decode_algorithm()
    os.environ[ms.ALGORITHM_ENV_VAR] = algorithm
    for tokens in token_counts:
        w1, w3, w2, xa, ea, wa, touched = setup(tokens)
        experts = w1[0].shape[0]
        config = ms.choose_config(xa.shape[0], experts, "fp4", algorithm)
        order, _, *tiles = ms.moe_schedule(ea, experts, config.block_n)
        # Weights are arguments, not constants folded into the program.
        up = jax.jit(lambda xs, schedule, rw, w1, w3: launch(
            xs, schedule, *w1, config, weight_b=w3[0], scale_b=w3[1], route_w=rw,
            swiglu_limit=LIMIT))
        args = (xa[order], (order, *tiles), wa[order], w1, w3)
        if "--launch-only" in sys.argv:
            for _ in range(4):
                jax.block_until_ready(up(*args))
            print("done", tokens, config)
            continue
        print_ops(f"T={tokens} gated launch {config} ({touched} experts)",
                  *profile_ops(lambda: jax.block_until_ready(up(*args))))
        x = xa[::6]
        idx = ea.reshape(tokens, 6)
        route_w = jnp.full(idx.shape, 0.5, jnp.float32)
        op = jax.jit(lambda x, i, w, w1, w3, w2: ms.moe_experts(
            x, i, w, w1, w3, w2, swiglu_limit=LIMIT, quantized=True, simulate=True,
            implementation="cute"))
        print_ops(f"T={tokens} op moe_experts", *profile_ops(
            lambda: jax.block_until_ready(op(x, idx, route_w, w1, w3, w2)), top=25))


if __name__ == "__main__":
    main()
