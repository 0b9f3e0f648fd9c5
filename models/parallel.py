"""The model's collectives on a ``jax.sharding.Mesh`` with axes ``("data", "expert")``.

Layout (the rule table is ``dsv4_jax.mesh_rules.RULES``): activations, the cache and attention
are data-parallel (no head splitting) over the axes ``mesh_rules.row_axes`` gives for the
batch: all devices (``data x expert``), or -- a batch of at most ``REPLICATE_MAX_ROWS`` rows
per ``data`` group -- ``data`` only, the rows replicated over ``expert``. Routed experts are
split over ``expert`` (replicated over ``data``); embedding and LM head over the vocabulary
(all devices). Each collective section is a ``jax.shard_map``, so the same model code runs
on one device (``mesh=None``: these functions are not called) and on N. Every function
takes the batch's row count from dim 0 of its row arguments (``expert_parallel``: ``rows``).

* ``embed``: all-gather the ids over the row axes, look up the local vocabulary slice (zeros
  elsewhere), reduce-scatter back to the local rows (and sum over the vocabulary axes the
  rows are replicated on) -- exact, one row per id is non-zero.
* ``head_logits``: all-gather the hidden rows, local vocabulary slice of the logits,
  all-gather over the vocabulary axes the rows are replicated on, all-to-all back to
  full-vocabulary logits of the local rows.
* ``expert_parallel``: each device runs its local experts on the assignments that reach them,
  each assignment's row non-zero on one device only, so every sum below is exact and the
  rows are summed per token in assignment order, as on one device. Rows replicated over
  ``expert``: each device computes its own experts' rows of every assignment (zero rows for
  the others) and one all-reduce gives every device all rows -- one collective a layer. Few
  tokens per device (decode on split rows): the group's tokens, ids and weights gathered in
  one all-gather, the rows back by one reduce-scatter. Many tokens (prefill on split rows):
  tokens go to the devices owning their experts (all-to-all over ``expert`` with a
  worst-case capacity, so nothing is ever dropped) and come back the same way.
* ``batch_parallel``: runs a per-row function (the sparse attention op, the indexer's
  selection, the kernels' GEMMs) on local rows only -- a custom call outside a shard_map
  would have its operands gathered to every device by the partitioner.
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dsv4_jax.ffi.moe import sum_rows_per_token
from dsv4_jax.mesh_rules import EXPERT, mesh_axes, row_axes, row_split


def _shard_map(fn, mesh, in_specs, out_specs):
    # check_vma=False: the kernels' custom calls (cutlass_call) carry no varying-axes type,
    # so platform_dependent(cuda=kernel, default=reference) would not type-check inside.
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _spec(mesh, ndim: int, first=None) -> P:
    return P(first or None, *([None] * (ndim - 1)))


def _vocab_split(mesh, row_split_axes: tuple):
    """The vocabulary's axes, and those of them the rows are not split over."""
    vocab = mesh_axes(mesh, "vocab") or ()
    return vocab, tuple(a for a in vocab if a not in row_split_axes)


def embed(table: jax.Array, ids: jax.Array, mesh) -> jax.Array:
    """``table[ids]`` with the table split over the vocabulary and ids over the batch."""
    axes = row_axes(mesh, ids.shape[0])
    vocab, replicated = _vocab_split(mesh, axes)

    def local(tab, ids_l):
        all_ids = jax.lax.all_gather(ids_l, axes, axis=0, tiled=True) if axes else ids_l
        start = jax.lax.axis_index(vocab) * tab.shape[0]
        rel = all_ids - start
        ok = (rel >= 0) & (rel < tab.shape[0])
        rows = jnp.take(tab, jnp.clip(rel, 0, tab.shape[0] - 1), axis=0)
        rows = jnp.where(ok[..., None], rows, jnp.zeros((), tab.dtype))
        if axes:
            rows = jax.lax.psum_scatter(rows, axes, scatter_dimension=0, tiled=True)
        return jax.lax.psum(rows, replicated) if replicated else rows

    return _shard_map(local, mesh, (P(vocab, None), _spec(mesh, ids.ndim, axes)),
                      _spec(mesh, ids.ndim + 1, axes))(table, ids)


