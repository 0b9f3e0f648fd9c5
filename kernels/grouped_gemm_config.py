"""The grouped GEMM's kernels, their launch configurations and limits; no cutlass.

One op (``ffi/grouped_gemm.py``) multiplies row tiles, sorted by group, by their group's
weight matrix; the routed experts (a group = an expert) and the dense linears (one group)
run it. Four kernels compute it behind one launcher (``grouped_gemm_sm90_launch``), all with
the same arguments and outputs; ``KERNELS`` is their table:

| algorithm | file | tiles | what it does |
|---|---|---|---|
| ``"wgmma"`` | ``grouped_gemm_sm90_wgmma`` | prefill (and decode on request) | cp.async producer warpgroup, weights dequantised into a shared-memory A tile, WGMMA |
| ``"wgmma_fp8"`` | ``grouped_gemm_sm90_wgmma_fp8`` | prefill | "wgmma" on FP8 WGMMAs, FP4 scales folded into e4m3 codes |
| ``"wgmma_coop"`` | ``grouped_gemm_sm90_wgmma_coop`` | prefill | "wgmma" with 128 weight rows per CTA, two math warpgroups converting and multiplying 64 each |
| ``"wgmma_fp8_coop"`` | ``grouped_gemm_sm90_wgmma_fp8_coop`` | prefill | "wgmma_fp8" with the CTA of "wgmma_coop": the two math warpgroups convert (FP4 fold; FP8 weights are copied into the A tiles as they are) and run FP8 WGMMAs |
| ``"mma_sync"`` | ``grouped_gemm_sm90_mma_sync`` | decode (8 rows) | every warp streams 16 weight rows, converts them in registers, warp-level bf16 MMAs |
| ``"mma_fp8"`` | ``grouped_gemm_sm90_mma_fp8`` | decode (8 rows) | "mma_sync" on FP8 tensor cores (``mma.sync`` e4m3) |
| ``"wgmma_rs"`` | ``grouped_gemm_sm90_wgmma_rs`` | decode (8 rows) | "mma_fp8" on warpgroup FP8 MMAs (weights as register A operands, tokens by descriptor) |
| ``"mma_fp8_stream"`` | ``grouped_gemm_sm90_mma_fp8_stream`` | decode (8 rows) | "mma_fp8" with the weights loaded straight into registers (no shared-memory ring, no barrier per K block) |

The FP8 kernels multiply the activations as e4m3 codes and per-(row, 128 columns) scales
(``quant.act_quant``), so they need FP4/FP8 weights and the FP8 activation simulation;
"mma_fp8" and "wgmma_rs" quantise the bf16 rows themselves, the others take the codes.
Measurements of each (and the crossovers ``choose_config`` uses): docs/performance.md.

The tile geometry and the warp kernels' shared-memory layouts and lane mappings are
``grouped_gemm_layout``'s. The JAX side consults ``GroupedGemmSm90Config.is_supported``
before it imports CuTe DSL.
"""
from __future__ import annotations

import dataclasses

from .grouped_gemm_layout import (BLOCK_K, BLOCK_M, ROW_BYTES, STREAM_CHUNK_BLOCKS,
                                  STREAM_KBLOCK_BYTES, WARP_TOKENS, WEIGHT_LAYOUTS,
                                  fp8_warp_smem_bytes, warp_scale_group, warp_smem_bytes)

