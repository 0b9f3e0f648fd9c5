"""``hc_stream_mixes`` on Hopper: the prefill stream-mix kernel's configuration and limits,
no CuTe DSL.

The CuTe DSL code is ``hc_mixes_sm90.py``: each warp takes ``tiles`` x 16 rows of the
flattened streams and one K slice, and runs the mixes as warp-level bf16 tensor-core MMAs
against fn split into three bf16 parts in registers; the slices' partial sums go out as
``[slices, rows, MIX_COLUMNS]`` f32 and one XLA fusion adds them (docs/performance.md).
"""
from __future__ import annotations

import dataclasses

WARPS = 4                       # per CTA (128 threads)
CHUNK = 64                      # K columns per lane pass: 16 per lane, 4 MMA steps
MIX_COLUMNS = 32                # per row and slice: the mixes, the sum of squares, padding
MAX_MIXES = MIX_COLUMNS - 8     # n-tiles of 8 mixes; column MAX_MIXES.. holds the squares
TILES = (1, 2, 4)               # 16-row MMA tiles per warp
# CTAs of one full wave on an H100/H200 (132 SMs, 2 CTAs of 128 threads each: a lane holds
# two chunks' loads and the chunk's sums, over 168 registers): slices are doubled while the
# grid stays within it, so that no second, partial wave ends the launch.
RESIDENT_CTAS = 2 * 132
MIN_CHUNKS_PER_SLICE = 4


@dataclasses.dataclass(frozen=True)
class HcMixesSm90Config:
    """One launch configuration: ``tiles`` 16-row MMA tiles per warp (WARPS warps, so
    ``WARPS * 16 * tiles`` rows per CTA) and ``slices`` K slices (grid y), each a whole
    number of CHUNK columns."""
    tiles: int = 2
    slices: int = 8

    def __post_init__(self):
        if self.tiles not in TILES:
            raise ValueError(f"HcMixesSm90Config: tiles must be one of {TILES}, got "
                             f"{self.tiles}")
        if not isinstance(self.slices, int) or self.slices < 1:
            raise ValueError(f"HcMixesSm90Config: slices must be a positive int, got "
                             f"{self.slices!r}")

    @property
    def rows_per_cta(self) -> int:
        return WARPS * 16 * self.tiles

    def is_supported(self, *, rows: int, k: int, mixes: int, x_dtype: str,
                     fn_dtype: str) -> tuple[bool, str]:
        """``(True, "")`` when the kernel handles these arguments, else ``(False, reason)``."""
        if x_dtype != "bfloat16":
            return False, f"x of dtype {x_dtype} (the kernel takes bf16)"
        if fn_dtype != "float32":
            return False, f"fn of dtype {fn_dtype} (the kernel takes f32)"
        if mixes % 8 or not 8 <= mixes <= MAX_MIXES:
            return False, f"{mixes} mixes (a multiple of 8, at most {MAX_MIXES})"
        if k % (CHUNK * self.slices):
            return False, (f"n d = {k} columns (a multiple of {CHUNK} x slices = "
                           f"{CHUNK * self.slices})")
        if rows < 1:
            return False, "no rows"
        if rows * k >= 2 ** 31:
            return False, f"{rows} x {k} elements (32-bit element offsets)"
        return True, ""


def choose_config(rows: int, k: int) -> HcMixesSm90Config:
    """Two tiles per warp; slices doubled while the grid stays within ``RESIDENT_CTAS`` and
    each slice keeps at least ``MIN_CHUNKS_PER_SLICE`` chunks (and divides K)."""
    config = HcMixesSm90Config()
    blocks = -(-max(rows, 1) // config.rows_per_cta)
    slices = 1
    while (blocks * slices * 2 <= RESIDENT_CTAS and k % (CHUNK * slices * 2) == 0
           and k // (CHUNK * slices * 2) >= MIN_CHUNKS_PER_SLICE):
        slices *= 2
    return dataclasses.replace(config, slices=slices)
