"""DeepSeek-V4 quantisation numerics: FP8/FP4 block scaling, simulations, weight decoding.

Every function reproduces a step of the official TileLang kernels (``inference/kernel.py``)
bit for bit; ``tests/test_quant.py`` checks them against the shared reference vectors.

* Power-of-two ("UE8M0") scales are ``2^ceil(log2(amax * (1/qmax)))``, computed from the IEEE
  bits of the f32 product exactly as ``fast_round_scale`` does (exponent + 1 when any mantissa
  bit is set), never with ``log2``/``ceil`` in floating point.
* Quantised values are ``cast(clamp(x / s, -qmax, qmax))`` with round-to-nearest-even;
  ``x / s`` is exact because ``s`` is a power of two.
* FP8 is e4m3fn (max 448), FP4 is e2m1 (max 6), scales are stored as e8m0 bytes (2^(E-127)).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import jax
import jax.numpy as jnp

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_DTYPE = jnp.float8_e4m3fn
FP4_DTYPE = jnp.float4_e2m1fn
E8M0_DTYPE = jnp.float8_e8m0fnu

# Value of each e2m1 code (low nibble first in packed bytes), docs/architecture.md §5.3.
FP4_CODE_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                           dtype=np.float32)


def pow2_ceil_scale(amax_times_inv_qmax: jax.Array) -> jax.Array:
    """2^ceil(log2(v)) for positive normal f32 ``v``, from its bits (TileLang fast_round_scale)."""
    bits = jax.lax.bitcast_convert_type(amax_times_inv_qmax.astype(jnp.float32), jnp.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(jnp.int32) - 127
    exponent = exponent + (bits & 0x7FFFFF != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(((exponent + 127) << 23).astype(jnp.uint32), jnp.float32)


def _blocked(x: jax.Array, block: int) -> jax.Array:
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the block {block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _block_scale(xb: jax.Array, floor: float, qmax: float) -> jax.Array:
    amax = jnp.max(jnp.abs(xb.astype(jnp.float32)), axis=-1, keepdims=True)
    amax = jnp.maximum(amax, jnp.float32(floor))
    return pow2_ceil_scale(amax * jnp.float32(1.0 / qmax))


def act_quant(x: jax.Array, block: int = 128):
    """Quantise activations to e4m3 per ``block`` channels with power-of-two scales.

    Returns ``(codes [..., N] float8_e4m3fn, scales [..., N/block] f32)``; ``codes * scales``
    (per block) is the value the official FP8/FP4 GEMMs multiply.
    """
    xb = _blocked(x, block)
    s = _block_scale(xb, 1e-4, FP8_MAX)
    q = jnp.clip(xb.astype(jnp.float32) / s, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return q.reshape(x.shape), s[..., 0]


def act_quant_dequant(x: jax.Array, block: int = 128) -> jax.Array:
    """``act_quant`` followed by exact dequantisation, in f32 (the GEMM's effective input)."""
    q, s = act_quant(x, block)
    return (_blocked(q, block).astype(jnp.float32) * s[..., None]).reshape(x.shape)


def gemm_operands(x: jax.Array, w: jax.Array, simulate: bool):
    """Operands of the reference's ``x @ w.T`` for a dequantised weight ``w`` (f32 or BF16).

    ``simulate`` (quantised weights with ``quant_simulation``): the activation goes through
    ``act_quant_dequant`` (FP8 1x128 blocks, as the official FP8/FP4 GEMMs) and both operands
    are BF16 -- exact, since FP8 values and code x power-of-two weights are BF16 numbers -- so
    the only rounding is the f32 accumulation. Otherwise BF16 activations multiply BF16
    weights and f32 activations f32 weights.
    """
    if simulate:
        return act_quant_dequant(x).astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    if x.dtype == jnp.bfloat16:
        return x, w.astype(jnp.bfloat16)
    return x.astype(jnp.float32), w.astype(jnp.float32)


def fp8_simulate(x: jax.Array, block: int = 64) -> jax.Array:
    """In-place FP8 simulation of the KV entry (``act_quant(..., inplace=True)``), same dtype out."""
    xb = _blocked(x, block)
    s = _block_scale(xb, 1e-4, FP8_MAX)
    q = jnp.clip(xb.astype(jnp.float32) / s, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return (q.astype(jnp.float32) * s).astype(x.dtype).reshape(x.shape)


def fp4_simulate(x: jax.Array, block: int = 32) -> jax.Array:
    """In-place MXFP4 simulation (``fp4_act_quant(..., inplace=True)``), same dtype out."""
    xb = _blocked(x, block)
    s = _block_scale(xb, 6.0 * 2.0 ** -126, FP4_MAX)
    q = jnp.clip(xb.astype(jnp.float32) / s, -FP4_MAX, FP4_MAX).astype(FP4_DTYPE)
    return (q.astype(jnp.float32) * s).astype(x.dtype).reshape(x.shape)


def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester (natural order) Hadamard matrix of size ``n`` with +-1 entries."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    i = np.arange(n)
    parity = np.vectorize(lambda v: bin(v).count("1") & 1)(i[:, None] & i[None, :])
    return np.where(parity, -1.0, 1.0).astype(np.float32)


def hadamard_rotate(x: jax.Array) -> jax.Array:
    """``rotate_activation``: orthonormal Hadamard over the last dim, f32 math, one rounding.

    The transform is exact in f32 for bf16 inputs of the sizes used here (sums of 128 terms
    whose magnitudes keep every partial sum representable is not guaranteed, so the matmul runs
    at HIGHEST precision); the 1/sqrt(n) scale is applied afterwards as the kernel does.
    """
    n = x.shape[-1]
    h = jnp.asarray(hadamard_matrix(n))
    y = jnp.matmul(x.astype(jnp.float32), h, precision=jax.lax.Precision.HIGHEST)
    return (y * jnp.float32(n ** -0.5)).astype(x.dtype)


def e8m0_to_f32(scale: jax.Array) -> jax.Array:
    """E8M0 scale (``float8_e8m0fnu`` or raw uint8 exponent byte) to its f32 value 2^(E-127)."""
    if scale.dtype == E8M0_DTYPE:
        return scale.astype(jnp.float32)
    if scale.dtype == jnp.uint8:
        return jax.lax.bitcast_convert_type(scale, E8M0_DTYPE).astype(jnp.float32)
    return scale.astype(jnp.float32)


def unpack_fp4(packed: jax.Array) -> jax.Array:
    """int8/uint8 ``[..., K/2]`` with two e2m1 codes per byte (low nibble first) -> f32 ``[..., K]``."""
    b = jax.lax.bitcast_convert_type(packed, jnp.uint8) if packed.dtype == jnp.int8 else packed
    lo = (b & 0xF).astype(jnp.int32)
    hi = (b >> 4).astype(jnp.int32)
    codes = jnp.stack([lo, hi], axis=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)
    return jnp.asarray(FP4_CODE_VALUES)[codes]


def pack_fp4(values: jax.Array) -> jax.Array:
    """f32 values exactly on the e2m1 grid ``[..., K]`` -> int8 ``[..., K/2]`` (low nibble first)."""
    grid = jnp.asarray(FP4_CODE_VALUES[:8])
    mag = jnp.argmin(jnp.abs(jnp.abs(values)[..., None] - grid), axis=-1).astype(jnp.uint8)
    codes = mag | (jnp.signbit(values).astype(jnp.uint8) << 3)
    codes = codes.reshape(*values.shape[:-1], values.shape[-1] // 2, 2)
    byte = codes[..., 0] | (codes[..., 1] << 4)
    return jax.lax.bitcast_convert_type(byte, jnp.int8)


# The "blocked" FP4 layout: 64 rows x 128 codes (64 bytes) per tile, tiles row-block-major;
# every tile is 4 KB of contiguous bytes, which is how the decode kernels read a K block
# (kernels/grouped_gemm_layout.weight_offset).
FP4_TILE = (64, 64)       # (rows, bytes) of one tile


def can_block_fp4(shape) -> bool:
    """Whether packed FP4 of ``shape`` ``[..., out, in/2]`` is whole 64-row x 128-code tiles."""
    return len(shape) >= 2 and shape[-2] % FP4_TILE[0] == 0 and shape[-1] % FP4_TILE[1] == 0


def block_fp4_weight(packed: jax.Array) -> jax.Array:
    """Packed FP4 ``[..., out, in/2]`` -> the same bytes in the "blocked" layout
    ``[..., out/64, in/128, 64, 64]`` (a copy, made once when weights are loaded)."""
    *lead, out_f, half_in = packed.shape
    rows, cols = FP4_TILE
    if not can_block_fp4(packed.shape):
        raise ValueError(f"block_fp4_weight: packed FP4 [..., out, in/2] needs out a multiple "
                         f"of {rows} and in a multiple of {2 * cols}; got shape "
                         f"{tuple(packed.shape)}")
    tiles = packed.reshape(*lead, out_f // rows, rows, half_in // cols, cols)
    return jnp.swapaxes(tiles, -3, -2)


def unblock_fp4_weight(blocked: jax.Array) -> jax.Array:
    """Inverse of ``block_fp4_weight``: ``[..., out/64, in/128, 64, 64]`` -> ``[..., out, in/2]``."""
    *lead, row_tiles, col_tiles, rows, cols = blocked.shape
    return jnp.swapaxes(blocked, -3, -2).reshape(*lead, row_tiles * rows, col_tiles * cols)


def dequant_fp8_weight(weight: jax.Array, scale: jax.Array, block: int = 128) -> jax.Array:
    """FP8 e4m3 ``[out, in]`` with E8M0 ``[ceil(out/b), ceil(in/b)]`` block scales -> f32."""
    out_f, in_f = weight.shape[-2:]
    s = e8m0_to_f32(scale)
    s = jnp.repeat(jnp.repeat(s, block, axis=-2)[..., :out_f, :], block, axis=-1)[..., :in_f]
    return weight.astype(jnp.float32) * s


def dequant_fp4_weight(packed: jax.Array, scale: jax.Array, block: int = 32) -> jax.Array:
    """Packed FP4 ``[out, in/2]`` with E8M0 ``[out, in/32]`` scales -> f32 ``[out, in]``."""
    w = unpack_fp4(packed)
    s = jnp.repeat(e8m0_to_f32(scale), block, axis=-1)
    return w * s


# ----------------------------------------------------------------------------- weight formats
@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How one weight matrix ``W [out, in]`` is stored (docs/architecture.md §5.2, §5.3).

    ``name`` is the one vocabulary every layer uses (ops, kernels, checkpoints): ``"fp4"``
    (packed e2m1 codes, two per byte, E8M0 scale per 1 x 32 block along the input), ``"fp8"``
    (e4m3 codes, E8M0 scale per 128 x 128 block), or a plain dtype name -- ``"bf16"``,
    ``"f16"``, ``"f32"`` -- with no scale. Stacked weights (``[E, out, in]``) add leading dims.
    ``layout`` is how the bytes lie: ``"rows"`` (``[..., out, stored in]``), or for FP4
    ``"blocked"`` (``FP4_BLOCKED``: ``[..., out/64, in/128, 64, 64]``, ``block_fp4_weight``),
    whose scales stay ``[..., out, in/32]``.
    """
    name: str
    scale_block: tuple[int, int] | None = None   # (rows, columns) per scale; None: plain
    codes_per_byte: int = 1
    layout: str = "rows"      # or "blocked" (packed FP4 in tiles: ``block_fp4_weight``)

    @property
    def quantized(self) -> bool:
        return self.scale_block is not None

    @property
    def label(self) -> str:
        """The name, with the layout where it is not "rows" (for messages)."""
        return self.name if self.layout == "rows" else f"{self.name} ({self.layout})"

    def stored_in(self, in_features: int) -> int:
        """Stored length of a row of ``in_features`` values."""
        return in_features // self.codes_per_byte

    def stored_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        """The weight array's trailing dims for an ``[out, in]`` matrix."""
        if self.layout == "blocked":
            rows, cols = FP4_TILE
            return out_features // rows, self.stored_in(in_features) // cols, rows, cols
        return out_features, self.stored_in(in_features)

    def matrix_dims(self, weight) -> tuple[int, ...]:
        """``(*lead, out, stored in)`` of a weight of this format, whatever its layout (the
        blocked layout's bytes viewed as ``[..., out, in/2]`` rows are its tiles' bytes in
        order, not the rows: a shape, for kernels that read the tiles)."""
        if self.layout == "blocked":
            *lead, row_tiles, col_tiles, rows, cols = weight.shape
            return (*lead, row_tiles * rows, col_tiles * cols)
        return tuple(weight.shape)

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, int] | None:
        """``[ceil(out / rows), ceil(in / cols)]`` E8M0 scales, or None for plain weights."""
        if self.scale_block is None:
            return None
        rows, cols = self.scale_block
        return -(-out_features // rows), -(-in_features // cols)

    def dequantize(self, weight: jax.Array, scale: jax.Array | None, dtype) -> jax.Array:
        """The weight's exact values in ``dtype`` (code x power of two is exact in BF16)."""
        if self is FP4_BLOCKED:
            return dequant_fp4_weight(unblock_fp4_weight(weight), scale).astype(dtype)
        if self is FP4:
            return dequant_fp4_weight(weight, scale).astype(dtype)
        if self is FP8:
            return dequant_fp8_weight(weight, scale).astype(dtype)
        return weight.astype(dtype)


FP4 = WeightFormat("fp4", (1, 32), 2)
FP4_BLOCKED = WeightFormat("fp4", (1, 32), 2, "blocked")
FP8 = WeightFormat("fp8", (128, 128))
BF16 = WeightFormat("bf16")
F16 = WeightFormat("f16")
F32 = WeightFormat("f32")
WEIGHT_FORMATS = {f.name: f for f in (FP4, FP8, BF16, F16, F32)}     # the "rows" layouts
_PLAIN_BY_DTYPE = {jnp.dtype(jnp.bfloat16): BF16, jnp.dtype(jnp.float16): F16,
                   jnp.dtype(jnp.float32): F32}
# Scale dtypes a quantised weight may carry: E8M0 (float8_e8m0fnu or its raw exponent bytes)
# or f32 powers of two.
SCALE_DTYPES = (jnp.dtype(E8M0_DTYPE), jnp.dtype(jnp.uint8), jnp.dtype(jnp.float32))


def is_blocked_fp4(weight) -> bool:
    """Whether ``weight`` is packed FP4 in the "blocked" layout (``[..., out/64, in/128, 64,
    64]`` int8/uint8; no row-layout FP4 weight has more than three dims)."""
    return (jnp.dtype(weight.dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8))
            and weight.ndim >= 4 and tuple(weight.shape[-2:]) == FP4_TILE)


def matrix_dims(weight) -> tuple[int, ...]:
    """``(*lead, out, stored in)`` of a weight in any format and layout
    (``WeightFormat.matrix_dims``)."""
    return (FP4_BLOCKED if is_blocked_fp4(weight) else FP4).matrix_dims(weight)


def weight_format(weight, scale=None, *, name: str = "weight", op: str = "weight") -> WeightFormat:
    """The ``WeightFormat`` of ``weight`` (+ ``scale``) from the storage dtypes.

    ``TypeError`` for an unknown storage dtype, ``ValueError`` when the scale's presence does
    not fit the format; both name ``op`` and ``name`` with the shapes."""
    dt = jnp.dtype(weight.dtype)
    if dt in (jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8)):
        fmt = FP4_BLOCKED if is_blocked_fp4(weight) else FP4
    elif dt == jnp.dtype(FP8_DTYPE):
        fmt = FP8
    elif dt in _PLAIN_BY_DTYPE:
        fmt = _PLAIN_BY_DTYPE[dt]
    else:
        raise TypeError(f"{op}: {name} must be packed FP4 (int8/uint8), FP8 e4m3 or "
                        f"bf16/f16/f32; {name} has shape {tuple(weight.shape)} and dtype {dt}")
    if not fmt.quantized and scale is not None:
        raise ValueError(f"{op}: {name} is plain {dt} and takes no scale; {name} scale has "
                         f"shape {tuple(scale.shape)} and dtype {scale.dtype}")
    if fmt.quantized and scale is None:
        raise ValueError(f"{op}: {name} is {fmt.name.upper()} ({name} has shape "
                         f"{tuple(weight.shape)} and dtype {dt}) and needs its E8M0 scale, "
                         f"got None")
    return fmt


def dequant_weight(weight: jax.Array, scale: jax.Array | None, dtype) -> jax.Array:
    """A weight in any storage format as exact ``dtype`` values (plain weights: a cast)."""
    return weight_format(weight, scale).dequantize(weight, scale, dtype)


def quantize_fp8_weight(w: jax.Array, block: int = 128):
    """f32/bf16 ``[..., out, in]`` -> (e4m3 weight, e8m0 ``[..., out/b, in/b]`` scale).

    Per 128x128 block the scale is the power of two that maps the block's amax into 448;
    used to build quantised random models and test checkpoints in the official format.
    """
    *lead, out_f, in_f = w.shape
    if out_f % block or in_f % block:
        raise ValueError(f"FP8 block quantisation needs dims divisible by {block}, got {w.shape}")
    wb = w.astype(jnp.float32).reshape(*lead, out_f // block, block, in_f // block, block)
    amax = jnp.max(jnp.abs(wb), axis=(-3, -1), keepdims=True)
    s = pow2_ceil_scale(jnp.maximum(amax, 1e-4) * jnp.float32(1.0 / FP8_MAX))
    q = jnp.clip(wb / s, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE).reshape(w.shape)
    return q, s[..., 0, :, 0].astype(E8M0_DTYPE)


def quantize_fp4_weight(w: jax.Array, block: int = 32):
    """f32/bf16 ``[..., out, in]`` -> (packed int8 ``[..., out, in/2]``, e8m0 ``[..., out, in/32]``)."""
    wb = _blocked(w.astype(jnp.float32), block)
    s = _block_scale(wb, 6.0 * 2.0 ** -126, FP4_MAX)
    q = jnp.clip(wb / s, -FP4_MAX, FP4_MAX).astype(FP4_DTYPE).astype(jnp.float32)
    return pack_fp4(q.reshape(w.shape)), s[..., 0].astype(E8M0_DTYPE)


def fp4_to_fp8_weight(packed: jax.Array, scale: jax.Array, block: int = 128, sub: int = 32):
    """Lossless FP4 (1x32 E8M0) -> FP8 (128x128 E8M0) conversion (docs/architecture.md §5.6).

    Per 128x128 block: new scale = max(sub-block scales) / 2^6, e4m3 = e2m1 * (sub / new);
    every product is at most 6 * 2^6 = 384 < 448 and a power-of-two multiple of an e2m1 value,
    so the conversion is exact except for sub-scales more than 2^6 below the block maximum,
    whose smallest codes can underflow e4m3 -- the official converter accepts that too.
    """
    *lead, out_f, half_in = packed.shape
    in_f = half_in * 2
    if out_f % block or in_f % block:
        raise ValueError(f"FP4->FP8 conversion needs dims divisible by {block}, got {(out_f, in_f)}")
    sub_scale = e8m0_to_f32(scale)                                    # [..., out, in/32]
    blk = sub_scale.reshape(*lead, out_f // block, block, in_f // block, block // sub)
    new_scale = jnp.max(blk, axis=(-3, -1)) / 64.0                     # [..., out/b, in/b]
    ratio = blk / new_scale[..., :, None, :, None]
    ratio = jnp.repeat(ratio.reshape(*lead, out_f, in_f // sub), sub, axis=-1)
    q = (unpack_fp4(packed) * ratio).astype(FP8_DTYPE)
    return q, new_scale.astype(E8M0_DTYPE)