WEIGHT_FORMATS = ("fp4", "fp8", "bf16")     # quant.WeightFormat names the kernels read
SMEM_BYTES = 227 * 1024  # per CTA on sm_90
PDL_MODES = ("", "start", "weights")     # GroupedGemmSm90Config.pdl
MAX_GRID_Y = 65535
MAX_SPLIT_K = 8          # the splits of a tile are one cluster (portable size: 8)
FP8_WGMMA_MAX_BLOCK_N = 64     # registers: 2 x 2 block accumulators + 2 accumulators
# "mma_fp8" quantises its bf16 token rows into stages of codes + scales: two by default (one
# K block ahead), up to MAX_TOKEN_STAGES (``GroupedGemmSm90Config.token_stages``).
FP8_TOKEN_BUFFERS = 2
MAX_TOKEN_STAGES = 8
# FP4 -> bf16 byte lookup tables for ``prmt`` (bytes 0-3 in the first word, 4-7 in the
# second): high and low bytes of the bf16 values of the e2m1 magnitudes 0, .5, 1, 1.5, 2, 3,
# 4, 6 (e.g. 1.5 = 0x3FC0). tests/test_kernels_grouped_gemm_sm90.py replays the permutes.
FP4_BF16_HI = (0x3F3F3F00, 0x40404040)
FP4_BF16_LO = (0xC0800000, 0xC0804000)
# FP8 -> bf16: e4m3 bits << 4 are a bf16 with value x 2^-120; bf16 bits of 2^120.
BF16_2POW120 = 0x7B80


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One kernel of the family: what it takes and which test hooks it offers.

    module / class_name: where the CuTe DSL class lives (``kernels/<module>.py``).
    tiles: ``"decode"`` (8-row tiles only) or ``"any"`` (block_n a multiple of 8).
    fp8_activations: multiplies FP8-quantised activations (``quant.act_quant``: the FP8
      simulation must be on): e4m3 token codes + f32 scales instead of bf16 rows, unless
      ``quantizes_tokens``.
    weight_formats: the ``quant.WeightFormat`` names it reads.
    max_block_n: the largest tile of token rows (gated launch) its registers allow.
    split_k: offers the K split (grid z, one cluster per tile that adds its sums).
    ablations: benchmark-only stages it can leave out (``GroupedGemmSm90Config.ablation``,
      several joined by "+"); outputs are then wrong by design.
    min_stages: the least ``num_stages`` (a ring needs two stages; "mma_fp8_stream" reads it
      as K blocks per batch of register loads, so one will do).
    quantizes_tokens: takes the bf16 rows and quantises them itself (the official 1 x 128
      blocks, exactly ``quant.act_quant``), so no XLA launch quantises them first.
    max_row_blocks: the most ``GroupedGemmSm90Config.row_blocks`` (64-row output blocks per
      CTA of an ungated launch) it takes.
    """
    algorithm: str
    module: str
    class_name: str
    tiles: str
    fp8_activations: bool
    weight_formats: tuple[str, ...]
    max_block_n: int
    split_k: bool
    ablations: tuple[str, ...]
    min_stages: int = 2
    quantizes_tokens: bool = False
    max_row_blocks: int = 1


KERNELS = {spec.algorithm: spec for spec in (
    KernelSpec("wgmma", "grouped_gemm_sm90_wgmma", "GroupedGemmWgmmaSm90", "any", False,
               WEIGHT_FORMATS, 128, False,
               ("no_load", "no_token_load", "no_dequant", "no_mma")),
    KernelSpec("mma_sync", "grouped_gemm_sm90_mma_sync", "GroupedGemmMmaSyncSm90", "decode",
               False, WEIGHT_FORMATS, WARP_TOKENS, True,
               ("no_load", "no_token_load", "no_scale_load", "no_dequant", "no_mma",
                "no_reduce", "no_cluster", "no_barrier")),
    KernelSpec("mma_fp8", "grouped_gemm_sm90_mma_fp8", "GroupedGemmMmaFp8Sm90", "decode",
               True, ("fp4", "fp8"), WARP_TOKENS, True,
               ("no_load", "no_scale_load", "no_dequant", "no_mma", "no_quant", "no_reduce",
                "no_cluster", "no_barrier"),
               quantizes_tokens=True, max_row_blocks=2),
    KernelSpec("wgmma_rs", "grouped_gemm_sm90_wgmma_rs", "GroupedGemmWgmmaRsSm90", "decode",
               True, ("fp4", "fp8"), WARP_TOKENS, True,
               ("no_load", "no_scale_load", "no_dequant", "no_mma", "no_quant", "no_reduce",
                "no_cluster", "no_barrier"),
               quantizes_tokens=True, max_row_blocks=2),
    KernelSpec("mma_fp8_stream", "grouped_gemm_sm90_mma_fp8_stream",
               "GroupedGemmMmaFp8StreamSm90", "decode", True, ("fp4", "fp8"), WARP_TOKENS, True,
               ("no_load", "no_mma"), min_stages=1),
    KernelSpec("wgmma_fp8", "grouped_gemm_sm90_wgmma_fp8", "GroupedGemmWgmmaFp8Sm90", "any",
               True, ("fp4", "fp8"), FP8_WGMMA_MAX_BLOCK_N, False, ("no_dequant", "no_mma")),
    KernelSpec("wgmma_coop", "grouped_gemm_sm90_wgmma_coop", "GroupedGemmWgmmaCoopSm90", "any",
               False, ("fp4", "fp8"), 128, False,
               ("no_load", "no_token_load", "no_dequant", "no_mma")),
    KernelSpec("wgmma_fp8_coop", "grouped_gemm_sm90_wgmma_fp8_coop",
               "GroupedGemmWgmmaFp8CoopSm90", "any", True, ("fp4", "fp8"), 128, False,
               ("no_dequant", "no_mma")),
)}
# The warp kernels that take ``interleaved_split`` ("mma_fp8_stream" has a loop of its own).
INTERLEAVED_SPLIT_ALGORITHMS = ("mma_sync", "mma_fp8", "wgmma_rs")
# The FP8 WGMMA kernels: token codes + scales, an even number of K blocks (two chains per
# iteration), block_n <= their spec's max_block_n (registers).
FP8_WGMMA_ALGORITHMS = ("wgmma_fp8", "wgmma_fp8_coop")
# Two math warpgroups of BLOCK_M rows each: output features a multiple of COOP_ROWS.
COOP_ALGORITHMS = ("wgmma_coop", "wgmma_fp8_coop")
# "wgmma_coop": weight rows per CTA and matrix (two math warpgroups of BLOCK_M).
COOP_ROWS = 2 * BLOCK_M
ALGORITHMS = tuple(KERNELS)
WARP_ALGORITHMS = tuple(a for a, s in KERNELS.items() if s.tiles == "decode")
PREFILL_ALGORITHMS = tuple(a for a, s in KERNELS.items() if s.tiles == "any")
# Algorithms that multiply FP8-quantised activations (they need the FP8 simulation), and
# those of them that take e4m3 token codes + per-128 scales (quant.act_quant), not bf16 rows.
FP8_ACTIVATION_ALGORITHMS = tuple(a for a, s in KERNELS.items() if s.fp8_activations)
FP8_CODE_ALGORITHMS = tuple(a for a, s in KERNELS.items()
                            if s.fp8_activations and not s.quantizes_tokens)


@dataclasses.dataclass(frozen=True)
class GroupedGemmSm90Config:
    """One compiled variant of the grouped GEMM (validated against its ``KernelSpec``).

    block_n: token rows per tile (the MMA's N; a multiple of 8, at most 256).
    num_stages: depth of the copy pipeline of raw weight bytes + token rows.
    algorithm: the kernel (``KERNELS``).
    split_k: K split over this many CTAs per tile (grid z, one cluster), which add their f32
      sums in distributed shared memory before the epilogue; kernels with
      ``KernelSpec.split_k``.
    ablation: benchmark-only stages left out, joined by "+" (the spec's ``ablations``);
      the outputs are then wrong by design.
    token_stages: shared-memory stages of quantised token blocks, for the kernels that
      quantise their tokens (``KernelSpec.quantizes_tokens``): the first
      ``token_stages - 1`` K blocks of a CTA's range are quantised before its K loop, each
      later one that many blocks ahead of its MMAs. 2 elsewhere.
    pdl: programmatic dependent launch of the warp kernels (``choose_config(pdl=True)``):
      "" off; "start" the launch may begin while the previous kernel ends and waits for it
      (``griddepcontrol.wait``) before reading anything; "weights" ("mma_fp8") it issues its
      first stages' weight and scale copies before that wait -- only where the tile arrays
      are not written by the kernel just before (dense linears: constants). Every launch
      lets the next one begin at its own start (``griddepcontrol.launch_dependents``).
    token_codes: a kernel that quantises its tokens ("mma_fp8", "wgmma_rs") takes them
      quantised instead -- e4m3 codes and their f32 scales (``quant.act_quant``'s, the codes
      it would make) -- and only copies them into its stages: for rows that XLA gathers
      before the launch anyway, where the quantisation joins the gather, while every CTA of
      the launch would quantise the same rows again (``GroupedGemmPolicy.token_codes``).
    row_norm_eps: a kernel that quantises its tokens first normalises each bf16 row --
      ``rms_norm(x, w, eps)``'s output, ``w`` the norm weight the launch takes in the token
      scales' place -- so that a linear after an RMSNorm needs no launch for the norm
      (``grouped_gemm(row_norm=)``); None: the rows as they come.
    row_blocks: 64-row output blocks per CTA of an ungated launch (paired: both weights in
      whole such blocks) of a kernel with ``KernelSpec.max_row_blocks`` > 1: with 2 each
      warp streams 16 rows of both blocks, as a gated launch streams its two matrices, so
      that the token operand, the K loop and its addresses are paid once for twice the
      weight bytes (fewer instructions per byte, but slower where measured: opt-in,
      docs/performance.md, thirty-sixth session).
    interleaved_split: a K split's CTA z reads K blocks z, z + split_k, z + 2 split_k, ...
      instead of one contiguous range (``INTERLEAVED_SPLIT_ALGORITHMS``, FP4 weights, K
      blocks a multiple of split_k x the scale group): the cluster's CTAs then read the
      neighbouring 64-byte halves of each FP4 row's 128-byte lines at about the same time,
      which DRAM serves faster than lines read half by half a K block apart
      (docs/performance.md, thirty-seventh session). The sums are the same, in the same
      order per CTA.
    weight_layout: how the weight bytes lie in HBM (``grouped_gemm_layout.WEIGHT_LAYOUTS``):
      "rows", or "blocked" -- packed FP4 in contiguous 64-row x K-block tiles
      (``grouped_gemm_layout.weight_offset``); every kernel reads both. Not chosen by
      ``choose_config``: the op sets it from the weights it is given.
    """
    block_n: int = 8
    num_stages: int = 8
    algorithm: str = "wgmma"
    split_k: int = 1
    ablation: str = ""
    token_stages: int = FP8_TOKEN_BUFFERS
    pdl: str = ""
    token_codes: bool = False
    row_norm_eps: float | None = None
    row_blocks: int = 1
    interleaved_split: bool = False
    weight_layout: str = "rows"

    def __post_init__(self):
        if self.algorithm not in KERNELS:
            raise ValueError(f"GroupedGemmSm90Config: algorithm must be one of {ALGORITHMS}, "
                             f"got {self.algorithm!r}")
        spec = KERNELS[self.algorithm]
        if self.block_n % 8 or not 8 <= self.block_n <= 256:
            raise ValueError(f"GroupedGemmSm90Config: block_n must be a multiple of 8 in "
                             f"[8, 256], got {self.block_n}")
        if spec.tiles == "decode" and self.block_n != WARP_TOKENS:
            raise ValueError(f"GroupedGemmSm90Config: algorithm {self.algorithm!r} takes "
                             f"block_n {WARP_TOKENS}, got {self.block_n}")
        if self.algorithm in FP8_WGMMA_ALGORITHMS and self.block_n > spec.max_block_n:
            raise ValueError(f"GroupedGemmSm90Config: algorithm {self.algorithm!r} takes "
                             f"block_n <= {spec.max_block_n}, got {self.block_n}")
        if self.num_stages < spec.min_stages:
            raise ValueError(f"GroupedGemmSm90Config: num_stages must be >= "
                             f"{spec.min_stages} for {self.algorithm!r}, got {self.num_stages}")
        if not 1 <= self.split_k <= MAX_SPLIT_K or (self.split_k > 1 and not spec.split_k):
            raise ValueError(f"GroupedGemmSm90Config: split_k must be in [1, {MAX_SPLIT_K}], "
                             f"and 1 unless the algorithm is one of {WARP_ALGORITHMS}; got "
                             f"{self.split_k} with {self.algorithm!r}")
        if not 2 <= self.token_stages <= MAX_TOKEN_STAGES or (
                self.token_stages != FP8_TOKEN_BUFFERS and not spec.quantizes_tokens):
            raise ValueError(f"GroupedGemmSm90Config: token_stages must be in [2, "
                             f"{MAX_TOKEN_STAGES}], and {FP8_TOKEN_BUFFERS} unless the "
                             f"algorithm quantises its tokens; got {self.token_stages} with "
                             f"{self.algorithm!r}")
        if self.pdl not in PDL_MODES or (self.pdl and spec.tiles != "decode") or (
                self.pdl == "weights" and not spec.quantizes_tokens):
            raise ValueError(f"GroupedGemmSm90Config: pdl must be one of {PDL_MODES} "
                             f"(a warp kernel's; 'weights' with 'mma_fp8' or 'wgmma_rs' "
                             f"only), got {self.pdl!r} with {self.algorithm!r}")
        if not isinstance(self.token_codes, bool) or (self.token_codes
                                                      and not spec.quantizes_tokens):
            raise ValueError(f"GroupedGemmSm90Config: token_codes must be a bool, and False "
                             f"unless the algorithm quantises its tokens; got "
                             f"{self.token_codes!r} with {self.algorithm!r}")
        if self.row_norm_eps is not None and (
                not isinstance(self.row_norm_eps, float) or not self.row_norm_eps >= 0.0
                or not spec.quantizes_tokens or self.token_codes):
            raise ValueError(f"GroupedGemmSm90Config: row_norm_eps must be None or a float "
                             f">= 0 with an algorithm that quantises its tokens (not "
                             f"token_codes); got {self.row_norm_eps!r} with "
                             f"{self.algorithm!r}, token_codes {self.token_codes}")
        if (isinstance(self.row_blocks, bool) or not isinstance(self.row_blocks, int)
                or not 1 <= self.row_blocks <= spec.max_row_blocks):
            raise ValueError(f"GroupedGemmSm90Config: row_blocks must be an int in [1, "
                             f"{spec.max_row_blocks}] for {self.algorithm!r}, got "
                             f"{self.row_blocks!r}")
        if not isinstance(self.interleaved_split, bool) or (
                self.interleaved_split and self.algorithm not in INTERLEAVED_SPLIT_ALGORITHMS):
            raise ValueError(f"GroupedGemmSm90Config: interleaved_split must be a bool, and "
                             f"False unless the algorithm is one of "
                             f"{INTERLEAVED_SPLIT_ALGORITHMS}; got {self.interleaved_split!r} "
                             f"with {self.algorithm!r}")
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"GroupedGemmSm90Config: weight_layout must be one of "
                             f"{WEIGHT_LAYOUTS}, got {self.weight_layout!r}")
        parts = self.ablation.split("+")
        if self.ablation and (any(p not in spec.ablations for p in parts)
                              or len(set(parts)) != len(parts)):
            raise ValueError(f"GroupedGemmSm90Config: algorithm {self.algorithm!r} takes "
                             f"ablation in {('',) + spec.ablations} (or several joined by "
                             f"+), got {self.ablation!r}")

    @property
    def spec(self) -> KernelSpec:
        return KERNELS[self.algorithm]

    @property
    def takes_codes(self) -> bool:
        """Whether the launch reads e4m3 token codes and f32 scales (else bf16 rows)."""
        return self.algorithm in FP8_CODE_ALGORITHMS or self.token_codes

    def leaves_out(self, stage: str) -> bool:
        """Whether the ablation leaves ``stage`` (one of the spec's ``ablations``) out."""
        return stage in self.ablation.split("+")

    def smem_bytes(self, weight_format: str, gated: bool) -> int:
        mats = 2 if gated else 1
        if self.algorithm == "mma_sync":
            return warp_smem_bytes(weight_format, gated, self.num_stages)
        if self.spec.quantizes_tokens:          # "mma_fp8", "wgmma_rs"
            # Two row blocks take the ring of a gated launch's two matrices.
            return fp8_warp_smem_bytes(weight_format, gated or self.row_blocks > 1,
                                       self.num_stages,
                                       self.token_stages) + (
                WARP_TOKENS * 4 if self.row_norm_eps is not None else 0)
        if self.algorithm == "mma_fp8_stream":
            return STREAM_CHUNK_BLOCKS * STREAM_KBLOCK_BYTES
        if self.algorithm == "wgmma_fp8":        # per stage, bytes (grouped_gemm_sm90_wgmma_fp8)
            stage = (mats * BLOCK_M * (ROW_BYTES[weight_format] + BLOCK_K + 4 + 8)
                     + self.block_n * (BLOCK_K + 4))
            return self.num_stages * stage + 3072
        if self.algorithm == "wgmma_fp8_coop":   # grouped_gemm_sm90_wgmma_fp8_coop
            # 128 weight rows per stage (gated: 64 of each matrix), the token codes and
            # scales (4 lanes' groups, each padded by 4 slots: ``x_scale_slots``); FP4: A
            # tiles per (warpgroup, parity) (FP8 weights are copied into the stages' A
            # tiles: their rows' bytes); gated, the up sums handed over.
            stage = (COOP_ROWS * (ROW_BYTES[weight_format] + 4 + 4)
                     + self.block_n * (BLOCK_K + 4) + 4 * 4 * 4)
            a_tiles = 0 if weight_format == "fp8" else 2 * 2 * BLOCK_M * BLOCK_K
            handoff = BLOCK_M * self.block_n * 4 if gated else 0
            return self.num_stages * stage + a_tiles + handoff + 3072
        cta_rows = COOP_ROWS if self.algorithm == "wgmma_coop" else BLOCK_M
        raw = mats * cta_rows * ROW_BYTES[weight_format] + mats * cta_rows * 4
        x_tile = self.block_n * BLOCK_K * 2
        # bf16 A tiles: "wgmma" double-buffers its one warpgroup's, "wgmma_coop" has one per
        # warpgroup and matrix.
        dequant = 2 * mats * BLOCK_M * BLOCK_K * 2
        return self.num_stages * (raw + x_tile) + dequant + 2048

    def is_supported(self, *, weight_format: str, gated: bool, n_out: int, k_in: int,
                     x_dtype: str, num_tiles: int) -> tuple[bool, str]:
        """``(True, "")`` when the kernel handles these shapes, else ``(False, reason)``."""
        if weight_format not in WEIGHT_FORMATS:
            return False, f"weight format {weight_format!r} (one of {WEIGHT_FORMATS})"
        if x_dtype != "bfloat16":
            return False, f"activation dtype {x_dtype} (the kernel is bf16 only)"
        if weight_format not in self.spec.weight_formats:
            return False, (f"weight format {weight_format!r} (algorithm {self.algorithm!r} "
                           f"takes {'/'.join(self.spec.weight_formats)})")
        if self.weight_layout == "blocked" and weight_format != "fp4":
            return False, (f"weight layout 'blocked' with {weight_format!r} weights (packed "
                           f"FP4 only)")
        if self.algorithm in FP8_WGMMA_ALGORITHMS and (k_in // BLOCK_K) % 2:
            return False, (f"input features {k_in} (algorithm {self.algorithm!r} needs an "
                           f"even number of {BLOCK_K}-column blocks)")
        if self.block_n % 8 or not 8 <= self.block_n <= (128 if gated else 256):
            return False, f"block_n {self.block_n} (a multiple of 8, <= {128 if gated else 256})"
        if n_out % BLOCK_M:
            return False, f"output features {n_out} (the kernel needs a multiple of {BLOCK_M})"
        if self.row_blocks > 1 and (gated or n_out % (BLOCK_M * self.row_blocks)):
            return False, (f"row_blocks {self.row_blocks} (ungated launches of output "
                           f"features a multiple of {BLOCK_M * self.row_blocks}; got "
                           f"{n_out}, gated {gated})")
        if self.interleaved_split and not interleaves(weight_format, k_in, self.split_k):
            return False, (f"interleaved_split (FP4 weights of K blocks a multiple of split_k "
                           f"{self.split_k} x the scale group; got {weight_format!r}, input "
                           f"features {k_in})")
        if self.algorithm in COOP_ALGORITHMS and n_out % COOP_ROWS:
            return False, (f"output features {n_out} (algorithm {self.algorithm!r} needs a "
                           f"multiple of {COOP_ROWS})")
        if k_in % BLOCK_K:
            return False, f"input features {k_in} (the kernel needs a multiple of {BLOCK_K})"
        if weight_format == "fp8" and n_out % 128:
            return False, f"output features {n_out} (FP8 scale blocks need a multiple of 128)"
        if weight_format == "fp8" and (k_in // 128) % 4:
            return False, f"input features {k_in} (FP8 scale rows must be a multiple of 4 bytes)"
        if self.smem_bytes(weight_format, gated) > SMEM_BYTES:
            return False, f"config {self} needs {self.smem_bytes(weight_format, gated)} B smem"
        if num_tiles > MAX_GRID_Y:
            return False, f"{num_tiles} row tiles (the grid takes at most {MAX_GRID_Y})"
        return True, ""


DECODE_CONFIG = GroupedGemmSm90Config(block_n=8, num_stages=4)   # ~110 KB: two CTAs per SM
PREFILL_CONFIG = GroupedGemmSm90Config(block_n=128, num_stages=3)
# WGMMA tiles of 64 rows between the warp kernels' range and PREFILL_CONFIG's.
MID_CONFIG = GroupedGemmSm90Config(block_n=64, num_stages=4)
# Rows per group (on average) up to which the warp kernels (8-row tiles) run, and up to which
# MID_CONFIG does: the measured crossovers (docs/performance.md, "Crossover").
WARP_ROWS_PER_EXPERT = 16
MID_ROWS_PER_EXPERT = 40
# "wgmma_coop" (bf16 tokens: one accumulator per math thread, no FP8 block sums) on an ungated
# launch of at least WIDE_ROWS_PER_GROUP rows per group takes WIDE_BLOCK_N-row tiles at 2
# stages: each converted weight tile then serves twice the tokens (measured on the grouped
# wo_a of 1024-4096-token chunks; docs/performance.md, "The grouped wo_a at prefill").
WIDE_BLOCK_N = 256
WIDE_ROWS_PER_GROUP = 1024
# The warp-level decode kernels ("mma_sync", "mma_fp8"); 4 stages leave several CTAs per SM.
DECODE_MMA_SYNC_CONFIG = GroupedGemmSm90Config(block_n=8, num_stages=4, algorithm="mma_sync")


# The algorithms a policy names by default: "auto" for decode tiles (below; "mma_sync" where
# the FP8 kernels do not apply: BF16 weights or no FP8 activation simulation),
# "wgmma_fp8_coop" for prefill tiles ("wgmma_coop" where it does not apply: no FP8 activation
# simulation, an odd number of K blocks; "wgmma" for BF16 weights and output features not a
# multiple of 128). Measured choices: docs/performance.md.
DEFAULT_DECODE_ALGORITHM = "auto"
DEFAULT_PREFILL_ALGORITHM = "wgmma_fp8_coop"

# "auto", a decode algorithm that names no kernel: the warp kernel per launch, by the decode
# GEMMs measured one by one (docs/performance.md, "A decode kernel per launch" and "The routed
# launches split K"). "wgmma_rs" issues fewer instructions per MMA and is faster or level on
# every launch of at most AUTO_MAX_ROWS rows; a gated launch of more rows (the routed w1/w3 at
# batch 3 and up) waits at each step's warpgroup MMA for the slowest of its four warps unless
# its K is split (``many_rows_split_k``, up to MANY_ROWS_SPLIT_MAX_ROWS rows), and runs
# "mma_fp8" where it is not split; an ungated launch of more than AUTO_MAX_ROWS rows per group
# (the small dense linears at batch 64, several row tiles per weight block) runs "mma_fp8".
AUTO_DECODE_ALGORITHM = "auto"
AUTO_MAX_ROWS = 2 * WARP_TOKENS
DECODE_ALGORITHMS = ALGORITHMS + (AUTO_DECODE_ALGORITHM,)
# "wgmma_rs" launches of at most MANY_ROWS_SPLIT_MAX_ROWS rows, at most AUTO_MAX_ROWS per group,
# K split automatic: gated ones of more than WARP_TOKENS rows split K 4 ways, ungated ones of
# more than AUTO_MAX_ROWS 2 ways (the routed launches at T = 2 ... 16; at T = 64 the gated
# launch split was level alone and the model slower with it, w2 at T = 2, 32 and 64 level or
# slower split).
MANY_ROWS_GATED_SPLIT_K = 4
MANY_ROWS_SPLIT_K = 2
MANY_ROWS_SPLIT_MAX_ROWS = 8 * AUTO_MAX_ROWS


def many_rows_split_k(num_rows: int, num_groups: int, gated: bool, weight_format: str,
                      k_ins: tuple[int, ...]) -> int:
    """The automatic K split of a "wgmma_rs" decode launch of at most
    ``MANY_ROWS_SPLIT_MAX_ROWS`` rows, more than ``WARP_TOKENS`` (gated) or
    ``AUTO_MAX_ROWS`` (ungated), at most ``AUTO_MAX_ROWS`` per group, in ``num_groups``
    groups (1 otherwise; ``choose_config`` takes the larger of it and ``auto_split_k``), at
    most one split per scale group of the shortest of ``k_ins`` (none without them)."""
    fewest = WARP_TOKENS if gated else AUTO_MAX_ROWS
    if (not fewest < num_rows <= MANY_ROWS_SPLIT_MAX_ROWS
            or num_rows > AUTO_MAX_ROWS * num_groups or not k_ins):
        return 1
    return whole_group_split(MANY_ROWS_GATED_SPLIT_K if gated else MANY_ROWS_SPLIT_K,
                             weight_format, k_ins)


def auto_decode_algorithm(num_rows: int, num_groups: int, gated: bool,
                          weight_format: str = "fp4", k_ins: tuple[int, ...] = (),
                          split_k: int | None = None) -> str:
    """The warp kernel that "auto" runs for a launch of ``num_rows`` rows in ``num_groups``
    groups with input features ``k_ins``, K split ``split_k`` (None: automatic; see
    ``AUTO_DECODE_ALGORITHM``)."""
    if num_rows <= AUTO_MAX_ROWS * (1 if gated else num_groups):
        return "wgmma_rs"
    if gated and split_k is None and many_rows_split_k(num_rows, num_groups, gated,
                                                       weight_format, k_ins) > 1:
        return "wgmma_rs"
    return "mma_fp8"


def whole_group_split(want: int, weight_format: str, k_ins: tuple[int, ...]) -> int:
    """A K split of about ``want`` ways (at least 1, at most ``MAX_SPLIT_K``) that starts each
    split at a scale group of the shortest of ``k_ins`` and leaves no split without work:
    ``want`` capped at the groups, then as many splits as the groups per split need."""
    k_blocks = min(k_ins) // BLOCK_K
    groups = max(1, k_blocks // warp_scale_group(weight_format, k_blocks))
    per = -(-groups // max(1, min(want, MAX_SPLIT_K, groups)))     # scale groups per split
    return -(-groups // per)


def interleaves(weight_format: str, k_in: int, split_k: int) -> bool:
    """Whether a K split of ``split_k`` may interleave its CTAs' K blocks
    (``GroupedGemmSm90Config.interleaved_split``): FP4 rows (64 bytes per K block, half a
    line; FP8 rows take whole lines already, and their scale words hold 4 consecutive K
    blocks), and every split the same whole scale groups."""
    num_k = k_in // BLOCK_K
    return (weight_format == "fp4" and split_k > 1 and k_in % BLOCK_K == 0
            and num_k % (split_k * warp_scale_group(weight_format, num_k)) == 0)


def split_k_blocks(num_k: int, split_k: int, scale_group: int) -> int:
    """K blocks per split: ceil(num_k / split_k) rounded up to whole scale groups (a split
    starts a scale group, the unit of the warp kernels' scale copies); the last split may
    get fewer, or none. Non-negative arithmetic only: ``num_k`` is a device value in the
    kernels, whose integer division truncates."""
    per = (num_k + split_k - 1) // split_k
    return (per + scale_group - 1) // scale_group * scale_group


PREFILL_FP8_CONFIG = GroupedGemmSm90Config(block_n=FP8_WGMMA_MAX_BLOCK_N, num_stages=6,
                                           algorithm="wgmma_fp8")


NUM_SMS = 132            # H100 SXM and H200
# Rows per group up to which a launch whose WGMMA tiles would leave SMs idle runs the warp
# kernels' 8-row tiles instead (each weight block then read by up to 16 tiles, through L2) --
# the FP8 warp kernels only: "mma_sync" converts every weight byte to bf16 again for each of
# those tiles and is bound by it (the grouped wo_a at 32 and 64 rows per group: 1.7x and 2.3x
# the time of the 64-row WGMMA tiles; docs/performance.md, "A decode kernel per launch").
WARP_ROWS_FEW_CTAS = 128
FEW_CTAS_ALGORITHMS = tuple(a for a in WARP_ALGORITHMS if a != "mma_sync")


def _wgmma_block(num_rows: int, num_groups: int) -> int:
    return (MID_CONFIG if num_rows <= MID_ROWS_PER_EXPERT * num_groups
            else PREFILL_CONFIG).block_n


# The warp kernels' K split: a launch with fewer than SPLIT_BELOW_CTAS_PER_SM CTAs per SM splits
# until about RESIDENT_CTAS_PER_SM CTAs per SM run at once (what their shared memory allows):
# the decode sweep (docs/performance.md, "Decode GEMMs") measured the most CTAs fastest for
# long K (wo_b, the shared expert), and no split fastest at 3 CTAs per SM (routed w2, T = 1).
# "mma_sync" (bf16 tokens: twice the MMAs and a bf16 conversion per weight byte) is bound by
# its instructions, not its CTAs: its splits only add the cluster's sums, so it aims lower.
SPLIT_BELOW_CTAS_PER_SM = 2
RESIDENT_CTAS_PER_SM = 4
RESIDENT_CTAS_PER_SM_BY_ALGORITHM = {"mma_sync": 2}
# A split launch's splits are one thread-block cluster, which runs only when all its CTAs fit
# at once in one GPC: split launches take 3 stages (several CTAs per SM, whole clusters
# resident; the sweep measured 3 best or level for every split launch), the unsplit decode
# launches of few tiles 4: with their tokens quantised ahead (below), deeper rings were slower
# in the T = 1 and T = 8 sweeps on both an H100 and an H200 (wq_b most; docs/performance.md,
# "Decode: the T = 1 stages ... nineteenth session").
SPLIT_STAGES = 3
FEW_TILES_STAGES = 4
# ... and, quantising their own tokens, all of a short K range's blocks before the K loop (a
# decode K block's MMAs are shorter than a token load's latency: docs/performance.md).
FEW_TILES_TOKEN_STAGES = MAX_TOKEN_STAGES
# The unsplit launches of more rows too (the routed launches at batch 64: gated "mma_fp8" -10 %,
# w2 -5 %); the split ones keep 2 (the routed w1/w3 at batch 8 and 16 +3 % with more;
# docs/performance.md, thirty-sixth session).
UNSPLIT_TOKEN_STAGES = MAX_TOKEN_STAGES


def auto_split_k(num_rows: int, num_groups: int, weight_format: str, k_ins: tuple[int, ...],
                 n_outs: tuple[int, ...], algorithm: str = "mma_fp8") -> int:
    """The warp kernels' K split for a decode launch of a small matrix (few 64-row output
    blocks, one or two tiles of rows), which otherwise streams its weights through a few
    CTAs per SM: ``RESIDENT_CTAS_PER_SM`` CTAs per SM (the ``algorithm``'s own figure where
    it has one) when it has fewer than ``SPLIT_BELOW_CTAS_PER_SM``. Splits start scale
    groups (``split_k_blocks``): at most ``K blocks / scale group`` of them, and no more
    than get work."""
    if not n_outs or not k_ins:
        return 1
    tiles = (min(num_groups, num_rows) if num_groups > 1
             else -(-num_rows // WARP_TOKENS))
    ctas = min(n_outs) // BLOCK_M * max(tiles, 1)
    if ctas >= SPLIT_BELOW_CTAS_PER_SM * NUM_SMS:
        return 1
    resident = RESIDENT_CTAS_PER_SM_BY_ALGORITHM.get(algorithm, RESIDENT_CTAS_PER_SM)
    return whole_group_split(resident * NUM_SMS // max(ctas, 1), weight_format, k_ins)


def choose_config(num_rows: int, num_groups: int, weight_format: str, *,
                  decode_algorithm: str = DEFAULT_DECODE_ALGORITHM,
                  prefill_algorithm: str = DEFAULT_PREFILL_ALGORITHM,
                  fp8_activations: bool = True, k_ins: tuple[int, ...] = (),
                  n_outs: tuple[int, ...] = (),
                  split_k: int | None = 1, pdl: bool = False,
                  gated: bool = False, row_blocks: int = 1,
                  token_stages: int | None = None,
                  interleaved_split: bool = False) -> GroupedGemmSm90Config:
    """The config of a launch (``gated``: of two matrices and the SwiGLU) in a call whose
    launches have input features ``k_ins`` and outputs ``n_outs`` (the op checks support
    with it too). Every launch of a call gets the same tiles; with
    ``decode_algorithm="auto"`` their kernels (``auto_decode_algorithm``), K splits and
    stages may differ.

    Decode tiles (8 rows) while the average group holds at most ``WARP_ROWS_PER_EXPERT``
    rows, else prefill tiles (64 rows up to ``MID_ROWS_PER_EXPERT``, then 128) -- unless
    those WGMMA tiles would give fewer CTAs than SMs for the launches' output features
    ``n_outs`` (a dense linear of a small matrix at batch 64) with at most
    ``WARP_ROWS_FEW_CTAS`` rows per group: then decode tiles too (not for "mma_sync":
    ``FEW_CTAS_ALGORITHMS``). Decode tiles run
    ``decode_algorithm``, prefill tiles ``prefill_algorithm``. The FP8 algorithms need
    FP4/FP8 weights and FP8-quantised activations (``fp8_activations``: the simulation is
    on), else they become "mma_sync" / "wgmma" ("wgmma_fp8_coop": "wgmma_coop"); the FP8
    WGMMA kernels also an even number of K blocks in each of ``k_ins``, the input features
    of the launches that will use the config.
    WGMMA: BF16 weights (4x the bytes of FP4 per stage) take 64-row tiles; then as many
    pipeline stages as fit in shared memory for this launch (``gated``: two matrices).
    Warp kernels: for at most 2 tiles of rows, K split ``split_k`` ways (None:
    ``auto_split_k``) with ``SPLIT_STAGES`` stages when it splits, else
    ``FEW_TILES_STAGES`` (few CTAs, each must keep more bytes in flight); else 4 stages;
    for "wgmma_rs" with ``split_k`` None, at least ``many_rows_split_k`` splits (at
    ``SPLIT_STAGES``);
    fewer while two CTAs would not fit in an SM. ``pdl``: warp kernels launch as programmatic
    dependents ("start"; the launch upgrades it to "weights" where it may,
    ``GroupedGemmSm90Config.pdl``). ``row_blocks``: 64-row output blocks per CTA of an
    ungated warp-kernel launch whose kernel takes them and whose ``n_outs`` are whole such
    blocks (elsewhere 1). ``token_stages``: the token stages of a decode launch of a kernel
    that quantises (or copies) its tokens (None: ``FEW_TILES_TOKEN_STAGES`` for at most 2
    tiles of rows, ``UNSPLIT_TOKEN_STAGES`` for more rows unsplit, 2 for more rows split).
    ``interleaved_split``: a decode launch that splits K interleaves its CTAs' K blocks
    where its kernel and every one of ``k_ins`` allow (``interleaves``)."""
    for name, value, allowed in (("decode_algorithm", decode_algorithm, DECODE_ALGORITHMS),
                                 ("prefill_algorithm", prefill_algorithm, PREFILL_ALGORITHMS)):
        if value not in allowed:
            raise ValueError(f"choose_config: {name} must be one of {allowed}, got {value!r}")
    if decode_algorithm == AUTO_DECODE_ALGORITHM:
        decode_algorithm = auto_decode_algorithm(num_rows, num_groups, gated, weight_format,
                                                 k_ins, split_k)
    fp8_ok = weight_format != "bf16" and fp8_activations
    if decode_algorithm in FP8_ACTIVATION_ALGORITHMS and decode_algorithm in WARP_ALGORITHMS \
            and not fp8_ok:
        decode_algorithm = "mma_sync"
    decode = num_rows <= WARP_ROWS_PER_EXPERT * num_groups
    if (not decode and n_outs and num_rows <= WARP_ROWS_FEW_CTAS * num_groups
            and decode_algorithm in FEW_CTAS_ALGORITHMS):
        block = _wgmma_block(num_rows, num_groups)
        ctas = min(n_outs) // BLOCK_M * num_groups * -(-num_rows // num_groups // block)
        decode = ctas < NUM_SMS
    if not fp8_ok or any((k // BLOCK_K) % 2 for k in k_ins):
        # The FP8 WGMMA kernels become their bf16 counterparts.
        fallback = {"wgmma_fp8": "wgmma", "wgmma_fp8_coop": "wgmma_coop"}
        decode_algorithm = fallback.get(decode_algorithm, decode_algorithm)
        prefill_algorithm = fallback.get(prefill_algorithm, prefill_algorithm)
    if decode and decode_algorithm in WARP_ALGORITHMS:
        config = dataclasses.replace(DECODE_MMA_SYNC_CONFIG, algorithm=decode_algorithm)
        many = (many_rows_split_k(num_rows, num_groups, gated, weight_format, k_ins)
                if split_k is None and decode_algorithm == "wgmma_rs" else 1)
        if num_rows <= 2 * WARP_TOKENS:
            split = max(many, auto_split_k(num_rows, num_groups, weight_format, k_ins, n_outs,
                                           decode_algorithm) if split_k is None else split_k)
            config = dataclasses.replace(
                config, num_stages=SPLIT_STAGES if split > 1 else FEW_TILES_STAGES,
                split_k=split, token_stages=(FEW_TILES_TOKEN_STAGES
                                             if config.spec.quantizes_tokens
                                             else FP8_TOKEN_BUFFERS))
        elif many > 1:
            config = dataclasses.replace(config, num_stages=SPLIT_STAGES, split_k=many)
        elif config.spec.quantizes_tokens:
            config = dataclasses.replace(config, token_stages=UNSPLIT_TOKEN_STAGES)
        if token_stages is not None and config.spec.quantizes_tokens:
            config = dataclasses.replace(config, token_stages=token_stages)
        while (config.num_stages > 2
               and 2 * config.smem_bytes(weight_format, True) > SMEM_BYTES):
            config = dataclasses.replace(config, num_stages=config.num_stages - 1)
        if (row_blocks > 1 and not gated and row_blocks <= config.spec.max_row_blocks
                and n_outs and not any(n % (BLOCK_M * row_blocks) for n in n_outs)):
            config = dataclasses.replace(config, row_blocks=row_blocks)
        if (interleaved_split and config.algorithm in INTERLEAVED_SPLIT_ALGORITHMS
                and k_ins and all(interleaves(weight_format, k, config.split_k)
                                  for k in k_ins)):
            config = dataclasses.replace(config, interleaved_split=True)
        return dataclasses.replace(config, pdl="start") if pdl else config
    algorithm = decode_algorithm if decode else prefill_algorithm
    if algorithm in COOP_ALGORITHMS and (weight_format not in KERNELS[algorithm].weight_formats
                                         or any(n % COOP_ROWS for n in n_outs)):
        algorithm = "wgmma"
    if algorithm == "wgmma_fp8_coop":
        # One accumulator and two block accumulators per math thread: 128-row tiles fit.
        config = dataclasses.replace(
            MID_CONFIG if decode or num_rows <= MID_ROWS_PER_EXPERT * num_groups
            else PREFILL_CONFIG, algorithm=algorithm, num_stages=8)
        if decode:
            config = dataclasses.replace(config, block_n=DECODE_CONFIG.block_n)
    elif algorithm == "wgmma_fp8":
        config = PREFILL_FP8_CONFIG
        if decode:
            config = dataclasses.replace(config, block_n=DECODE_CONFIG.block_n)
    elif decode:
        config = dataclasses.replace(DECODE_CONFIG, algorithm=algorithm)
    else:
        config = MID_CONFIG if num_rows <= MID_ROWS_PER_EXPERT * num_groups else PREFILL_CONFIG
        config = dataclasses.replace(config, algorithm=algorithm)
        if (algorithm == "wgmma_coop" and not gated
                and num_rows >= WIDE_ROWS_PER_GROUP * num_groups):
            config = dataclasses.replace(config, block_n=WIDE_BLOCK_N)
    if weight_format == "bf16" and config.block_n > 64:
        config = dataclasses.replace(config, block_n=64)
    # As many stages as fit this launch: an ungated one (one matrix) may keep one more than
    # the gated launch of its call (docs/performance.md, "The grouped wo_a at prefill").
    while config.num_stages > 2 and config.smem_bytes(weight_format, gated) > SMEM_BYTES:
        config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    return config


def num_tile_slots(num_rows: int, num_groups: int, block_n: int) -> int:
    """Static worst case of row tiles: every group may leave one partial tile."""
    return -(-num_rows // block_n) + min(num_groups, num_rows)
