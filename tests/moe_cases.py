"""Deterministic MoE inputs in every stored expert format (NumPy RNG, no jax.random), shared by
the MoE op tests and by the script that wrote ``tests/data/moe_routed_experts.npz``.

    python tests/moe_cases.py      # rewrite the golden file (only when the numerics change on
                                   # purpose; it was written with the pre-op model code)
"""
from __future__ import annotations

import os

import ml_dtypes
import numpy as np

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "moe_routed_experts.npz")
E, D, INTER, K = 8, 256, 128, 2
FORMATS = ("fp4", "fp8", "bf16", "f32")     # last two: plain weights (quantized=False)
TOKENS = (2, 11)                            # 2*2 rows < 8 experts: gather; 22 rows: grouped


def _e8m0(rng, shape, lo, hi):
    return (2.0 ** rng.integers(lo, hi + 1, shape)).astype(np.float32).astype(
        ml_dtypes.float8_e8m0fnu)


def expert_weights(fmt: str, seed: int = 0, e: int = E, d: int = D, inter: int = INTER):
    """``{"w1": (weight, scale|None), "w3": ..., "w2": ...}`` as NumPy arrays in ``fmt``."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (o, i) in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
        if fmt == "fp4":
            # Any byte is a pair of valid e2m1 codes; codes have std ~3, scale ~ i^-0.5 / 3.
            w = rng.integers(-128, 128, (e, o, i // 2), dtype=np.int8)
            out[name] = (w, _e8m0(rng, (e, o, i // 32), -7, -5))
        elif fmt == "fp8":
            w = np.clip(rng.standard_normal((e, o, i)) * 64, -448, 448).astype(
                ml_dtypes.float8_e4m3fn)
            out[name] = (w, _e8m0(rng, (e, -(-o // 128), -(-i // 128)), -11, -9))
        else:
            dt = ml_dtypes.bfloat16 if fmt == "bf16" else np.float32
            out[name] = ((rng.standard_normal((e, o, i)) * i ** -0.5).astype(dt), None)
    return out


def routing(tokens: int, seed: int = 1, e: int = E, k: int = K, d: int = D):
    """x [T, d] f32 (scaled so the SwiGLU clamp is hit), distinct ids [T, k] int32, weights."""
    rng = np.random.default_rng(seed + tokens)
    x = (rng.standard_normal((tokens, d)) * 3).astype(np.float32)
    idx = np.stack([rng.permutation(e)[:k] for _ in range(tokens)]).astype(np.int32)
    w = rng.random((tokens, k)).astype(np.float32)
    return x, idx, w


def case_config(fmt: str, simulate: bool):
    """The tiny Config for one golden case."""
    import dsv4_jax as dj
    if fmt in ("fp4", "fp8"):
        return dj.Config.tiny(quantized=True, expert_dtype=fmt, quant_simulation=simulate)
    return dj.Config.tiny(dtype="float32" if fmt == "f32" else "bfloat16")


def case_names():
    for fmt in FORMATS:
        for sim in ((True, False) if fmt in ("fp4", "fp8") else (True,)):
            for t in TOKENS:
                yield fmt, sim, t, f"{fmt}_sim{int(sim)}_t{t}"


def model_outputs(routed_experts, jit: bool = False) -> dict:
    """``routed_experts(x, route_w, route_idx, params, cfg)`` (the model's function) per case,
    eagerly (as the golden file was written) or jitted."""
    import jax
    import jax.numpy as jnp
    outs = {}
    for fmt, sim, t, name in case_names():
        cfg = case_config(fmt, sim)
        x, idx, w = routing(t)
        params = {n: (jnp.asarray(a), None if s is None else jnp.asarray(s))
                  for n, (a, s) in expert_weights(fmt).items()}
        xj = jnp.asarray(x).astype(jnp.dtype(cfg.dtype))
        f = lambda *a, cfg=cfg: routed_experts(*a, cfg)
        outs[name] = np.asarray((jax.jit(f) if jit else f)(xj, jnp.asarray(w), jnp.asarray(idx),
                                                           params))
    return outs


if __name__ == "__main__":
    import dsv4_jax  # noqa: F401  (XLA flags first)
    from dsv4_jax.models import moe
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    np.savez_compressed(GOLDEN, **model_outputs(moe.routed_experts))
    print("wrote", GOLDEN)
