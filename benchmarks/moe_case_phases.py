"""Where the time of one GPU test case of the MoE op goes, phase by phase (weights, the op's
first call = compile + run, its second call, the reference), printed as each phase ends, so
that a case that stalls shows the phase it stalls in.

    source .device/setup.sh && python3 benchmarks/moe_case_phases.py flash-fp4-3-one_expert \
        pro-fp8-8-random
Cases are ``dims-format-tokens-routing`` as in ``tests/test_moe.py``'s test ids.
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import conftest  # noqa: E402,F401  (CuTe DSL target, XLA flags: as in the tests)
import jax  # noqa: E402
import numpy as np  # noqa: E402

import test_moe as tm  # noqa: E402
from dsv4_jax.ffi import moe as op  # noqa: E402


def phases(case: str) -> None:
    dims, fmt, t, routing = case.split("-")
    t = int(t)
    start = time.perf_counter()

    def mark(what):
        print(f"{case}: {what} at {time.perf_counter() - start:7.2f} s", flush=True)

    p, args, kw, f = tm.case_inputs("cute", dims, fmt, t, routing)
    jax.block_until_ready(p)
    mark("weights")
    e, d, inter, _ = tm.DIMS[dims]
    rows = args[1].size
    config = op._choose_config(rows, e, fmt, d, inter, simulate=True)
    mark(f"rows {rows}, config {config}")
    compiled = f.lower(*args).compile()
    mark("op compiled")
    got = jax.block_until_ready(compiled(*args))
    mark("op first run")
    again = jax.block_until_ready(compiled(*args))
    mark("op second run")
    want = jax.block_until_ready(tm._reference_chunked(*args[:3], p, **kw))
    mark("reference")
    same = np.array_equal(np.asarray(got), np.asarray(again))
    print(f"{case}: rel err {tm._rel_err(got, want):.3e}, repeatable {same}, "
          f"finite {bool(np.all(np.isfinite(np.asarray(got))))}", flush=True)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        phases(name)
