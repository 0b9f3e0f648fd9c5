"""Sparse MQA attention with a per-head sink: the op every DSV4 attention layer calls.

Laid out as every op (docs/architecture.md §7): the public op ``sparse_attention`` with its
``implementation`` dispatch, the pure-JAX ``sparse_attention_reference``, the argument checks
``check_sparse_attention_args``, and the kernel path ``sparse_attention_cute`` whose launch
configuration is a ``SparseAttentionSm90Config`` (``kernels/sparse_attention_config.py``).

Contract::

    sparse_attention(q, kv, idx, sink, *, extra_kv=None, extra_idx=None, extra_len=None,
                     rope=None, q_norm_eps=None, scale, implementation=None) -> (o, lse)

    q:         [T, H, D]  query tokens (T = batch x step), D = 512 for DSV4
    kv:        [N, D]     flat pool of window entries (all rows' rings + new entries)
    idx:       [T, K]     int32 global rows of ``kv``; -1 = unused slot
    extra_kv:  [M, D]     optional second pool (compressed entries of CSA/HCA layers), in
                          q's dtype or uint8 [M, W]: FP8 entry rows (``dsv4_jax.kv_entry``,
                          W = 584 for D = 512), decoded where they are read
    extra_idx: [T, K2]    int32 rows of ``extra_kv``; -1 = unused slot
    extra_len: [T]        optional int32 bound: slots ``j >= extra_len[t]`` of ``extra_idx[t]``
                          are unused (HCA: a query's visible entries are its first slots);
                          the kernel's work stops at it, so a long cache's unused tail costs
                          nothing
    sink:      [H]        f32 per-head sink logit, in the denominator only
    rope:      (cos, sin) optional f32 [T, r / 2] each (``ffi.rope.rope_table`` of the
                          tokens' positions): the queries' last r channels are rotated
                          (interleaved pairs) before they attend and the output's rotated
                          back after -- DSV4's query RoPE and inverse output RoPE
    q_norm_eps:           optional float: the queries are first normalised per head
                          (``ffi.rope.head_rms_norm``, weightless, in q's dtype)

With ``rope`` and ``q_norm_eps`` the op takes the queries as the projection writes them and
does the model's three XLA passes around attention itself (on the kernel: in its prologue
and epilogue, no launch of their own).

    o[t,h]   = sum_k e^{l_k} v_k / (sum_k e^{l_k} + e^{sink_h}),  l_k = scale * q[t,h].kv[k]
    lse[t,h] = log sum_k e^{l_k}   (natural log, over attended entries, sink excluded)

Keys are values (MQA: one 512-d entry per position shared by all heads). Every index
outside ``[0, pool size)`` -- -1 and any out-of-range value alike -- is an unused slot: it
is never read, so a bad index cannot read out of bounds. A token with no used slot gets
``o = 0`` and ``lse = -inf`` (no NaN). Duplicated indices count once per occurrence, as a
softmax over the list would.

Numerics of the reference follow DeepSeek's TileLang kernel: logits, running max and sums
in f32; the probabilities are cast to the input dtype (bf16) before the P.V product; the
output is cast back to the input dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4_jax import kv_entry
from dsv4_jax.kernels.sparse_attention_config import (DEFAULT_CONFIG,
                                                      SparseAttentionSm90Config,
                                                      choose_num_splits)
from .dispatch import dispatch
from .registry import OpSpec, register
from .rope import head_rms_norm, rotate_tail

__all__ = ["sparse_attention", "sparse_attention_reference", "sparse_attention_cute",
           "check_sparse_attention_args", "SparseAttentionSm90Config"]

_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# Tokens per lax.map step of the reference, which bounds the gathered [chunk, K, D] block.
_REFERENCE_TOKEN_CHUNK = 256


def _describe(name, x):
    return f"{name} has shape {tuple(x.shape)} and dtype {x.dtype}"


def check_sparse_attention_args(q, kv, idx, sink, extra_kv=None, extra_idx=None,
                                extra_len=None, rope=None, q_norm_eps=None):
    """Raise ``TypeError``/``ValueError`` naming the argument when shapes or dtypes are wrong."""
    if q.ndim != 3:
        raise ValueError(f"sparse_attention: q must be [T, H, D]; {_describe('q', q)}")
    t, h, d = q.shape
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"sparse_attention: q must be bf16/f16/f32; {_describe('q', q)}")
    if kv.ndim != 2 or kv.shape[1] != d:
        raise ValueError(f"sparse_attention: kv must be [N, {d}] to match q; "
                         f"{_describe('kv', kv)}, {_describe('q', q)}")
    if kv.dtype != q.dtype:
        raise TypeError(f"sparse_attention: kv dtype must equal q dtype; "
                        f"{_describe('kv', kv)}, {_describe('q', q)}")
    if idx.ndim != 2 or idx.shape[0] != t:
        raise ValueError(f"sparse_attention: idx must be [T={t}, K]; {_describe('idx', idx)}")
    if idx.dtype != jnp.int32:
        raise TypeError(f"sparse_attention: idx must be int32; {_describe('idx', idx)}")
    if sink.shape != (h,):
        raise ValueError(f"sparse_attention: sink must have shape ({h},) (one per head); "
                         f"{_describe('sink', sink)}")
    if not jnp.issubdtype(sink.dtype, jnp.floating):
        raise TypeError(f"sparse_attention: sink must be floating; {_describe('sink', sink)}")
    if (extra_kv is None) != (extra_idx is None):
        raise ValueError("sparse_attention: extra_kv and extra_idx must be given together")
    if extra_kv is not None:
        if kv_entry.is_fp8_table(extra_kv):
            if extra_kv.ndim != 2 or kv_entry.rope_dim_of(extra_kv.shape[1], d) is None:
                raise ValueError(f"sparse_attention: uint8 extra_kv must be [M, W] FP8 entry "
                                 f"rows of head_dim {d} (W = 584 for 512); "
                                 f"{_describe('extra_kv', extra_kv)}")
        elif extra_kv.ndim != 2 or extra_kv.shape[1] != d:
            raise ValueError(f"sparse_attention: extra_kv must be [M, {d}] (or uint8 FP8 "
                             f"entry rows); {_describe('extra_kv', extra_kv)}")
        elif extra_kv.dtype != q.dtype:
            raise TypeError(f"sparse_attention: extra_kv dtype must equal q dtype (or be uint8 "
                            f"FP8 entry rows); {_describe('extra_kv', extra_kv)}, "
                            f"{_describe('q', q)}")
        if extra_idx.ndim != 2 or extra_idx.shape[0] != t:
            raise ValueError(f"sparse_attention: extra_idx must be [T={t}, K2]; "
                             f"{_describe('extra_idx', extra_idx)}")
        if extra_idx.dtype != jnp.int32:
            raise TypeError(f"sparse_attention: extra_idx must be int32; "
                            f"{_describe('extra_idx', extra_idx)}")
    if extra_len is not None:
        if extra_idx is None:
            raise ValueError("sparse_attention: extra_len bounds extra_idx, which is not given")
        if extra_len.shape != (t,):
            raise ValueError(f"sparse_attention: extra_len must be [T={t}]; "
                             f"{_describe('extra_len', extra_len)}")
        if extra_len.dtype != jnp.int32:
            raise TypeError(f"sparse_attention: extra_len must be int32; "
                            f"{_describe('extra_len', extra_len)}")
    _check_query_prep(q, rope, q_norm_eps)


def _check_query_prep(q, rope, q_norm_eps):
    if q_norm_eps is not None and not isinstance(q_norm_eps, (int, float)):
        raise TypeError(f"sparse_attention: q_norm_eps must be a Python float or None, got "
                        f"{type(q_norm_eps).__name__}")
    if rope is None:
        return
    if not isinstance(rope, (tuple, list)) or len(rope) != 2:
        raise TypeError(f"sparse_attention: rope must be a (cos, sin) pair of arrays, got "
                        f"{type(rope).__name__}")
    cos, sin = rope
    t, _, d = q.shape
    for name, a in (("cos", cos), ("sin", sin)):
        if a.ndim != 2 or a.shape[0] != t or not 0 < 2 * a.shape[1] <= d:
            raise ValueError(f"sparse_attention: rope {name} must be [T={t}, r/2] with "
                             f"0 < r <= {d}; {_describe(name, a)}")
        if a.dtype != jnp.float32:
            raise TypeError(f"sparse_attention: rope {name} must be float32; "
                            f"{_describe(name, a)}")
    if cos.shape != sin.shape:
        raise ValueError(f"sparse_attention: rope cos and sin must have one shape; "
                         f"{_describe('cos', cos)}, {_describe('sin', sin)}")


def prepare_queries(q, rope=None, q_norm_eps=None):
    """The queries as they attend: per-head RMSNorm (``q_norm_eps``), then RoPE (``rope``)."""
    if q_norm_eps is not None:
        q = head_rms_norm(q, q_norm_eps)
    if rope is not None:
        q = rotate_tail(q, rope[0][:, None, :], rope[1][:, None, :])
    return q


def _gather(pool, idx, head_dim, dtype):
    """Rows ``idx`` [t, K] of ``pool`` ([t, K, D] keys, FP8 entry rows decoded) and which
    slots are used; an unused slot reads row 0 (masked by the caller)."""
    valid = (idx >= 0) & (idx < pool.shape[0])
    keys = pool[jnp.where(valid, idx, 0)]
    if kv_entry.is_fp8_table(pool):
        keys = kv_entry.decode(keys, head_dim, dtype)
    return keys, valid


def _attend_chunk(q, pools, sink, scale):
    """Reference attention for a chunk of tokens: q [t,H,D]; ``pools`` a list of (pool, idx
    [t,K_i] rows of pool): one softmax over the concatenated slots."""
    gathered = [_gather(pool, idx, q.shape[-1], q.dtype) for pool, idx in pools]
    keys = jnp.concatenate([k for k, _ in gathered], axis=1)         # [t, K, D]
    valid = jnp.concatenate([v for _, v in gathered], axis=1)        # [t, K]
    logits = jnp.einsum("thd,tkd->thk", q, keys,
                        preferred_element_type=jnp.float32) * jnp.float32(scale)
    logits = jnp.where(valid[:, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1)                                     # [t, H]
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m_safe[..., None])                          # 0 on unused slots
    denom_attended = jnp.sum(p, axis=-1)
    denom = denom_attended + jnp.exp(sink.astype(jnp.float32)[None, :] - m_safe)
    pv = jnp.einsum("thk,tkd->thd", p.astype(q.dtype), keys,
                    preferred_element_type=jnp.float32)
    o = pv / denom[..., None]
    any_valid = jnp.any(valid, axis=-1)[:, None]                     # [t, 1]
    o = jnp.where(any_valid[..., None], o, 0.0).astype(q.dtype)
    lse = jnp.where(any_valid, m_safe + jnp.log(denom_attended), -jnp.inf)
    return o, lse


def bounded_extra_idx(extra_idx, extra_len):
    """``extra_idx`` with every slot at or past the token's ``extra_len`` set to -1."""
    slot = jnp.arange(extra_idx.shape[1], dtype=jnp.int32)[None, :]
    return jnp.where(slot < extra_len[:, None], extra_idx, -1)


