"""The grouped GEMM's kernel choices as command-line flags, for the MoE benchmarks that run
one ``GroupedGemmPolicy`` (``moe_kernel_check.py``, ``moe_case_phases.py``)."""
from __future__ import annotations

import argparse

from dsv4_jax.ffi.policy import GroupedGemmPolicy
from dsv4_jax.kernels.grouped_gemm_config import (DECODE_ALGORITHMS,
                                                  DEFAULT_DECODE_ALGORITHM,
                                                  DEFAULT_PREFILL_ALGORITHM, MAX_SPLIT_K,
                                                  PREFILL_ALGORITHMS)


def add_policy_flags(parser: argparse.ArgumentParser) -> None:
    """``--algorithm``, ``--prefill-algorithm`` and ``--split-k`` (default 1: no K split)."""
    parser.add_argument("--algorithm", default=DEFAULT_DECODE_ALGORITHM,
                        choices=DECODE_ALGORITHMS,
                        help="decode algorithm (GroupedGemmPolicy)")
    parser.add_argument("--prefill-algorithm", default=DEFAULT_PREFILL_ALGORITHM,
                        choices=PREFILL_ALGORITHMS,
                        help="prefill algorithm (GroupedGemmPolicy)")
    parser.add_argument("--split-k", type=int, default=1,
                        help=f"K split of the decode kernels, 1-{MAX_SPLIT_K} "
                             "(GroupedGemmPolicy)")


def policy_of_flags(args: argparse.Namespace) -> GroupedGemmPolicy:
    return GroupedGemmPolicy(args.algorithm, args.prefill_algorithm, args.split_k)
