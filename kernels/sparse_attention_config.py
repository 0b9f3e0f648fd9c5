"""``sparse_attention`` on Hopper (sm_90a): the kernel's configuration, limits and launch
heuristics -- everything the op needs to decide, without importing CuTe DSL.

The CuTe DSL code is in ``sparse_attention_sm90_kernel.py`` (main kernel) and
``sparse_attention_sm90_combine.py`` (flash-decoding merge); only the kernel path of
``dsv4_jax.ffi.sparse_attention`` imports them.
"""
from __future__ import annotations

import dataclasses

HEAD_DIM = 512
HEAD_BLOCK = 64          # heads per CTA = WGMMA M
SMEM_BYTES = 227 * 1024  # per CTA on sm_90
NUM_SMS = 132            # H100 SXM and H200 both have 132 SMs
MAX_GRID_Z = 65535       # tokens run along the grid's z dimension
# The FP8 entry rows the kernel reads as its second pool (``dsv4_jax.kv_entry``; a test
# checks these against it): e4m3 codes of the 448 no-RoPE dims, the 64 RoPE dims in BF16,
# one E8M0 scale byte per 64 codes, padding to 584 bytes.
FP8_NOPE_DIM = 448
FP8_ROPE_OFFSET = 448
FP8_SCALE_OFFSET = 576
FP8_ENTRY_BYTES = 584
# The query preparation the kernel takes (``q_prep``: the heads' RMSNorm and RoPE of the
# queries, the inverse RoPE of the output) rotates the last ROPE_DIM channels of a head.
ROPE_DIM = 64
# Benchmark-only variants that leave one stage out, to see where the time goes; their
# outputs are wrong by design.
ABLATIONS = ("", "no_gather", "no_qk", "no_softmax", "no_pv")
# (entries per pipeline stage, stages, split QK^T) the kernel offers: Q (64 KB) + the stages
# (+ the fp32 score exchange buffer when QK^T is split between the math warpgroups) must fit
# in 227 KB of smem.
_OFFERED = ((64, 2, False), (64, 2, True), (48, 3, False))


