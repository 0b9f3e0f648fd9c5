"""Token compressors and the lightning indexer over a chunk of tokens (docs/architecture.md
§3.4, §3.5).

A call appends ``S`` tokens to every row at its own length ``L_b`` (``n_b <= S`` of them are
real, the rest padding). The compressor lays the row's saved raw rows and the new tokens out
by absolute position in one buffer ``E`` that starts at the first row of the saved state,
``m * (L_b // m - (coff - 1))``; block ``q`` of ``E`` is one compression block. Every block
that becomes complete in this call is pooled (per-channel softmax over its m -- or, for CSA's
overlap, 2m -- slots) and emitted; the rows the next call needs become the new state. Chunked
prefill, decode (S = 1) and rows at different lengths are all the same code.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn
from flax import struct

from dsv4_jax.config import CSA_RATIO, Config, compressor_overlap
from dsv4_jax import kv_entry, quant
from dsv4_jax.ffi import index_topk
from dsv4_jax.ffi.policy import DEFAULT_POLICY, KernelPolicy
from .layers import (FP8Weight, Linear, RMSNorm, act_dtype, fp8_linear, normal_init,
                     rope_tail)
from .parallel import batch_parallel


def _place_rows(buf: jax.Array, rows: jax.Array, offset: jax.Array) -> jax.Array:
    """``buf[b, offset_b + s] = rows[b, s]`` for every row b (per-row dynamic offsets; the
    rows must fit, ``offset_b + S <= N``). Written as a select of each of ``buf``'s rows
    between itself and a gathered new row, not as a per-row update (a scatter), so that XLA
    can fuse it into the pooling that reads it instead of launching it on its own."""
    n, s = buf.shape[1], rows.shape[1]
    src = jnp.arange(n)[None, :] - offset[:, None]                      # [B, N]: row of rows
    inside = (src >= 0) & (src < s)
    picked = jnp.take_along_axis(rows, jnp.clip(src, 0, s - 1)[..., None], axis=1)
    return jnp.where(inside[..., None], picked.astype(buf.dtype), buf)


def _take_rows(buf: jax.Array, start: jax.Array, size: int) -> jax.Array:
    return jax.vmap(lambda bb, s: jax.lax.dynamic_slice_in_dim(bb, s, size, 0))(buf, start)


def write_entries(table: jax.Array, entries: jax.Array, ids: jax.Array) -> jax.Array:
    """``table[b, ids[b, q]] = entries[b, q]`` where ``ids >= 0`` (other entries dropped);
    a table of FP8 entry rows or of MXFP4 index key rows (``kv_entry``) gets the entries
    encoded."""
    if kv_entry.is_index_key_rows(table, entries.shape[-1]):
        entries = kv_entry.encode_index_keys(entries)
    elif kv_entry.is_fp8_table(table):
        entries = kv_entry.encode(entries, kv_entry.rope_dim_of(table.shape[-1],
                                                                entries.shape[-1]))
    n = table.shape[1]
    safe = jnp.where(ids >= 0, ids, n)        # n is out of range -> dropped, never wrapped
    b = jnp.arange(table.shape[0])[:, None]
    return table.at[b, safe].set(entries.astype(table.dtype), mode="drop")


@struct.dataclass
class CompressorChunk:
    """What one call computed for a compressor: enough to commit any number of its tokens.

    ``entries [B, Q, hd]``: post-processed entries of every block that can complete in this
    call (block q of E); ``e_kv``/``e_score [B, E_len, coff*hd]``: saved rows then the chunk's
    rows by absolute position. Committing n_b tokens (``commit_compressor``) is cheap and
    parameter-free, which lets speculative decoding decide how many tokens to keep *after*
    the forward pass.
    """
    entries: jax.Array
    e_kv: jax.Array
    e_score: jax.Array
    ratio: int = struct.field(pytree_node=False)
    coff: int = struct.field(pytree_node=False)


def commit_compressor(chunk: CompressorChunk, lengths: jax.Array, num_new: jax.Array):
    """Entry ids (-1 = not emitted) and the new saved rows after keeping ``num_new`` tokens."""
    m, coff = chunk.ratio, chunk.coff
    n_blocks = chunk.e_kv.shape[1] // m
    q = jnp.arange(coff - 1, n_blocks)
    filled = (coff - 1) * m + lengths % m + num_new                       # valid rows of E
    complete = (q[None, :] + 1) * m <= filled[:, None]
    first_block = lengths // m - (coff - 1)
    ids = jnp.where(complete, first_block[:, None] + q[None, :], -1)
    start = ((lengths + num_new) // m - lengths // m) * m
    new_kv = _take_rows(chunk.e_kv, start, coff * m)
    new_score = _take_rows(chunk.e_score, start, coff * m)
    keep = (start[:, None] + jnp.arange(coff * m)[None, :]) < filled[:, None]
    new_kv = jnp.where(keep[..., None], new_kv, 0.0)
    new_score = jnp.where(keep[..., None], new_score, -jnp.inf)
    return ids, new_kv, new_score


class Compressor(nn.Module):
    """Gated pooling of ``ratio`` tokens into one ``head_dim`` entry (CSA: overlapping)."""
    cfg: Config
    ratio: int
    head_dim: int
    rotate: bool = False          # indexer keys: Hadamard + FP4; main entries: FP8 (448 dims)

    @nn.compact
    def __call__(self, x, state_kv, state_score, lengths, num_new, inv_freq) -> CompressorChunk:
        """x [B,S,d] -> the chunk's candidate entries and E buffers (see CompressorChunk)."""
        cfg, m, hd = self.cfg, self.ratio, self.head_dim
        coff = compressor_overlap(m)
        b, s, _ = x.shape
        kv = Linear(cfg, cfg.dim, coff * hd, "f32", name="wkv")(x)           # f32
        score = Linear(cfg, cfg.dim, coff * hd, "f32", name="wgate")(x)
        ape = self.param("ape", normal_init(0.1), (m, coff * hd), jnp.float32)
        positions = lengths[:, None] + jnp.arange(s)[None, :]
        score = score + ape[positions % m]

        # E: saved rows, then the new tokens right after the row's last consumed position.
        n_blocks = -(-(coff * m + s) // m)
        pad = ((0, 0), (0, n_blocks * m - coff * m), (0, 0))
        offset = (coff - 1) * m + lengths % m
        e_kv = _place_rows(jnp.pad(state_kv, pad), kv, offset)
        e_score = _place_rows(jnp.pad(state_score, pad, constant_values=-jnp.inf), score, offset)

        blk_kv = e_kv.reshape(b, n_blocks, m, coff * hd)
        blk_score = e_score.reshape(b, n_blocks, m, coff * hd)
        if coff == 2:   # entry q pools the previous block's first half and its own second half
            slots_kv = jnp.concatenate([blk_kv[:, :-1, :, :hd], blk_kv[:, 1:, :, hd:]], axis=2)
            slots_score = jnp.concatenate([blk_score[:, :-1, :, :hd], blk_score[:, 1:, :, hd:]],
                                          axis=2)
        else:
            slots_kv, slots_score = blk_kv, blk_score
        q = jnp.arange(coff - 1, n_blocks)
        # Blocks that cannot complete even with every token kept hold -inf rows: pool them
        # with zero scores instead (never committed) so no NaN is produced.
        possible = (q[None, :] + 1) * m <= (offset + num_new)[:, None]
        weights = jax.nn.softmax(jnp.where(possible[..., None, None], slots_score, 0.0), axis=2)
        pooled = jnp.sum(weights * slots_kv, axis=2)                          # [B, Q, hd] f32

        entry = RMSNorm(hd, cfg.norm_eps, name="norm")(pooled.astype(act_dtype(cfg)))
        block_ids = lengths[:, None] // m - (coff - 1) + q[None, :]
        entry = rope_tail(entry, jnp.maximum(block_ids, 0) * m, inv_freq, cfg.rope_head_dim)
        if self.rotate:
            entry = quant.hadamard_rotate(entry)
            if cfg.quant_simulation:
                entry = quant.fp4_simulate(entry, 32)
        elif cfg.quant_simulation:
            nope = hd - cfg.rope_head_dim
            entry = jnp.concatenate([quant.fp8_simulate(entry[..., :nope], 64),
                                     entry[..., nope:]], axis=-1)
        return CompressorChunk(entry, e_kv, e_score, m, coff)


class Indexer(nn.Module):
    """Lightning indexer of CSA layers: scores completed compressed entries, keeps the top-k.

    Its query projection ``wq_b`` reads the attention's ``qr`` like the attention's own
    ``wq_b``: with quantised weights the attention runs both as one op
    (``query_weight``, then ``__call__(..., q_proj=)``)."""
    cfg: Config
    policy: KernelPolicy = DEFAULT_POLICY
    mesh: object = None

    def setup(self):
        cfg = self.cfg
        nh, hd = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = (FP8Weight(cfg.q_lora_rank, nh * hd) if cfg.quantized else
                     Linear(cfg, cfg.q_lora_rank, nh * hd, "fp8", policy=self.policy,
                            mesh=self.mesh))
        self.compressor = Compressor(cfg, CSA_RATIO, hd, rotate=True)
        self.weights_proj = Linear(cfg, cfg.dim, nh, "plain")

    def query_weight(self):
        """``(weight, scale)`` of the FP8 query projection (quantised weights only)."""
        return self.wq_b()

    def __call__(self, x, qr, positions, lcache, lengths, num_new, inv_freq, q_proj=None):
        """Returns (top-k entry ids [B,S,k] with -1 for unused, the key compressor's chunk).
        ``q_proj``: ``wq_b``'s output ``[B,S,H*hd]`` when the caller ran it (else computed
        here from ``qr``)."""
        cfg = self.cfg
        b, s, _ = x.shape
        nh, hd, m = cfg.index_n_heads, cfg.index_head_dim, CSA_RATIO
        dt = act_dtype(cfg)
        if q_proj is None:
            q_proj = (fp8_linear(qr, *self.wq_b(), cfg.quant_simulation, policy=self.policy,
                                 mesh=self.mesh) if cfg.quantized else self.wq_b(qr))
        q = q_proj.reshape(b, s, nh, hd)
        q = rope_tail(q, positions[..., None], inv_freq, cfg.rope_head_dim)
        q = quant.hadamard_rotate(q)
        if cfg.quant_simulation:
            q = quant.fp4_simulate(q, 32)
        chunk = self.compressor(
            x, lcache.index_kv_state, lcache.index_score_state, lengths, num_new, inv_freq)
        ids, _, _ = commit_compressor(chunk, lengths, num_new)
        table = write_entries(lcache.index_keys, chunk.entries, ids)
        weights = self.weights_proj(x)
        weights = (weights * (hd ** -0.5 * nh ** -0.5)).astype(dt)
        # The scores [B,S,H,N] are never materialised: the op merges blocks of entries into a
        # running top-k with the reference's rounding points (ffi/indexer.py).
        visible = (positions + 1) // m                                          # [B,S]

        def select(q, weights, table, visible):
            return index_topk(q, weights, table, visible, cfg.index_topk,
                              implementation=self.policy.implementation_for("index_topk"))
        if self.mesh is None:
            return select(q, weights, table, visible), chunk
        # Each device selects for its own rows (as the attention attends them): outside a
        # shard_map the partitioner would gather every row's keys to every device.
        top, = batch_parallel(lambda *a: (select(*a),), self.mesh, (q, weights, table, visible),
                              (), 1)
        return top, chunk
