"""Planning a mesh run without allocating it: per-device shards, memory and all-to-all sizes.

Everything here works on abstract shapes (``abstract_params``, ``jax.eval_shape`` of
``Cache.init``), so a 1.6T-parameter DSV4-Pro plan is computed on a laptop's simulated CPU
devices. ``benchmarks/pro_plan.py`` prints the tables; docs/performance.md quotes them.

* ``shard_table``: every parameter's global and per-device shape under ``param_shardings``.
* ``param_bytes_per_device``, ``check_fits``: a device's share of the parameters, and the
  refusal to load a checkpoint that does not fit the devices (``load(..., mesh=...)``).
* ``cache_bytes_per_device``: a ``Cache`` of batch x max_len split over the batch axes.
* ``step_activation_estimate``: the transients of one layer of a prefill/decode step (the
  documented formula below), for the CuTe MoE kernel path and for the XLA reference path.
* ``memory_plan``: parameters + cache + one step's activations of a run against a device;
  ``memory_table``: the same functions per model and device count (experts over all devices).
* ``all_to_all_sizes``: the expert-parallel exchange of ``models/parallel.expert_parallel``
  (worst-case capacity: every device sends a full block of its assignments to every device).
* ``abstract_step``: the jitted model step lowered on a mesh with abstract inputs, for the
  compiler's own memory analysis of a reduced stack.

This is the one place that sizes memory; ``dsv4_jax.sharding`` only places. The functions
take a ``Mesh`` or a ``jax.sharding.AbstractMesh`` (sizes only, so a plan for more devices
than the host has).
"""
from __future__ import annotations

import re

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from .cache import Cache
from .config import CSA_RATIO, Config
from .mesh_rules import (DATA, EXPERT, axis_size, cache_shardings, check_batch, padded_rows,
                         row_axes, row_split)
from .models.transformer import DSV4
from .params import abstract_params, leaf_keys
from .sharding import param_shardings

__all__ = ["H200_BYTES", "shard_table", "group_shard_table", "per_device_bytes",
           "param_bytes_per_device", "check_fits", "cache_bytes_per_device", "step_activation_estimate", "all_to_all_sizes",
           "reduced_config", "abstract_step", "memory_plan", "memory_table"]

# One H200 as the CUDA driver reports it (143,771 MiB, docs/performance.md, 2 x H200 run).
H200_BYTES = 143771 * 2 ** 20


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize


def shard_table(cfg: Config, mesh: Mesh, abstract=None) -> list[dict]:
    """One row per parameter leaf: path, global shape, dtype, PartitionSpec, per-device shard
    shape and bytes (every device holds the same shard size: the splits divide evenly)."""
    abstract = abstract if abstract is not None else abstract_params(cfg)
    shardings = param_shardings(cfg, mesh, abstract)
    rows = []
    for (keys, leaf), sh in zip(jax.tree_util.tree_leaves_with_path(abstract),
                                jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(
                                    x, jax.sharding.Sharding))):
        shard = tuple(sh.shard_shape(leaf.shape))
        rows.append(dict(path="/".join(leaf_keys(keys)), shape=tuple(leaf.shape),
                         dtype=jnp.dtype(leaf.dtype).name, spec=str(sh.spec), shard=shard,
                         shard_bytes=_nbytes(shard, leaf.dtype)))
    return rows


def group_shard_table(rows: list[dict]) -> list[dict]:
    """``shard_table`` rows with the block index folded (``layers_*``, ``mtp_*``): one row per
    distinct (path, shape, dtype, spec), with ``count`` leaves and their total shard bytes."""
    groups: dict = {}
    for r in rows:
        path = re.sub(r"^(layers|mtp)_\d+", r"\1_*", r["path"])
        key = (path, r["shape"], r["dtype"], r["spec"])
        g = groups.setdefault(key, dict(r, path=path, count=0, total_bytes=0))
        g["count"] += 1
        g["total_bytes"] += r["shard_bytes"]
    return list(groups.values())


def _holders(sh) -> tuple:
    """The devices that hold a shard under ``sh``; one stand-in for a mesh of sizes only,
    where every position holds a shard of every leaf."""
    if isinstance(getattr(sh, "mesh", None), AbstractMesh):
        return (None,)
    return tuple(sh.addressable_devices) if hasattr(sh, "addressable_devices") else (None,)


def per_device_bytes(abstract, shardings) -> int:
    """Bytes of the largest per-device share of a tree under ``shardings``."""
    totals: dict = {}
    for leaf, sh in zip(jax.tree.leaves(abstract), jax.tree.leaves(
            shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))):
        nbytes = _nbytes(sh.shard_shape(leaf.shape), leaf.dtype)
        for d in _holders(sh):
            totals[d] = totals.get(d, 0) + nbytes
    return max(totals.values()) if totals else 0


