"""The declarative map between our Flax parameter tree and the official checkpoint names.

Official names (docs/architecture.md §6) have no ``model.`` prefix and our Flax modules carry
the same names, so the table is short: a block prefix ``layers_{i}`` / ``mtp_{i}`` <->
``layers.{i}`` / ``mtp.{i}``, ``/`` <-> ``.``, plus two layouts that differ:

* routed experts are one stacked leaf ``[E, ...]`` here and ``E`` tensors
  ``...experts.{e}.w1.weight`` in the files;
* the hash-routing table ``tid2eid`` is int32 here and I64 in the files.

``checkpoint_inventory(cfg)`` expands the table over ``abstract_params(cfg)`` into every
tensor the official files hold for ``cfg`` (name, shape, safetensors dtype, source leaf);
the loader checks the files against it and the test-checkpoint writer writes exactly it.
For ``Config.pro(quantized=True)`` that is the published inventory's 145,116 tensors.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import jax
import numpy as np

from dsv4_jax.config import Config
from dsv4_jax.params import abstract_params, leaf_keys
from .safetensors_io import dtype_code

__all__ = ["NAME_TABLE", "IGNORED_NAMES", "FileTensor", "checkpoint_inventory",
           "official_name", "leaf_keys", "is_ignored"]

# (flax path pattern, official name pattern, layout). First match wins.
#   {block}  layers_{i} <-> layers.{i}   or   mtp_{i} <-> mtp.{i}
#   {rest}   the remaining path, '/' <-> '.'
#   {e}      expert index: the flax leaf stacks experts along axis 0, one file tensor each
# layouts: "tensor" (same shape), "per_expert" (axis 0 split), "index_i64" (int32 <-> I64).
NAME_TABLE = (
    ("{block}/ffn/experts/{rest}", "{block}.ffn.experts.{e}.{rest}", "per_expert"),
    ("{block}/ffn/gate/tid2eid", "{block}.ffn.gate.tid2eid", "index_i64"),
    ("{block}/{rest}", "{block}.{rest}", "tensor"),
    ("{rest}", "{rest}", "tensor"),
)

# Copies that some dumps carry and the official converter skips (the MTP block shares the
# main model's embedding and head; docs/architecture.md §6.3): accepted, never loaded.
IGNORED_NAMES = (r"mtp\.\d+\.emb(ed)?\..*", r"mtp\.\d+\.head\.weight")

_BLOCK = r"(?P<kind>layers|mtp)_(?P<i>\d+)"
_REST = r"(?P<rest>.+)"


def _compile(pattern: str) -> re.Pattern:
    rx = re.escape(pattern).replace(re.escape("{block}"), _BLOCK).replace(re.escape("{rest}"),
                                                                          _REST)
    return re.compile(rx + r"\Z")


_RULES = tuple((_compile(flax), official, layout) for flax, official, layout in NAME_TABLE)
_IGNORED = tuple(re.compile(p + r"\Z") for p in IGNORED_NAMES)


def is_ignored(name: str) -> bool:
    return any(rx.match(name) for rx in _IGNORED)


def official_name(keys: tuple, expert: int | None = None) -> tuple[str, str]:
    """(official name, layout) of a Flax leaf; ``expert`` fills ``{e}`` for per-expert leaves."""
    flax_path = "/".join(keys)
    for rx, template, layout in _RULES:
        m = rx.match(flax_path)
        if m is None:
            continue
        g = m.groupdict()
        fields = {"rest": g.get("rest", "").replace("/", "."), "e": expert}
        if g.get("kind"):
            fields["block"] = f"{g['kind']}.{g['i']}"
        if layout == "per_expert" and expert is None:
            raise ValueError(f"{flax_path} stores one tensor per expert: pass expert=")
        return template.format(**fields), layout
    raise ValueError(f"no NAME_TABLE rule matches {flax_path!r}")


@dataclass(frozen=True)
class FileTensor:
    """One tensor of the official files and the Flax leaf it belongs to."""
    name: str
    shape: tuple
    dtype: str                  # safetensors code
    leaf: tuple                 # Flax key path
    expert: int | None = None   # row of the stacked leaf (per-expert layout)


def checkpoint_inventory(cfg: Config) -> list[FileTensor]:
    """Every tensor of an official checkpoint of ``cfg`` (in checkpoint precision).

    ``cfg.dtype`` must be ``"bfloat16"`` (the files store BF16). A quantized ``cfg`` gives the
    published FP8/FP4 layout, an unquantized one a plain BF16 checkpoint.
    """
    if cfg.dtype != "bfloat16":
        raise ValueError("checkpoint_inventory: checkpoints store bfloat16, got "
                         f"dtype={cfg.dtype!r}")
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params(cfg)):
        keys = leaf_keys(path)
        _, layout = official_name(keys, expert=0)
        code = dtype_code(leaf.dtype)
        if layout == "per_expert":
            for e in range(leaf.shape[0]):
                out.append(FileTensor(official_name(keys, e)[0], tuple(leaf.shape[1:]), code,
                                      keys, e))
        elif layout == "index_i64":
            if np.dtype(leaf.dtype) != np.int32:
                raise ValueError(f"{'/'.join(keys)}: expected an int32 index, got {leaf.dtype}")
            out.append(FileTensor(official_name(keys)[0], tuple(leaf.shape), "I64", keys))
        else:
            out.append(FileTensor(official_name(keys)[0], tuple(leaf.shape), code, keys))
    return out
