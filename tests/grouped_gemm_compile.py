"""Shared by the grouped-GEMM kernel tests: compiling a kernel configuration for sm_90a the way
``cutlass_call`` does on the device, assembling it with ``ptxas``, and the PTX ``prmt``
instruction replayed in Python."""
import os
import re
import shutil
import subprocess

import cutlass
import cutlass.cute as cute
import pytest
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from dsv4_jax.kernels import grouped_gemm_config as support
from dsv4_jax.kernels import grouped_gemm_layout as layout
from dsv4_jax.kernels import grouped_gemm_sm90_launch as kernel


def prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32`` (default mode): byte i of the result is byte s & 7 of {b, a},
    or the replicated sign bit of that byte when s & 8."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        s = (selector >> (4 * i)) & 0xF
        byte = pool[s & 7]
        if s & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def compile_variant(fmt, gated, config, a=64, k=512, n=256, e=4):
    """Compile as ``cutlass_call`` does on the device: every extent a runtime value (only the
    divisibilities the JAX side guarantees are known), the launcher's static arguments."""
    def fake(dtype, shape):
        return make_fake_compact_tensor(dtype, shape, assumed_align=16)

    def dyn(extent):
        div = next(d for d in (16, 8, 4, 2, 1) if extent % d == 0)
        return cute.sym_int(divisibility=div)
    u8, bf16, i32 = cutlass.Uint8, cutlass.BFloat16, cutlass.Int32
    a_, k_, n_, e_ = dyn(a), dyn(k), dyn(n), dyn(e)
    weights = {"fp4": (fake(u8, (e_, n_, dyn(k // 2))), fake(u8, (e_, n_, dyn(k // 32)))),
               "fp8": (fake(u8, (e_, n_, k_)), fake(u8, (e_, dyn(n // 128), dyn(k // 128)))),
               "bf16": (fake(bf16, (e_, n_, k_)), fake(u8, (4,)))}[fmt]
    slots = dyn(support.num_tile_slots(a, e, config.block_n))
    fp8_x = config.takes_codes                     # e4m3 codes + f32 scales
    x = fake(u8, (a_, k_)) if fp8_x else fake(bf16, (a_, k_))
    x_scale = fake(cutlass.Float32, (a_, dyn(k // 128)) if fp8_x else (1,))
    if config.row_norm_eps is not None:            # the norm weight, bf16 [K]
        x_scale = fake(bf16, (k_,))
    out = fake(bf16, (a_, n_))
    return cute.compile(kernel.grouped_gemm_launcher, make_fake_stream(), x, x_scale,
                        fake(i32, (slots,)), fake(i32, (slots,)), fake(i32, (slots,)),
                        *weights, *weights, fake(cutlass.Float32, (a_,)), out,
                        weight_format=fmt, gated=gated, swiglu_limit=10.0,
                        block_n=config.block_n, num_stages=config.num_stages,
                        algorithm=config.algorithm, ablation=config.ablation,
                        scale_group=layout.warp_scale_group(fmt, k // support.BLOCK_K),
                        split_k=config.split_k, token_stages=config.token_stages,
                        **({"pdl": config.pdl} if config.pdl else {}),
                        **({"token_codes": True} if config.token_codes else {}),
                        **({"row_norm_eps": config.row_norm_eps}
                           if config.row_norm_eps is not None else {}),
                        **({"row_blocks": config.row_blocks} if config.row_blocks > 1 else {}),
                        **({"interleaved_split": True} if config.interleaved_split else {}),
                        **({"weight_layout": config.weight_layout}
                           if config.weight_layout != "rows" else {}))


def run_ptxas(ptx: str, folder) -> tuple[int, str] | None:
    """``ptxas -arch=sm_90a -v`` on ``ptx`` in ``folder``: ``(return code, log)``, or None where
    no ptxas is on the PATH. The PTX's ISA version is lowered to 9.0 first: the local CUDA
    13.0 ptxas takes ISA <= 9.0, the DSL stamps 9.4 on the same instructions."""
    if shutil.which("ptxas") is None:
        return None
    src = os.path.join(folder, "kernel.ptx")
    with open(src, "w") as f:
        f.write(re.sub(r"^\.version \d+\.\d+", ".version 9.0", ptx, flags=re.M))
    out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", src, "-o",
                          os.path.join(folder, "kernel.cubin")], capture_output=True, text=True)
    return out.returncode, out.stdout + out.stderr


def ptxas_log(tmp_path, compiled) -> str:
    """``ptxas -v`` on a compiled kernel's PTX: its log (skips when ptxas is absent or older
    than the PTX)."""
    result = run_ptxas(compiled.artifacts.PTX, str(tmp_path))
    if result is None:
        pytest.skip("no ptxas on this machine")
    code, log = result
    if code and "Unsupported .version" in log:
        pytest.skip(f"this ptxas is older than the PTX: {log.strip()[:200]}")
    assert code == 0, log
    return log
