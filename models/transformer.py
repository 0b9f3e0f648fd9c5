"""The DSV4 model: embedding -> mHC blocks (attention + MoE) -> mHC head -> logits; MTP block.

``DSV4.__call__(tokens [B,S], cache)`` appends the tokens of every row at that row's length
(prefill and decode are the same call) and returns ``(logits, new_cache)``. ``num_new [B]``
marks how many of the S tokens of each row are real: the rest is padding that changes no
state. ``DSV4.mtp`` runs the multi-token-prediction block (docs/architecture.md §3.9) on the
main model's final residual streams.
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import flax.linen as nn

from dsv4_jax.config import Config
from dsv4_jax.cache import Cache, LayerCache
from dsv4_jax.ffi.hc_pre_reference import pending_total
from dsv4_jax.ffi.policy import DEFAULT_POLICY, KernelPolicy
from dsv4_jax.mesh_rules import check_batch
from .attention import Attention, commit_layer
from . import parallel
from .layers import Linear, RMSNorm, act_dtype, matmul_f32, normal_init
from .mhc import hc_head, hc_post, mhc_pre
from .moe import MoE


class Embedding(nn.Module):
    """Token embedding ``weight [vocab, d]`` (BF16 lookup; split over the vocabulary on a mesh)."""
    cfg: Config
    mesh: object = None

    def setup(self):
        cfg = self.cfg
        self.weight = self.param("weight", normal_init(1.0), (cfg.vocab_size, cfg.dim),
                                 act_dtype(cfg))

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        if self.mesh is not None:
            return parallel.embed(self.weight, token_ids, self.mesh)
        return jnp.take(self.weight, token_ids, axis=0)


class LMHead(nn.Module):
    """``head.weight [vocab, d]`` (BF16), used as an f32 GEMM like the reference."""
    cfg: Config
    mesh: object = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        w = self.param("weight", normal_init(cfg.dim ** -0.5), (cfg.vocab_size, cfg.dim),
                       jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32)
        if self.mesh is not None:
            return parallel.head_logits(x, w, self.mesh, matmul_f32)
        return matmul_f32(x, w)


class Block(nn.Module):
    """One transformer block: [mHC-pre -> norm -> attention -> mHC-post] then the same for MoE."""
    cfg: Config
    layer_id: int
    policy: KernelPolicy = DEFAULT_POLICY
    mesh: object = None

    def _hc(self, prefix: str):
        cfg = self.cfg
        n, d = cfg.hc_mult, cfg.dim
        fn = self.param(f"hc_{prefix}_fn", normal_init((n * d) ** -0.5), (cfg.n_hc_mixes, n * d),
                        jnp.float32)
        base = self.param(f"hc_{prefix}_base", normal_init(0.1), (cfg.n_hc_mixes,), jnp.float32)
        scale = self.param(f"hc_{prefix}_scale", nn.initializers.ones, (3,), jnp.float32)
        return fn, scale, base

    def _mhc_pre(self, x, prefix, pending=None):
        """The sub-block's normalised input, post gates and comb matrix (``ffi.hc_pre``:
        mixes, split, collapse and the ``{prefix}_norm`` RMSNorm in one op). ``pending``:
        the previous sub-block's ``(out, post, comb)``, its hc_post applied to x in the same
        op, which then also returns the updated streams."""
        cfg = self.cfg
        fn, scale, base = self._hc(prefix)
        norm = RMSNorm(cfg.dim, cfg.norm_eps, name=f"{prefix}_norm")
        return mhc_pre(x, fn, scale, base, norm.weight, cfg.hc_mult, cfg.hc_sinkhorn_iters,
                       cfg.hc_eps, cfg.norm_eps,
                       implementation=self.policy.implementation_for("hc_pre"),
                       split_implementation=self.policy.implementation_for("hc_split_sinkhorn"),
                       mixes_implementation=self.policy.implementation_for("hc_stream_mixes"),
                       mesh=self.mesh, pending=pending)

    def block(self, x, token_ids, lcache: LayerCache, lengths, num_new, incoming=None):
        """The block on the streams ``x``; returns ``(x after attention, lcache, the layer's
        pending cache update, (f, post, comb))``: the MoE sub-block's hc_post is left to the
        caller (``hc_post(f, x, post, comb)``, or the next block's ``incoming``, applied
        inside its first mHC pre). ``incoming``: the previous block's ``(f, post, comb)``."""
        cfg = self.cfg
        normed, post, comb, *updated = self._mhc_pre(x, "attn", pending=incoming)
        if incoming is not None:
            x, = updated
        a, lcache, pending = Attention(cfg, self.layer_id, self.policy, self.mesh,
                                       name="attn")(normed, lcache, lengths, num_new)
        normed, post, comb, x = self._mhc_pre(x, "ffn", pending=(a, post, comb))
        f = MoE(cfg, self.layer_id, self.mesh, self.policy, name="ffn")(normed, token_ids,
                                                                       as_parts=True)
        return x, lcache, pending, (f, post, comb)

    @nn.compact
    def __call__(self, x, token_ids, lcache, lengths, num_new, incoming=None):
        """``block``: the streams before the MoE's hc_post and its ``(f, post, comb)``."""
        return self.block(x, token_ids, lcache, lengths, num_new, incoming)


