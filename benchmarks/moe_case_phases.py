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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import test_moe as tm  # noqa: E402
from dsv4_jax.ffi import moe as op  # noqa: E402


def phases(case: str) -> None:
    dims, fmt, t, routing = case.split("-")
    t = int(t)
    e, d, inter, k = tm.DIMS[dims]
    start = time.perf_counter()

    def mark(what):
        print(f"{case}: {what} at {time.perf_counter() - start:7.2f} s", flush=True)

    p = jax.block_until_ready(tm._device_weights(dims, fmt))
    mark("weights")
    idx, w = tm._routing(routing, t, e, k)
    x = jax.random.normal(jax.random.key(7 + t), (t, d), jnp.float32).astype(jnp.bfloat16)
    kw = dict(swiglu_limit=tm.LIMIT, quantized=fmt != "bf16", simulate=True)
    rows = idx.shape[0] * idx.shape[1]
    config = op._choose_config(rows, e, fmt, d, inter, simulate=True)
    mark(f"rows {rows}, config {config}")
    f = jax.jit(lambda x, i, w, w1, w3, w2: op.moe_experts(x, i, w, w1, w3, w2, **kw,
                                                           implementation="cute"))
    args = (x, idx, w, p["w1"], p["w3"], p["w2"])
    compiled = f.lower(*args).compile()
    mark("op compiled")
    got = jax.block_until_ready(compiled(*args))
    mark("op first run")
    again = jax.block_until_ready(compiled(*args))
    mark("op second run")
    want = jax.block_until_ready(tm._reference_chunked(x, idx, w, p, **kw))
    mark("reference")
    same = np.array_equal(np.asarray(got), np.asarray(again))
    print(f"{case}: rel err {tm._rel_err(got, want):.3e}, repeatable {same}, "
          f"finite {bool(np.all(np.isfinite(np.asarray(got))))}", flush=True)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        phases(name)
