"""Tiny random checkpoints in the exact official DSV4 format, for tests and examples.

``write_tiny_checkpoint(dir, cfg)`` writes what ``deepseek-ai/DeepSeek-V4-*`` ships, at
toy size: ``config.json`` (``Config.to_hf_dict``), ``model-0000k-of-0000n.safetensors``
shards with the official names (no ``model.`` prefix), dtypes (F8_E4M3 weights, F8_E8M0
block scales, I8-packed FP4 routed experts one tensor per expert, I64 ``tid2eid``, BF16,
F32) and scale layouts, and ``model.safetensors.index.json``. The values are
``dsv4_jax.init_params(cfg, seed)``, returned so a round trip can be compared exactly.
"""
from __future__ import annotations

import json
import os

import numpy as np

from dsv4_jax.config import Config
from dsv4_jax.params import init_params
from .common import flat_leaves
from .hf import INDEX_FILE
from .names import checkpoint_inventory
from .safetensors_io import DTYPES, write_safetensors

__all__ = ["write_tiny_checkpoint", "tiny_config", "shard_name"]


def tiny_config(**overrides) -> Config:
    """``Config.tiny(quantized=True)``: the official FP8/FP4 layout at CPU size."""
    return Config.tiny(**{"quantized": True, **overrides})


def shard_name(k: int, n: int) -> str:
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def write_tiny_checkpoint(path: str | os.PathLike, config: Config | None = None, seed: int = 0,
                          shards: int = 3) -> dict:
    """Write an official-format checkpoint of ``config`` (default ``tiny_config()``) to the
    directory ``path`` (created); returns the parameter tree whose values it holds."""
    cfg = tiny_config() if config is None else config
    if cfg.dtype != "bfloat16":
        raise ValueError("write_tiny_checkpoint: checkpoints store bfloat16 (got "
                         f"dtype={cfg.dtype!r})")
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"write_tiny_checkpoint: shards must be a positive int, got {shards!r}")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    params = init_params(cfg, seed)
    leaves = {k: np.asarray(x) for k, x in flat_leaves(params)}
    inventory = checkpoint_inventory(cfg)
    tensors = []
    for t in inventory:
        arr = leaves[t.leaf] if t.expert is None else leaves[t.leaf][t.expert]
        tensors.append((t.name, np.ascontiguousarray(arr.astype(DTYPES[t.dtype]))))
    total = sum(a.nbytes for _, a in tensors)
    n = min(shards, len(tensors))
    # contiguous runs of roughly equal bytes, like the published shards
    buckets: list[dict] = [{} for _ in range(n)]
    done = 0
    for name, arr in tensors:
        buckets[min(n - 1, done * n // max(total, 1))][name] = arr
        done += arr.nbytes
    weight_map = {}
    for k, bucket in enumerate(buckets):
        fname = shard_name(k, n)
        write_safetensors(os.path.join(path, fname), bucket)
        weight_map.update({name: fname for name in bucket})
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    return params
