"""Mixture of experts (docs/architecture.md §3.7): sqrt-softplus router, hash routing, routed + shared SwiGLU.

Routed experts are stored stacked: ``experts/w{1,2,3}/weight [E, out, in]`` (packed FP4
``[E, out, in/2]`` int8 with ``scale [E, out, in/32]``, or FP8 with 128x128 scales, or plain).
Per (token, expert) assignment the reference computes::

    gate = w1(x).float(); up = w3(x).float()      # FP8 activations x FP4 weights -> bf16
    up = clamp(up, -l, l); gate = min(gate, l)
    h = (weight * silu(gate) * up).to(bf16)        # routing weight applied before w2
    y += w2(h)                                     # f32 accumulation over experts

The routed experts are the op ``dsv4_jax.ffi.moe_experts`` (``ffi/moe.py`` holds the contract):
the CuTe kernel when lowering for Hopper, else its XLA reference -- gathered expert weights
per assignment when there are fewer assignments than experts (decode), one grouped GEMM per
projection (``lax.ragged_dot_general``) otherwise.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn

from dsv4_jax import quant
from dsv4_jax.config import Config
from dsv4_jax.ffi.ffn_sum import FfnSum
from dsv4_jax.ffi.moe import moe_expert_rows, moe_experts, swiglu
from dsv4_jax.ffi.policy import DEFAULT_POLICY, KernelPolicy
from dsv4_jax.ffi.router import moe_router
from .parallel import batch_parallel, expert_parallel
from .layers import (FP8Weight, Linear, act_dtype, fp4_packed_init, fp8_codes_init,
                     grouped_linear, normal_init, pow2_scale_init, FP4_CODE_STD,
                     FP8_CODE_STD)


def moe_op_kwargs(cfg: Config) -> dict:
    """The op's static arguments for a model configuration."""
    return dict(swiglu_limit=cfg.swiglu_limit, quantized=cfg.quantized,
                simulate=cfg.quant_simulation)


def expert_rows(xa: jax.Array, ea: jax.Array, wa: jax.Array, params: dict,
                cfg: Config, policy=DEFAULT_POLICY) -> jax.Array:
    """``w2(wa * swiglu(w1 xa, w3 xa))`` per assignment row (``ffi.moe_expert_rows``): rows
    ``[A, d]``, expert ids ``[A]`` into the stacked weights of ``params`` (ids outside
    ``[0, E)`` inside jit are dropped), weights ``[A]`` -> ``[A, d]`` in xa's dtype.
    ``policy``: a ``KernelPolicy`` or what ``KernelPolicy.coerce`` takes."""
    policy = KernelPolicy.coerce(policy)
    return moe_expert_rows(xa, ea, wa, params["w1"], params["w3"], params["w2"],
                           **moe_op_kwargs(cfg),
                           implementation=policy.implementation_for("moe_expert_rows"),
                           policy=policy.grouped_gemm)


def routed_experts(x: jax.Array, route_w: jax.Array, route_idx: jax.Array, params: dict,
                   cfg: Config, mesh=None, policy=DEFAULT_POLICY, rows: int | None = None,
                   summed: bool = True):
    """Sum over each token's experts of ``w2(weight * swiglu(w1 x, w3 x))``: f32 ``[T, d]``.

    ``params`` maps ``w1``/``w2``/``w3`` to ``(weight, scale or None)`` stacked over experts.
    With a ``mesh`` the experts are split over its ``expert`` axis (expert parallelism) and
    each device runs ``moe_expert_rows`` on the rows it received; ``rows``: the batch's rows
    (the T tokens are rows x sequence; default T), which set how they are split
    (``mesh_rules.row_axes``). ``policy``: a ``KernelPolicy`` (or ``"cute"``, ``"xla"``,
    None) choosing the ops' implementations. ``summed=False`` (one device only): the
    unsummed ``(rows, position, valid)`` of ``ffi.ffn_sum.FfnSum`` (``moe_experts``).
    """
    policy = KernelPolicy.coerce(policy)
    if mesh is not None:
        if not summed:
            raise ValueError("routed_experts: summed=False needs one device (mesh None)")
        return expert_parallel(x, route_w, route_idx, params, cfg.n_routed_experts, mesh,
                               lambda r, e, w, p: expert_rows(r, e, w, p, cfg, policy),
                               x.shape[0] if rows is None else rows)
    return moe_experts(x, route_idx, route_w, params["w1"], params["w3"], params["w2"],
                       **moe_op_kwargs(cfg), implementation=policy.implementation_for(
                           "moe_experts"), policy=policy.grouped_gemm, summed=summed)


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
            fmt = quant.FP4_BLOCKED if cfg.expert_layout == "blocked" else quant.FP4
            w = self.param("weight", fp4_packed_init, (e, *fmt.stored_shape(o, i)))
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
    """The shared expert: SwiGLU with FP8-family linears and the same clamp. Quantised, it is
    the routed experts' arithmetic with one expert and weight 1: a gated grouped GEMM (w1, w3
    and the SwiGLU in one launch on a Hopper GPU) and the w2 GEMM."""
    cfg: Config
    policy: KernelPolicy = DEFAULT_POLICY
    mesh: object = None

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        d, inter = cfg.dim, cfg.moe_inter_dim
        if cfg.quantized:
            w1, w3 = FP8Weight(d, inter, name="w1")(), FP8Weight(d, inter, name="w3")()
            w2 = FP8Weight(inter, d, name="w2")()
            one = lambda w: (w[0][None], w[1][None])
            kw = dict(simulate=cfg.quant_simulation, policy=self.policy, mesh=self.mesh)
            h = grouped_linear(x, one(w1), w_up=one(w3), swiglu_limit=cfg.swiglu_limit, **kw)
            return grouped_linear(h, one(w2), **kw)
        gate = Linear(cfg, d, inter, "fp8", name="w1")(x)
        up = Linear(cfg, d, inter, "fp8", name="w3")(x)
        h = swiglu(gate, up, cfg.swiglu_limit).astype(x.dtype)
        return Linear(cfg, inter, d, "fp8", name="w2")(h)


