"""The routed experts' schedule on Hopper: the assignment rows sorted by expert and cut into
tiles (``grouped_gemm_sm90.schedule``'s contract) plus each row's sorted position, in one
launch of ``kernels/moe_schedule_sm90.py`` where it takes the rows (decode sizes), else in
XLA.

``sorted_schedule(group_ids, groups, block_n)`` returns ``(order, position, valid_sorted,
tile_group, tile_row0, tile_rows)``: ``order`` [M] sorted position -> row, ``position`` [M]
its inverse, ``valid_sorted`` [M] bool, and the tile slots -- the same arrays either way
(tests/test_moe_schedule.py compares them bit for bit on the GPU).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4_jax.kernels import moe_schedule_config
from dsv4_jax.kernels.grouped_gemm_config import num_tile_slots
from . import grouped_gemm_sm90 as gemm
from .moe_reference import inverse_order

__all__ = ["sorted_schedule", "schedule_cute", "schedule_xla"]


def schedule_xla(group_ids: jax.Array, groups: int, block_n: int):
    """``sorted_schedule`` in XLA: ``grouped_gemm_sm90.schedule`` and a scatter of the
    inverse permutation."""
    order, valid_sorted, *tiles = gemm.schedule(group_ids, groups, block_n)
    return (order, inverse_order(order), valid_sorted, *tiles)


def schedule_cute(group_ids: jax.Array, groups: int, block_n: int):
    """``sorted_schedule`` in one launch of the schedule kernel (a custom call)."""
    # Imported when a kernel is emitted (the XLA path never loads cutlass); cute_call first:
    # it pins CUTE_DSL_ARCH before cutlass is imported.
    from .cute_call import cute_call
    from dsv4_jax.kernels import moe_schedule_sm90 as kernel

    rows = group_ids.shape[0]
    slots = num_tile_slots(rows, groups, block_n)
    shapes = tuple(jax.ShapeDtypeStruct((n,), jnp.int32) for n in (rows,) * 3 + (slots,) * 3)
    order, position, valid, *tiles = cute_call(
        kernel.moe_schedule_launcher, shapes, group_ids.astype(jnp.int32), rows=rows,
        groups=groups, block_n=block_n, slots=slots)
    return (order, position, valid != 0, *tiles)


def sorted_schedule(group_ids: jax.Array, groups: int, block_n: int):
    """The schedule kernel where it takes these rows (``moe_schedule_config.supports``),
    else XLA; see the module docstring."""
    if moe_schedule_config.supports(group_ids.shape[0], groups)[0]:
        return schedule_cute(group_ids, groups, block_n)
    return schedule_xla(group_ids, groups, block_n)
