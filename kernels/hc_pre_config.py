"""``hc_pre`` on Hopper: the fused mHC-pre kernel's configuration and limits, no CuTe DSL.

The CuTe DSL code is ``hc_pre_sm90.py``: one cluster of ``cluster`` CTAs per group of up to
``tokens_per_cluster`` tokens computes the stream mixes, the mHC split, the collapse of the
streams and the sub-block's RMSNorm in one launch (docs/architecture.md §3.2).
"""
from __future__ import annotations

import dataclasses

from .hc_sinkhorn_config import lanes_per_token

THREADS = 256
CLUSTERS = (1, 2, 4, 8, 16)     # 16: a non-portable size (CuTe DSL allows it on every kernel)
MAX_TOKENS_PER_CLUSTER = 4
# With a pending hc_post each token's pass also loads the n streams and the sub-block output
# to form the updated streams: at most 2 tokens per cluster keep that in registers.
MAX_TOKENS_PER_CLUSTER_PENDING = 2
# Per token and thread: (2 + n) n mix sums and one sum of squares stay in registers through
# the K loop, next to the 24 float4 mixing-weight loads in flight.
MAX_SUMS_PER_THREAD = 128
# Above this many tokens the stream mixes are a real GEMM (each cluster re-reads the f32
# mixing weights): XLA's dot and the split kernel run instead (docs/performance.md).
MAX_TOKENS = 128
# CTAs a launch aims at (``choose_config``): the swept best at 1 to 128 tokens
# (docs/performance.md); a token's latency chain, not bandwidth, bounds small launches.
TARGET_CTAS = 64
# A pending out given as its parts (``ffi.ffn_sum.FfnSum``): the routed rows per token each
# thread adds per 4-column unit (their loads are issued together).
MAX_SUMMED_ROWS = 16


@dataclasses.dataclass(frozen=True)
class HcPreSm90Config:
    """One launch configuration: ``cluster`` CTAs split each token's K = n d mix sums and
    d columns; each cluster takes ``tokens_per_cluster`` tokens. ``split_apart``: the kernel
    stores the mixes and the split (post, comb) is a launch of its own (``hc_split_sinkhorn``)
    that only the next sub-block's mHC pre waits for -- its Sinkhorn chain, the tail of the
    fused launch, is then off a decode step's critical path (concurrent commands run it
    beside the sub-block); False: the split runs inside, on the last warps."""
    cluster: int = 8
    tokens_per_cluster: int = MAX_TOKENS_PER_CLUSTER
    split_apart: bool = False

    def __post_init__(self):
        if self.cluster not in CLUSTERS:
            raise ValueError(f"HcPreSm90Config: cluster must be one of {CLUSTERS}, got "
                             f"{self.cluster}")
        if not 1 <= self.tokens_per_cluster <= MAX_TOKENS_PER_CLUSTER:
            raise ValueError(f"HcPreSm90Config: tokens_per_cluster must be in [1, "
                             f"{MAX_TOKENS_PER_CLUSTER}], got {self.tokens_per_cluster}")
        if not isinstance(self.split_apart, bool):
            raise TypeError(f"HcPreSm90Config: split_apart must be a bool, got "
                            f"{type(self.split_apart).__name__}")

    def tokens_for(self, tokens: int) -> int:
        """Tokens per cluster of a launch over ``tokens`` (no more than there are)."""
        return max(1, min(self.tokens_per_cluster, tokens))

    def is_supported(self, *, n: int, dim: int, tokens: int, x_dtype: str, fn_dtype: str,
                     weight_dtype: str, pending: bool = False) -> tuple[bool, str]:
        """``(True, "")`` when the kernel handles these arguments (``pending``: with the
        previous sub-block's hc_post), else ``(False, reason)``."""
        if pending and self.tokens_per_cluster > MAX_TOKENS_PER_CLUSTER_PENDING:
            return False, (f"tokens_per_cluster = {self.tokens_per_cluster} with a pending "
                           f"hc_post (at most {MAX_TOKENS_PER_CLUSTER_PENDING})")
        if x_dtype != "bfloat16" or weight_dtype != "bfloat16":
            return False, f"x of dtype {x_dtype} and norm weight {weight_dtype} (takes bf16)"
        if fn_dtype != "float32":
            return False, f"fn of dtype {fn_dtype} (takes f32)"
        if lanes_per_token(n) == 1:
            return False, f"n = {n} streams (the split runs on n n <= 32 lanes)"
        if dim % (4 * self.cluster):
            return False, f"dim = {dim} (a multiple of 4 x cluster = {4 * self.cluster})"
        if not 1 <= tokens <= MAX_TOKENS:
            return False, f"{tokens} tokens (the kernel takes 1 .. {MAX_TOKENS})"
        sums = self.tokens_for(tokens) * ((2 + n) * n + 1)
        if sums > MAX_SUMS_PER_THREAD:
            return False, f"{sums} sums per thread (at most {MAX_SUMS_PER_THREAD})"
        return True, ""


def choose_config(tokens: int, dim: int, pending: bool = False) -> HcPreSm90Config:
    """The launch for ``tokens`` rows of width ``dim``: groups of 4 tokens (2 with a pending
    hc_post), clusters as large as ``TARGET_CTAS`` over the groups allows (at least 2, at
    most 16) that divide the columns in 4-column units; the split apart when the tokens
    are one group (one cluster, whose Sinkhorn tail would end the launch: a batch-1 step
    is faster with it apart, a batch-8 one slower, docs/performance.md)."""
    per = MAX_TOKENS_PER_CLUSTER_PENDING if pending else MAX_TOKENS_PER_CLUSTER
    groups = -(-max(tokens, 1) // per)
    apart = groups == 1
    fitting = [c for c in CLUSTERS if dim % (4 * c) == 0]
    if not fitting:
        return HcPreSm90Config(1, per, apart)
    aim = max(2, TARGET_CTAS // groups)
    return HcPreSm90Config(max([c for c in fitting if c <= aim] or fitting[:1]), per, apart)
