"""``hc_pre`` on Hopper: one launch of ``kernels/hc_pre_sm90.py`` (a cluster per group of
tokens) as an XLA custom call."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from dsv4_jax.kernels.hc_pre_config import MAX_SUMMED_ROWS, HcPreSm90Config, choose_config

from .ffn_sum import FfnSum
from .hc_sinkhorn import hc_split_sinkhorn

__all__ = ["support", "hc_pre_cute"]

_NO_F32 = np.zeros((4,), np.float32)
_NO_I32 = np.zeros((4,), np.int32)


def _tokens(x) -> int:
    tokens = 1
    for d in x.shape[:-2]:
        tokens *= d
    return tokens


def support(x, fn, weight, n: int, config: HcPreSm90Config | None = None, *,
            pending: bool = False, pending_out=None) -> tuple[bool, str]:
    """``config.is_supported`` for these arguments (config None: ``choose_config``'s;
    ``pending_out``: the pending out, an array or an ``FfnSum``); imports no cutlass."""
    name = lambda a: jnp.dtype(a.dtype).name  # noqa: E731
    if isinstance(pending_out, FfnSum):
        if pending_out.k > MAX_SUMMED_ROWS:
            return False, (f"a pending FfnSum of k = {pending_out.k} rows per token (at most "
                           f"{MAX_SUMMED_ROWS})")
        if name(pending_out.rows) != name(x):
            return False, f"FfnSum rows of dtype {name(pending_out.rows)} (x's: {name(x)})"
    config = config or choose_config(_tokens(x), x.shape[-1], pending)
    return config.is_supported(n=n, dim=x.shape[-1], tokens=_tokens(x), x_dtype=name(x),
                               fn_dtype=name(fn), weight_dtype=name(weight), pending=pending)


def hc_pre_cute(x, fn, scale, base, weight, pending_out=None, pending_post=None,
                pending_comb=None, *, n: int, iters: int, hc_eps: float, norm_eps: float,
                config: HcPreSm90Config | None = None, split=hc_split_sinkhorn):
    """The kernel on ``x [..., n, d]`` bf16 -> ``(out [..., d] bf16, post, comb)``; with the
    ``pending_*`` arrays x is first updated by their hc_post, and x_new is returned too
    (``pending_out`` an ``FfnSum``: its parts are added in the kernel). With the config's
    ``split_apart`` post and comb come from ``split(mixes, scale, base, n=, iters=, eps=)``
    on the mixes the kernel stores (the ``hc_split_sinkhorn`` op: its kernel on Hopper)."""
    # Imported when a kernel is emitted (the reference path never loads cutlass); cute_call
    # first: it pins CUTE_DSL_ARCH before cutlass is imported.
    from .cute_call import cute_call
    from dsv4_jax.kernels import hc_pre_sm90 as kernel

    lead, d = x.shape[:-2], x.shape[-1]
    t = _tokens(x)
    pending = pending_out is not None
    config = config or choose_config(t, d, pending)
    apart = config.split_apart
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    # Outputs the kernel does not write are 4-element placeholders.
    shapes = (jax.ShapeDtypeStruct((t, d), x.dtype), f32(4) if apart else f32(t, n),
              f32(4) if apart else f32(t, n * n),
              jax.ShapeDtypeStruct((t, n * d) if pending else (4,), x.dtype),
              f32(t, (2 + n) * n) if apart else f32(4))
    summed_k, parts = 0, (_NO_I32, _NO_I32, _NO_I32)
    if isinstance(pending_out, FfnSum):
        # The shared row stands where the out row would; the routed rows are added to it.
        # (valid as int32: a convert beside the experts' launches, off the step's path.)
        summed_k = pending_out.k
        parts = (pending_out.rows, pending_out.position, pending_out.valid.astype(jnp.int32))
        pending_out = pending_out.shared
    if pending:
        update = (pending_out.reshape(t, d), pending_post.reshape(t, n).astype(jnp.float32),
                  pending_comb.reshape(t, n * n).astype(jnp.float32))
    else:       # constants (no launch fills them); the kernel does not read them
        update = (np.zeros((4,), jnp.dtype(x.dtype)), _NO_F32, _NO_F32)
    out, post, comb, x_new, mixes = cute_call(
        kernel.hc_pre_launcher, shapes, x.reshape(t, n * d), fn, scale.astype(jnp.float32),
        base.astype(jnp.float32), weight, *update, *parts, n=n, dim=d, tokens=t, iters=iters,
        hc_eps=float(hc_eps), norm_eps=float(norm_eps), pending=pending, summed_k=summed_k,
        cluster=config.cluster, tokens_per_cluster=config.tokens_per_cluster,
        split_apart=apart)
    if apart:
        _, post, comb = split(mixes, scale, base, n=n, iters=iters, eps=float(hc_eps))
    outs = (out.reshape(*lead, d), post.reshape(*lead, n), comb.reshape(*lead, n, n))
    return outs + ((x_new.reshape(x.shape),) if pending else ())
