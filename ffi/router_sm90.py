"""``moe_router`` on Hopper: one launch of ``kernels/router_sm90.py`` (a cluster per group of
tokens) as an XLA custom call."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from dsv4_jax.kernels.router_config import RouterSm90Config, choose_config

__all__ = ["support", "moe_router_cute"]

# The operands of the routing the launch does not take (constants: no launch fills them).
_NO_BIAS = np.zeros((1,), np.float32)
_NO_TABLE = np.zeros((1, 1), np.int32)
_NO_TOKENS = np.zeros((1,), np.int32)


def support(x, weight, k: int, config: RouterSm90Config | None = None) -> tuple[bool, str]:
    """``config.is_supported`` for these arguments (config None: ``choose_config``'s);
    imports no cutlass."""
    tokens, experts = x.shape[0], weight.shape[0]
    config = config or choose_config(tokens, experts)
    return config.is_supported(experts=experts, dim=x.shape[1], tokens=tokens, k=k,
                               x_dtype=jnp.dtype(x.dtype).name,
                               weight_dtype=jnp.dtype(weight.dtype).name)


def moe_router_cute(x, weight, bias, table, token_ids, *, k: int, score_func: str,
                    route_scale: float, config: RouterSm90Config | None = None):
    """The kernel on ``x [T, d]`` bf16 -> ``(route_w [T, k] f32, route_idx [T, k] int32)``."""
    # Imported when a kernel is emitted (the reference path never loads cutlass); cute_call
    # first: it pins CUTE_DSL_ARCH before cutlass is imported.
    from .cute_call import cute_call
    from dsv4_jax.kernels import router_sm90 as kernel

    (t, d), experts = x.shape, weight.shape[0]
    config = config or choose_config(t, experts)
    hashed = table is not None
    shapes = (jax.ShapeDtypeStruct((t, k), jnp.float32), jax.ShapeDtypeStruct((t, k), jnp.int32))
    return cute_call(
        kernel.router_launcher, shapes, x, weight,
        _NO_BIAS if hashed else bias.astype(jnp.float32),
        table.astype(jnp.int32) if hashed else _NO_TABLE,
        token_ids.astype(jnp.int32) if hashed else _NO_TOKENS,
        experts=experts, dim=d, tokens=t, k=k, score_func=score_func,
        route_scale=float(route_scale), hashed=hashed,
        vocab=table.shape[0] if hashed else 1, cluster=config.cluster,
        tokens_per_cluster=config.tokens_per_cluster)
