"""Helpers shared by the HF and orbax paths: target config, shardings, tree checks, progress.

* ``target_config`` applies ``load``'s keyword overrides to the configuration a checkpoint
  was written for (``Config.replace``: unknown or mistyped fields raise ``TypeError``), and
  ``checkpoint_precision`` gives the config whose parameter tree the files actually hold.
* ``leaf_shardings`` turns ``load(shardings=...)`` (a tree, a callable, one ``Sharding``, or
  nothing) into one ``Sharding`` per leaf, checked against the tree before anything loads.
* Parameters are handled in *groups* -- one per top-level key of the tree (``embed``,
  ``layers_3``, ``mtp_0``, ...; loose top-level arrays form ``globals``) -- the unit the
  orbax layout stores and ``convert`` streams.
"""
from __future__ import annotations

import re
import sys
from collections import Counter

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding
from tqdm.auto import tqdm

from dsv4_jax import plan, sharding as rules
from dsv4_jax.config import Config
from .names import leaf_keys
from .safetensors_io import CheckpointError

GLOBALS_GROUP = "globals"
_DTYPE_NAMES = {"bfloat16": "bfloat16", "float32": "float32"}


# ----------------------------------------------------------------------------- configs
def _dtype_name(dtype) -> str:
    if isinstance(dtype, str) and dtype in _DTYPE_NAMES:
        return dtype
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in _DTYPE_NAMES:
        raise ValueError(f"load: dtype must be 'bfloat16' or 'float32', got {dtype!r}")
    return name


def target_config(source: Config, overrides: dict, *, dequantize: bool, dtype) -> Config:
    """The configuration ``load`` returns: ``source`` with ``overrides``, ``dtype`` and
    ``dequantize`` applied; ``ValueError`` when the precision cannot be produced on load."""
    overrides = dict(overrides)
    if dtype is not None:
        name = _dtype_name(dtype)
        if overrides.get("dtype", name) != name:
            raise ValueError(f"load: dtype={dtype!r} conflicts with dtype={overrides['dtype']!r}")
        overrides["dtype"] = name
    if dequantize:
        if overrides.get("quantized") is True:
            raise ValueError("load: dequantize=True conflicts with quantized=True")
        overrides["quantized"] = False
    target = source.replace(**overrides)
    if target.quantized and not source.quantized:
        raise ValueError("load: quantized=True needs a quantized checkpoint; this one stores "
                         "plain weights (quantizing on load is not supported)")
    if target.quantized and target.expert_dtype != source.expert_dtype:
        raise ValueError(f"load: expert_dtype={target.expert_dtype!r} but the checkpoint stores "
                         f"{source.expert_dtype!r} experts (use dequantize=True for plain weights)")
    return target


def checkpoint_precision(target: Config, source: Config) -> Config:
    """``target``'s structure in ``source``'s storage precision: the tree the files hold."""
    return target.replace(quantized=source.quantized, expert_dtype=source.expert_dtype,
                          dtype=source.dtype)


