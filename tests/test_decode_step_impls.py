"""``benchmarks/decode_step.py --impls`` without a GPU: an entry's variants combine into one
kernel policy, at most one of them changes the parameters (and the config with them), and a
name it does not know is refused in one line that lists the known ones."""
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import decode_step  # noqa: E402
from dsv4_jax.config import Config  # noqa: E402
from dsv4_jax.ffi.policy import KernelPolicy  # noqa: E402


def test_variants_combine_into_one_policy():
    default = KernelPolicy.from_environment({})
    policy = decode_step.policy_of("auto/blocked/nointerleave/ts2/ffnsum")
    assert policy.grouped_gemm.interleaved_split is False
    assert policy.grouped_gemm.token_stages == 2
    assert policy.ffn_sum_in_hc_pre is True
    # Everything else as the default policy.
    assert policy.grouped_gemm.pair_linears == default.grouped_gemm.pair_linears
    assert decode_step.policy_of("auto/blocked") == default
    assert decode_step.policy_of("auto") == default


def test_the_parameter_variant_sets_the_config():
    cfg = Config.tiny(quantized=True)
    assert decode_step.param_variant("auto/nointerleave/blocked") == "blocked"
    assert decode_step.param_variant("auto/nointerleave") is None
    assert decode_step.config_of("auto/nointerleave/blocked", cfg).expert_layout == "blocked"
    assert decode_step.config_of("auto/nointerleave", cfg) is cfg
    params = {"embed": object()}
    assert decode_step.params_of("auto/nointerleave", params, {}) is params


def test_unknown_variants_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^--impls: auto/nope: the variants are \[.*'blocked'"):
        decode_step.policy_of("auto/blocked/nope")
