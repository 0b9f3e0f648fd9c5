"""``index_topk``'s scores on Hopper (sm_90a): the kernel's configuration, limits and launch
rule -- everything the op decides without importing CuTe DSL.

The CuTe DSL code is ``index_scores_sm90.py``: for a block of ``width`` index entries, the
ReLU-weighted head sums of every query of a chunk, written as bf16 ``[B, S, width]`` (never
``[B, S, H, width]``); the op merges blocks into its running top-k.
"""
from __future__ import annotations

import dataclasses

HEADS = 64               # index heads = the WGMMA's M: one query per warpgroup tile
DIM = 128                # index head width = the WGMMA's K
BLOCK_N = 128            # entries per pipeline stage = the WGMMA's N
MATH_WARPGROUPS = 2
# MXFP4 key rows (dsv4_jax.kv_entry): DIM / 2 code bytes, DIM / 32 E8M0 scales, padded to 8.
FP4_KEY_BYTES = 72
FP4_KEY_SCALE_OFFSET = DIM // 2
SMEM_BYTES = 227 * 1024  # per CTA on sm_90
NUM_SMS = 132            # H100 SXM and H200
MAX_GRID_Y = 65535
MAX_GRID_Z = 65535
# The top-k kernel (``index_topk_sm90.py``): one CTA of TOPK_THREADS per row; its bitonic
# sort gives each thread one compare-exchange per stage, so k <= 2 x TOPK_THREADS.
TOPK_THREADS = 512
MAX_TOPK = 2 * TOPK_THREADS
# The split top-k (``index_topk_split_sm90.py``, a decode step's few long rows): each row in
# segments of SPLIT_SEGMENT entries, one CTA each; its last CTA per row scans two segments'
# tie counts a thread.
SPLIT_SEGMENT = 2048
MAX_SEGMENTS = 2 * TOPK_THREADS
# CTAs a launch aims for when its queries alone give fewer (decode: a few queries against
# many entries): the entries are split among CTAs so that every SM streams keys.
TARGET_CTAS = 2 * NUM_SMS


