"""Mixture of experts (spec §2.5): sqrt-softplus router, hash routing, routed + shared SwiGLU.

Routed experts are stored stacked: ``experts/w{1,2,3}/weight [E, out, in]`` (packed FP4
``[E, out, in/2]`` int8 with ``scale [E, out, in/32]``, or FP8 with 128x128 scales, or plain).
Per (token, expert) assignment the reference computes::

    gate = w1(x).float(); up = w3(x).float()      # FP8 activations x FP4 weights -> bf16
    up = clamp(up, -l, l); gate = min(gate, l)
    h = (weight * silu(gate) * up).to(bf16)        # routing weight applied before w2
    y += w2(h)                                     # f32 accumulation over experts

Two XLA schedules compute exactly that: with fewer assignments than experts (decode) the
selected experts' weights are gathered per assignment; otherwise assignments are sorted by
expert and multiplied with ``lax.ragged_dot_general`` (one grouped GEMM per projection).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn

from dsv4_jax.config import Config
from dsv4_jax import quant
from .layers import (HIGHEST, Linear, act_dtype, fp4_packed_init, fp8_codes_init, matmul_f32,
                     normal_init, pow2_scale_init, FP4_CODE_STD, FP8_CODE_STD)


def gemm_operands(x: jax.Array, w_f32: jax.Array, simulate: bool, quantized: bool):
    """Operands for ``x @ w.T`` as the reference multiplies them (see layers.quantized_matmul)."""
    if quantized and simulate:
        return quant.act_quant_dequant(x).astype(jnp.bfloat16), w_f32.astype(jnp.bfloat16)
    if x.dtype == jnp.bfloat16:
        return x, w_f32.astype(jnp.bfloat16)
    return x.astype(jnp.float32), w_f32.astype(jnp.float32)


def dequant_experts(weight: jax.Array, scale: jax.Array | None, dtype=jnp.float32) -> jax.Array:
    """Stacked expert weights in any storage format -> ``dtype`` (plain weights unchanged).

    FP8/FP4 codes times a power-of-two scale are exact in BF16, so dequantising straight to
    BF16 loses nothing and halves the transient memory of the XLA path."""
    if scale is None:
        return weight
    if weight.dtype in (jnp.int8, jnp.uint8):
        w = quant.dequant_fp4_weight(weight, scale)
    else:
        w = quant.dequant_fp8_weight(weight, scale)
    return w.astype(dtype)


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    return jax.nn.silu(gate) * up


def _dot_per_assignment(x, w, simulate, quantized, out_dtype):
    xin, win = gemm_operands(x, w, simulate, quantized)
    return jnp.einsum("ad,aod->ao", xin, win, preferred_element_type=jnp.float32,
                      precision=HIGHEST).astype(out_dtype)


def _dot_grouped(x, w, group_sizes, simulate, quantized, out_dtype):
    xin, win = gemm_operands(x, w, simulate, quantized)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])),
        lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(xin, win, group_sizes, dims, precision=HIGHEST,
                                      preferred_element_type=jnp.float32).astype(out_dtype)


def expert_rows(xa: jax.Array, ea: jax.Array, wa: jax.Array, params: dict,
                cfg: Config) -> jax.Array:
    """``w2(wa * swiglu(w1 xa, w3 xa))`` per assignment row: rows ``[A, d]``, expert ids ``[A]``
    (into the stacked weights of ``params``), weights ``[A]`` -> ``[A, d]`` in xa's dtype.

    Fewer rows than experts (decode): gather each row's expert weights. Otherwise: sort rows by
    expert and run one grouped GEMM per projection (``ragged_dot_general``).
    """
    dt = xa.dtype
    sim, qz = cfg.quant_simulation, cfg.quantized
    n_exp = params["w1"][0].shape[0]
    rows = xa.shape[0]
    if rows < n_exp:
        def w(name):
            weight, scale = params[name]
            return dequant_experts(weight[ea], None if scale is None else scale[ea], dt)
        h = swiglu(_dot_per_assignment(xa, w("w1"), sim, qz, dt),
                   _dot_per_assignment(xa, w("w3"), sim, qz, dt), cfg.swiglu_limit)
        h = (wa[:, None] * h).astype(dt)
        return _dot_per_assignment(h, w("w2"), sim, qz, dt)
    order = jnp.argsort(ea, stable=True)
    group_sizes = jnp.bincount(ea, length=n_exp).astype(jnp.int32)
    xs = xa[order]
    deq = {n: dequant_experts(*params[n], dt) for n in ("w1", "w2", "w3")}
    h = swiglu(_dot_grouped(xs, deq["w1"], group_sizes, sim, qz, dt),
               _dot_grouped(xs, deq["w3"], group_sizes, sim, qz, dt), cfg.swiglu_limit)
    h = (wa[order][:, None] * h).astype(dt)
    out = _dot_grouped(h, deq["w2"], group_sizes, sim, qz, dt)
    return jnp.zeros_like(out).at[order].set(out)


def routed_experts(x: jax.Array, route_w: jax.Array, route_idx: jax.Array, params: dict,
                   cfg: Config, mesh=None) -> jax.Array:
    """Sum over each token's experts of ``w2(weight * swiglu(w1 x, w3 x))``: f32 ``[T, d]``.

    ``params`` maps ``w1``/``w2``/``w3`` to ``(weight, scale or None)`` stacked over experts.
    With a ``mesh`` the experts are split over its ``expert`` axis (expert parallelism).
    """
    if mesh is not None:
        from .parallel import expert_parallel
        return expert_parallel(x, route_w, route_idx, params, cfg.n_routed_experts, mesh,
                               lambda r, e, w, p: expert_rows(r, e, w, p, cfg))
    t, k = route_idx.shape
    token = jnp.repeat(jnp.arange(t), k)
    out = expert_rows(x[token], route_idx.reshape(-1), route_w.reshape(-1), params, cfg)
    return jax.ops.segment_sum(out.astype(jnp.float32), token, num_segments=t)


class StackedWeight(nn.Module):
    """One projection of all routed experts: ``weight [E, out, in]`` (+ ``scale``)."""
    cfg: Config
    out_features: int
    in_features: int

    @nn.compact
    def __call__(self):
        cfg = self.cfg
        e, o, i = cfg.n_routed_experts, self.out_features, self.in_features
        std = i ** -0.5
        if not cfg.quantized:
            return self.param("weight", normal_init(std), (e, o, i), act_dtype(cfg)), None
        if cfg.expert_dtype == "fp4":
            w = self.param("weight", fp4_packed_init, (e, o, i // 2))
            s = self.param("scale", pow2_scale_init(std, FP4_CODE_STD), (e, o, i // 32))
        else:
            w = self.param("weight", fp8_codes_init, (e, o, i))
            s = self.param("scale", pow2_scale_init(std, FP8_CODE_STD), (e, o // 128, i // 128))
        return w, s


class Experts(nn.Module):
    """Container giving the stacked routed-expert weights the names ``experts/w{1,2,3}``."""
    cfg: Config

    @nn.compact
    def __call__(self) -> dict:
        cfg = self.cfg
        d, inter = cfg.dim, cfg.moe_inter_dim
        return {"w1": StackedWeight(cfg, inter, d, name="w1")(),
                "w3": StackedWeight(cfg, inter, d, name="w3")(),
                "w2": StackedWeight(cfg, d, inter, name="w2")()}


class Expert(nn.Module):
    """The shared expert: SwiGLU with FP8-family linears and the same clamp."""
    cfg: Config

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        gate = Linear(cfg, cfg.dim, cfg.moe_inter_dim, "fp8", name="w1")(x)
        up = Linear(cfg, cfg.dim, cfg.moe_inter_dim, "fp8", name="w3")(x)
        h = swiglu(gate, up, cfg.swiglu_limit).astype(x.dtype)
        return Linear(cfg, cfg.moe_inter_dim, cfg.dim, "fp8", name="w2")(h)


def random_hash_table(key, shape, dtype=jnp.int32, *, n_experts: int):
    """tid2eid init: ``k`` distinct random experts per token id."""
    vocab, k = shape
    r = jax.random.uniform(key, (vocab, n_experts))
    return jnp.argsort(r, axis=-1)[:, :k].astype(dtype)


class Gate(nn.Module):
    """Router: f32 scores, selection by top-k of (score + bias) or by the hash table."""
    cfg: Config
    hashed: bool

    @nn.compact
    def __call__(self, x: jax.Array, token_ids: jax.Array):
        cfg = self.cfg
        w = self.param("weight", normal_init(cfg.dim ** -0.5), (cfg.n_routed_experts, cfg.dim),
                       jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32)
        logits = matmul_f32(x, w)
        if cfg.score_func == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
        elif cfg.score_func == "sigmoid":
            scores = jax.nn.sigmoid(logits)
        else:
            scores = jnp.sqrt(jax.nn.softplus(logits))
        k = cfg.n_activated_experts
        if self.hashed:
            table = self.param("tid2eid", lambda key, shape, dtype=jnp.int32: random_hash_table(
                key, shape, dtype, n_experts=cfg.n_routed_experts), (cfg.vocab_size, k))
            idx = table[token_ids].astype(jnp.int32)
        else:
            bias = self.param("bias", normal_init(0.1), (cfg.n_routed_experts,), jnp.float32)
            _, idx = jax.lax.top_k(scores + bias, k)
        weights = jnp.take_along_axis(scores, idx, axis=-1)
        if cfg.score_func != "softmax":
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights * cfg.route_scale, idx.astype(jnp.int32)


class MoE(nn.Module):
    cfg: Config
    layer_id: int
    mesh: object = None

    @nn.compact
    def __call__(self, x: jax.Array, token_ids: jax.Array) -> jax.Array:
        """x [B,S,d] (normed), token_ids [B,S] (hash routing) -> [B,S,d] in x's dtype."""
        cfg = self.cfg
        b, s, d = x.shape
        xf = x.reshape(b * s, d)
        weights, idx = Gate(cfg, self.layer_id < cfg.n_hash_layers, name="gate")(
            xf, token_ids.reshape(-1))
        params = Experts(cfg, name="experts")()
        y = routed_experts(xf, weights, idx, params, cfg, self.mesh)
        y = y + Expert(cfg, name="shared_experts")(xf).astype(jnp.float32)
        return y.astype(x.dtype).reshape(b, s, d)
