"""DSV4 attention sub-block: SWA-only, CSA (compressed + indexer) and HCA layers
(docs/architecture.md §3.3-3.6).

Dataflow for a chunk of S tokens per row (positions ``L_b .. L_b + S - 1``):

1. queries: ``wq_a -> q_norm -> wq_b``, per-head weightless RMSNorm, RoPE on the last 64 dims;
   window entry: ``wkv -> kv_norm``, RoPE, FP8 simulation of the 448 no-RoPE dims.
   ``wq_a`` and ``wkv`` (both read x) run as one op, as do ``wq_b`` and a CSA layer's
   indexer ``wq_b`` (both read the normed queries): one kernel launch each at decode.
2. window pool = each row's ring (previous W entries) followed by the chunk's new entries;
   query t attends positions ``t-W+1 .. t`` found either in the ring (slot ``p mod W``) or in
   the chunk.
3. CSA/HCA: the compressor emits the blocks completed in this chunk into the row's compressed
   table *before* attention (an entry whose block ends at t is visible to t); HCA attends every
   completed entry, CSA the indexer's top-k.
4. ``dsv4_jax.ffi.sparse_attention`` over both pools (one softmax, sink in the denominator),
   inverse RoPE at the query position, grouped ``wo_a`` then ``wo_b``.
5. the ring keeps, per slot, the newest position of the row that maps to it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import flax.linen as nn
from flax import struct

from dsv4_jax.config import Config
from dsv4_jax.cache import LayerCache
from dsv4_jax.ffi import sparse_attention
from dsv4_jax.ffi.policy import DEFAULT_POLICY, KernelPolicy
from dsv4_jax.ffi.rope import head_rms_norm, rope_table, rotate_tail
from dsv4_jax import kv_entry, quant
from .compressor import (Compressor, CompressorChunk, Indexer, commit_compressor,
                         write_entries)
from .layers import (FP8Weight, Linear, RMSNorm, act_dtype, fp8_codes_init, fp8_linear_pair,
                     grouped_linear, normal_init, pow2_scale_init, rope_inv_freq,
                     FP8_CODE_STD)
from .parallel import batch_parallel


def window_indices(lengths: jax.Array, seq: int, window: int) -> jax.Array:
    """[B, S, W] rows of each row's window pool ``[ring_b (W) ; chunk_b (S)]`` for every
    query: position p sits in the chunk (p >= L) or in ring slot p mod W; p < 0 gives -1."""
    t = lengths[:, None] + jnp.arange(seq)[None, :]                      # [B, S]
    p = t[..., None] - (window - 1) + jnp.arange(window)                # [B, S, W]
    in_chunk = p >= lengths[:, None, None]
    local = jnp.where(in_chunk, window + p - lengths[:, None, None], p % window)
    return jnp.where(p >= 0, local, -1).astype(jnp.int32)


def attend_rows(q, pool, win_idx, table, selected, selected_len, cos, sin, sink, *,
                scale, q_norm_eps, implementation, config=None):
    """The sparse attention of a batch of rows, per-row indices made global for the op.

    q [B,S,H,c] (as wq_b writes it with cos and sin, else normed and rotated); pool
    [B,W+S,c] window pool; win_idx [B,S,W] into the row's pool; table [B,N,c] compressed
    entries, [B,N,584] uint8 FP8 rows (the op decodes the rows it reads) or None; selected
    [B,S,K2] entry ids (-1 unused); selected_len [B,S] int32 or None: slots of ``selected``
    at or past it are unused (HCA: the visible entries come first, and the kernel stops
    there, so a long cache's empty tail costs nothing); cos, sin [B,S,rd/2] or None: the
    queries' RoPE, which the op applies after their heads' norm (``q_norm_eps``), and
    inverts on the output -> o [B,S,H,c].
    ``config``: the kernel's ``SparseAttentionSm90Config`` (``KernelPolicy.sparse_attention``).
    """
    b, s, h, c = q.shape
    offset = jnp.arange(b, dtype=jnp.int32)[:, None, None] * pool.shape[1]
    win = jnp.where(win_idx >= 0, win_idx + offset, -1).reshape(b * s, -1)
    extra_kv = extra_idx = extra_len = None
    if table is not None and table.shape[1]:
        n = table.shape[1]
        row = jnp.arange(b, dtype=jnp.int32)[:, None, None] * n
        extra_idx = jnp.where(selected >= 0, selected + row, -1).reshape(b * s, -1)
        extra_kv = table.reshape(b * n, table.shape[-1])
        if not kv_entry.is_fp8_table(table):
            extra_kv = extra_kv.astype(q.dtype)
        if selected_len is not None:
            extra_len = selected_len.reshape(b * s).astype(jnp.int32)
    rope = None if cos is None else (cos.reshape(b * s, -1), sin.reshape(b * s, -1))
    o, _ = sparse_attention(q.reshape(b * s, h, c), pool.reshape(-1, c).astype(q.dtype), win,
                            sink, extra_kv=extra_kv, extra_idx=extra_idx, extra_len=extra_len,
                            rope=rope, q_norm_eps=q_norm_eps, scale=scale,
                            implementation=implementation, config=config)
    return o.reshape(b, s, h, c)


def update_ring(ring: jax.Array, new: jax.Array, lengths: jax.Array,
                num_new: jax.Array) -> jax.Array:
    """Ring after appending ``num_new`` of the chunk's entries: slot i holds the newest
    position ``p < L + n`` with ``p mod W == i`` (taken from the chunk when ``p >= L``)."""
    w, s = ring.shape[1], new.shape[1]
    last = (lengths + num_new - 1)[:, None]                             # [B, 1]
    slot = jnp.arange(w)[None, :]
    p = last - ((last - slot) % w)                                      # [B, W]
    from_chunk = (p >= lengths[:, None]) & (p >= 0)
    src = jnp.clip(p - lengths[:, None], 0, s - 1)
    picked = jnp.take_along_axis(new, src[..., None], axis=1)
    return jnp.where(from_chunk[..., None], picked.astype(ring.dtype), ring)


def all_entry_indices(positions: jax.Array, ratio: int, n_entries: int):
    """HCA: ``([B, S, n_entries] ids, [B, S] count)``: the entry ids visible to each query
    ((j+1)*m <= t+1), else -1, and how many there are (the first ``count`` slots)."""
    j = jnp.arange(n_entries)
    visible = jnp.clip((positions + 1) // ratio, 0, n_entries).astype(jnp.int32)
    return jnp.where(j[None, None, :] < visible[..., None], j, -1).astype(jnp.int32), visible


@struct.dataclass
class LayerPending:
    """A layer's share of a forward pass, before deciding how many tokens to keep: the
    chunk's window entries and its compressors' chunks (see ``commit_layer``)."""
    kv: jax.Array
    compressor: CompressorChunk | None = None
    indexer: CompressorChunk | None = None


def commit_layer(lcache: LayerCache, pending: LayerPending, lengths, num_new) -> LayerCache:
    """The layer cache after keeping the first ``num_new [B]`` tokens of the chunk."""
    new = lcache.replace(window=update_ring(lcache.window, pending.kv, lengths, num_new))
    if pending.compressor is not None:
        ids, st_kv, st_score = commit_compressor(pending.compressor, lengths, num_new)
        new = new.replace(kv_state=st_kv, score_state=st_score,
                          compressed=write_entries(lcache.compressed,
                                                   pending.compressor.entries, ids))
    if pending.indexer is not None:
        ids, st_kv, st_score = commit_compressor(pending.indexer, lengths, num_new)
        new = new.replace(index_kv_state=st_kv, index_score_state=st_score,
                          index_keys=write_entries(lcache.index_keys, pending.indexer.entries, ids))
    return new


class GroupedOutput(nn.Module):
    """``wo_a`` applied per output group: ``[B,S,g,(h/g)*c] -> [B,S,g,o_lora]``: BF16 outputs
    times the exactly dequantised weight (the reference dequantises ``wo_a`` to BF16 at
    conversion; no FP8 activation quantisation), f32 accumulation. A grouped GEMM with one
    group per output group (``layers.grouped_linear``): the FP8 weight is read as stored."""
    cfg: Config
    policy: KernelPolicy = DEFAULT_POLICY
    mesh: object = None

    @nn.compact
    def __call__(self, o: jax.Array) -> jax.Array:
        cfg = self.cfg
        g = cfg.o_groups
        in_f = cfg.n_heads * cfg.head_dim // g
        shape = (g * cfg.o_lora_rank, in_f)
        std = in_f ** -0.5
        if cfg.quantized:
            w = self.param("weight", fp8_codes_init, shape)
            s = self.param("scale", pow2_scale_init(std, FP8_CODE_STD),
                           (-(-shape[0] // 128), -(-shape[1] // 128)))
        else:
            w, s = self.param("weight", normal_init(std), shape, act_dtype(cfg)), None
        if s is None or cfg.o_lora_rank % 128:       # plain, or a scale block spans groups
            w = quant.dequant_weight(w, s, o.dtype).reshape(g, cfg.o_lora_rank, in_f)
            return jnp.einsum("bsgd,grd->bsgr", o, w, preferred_element_type=jnp.float32
                              ).astype(o.dtype)
        w = w.reshape(g, cfg.o_lora_rank, in_f)
        s = s.reshape(g, cfg.o_lora_rank // 128, s.shape[-1])
        return grouped_linear(o, (w, s), simulate=False, policy=self.policy, mesh=self.mesh,
                              groups_last=True)


class Attention(nn.Module):
    cfg: Config
    layer_id: int
    policy: KernelPolicy = DEFAULT_POLICY       # the ops' implementations and kernel configs
    mesh: object = None

    @nn.compact
    def __call__(self, x, lcache: LayerCache, lengths, num_new):
        """x [B,S,d] (normed block input) -> (out [B,S,d], new LayerCache, LayerPending)."""
        cfg = self.cfg
        ratio, kind = cfg.compress_ratios[self.layer_id], cfg.layer_kind(self.layer_id)
        b, s, _ = x.shape
        h, c, rd = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        inv_freq = rope_inv_freq(cfg, compressed=ratio > 0)
        positions = lengths[:, None] + jnp.arange(s)[None, :]

        linear = functools.partial(Linear, cfg, family="fp8", policy=self.policy,
                                   mesh=self.mesh)
        if cfg.quantized:      # wq_a and wkv read the same rows: one op, one launch
            q_lat, kv = fp8_linear_pair(
                x, FP8Weight(cfg.dim, cfg.q_lora_rank, name="wq_a")(),
                FP8Weight(cfg.dim, c, name="wkv")(), cfg.quant_simulation,
                policy=self.policy, mesh=self.mesh)
        else:
            q_lat = linear(cfg.dim, cfg.q_lora_rank, name="wq_a")(x)
            kv = linear(cfg.dim, c, name="wkv")(x)
        q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, name="q_norm")
        qr = q_norm(q_lat)
        # Quantised, wq_b's op takes q_lat and the norm (qr is then unused): XLA's norm before
        # its launch, or under GroupedGemmPolicy(row_norm_in_kernel=True) inside its decode
        # kernels, where the norm takes no launch of its own.
        row_norm = (q_norm.weight, cfg.norm_eps)
        indexer = Indexer(cfg, self.policy, self.mesh, name="indexer") if kind == "csa" else None
        index_q = None
        if indexer is not None and cfg.quantized:     # both query projections read qr
            q, index_q = fp8_linear_pair(
                q_lat, FP8Weight(cfg.q_lora_rank, h * c, name="wq_b")(),
                indexer.query_weight(), cfg.quant_simulation, policy=self.policy,
                mesh=self.mesh, row_norm=row_norm)
        elif cfg.quantized:
            q = linear(cfg.q_lora_rank, h * c, name="wq_b")(q_lat, row_norm=row_norm)
        else:
            q = linear(cfg.q_lora_rank, h * c, name="wq_b")(qr)
        q = q.reshape(b, s, h, c)
        rope = rope_table(positions, inv_freq)                        # [B, S, rd / 2] each
        # The heads' norm, the query RoPE and the output's inverse RoPE: the attention op's
        # with ``attention_rope`` (on the kernel, no launches of their own), else XLA's.
        in_op = self.policy.attention_rope
        if not in_op:
            q = rotate_tail(head_rms_norm(q, cfg.norm_eps), *(r[..., None, :] for r in rope))

        kv = RMSNorm(c, cfg.norm_eps, name="kv_norm")(kv)
        kv = rotate_tail(kv, *rope)                     # the queries' table: same positions
        if cfg.quant_simulation:
            kv = jnp.concatenate([quant.fp8_simulate(kv[..., :c - rd], 64), kv[..., c - rd:]],
                                 axis=-1)

        w = cfg.window_size
        pool = jnp.concatenate([lcache.window.astype(kv.dtype), kv], axis=1)   # [B, W+S, c]
        win_idx = window_indices(lengths, s, w)

        pending, sel, sel_len, table = LayerPending(kv=kv), None, None, None
        if kind != "swa":
            pending = pending.replace(compressor=Compressor(cfg, ratio, c, name="compressor")(
                x, lcache.kv_state, lcache.score_state, lengths, num_new, inv_freq))
            if kind == "csa":
                sel, ichunk = indexer(x, qr, positions, lcache, lengths, num_new, inv_freq,
                                      q_proj=index_q)
                pending = pending.replace(indexer=ichunk)
        new_cache = commit_layer(lcache, pending, lengths, num_new)
        if kind != "swa":
            table = new_cache.compressed                     # this call's entries included
            if kind == "hca":
                sel, sel_len = all_entry_indices(positions, ratio, table.shape[1])

        sink = self.param("attn_sink", normal_init(0.5), (h,), jnp.float32)
        attend = functools.partial(
            attend_rows, scale=cfg.softmax_scale, q_norm_eps=cfg.norm_eps if in_op else None,
            implementation=self.policy.implementation_for("sparse_attention"),
            config=self.policy.sparse_attention)
        tables = rope if in_op else (None, None)
        if self.mesh is None:
            o = attend(q, pool, win_idx, table, sel, sel_len, *tables, sink)
        else:       # data parallel: every device attends its own rows with local indices
            o, = batch_parallel(lambda *a: (attend(*a),), self.mesh,
                                (q, pool, win_idx, table, sel, sel_len, *tables), (sink,), 1)
        if not in_op:
            o = rotate_tail(o, *(r[..., None, :] for r in rope), inverse=True)
        o = o.reshape(b, s, cfg.o_groups, h // cfg.o_groups * c)
        u = GroupedOutput(cfg, self.policy, self.mesh, name="wo_a")(o)
        out = linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, name="wo_b")(u.reshape(b, s, -1))
        return out, new_cache, pending
