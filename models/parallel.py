"""The model's collectives on a ``jax.sharding.Mesh`` with axes ``("data", "expert")``.

Layout (the rule table is ``dsv4_jax.mesh_rules.RULES``): activations, the cache and attention
are data-parallel over *all* devices (batch split over ``data x expert``, no head splitting);
routed experts are split over ``expert`` (replicated over ``data``); embedding and LM head are
split over the vocabulary (all devices). Each collective section is a ``jax.shard_map``, so the
same model code runs on one device (``mesh=None``: these functions are not called) and on N:

* ``embed``: all-gather the ids, look up the local vocabulary slice (zeros elsewhere),
  reduce-scatter back to the local rows -- exact, one row per id is non-zero.
* ``head_logits``: all-gather the hidden rows, local vocabulary slice of the logits, all-to-all
  back to full-vocabulary logits of the local rows.
* ``expert_parallel``: each device runs its local experts on the assignments that reach them.
  Few tokens (decode): every device of an ``expert`` group gathers the group's tokens, ids and
  weights in one all-gather, computes the assignment rows of its own experts (zero rows for
  the others) and a reduce-scatter hands each device its tokens' rows -- two collectives a
  layer, each row non-zero on one device only, so the sum is exact. Many tokens (prefill):
  tokens go to the devices owning their experts (all-to-all over ``expert`` with a
  worst-case capacity, so nothing is ever dropped) and come back the same way. Either way
  the rows are summed per token in assignment order, as on one device.
* ``batch_parallel``: runs a per-row function (the sparse attention op) on local rows only.
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dsv4_jax.ffi.moe import sum_rows_per_token
from dsv4_jax.mesh_rules import EXPERT, axis_size, batch_axes


def _shard_map(fn, mesh, in_specs, out_specs):
    # check_vma=False: the kernels' custom calls (cutlass_call) carry no varying-axes type,
    # so platform_dependent(cuda=kernel, default=reference) would not type-check inside.
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _spec(mesh, ndim: int, first=None) -> P:
    return P(first, *([None] * (ndim - 1)))


def embed(table: jax.Array, ids: jax.Array, mesh) -> jax.Array:
    """``table[ids]`` with the table split over the vocabulary and ids over the batch."""
    axes = batch_axes(mesh)

    def local(tab, ids_l):
        all_ids = jax.lax.all_gather(ids_l, axes, axis=0, tiled=True)
        start = jax.lax.axis_index(axes) * tab.shape[0]
        rel = all_ids - start
        ok = (rel >= 0) & (rel < tab.shape[0])
        rows = jnp.take(tab, jnp.clip(rel, 0, tab.shape[0] - 1), axis=0)
        rows = jnp.where(ok[..., None], rows, jnp.zeros((), tab.dtype))
        return jax.lax.psum_scatter(rows, axes, scatter_dimension=0, tiled=True)

    return _shard_map(local, mesh, (P(axes, None), _spec(mesh, ids.ndim, axes)),
                      _spec(mesh, ids.ndim + 1, axes))(table, ids)


def head_logits(x: jax.Array, weight: jax.Array, mesh, matmul) -> jax.Array:
    """``matmul(x, weight)`` (f32 logits) with the head split over the vocabulary."""
    axes = batch_axes(mesh)

    def local(w, xl):
        xs = jax.lax.all_gather(xl, axes, axis=0, tiled=True)
        part = matmul(xs, w)                                   # [B, ..., V/N]
        return jax.lax.all_to_all(part, axes, split_axis=0, concat_axis=part.ndim - 1,
                                  tiled=True)

    return _shard_map(local, mesh, (P(axes, None), _spec(mesh, x.ndim, axes)),
                      _spec(mesh, x.ndim, axes))(weight, x)


def batch_parallel(fn, mesh, batched_args: tuple, replicated_args: tuple, n_out: int):
    """``fn(*batched_args, *replicated_args)`` on each device's rows (dim 0 of batched args)."""
    axes = batch_axes(mesh)
    in_specs = (tuple(None if a is None else _spec(mesh, a.ndim, axes) for a in batched_args)
                + tuple(None if a is None else P() for a in replicated_args))
    out_specs = tuple(P(axes) for _ in range(n_out))
    return _shard_map(lambda *a: fn(*a), mesh, in_specs, out_specs)(*batched_args,
                                                                     *replicated_args)


# Tokens per device up to which the expert-parallel exchange gathers the group's tokens (two
# small collectives a layer) instead of the capacity all-to-all (four, with sort and scatter
# glue): decode and speculative steps; prefill chunks keep the all-to-all, whose return trip
# moves half the rows (docs/performance.md, 2 x H200, "Decode and long context").
GATHER_MAX_TOKENS = 64


def pack_rows(*arrays) -> jax.Array:
    """``[t, ...]`` arrays of any dtypes as one ``[t, bytes]`` uint8 array (their bits, in
    order), so that one collective moves them all."""
    return jnp.concatenate([jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(a.shape[0], -1)
                            for a in arrays], axis=1)