def head_logits(x: jax.Array, weight: jax.Array, mesh, matmul) -> jax.Array:
    """``matmul(x, weight)`` (f32 logits) with the head split over the vocabulary."""
    axes = row_axes(mesh, x.shape[0])
    vocab, replicated = _vocab_split(mesh, axes)

    def local(w, xl):
        xs = jax.lax.all_gather(xl, axes, axis=0, tiled=True) if axes else xl
        part = matmul(xs, w)                                   # [B, ..., V/N]
        last = part.ndim - 1
        if replicated:      # vocabulary slices of the axes the rows are replicated on
            part = jax.lax.all_gather(part, replicated, axis=last, tiled=True)
        if axes:
            part = jax.lax.all_to_all(part, axes, split_axis=0, concat_axis=last, tiled=True)
        return part

    return _shard_map(local, mesh, (P(vocab, None), _spec(mesh, x.ndim, axes)),
                      _spec(mesh, x.ndim, axes))(weight, x)


def batch_parallel(fn, mesh, batched_args: tuple, replicated_args: tuple, n_out: int):
    """``fn(*batched_args, *replicated_args)`` on each device's rows (dim 0 of batched args:
    the batch's rows, which give the split, ``mesh_rules.row_axes``)."""
    rows = next(a.shape[0] for a in batched_args if a is not None)
    axes = row_axes(mesh, rows)
    in_specs = (tuple(None if a is None else _spec(mesh, a.ndim, axes) for a in batched_args)
                + tuple(None if a is None else P() for a in replicated_args))
    out_specs = tuple(_spec(mesh, 1, axes) for _ in range(n_out))
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


def expert_parallel(x, route_w, route_idx, params, n_experts: int, mesh, rows_fn, rows: int,
                    gather_max_tokens: int = GATHER_MAX_TOKENS):
    """Routed-expert sum for the tokens of a batch of ``rows`` rows (``x [T, d]``, T a
    multiple of ``rows``, split like the rows: ``mesh_rules.row_axes``) and experts split
    over ``expert``.

    ``rows_fn(rows [R, d], local expert [R], weight [R], local params) -> [R, d]`` computes
    single assignments (``ffi.moe_expert_rows``); ids outside ``[0, local experts)`` (-1 for
    empty slots and for other devices' experts) must come back as zero rows. Returns f32
    ``[T, d]``, each token's rows summed in assignment order (bit for bit the one-device sum).
    ``gather_max_tokens``: the most tokens per device that take the gathering exchange.
    """
    axes = row_axes(mesh, rows)
    n = mesh.shape[EXPERT] if EXPERT in mesh.axis_names else 1
    per_device = n_experts // n

    def own_rows(xs, ids, ws, pl):
        """Every assignment's row of this device's experts, zero rows for the others'."""
        k = ids.shape[1]
        owner = ids // per_device
        mine = owner == jax.lax.axis_index(EXPERT)
        local_ids = jnp.where(mine, ids - owner * per_device, -1).reshape(-1)
        return rows_fn(jnp.repeat(xs, k, axis=0), local_ids,
                       jnp.where(mine, ws, 0).reshape(-1), pl)         # [t k, d]

    def replicated(xl, wl, il, pl):
        # The rows are on every device of the group: one all-reduce of the assignment rows
        # (each non-zero on one device: the sum is that row, exactly).
        t, k = il.shape
        return sum_rows_per_token(jax.lax.psum(own_rows(xl, il, wl, pl), EXPERT), None, t, k)

    def gathered(xl, wl, il, pl):
        t, k = il.shape
        row_specs = tuple(jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for v in (xl, il, wl))
        packed = jax.lax.all_gather(pack_rows(xl, il, wl), EXPERT, axis=0, tiled=True)
        xs, ids, ws = unpack_rows(packed, row_specs)             # the group's n t tokens
        # Each assignment's row is non-zero on one device: the sum is that row, exactly.
        mine_rows = jax.lax.psum_scatter(own_rows(xs, ids, ws, pl), EXPERT, scatter_dimension=0,
                                         tiled=True)
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

    if x.shape[0] % rows:
        raise ValueError(f"expert_parallel: tokens {x.shape[0]} are not a multiple of the "
                         f"batch's rows {rows}")
    local_tokens = x.shape[0] // row_split(mesh, rows)
    if n > 1 and EXPERT not in axes:
        local = replicated
    elif n > 1 and local_tokens <= gather_max_tokens:
        local = gathered
    else:
        local = all_to_all
    expert_spec = jax.tree.map(lambda v: None if v is None else _spec(mesh, v.ndim, EXPERT),
                               params, is_leaf=lambda v: v is None)
    return _shard_map(local, mesh, (_spec(mesh, 2, axes), _spec(mesh, 2, axes),
                                    _spec(mesh, 2, axes), expert_spec),
                      _spec(mesh, 2, axes))(x, route_w, route_idx, params)
