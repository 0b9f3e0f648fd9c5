"""Shared building blocks: linear layers in every weight format, RMSNorm, RoPE.

Weight layout follows the official checkpoint: ``weight [out, in]`` (``y = x @ W.T``), plus
``scale`` for FP8 weights (E8M0, one per 128x128 block). What the reference computes:

* ``fp8`` family (wq_a, wq_b, wkv, wo_b, indexer.wq_b, shared experts, MTP e/h_proj): with
  quantised weights and ``quant_simulation`` the activation is quantised to e4m3 per token per
  128 channels (power-of-two scales) and multiplied with the FP8 weight, f32 accumulation,
  output in the activation dtype. Without simulation (or with plain weights): plain GEMM.
  Quantised weights go through the grouped-GEMM op (``ffi.grouped_gemm``, one group): on a
  Hopper GPU a kernel that reads the FP8 bytes and their scales, never a BF16 copy.
* ``f32`` family (compressor wkv/wgate, router gate, LM head): stored BF16, used as an f32 GEMM
  (``matmul_f32``: BF16 weights are read as they are, the products are exact in f32).
* ``plain`` family (indexer weights_proj): GEMM in the activation dtype.
"""
from __future__ import annotations

import math

import numpy as np
import jax
import jax.numpy as jnp
import flax.linen as nn

from dsv4_jax.config import Config
from dsv4_jax import quant
from dsv4_jax.ffi.grouped_gemm import grouped_gemm, grouped_gemm_pair
from dsv4_jax.ffi.norm import rms_norm
from dsv4_jax.ffi.router_reference import matmul_f32
from dsv4_jax.ffi.policy import DEFAULT_POLICY, KernelPolicy
from dsv4_jax.ffi.rope import rope_table, rotate_tail
from .parallel import batch_parallel

HIGHEST = jax.lax.Precision.HIGHEST


def act_dtype(cfg: Config):
    return jnp.dtype(cfg.dtype)


