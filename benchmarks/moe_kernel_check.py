"""GPU check of the MoE kernels (H100/H200): exactness, numerics vs the op's reference, timings.

    source .device/setup.sh && python3 benchmarks/moe_kernel_check.py
    source .device/setup.sh && python3 benchmarks/moe_kernel_check.py --algorithm mma_sync
    source .device/setup.sh && python3 benchmarks/moe_kernel_check.py --split-k 4
    source .device/setup.sh && python3 benchmarks/moe_kernel_check.py --prefill \
        --prefill-algorithm wgmma_fp8                        # prefill tiles only
    python3 benchmarks/moe_kernel_check.py --tiny           # dry run (CPU)

``--algorithm``, ``--prefill-algorithm``, ``--split-k``: the ``GroupedGemmPolicy`` the kernel
configs come from (defaults: the op's). ``--tiny``: every case at the tiny dims; without a
GPU nothing is launched -- the configs, inputs and launch arguments are built and the op's
XLA reference is checked against the chunked reference.

* exact: one-hot token rows read every weight back through one launch of the grouped GEMM
  (FP4, FP8, BF16 weights, scale exponents over -37..32): must equal the dequantised weights
  bit for bit;
* cases (``dsv4_jax.ffi.cases.moe_case``): ``moe_experts(implementation="cute")`` vs the
  op's reference (``cases.moe_reference_chunked``): relative error (the GPU tests' tolerance),
  repeatability of two calls, finite; the op's time, that of the gated launch (up) and of
  the w2 launch (down) alone (``timing.back_to_back_seconds``: the same inputs call after
  call, so part of the weights may stay in the L2); GB/s over the touched experts' bytes,
  useful TF/s 2 T k 3 d inter.
"""
from __future__ import annotations

import argparse

import dsv4_jax  # noqa: F401  (first: XLA flags)
import jax
import jax.numpy as jnp

from dsv4_jax import quant
from dsv4_jax.ffi import cases
from dsv4_jax.ffi.grouped_gemm_sm90 import grouped_gemm_cute, resolve_config
from dsv4_jax.ffi.moe_sm90 import moe_configs, moe_support
from policy_flags import add_policy_flags, policy_of_flags
from timing import back_to_back_seconds, rates

TOL = 1e-2                          # the GPU tests' tolerance (tests/test_moe.py)
# Scale exponents of the exactness check: wide, so that every scale path of the kernels is
# exercised; "wgmma_fp8" folds an FP4 row's four scales of a K block into e4m3 codes, exact
# while they lie within 2^14 of each other (grouped_gemm_sm90_wgmma_fp8), so a narrower range.
WIDE_EXPONENTS = (-37, 32)
FOLDED_FP4_EXPONENTS = (-21, -7)

# (label, dims, tokens, routing, weight format, FP8 activation simulation), grouped by dims
# and format: the cases share one set of weights at a time (cases.shared_expert_weights).
DECODE_CASES = [("tiny", "tiny", 3, "random", "fp4", True),
                ("tiny no simulation", "tiny", 5, "random", "fp4", False),
                ("tiny bf16", "tiny", 3, "random", "bf16", False),
                ("small fp8", "small", 3, "random", "fp8", True),
                *[("flash decode", "flash", t, "random", "fp4", True) for t in (1, 8, 64)],
                ("flash skewed", "flash", 64, "few_experts", "fp4", True),
                *[("flash prefill", "flash", t, "random", "fp4", True) for t in (512, 4096)],
                ("flash decode fp8", "flash", 8, "random", "fp8", True),
                ("pro decode", "pro", 8, "random", "fp4", True)]
PREFILL_CASES = [("small prefill", "small", 1024, "random", "fp4", True),
                 *[("flash prefill", "flash", t, "random", "fp4", True) for t in (512, 4096)],
                 ("flash prefill fp8", "flash", 4096, "random", "fp8", True),
                 ("pro prefill", "pro", 4096, "random", "fp4", True)]


