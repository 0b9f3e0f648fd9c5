"""Running DSV4 on a ``jax.sharding.Mesh``: mesh construction, parameter shardings, placement.

The distribution policy -- mesh axes ``("data", "expert")`` and the logical-axis rule table
``RULES`` -- is in ``dsv4_jax.mesh_rules`` (re-exported here). ``PARAM_AXES`` below maps
parameter paths to logical axes; everything it does not match (attention weights, shared
experts, norms, routers, mHC) is replicated.

``DSV4(cfg, mesh=mesh)`` runs the collectives (models/parallel.py); ``shard`` places a
parameter tree, ``Cache.init(..., mesh=mesh)`` a cache, ``init_params(..., shardings=...)`` and
``load(..., mesh=...)`` create parameters directly on the devices. This module only places;
what a placement costs in memory (parameters, cache, activations, the fit check) is
``dsv4_jax.plan``'s.
"""
from __future__ import annotations

import re

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import Config
from .params import abstract_params, leaf_keys
from .mesh_rules import (DATA, EXPERT, RULES, axis_size, cache_shardings, check_batch,
                         mesh_axes)

__all__ = ["RULES", "PARAM_AXES", "make_mesh", "param_shardings", "shard", "cache_shardings",
           "check_mesh", "check_batch"]

# parameter path (regex on "a/b/c") -> logical axes of its dimensions; unmatched: replicated
PARAM_AXES = (
    (r"^embed/weight$", ("vocab", None)),
    (r"^head/weight$", ("vocab", None)),
    (r"/ffn/experts/w[123]/(weight|scale)$", ("expert", None, None)),
)


def make_mesh(data: int = 1, expert: int | None = None, devices=None) -> Mesh:
    """A ``("data", "expert")`` mesh; ``expert`` defaults to all devices not used by ``data``."""
    devices = list(devices if devices is not None else jax.devices())
    if expert is None:
        if len(devices) % data:
            raise ValueError(f"make_mesh: {len(devices)} devices are not divisible by data={data}")
        expert = len(devices) // data
    if data * expert > len(devices):
        raise ValueError(f"make_mesh: data={data} x expert={expert} needs {data * expert} "
                         f"devices, {len(devices)} available")
    # Auto axes: XLA's partitioner propagates the batch sharding through the per-row ops;
    # the collectives are explicit shard_maps (models/parallel.py).
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((data, expert), (DATA, EXPERT), axis_types=auto,
                         devices=devices[:data * expert])


def check_mesh(cfg: Config, mesh: Mesh) -> None:
    """``ValueError`` when the mesh cannot hold this model's layout."""
    unknown = set(mesh.axis_names) - {DATA, EXPERT}
    if unknown:
        raise ValueError(f"mesh axes must be 'data' and/or 'expert', got {mesh.axis_names}")
    n_exp = axis_size(mesh, "expert")
    if cfg.n_routed_experts % n_exp:
        raise ValueError(f"the mesh's expert axis ({n_exp}) does not divide n_routed_experts "
                         f"({cfg.n_routed_experts})")
    n_vocab = axis_size(mesh, "vocab")
    if cfg.vocab_size % n_vocab:
        raise ValueError(f"vocab_size {cfg.vocab_size} is not divisible by the {n_vocab} devices "
                         "that split the embedding and the LM head")


def _path(keys) -> str:
    return "/".join(leaf_keys(keys))


def param_spec(path: str, ndim: int, mesh: Mesh) -> P:
    for pattern, logical in PARAM_AXES:
        if re.search(pattern, path):
            axes = [mesh_axes(mesh, lg) for lg in logical][:ndim]
            return P(*axes, *([None] * (ndim - len(axes))))
    return P()


def param_shardings(cfg: Config, mesh: Mesh, abstract=None):
    """Tree of ``NamedSharding`` matching the parameter tree of ``DSV4(cfg)``."""
    check_mesh(cfg, mesh)
    abstract = abstract if abstract is not None else abstract_params(cfg)
    return jax.tree_util.tree_map_with_path(
        lambda k, leaf: NamedSharding(mesh, param_spec(_path(k), leaf.ndim, mesh)), abstract)


def shard(params, cfg: Config, mesh: Mesh):
    """Place an existing parameter tree on the mesh (``jax.device_put`` leaf by leaf)."""
    shardings = param_shardings(cfg, mesh, params)
    return jax.tree.map(jax.device_put, params, shardings)

