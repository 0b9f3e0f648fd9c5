"""Parameter construction: random init (fast, shardable), abstract shapes, counts.

``DSV4.init`` works as for any Flax module, but jit-compiling it inlines one threefry per
parameter (tens of seconds on CPU, minutes for the real configs). ``init_params`` instead
takes the parameter tree from ``jax.eval_shape`` and fills each leaf with a small jitted
generator chosen by the leaf's name, shape and dtype -- one compile per distinct leaf kind,
each leaf created directly with its sharding when ``shardings`` is given (no host copy).
The distributions mirror the module initialisers.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from .cache import Cache
from .config import Config
from . import quant
from .quant import FP4_CODE_VALUES
from .models.layers import FP4_CODE_STD, FP8_CODE_STD
from .models.transformer import DSV4

__all__ = ["init_params", "abstract_params", "param_count", "leaf_keys", "block_expert_weights"]


def _init(cfg: Config, key):
    cache = Cache.init(cfg, batch=1, max_len=max(cfg.window_size, 128))
    tokens = jnp.zeros((1, 1), jnp.int32)
    return DSV4(cfg, runtime_checks=False).init(key, tokens, cache)["params"]


# Fields that change no parameter shape or dtype: reset before caching the abstract tree, so a
# Pro-sized trace (~15 s) is not repeated for e.g. an override of quant_simulation.
_NON_STRUCTURAL = ("quant_simulation", "bos_token_id", "eos_token_id", "index_topk",
                   "route_scale", "swiglu_limit", "rope_theta", "compress_rope_theta",
                   "rope_factor", "original_seq_len", "beta_fast", "beta_slow", "norm_eps",
                   "hc_eps", "hc_sinkhorn_iters", "score_func")


def abstract_params(cfg: Config) -> dict:
    """``jax.ShapeDtypeStruct`` tree of the parameters, without allocating anything."""
    defaults = Config()
    return _abstract_params(cfg.replace(**{f: getattr(defaults, f) for f in _NON_STRUCTURAL}))


@functools.lru_cache(maxsize=16)
def _abstract_params(cfg: Config) -> dict:
    return jax.eval_shape(functools.partial(_init, cfg), jax.random.key(0))


def leaf_keys(path) -> tuple:
    """``jax.tree_util`` key path -> tuple of str, e.g. ``('layers_0', 'attn', 'wq_a')``."""
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def leaf_rule(keys: tuple, leaf) -> tuple:
    """(kind, std) of a parameter leaf from its path: what distribution fills it."""
    name, parent = keys[-1], (keys[-2] if len(keys) > 1 else "")
    dt = jnp.dtype(leaf.dtype)
    if name == "tid2eid":
        return "hash", 0.0
    if name == "scale" and dt == jnp.float8_e8m0fnu:
        return "pow2", 0.0
    if dt == jnp.int8:
        return "fp4", 0.0
    if dt == jnp.float8_e4m3fn:
        return "fp8", 0.0
    if name.endswith("_scale"):                    # mHC scales
        return "ones", 0.0
    if name.endswith("_base") or name in ("ape", "bias"):
        return "normal", 0.1
    if name == "attn_sink":
        return "normal", 0.5
    if name == "weight" and ("norm" in parent):
        return "ones", 0.0
    if name == "weight" and parent == "embed":
        return "normal", 1.0
    if name.endswith("_fn"):
        return "normal", leaf.shape[-1] ** -0.5
    return "normal", leaf.shape[-1] ** -0.5


def _fan_in(weight_leaf) -> int:
    n = quant.matrix_dims(weight_leaf)[-1]
    return n * 2 if jnp.dtype(weight_leaf.dtype) == jnp.int8 else n


class _HostRandom:
    """numpy draws for unsharded init: no compilation at all."""
    xp = np
    fp4_code_std = FP4_CODE_STD       # N(0, 2) values rounded onto the FP4 grid

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def normal(self, shape):
        return self.rng.standard_normal(shape, np.float32)

    def uniform(self, shape):
        return self.rng.random(shape)

    def fp4_codes(self, shape):
        v = np.clip(self.normal((*shape[:-1], shape[-1] * 2)) * 2, -6, 6)
        mag = np.abs(np.abs(v)[..., None] - FP4_CODE_VALUES[:8]).argmin(-1).astype(np.uint8)
        codes = (mag | (np.signbit(v).astype(np.uint8) << 3)).reshape(*shape, 2)
        return (codes[..., 0] | (codes[..., 1] << 4)).view(np.int8)


class _DeviceRandom:
    """``jax.random`` draws from one key, traced inside the per-leaf jit of ``_filler``."""
    xp = jnp
    fp4_code_std = 3.4                # uniform random codes

    def __init__(self, key):
        self.key = key

    def normal(self, shape):
        return jax.random.normal(self.key, shape, jnp.float32)

    def uniform(self, shape):
        return jax.random.uniform(self.key, shape)

    def fp4_codes(self, shape):
        # uniform random codes straight as bytes: no [.., 2*in] float intermediate, which at
        # real size (a stacked expert projection) would be tens of GB
        return jax.lax.bitcast_convert_type(jax.random.bits(self.key, shape, jnp.uint8),
                                            jnp.int8)


def _fill(random, *, kind, std, shape, dtype, n_experts=0, code_std=1.0):
    """One leaf of distribution ``kind`` (see ``leaf_rule``), drawn with ``random``."""
    xp = random.xp
    if kind == "ones":
        return xp.ones(shape, dtype)
    if kind == "normal":
        return (random.normal(shape) * xp.float32(std)).astype(dtype)
    if kind == "fp8":
        return xp.clip(random.normal(shape) * FP8_CODE_STD, -448, 448).astype(dtype)
    if kind == "fp4":
        return random.fp4_codes(shape)
    if kind == "pow2":
        return xp.full(shape, 2.0 ** round(math.log2(std / code_std)), xp.float32).astype(dtype)
    if kind == "hash":
        order = xp.argsort(random.uniform((shape[0], n_experts)), axis=-1)
        return order[:, :shape[1]].astype(dtype)
    raise ValueError(kind)


def _fill_on_device(key, **static):
    return _fill(_DeviceRandom(key), **static)


@functools.lru_cache(maxsize=None)
def _filler(sharding):
    """``_fill`` jitted to produce its leaf directly with ``sharding`` (no host copy)."""
    return jax.jit(_fill_on_device, static_argnames=("kind", "std", "shape", "dtype",
                                                     "n_experts", "code_std"),
                   out_shardings=sharding)


def init_params(cfg: Config, key, *, shardings=None) -> dict:
    """Random parameters of ``DSV4(cfg)`` (MTP block included), in the config's precision.

    ``key``: a PRNG key or an int seed. ``shardings``: optional tree of ``jax.sharding``
    objects matching the parameter tree; every leaf is then generated on its devices.
    """
    if isinstance(key, int):
        key = jax.random.key(key)
    abstract = abstract_params(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    shard_leaves = (jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
                    if shardings is not None else [None] * len(flat))
    by_path = {leaf_keys(p): leaf for p, leaf in flat}
    host = None
    if shardings is None:       # host generation: no per-leaf compiles
        seed = np.asarray(jax.random.key_data(key)).astype(np.uint64).ravel().tolist()
        host = _HostRandom(np.random.default_rng(seed))
    out = []
    for i, ((path, leaf), sharding) in enumerate(zip(flat, shard_leaves)):
        keys = leaf_keys(path)
        kind, std = leaf_rule(keys, leaf)
        code_std = 1.0
        if kind == "pow2":                            # scale of a quantised weight
            weight = by_path[keys[:-1] + ("weight",)]
            std = _fan_in(weight) ** -0.5
            random = host or _DeviceRandom
            code_std = (random.fp4_code_std if jnp.dtype(weight.dtype) == jnp.int8
                        else FP8_CODE_STD)
        if host is not None:
            out.append(jnp.asarray(_fill(host, kind=kind, std=float(std),
                                         shape=tuple(leaf.shape), dtype=jnp.dtype(leaf.dtype),
                                         n_experts=cfg.n_routed_experts, code_std=code_std)))
            continue
        leaf_key = jax.random.fold_in(key, i)
        fill = _filler(sharding)
        out.append(fill(leaf_key, kind=kind, std=float(std), shape=tuple(leaf.shape),
                        dtype=jnp.dtype(leaf.dtype), n_experts=cfg.n_routed_experts,
                        code_std=code_std))
    return jax.tree_util.tree_unflatten(treedef, out)


def _is_expert_weight(keys: tuple) -> bool:
    return (len(keys) >= 4 and keys[-1] == "weight" and keys[-2] in ("w1", "w2", "w3")
            and keys[-3] == "experts")


@functools.cache
def _per_shard(convert, donate: bool, sharding):
    """``convert`` (the layout change of one expert weight) jitted. For a ``NamedSharding``
    leaf each device converts its own shard (whole tiles), so the leaf stays where it was
    placed with no resharding, under any mesh axis type: a row-layout spec ``(E, out, in)``
    means the same on the tiles' leading dims (experts, row tiles, K tiles)."""
    if sharding is not None:
        convert = jax.shard_map(convert, mesh=sharding.mesh, in_specs=sharding.spec,
                                out_specs=sharding.spec)
    return jax.jit(convert, donate_argnums=0 if donate else (), out_shardings=sharding)