def _head_params(module: nn.Module, cfg: Config):
    n = cfg.hc_mult
    fn = module.param("hc_head_fn", normal_init((n * cfg.dim) ** -0.5), (n, n * cfg.dim),
                      jnp.float32)
    base = module.param("hc_head_base", normal_init(0.1), (n,), jnp.float32)
    scale = module.param("hc_head_scale", nn.initializers.ones, (1,), jnp.float32)
    return fn, scale, base


class MTPBlock(Block):
    """MTP block: ``e_proj(enorm(embed(next ids))) + h_proj(hnorm(H))`` -> a SWA-only block
    -> its own mHC head and norm; the caller applies the shared LM head."""

    @nn.compact
    def __call__(self, hidden, token_ids, embedded, lcache, lengths, num_new):
        cfg = self.cfg
        e = RMSNorm(cfg.dim, cfg.norm_eps, name="enorm")(embedded)
        hs = RMSNorm(cfg.dim, cfg.norm_eps, name="hnorm")(hidden)
        x = (Linear(cfg, cfg.dim, cfg.dim, "fp8", self.policy, self.mesh, name="e_proj")(e)[
                :, :, None, :]
             + Linear(cfg, cfg.dim, cfg.dim, "fp8", self.policy, self.mesh, name="h_proj")(hs))
        x, lcache, _, (f, post, comb) = self.block(x, token_ids, lcache, lengths, num_new)
        x = hc_post(pending_total(f), x, post, comb)
        fn, scale, base = _head_params(self, cfg)
        h = hc_head(x, fn, scale, base, cfg.norm_eps, cfg.hc_eps)
        return RMSNorm(cfg.dim, cfg.norm_eps, name="norm")(h), x, lcache


