"""Mesh axis names and the logical-axis rule table: the distribution policy in one place.

Mesh axes are ``("data", "expert")``. ``RULES`` maps each logical axis to mesh axes:

* ``batch`` -- activations, attention, the cache -- is split over all devices (data x expert):
  attention is data-parallel, never head-split (MQA heads share one entry; splitting heads
  would pad them and cut arithmetic intensity);
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

__all__ = ["DATA", "EXPERT", "RULES", "mesh_axes", "axis_size", "batch_axes", "check_batch",
           "cache_shardings"]

DATA, EXPERT = "data", "expert"

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
    """Mesh axes the batch is split over (a tuple, empty when none)."""
    return mesh_axes(mesh, "batch") or ()


def check_batch(batch: int, mesh: Mesh) -> None:
    n = axis_size(mesh, "batch")
    if batch % n:
        raise ValueError(f"batch {batch} is not divisible by the data-parallel size {n} "
                         f"(mesh data x expert = {dict(mesh.shape)})")


def cache_shardings(abstract_cache, mesh: Mesh, rules=None):
    """Every cache array is split along its batch dimension (dim 0)."""
    check_batch(abstract_cache.lengths.shape[0], mesh)
    axes = mesh_axes(mesh, "batch")
    return jax.tree.map(lambda x: NamedSharding(mesh, P(axes, *([None] * (x.ndim - 1)))),
                        abstract_cache)