def param_bytes_per_device(cfg: Config, mesh: Mesh, abstract=None) -> int:
    """Per-device bytes of the parameters of ``DSV4(cfg)`` under ``param_shardings``."""
    abstract = abstract if abstract is not None else abstract_params(cfg)
    return per_device_bytes(abstract, param_shardings(cfg, mesh, abstract))


def _device_memory(device) -> int | None:
    try:
        stats = device.memory_stats()
    except Exception:
        return None
    return (stats or {}).get("bytes_limit")


def check_fits(cfg: Config, mesh: Mesh, *, reserve: float = 0.1, abstract=None) -> int:
    """Per-device parameter bytes on this mesh; ``ValueError`` before anything is allocated
    when that exceeds the devices' memory (minus ``reserve`` for cache and activations).
    Needs a ``Mesh`` of devices; those that report no memory limit (CPU) are not checked."""
    need = param_bytes_per_device(cfg, mesh, abstract)
    limits = [m for m in (_device_memory(d) for d in mesh.devices.flat) if m]
    if limits and need > (1 - reserve) * min(limits):
        raise ValueError(f"the checkpoint does not fit this mesh: it needs {need / 2**30:.1f} GiB "
                         f"of parameters per device, a device has {min(limits) / 2**30:.1f} GiB "
                         f"({reserve:.0%} kept for cache and activations); use more devices "
                         "along the expert axis")
    return need


def cache_bytes_per_device(cfg: Config, mesh: Mesh, batch: int, max_len: int,
                           kv_dtype: str | None = None) -> int:
    """Per-device bytes of ``Cache.init(cfg, batch, max_len, kv_dtype=kv_dtype, mesh=mesh)``
    (nothing allocated); ``ValueError`` when the batch does not split over the mesh."""
    check_batch(batch, mesh)
    cache = jax.eval_shape(lambda: Cache.init(cfg, batch, max_len, kv_dtype=kv_dtype))
    return per_device_bytes(cache, cache_shardings(cache, mesh))