class DSV4(nn.Module):
    """DeepSeek-V4 as a Flax Linen module (see the module docstring for the call contract).

    ``implementation`` chooses the ``dsv4_jax.ffi`` ops' implementations and kernel
    configurations: None (the CuTe kernels where they run), ``"xla"`` / ``"cute"`` for every
    op, a mapping ``{op name: implementation}``, or a ``dsv4_jax.KernelPolicy`` (which also
    carries the kernels' policies). It is a value: the environment is not read here (the
    command line and ``dsv4_jax.load`` build it with ``KernelPolicy.from_environment``).
    ``mesh``: a ``jax.sharding.Mesh`` with axes ("data", "expert") to run data-parallel
    attention and expert-parallel MoE (see ``dsv4_jax.sharding``); None runs on one device.
    ``runtime_checks``: validate token ids and cache capacity when they are traced (a host
    callback that raises); concrete inputs are always validated with a ``ValueError``.
    """
    config: Config
    implementation: str | KernelPolicy | None = None
    runtime_checks: bool = True
    mesh: object = None

    def __post_init__(self):
        # Validate the implementation on construction (a misspelt op name fails here, not
        # when a step is traced); a mapping becomes a hashable KernelPolicy.
        policy = KernelPolicy.coerce(self.implementation)
        if not (self.implementation is None or isinstance(self.implementation, str)):
            object.__setattr__(self, "implementation", policy)
        super().__post_init__()

    def setup(self):
        cfg, mesh = self.config, self.mesh
        self.embed = Embedding(cfg, mesh)
        policy = KernelPolicy.coerce(self.implementation)
        self.layers = [Block(cfg, i, policy, mesh) for i in range(cfg.n_layers)]
        self.mtp = [MTPBlock(cfg, cfg.n_layers + i, policy, mesh)
                    for i in range(cfg.n_mtp_layers)]
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = LMHead(cfg, mesh)
        self.head_params = _head_params(self, cfg)

    def logits(self, normed: jax.Array) -> jax.Array:
        """f32 logits of normed final hidden states ``[..., d]`` (f32 GEMM with the BF16 head)."""
        return self.head(normed)

    def embed_streams(self, tokens: jax.Array) -> jax.Array:
        """Embedding and mHC initialisation: ``hc_mult`` identical copies ``[B, S, hc, d]``."""
        x = self.embed(tokens)
        return jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], self.config.hc_mult, x.shape[-1]))

    def final_norm(self, hidden: jax.Array) -> jax.Array:
        """mHC head collapse of the streams ``[..., hc, d]`` then the final RMSNorm."""
        cfg = self.config
        fn, scale, base = self.head_params
        return self.norm(hc_head(hidden, fn, scale, base, cfg.norm_eps, cfg.hc_eps))

    def __call__(self, tokens, cache: Cache, *, num_new=None, logits_at: str = "all",
                 return_hidden: bool = False, return_pending: bool = False):
        """Append ``tokens [B, S]`` to ``cache``; returns ``(logits, cache[, hidden][, pending])``.

        logits: ``[B, S, vocab]`` f32 (``logits_at="all"``) or ``[B, vocab]`` at each row's
        last real token (``"last"``). hidden: the final residual streams ``[B, S, hc, d]``
        (before the mHC head), the MTP block's input. pending: what ``commit(old_cache,
        pending, n)`` needs to keep only the first ``n_b <= num_new_b`` tokens instead
        (speculative decoding decides that after seeing the logits).
        """
        cfg = self.config
        num_new = _check_call(cfg, tokens, cache, num_new, logits_at, self.runtime_checks,
                              cache.lengths, "cache.lengths")
        if self.mesh is not None:
            check_batch(tokens.shape[0], self.mesh)
        x = self.embed_streams(tokens)
        new_layers, pendings, outgoing = [], [], None
        for layer, lcache in zip(self.layers, cache.layers):
            # Each block's last hc_post runs inside the next block's first mHC pre.
            x, lcache, pending, outgoing = layer(x, tokens, lcache, cache.lengths, num_new,
                                                 outgoing)
            new_layers.append(lcache)
            pendings.append(pending)
        f, post, comb = outgoing
        x = hc_post(pending_total(f), x, post, comb)
        logits = self.logits(_select(self.final_norm(x), num_new, logits_at))
        new_cache = cache.replace(layers=tuple(new_layers), lengths=cache.lengths + num_new)
        if cfg.n_mtp_layers and self.is_initializing():     # create the MTP parameters too
            self.mtp_forward(x, tokens, cache)
        out = (logits, new_cache) + ((x,) if return_hidden else ())
        return out + ((tuple(pendings),) if return_pending else ())

    def mtp_forward(self, hidden, tokens, cache: Cache, *, num_new=None,
                    logits_at: str = "all", depth: int = 0):
        """MTP block ``depth``: hidden ``[B,S,hc,d]`` of positions i, tokens = ids at i+1.

        Appends at ``cache.mtp_lengths`` and returns ``(draft logits, cache, mtp hidden)``.
        """
        cfg = self.config
        if not cfg.n_mtp_layers:
            raise ValueError("mtp_forward: this config has n_mtp_layers = 0")
        num_new = _check_call(cfg, tokens, cache, num_new, logits_at, self.runtime_checks,
                              cache.mtp_lengths, "cache.mtp_lengths")
        if hidden.shape != (*tokens.shape, cfg.hc_mult, cfg.dim):
            raise ValueError(f"mtp_forward: hidden must be {(*tokens.shape, cfg.hc_mult, cfg.dim)}"
                             f", got {hidden.shape}")
        normed, x, lcache = self.mtp[depth](hidden, tokens, self.embed(tokens), cache.mtp[depth],
                                            cache.mtp_lengths, num_new)
        logits = self.logits(_select(normed, num_new, logits_at))
        mtp = cache.mtp[:depth] + (lcache,) + cache.mtp[depth + 1:]
        return logits, cache.replace(mtp=mtp, mtp_lengths=cache.mtp_lengths + num_new), x