def sparse_attention_reference(q, kv, idx, sink, *, extra_kv=None, extra_idx=None,
                               extra_len=None, rope=None, q_norm_eps=None, scale):
    """Pure-JAX definition of the op (runs anywhere). Same contract as ``sparse_attention``.
    Only the rows a token selects are gathered (and, for FP8 entry rows, decoded)."""
    check_sparse_attention_args(q, kv, idx, sink, extra_kv, extra_idx, extra_len, rope,
                                q_norm_eps)
    q = prepare_queries(q, rope, q_norm_eps)
    o, lse = _attend_all(q, kv, idx, sink, extra_kv, extra_idx, extra_len, scale)
    if rope is not None:
        o = rotate_tail(o, rope[0][:, None, :], rope[1][:, None, :], inverse=True)
    return o, lse


def _attend_all(q, kv, idx, sink, extra_kv, extra_idx, extra_len, scale):
    if extra_len is not None:
        extra_idx = bounded_extra_idx(extra_idx, extra_len)
    pools = [kv] if extra_kv is None else [kv, extra_kv]
    indices = [idx] if extra_kv is None else [idx, extra_idx]

    def attend(q_chunk, idx_chunks):
        return _attend_chunk(q_chunk, list(zip(pools, idx_chunks)), sink, scale)

    t = q.shape[0]
    if t <= _REFERENCE_TOKEN_CHUNK:
        return attend(q, indices)
    # Long prefill: bound the gathered [chunk, K, D] block by mapping over token chunks.
    c = _REFERENCE_TOKEN_CHUNK
    pad = (-t) % c
    qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(-1, c, *q.shape[1:])
    ip = [jnp.pad(i, ((0, pad), (0, 0)), constant_values=-1).reshape(-1, c, i.shape[1])
          for i in indices]
    o, lse = jax.lax.map(lambda a: attend(a[0], a[1]), (qp, ip))
    return o.reshape(-1, *q.shape[1:])[:t], lse.reshape(-1, q.shape[1])[:t]


