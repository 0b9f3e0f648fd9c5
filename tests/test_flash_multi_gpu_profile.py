"""``benchmarks/flash_multi_gpu.py``'s profile grouping without a GPU: XLA's one-shot
all-reduce kernel (named after its psum) counts as a collective, and the per-device split
gives each device's device time and collective time per step."""
import collections
import os
import statistics
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import flash_multi_gpu  # noqa: E402
import step_figures  # noqa: E402


def test_the_psum_fusion_is_a_collective():
    group = flash_multi_gpu.kernel_group
    assert group("psum_357_0_fusion_1").startswith("collectives")
    assert group("ncclDevKernel_AllGather_RING_LL").startswith("collectives")
    assert group("loop_add_fusion") == "XLA fusions, copies"


def test_the_per_device_split_of_a_trace():
    by_device = {"/device:GPU:1": collections.Counter({"psum_1_fusion": 300.0, "gemm": 100.0}),
                 "/device:GPU:0": collections.Counter({"psum_1_fusion": 60.0, "gemm": 140.0})}
    split = flash_multi_gpu.per_device_split(by_device, 4)
    assert list(split) == ["/device:GPU:0", "/device:GPU:1"]
    assert split["/device:GPU:0"] == {"all": 50.0, "collectives": 15.0}
    assert split["/device:GPU:1"] == {"all": 100.0, "collectives": 75.0}


def test_trace_device_ops_splits_by_device():
    """On the CPU backend the ops of the host threads stand in for the device streams: the
    per-device counters add up to the totals, and each device's busy time is at most its
    ops' summed durations."""
    fn = jax.jit(lambda x: jnp.sin(x) @ x)
    x = jnp.ones((64, 64), jnp.float32)
    by_device, busy = {}, {}
    totals, counts = step_figures.trace_device_ops(lambda: jax.block_until_ready(fn(x)),
                                                   by_device=by_device, busy=busy)
    assert sum(counts.values()) > 0 and by_device
    merged = sum(by_device.values(), collections.Counter())
    assert set(merged) == set(totals)
    assert abs(sum(merged.values()) - sum(totals.values())) < 1e-6
    assert set(busy) == set(by_device)
    for device, ops in by_device.items():
        assert 0 < busy[device] <= sum(ops.values()) + 1e-6


def test_busy_time_counts_overlapping_ops_once():
    """Concurrent commands: two kernels at once are one span of busy time; gaps are not."""
    assert step_figures.busy_us([]) == 0.0
    assert step_figures.busy_us([(0, 10), (20, 25)]) == 15.0
    assert step_figures.busy_us([(5, 12), (0, 10), (11, 14)]) == 14.0
    assert step_figures.busy_us([(0, 30), (2, 4), (10, 20)]) == 30.0
    assert step_figures.busy_us([(0, 10), (10, 15)]) == 15.0


def test_loops_are_timed_in_turn_and_each_repeat_is_kept():
    """``step_figures.time_interleaved``: every repeat times each loop's short and long
    budget (the fastest of ``tries`` runs each) before the next repeat, the per-step figure
    is their difference over their step counts, and making a loop's inputs is not timed."""
    calls = []

    def fake_loop(name, step_s):
        def prepare(budget):
            calls.append(("prepare", name, budget))
            time.sleep(budget * 0.02)     # timed, it would add 20 ms to each step's figure

            def go():
                calls.append((name, budget))
                # every other run is delayed as a busy host would: only the fastest counts
                slow = calls.count((name, budget)) % 2 == 0
                time.sleep(budget * (step_s + (0.02 if slow else 0.0)))
                return np.zeros((2, budget), np.int32)
            return go
        return prepare

    runs = {"on": fake_loop("on", 0.005), "off": fake_loop("off", 0.010)}
    timed = step_figures.time_interleaved(runs, 2, 8, repeats=2, tries=2)
    loops = [("on", 2), ("on", 8), ("off", 2), ("off", 8)]
    assert calls == [("prepare", "on", 8), ("on", 8), ("prepare", "off", 8), ("off", 8)] + [
        step for loop in loops for step in (("prepare", *loop), loop) * 2] * 2
    for name, step_s in (("on", 0.005), ("off", 0.010)):
        (median, each), first_s = timed[name]
        assert len(each) == 2 and median == statistics.median(each)
        # sleeps only overshoot, by far less than a step, on a busy machine too
        assert step_s * 0.5 < median < step_s * 3 and first_s >= 8 * step_s