def commit(cache: Cache, pending: tuple, num_new: jax.Array) -> Cache:
    """``cache`` (as it was before the call that produced ``pending``) after keeping the
    first ``num_new [B]`` tokens of that call -- exactly the cache a call with only those
    tokens would have produced. Parameter-free and cheap (state rows and table writes)."""
    layers = tuple(commit_layer(lc, p, cache.lengths, num_new)
                   for lc, p in zip(cache.layers, pending))
    return cache.replace(layers=layers, lengths=cache.lengths + num_new)


def _select(h, num_new, logits_at):
    if logits_at == "all":
        return h
    last = jnp.maximum(num_new - 1, 0)
    return jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_call(cfg, tokens, cache, num_new, logits_at, runtime_checks, lengths, lengths_name):
    """Argument checks of a model call; returns num_new as an int32 [B] array."""
    if not isinstance(cache, Cache):
        raise TypeError(f"cache must be a dsv4_jax.Cache, got {type(cache).__name__}")
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    b, s = tokens.shape
    if cache.batch != b:
        raise ValueError(f"tokens batch {b} does not match the cache batch {cache.batch} "
                         f"(tokens shape {tuple(tokens.shape)})")
    if jnp.dtype(cache.dtype) != jnp.dtype(cfg.dtype):
        raise TypeError(f"cache dtype {cache.dtype} does not match config dtype {cfg.dtype}")
    if len(cache.layers) != cfg.n_layers or len(cache.mtp) != cfg.n_mtp_layers:
        raise ValueError(f"cache has {len(cache.layers)} layers / {len(cache.mtp)} MTP blocks, "
                         f"config has {cfg.n_layers} / {cfg.n_mtp_layers}")
    if logits_at not in ("all", "last"):
        raise ValueError(f"logits_at must be 'all' or 'last', got {logits_at!r}")
    if num_new is None:
        num_new = jnp.full((b,), s, jnp.int32)
    else:
        num_new = jnp.asarray(num_new)
        if num_new.shape != (b,) or not jnp.issubdtype(num_new.dtype, jnp.integer):
            raise ValueError(f"num_new must be an int array of shape ({b},), got "
                             f"{num_new.dtype}{tuple(num_new.shape)}")
        num_new = num_new.astype(jnp.int32)
    if all(_is_concrete(a) for a in (tokens, num_new, lengths)):
        _validate_values(np.asarray(tokens), np.asarray(num_new), np.asarray(lengths),
                         cfg.vocab_size, cache.max_len, lengths_name)
    elif runtime_checks:
        jax.debug.callback(_validate_values, tokens, num_new, lengths, cfg.vocab_size,
                           cache.max_len, lengths_name)
    return num_new


def _validate_values(tokens, num_new, lengths, vocab, max_len, lengths_name):
    tokens, num_new, lengths = np.asarray(tokens), np.asarray(num_new), np.asarray(lengths)
    s = tokens.shape[1]
    real = np.arange(s)[None, :] < num_new[:, None]
    bad = real & ((tokens < 0) | (tokens >= vocab))
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise ValueError(f"tokens: id {int(tokens[r, c])} at [{r}, {c}] is outside [0, {vocab})")
    if ((num_new < 0) | (num_new > s)).any():
        raise ValueError(f"num_new must be in [0, {s}], got {num_new.tolist()}")
    end = lengths + num_new
    if (end > max_len).any():
        r = int(np.argmax(end > max_len))
        raise ValueError(f"writing past max_len: row {r} has {int(lengths[r])} tokens "
                         f"({lengths_name}) + {int(num_new[r])} new > max_len {max_len}")