def _support(q, kv, idx, sink, *, extra_kv=None, extra_idx=None, extra_len=None, rope=None,
             q_norm_eps=None, scale, config: SparseAttentionSm90Config = DEFAULT_CONFIG,
             **_) -> tuple[bool, str]:
    """``config.is_supported`` for these arguments; imports no cutlass."""
    try:
        float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return False, "a traced scale (the kernel bakes scale in; pass a Python float)"
    return config.is_supported(
        dtype=jnp.dtype(q.dtype).name, head_dim=q.shape[-1], num_heads=q.shape[1],
        num_tokens=q.shape[0], window_slots=idx.shape[1], pool_rows=kv.shape[0],
        extra_slots=0 if extra_idx is None else extra_idx.shape[1],
        extra_rows=1 if extra_kv is None else extra_kv.shape[0],
        extra_entry_bytes=(extra_kv.shape[1] if kv_entry.is_fp8_table(extra_kv) else None),
        rope_dim=None if rope is None else 2 * rope[0].shape[1],
        q_norm=q_norm_eps is not None)


def sparse_attention_cute(q, kv, idx, sink, *, extra_kv=None, extra_idx=None, extra_len=None,
                          rope=None, q_norm_eps=None, scale,
                          config: SparseAttentionSm90Config | None = None):
    """The Hopper kernel (``kernels/sparse_attention_sm90_kernel.py``) as an XLA custom call.

    ``config``: a ``SparseAttentionSm90Config`` (default: ``DEFAULT_CONFIG``); its
    ``qk_split=None`` is decided per launch (``SparseAttentionSm90Config.resolve``), and its
    test hooks (``poison``, ``ablation``) apply here.
    """
    # Imported here, not at the top: CuTe DSL loads only when a kernel is emitted, so the
    # reference path works (and imports fast) where cutlass cannot load. cute_call first: it
    # pins CUTE_DSL_ARCH before cutlass is imported.
    from .cute_call import cute_call
    from dsv4_jax.kernels import sparse_attention_sm90_kernel as kernel

    check_sparse_attention_args(q, kv, idx, sink, extra_kv, extra_idx, extra_len, rope,
                                q_norm_eps)
    config = DEFAULT_CONFIG if config is None else config
    ok, reason = _support(q, kv, idx, sink, extra_kv=extra_kv, extra_idx=extra_idx, rope=rope,
                          q_norm_eps=q_norm_eps, scale=scale, config=config)
    if not ok:
        raise ValueError(f"sparse_attention: the kernel does not take these arguments: {reason}")
    t, h, d = q.shape
    has_extra = extra_kv is not None
    if not has_extra:
        # The launcher's signature is fixed; these stand-ins are never read (has_extra=False).
        extra_kv, extra_idx = kv, idx
    has_extra_len = extra_len is not None
    if not has_extra_len:           # a stand-in, never read (has_extra_len=False)
        extra_len = jnp.zeros((1,), jnp.int32)
    num_slots = idx.shape[1] + (extra_idx.shape[1] if has_extra else 0)
    splits = choose_num_splits(t, h, num_slots, config.block_n)
    launch = config.resolve(splits, extra_fp8=has_extra and kv_entry.is_fp8_table(extra_kv))
    # Flash-decoding partials (fp32 output and lse of each split); a placeholder without split.
    part_o = (splits, t, h, d) if splits > 1 else (1,)
    part_lse = (splits, t, h) if splits > 1 else (1,)
    out_shapes = (jax.ShapeDtypeStruct((t, h, d), q.dtype),
                  jax.ShapeDtypeStruct((t, h), jnp.float32),
                  jax.ShapeDtypeStruct(part_o, jnp.float32),
                  jax.ShapeDtypeStruct(part_lse, jnp.float32))
    q_prep = rope is not None
    if not q_prep:                  # stand-ins, never read (q_prep=False)
        rope = (jnp.zeros((1, 1), jnp.float32),) * 2
    static = dict(num_heads=h, softmax_scale=float(scale), num_splits=splits,
                  has_extra=has_extra, extra_fp8=kv_entry.is_fp8_table(extra_kv),
                  block_n=launch.block_n, num_stages=launch.num_stages,
                  qk_split=launch.qk_split, ablation=launch.ablation,
                  has_extra_len=has_extra_len, q_prep=q_prep,
                  norm_eps=float(q_norm_eps) if q_prep else 0.0)
    inputs = (q, kv, idx, extra_kv, extra_idx, extra_len, sink.astype(jnp.float32), *rope)
    if launch.poison is None:
        o, lse, _, _ = cute_call(kernel.sparse_attention_launcher, out_shapes, *inputs,
                                 **static)
    else:
        buffers = tuple(jnp.full(s.shape, launch.poison, s.dtype) for s in out_shapes)
        aliases = {len(inputs) + i: i for i in range(len(buffers))}
        o, lse, _, _ = cute_call(kernel.sparse_attention_launcher, out_shapes, *inputs,
                                 *buffers, input_output_aliases=aliases, **static)
    return o, lse