def matmul_lowp(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w.T`` with operands in x's dtype, f32 accumulation, result in x's dtype."""
    return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype),
                      preferred_element_type=jnp.float32).astype(x.dtype)


# ----------------------------------------------------------------------------- init helpers
def normal_init(std: float):
    def init(key, shape, dtype=jnp.float32):
        return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)
    return init


def fp8_codes_init(key, shape, dtype=quant.FP8_DTYPE):
    """Random e4m3 codes with std 64 (max 448 ~ 7 sigma); the scale sets the real magnitude."""
    return jnp.clip(jax.random.normal(key, shape, jnp.float32) * 64.0, -448, 448).astype(dtype)


def pow2_scale_init(std: float, code_std: float):
    """Constant E8M0 scale 2^round(log2(std / code_std)) (random init of quantised weights)."""
    value = 2.0 ** round(math.log2(std / code_std))

    def init(key, shape, dtype=quant.E8M0_DTYPE):
        return jnp.full(shape, value, jnp.float32).astype(dtype)
    return init


def fp4_packed_init(key, shape, dtype=jnp.int8):
    """Random packed e2m1 codes (values ~ N(0, 2) rounded onto the FP4 grid)."""
    *lead, half = shape
    v = jnp.clip(jax.random.normal(key, (*lead, half * 2), jnp.float32) * 2.0, -6, 6)
    return quant.pack_fp4(v.astype(quant.FP4_DTYPE).astype(jnp.float32))


FP8_CODE_STD = 64.0
FP4_CODE_STD = 2.0


# ----------------------------------------------------------------------------- modules
class FP8Weight(nn.Module):
    """The parameters ``weight [out, in]`` (e4m3) and ``scale`` (E8M0, 128 x 128 blocks) of
    an FP8-family linear, for modules that run the GEMM themselves (the shared expert's gated
    GEMM)."""
    in_features: int
    out_features: int

    @nn.compact
    def __call__(self):
        std = self.in_features ** -0.5
        w = self.param("weight", fp8_codes_init, (self.out_features, self.in_features))
        s = self.param("scale", pow2_scale_init(std, FP8_CODE_STD),
                       (-(-self.out_features // 128), -(-self.in_features // 128)))
        return w, s


class Linear(nn.Module):
    """``y = x @ W.T`` for one weight family (see module docstring); params ``weight[, scale]``.

    ``policy``: the ops' ``KernelPolicy``; ``mesh``: the model's mesh (the FP8 GEMM then runs
    on each device's rows)."""
    cfg: Config
    in_features: int
    out_features: int
    family: str = "fp8"          # "fp8" | "f32" | "plain"
    policy: KernelPolicy = DEFAULT_POLICY
    mesh: object = None

    @nn.compact
    def __call__(self, x: jax.Array, row_norm=None) -> jax.Array:
        """``row_norm``: None, or ``(weight, eps)`` of an RMSNorm that ``x`` goes through first
        (the FP8 family's op takes it: ``fp8_linear``)."""
        cfg = self.cfg
        std = self.in_features ** -0.5
        shape = (self.out_features, self.in_features)
        if self.family == "fp8" and cfg.quantized:
            w = self.param("weight", fp8_codes_init, shape)
            s = self.param("scale", pow2_scale_init(std, FP8_CODE_STD),
                           (-(-self.out_features // 128), -(-self.in_features // 128)))
            return fp8_linear(x, w, s, cfg.quant_simulation, policy=self.policy,
                              mesh=self.mesh, row_norm=row_norm)
        if row_norm is not None:
            x = rms_norm(x, *row_norm)
        if self.family == "f32":
            w = self.param("weight", normal_init(std), shape, jnp.bfloat16
                           if cfg.dtype == "bfloat16" else jnp.float32)
            return matmul_f32(x, w)
        w = self.param("weight", normal_init(std), shape, act_dtype(cfg))
        return matmul_lowp(x, w)


def grouped_linear(x: jax.Array, w, *, w_up=None, swiglu_limit: float = 0.0,
                   simulate: bool, policy: KernelPolicy = DEFAULT_POLICY, mesh=None,
                   groups_last: bool = False, row_norm=None) -> jax.Array:
    """``ffi.grouped_gemm`` on ``x [..., K]`` with rows in equal blocks per group (one group:
    a dense linear) -> ``[..., N]``; with a ``mesh``, each device runs its own rows.

    ``w`` (and ``w_up``): ``(weight [G, N, K], scale or None)``. ``groups_last``: ``x`` is
    ``[..., G, K]`` (group g in the second-to-last dim) and so is the result. ``row_norm``:
    ``(weight [K], eps)`` of an RMSNorm the rows go through first (``ffi.grouped_gemm``)."""
    groups = w[0].shape[0]
    norm_weight, eps = (None, None) if row_norm is None else row_norm

    def run(x, weight, scale, up, up_scale, norm_weight):
        lead = x.shape[:-2] if groups_last else x.shape[:-1]
        if groups_last:                         # rows of group g together, g = 0 .. G-1
            x = jnp.moveaxis(x, -2, 0)
        rows = x.reshape(-1, x.shape[-1])
        y = grouped_gemm(rows, None, (weight, scale),
                         w_up=None if up is None else (up, up_scale),
                         swiglu_limit=swiglu_limit, simulate=simulate,
                         row_norm=None if norm_weight is None else (norm_weight, eps),
                         implementation=policy.implementation_for("grouped_gemm"),
                         policy=policy.grouped_gemm)
        if groups_last:
            return jnp.moveaxis(y.reshape(groups, *lead, -1), 0, -2)
        return y.reshape(*lead, -1)

    up, up_scale = (None, None) if w_up is None else w_up
    if mesh is None:
        return run(x, *w, up, up_scale, norm_weight)
    return batch_parallel(lambda x, *r: (run(x, *r),), mesh, (x,),
                          (*w, up, up_scale, norm_weight), 1)[0]


def fp8_linear(x: jax.Array, weight: jax.Array, scale: jax.Array, simulate: bool, *,
               policy: KernelPolicy = DEFAULT_POLICY, mesh=None, row_norm=None) -> jax.Array:
    """FP8 block-scaled weight GEMM: activations FP8-quantised when ``simulate``; the weight
    is read in its storage format (``grouped_linear``, one group); ``row_norm``: an RMSNorm
    before it (``grouped_linear``)."""
    return grouped_linear(x, (weight[None], scale[None]), simulate=simulate, policy=policy,
                          mesh=mesh, row_norm=row_norm)


def fp8_linear_pair(x: jax.Array, w, w_next, simulate: bool, *,
                    policy: KernelPolicy = DEFAULT_POLICY, mesh=None, row_norm=None):
    """Two FP8 linears of one input, ``(fp8_linear(x, *w), fp8_linear(x, *w_next))``, as
    one op (``ffi.grouped_gemm_pair``: one kernel launch at decode); ``w``, ``w_next``:
    ``(weight [N, K], scale)``; ``row_norm``: an RMSNorm before both (``fp8_linear``)."""
    norm_weight, eps = (None, None) if row_norm is None else row_norm

    def run(x, weight, scale, weight_next, scale_next, norm_weight):
        rows = x.reshape(-1, x.shape[-1])
        ys = grouped_gemm_pair(rows, None, (weight[None], scale[None]),
                               (weight_next[None], scale_next[None]), simulate=simulate,
                               row_norm=None if norm_weight is None else (norm_weight, eps),
                               implementation=policy.implementation_for("grouped_gemm"),
                               policy=policy.grouped_gemm)
        return tuple(y.reshape(*x.shape[:-1], -1) for y in ys)

    if mesh is None:
        return run(x, *w, *w_next, norm_weight)
    return batch_parallel(run, mesh, (x,), (*w, *w_next, norm_weight), 2)


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)`` in f32, cast back to x's dtype (weight kept BF16).
    ``weight`` is readable from the parent (``ffi.hc_pre`` fuses the norm into the mHC pre)."""
    dim: int
    eps: float = 1e-6

    def setup(self):
        self.weight = self.param("weight", nn.initializers.ones, (self.dim,), jnp.bfloat16)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight, self.eps)


# ----------------------------------------------------------------------------- RoPE
def rope_inv_freq(cfg: Config, compressed: bool) -> np.ndarray:
    """Per-pair frequencies f_i (i < rope_head_dim/2), with YaRN for compressed layers
    (docs/architecture.md §3.1)."""
    dim = cfg.rope_head_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    original = cfg.original_seq_len if compressed else 0
    freqs = (1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))))
    freqs = freqs.astype(np.float32)
    if original > 0:
        def corr(rot):
            return dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr(cfg.beta_fast)), 0)
        high = min(math.ceil(corr(cfg.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        smooth = (1 - ramp).astype(np.float32)
        freqs = (freqs / np.float32(cfg.rope_factor) * (1 - smooth) + freqs * smooth)
    return freqs.astype(np.float32)


def rope_tail(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray,
              rope_dim: int, inverse: bool = False) -> jax.Array:
    """Apply RoPE to the last ``rope_dim`` channels of x (interleaved pairs rotated by
    ``positions``, shape ``x.shape[:-1]`` or broadcastable; f32 math, x's dtype; ``inverse``:
    by the conjugate), leaving the others untouched."""
    if rope_dim != 2 * len(inv_freq):
        raise ValueError(f"rope_tail: rope_dim {rope_dim} must be twice the {len(inv_freq)} "
                         f"frequencies")
    return rotate_tail(x, *rope_table(positions, inv_freq), inverse)