def random_hash_table(key, shape, dtype=jnp.int32, *, n_experts: int):
    """tid2eid init: ``k`` distinct random experts per token id."""
    vocab, k = shape
    r = jax.random.uniform(key, (vocab, n_experts))
    return jnp.argsort(r, axis=-1)[:, :k].astype(dtype)


class Gate(nn.Module):
    """Router: f32 scores, selection by top-k of (score + bias) or by the hash table, the
    routing weights (the op ``ffi.moe_router``: one kernel launch at decode on Hopper)."""
    cfg: Config
    hashed: bool
    policy: KernelPolicy = DEFAULT_POLICY
    mesh: object = None           # with a mesh, each device routes its own rows

    @nn.compact
    def __call__(self, x: jax.Array, token_ids: jax.Array):
        cfg = self.cfg
        w = self.param("weight", normal_init(cfg.dim ** -0.5), (cfg.n_routed_experts, cfg.dim),
                       jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32)
        k = cfg.n_activated_experts
        bias = table = None
        if self.hashed:
            table = self.param("tid2eid", lambda key, shape, dtype=jnp.int32: random_hash_table(
                key, shape, dtype, n_experts=cfg.n_routed_experts), (cfg.vocab_size, k))
        else:
            bias = self.param("bias", normal_init(0.1), (cfg.n_routed_experts,), jnp.float32)

        def route(xs, ids, weight, b, tab):        # rows [b, s, d] -> per token [b s, k]
            return moe_router(xs.reshape(-1, xs.shape[-1]), weight, b, tab,
                              None if ids is None else ids.reshape(-1), k=k,
                              score_func=cfg.score_func, route_scale=cfg.route_scale,
                              implementation=self.policy.implementation_for("moe_router"))
        ids = token_ids if self.hashed else None
        if self.mesh is None:
            return route(x, ids, w, bias, table)
        # The rows (dim 0 of x [B, S, d]) set how the batch is split (mesh_rules.row_axes).
        return batch_parallel(route, self.mesh, (x, ids), (w, bias, table), 2)


class MoE(nn.Module):
    cfg: Config
    layer_id: int
    mesh: object = None
    policy: KernelPolicy = DEFAULT_POLICY       # the ops' implementations and kernel configs

    @nn.compact
    def __call__(self, x: jax.Array, token_ids: jax.Array, as_parts: bool = False):
        """x [B,S,d] (normed), token_ids [B,S] (hash routing) -> [B,S,d] in x's dtype, or
        with ``as_parts`` (the block's call) its unsummed parts (``ffi.ffn_sum.FfnSum``,
        ``total()`` the same bits) when the policy's ``ffn_sum_in_hc_pre`` is on and there
        is no mesh: the next mHC pre adds them. On a mesh the [B, S] arrays go to the
        collective sections as they are: their rows set how the batch is split
        (``mesh_rules.row_axes``)."""
        cfg = self.cfg
        b, s, d = x.shape
        gate = Gate(cfg, self.layer_id < cfg.n_hash_layers, self.policy, self.mesh, name="gate")
        weights, idx = gate(x, token_ids)
        params = Experts(cfg, name="experts")()
        parts = (as_parts and self.mesh is None
                 and KernelPolicy.coerce(self.policy).ffn_sum_in_hc_pre)
        y = routed_experts(x.reshape(b * s, d), weights, idx, params, cfg, self.mesh,
                           self.policy, rows=b, summed=not parts)
        shared = Expert(cfg, self.policy, self.mesh, name="shared_experts")(x)
        if parts:
            return FfnSum(*y, shared=shared.reshape(b, s, d), k=idx.shape[-1])
        y = y + shared.reshape(b * s, d).astype(jnp.float32)
        return y.astype(x.dtype).reshape(b, s, d)
