"""Shape limits and launch heuristics of ``sparse_attention_sm90`` (no cutlass import).

The JAX dispatcher consults ``is_supported`` before it decides to import CuTe DSL at all.
"""
from __future__ import annotations

HEAD_DIM = 512
HEAD_BLOCK = 64          # heads per CTA = WGMMA M
SMEM_BYTES = 227 * 1024  # per CTA on sm_90
# (entries per pipeline stage, stages, split QK^T): Q (64 KB) + the stages (+ the fp32 score
# exchange buffer when QK^T is split between the math warpgroups) must fit in 227 KB of smem.
CONFIGS = ((64, 2, False), (64, 2, True), (48, 3, False))
# QK^T is split whenever the launch has a single split (see normalize_config).
DEFAULT_CONFIG = (64, 2)
NUM_SMS = 132            # H100 SXM and H200 both have 132 SMs
MAX_GRID_Z = 65535       # tokens run along the grid's z dimension


def normalize_config(config=None, num_splits: int = 1) -> tuple[int, int, bool]:
    """``(block_n, num_stages[, qk_split])`` -> a ``CONFIGS`` entry; raises ``ValueError``
    for a configuration the kernel does not offer.

    Without ``qk_split``, QK^T is split between the math warpgroups when the launch has one
    split (many blocks per CTA: measured 2-8% faster on H200 at Pro T=64/128 and Flash
    T=128) and computed by both when it is split flash-decoding style (a few blocks per CTA:
    the duplicated, ping-ponged QK^T measured equal or up to 2% faster)."""
    config = tuple(config or DEFAULT_CONFIG)
    if len(config) not in (2, 3):
        raise ValueError(f"kernel config {config!r}: one of {CONFIGS}")
    block_n, num_stages = int(config[0]), int(config[1])
    if len(config) == 3:
        qk_split = bool(config[2])
    else:
        qk_split = num_splits == 1 and (block_n, num_stages, True) in CONFIGS
    if (block_n, num_stages, qk_split) not in CONFIGS:
        raise ValueError(f"kernel config {config!r}: one of {CONFIGS}")
    return block_n, num_stages, qk_split


def smem_bytes(block_n: int, num_stages: int, qk_split: bool) -> int:
    """Shared memory of one CTA: Q, the stages, the score exchange, barriers and validity."""
    exchange = 2 * HEAD_BLOCK * block_n * 4 if qk_split else 0
    return (HEAD_BLOCK + block_n * num_stages) * HEAD_DIM * 2 + exchange + 1024


def is_supported(*, dtype: str, head_dim: int, num_heads: int, num_tokens: int,
                 window_slots: int, pool_rows: int, extra_slots: int = 0,
                 extra_rows: int = 1) -> tuple[bool, str]:
    """Whether the kernel handles these shapes: ``(True, "")`` or ``(False, reason)``."""
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
    return True, ""


def choose_num_splits(num_tokens: int, num_heads: int, num_slots: int,
                      block_n: int = DEFAULT_CONFIG[0], num_sms: int = NUM_SMS) -> int:
    """Flash-decoding split count: the fewest splits minimising waves x blocks per split."""
    num_blocks = max(1, -(-num_slots // block_n))
    ctas = num_tokens * (num_heads // HEAD_BLOCK)
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
