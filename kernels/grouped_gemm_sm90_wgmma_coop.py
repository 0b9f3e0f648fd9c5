"""Grouped expert GEMM for prefill tiles with two math warpgroups: ``algorithm="wgmma_coop"``.

"wgmma" (``grouped_gemm_sm90_wgmma``: same launcher, schedule, conversion and epilogue) with
a CTA of 128 weight rows per matrix instead of 64: a producer warpgroup copies each K block's
raw weight bytes of the 128 rows and the tile's token rows once, and two math warpgroups
("cooperative") each convert their own 64 rows into their own A tiles and issue their own
WGMMAs against the shared token rows.

Why (docs/performance.md, "Where the prefill time goes"): in "wgmma" one math warpgroup both
converts and multiplies, and its conversion bounds the launch; ~10,000 short CTAs each pay
their start, handshakes and epilogue. Here one warpgroup's conversion runs while the other's
WGMMAs occupy the tensor cores, the CTAs halve, and each token row copied to shared memory
feeds twice the weight rows.

Dataflow per K block (384 threads; the producer gives registers to the math warpgroups with
``setmaxnreg``):

1. WG0: cp.async of 2 x 64 weight rows' raw bytes per matrix, their scale words and the
   token rows into stage ``kb % num_stages`` (an mbarrier pipeline, as "wgmma").
2. Math warpgroup w (WG1 + w): waits for the stage, converts rows [64 w, 64 w + 64) into its
   single-buffered A tiles (one per matrix), issues the WGMMAs, waits for them to retire
   (its A tiles are rewritten next) and releases the stage (both warpgroups arrive).
3. Epilogue: each warpgroup writes its 64 output features of the tile's rows.

Constraints: as "wgmma", plus output features a multiple of 128 (``grouped_gemm_config``
checks) and FP4/FP8 weights (BF16 stages do not fit shared memory with two A tiles each);
FP8 weights fit two stages of 128-row tiles, FP4 three.
"""
from __future__ import annotations

from .grouped_gemm_sm90_wgmma import GroupedGemmWgmmaSm90


class GroupedGemmWgmmaCoopSm90(GroupedGemmWgmmaSm90):
    """Static configuration of one compiled kernel (see the module docstring)."""

    MATH_WARPGROUPS = 2
