"""Mesh axis names and the logical-axis rule table: the distribution policy in one place.

Mesh axes are ``("data", "expert")``. ``RULES`` maps each logical axis to mesh axes:

* ``batch`` -- activations, attention, the cache -- is split over all devices (data x expert):
  attention is data-parallel, never head-split (MQA heads share one entry; splitting heads
  would pad them and cut arithmetic intensity). A small batch -- at most
  ``REPLICATE_MAX_ROWS`` rows per ``data`` group -- is split over ``data`` only and
  replicated over ``expert`` (``row_axes``): every device of a group then computes the
  group's attention (at a few rows its cost is reading the same weights either way), the
  expert exchange is one all-reduce a layer instead of an all-gather and a reduce-scatter,
  and a batch smaller than the device count needs no padding rows;
* ``expert``: routed experts are split over ``expert`` (expert parallelism), replicated over
  ``data``;
* ``vocab``: embedding and LM head are split over the vocabulary (all devices).

This module sits at the bottom of the import order (docs/architecture.md §1.2) so that the
cache (``Cache.init(mesh=...)``), the model's collectives (``models/parallel.py``) and the
parameter placement (``dsv4_jax.sharding``) all read the same table.
"""
from __future__ import annotations

import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

__all__ = ["DATA", "EXPERT", "RULES", "REPLICATE_MAX_ROWS", "mesh_axes", "axis_size",
           "batch_axes", "row_axes", "row_split", "padded_rows", "check_batch", "cache_shardings"]

DATA, EXPERT = "data", "expert"

# Rows per ``data`` group up to which a batch is replicated over ``expert`` rather than split
# (module docstring; docs/performance.md, "Small batches replicated over the expert axis").
REPLICATE_MAX_ROWS = 8

# logical axis -> mesh axes
RULES = {
    "batch": (DATA, EXPERT),
    "vocab": (DATA, EXPERT),
    "expert": EXPERT,
}


def mesh_axes(mesh: Mesh, logical) -> tuple | None:
    """The axes of ``mesh`` that logical axis ``logical`` is split over (None: replicated)."""
    if logical is None:
        return None
    axes = RULES[logical]
    axes = (axes,) if isinstance(axes, str) else axes
    axes = tuple(a for a in axes if a in mesh.axis_names)
    return axes if axes else None


def axis_size(mesh: Mesh, logical) -> int:
    """How many devices split logical axis ``logical`` on ``mesh``."""
    axes = mesh_axes(mesh, logical) or ()
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def batch_axes(mesh: Mesh) -> tuple:
    """Mesh axes a large batch is split over (a tuple, empty when none); a batch of a given
    size: ``row_axes``."""
    return mesh_axes(mesh, "batch") or ()


def _data_size(mesh: Mesh) -> int:
    return int(mesh.shape[DATA]) if DATA in mesh.axis_names else 1


def row_axes(mesh: Mesh, rows: int) -> tuple:
    """Mesh axes a batch of ``rows`` rows is split over: every batch axis, except ``expert``
    while a ``data`` group holds at most ``REPLICATE_MAX_ROWS`` rows (then replicated over
    it)."""
    axes = batch_axes(mesh)
    if EXPERT in axes and rows // _data_size(mesh) <= REPLICATE_MAX_ROWS:
        axes = tuple(a for a in axes if a != EXPERT)
    return axes


def row_split(mesh: Mesh, rows: int) -> int:
    """How many devices a batch of ``rows`` rows is split over (``row_axes``)."""
    return int(np.prod([mesh.shape[a] for a in row_axes(mesh, rows)], dtype=np.int64))


def padded_rows(mesh: Mesh, rows: int) -> int:
    """The least batch >= ``rows`` that ``mesh`` splits evenly (``row_axes``): a multiple of
    the ``data`` size while it stays replicated over ``expert``, else of every batch axis."""
    n_data = _data_size(mesh)
    small = -(-rows // n_data) * n_data
    if row_split(mesh, small) == n_data:
        return small
    n = axis_size(mesh, "batch")
    return -(-rows // n) * n


def check_batch(batch: int, mesh: Mesh) -> None:
    n = row_split(mesh, batch)
    if batch % n:
        raise ValueError(f"batch {batch} is not divisible by the {n} devices it is split "
                         f"over (mesh data x expert = {dict(mesh.shape)}; "
                         f"dsv4_jax.mesh_rules.padded_rows gives {padded_rows(mesh, batch)})")


def cache_shardings(abstract_cache, mesh: Mesh, rules=None):
    """Every cache array is split along its batch dimension (dim 0) like the batch's rows
    (``row_axes``)."""
    rows = abstract_cache.lengths.shape[0]
    check_batch(rows, mesh)
    axes = row_axes(mesh, rows) or None
    return jax.tree.map(lambda x: NamedSharding(mesh, P(axes, *([None] * (x.ndim - 1)))),
                        abstract_cache)