def _named_sharding(leaf):
    return leaf.sharding if isinstance(leaf.sharding, NamedSharding) else None


def _shard_shape(leaf) -> tuple:
    """The shape of each device's piece of ``leaf`` (the whole shape unless it is split)."""
    sharding = _named_sharding(leaf)
    return tuple(sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape)


def _is_row_fp4_expert_weight(path, leaf) -> bool:
    return (_is_expert_weight(leaf_keys(path)) and leaf.ndim == 3
            and jnp.dtype(leaf.dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8)))


def _block_leaf(path, leaf, donate: bool):
    sharding, shard = _named_sharding(leaf), _shard_shape(leaf)
    if sharding is not None and not quant.can_block_fp4(shard):
        raise ValueError(
            f"block_expert_weights: {jax.tree_util.keystr(path)} {tuple(leaf.shape)} on "
            f"{sharding.spec} has shards {shard}, not whole 64-row "
            f"x 128-code tiles: shard the experts' dim 0 only, or keep expert_layout='rows'")
    return _per_shard(quant.block_fp4_weight, donate, sharding)(leaf)


def can_block_expert_weights(params: dict) -> bool:
    """Whether ``block_expert_weights`` can convert every packed FP4 routed-expert weight of
    ``params`` where it lies (each shard whole tiles); False when there is none."""
    weights = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)
               if _is_row_fp4_expert_weight(path, leaf)]
    return bool(weights) and all(quant.can_block_fp4(_shard_shape(w)) for w in weights)


