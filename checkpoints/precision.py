"""Host-side (numpy) precision conversions applied while loading a tensor.

Only exact conversions are allowed; anything that would round raises ``CheckpointError``
naming the tensor:

* BF16 -> F32 (``Config.dtype="float32"``), I64 -> int32 for ``tid2eid`` (range-checked
  against ``n_routed_experts``), F32 power-of-two scales -> E8M0 (the FP8 -Base checkpoints
  may store F32 block scales; unverified);
* dequantisation (``dequantize=True``): FP8 e4m3 x E8M0 128x128 and packed FP4 e2m1 x E8M0
  1x32 (docs/architecture.md §5.2-5.3) are products of a short-mantissa code and a power of
  two, so they are exact in BF16/F32 whenever the scale exponents keep every product inside
  the target's range (``check_exact_dequant``; true for any real checkpoint).

These are numpy twins of ``dsv4_jax.quant.dequant_fp8_weight`` /
``dequant_fp4_weight`` (the tests compare them bit for bit) so loading needs no device
compute and no per-shape compilation.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from dsv4_jax.quant import FP4_CODE_VALUES
from .safetensors_io import CheckpointError

E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)

# (largest |code|, smallest spacing of codes) of each stored weight format.
_CODE_RANGE = {"fp8": (448.0, 2.0 ** -9), "fp4": (6.0, 0.5)}
_FP8_BLOCK, _FP4_BLOCK = 128, 32


def scale_exponents(scale: np.ndarray, code: str, name: str) -> np.ndarray:
    """Integer exponents k of block scales 2^k stored as E8M0 bytes or F32 powers of two."""
    if code == "F8_E8M0":
        raw = scale.view(np.uint8).astype(np.int32)
        if raw.size and raw.max() == 255:
            raise CheckpointError(f"{name}: E8M0 scale byte 255 (NaN)")
        return raw - 127
    if code == "F32":
        mant, exp = np.frexp(scale)
        bad = ~np.isfinite(scale) | (mant != 0.5)
        if bad.any():
            raise CheckpointError(f"{name}: F32 scale {scale[bad].ravel()[0]!r} is not a power "
                                  "of two, so it has no exact E8M0 form")
        k = exp.astype(np.int32) - 1
        if k.size and (k.min() < -127 or k.max() > 127):
            raise CheckpointError(f"{name}: F32 scale exponent outside the E8M0 range [-127, 127]")
        return k
    raise CheckpointError(f"{name}: scale dtype {code} (expected F8_E8M0 or F32)")


def check_exact_dequant(kmin: int, kmax: int, fmt: str, target, name: str) -> None:
    """Every ``code * 2^k`` with k in [kmin, kmax] is representable in ``target``."""
    top, step = _CODE_RANGE[fmt]
    info = ml_dtypes.finfo(np.dtype(target))
    if top * 2.0 ** kmax > float(info.max) or step * 2.0 ** kmin < float(info.smallest_subnormal):
        raise CheckpointError(
            f"{name}: dequantizing {fmt} with scale exponents in [{kmin}, {kmax}] to "
            f"{np.dtype(target).name} would not be exact (load it quantized, or in float32)")


def convert(arr: np.ndarray, code: str, target, name: str, *, n_experts: int) -> np.ndarray:
    """A stored tensor in the leaf's dtype ``target`` (exact conversions only)."""
    target = np.dtype(target)
    if code == "I64":                          # tid2eid: the reference declares int32
        if arr.size and (arr.min() < 0 or arr.max() >= n_experts):
            bad = arr[(arr < 0) | (arr >= n_experts)].ravel()[0]
            raise CheckpointError(f"{name}: expert id {int(bad)} outside [0, n_routed_experts="
                                  f"{n_experts})")
        return arr.astype(target)
    if target == E8M0 and code == "F32":
        return np.exp2(scale_exponents(arr, code, name).astype(np.float32)).astype(E8M0)
    if arr.dtype == target:
        return arr
    if code == "BF16" and target == np.float32:
        return arr.astype(np.float32)
    raise CheckpointError(f"{name}: cannot load {code} into a {target.name} parameter")


def _expand_fp8_scale(scale_f32: np.ndarray, out_f: int, in_f: int) -> np.ndarray:
    s = np.repeat(scale_f32, _FP8_BLOCK, axis=-2)[..., :out_f, :]
    return np.repeat(s, _FP8_BLOCK, axis=-1)[..., :in_f]


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """int8 ``[..., K/2]`` (low nibble = element 2k) -> f32 ``[..., K]``."""
    b = packed.view(np.uint8)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)
    return FP4_CODE_VALUES[codes]


def dequantize(weight: np.ndarray, weight_code: str, scale: np.ndarray, scale_code: str,
               target, name: str) -> np.ndarray:
    """FP8 (``F8_E4M3``) or packed FP4 (``I8``) weight times its block scales, in ``target``."""
    k = scale_exponents(scale, scale_code, name + " scale")
    fmt = {"F8_E4M3": "fp8", "I8": "fp4"}.get(weight_code)
    if fmt is None:
        raise CheckpointError(f"{name}: cannot dequantize dtype {weight_code}")
    if k.size:
        check_exact_dequant(int(k.min()), int(k.max()), fmt, target, name)
    s = np.exp2(k.astype(np.float32))
    if fmt == "fp8":
        out_f, in_f = weight.shape[-2:]
        values = weight.astype(np.float32) * _expand_fp8_scale(s, out_f, in_f)
    else:
        values = unpack_fp4(weight) * np.repeat(s, _FP4_BLOCK, axis=-1)
    return values.astype(target)