def _moe_exchange(cfg: Config, mesh: Mesh, batch: int, seq: int) -> dict:
    """Shapes of ``expert_parallel``'s exchange on one device (models/parallel.py)."""
    check_batch(batch, mesh)
    n = mesh.shape[EXPERT] if EXPERT in mesh.axis_names else 1
    tokens = batch * seq // row_split(mesh, batch)            # t: local tokens
    assignments = tokens * cfg.n_activated_experts            # a = t k
    # Rows replicated over ``expert``: every device computes (zero rows but its own) and
    # all-reduces the group's a rows; split rows: n a capacity slots (an upper bound of the
    # gathering exchange's n a rows too).
    replicated = n > 1 and EXPERT not in row_axes(mesh, batch)
    return dict(n=n, tokens=tokens, assignments=assignments,
                slots=assignments if replicated else n * assignments,
                local_experts=cfg.n_routed_experts // n)


def all_to_all_sizes(cfg: Config, mesh: Mesh, batch: int, seq: int = 1) -> dict:
    """Bytes one device moves through the expert-parallel all-to-alls for ``batch`` rows of
    ``seq`` tokens, per MoE layer and per step (all ``n_layers`` blocks; the MTP block runs
    only when drafting).

    The capacity rule of ``expert_parallel``: each device sends every device a block of
    ``a = t k`` slots (t local tokens, k experts per token), enough for all its assignments
    to land on one device, so nothing is dropped. Dispatch sends three arrays (rows in the
    activation dtype, expert id int32, routing weight f32), combine sends the rows back in
    the activation dtype. Of each ``[n, a, ...]`` buffer, ``(n - 1) / n`` leaves the device;
    ``a`` of the ``n a`` slots are real (the rest keep expert id -1). A batch replicated
    over ``expert`` (``mesh_rules.row_axes``) dispatches nothing: its ``a`` rows are
    all-reduced (a ring sends 2 (n - 1) / n of the buffer).
    """
    x = _moe_exchange(cfg, mesh, batch, seq)
    n, a = x["n"], x["assignments"]
    row = cfg.dim * jnp.dtype(cfg.dtype).itemsize
    leaving = (n - 1) / n if n > 1 else 0.0
    if n > 1 and x["slots"] == a:                    # replicated rows: one all-reduce
        dispatch, combine = 0, a * row
        per_layer_sent = int(2 * combine * leaving)
    else:
        dispatch = n * a * (row + 4 + 4)             # x rows + int32 id + f32 weight
        combine = n * a * row
        per_layer_sent = int((dispatch + combine) * leaving)
    return dict(x, dispatch_buffer_bytes=dispatch, combine_buffer_bytes=combine,
                sent_bytes_per_layer=per_layer_sent,
                useful_bytes_per_layer=int(a * (2 * row + 8) * leaving),
                sent_bytes_per_step=per_layer_sent * cfg.n_layers)


def _linear_bf16_bytes(cfg: Config, abstract) -> int:
    """The largest block's non-expert quantised weights once dequantised to the activation
    dtype (XLA dequantises FP8 linears before its GEMMs)."""
    per_block: dict = {}
    for keys, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        path = "/".join(leaf_keys(keys))
        m = re.match(r"^((?:layers|mtp)_\d+)/", path)
        if m and "/experts/" not in path and leaf.dtype == jnp.float8_e4m3fn:
            per_block[m.group(1)] = per_block.get(m.group(1), 0) + leaf.size
    return max(per_block.values(), default=0) * jnp.dtype(cfg.dtype).itemsize


def step_activation_estimate(cfg: Config, mesh: Mesh, batch: int, seq: int, max_len: int,
                             *, moe: str = "kernel", logits_at: str = "last",
                             abstract=None) -> dict:
    """Per-device transient bytes of one layer of a step, by component (the formula).

    Layers run one after the other, so a step's peak above parameters and cache is about
    one layer's transients plus the logits. t = local tokens (batch x seq over the batch
    axes), b = local rows, act = activation bytes, n = expert-axis size, a = t k:

    * ``streams``: 3 t hc d act (mHC input, output and the collapsed stream);
    * ``attention``: queries and output 2 t h c act, gathered entries t (W + K) c act with
      K = min(index_topk, max_len / 4) for CSA (all max_len / 128 entries for HCA), the
      indexer's f32 scores t h_I (max_len / 4) 4;
    * ``dense_linears``: the block's FP8 linears dequantised to act (XLA path of the linears);
    * ``moe_exchange``: the four ``[n, a, d]`` buffers (send, receive, result, returned);
    * ``moe_compute``: kernel -- gate, up and h rows ``[n a, inter]`` in act plus the FP8
      copy of the received rows; xla -- the dequantised local experts (all of them when
      ``n a`` >= local experts, as ``ragged_dot``; else one gathered copy per row);
    * ``logits``: gathered hidden rows, the f32 vocabulary slice of every row and the local
      rows' full f32 logits (``logits_at="last"``: one row per sequence).
    """
    if moe not in ("kernel", "xla"):
        raise ValueError(f"moe must be 'kernel' or 'xla', got {moe!r}")
    abstract = abstract if abstract is not None else abstract_params(cfg)
    act = jnp.dtype(cfg.dtype).itemsize
    x = _moe_exchange(cfg, mesh, batch, seq)
    t, n, slots = x["tokens"], x["n"], x["slots"]
    b = batch // row_split(mesh, batch)
    d, c, h = cfg.dim, cfg.head_dim, cfg.n_heads
    kinds = {cfg.layer_kind(i) for i in range(cfg.n_layers)}
    entries = cfg.window_size + max(
        [min(cfg.index_topk, max_len // CSA_RATIO)] * ("csa" in kinds)
        + [max_len // cfg.compress_ratios[i] for i in range(cfg.n_layers)
           if cfg.layer_kind(i) == "hca"] + [0])
    indexer = t * cfg.index_n_heads * (max_len // CSA_RATIO) * 4 if "csa" in kinds else 0
    expert_matrix = 3 * cfg.moe_inter_dim * d * act
    if moe == "kernel":
        compute = slots * (3 * cfg.moe_inter_dim * act + d)
    else:
        compute = min(slots, x["local_experts"]) * expert_matrix
    logit_rows = b if logits_at == "last" else t
    n_vocab = axis_size(mesh, "vocab")
    all_rows = logit_rows * row_split(mesh, batch)
    parts = dict(
        streams=3 * t * cfg.hc_mult * d * act,
        attention=2 * t * h * c * act + t * entries * c * act + indexer,
        dense_linears=_linear_bf16_bytes(cfg, abstract),
        moe_exchange=4 * slots * d * act,
        moe_compute=compute,
        logits=all_rows * d * act + all_rows * cfg.vocab_size // n_vocab * 4
        + logit_rows * cfg.vocab_size * 4)
    return dict(parts, total=sum(parts.values()))


def memory_plan(cfg: Config, mesh: Mesh, *, batch: int, max_len: int, seq: int = 1,
                moe: str = "kernel", device_bytes: int = 139 * 2 ** 30,
                abstract=None) -> dict:
    """Per-device parameters + cache + one step's activations against ``device_bytes``."""
    abstract = abstract if abstract is not None else abstract_params(cfg)
    params = param_bytes_per_device(cfg, mesh, abstract)
    cache = cache_bytes_per_device(cfg, mesh, batch, max_len)
    act = step_activation_estimate(cfg, mesh, batch, seq, max_len, moe=moe,
                                   abstract=abstract)["total"]
    total = params + cache + act
    return dict(mesh=dict(mesh.shape), batch=batch, seq=seq, max_len=max_len, moe=moe,
                params=params, cache=cache, activations=act, total=total,
                device_bytes=device_bytes, headroom=device_bytes - total,
                fits=total <= device_bytes)


def _sizes_mesh(data: int, expert: int) -> AbstractMesh:
    """A ``("data", "expert")`` mesh of sizes only: the table plans device counts the host
    does not have."""
    return AbstractMesh((data, expert), (DATA, EXPERT),
                        axis_types=(jax.sharding.AxisType.Auto,) * 2)


def memory_table(cfg: Config, n_devices=(1, 2, 4, 8), *, batch: int = 8,
                 prefill_chunk: int = 4096, max_len: int | None = None,
                 abstract=None, kv_dtype: str | None = None) -> list[dict]:
    """Per-device GiB with experts split over all devices (data = 1, expert = n), one row per
    device count, from the functions above (no devices needed):

    * ``params_gib``: ``param_bytes_per_device``;
    * ``cache_gib_per_1k_tokens_per_seq`` and ``cache_fixed_gib_per_seq``: one sequence's
      ``cache_bytes_per_device`` grows linearly with max_len (compressed entries, indexer
      keys) on top of a fixed part (windows, compressor tails); ``kv_dtype="fp8"``: the
      compressed entries as FP8 rows (``Cache.init``);
    * ``activations_gib``: ``step_activation_estimate`` total, XLA MoE path, of a prefill
      chunk of ``batch`` rows x ``prefill_chunk`` tokens with a cache of ``max_len`` tokens
      (default: the chunk). The batch splits as ``mesh_rules.row_axes`` splits it (a small
      one replicated on every device), padded as ``mesh_rules.padded_rows`` pads it, as
      ``dj.generate`` and the benchmarks run it.
    """
    abstract = abstract if abstract is not None else abstract_params(cfg)
    max_len = max_len if max_len is not None else prefill_chunk
    one = _sizes_mesh(1, 1)
    per_1k = (cache_bytes_per_device(cfg, one, 1, 2048, kv_dtype)
              - cache_bytes_per_device(cfg, one, 1, 1024, kv_dtype))
    fixed_cache = cache_bytes_per_device(cfg, one, 1, 1024, kv_dtype) - per_1k
    rows = []
    for n in n_devices:
        mesh = _sizes_mesh(1, n)
        rows_run = padded_rows(mesh, batch)
        act = step_activation_estimate(cfg, mesh, rows_run, prefill_chunk, max_len, moe="xla",
                                       abstract=abstract)["total"]
        rows.append(dict(
            devices=n, params_gib=param_bytes_per_device(cfg, mesh, abstract) / 2**30,
            cache_gib_per_1k_tokens_per_seq=per_1k / 2**30,
            cache_fixed_gib_per_seq=fixed_cache / 2**30,
            activations_gib=act / 2**30))
    return rows


def reduced_config(cfg: Config, ratios: tuple) -> Config:
    """``cfg`` with the main stack replaced by blocks of the given compression ratios (real
    dimensions, fewer layers; the MTP blocks kept)."""
    ratios = tuple(ratios)
    return cfg.replace(n_layers=len(ratios),
                       compress_ratios=ratios + cfg.compress_ratios[cfg.n_layers:],
                       n_hash_layers=min(cfg.n_hash_layers, len(ratios)))


def abstract_step(cfg: Config, mesh: Mesh, batch: int, seq: int, max_len: int,
                  implementation: str | None = None):
    """``jax.jit(model.apply).lower(...)`` of a step with abstract, mesh-sharded parameters,
    cache (donated) and tokens: ``.compile().memory_analysis()`` gives the compiler's
    per-device figures without allocating the model."""
    check_batch(batch, mesh)
    abstract = abstract_params(cfg)
    shardings = param_shardings(cfg, mesh, abstract)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
    cache = jax.eval_shape(lambda: Cache.init(cfg, batch, max_len))
    cache = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         cache, cache_shardings(cache, mesh))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32,
                                  sharding=NamedSharding(mesh, P(row_axes(mesh, batch) or None,
                                                                 None)))
    model = DSV4(cfg, implementation=implementation, runtime_checks=False, mesh=mesh)
    step = jax.jit(lambda p, t, c: model.apply({"params": p}, t, c, logits_at="last"),
                   donate_argnames=("c",))
    return step.lower(params, tokens, cache)
