"""Bit-exact float conversions for the Triton kernels that write caches (``kv_cache_insert``,
``gqa_kv_cache_insert``), shared so both round the same way.

Why integer arithmetic: the Triton interpreter truncates in ``.to(float8 / bfloat16)`` while the GPU
rounds to nearest even, and the written bytes must be identical on every backend. These functions
compute the rounded bit pattern from the float32 bits with integer operations only, so the GPU and the
interpreter give the same bits, and those bits equal PyTorch's round-to-nearest-even conversions.
"""

from __future__ import annotations

from ._triton import tl, triton


@triton.jit
def round_to_small_float(x, MBITS: tl.constexpr, EBITS: tl.constexpr, BIAS: tl.constexpr,
                         MAX_MAG: tl.constexpr, NAN_BITS: tl.constexpr):
    """int32 bit pattern of float32 ``x`` rounded to nearest even in a float format with ``MBITS``
    mantissa bits, ``EBITS`` exponent bits and exponent bias ``BIAS`` (subnormals included); the
    magnitude saturates at the pattern ``MAX_MAG`` (448 for e4m3fn, so +-inf too; inf for bf16/fp16);
    every NaN becomes ``NAN_BITS``, the format's canonical quiet NaN. Integer arithmetic only, so the
    GPU and the interpreter give the same bits."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    is_nan = mag > 0x7F800000  # (the rounding below overflows int32 for these; the select drops it)
    exp = mag >> 23
    SHIFT: tl.constexpr = 23 - MBITS
    # Normal results: round the float32 mantissa to MBITS bits (a carry moves into the exponent), rebias.
    normal = ((mag + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MBITS)
    # Subnormal results (|x| < 2**(1 - BIAS)): the significand counted in units of the smallest
    # subnormal, 2**(1 - BIAS - MBITS), rounded to an integer; 2**MBITS units is the smallest normal.
    sig = (mag & 0x7FFFFF) | tl.where(exp > 0, 0x800000, 0)
    # float32 subnormals (exp == 0) have the scale of exp == 1; [1, 31] keeps every shift defined.
    drop = tl.minimum(tl.maximum(151 - BIAS - MBITS - tl.maximum(exp, 1), 1), 31)
    kept = sig >> drop
    rest = sig & ((1 << drop) - 1)
    half = 1 << (drop - 1)
    sub = kept + ((rest > half) | ((rest == half) & ((kept & 1) == 1))).to(tl.int32)
    mag_out = tl.minimum(tl.where(exp < 128 - BIAS, sub, normal), MAX_MAG)
    return tl.where(is_nan, NAN_BITS, mag_out | (sign << (EBITS + MBITS)))


@triton.jit
def e4m3_bits(x):
    return round_to_small_float(x, 3, 4, 7, 0x7E, 0x7F)


@triton.jit
def bf16_bits(x):
    return round_to_small_float(x, 7, 8, 127, 0x7F80, 0x7FC0)


@triton.jit
def f16_bits(x):
    return round_to_small_float(x, 10, 5, 15, 0x7C00, 0x7E00)


@triton.jit
def load_as_f32(ptrs, mask, IS_BF16: tl.constexpr):
    """float32 of the values at ``ptrs``; bf16 arrives as int16 bits and is widened by a shift (the
    interpreter's ``.to(float32)`` turns bf16 subnormals into wrong values)."""
    if IS_BF16:
        return (tl.load(ptrs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
