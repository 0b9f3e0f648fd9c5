"""GPU check of the MoE kernels (H100/H200): exactness, numerics vs a float reference, timings.

    source .device/setup.sh && python3 benchmarks/moe_kernel_check.py
    source .device/setup.sh && DSV4_MOE_ALGORITHM=mma_sync python3 benchmarks/moe_kernel_check.py
    source .device/setup.sh && DSV4_MOE_ALGORITHM=mma_fp8 python3 benchmarks/moe_kernel_check.py
    source .device/setup.sh && DSV4_MOE_SPLIT_K=4 python3 benchmarks/moe_kernel_check.py
    source .device/setup.sh && DSV4_MOE_PREFILL_ALGORITHM=wgmma_fp8 \
        python3 benchmarks/moe_kernel_check.py --prefill      # prefill tiles only

* exact decode: one-hot token rows read every weight back through the kernel (FP4, FP8,
  BF16 weights, scales over 2^-37..2^32): must equal the dequantised weights bit for bit;
* cases: ``expert_rows_sm90`` vs ``reference`` (f32 products of the dequantised operands,
  bf16 roundings where the op rounds), repeatability of two calls, NaN check, and the op's
  time (back-to-back calls, median of 5 x 30), of the gated launch (up) and of the w2 launch
  (down) alone; GB/s over the touched experts' bytes, useful TF/s 2 T k 3 d inter.
"""
import functools
import sys
import time
import numpy as np
import dsv4_jax  # noqa: F401  (XLA flags)
import jax, jax.numpy as jnp
from dsv4_jax import quant
from dsv4_jax.ffi import moe as ms

LIMIT = 10.0
def e8m0(u8): return jax.lax.bitcast_convert_type(u8.astype(jnp.uint8), jnp.float8_e8m0fnu)

