"""The one ``cutlass_call`` entry point of the MoE kernels: picks the kernel class of the
config's algorithm ("wgmma": ``moe_sm90_kernel``, "wgmma_fp8": ``moe_sm90_fp8``, "mma_sync":
``moe_sm90_warp``, "mma_fp8": ``moe_sm90_warp_fp8``), all behind the same arguments."""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import const_expr

from .moe_sm90 import MoeGemmSm90Config
from .moe_sm90_fp8 import MoeGemmFp8Sm90
from .moe_sm90_kernel import MoeGemmSm90
from .moe_sm90_warp import MoeGemmWarpSm90
from .moe_sm90_warp_fp8 import MoeGemmWarpFp8Sm90


@cute.jit
def moe_gemm_launcher(stream: cuda.CUstream, x: cute.Tensor, tile_expert: cute.Tensor,
                      tile_row0: cute.Tensor, tile_rows: cute.Tensor, w_a: cute.Tensor,
                      s_a: cute.Tensor, w_b: cute.Tensor, s_b: cute.Tensor,
                      route_w: cute.Tensor, x_scale: cute.Tensor, out: cute.Tensor, *,
                      weight_format: cutlass.Constexpr, gated: cutlass.Constexpr,
                      swiglu_limit: cutlass.Constexpr, block_n: cutlass.Constexpr,
                      num_stages: cutlass.Constexpr, ablation: cutlass.Constexpr = "",
                      algorithm: cutlass.Constexpr = "wgmma",
                      scale_group: cutlass.Constexpr = 1, split_k: cutlass.Constexpr = 1):
    """(stream, *inputs, *outputs, **static config). The warp kernels also take
    ``scale_group`` (``moe_sm90.warp_scale_group`` of the input features). ``x_scale``: the
    FP8-activation algorithms ("mma_fp8", "wgmma_fp8") read ``x`` as e4m3 codes [rows, K]
    (uint8) and these f32 scales [rows, K / 128]; the others read bf16 ``x`` and ignore it.
    ``split_k`` > 1 (warp kernels): ``out`` is f32 [split_k, rows, mats * N] partial sums."""
    config = MoeGemmSm90Config(block_n=block_n, num_stages=num_stages, ablation=ablation,
                               algorithm=algorithm, split_k=split_k)
    if const_expr(algorithm in ("wgmma", "wgmma_fp8")):
        kernel_class = MoeGemmFp8Sm90 if const_expr(algorithm == "wgmma_fp8") else MoeGemmSm90
        kernel_class(weight_format, gated, swiglu_limit, config)(
            x, x_scale, tile_expert, tile_row0, tile_rows, w_a, s_a, w_b, s_b, route_w, out,
            stream)
    else:
        kernel_class = MoeGemmWarpFp8Sm90 if const_expr(algorithm == "mma_fp8") else (
            MoeGemmWarpSm90)
        kernel_class(weight_format, gated, swiglu_limit, config, scale_group)(
            x, tile_expert, tile_row0, tile_rows, w_a, s_a, w_b, s_b, route_w, x_scale, out,
            stream)
