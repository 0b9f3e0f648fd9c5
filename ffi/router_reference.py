"""The MoE router's pure-JAX reference, its parts and argument checks (contract:
``ffi/router.py``).

``matmul_f32`` (the f32 linear family) and ``router_scores`` are the model's own
definitions: ``models/layers.py`` imports ``matmul_f32`` from here, so the op and the model's
other f32 linears (LM head, compressor) cannot drift apart.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["moe_router_reference", "check_router_args", "matmul_f32", "router_scores",
           "SCORE_FUNCS"]

HIGHEST = jax.lax.Precision.HIGHEST
SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


def _matmul_upcast(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), w.astype(jnp.float32),
                      precision=HIGHEST)


def _matmul_bf16_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32)


def matmul_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w.T`` in true f32 (no TF32 on GPUs), as the reference's f32 ``F.linear``.

    BF16 ``x`` and ``w`` on a GPU: a BF16 x BF16 product is exact in f32, so the GEMM takes
    them as they are with f32 accumulation -- the reference's numbers up to the f32 summation
    order, without writing and reading an f32 copy of the weight (the LM head's is 2 GB) every
    call. Elsewhere both are upcast (the CPU's bf16 dot sums in another order)."""
    if x.dtype == w.dtype == jnp.bfloat16:
        return jax.lax.platform_dependent(x, w, cuda=_matmul_bf16_f32, default=_matmul_upcast)
    return _matmul_upcast(x, w)


def router_scores(logits: jax.Array, score_func: str) -> jax.Array:
    """The router's affinities from its f32 logits ``[..., E]``."""
    if score_func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    if score_func == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jnp.sqrt(jax.nn.softplus(logits))


def check_router_args(x, weight, bias, table, token_ids, k, score_func, route_scale) -> None:
    """``TypeError``/``ValueError`` naming the argument and its shape, in one line."""
    op = "moe_router"
    shape = lambda a: tuple(a.shape)  # noqa: E731
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        kind = TypeError if x.ndim == 2 else ValueError
        raise kind(f"{op}: x must be floating [T, d]; x has shape {shape(x)} and dtype "
                   f"{x.dtype}")
    t, d = x.shape
    if weight.ndim != 2 or weight.shape[1] != d:
        raise ValueError(f"{op}: weight must be [E, d = {d}] for x of shape {shape(x)}; "
                         f"weight has shape {shape(weight)}")
    if not jnp.issubdtype(weight.dtype, jnp.floating):
        raise TypeError(f"{op}: weight must be floating; weight has dtype {weight.dtype}")
    e = weight.shape[0]
    if not isinstance(k, int) or not 1 <= k <= e:
        raise ValueError(f"{op}: k must be an int in [1, E = {e}], got {k!r}")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"{op}: score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    if not isinstance(route_scale, (int, float)):
        raise TypeError(f"{op}: route_scale must be a float, got {type(route_scale).__name__}")
    if (bias is None) == (table is None):
        raise ValueError(f"{op}: give exactly one of bias (top-k routing) and table (hash "
                         f"routing); got {'both' if bias is not None else 'neither'}")
    if bias is not None and shape(bias) != (e,):
        raise ValueError(f"{op}: bias must be [E = {e}]; bias has shape {shape(bias)}")
    if table is not None:
        if table.ndim != 2 or table.shape[1] != k:
            raise ValueError(f"{op}: table must be [vocab, k = {k}]; table has shape "
                             f"{shape(table)}")
        if token_ids is None or shape(token_ids) != (t,):
            got = None if token_ids is None else shape(token_ids)
            raise ValueError(f"{op}: token_ids must be [T = {t}] with a table; token_ids "
                             f"has shape {got}")
        for name, a in (("table", table), ("token_ids", token_ids)):
            if not jnp.issubdtype(a.dtype, jnp.integer):
                raise TypeError(f"{op}: {name} must be integer; {name} has dtype {a.dtype}")


def moe_router_reference(x, weight, bias, table, token_ids, *, k: int, score_func: str,
                         route_scale: float):
    """Pure-JAX definition of ``moe_router`` (runs anywhere); see ``ffi/router.py``."""
    check_router_args(x, weight, bias, table, token_ids, k, score_func, route_scale)
    scores = router_scores(matmul_f32(x, weight), score_func)
    if table is None:
        _, idx = jax.lax.top_k(scores + bias, k)
    else:
        idx = table[token_ids]
    idx = idx.astype(jnp.int32)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if score_func != "softmax":
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights * route_scale, idx
