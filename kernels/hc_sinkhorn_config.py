"""``hc_split_sinkhorn`` on Hopper: the kernel's configuration and limits, no CuTe DSL.

The CuTe DSL code is ``hc_sinkhorn_sm90.py``: one thread per token, the (2 + n) n mixes, the
pre/post gates and the n x n Sinkhorn matrix in registers -- the mHC split of one sub-block
in one launch (docs/architecture.md §3.2).
"""
from __future__ import annotations

import dataclasses

MAX_STREAMS = 8          # n: registers hold (2 + n) n mixes and the n x n matrix per thread
MAX_GRID_X = 2 ** 31 - 1


def lanes_per_token(n: int) -> int:
    """Lanes per token of the shuffle dataflow: n n rounded up to a power of two, or 1 (one
    thread per token) when that exceeds a warp."""
    lanes = 1
    while lanes < n * n:
        lanes *= 2
    return lanes if lanes <= 32 else 1


@dataclasses.dataclass(frozen=True)
class HcSinkhornSm90Config:
    """One launch configuration: ``threads`` tokens per CTA (one thread each)."""
    threads: int = 128

    def __post_init__(self):
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"HcSinkhornSm90Config: threads must be a multiple of 32 in "
                             f"[32, 1024], got {self.threads}")

    def is_supported(self, *, n: int, iters: int, dtype: str, tokens: int) -> tuple[bool, str]:
        """``(True, "")`` when the kernel handles these arguments, else ``(False, reason)``."""
        if dtype != "float32":
            return False, f"mixes of dtype {dtype} (the kernel takes f32)"
        if not 1 <= n <= MAX_STREAMS:
            return False, f"n = {n} streams (the kernel takes 1 .. {MAX_STREAMS})"
        if iters < 1:
            return False, f"iters = {iters} (at least 1)"
        if tokens == 0:
            return False, "no tokens"
        if -(-tokens // self.threads) > MAX_GRID_X:
            return False, f"{tokens} tokens (more CTAs than the grid takes)"
        return True, ""


DEFAULT_CONFIG = HcSinkhornSm90Config()
