"""The decode state of DSV4 as an explicit pytree (docs/architecture.md §4).

Per layer (``LayerCache``):

* ``window``      [B, W, D]   ring of the last W window entries, slot ``t mod W``
* CSA / HCA layers (ratio m, coff = 2 for CSA's overlapping pooling, else 1):
  ``kv_state``, ``score_state`` [B, coff*m, coff*D] f32 -- raw compressor rows (a_t and
  z_t + ape) by absolute position from ``m * (L//m - (coff-1))``: for CSA rows 0..3 hold the
  previous complete block, rows 4..7 the current one; unfilled rows are (0, -inf), which
  gives them zero weight (the "previous block" of block 0 starts that way);
  ``compressed`` [B, max_len // m, D] emitted entries -- or, with ``kv_dtype="fp8"``,
  uint8 [B, max_len // m, 584]: each entry in the official FP8 layout (``kv_entry``),
  which holds the same values as the BF16 entry under ``quant_simulation``.
* CSA layers also: ``index_kv_state``/``index_score_state`` [B, 8, 2*Di] and
  ``index_keys`` [B, max_len // 4, Di] for the lightning indexer -- or, with
  ``kv_dtype="fp8+fp4"``, ``[B, max_len // 4, 72]`` uint8 MXFP4 rows (``dsv4_jax.kv_entry``).

``lengths [B]`` counts the tokens each row has consumed; the MTP block (speculative drafting)
has its own rings and ``mtp_lengths``. Everything is data: jitted steps take the cache and
return the new one, so ``donate_argnames=("cache",)`` lets XLA update it in place.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from .config import CSA_RATIO, Config, compressor_overlap
from .kv_entry import check_kv_dtype, entry_bytes, index_key_bytes, is_fp8_table
from .mesh_rules import cache_shardings

__all__ = ["Cache", "LayerCache"]


@struct.dataclass
class LayerCache:
    window: jax.Array
    kv_state: Optional[jax.Array] = None
    score_state: Optional[jax.Array] = None
    compressed: Optional[jax.Array] = None
    index_kv_state: Optional[jax.Array] = None
    index_score_state: Optional[jax.Array] = None
    index_keys: Optional[jax.Array] = None

    def emptied(self) -> "LayerCache":
        """A fresh layer cache of the same shapes and dtypes (what ``init_layer_cache`` gives)."""
        def like(x, make):
            return None if x is None else make(x.shape, x.dtype)
        return LayerCache(
            like(self.window, _empty), like(self.kv_state, _empty),
            like(self.score_state, _empty_scores), like(self.compressed, _empty),
            like(self.index_kv_state, _empty), like(self.index_score_state, _empty_scores),
            like(self.index_keys, _empty))


def _compressor_state(batch: int, ratio: int, width: int):
    coff = compressor_overlap(ratio)
    shape = (batch, coff * ratio, coff * width)
    return _empty(shape, jnp.float32), _empty_scores(shape, jnp.float32)


def _empty(shape, dtype):
    return jnp.zeros(shape, dtype)


def _empty_scores(shape, dtype):
    # unfilled compressor rows have score -inf: zero weight in the pooling softmax
    return jnp.full(shape, -jnp.inf, dtype)


def init_layer_cache(cfg: Config, layer_id: int, batch: int, max_len: int, dtype,
                     kv_dtype: str | None = None) -> LayerCache:
    ratio, kind = cfg.compress_ratios[layer_id], cfg.layer_kind(layer_id)
    window = _empty((batch, cfg.window_size, cfg.head_dim), dtype)
    if kind == "swa":
        return LayerCache(window=window)
    kv_state, score_state = _compressor_state(batch, ratio, cfg.head_dim)
    if kv_dtype in ("fp8", "fp8+fp4"):
        compressed = _empty((batch, max_len // ratio, entry_bytes(cfg.head_dim,
                                                                  cfg.rope_head_dim)),
                            jnp.uint8)
    else:
        compressed = _empty((batch, max_len // ratio, cfg.head_dim), dtype)
    if kind == "hca":
        return LayerCache(window, kv_state, score_state, compressed)
    ikv, isc = _compressor_state(batch, CSA_RATIO, cfg.index_head_dim)
    if kv_dtype == "fp8+fp4":
        keys = _empty((batch, max_len // CSA_RATIO, index_key_bytes(cfg.index_head_dim)),
                      jnp.uint8)
    else:
        keys = _empty((batch, max_len // CSA_RATIO, cfg.index_head_dim), dtype)
    return LayerCache(window, kv_state, score_state, compressed, ikv, isc, keys)


@struct.dataclass
class Cache:
    lengths: jax.Array                    # [B] int32 tokens consumed per row
    layers: tuple                         # LayerCache per transformer block
    mtp_lengths: jax.Array                # [B] int32 tokens consumed by the MTP block(s)
    mtp: tuple                            # LayerCache per MTP block
    max_len: int = struct.field(pytree_node=False)

    @classmethod
    def init(cls, cfg: Config, batch: int, max_len: int, dtype=None, *, kv_dtype=None,
             mesh=None, rules=None) -> "Cache":
        """An empty cache for ``batch`` rows of up to ``max_len`` tokens.

        ``dtype`` defaults to ``cfg.dtype``. ``kv_dtype="fp8"`` stores the compressed entries
        of CSA/HCA layers as 584-byte FP8 rows (the official layout, ``dsv4_jax.kv_entry``:
        1.75x smaller than BF16; needs ``dtype`` bfloat16); ``"fp8+fp4"`` also the CSA layers'
        index keys as 72-byte MXFP4 rows (3.6x smaller; a slower indexer, see
        docs/performance.md); both exact under the FP8/FP4 simulation. The window rings stay
        in ``dtype``. With ``mesh`` the arrays are created directly with the batch sharded over
        the mesh's data axis (see ``dsv4_jax.sharding``).
        """
        if not isinstance(batch, int) or batch <= 0:
            raise ValueError(f"Cache.init: batch must be a positive int, got {batch!r}")
        if not isinstance(max_len, int) or max_len <= 0:
            raise ValueError(f"Cache.init: max_len must be a positive int, got {max_len!r}")
        dtype = jnp.dtype(dtype or cfg.dtype)
        has_csa = any(cfg.layer_kind(i) == "csa"
                      for i in range(cfg.n_layers + cfg.n_mtp_layers))
        kv_dtype = check_kv_dtype(kv_dtype, cfg.head_dim, cfg.rope_head_dim, dtype,
                                  cfg.index_head_dim if has_csa else None)

        def build():
            layers = tuple(init_layer_cache(cfg, i, batch, max_len, dtype, kv_dtype)
                           for i in range(cfg.n_layers))
            mtp = tuple(init_layer_cache(cfg, cfg.n_layers + i, batch, max_len, dtype,
                                         kv_dtype)
                        for i in range(cfg.n_mtp_layers))
            # two separate arrays: one buffer twice in a pytree cannot be donated
            return cls(jnp.zeros((batch,), jnp.int32), layers, jnp.zeros((batch,), jnp.int32),
                       mtp, max_len)

        if mesh is None:
            return build()
        shardings = cache_shardings(jax.eval_shape(build), mesh, rules)
        return jax.jit(build, out_shardings=shardings)()

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def dtype(self):
        return self.layers[0].window.dtype if self.layers else jnp.dtype(jnp.bfloat16)

    @property
    def kv_dtype(self) -> str | None:
        """``"fp8"`` when the compressed entries are FP8 rows, ``"fp8+fp4"`` when the index
        keys are MXFP4 rows too, else None (the cache dtype)."""
        layers = self.layers + self.mtp
        tables = [lc.compressed for lc in layers if lc.compressed is not None]
        if not (tables and is_fp8_table(tables[0])):
            return None
        keys = [lc.index_keys for lc in layers if lc.index_keys is not None]
        return "fp8+fp4" if keys and is_fp8_table(keys[0]) else "fp8"

    def reset_rows(self, rows: jax.Array) -> "Cache":
        """Empty the rows where ``rows`` [B] bool is true (start new sequences in place)."""
        fresh = Cache.init_like(self)

        def pick(new, old):
            shape = (-1,) + (1,) * (old.ndim - 1)
            return jnp.where(rows.reshape(shape), new, old)
        return jax.tree.map(pick, fresh, self)

    @staticmethod
    def init_like(cache: "Cache") -> "Cache":
        """A fresh cache of the same structure, shapes and dtypes."""
        return cache.replace(
            lengths=jnp.zeros_like(cache.lengths), mtp_lengths=jnp.zeros_like(cache.mtp_lengths),
            layers=tuple(lc.emptied() for lc in cache.layers),
            mtp=tuple(lc.emptied() for lc in cache.mtp))

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))
