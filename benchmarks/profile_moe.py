"""Run one MoE gated (w1/w3) launch at Flash dims a few times, for a profiler:

    XLA_FLAGS=--xla_gpu_enable_command_buffer= ncu --clock-control none --set full \
        -k regex:MoeGemm --launch-skip 2 --launch-count 1 -o moe \
        python3 benchmarks/profile_moe.py 8 [mma_sync | wgmma]
"""
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_kernel_ablation import setup  # noqa: E402
from moe_kernel_check import LIMIT  # noqa: E402

from dsv4_jax.ffi import moe as ms  # noqa: E402


def main():
    tokens = int(sys.argv[1])
    algorithm = sys.argv[2] if len(sys.argv) > 2 else ms.decode_algorithm()
    w1, w3, _, xa, ea, wa, touched = setup(tokens)
    config = ms.choose_config(xa.shape[0], w1[0].shape[0], "fp4", algorithm)
    order, _, *tiles = ms.moe_schedule(ea, w1[0].shape[0], config.block_n)
    up = jax.jit(lambda xs, schedule, rw: ms.grouped_gemm_sm90(
        xs, schedule, *w1, weight_b=w3[0], scale_b=w3[1], route_w=rw, swiglu_limit=LIMIT,
        config=config))
    for _ in range(4):
        jax.block_until_ready(up(xa[order], (order, *tiles), wa[order]))
    print("done", tokens, config, "experts touched", touched)


if __name__ == "__main__":
    main()