def sparse_attention(q, kv, idx, sink, *, extra_kv=None, extra_idx=None, extra_len=None,
                     rope=None, q_norm_eps=None, scale, implementation=None,
                     config: SparseAttentionSm90Config | None = None):
    """Sparse MQA attention with sink; see the module docstring for the contract.

    ``implementation``: ``"cute"`` (the Hopper kernel; raises ``ValueError`` when it does not
    support the arguments, e.g. head_dim != 512, and ``RuntimeError`` without a Hopper GPU),
    ``"xla"`` (the pure-JAX reference) or ``None`` (the kernel when lowering for a Hopper GPU
    and it supports the arguments, else the reference).
    """
    check_sparse_attention_args(q, kv, idx, sink, extra_kv, extra_idx, extra_len, rope,
                                q_norm_eps)
    if not isinstance(config, (SparseAttentionSm90Config, type(None))):
        raise TypeError(f"sparse_attention: config must be a SparseAttentionSm90Config or None, "
                        f"got {type(config).__name__}")
    config = DEFAULT_CONFIG if config is None else config
    pair = lambda cos, sin: None if cos is None else (cos, sin)  # noqa: E731

    def reference(q, kv, idx, sink, extra_kv, extra_idx, extra_len, cos, sin):
        return sparse_attention_reference(q, kv, idx, sink, extra_kv=extra_kv,
                                          extra_idx=extra_idx, extra_len=extra_len,
                                          rope=pair(cos, sin), q_norm_eps=q_norm_eps,
                                          scale=scale)

    def kernel(q, kv, idx, sink, extra_kv, extra_idx, extra_len, cos, sin):
        return sparse_attention_cute(q, kv, idx, sink, extra_kv=extra_kv, extra_idx=extra_idx,
                                     extra_len=extra_len, rope=pair(cos, sin),
                                     q_norm_eps=q_norm_eps, scale=scale, config=config)

    cos, sin = (None, None) if rope is None else rope
    return dispatch("sparse_attention", implementation,
                    lambda: _support(q, kv, idx, sink, extra_kv=extra_kv, extra_idx=extra_idx,
                                     rope=rope, q_norm_eps=q_norm_eps, scale=scale,
                                     config=config),
                    reference, kernel, q, kv, idx, sink, extra_kv, extra_idx, extra_len, cos,
                    sin)


register(OpSpec("sparse_attention", sparse_attention_reference, _support))