def unpack_rows(packed: jax.Array, like: tuple) -> list:
    """The arrays ``pack_rows`` packed, for rows of ``packed``: ``like`` gives each one's
    trailing shape and dtype (``jax.ShapeDtypeStruct`` of one row)."""
    out, start = [], 0
    for spec in like:
        item = jnp.dtype(spec.dtype).itemsize
        size = int(np.prod(spec.shape, dtype=np.int64)) * item
        part = packed[:, start:start + size]
        start += size
        if item > 1:
            part = part.reshape(packed.shape[0], -1, item)
        out.append(jax.lax.bitcast_convert_type(part, spec.dtype).reshape(
            (packed.shape[0],) + tuple(spec.shape)))
    return out


def expert_parallel(x, route_w, route_idx, params, n_experts: int, mesh, rows_fn,
                    gather_max_tokens: int = GATHER_MAX_TOKENS):
    """Routed-expert sum for tokens split over the batch and experts split over ``expert``.

    ``rows_fn(rows [R, d], local expert [R], weight [R], local params) -> [R, d]`` computes
    single assignments (``ffi.moe_expert_rows``); ids outside ``[0, local experts)`` (-1 for
    empty slots and for other devices' experts) must come back as zero rows. Returns f32
    ``[T, d]``, each token's rows summed in assignment order (bit for bit the one-device sum).
    ``gather_max_tokens``: the most tokens per device that take the gathering exchange.
    """
    axes = batch_axes(mesh)
    n = mesh.shape[EXPERT] if EXPERT in mesh.axis_names else 1
    per_device = n_experts // n

    def gathered(xl, wl, il, pl):
        t, k = il.shape
        row_specs = tuple(jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for v in (xl, il, wl))
        packed = jax.lax.all_gather(pack_rows(xl, il, wl), EXPERT, axis=0, tiled=True)
        xs, ids, ws = unpack_rows(packed, row_specs)             # the group's n t tokens
        owner = ids // per_device
        mine = owner == jax.lax.axis_index(EXPERT)
        local_ids = jnp.where(mine, ids - owner * per_device, -1).reshape(-1)
        rows = rows_fn(jnp.repeat(xs, k, axis=0), local_ids,
                       jnp.where(mine, ws, 0).reshape(-1), pl)   # [n t k, d], zero if not mine
        # Each assignment's row is non-zero on one device: the sum is that row, exactly.
        mine_rows = jax.lax.psum_scatter(rows, EXPERT, scatter_dimension=0, tiled=True)
        return sum_rows_per_token(mine_rows, None, t, k)

    def all_to_all(xl, wl, il, pl):
        t, k = il.shape
        a = t * k
        flat_e, flat_w = il.reshape(a), wl.reshape(a)
        token = jnp.repeat(jnp.arange(t), k)
        dest = flat_e // per_device
        order = jnp.argsort(dest, stable=True)
        counts = jnp.bincount(dest, length=n)
        starts = jnp.cumsum(counts) - counts
        d_sorted = dest[order]
        slot = jnp.arange(a) - starts[d_sorted]                 # position in the dest block
        send_x = jnp.zeros((n, a, xl.shape[-1]), xl.dtype).at[d_sorted, slot].set(
            xl[token[order]])
        send_e = jnp.full((n, a), -1, jnp.int32).at[d_sorted, slot].set(
            flat_e[order] % per_device)
        send_w = jnp.zeros((n, a), wl.dtype).at[d_sorted, slot].set(flat_w[order])
        if n > 1:
            exchange = lambda v: jax.lax.all_to_all(v, EXPERT, 0, 0, tiled=True)
        else:
            exchange = lambda v: v
        recv_x, recv_e, recv_w = exchange(send_x), exchange(send_e), exchange(send_w)
        # Empty capacity slots keep id -1: the MoE op drops ids outside [0, E) (zero rows),
        # and a kernel can skip them instead of computing some expert with weight 0.
        out = rows_fn(recv_x.reshape(n * a, -1), recv_e.reshape(-1), recv_w.reshape(-1), pl)
        back = exchange(out.reshape(n, a, -1))
        return sum_rows_per_token(back[d_sorted, slot], order, t, k)

    local_tokens = x.shape[0] // axis_size(mesh, "batch")
    local = gathered if n > 1 and local_tokens <= gather_max_tokens else all_to_all
    expert_spec = jax.tree.map(lambda v: None if v is None else _spec(mesh, v.ndim, EXPERT),
                               params, is_leaf=lambda v: v is None)
    return _shard_map(local, mesh, (_spec(mesh, 2, axes), _spec(mesh, 2, axes),
                                    _spec(mesh, 2, axes), expert_spec),
                      _spec(mesh, 2, axes))(x, route_w, route_idx, params)