# ----------------------------------------------------------------------------- trees
def flat_leaves(tree) -> list[tuple[tuple, object]]:
    """``[(key tuple, leaf)]`` in ``jax.tree_util`` order."""
    return [(leaf_keys(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def nest(flat: dict) -> dict:
    """``{key tuple: value}`` -> nested dict."""
    out: dict = {}
    for keys, value in flat.items():
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return out


def group_of(keys: tuple) -> str:
    return keys[0] if len(keys) > 1 else GLOBALS_GROUP


def group_subtree(group: str, leaves: dict) -> dict:
    """Nested dict of one group's ``{full key tuple: leaf}``, without the group key."""
    if group == GLOBALS_GROUP:
        return {k[0]: v for k, v in leaves.items()}
    return nest({k[1:]: v for k, v in leaves.items()})


def split_groups(params: dict) -> list[tuple[str, dict]]:
    """``[(group, subtree)]`` of a params tree (inverse of ``merge_groups``)."""
    groups: dict[str, dict] = {}
    for keys, leaf in flat_leaves(params):
        groups.setdefault(group_of(keys), {})[keys] = leaf
    return [(g, group_subtree(g, leaves)) for g, leaves in groups.items()]


def merge_groups(groups) -> dict:
    params: dict = {}
    for group, subtree in groups:
        if group == GLOBALS_GROUP:
            params.update(subtree)
        else:
            params[group] = subtree
    return params


def describe(shape, dtype) -> str:
    return f"{np.dtype(dtype).name}{list(shape)}"


def summarize_names(names, limit: int = 64) -> str:
    """All names when there are few; else the first ``limit`` and every index pattern with
    its count (a wrong-format directory can mismatch 100k names)."""
    names = sorted(names)
    if len(names) <= limit:
        return ", ".join(names)
    patterns = Counter(re.sub(r"\d+", "*", n) for n in names)
    return (", ".join(names[:limit]) + f", ... ({len(names)} in all; patterns: "
            + ", ".join(f"{p} x{c}" for p, c in sorted(patterns.items())) + ")")


def tree_differences(expected: dict, got: dict, got_label: str) -> list[str]:
    """Differences between two ``{key tuple: (shape, dtype)}`` maps, one line per kind."""
    lines = []
    missing = ["/".join(k) for k in expected if k not in got]
    extra = ["/".join(k) for k in got if k not in expected]
    if missing:
        lines.append(f"{len(missing)} missing in {got_label}: {summarize_names(missing)}")
    if extra:
        lines.append(f"{len(extra)} unexpected in {got_label}: {summarize_names(extra)}")
    for k, (shape, dtype) in expected.items():
        if k in got:
            gshape, gdtype = got[k]
            if tuple(gshape) != tuple(shape) or np.dtype(gdtype) != np.dtype(dtype):
                lines.append(f"{'/'.join(k)}: expected {describe(shape, dtype)}, "
                             f"{got_label} has {describe(gshape, gdtype)}")
    return lines


def shape_map(tree) -> dict:
    return {k: (tuple(x.shape), x.dtype) for k, x in flat_leaves(tree)}


# ----------------------------------------------------------------------------- shardings
def default_device() -> jax.Device:
    dev = jax.config.jax_default_device
    if isinstance(dev, jax.Device):
        return dev
    return jax.devices(dev)[0] if isinstance(dev, str) else jax.devices()[0]


def leaf_shardings(abstract, shardings, mesh=None, cfg=None) -> dict:
    """``{key tuple: Sharding}`` for every leaf of ``abstract`` (see module docstring).

    With a ``mesh`` and no ``shardings`` the rule table of ``dsv4_jax.sharding`` decides, after
    checking that the mesh fits the config and that the parameters fit the devices' memory
    (``dsv4_jax.plan.check_fits``)."""
    flat = flat_leaves(abstract)
    if shardings is None and mesh is not None:
        rules.check_mesh(cfg, mesh)
        plan.check_fits(cfg, mesh, abstract=abstract)
        shardings = rules.param_shardings(cfg, mesh, abstract)
    if shardings is None:
        one = SingleDeviceSharding(default_device())
        return {k: one for k, _ in flat}
    if isinstance(shardings, Sharding):
        out = {k: shardings for k, _ in flat}
    elif callable(shardings):
        out = {k: shardings(k, x) for k, x in flat}
    else:
        given = {leaf_keys(p): s for p, s in jax.tree_util.tree_leaves_with_path(
            shardings, is_leaf=lambda x: isinstance(x, Sharding))}
        diffs = tree_differences({k: ((), np.int8) for k, _ in flat},
                                 {k: ((), np.int8) for k in given}, "shardings")
        if diffs:
            raise ValueError("load: the shardings tree does not match the parameter tree:\n  "
                             + "\n  ".join(diffs))
        out = given
    for k, x in flat:
        s = out[k]
        if not isinstance(s, Sharding):
            raise TypeError(f"load: sharding of {'/'.join(k)} must be a jax.sharding.Sharding, "
                            f"got {type(s).__name__}")
        try:
            s.shard_shape(tuple(x.shape))
        except ValueError as e:
            raise ValueError(f"load: sharding {s} does not fit {'/'.join(k)} "
                             f"{describe(x.shape, x.dtype)}: {e}") from None
    return out


def replicated_like(sharding):
    """A sharding over the same devices that replicates (for leaves the target lacks)."""
    if isinstance(sharding, SingleDeviceSharding):
        return sharding
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    devices = np.array(sorted(sharding.device_set, key=lambda d: d.id))
    return NamedSharding(jax.sharding.Mesh(devices, ("d",)), PartitionSpec())


# ----------------------------------------------------------------------------- progress
class _NoProgress:
    def update(self, n=1):
        pass

    def close(self):
        pass

    def set_postfix_str(self, s, refresh=True):
        pass


def progress_bar(progress, total: int, desc: str, unit: str = "B"):
    """tqdm on a terminal (``progress=None``), forced on/off by True/False."""
    show = sys.stderr.isatty() if progress is None else bool(progress)
    if not show:
        return _NoProgress()
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=sys.stderr,
                dynamic_ncols=True)


MAX_LISTED = 10


def raise_if(lines: list[str], header: str, limit: int = MAX_LISTED):
    """One CheckpointError: ``header`` (the cause, one line), then the first ``limit``
    problems and "... and N more" (a wrong config can mismatch every tensor)."""
    if lines:
        shown = lines[:limit] + ([f"... and {len(lines) - limit} more"]
                                 if len(lines) > limit else [])
        raise CheckpointError(header + "\n  " + "\n  ".join(shown))
