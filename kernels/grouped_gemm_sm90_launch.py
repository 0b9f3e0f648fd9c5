"""The one ``cutlass_call`` entry point of the grouped GEMM: builds the config's kernel class
(``grouped_gemm_config.KERNELS`` names them) with the family's one constructor and call
signature, and launches it."""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from .grouped_gemm_config import KERNELS, GroupedGemmSm90Config
from .grouped_gemm_sm90_mma_fp8 import GroupedGemmMmaFp8Sm90
from .grouped_gemm_sm90_mma_fp8_stream import GroupedGemmMmaFp8StreamSm90
from .grouped_gemm_sm90_mma_sync import GroupedGemmMmaSyncSm90
from .grouped_gemm_sm90_wgmma import GroupedGemmWgmmaSm90
from .grouped_gemm_sm90_wgmma_coop import GroupedGemmWgmmaCoopSm90
from .grouped_gemm_sm90_wgmma_fp8 import GroupedGemmWgmmaFp8Sm90
from .grouped_gemm_sm90_wgmma_fp8_coop import GroupedGemmWgmmaFp8CoopSm90
from .grouped_gemm_sm90_wgmma_rs import GroupedGemmWgmmaRsSm90

KERNEL_CLASSES = {cls.__name__: cls for cls in (
    GroupedGemmWgmmaSm90, GroupedGemmWgmmaFp8Sm90, GroupedGemmMmaSyncSm90, GroupedGemmMmaFp8Sm90,
    GroupedGemmMmaFp8StreamSm90, GroupedGemmWgmmaCoopSm90, GroupedGemmWgmmaRsSm90,
    GroupedGemmWgmmaFp8CoopSm90)}
if {spec.class_name for spec in KERNELS.values()} != set(KERNEL_CLASSES):
    raise ImportError("grouped_gemm_config.KERNELS and the launcher's kernel classes differ")


@cute.jit
def grouped_gemm_launcher(stream: cuda.CUstream, x: cute.Tensor, x_scale: cute.Tensor,
                          tile_group: cute.Tensor, tile_row0: cute.Tensor,
                          tile_rows: cute.Tensor, w_a: cute.Tensor, s_a: cute.Tensor,
                          w_b: cute.Tensor, s_b: cute.Tensor, route_w: cute.Tensor,
                          out: cute.Tensor, *, weight_format: cutlass.Constexpr,
                          gated: cutlass.Constexpr, swiglu_limit: cutlass.Constexpr,
                          block_n: cutlass.Constexpr, num_stages: cutlass.Constexpr,
                          algorithm: cutlass.Constexpr, split_k: cutlass.Constexpr = 1,
                          ablation: cutlass.Constexpr = "",
                          scale_group: cutlass.Constexpr = 1,
                          token_stages: cutlass.Constexpr = 2,
                          paired: cutlass.Constexpr = False,
                          token_stride: cutlass.Constexpr = 1, pdl: cutlass.Constexpr = "",
                          token_codes: cutlass.Constexpr = False,
                          row_norm_eps: cutlass.Constexpr = None,
                          row_blocks: cutlass.Constexpr = 1,
                          interleaved_split: cutlass.Constexpr = False,
                          weight_layout: cutlass.Constexpr = "rows"):
    """(stream, *inputs, *outputs, **static config).

    ``x``: the sorted rows [rows, K], bf16, or e4m3 codes (uint8) for the FP8-activation
    algorithms, whose f32 scales [rows, K / 128] are ``x_scale`` (a stand-in elsewhere).
    ``tile_group`` / ``tile_row0`` / ``tile_rows``: the schedule's tile slots. ``w_a``,
    ``s_a`` (and ``w_b``, ``s_b`` when ``gated``): weight bytes and E8M0 scale bytes.
    ``route_w``: the rows' routing weights (gated). ``scale_group``: the warp kernels'
    ``grouped_gemm_layout.warp_scale_group`` of the input features. ``out``: bf16
    [rows, N] (a K split adds its sums in the kernel: one cluster per tile). ``paired``
    (the warp kernels, ungated): ``w_b``, ``s_b`` are a second weight of the same rows and
    format, whose outputs follow ``w_a``'s: ``out`` is [rows, N_a + N_b]. ``token_stride``
    ("mma_fp8"): tile row r reads row (row0 + r) / token_stride of ``x``. ``pdl``: the warp
    kernels' programmatic dependent launch (``GroupedGemmSm90Config.pdl``). ``token_codes``
    ("mma_fp8", "wgmma_rs"): ``x`` holds e4m3 codes and ``x_scale`` their scales, which the
    kernel copies instead of quantising bf16 rows. ``row_norm_eps`` (those two): ``x`` is
    normalised first (``GroupedGemmSm90Config.row_norm_eps``), ``x_scale`` is the norm's bf16
    weight [K]. ``row_blocks`` (those two, ungated): 64-row output blocks per CTA
    (``GroupedGemmSm90Config.row_blocks``). ``interleaved_split`` (the warp kernels but
    "mma_fp8_stream"): a K split's CTAs read interleaved K blocks
    (``GroupedGemmSm90Config.interleaved_split``). ``weight_layout``: "rows", or "blocked"
    (packed FP4 ``w_a`` / ``w_b`` in 64-row x K-block tiles,
    ``GroupedGemmSm90Config.weight_layout``)."""
    config = GroupedGemmSm90Config(block_n=block_n, num_stages=num_stages, algorithm=algorithm,
                                   split_k=split_k, ablation=ablation,
                                   token_stages=token_stages, pdl=pdl,
                                   token_codes=bool(token_codes),
                                   row_norm_eps=row_norm_eps, row_blocks=row_blocks,
                                   interleaved_split=bool(interleaved_split),
                                   weight_layout=weight_layout)
    kernel_class = KERNEL_CLASSES[KERNELS[algorithm].class_name]
    # Only the warp kernels take pairs, only those that quantise their tokens a stride.
    extra = ({"paired": True} if paired else {}) | (
        {"token_stride": token_stride} if token_stride != 1 else {})
    kernel_class(weight_format, gated, swiglu_limit, config, scale_group, **extra)(
        x, x_scale, tile_group, tile_row0, tile_rows, w_a, s_a, w_b, s_b, route_w, out, stream)