def default_expert_layout(cfg: Config, params: dict) -> str:
    """The layout ``load`` gives routed experts: "blocked" for packed FP4 experts whose
    shards are whole tiles (the rule table's are), "rows" otherwise."""
    fp4 = cfg.quantized and cfg.expert_dtype == "fp4"
    return "blocked" if fp4 and can_block_expert_weights(params) else "rows"


def block_expert_weights(params: dict, *, donate: bool = True) -> dict:
    """``params`` with every packed FP4 routed-expert weight (``.../experts/w{1,2,3}/weight``
    ``[E, out, in/2]``) in the blocked layout (``quant.block_fp4_weight``: 64-row x 128-code
    tiles, contiguous): the same values, which every op and kernel reads; the decode kernels
    read it faster (docs/performance.md). Leaf by leaf on the leaves' devices and shardings,
    each input donated (peak: one leaf more; ``donate=False`` keeps the inputs, for
    comparing both layouts, at the cost of a second copy of the expert weights). Each
    device converts its own shard, which must be whole tiles (``can_block_expert_weights``;
    else a ``ValueError`` naming the leaf). Weights already blocked, other formats and other
    leaves are returned as they are. ``save`` writes blocked experts as rows."""
    def convert(path, leaf):
        if _is_row_fp4_expert_weight(path, leaf):
            return _block_leaf(path, leaf, donate)
        return leaf
    return jax.tree_util.tree_map_with_path(convert, params)


def unblock_expert_weights(params: dict) -> dict:
    """The inverse of ``block_expert_weights``: ``params`` (a tree or any subtree of one)
    with every blocked FP4 routed-expert weight back in the checkpoints' row layout
    ``[E, out, in/2]``, as new arrays (the inputs are kept); other leaves as they are."""
    def convert(path, leaf):
        if _is_expert_weight(leaf_keys(path)) and quant.is_blocked_fp4(leaf):
            return _per_shard(quant.unblock_fp4_weight, False, _named_sharding(leaf))(leaf)
        return leaf
    return jax.tree_util.tree_map_with_path(convert, params)


def param_count(params_or_cfg, *, include_mtp: bool = True) -> int:
    """Logical parameter count: packed FP4 bytes count 2 each; E8M0 block scales and the
    hash routing table (an index, not a weight) are not counted."""
    tree = abstract_params(params_or_cfg) if isinstance(params_or_cfg, Config) else params_or_cfg
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        keys = leaf_keys(path)
        dt = jnp.dtype(leaf.dtype)
        if dt == jnp.float8_e8m0fnu or keys[-1] == "tid2eid":
            continue
        if not include_mtp and keys[0].startswith("mtp"):
            continue
        total += int(leaf.size) * (2 if dt == jnp.int8 else 1)
    return total