def make_w(key, E, out, inn, fmt, lo=118, hi=123):
    k1, k2 = jax.random.split(key)
    if fmt == "fp4":
        w = jax.random.randint(k1, (E, out, inn // 2), -128, 128, jnp.int32).astype(jnp.int8)
        s = e8m0(jax.random.randint(k2, (E, out, inn // 32), lo, hi))
        return w, s
    if fmt == "fp8":
        w = jnp.clip(jax.random.normal(k1, (E, out, inn), jnp.float32) * 100, -440, 440).astype(jnp.float8_e4m3fn)
        s = e8m0(jax.random.randint(k2, (E, out // 128, inn // 128), 113, 117))
        return w, s
    return (jax.random.normal(k1, (E, out, inn), jnp.float32) * inn ** -0.5).astype(jnp.bfloat16), None

def deq(w, s, fmt):
    if fmt == "fp4": return quant.dequant_fp4_weight(w, s).astype(jnp.float32)
    if fmt == "fp8": return quant.dequant_fp8_weight(w, s).astype(jnp.float32)
    return w.astype(jnp.float32)

def bf(x): return x.astype(jnp.bfloat16).astype(jnp.float32)

@functools.partial(jax.jit, static_argnames=("fmt", "simulate"))
def reference(xa, ea, wa, w1, w3, w2, fmt, simulate):
    E = w1[0].shape[0]
    x = quant.act_quant_dequant(xa) if simulate else xa.astype(jnp.float32)
    x = bf(x)
    def body(acc, e):
        sel = lambda w: (w[0][e], None if w[1] is None else w[1][e])
        W1 = deq(*sel(w1), fmt); W3 = deq(*sel(w3), fmt); W2 = deq(*sel(w2), fmt)
        g = bf(jnp.dot(x, W1.T, precision="highest")); u = bf(jnp.dot(x, W3.T, precision="highest"))
        u = jnp.clip(u, -LIMIT, LIMIT); g = jnp.minimum(g, LIMIT)
        h = bf(wa[:, None] * (jax.nn.silu(g) * u))
        if simulate: h = bf(quant.act_quant_dequant(h))
        y = bf(jnp.dot(h, W2.T, precision="highest"))
        return acc + jnp.where((ea == e)[:, None], y, 0.0), None
    out, _ = jax.lax.scan(body, jnp.zeros((xa.shape[0], w2[0].shape[1]), jnp.float32), jnp.arange(E))
    return out

def bench(fn, n=30):
    jax.block_until_ready(fn())
    res = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n): r = fn()
        jax.block_until_ready(r)
        res.append((time.perf_counter() - t0) / n)
    return float(np.median(res))

def launch(xs, sched, w, s, cfg, **kw):
    """``grouped_gemm_sm90`` on bf16 rows; "mma_fp8" takes them FP8-quantised (exact for the
    one-hot rows of ``check_decode_exact``, the simulation's numerics elsewhere)."""
    if cfg.algorithm in ms.FP8_ACTIVATION_ALGORITHMS:
        codes, scales = quant.act_quant(xs)
        return ms.grouped_gemm_sm90(codes, sched, w, s, x_scale=scales, config=cfg, **kw)
    return ms.grouped_gemm_sm90(xs, sched, w, s, config=cfg, **kw)

def choose(rows, E, fmt, k_ins, simulate=True):
    """The op's config for these rows (algorithms from the environment, as the op reads)."""
    return ms.choose_config(rows, E, fmt, ms.decode_algorithm(), fp8_activations=simulate,
                            prefill_algorithm=ms.prefill_algorithm(), k_ins=k_ins,
                            few_rows_split_k=ms.few_rows_split_k())

def check_decode_exact(fmt, decode_tiles):
    """One-hot rows read the dequantised weights back through the kernel: must be exact.
    ``decode_tiles``: the decode config (``DSV4_MOE_ALGORITHM``) instead of the prefill one."""
    E, N, K = 3, 128, 512
    A = 3 * K
    cfg = choose(E if decode_tiles else A, E, fmt, (K,))
    # "wgmma_fp8" folds a row's four FP4 scales of a K block into e4m3 codes: exact while
    # they lie within 2^14 of each other (grouped_gemm_sm90_wgmma_fp8), so a narrower range there.
    lo, hi = (106, 121) if cfg.algorithm == "wgmma_fp8" and fmt == "fp4" else (90, 160)
    w, s = make_w(jax.random.key(1), E, N, K, fmt, lo, hi)
    ea = jnp.repeat(jnp.arange(3, dtype=jnp.int32), K)
    xs = jnp.tile(jnp.eye(K, dtype=jnp.bfloat16), (3, 1))
    order, valid, *tiles = ms.moe_schedule(ea, E, cfg.block_n)
    y = launch(xs[order], (order, *tiles), w, s, cfg)
    y = jnp.zeros_like(y).at[order].set(y)
    ref = deq(w, s, fmt)                    # [E, N, K]; row (e, k) of y = ref[e, :, k]
    want = jnp.transpose(ref, (0, 2, 1)).reshape(A, N)
    ok = bool(jnp.all(y.astype(jnp.float32) == bf(want)))
    print(f"exact decode {fmt} ({cfg}):", ok, float(jnp.max(jnp.abs(y.astype(jnp.float32) - want))))
    return ok

def run_case(name, T, k, E, d, inter, fmt, simulate, skew=False, seed=0):
    key = jax.random.key(seed); ks = jax.random.split(key, 6)
    w1 = make_w(ks[0], E, inter, d, fmt); w3 = make_w(ks[1], E, inter, d, fmt); w2 = make_w(ks[2], E, d, inter, fmt)
    x = jax.random.normal(ks[3], (T, d), jnp.float32).astype(jnp.bfloat16)
    if skew: idx = jnp.tile(jnp.arange(k, dtype=jnp.int32)[None], (T, 1))
    else: idx = jnp.argsort(jax.random.uniform(ks[4], (T, E)), axis=-1)[:, :k].astype(jnp.int32)
    rw = jax.random.uniform(ks[5], (T, k), jnp.float32, 0.1, 1.0)
    xa = jnp.repeat(x, k, axis=0); ea = idx.reshape(-1); wa = rw.reshape(-1)
    f = jax.jit(lambda xa, ea, wa, w1, w3, w2: ms.moe_expert_rows_cute(xa, ea, wa, w1, w3, w2, swiglu_limit=LIMIT, simulate=simulate))
    y = f(xa, ea, wa, w1, w3, w2).astype(jnp.float32)
    y2 = f(xa, ea, wa, w1, w3, w2).astype(jnp.float32)
    rep = bool(jnp.all(y == y2))
    err = None
    if T * k <= 4096 * 6:
        ref = reference(xa, ea, wa, w1, w3, w2, fmt, simulate)
        err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
    nan = bool(jnp.any(jnp.isnan(y)))
    # timing
    for _ in range(3): f(xa, ea, wa, w1, w3, w2).block_until_ready()
    t = bench(lambda: f(xa, ea, wa, w1, w3, w2))
    cfg = choose(xa.shape[0], E, fmt, (d, inter), simulate)
    order, valid, *tiles = ms.moe_schedule(ea, E, cfg.block_n)
    xs = xa[order]; rws = wa[order]
    g1 = jax.jit(lambda xs, sched, w1, w3, rws: launch(xs, sched, *w1, cfg, weight_b=w3[0], scale_b=w3[1], route_w=rws, swiglu_limit=LIMIT))
    hs = g1(xs, (order, *tiles), w1, w3, rws)
    g2 = jax.jit(lambda hs, sched, w2: launch(hs, sched, *w2, cfg))
    t1 = bench(lambda: g1(xs, (order, *tiles), w1, w3, rws))
    t2 = bench(lambda: g2(hs, (order, *tiles), w2))

    touched = int(len(np.unique(np.asarray(idx))))
    per_exp = sum(a.size * a.dtype.itemsize for w in (w1, w3, w2) for a in w if a is not None) / E
    gbs = touched * per_exp / t / 1e9
    tfs = 2 * T * k * 3 * d * inter / t / 1e12
    print(f"{name:28s} T={T:6d} fmt={fmt} sim={int(simulate)} err={err} nan={nan} rep={rep} "
          f"t={t*1e6:8.1f}us up={t1*1e6:7.1f} down={t2*1e6:7.1f} experts={touched} {gbs:7.0f} GB/s ({gbs/4300*100:4.1f}%) {tfs:6.1f} TF/s")

def prefill_only():
    """Prefill tiles: exactness, then Flash (FP4, FP8) and Pro sizes."""
    for fmt in ("fp4", "fp8", "bf16"):
        check_decode_exact(fmt, False)
    run_case("small prefill", 1024, 4, 16, 512, 512, "fp4", True)
    for T in (512, 4096):
        run_case("flash prefill", T, 6, 256, 4096, 2048, "fp4", True)
    run_case("flash prefill fp8", 4096, 6, 256, 4096, 2048, "fp8", True)
    run_case("pro prefill", 4096, 6, 384, 7168, 3072, "fp4", True)

if __name__ == "__main__" and "--prefill" in sys.argv:
    print(jax.devices())
    prefill_only()
elif __name__ == "__main__":
    print(jax.devices())
    for fmt in ("fp4", "fp8", "bf16"):
        check_decode_exact(fmt, False)
        check_decode_exact(fmt, True)
    run_case("small", 3, 2, 8, 256, 128, "fp4", True)
    run_case("small-nosim", 5, 2, 8, 256, 128, "fp4", False)
    run_case("small fp8", 3, 2, 8, 512, 512, "fp8", True)
    run_case("small bf16", 3, 2, 8, 256, 128, "bf16", False)
    for T in (1, 8, 64):
        run_case("flash decode", T, 6, 256, 4096, 2048, "fp4", True)
    run_case("flash decode fp8", 8, 6, 256, 4096, 2048, "fp8", True)
    run_case("flash skew", 64, 6, 256, 4096, 2048, "fp4", True, skew=True)
    for T in (512, 4096):
        run_case("flash prefill", T, 6, 256, 4096, 2048, "fp4", True)
    run_case("pro decode", 8, 6, 384, 7168, 3072, "fp4", True)