@dataclasses.dataclass(frozen=True)
class SparseAttentionSm90Config:
    """One launch configuration of the kernel; a bad combination raises ``ValueError``.

    ``block_n`` entries per pipeline stage, ``num_stages`` stages, ``qk_split``: QK^T split
    between the two math warpgroups (True), computed by both (False), or ``None``: split when
    the launch has a single split (many blocks per CTA: faster there) and duplicated when it is
    split flash-decoding style (a few blocks per CTA: the duplicated, ping-ponged QK^T is as
    fast or faster); the measurements: docs/performance.md, "Split QK^T (v4)".

    Test and benchmark hooks (not model settings): ``ablation`` compiles a variant that leaves
    one stage out (wrong outputs, timing only; one of ``ABLATIONS``); ``poison`` (a float)
    fills every output buffer with that value before the kernel runs, so an element the
    kernel does not write shows up.
    """
    block_n: int = 64
    num_stages: int = 2
    qk_split: bool | None = None
    ablation: str = ""
    poison: float | None = None

    def __post_init__(self):
        if self.ablation not in ABLATIONS:
            raise ValueError(f"SparseAttentionSm90Config: ablation must be one of {ABLATIONS}, "
                             f"got {self.ablation!r}")
        shape = (self.block_n, self.num_stages)
        splits = (True, False) if self.qk_split is None else (self.qk_split,)
        if not any((*shape, s) in _OFFERED for s in splits):
            raise ValueError(f"SparseAttentionSm90Config: (block_n, num_stages, qk_split) = "
                             f"{(*shape, self.qk_split)} is not offered; one of {_OFFERED} "
                             "(qk_split None: either)")

    def resolve(self, num_splits: int = 1, extra_fp8: bool = False) -> "SparseAttentionSm90Config":
        """This configuration with ``qk_split`` decided for a launch of ``num_splits``; never
        split with an FP8 second pool (``is_supported``)."""
        if self.qk_split is not None:
            return self
        split = (num_splits == 1 and not extra_fp8
                 and (self.block_n, self.num_stages, True) in _OFFERED)
        return dataclasses.replace(self, qk_split=split)

    def smem_bytes(self) -> int:
        """Shared memory of one CTA: Q, the stages, the score exchange, barriers, validity
        and the FP8 rows' scale words (allocated whether the pool is FP8 or not)."""
        exchange = 2 * HEAD_BLOCK * self.block_n * 4 if self.resolve().qk_split else 0
        scales = self.block_n * self.num_stages * 8
        return ((HEAD_BLOCK + self.block_n * self.num_stages) * HEAD_DIM * 2 + exchange
                + scales + 1024)

    def is_supported(self, *, dtype: str, head_dim: int, num_heads: int, num_tokens: int,
                     window_slots: int, pool_rows: int, extra_slots: int = 0,
                     extra_rows: int = 1,
                     extra_entry_bytes: int | None = None, rope_dim: int | None = None,
                     q_norm: bool = False) -> tuple[bool, str]:
        """Whether the kernel handles these shapes: ``(True, "")`` or ``(False, reason)``.
        ``extra_entry_bytes``: the row width of an FP8 second pool (None: same dtype as q);
        ``rope_dim``, ``q_norm``: the query preparation asked for (rotated channels; the
        heads' norm), which the kernel does as a whole or not at all."""
        if dtype != "bfloat16":
            return False, f"dtype {dtype} (the kernel is bf16 only)"
        if head_dim != HEAD_DIM:
            return False, f"head_dim {head_dim} (the kernel needs {HEAD_DIM})"
        if num_heads == 0 or num_heads % HEAD_BLOCK:
            return False, f"num_heads {num_heads} (the kernel needs a multiple of {HEAD_BLOCK})"
        if num_tokens < 1 or window_slots < 1:
            return False, f"T={num_tokens}, K={window_slots} (the kernel needs T >= 1 and K >= 1)"
        if num_tokens > MAX_GRID_Z:
            return False, f"T={num_tokens} (the kernel's grid takes at most {MAX_GRID_Z} tokens)"
        if pool_rows < 1 or (extra_slots > 0 and extra_rows < 1):
            return False, "an empty kv pool (the kernel needs at least one row per pool)"
        if extra_entry_bytes is not None and extra_entry_bytes != FP8_ENTRY_BYTES:
            return False, (f"FP8 entry rows of {extra_entry_bytes} bytes (the kernel reads "
                           f"{FP8_ENTRY_BYTES})")
        if extra_entry_bytes is not None and extra_slots > 0 and self.qk_split:
            # The FP8 producer commits a block one block late; the split QK^T holds a block
            # until the next one lands: with two stages each would wait for the other.
            return False, ("qk_split=True with an FP8 second pool (the producer's late commit "
                           "and the split QK^T's look-ahead would hold both stages; use "
                           "qk_split None or False)")
        if (rope_dim is not None or q_norm) and (rope_dim != ROPE_DIM or not q_norm):
            return False, (f"a query preparation of rope_dim {rope_dim} with"
                           f"{'' if q_norm else 'out'} the heads' norm (the kernel does both, "
                           f"rope_dim {ROPE_DIM})")
        return True, ""


# Every configuration the kernel offers, each with qk_split decided.
CONFIGS = tuple(SparseAttentionSm90Config(b, s, q) for b, s, q in _OFFERED)
DEFAULT_CONFIG = SparseAttentionSm90Config()


def choose_num_splits(num_tokens: int, num_heads: int, num_slots: int,
                      block_n: int = DEFAULT_CONFIG.block_n, num_sms: int = NUM_SMS) -> int:
    """Flash-decoding split count: the fewest splits minimising waves x blocks per split, for
    launches that leave SMs idle without a split. A launch that already fills the SMs never
    splits: its partials (``splits x T x H x 512`` f32, written then read by the combine)
    would cost far more than the tail of its last wave (at a 4096-token prefill chunk they
    were gigabytes: docs/performance.md, long context)."""
    num_blocks = max(1, -(-num_slots // block_n))
    ctas = num_tokens * (num_heads // HEAD_BLOCK)
    if ctas >= num_sms:
        return 1
    best, best_cost = 1, None
    for splits in range(1, num_blocks + 1):
        per_split = -(-num_blocks // splits)
        used = -(-num_blocks // per_split)
        waves = -(-ctas * used // num_sms)
        # One CTA per SM (about 200 KB of smem): time ~ waves x blocks per CTA; splitting
        # adds a combine pass worth about one block.
        cost = waves * per_split + (1 if used > 1 else 0)
        if best_cost is None or cost < best_cost:
            best, best_cost = used, cost
    return best


def flops(num_tokens: int, num_heads: int, num_slots: int) -> int:
    """Matmul FLOPs of the op: QK^T and PV, 2 per multiply-add each."""
    return 4 * num_tokens * num_heads * num_slots * HEAD_DIM