@dataclasses.dataclass(frozen=True)
class IndexScoresSm90Config:
    """One launch configuration: ``tokens_per_warpgroup`` queries per math warpgroup (a CTA
    holds 2 x that many queries' Q tiles and reads each key block once for all of them) and
    ``num_stages`` key blocks in flight; ``skip_invisible``: a CTA loads and multiplies only
    the key blocks that start below its queries' largest visible count and writes -inf for
    the rest (a short context in a long table, the causal part of a prefill chunk), instead
    of masking every block it is given; ``split_n`` (with one token per warpgroup): both
    math warpgroups take the same query, each half of every key block (a decode row has one
    query: the second warpgroup would otherwise multiply a copy of it for nothing). A
    combination that does not fit raises ``ValueError``."""
    tokens_per_warpgroup: int = 2
    num_stages: int = 3
    skip_invisible: bool = False
    split_n: bool = False

    def __post_init__(self):
        if self.tokens_per_warpgroup not in (1, 2):
            raise ValueError(f"IndexScoresSm90Config: tokens_per_warpgroup must be 1 or 2, got "
                             f"{self.tokens_per_warpgroup}")
        if self.split_n and self.tokens_per_warpgroup != 1:
            raise ValueError(f"IndexScoresSm90Config: split_n needs tokens_per_warpgroup 1, got "
                             f"{self.tokens_per_warpgroup}")
        if not 2 <= self.num_stages <= 4:
            raise ValueError(f"IndexScoresSm90Config: num_stages must be in [2, 4], got "
                             f"{self.num_stages}")
        if self.smem_bytes() > SMEM_BYTES:
            raise ValueError(f"IndexScoresSm90Config: {self} needs {self.smem_bytes()} bytes of "
                             f"shared memory, more than {SMEM_BYTES}")

    @property
    def tokens_per_cta(self) -> int:
        return 1 if self.split_n else MATH_WARPGROUPS * self.tokens_per_warpgroup

    @property
    def n_tile(self) -> int:
        """Entries of a key block one math warpgroup multiplies (its WGMMA's N)."""
        return BLOCK_N // 2 if self.split_n else BLOCK_N

    def smem_bytes(self) -> int:
        """Q tiles + key stages + the head-sum exchange (2 buffers per math warpgroup and
        query, 4 warps x BLOCK_N f32) + barriers."""
        q = self.tokens_per_cta * HEADS * DIM * 2
        keys = self.num_stages * BLOCK_N * DIM * 2
        exchange = MATH_WARPGROUPS * 2 * self.tokens_per_warpgroup * 4 * BLOCK_N * 4
        return q + keys + exchange + 16 * self.num_stages + 2048   # alignment slack

    def grid(self, batch: int, tokens: int, width: int) -> tuple[int, int, int]:
        """(query groups, entry splits, batch rows): the entries are split when the queries
        give fewer than ``TARGET_CTAS`` CTAs, each split a whole number of blocks."""
        groups = -(-tokens // self.tokens_per_cta)
        blocks = -(-width // BLOCK_N)
        splits = max(1, min(blocks, -(-TARGET_CTAS // (groups * batch)), MAX_GRID_Y))
        return groups, splits, batch

    def is_supported(self, *, heads: int, dim: int, dtype: str, key_dtype: str, batch: int,
                     tokens: int, entries: int, width: int,
                     key_row_bytes: int | None = None) -> tuple[bool, str]:
        """``(True, "")`` when the kernel handles these arguments, else ``(False, reason)``.
        ``key_row_bytes``: the width of uint8 key rows (MXFP4, ``FP4_KEY_BYTES``)."""
        if heads != HEADS or dim != DIM:
            return False, f"{heads} heads of width {dim} (the kernel takes {HEADS} x {DIM})"
        if key_dtype == "uint8":
            if key_row_bytes != FP4_KEY_BYTES:
                return False, (f"uint8 key rows of {key_row_bytes} bytes (MXFP4 rows are "
                               f"{FP4_KEY_BYTES})")
        elif key_dtype != "bfloat16":
            return False, f"keys {key_dtype} (the kernel takes bfloat16 or MXFP4 rows)"
        if dtype != "bfloat16":
            return False, f"q {dtype} (the kernel takes bfloat16)"
        if entries < 1 or tokens < 1 or width < 1:
            return False, "an empty query set or entry table"
        if batch > MAX_GRID_Z or -(-tokens // self.tokens_per_cta) > 2 ** 31 - 1:
            return False, f"batch {batch} x {tokens} queries (more CTAs than the grid takes)"
        if batch * tokens * HEADS * DIM >= 2 ** 31 or batch * entries * DIM >= 2 ** 31:
            return False, "q or the key table has 2^31 elements or more (32-bit indexing)"
        return True, ""


# Skipping invisible blocks costs nothing when every block is visible (docs/performance.md,
# "The score kernel's decode configuration"), so every chosen config skips.
DEFAULT_CONFIG = IndexScoresSm90Config(skip_invisible=True)
# A row of two queries (a speculative step) fills only one query slot of a (2, 3) CTA per
# warpgroup: one slot and two stages leave the smem that lets two CTAs share an SM, which
# streams the keys faster (same section).
PAIR_CONFIG = IndexScoresSm90Config(tokens_per_warpgroup=1, num_stages=2, skip_invisible=True)
# A row of one query (a decode step): both math warpgroups take it, each half of every block.
DECODE_CONFIG = IndexScoresSm90Config(tokens_per_warpgroup=1, num_stages=2, skip_invisible=True,
                                      split_n=True)


def choose_config(tokens: int) -> IndexScoresSm90Config:
    """The launch configuration for rows of ``tokens`` queries."""
    if tokens == 1:
        return DECODE_CONFIG
    return PAIR_CONFIG if tokens <= PAIR_CONFIG.tokens_per_cta else DEFAULT_CONFIG
