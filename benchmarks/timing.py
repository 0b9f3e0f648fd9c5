"""The benchmarks' timing helper and roofline constants (H200).

Two ways to time a jitted function, both with warm-up executions excluded and every timed
interval ended by ``jax.block_until_ready``:

* ``median_seconds``: each execution waited for on its own; the median over ``runs``. With
  ``calls_on_sets`` -- one jitted function running R calls of an op on R distinct input sets,
  so that consecutive calls touch different data and nothing stays in the L2 -- the time of
  one call is the median divided by R (``bench_moe.py``).
* ``back_to_back_seconds``: groups of executions issued back to back (dispatch overlaps the
  previous execution), one wait per group; the median over groups of the mean per execution
  (``moe_kernel_check.py``, ``moe_kernel_ablation.py``, ``bench_sparse_attention.py``).
"""
from __future__ import annotations

import statistics
import time

import jax

PEAK_TBPS = 4.3          # H200 HBM3e bandwidth, TB/s
PEAK_TFLOPS = 790.0      # H200 dense BF16 tensor-core throughput, TF/s (FP8: twice that)


def median_seconds(fn, *args, runs: int = 20, warmup: int = 2) -> float:
    """Median wall time of one ``fn(*args)``, each execution waited for, after ``warmup``
    executions that are not timed."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def back_to_back_seconds(fn, *args, groups: int = 5, per_group: int = 30,
                         warmup: int = 1) -> float:
    """Median over ``groups`` of the mean time of ``per_group`` executions of ``fn(*args)``
    issued back to back and waited for once, after ``warmup`` executions that are not
    timed."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    means = []
    for _ in range(groups):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(per_group)]
        jax.block_until_ready(outs)
        means.append((time.perf_counter() - t0) / per_group)
    return statistics.median(means)


def calls_on_sets(call, shared, sets):
    """``jax.jit`` of ``[call(*shared, *s) for s in sets]``, compiled for these arguments:
    ``(compiled, temporary bytes of the executable or nan)``. Run it as
    ``compiled(shared, sets)``; a time of it divided by ``len(sets)`` is per call. The
    shared arguments (weights) are arguments, not constants folded into the program."""
    def run(shared, sets):
        return [call(*shared, *s) for s in sets]
    compiled = jax.jit(run).lower(shared, sets).compile()
    try:
        temp = compiled.memory_analysis().temp_size_in_bytes
    except Exception:                 # not every backend reports it
        temp = float("nan")
    return compiled, temp


def rates(nbytes: float, flops: float, seconds: float) -> dict:
    """GB/s and TF/s of ``nbytes`` and ``flops`` in ``seconds``, and their fractions of the
    roofline peaks."""
    gbps, tflops = nbytes / seconds / 1e9, flops / seconds / 1e12
    return dict(gbps=gbps, bw_frac=gbps / (PEAK_TBPS * 1e3), tflops=tflops,
                flops_frac=tflops / PEAK_TFLOPS)


def is_oom(err: Exception) -> bool:
    """Whether ``err`` is the device running out of memory."""
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def emit_table(lines: list[str], path: str | None) -> None:
    """Print a benchmark's markdown lines and write them to ``path`` when given."""
    text = "\n".join(lines)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