def check_exact(fmt, decode_tiles, policy, dry):
    """One-hot rows read the dequantised weights back through the kernel: must be exact.
    ``decode_tiles``: the policy's decode config instead of its prefill one."""
    groups, n, k = 3, 128, 512
    rows = groups * k
    config = resolve_config(policy, groups if decode_tiles else rows, groups, fmt, (k,),
                            simulate=True)
    folded = config.algorithm == "wgmma_fp8" and fmt == "fp4"
    w = cases.random_weight(fmt, *jax.random.split(jax.random.key(1)), groups, n, k,
                            exponents=FOLDED_FP4_EXPONENTS if folded else WIDE_EXPONENTS)
    ids = jnp.repeat(jnp.arange(groups, dtype=jnp.int32), k)
    x = jnp.tile(jnp.eye(k, dtype=jnp.bfloat16), (groups, 1))
    if dry:
        print(f"exact {fmt} ({config}): built, not launched (no GPU)")
        return None
    # One-hot rows are exact under the FP8 activation quantisation of the FP8 algorithms.
    y = jax.jit(lambda x, i, w: grouped_gemm_cute(x, i, w, config=config))(x, ids, w)
    want = jnp.transpose(quant.dequant_weight(*w, jnp.float32), (0, 2, 1)).reshape(rows, n)
    y = y.astype(jnp.float32)
    ok = bool(jnp.all(y == want.astype(jnp.bfloat16).astype(jnp.float32)))
    print(f"exact {fmt} ({config}):", ok, float(jnp.max(jnp.abs(y - want))))
    return ok


def run_case(label, dims, tokens, kind, fmt, simulate, policy, dry):
    case = cases.moe_case(dims, fmt, tokens, kind, simulate=simulate)
    p = case.weights
    sim = fmt != "bf16" and simulate
    rows = case.idx.size
    ok, why = moe_support(rows, "bfloat16", p["w1"], p["w3"], p["w2"], simulate=sim,
                          policy=policy)
    head = f"{label:20s} {dims:5s} T={tokens:6d} fmt={fmt} sim={int(simulate)}"
    if not ok and not dry:
        print(f"{head}: the kernel does not support {why}")
        return
    config, down_config = moe_configs(rows, p["w1"], p["w2"], simulate=sim, policy=policy)
    f = cases.moe_experts_jit("xla" if dry else "cute", case.kw, policy)
    got = f(*case.args)
    check = cases.compare_to_reference(got, cases.moe_reference_chunked(*case.args, **case.kw),
                                       TOL, again=f(*case.args))
    xa, ea, wa = cases.assignment_rows(case.x, case.idx, case.w)
    up, up_args = cases.grouped_launch(xa, ea, p["w1"], w_up=p["w3"], row_weights=wa,
                                       config=config, simulate=sim)
    head = f"{head} {check}"
    if dry:
        print(f"{head} (the XLA reference; {config}: launches built, not run"
              + ("" if ok else f"; the kernel does not support {why}") + ")")
        return
    t = back_to_back_seconds(f, *case.args)
    t_up = back_to_back_seconds(up, *up_args)
    down, down_args = cases.grouped_launch(up(*up_args), ea, p["w2"],
                                           config=down_config, simulate=sim, presorted=True)
    t_down = back_to_back_seconds(down, *down_args)
    touched = cases.touched_groups(case.idx)
    r = rates(touched * cases.bytes_per_group(p["w1"], p["w3"], p["w2"]),
              cases.moe_flops(int((case.idx >= 0).sum()), case.dims), t)
    print(f"{head} t={t * 1e6:8.1f}us up={t_up * 1e6:7.1f} down={t_down * 1e6:7.1f} "
          f"experts={touched} {r['gbps']:7.0f} GB/s ({100 * r['bw_frac']:4.1f}%) "
          f"{r['tflops']:6.1f} TF/s  {config}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_policy_flags(p)
    p.add_argument("--prefill", action="store_true",
                   help="prefill tiles only: exactness, then small, Flash and Pro sizes")
    p.add_argument("--tiny", action="store_true",
                   help="every case at the tiny dims (without a GPU: a dry run, no launch)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    policy = policy_of_flags(args)
    dry = jax.devices()[0].platform != "gpu"
    if dry and not args.tiny:
        raise SystemExit("moe_kernel_check.py: no GPU; --tiny runs a dry run of the script")
    print(jax.devices(), policy)
    for fmt in ("fp4", "fp8", "bf16"):
        check_exact(fmt, False, policy, dry)
        if not args.prefill:
            check_exact(fmt, True, policy, dry)
    for label, dims, tokens, kind, fmt, simulate in (PREFILL_CASES if args.prefill
                                                     else DECODE_CASES):
        run_case(label, "tiny" if args.tiny else dims, tokens, kind, fmt, simulate, policy, dry)


if __name__ == "__main__":
    main()
