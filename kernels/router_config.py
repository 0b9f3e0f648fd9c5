"""``moe_router`` on Hopper: the router kernel's configuration and limits, no CuTe DSL.

The CuTe DSL code is ``router_sm90.py``: one cluster of ``cluster`` CTAs per group of up to
``tokens_per_cluster`` tokens; CTA r computes the logits of experts [r E / C, (r + 1) E / C)
over the whole row, and CTA 0 chooses each token's experts from all of them (docs/
architecture.md §3.7).
"""
from __future__ import annotations

import dataclasses

THREADS = 256
CLUSTERS = (1, 2, 4, 8, 16)     # 16: a non-portable size (CuTe DSL allows it on every kernel)
MAX_TOKENS_PER_CLUSTER = 4
# Per thread: the logits' partial sums of a CTA's experts x its tokens stay in registers
# next to up to MAX_WEIGHT_LOADS 16-byte weight loads in flight: a launch at decode streams
# 1/C of the weight per SM, and its time is the bytes each SM has in flight
# (docs/performance.md).
MAX_SUMS_PER_THREAD = 32
MAX_WEIGHT_LOADS = 32
# The top-k runs one warp per token with the experts dealt over its lanes.
MAX_EXPERTS = 32 * 16
MAX_K = 32
# Above this many tokens the gate is a real GEMM (each cluster re-reads the weight): XLA's
# dot and sort run instead (docs/performance.md).
MAX_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class RouterSm90Config:
    """One launch configuration: ``cluster`` CTAs split the experts; each cluster takes
    ``tokens_per_cluster`` tokens."""
    cluster: int = 16
    tokens_per_cluster: int = 2

    def __post_init__(self):
        if self.cluster not in CLUSTERS:
            raise ValueError(f"RouterSm90Config: cluster must be one of {CLUSTERS}, got "
                             f"{self.cluster}")
        if not 1 <= self.tokens_per_cluster <= MAX_TOKENS_PER_CLUSTER:
            raise ValueError(f"RouterSm90Config: tokens_per_cluster must be in [1, "
                             f"{MAX_TOKENS_PER_CLUSTER}], got {self.tokens_per_cluster}")

    def tokens_for(self, tokens: int) -> int:
        """Tokens per cluster of a launch over ``tokens`` (no more than there are)."""
        return max(1, min(self.tokens_per_cluster, tokens))

    def is_supported(self, *, experts: int, dim: int, tokens: int, k: int, x_dtype: str,
                     weight_dtype: str) -> tuple[bool, str]:
        """``(True, "")`` when the kernel handles these arguments, else ``(False, reason)``."""
        if x_dtype != "bfloat16" or weight_dtype != "bfloat16":
            return False, f"x of dtype {x_dtype} and weight {weight_dtype} (takes bf16)"
        if experts % self.cluster:
            return False, f"E = {experts} experts (a multiple of the cluster, {self.cluster})"
        if experts > MAX_EXPERTS:
            return False, f"E = {experts} experts (at most {MAX_EXPERTS})"
        if k > MAX_K:
            return False, f"k = {k} (at most {MAX_K})"
        if dim % 8:
            return False, f"dim = {dim} (a multiple of 8)"
        if not 1 <= tokens <= MAX_TOKENS:
            return False, f"{tokens} tokens (the kernel takes 1 .. {MAX_TOKENS})"
        sums = self.tokens_for(tokens) * (experts // self.cluster)
        if sums > MAX_SUMS_PER_THREAD:
            return False, f"{sums} sums per thread (at most {MAX_SUMS_PER_THREAD})"
        loads = -(-dim // (8 * THREADS)) * (experts // self.cluster)
        if loads > MAX_WEIGHT_LOADS:
            return False, (f"{loads} weight loads per thread (E / C = "
                           f"{experts // self.cluster} experts x the row's passes; at most "
                           f"{MAX_WEIGHT_LOADS} in flight: slower than XLA's dot)")
        return True, ""


def choose_config(tokens: int, experts: int) -> RouterSm90Config:
    """The launch for ``tokens`` rows over ``experts``: the largest cluster that divides the
    experts (most CTAs streaming the weight), and as many tokens per cluster as the
    per-thread sums allow (each cluster reads the whole weight)."""
    cluster = max([c for c in CLUSTERS if experts % c == 0])
    per_cta = experts // cluster
    per_cluster = max(1, min(MAX_TOKENS_PER_CLUSTER, MAX_SUMS_PER_THREAD // per_cta))
    return RouterSm90Config(cluster, per_cluster)
