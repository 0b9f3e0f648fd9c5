"""Our own checkpoint layout: orbax ``StandardCheckpointer`` items plus the config as JSON.

::

    <dir>/dsv4_config.json      {"format": "dsv4-jax-orbax", "version": 1, "config": {...}}
    <dir>/params/<group>/       one orbax item per group: embed, head, norm, layers_<i>,
                                mtp_<i>, globals (the loose top-level hc_head_* arrays)

Weights are stored exactly as in the parameter tree (FP8 / packed FP4 with E8M0 scales when
quantized). One item per group lets ``convert`` write an HF checkpoint layer by layer
(host memory bounded by one layer) and lets ``load`` restore and convert layer by layer.
The config file is written last, so an interrupted save is not mistaken for a checkpoint.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.config import Config
from dsv4_jax import quant
from dsv4_jax.params import abstract_params, unblock_expert_weights
from . import precision
from .common import (GLOBALS_GROUP, checkpoint_precision, flat_leaves, group_of, group_subtree,
                     leaf_shardings, merge_groups, progress_bar, raise_if, replicated_like,
                     shape_map, split_groups, target_config, tree_differences)
from .safetensors_io import CheckpointError

CONFIG_FILE = "dsv4_config.json"
PARAMS_DIR = "params"
FORMAT, VERSION = "dsv4-jax-orbax", 1


def _orbax():
    # Imported on first use, not at the top: orbax adds about half a second to every
    # `import dsv4_jax`, and only orbax directories need it.
    import orbax.checkpoint
    return orbax.checkpoint


def is_orbax_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


# ----------------------------------------------------------------------------- save
def save(path, params, config: Config, *, overwrite: bool = False, progress=None) -> str:
    """Write ``params`` (the tree of ``DSV4(config)``) and ``config``; returns the path."""
    if not isinstance(config, Config):
        raise TypeError(f"save: config must be a dsv4_jax.Config, got {type(config).__name__}")
    if not isinstance(params, dict):
        raise TypeError(f"save: params must be the parameter dict, got {type(params).__name__}")
    raise_if(tree_differences(shape_map(abstract_params(config)), shape_map(params), "params"),
             "save: params do not match the config's parameter tree:")
    groups = split_groups(params)
    n_groups = len(groups)
    if config.expert_layout == "blocked":
        # Checkpoints hold the experts in rows: unblock one group at a time while writing,
        # so the extra memory is one group's expert weights.
        groups = ((group, unblock_expert_weights(subtree)) for group, subtree in groups)
        config = dataclasses.replace(config, expert_layout="rows")
    return write_groups(path, config, groups, overwrite=overwrite, progress=progress,
                        n_groups=n_groups)


def _prepare_dir(path: str, overwrite: bool) -> None:
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise FileExistsError(f"save: {path} exists and is not a directory")
        if os.listdir(path):
            if not overwrite:
                raise FileExistsError(f"save: {path} is not empty (overwrite=True, or --overwrite, "
                                      "replaces a dsv4_jax checkpoint)")
            if not is_orbax_dir(path):
                raise FileExistsError(f"save: refusing to overwrite {path}: it is not a "
                                      "dsv4_jax orbax checkpoint")
            os.remove(os.path.join(path, CONFIG_FILE))      # invalid until the new one is done
            shutil.rmtree(os.path.join(path, PARAMS_DIR), ignore_errors=True)
    os.makedirs(os.path.join(path, PARAMS_DIR), exist_ok=True)


def write_groups(path, config: Config, groups, *, overwrite=False, progress=None,
                 n_groups: int | None = None) -> str:
    """Save ``(group, subtree)`` pairs one at a time (``groups`` may be a generator that
    reads them lazily), then the config file."""
    ocp = _orbax()
    path = os.path.abspath(os.fspath(path))
    _prepare_dir(path, overwrite)
    checkpointer = ocp.StandardCheckpointer()
    bar = progress_bar(progress, n_groups or 0, "Saving", unit="group")
    try:
        for group, subtree in groups:
            checkpointer.save(os.path.join(path, PARAMS_DIR, group), subtree)
            checkpointer.wait_until_finished()      # bounds memory to one group in flight
            bar.update(1)
    finally:
        bar.close()
        checkpointer.close()
    fields = dataclasses.asdict(config)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump({"format": FORMAT, "version": VERSION, "config": fields}, f, indent=1)
    return path


# ----------------------------------------------------------------------------- load
def read_config(path: str) -> Config:
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file) as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise CheckpointError(f"{file}: not a {FORMAT} v{VERSION} config "
                              f"(format={doc.get('format') if isinstance(doc, dict) else None!r})")
    fields = doc.get("config")
    known = {f.name for f in dataclasses.fields(Config)}
    if not isinstance(fields, dict):
        raise CheckpointError(f"{file}: 'config' must be an object, got {fields!r}")
    if set(fields) - known:
        raise CheckpointError(f"{file}: unknown config fields {sorted(set(fields) - known)}")
    try:
        return Config(**fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: invalid config: {e}") from None


def _disk_shapes(path: str) -> dict:
    """``{key tuple: (shape, dtype)}`` from the orbax metadata of every stored group."""
    ocp = _orbax()
    root = os.path.join(path, PARAMS_DIR)
    if not os.path.isdir(root):
        raise CheckpointError(f"orbax checkpoint {path}: no {PARAMS_DIR}/ directory")
    out = {}
    checkpointer = ocp.StandardCheckpointer()
    for group in sorted(os.listdir(root)):
        try:
            meta = checkpointer.metadata(os.path.join(root, group)).item_metadata.tree
        except Exception as e:       # orbax raises assorted errors for damaged items
            raise CheckpointError(f"orbax checkpoint {path}: unreadable item {group}: "
                                  f"{e!r}") from None
        if meta is None:
            raise CheckpointError(f"orbax checkpoint {path}: item {group} has no metadata")
        prefix = () if group == GLOBALS_GROUP else (group,)
        for keys, leaf in flat_leaves(meta):
            out[prefix + keys] = (tuple(leaf.shape), leaf.dtype)
    checkpointer.close()
    return out


def _config_delta(stored: Config, target: Config) -> str:
    names = [f.name for f in dataclasses.fields(Config)]
    diff = [f"{n}: stored {getattr(stored, n)!r}, requested {getattr(target, n)!r}"
            for n in names if getattr(stored, n) != getattr(target, n)]
    return "; ".join(diff) or "none"


def load_orbax(path: str, *, dequantize=False, shardings=None, mesh=None, dtype=None,
               progress=None, overrides=None):
    """``(config, params)`` from a directory written by ``save``, restored group by group
    onto the target shardings; precision changes (``dequantize``, ``dtype="float32"``) are
    done on the devices right after each group is restored."""
    ocp = _orbax()
    path = os.path.abspath(path)
    stored = read_config(path)
    target = target_config(stored, overrides or {}, dequantize=dequantize, dtype=dtype)
    source = checkpoint_precision(target, stored)
    expected = shape_map(abstract_params(source))
    raise_if(tree_differences(expected, _disk_shapes(path), "the checkpoint"),
             f"orbax checkpoint {path} is incompatible with the requested configuration "
             f"(config changes: {_config_delta(stored, target)}):")
    target_tree = dict(flat_leaves(abstract_params(target)))
    sharding = leaf_shardings(abstract_params(target), shardings, mesh, target)

    groups: dict[str, dict] = {}
    for keys, (shape, dt) in expected.items():
        if keys in target_tree and tuple(target_tree[keys].shape) == shape:
            s = sharding[keys]
        else:                                    # a scale the target drops: replicate it
            s = replicated_like(sharding[keys[:-1] + ("weight",)])
        groups.setdefault(group_of(keys), {})[keys] = jax.ShapeDtypeStruct(shape, dt, sharding=s)
    total = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in expected.values())
    bar = progress_bar(progress, total, f"Restoring {os.path.basename(path)}")
    checkpointer = ocp.StandardCheckpointer()
    out = []
    try:
        for group, abstract in groups.items():
            restored = checkpointer.restore(os.path.join(path, PARAMS_DIR, group),
                                            group_subtree(group, abstract))
            prefix = () if group == GLOBALS_GROUP else (group,)
            leaves = {prefix + k: v for k, v in flat_leaves(restored)}
            converted = {k: _to_target(k, leaves, target_tree[k], sharding[k])
                         for k in abstract if k in target_tree}
            out.append((group, group_subtree(group, converted)))
            bar.update(sum(x.nbytes for x in leaves.values()))
    finally:
        bar.close()
        checkpointer.close()
    return target, merge_groups(out)


@functools.lru_cache(maxsize=None)
def _dequant_fn(fmt: str, dtype: str):
    """One jitted dequantizer per format and dtype (XLA then caches per shape)."""
    weight_format = quant.WEIGHT_FORMATS[fmt]
    return jax.jit(lambda w, s: weight_format.dequantize(w, s, dtype))


@jax.jit
def _upcast(x):
    return x.astype(jnp.float32)


def _to_target(keys, leaves: dict, target: jax.ShapeDtypeStruct, sharding):
    """A restored leaf in the target precision (exact conversions only, on device)."""
    x = leaves[keys]
    dt = jnp.dtype(target.dtype)
    name = "/".join(keys)
    scale_keys = keys[:-1] + ("scale",)
    if x.dtype == dt and x.shape == target.shape:
        return x
    if keys[-1] == "weight" and scale_keys in leaves and x.dtype in (jnp.int8, quant.FP8_DTYPE):
        scale = leaves[scale_keys]
        fmt = quant.weight_format(x, scale, name=name, op="load").name
        raw = jax.lax.bitcast_convert_type(scale, jnp.uint8)
        lo, hi = int(jnp.min(raw)), int(jnp.max(raw))
        if hi == 255:
            raise CheckpointError(f"{name}: E8M0 scale byte 255 (NaN)")
        precision.check_exact_dequant(lo - 127, hi - 127, fmt, dt, name)
        return jax.device_put(_dequant_fn(fmt, dt.name)(x, scale), sharding)
    if x.dtype == jnp.bfloat16 and dt == jnp.float32:
        return jax.device_put(_upcast(x), sharding)
    raise CheckpointError(f"{name}: cannot convert stored {x.dtype}{list(x.shape)} to "
                          f"{dt}{list(target.shape)}")
