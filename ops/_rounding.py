"""Bit-exact float conversions for the Triton kernels that write and read caches (``kv_cache_insert``,
``kv_cache_gather``, ``gqa_kv_cache_insert``), shared so that they all round the same way.

Two routes to the same bits, chosen by each kernel's ``HW_CVT`` launch flag:
- on the GPU, the hardware conversions (``cvt.rn.satfinite`` to e4m3, ``cvt.rn`` to bf16 / fp16: round
  to nearest even), with NaN replaced by the format's canonical pattern;
- under the Triton interpreter, which truncates in ``.to(float8 / bfloat16)``, integer routines
  (``round_to_small_float``) that compute the rounded bit pattern from the float32 bits.
Both equal PyTorch's round-to-nearest-even conversions, which the CPU kernels use; the tests compare
the bytes of all three. A GPU before sm_89 (Ampere) has no float8 conversion instructions (and Triton
refuses the float8 types there): the float8 conversions take the integer routines on it, decided when
the kernel is compiled (``cuda_capability_geq``), and every other conversion stays in hardware.
``e4m3_to_f32`` is the reverse conversion, by the same rule, except that an NVIDIA GPU before sm_89
decodes four bytes at a time by inline PTX (``e4m3_place_f16``: integer operations and byte permutes,
the same values).
"""

from __future__ import annotations

import os

from ._triton import cuda_capability_geq, tl, triton

# Under the interpreter on a machine with a GPU, ``cuda_capability_geq`` answers for that GPU, and the
# interpreter decodes the e4m3fn NaN bytes as +-480 (the GPU gives NaN): ``e4m3_to_f32`` mends that.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


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


@triton.jit
def clamp_keep_nan(x, bound):
    """``x`` clamped to ``[-bound, bound]``, NaN kept (the GPU's plain min / max return the other
    operand for a NaN, the interpreter's keep it: without ``propagate_nan`` the two backends differ)."""
    x = tl.maximum(x, -bound, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(x, bound, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def e4m3_byte(y, HW_CVT: tl.constexpr):
    """int32 e4m3fn bits of float32 ``y`` already clamped to [-448, 448]: round to nearest even; NaN -> 0x7F.
    On the GPU the hardware conversion (round to nearest even, the same bits); under the interpreter,
    which truncates in ``.to()``, and on a GPU before sm_89 the integer routine (``e4m3_bits``)."""
    if HW_CVT and cuda_capability_geq(8, 9):
        bits = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        bits = e4m3_bits(y)
    return tl.where(y != y, 0x7F, bits)


# Four float32 values ($1..$4) to four e4m3fn bytes in one register ($0, value i in byte i): the
# saturating conversion (round to nearest even; beyond +-448, infinities included, +-448), then every
# NaN byte (low seven bits all set) loses its sign bit, so that NaN is stored as 0x7F. Adding 1 to a
# byte's low seven bits carries into its bit 7 exactly when they are all set, and never into the next
# byte.
F32X4_TO_E4M3X4 = tl.constexpr("""{
.reg .b16 lo, hi;
.reg .b32 w, t;
cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
mov.b32 w, {lo, hi};
and.b32 t, w, 0x7F7F7F7F;
add.u32 t, t, 0x01010101;
and.b32 t, t, 0x80808080;
not.b32 t, t;
and.b32 $0, w, t;
}""")


@triton.jit
def e4m3_bytes(y, HW_CVT: tl.constexpr):
    """uint8 e4m3fn bytes of float32 ``y``: round to nearest even, saturating at +-448, NaN -> 0x7F.
    On the GPU four values per conversion sequence (``F32X4_TO_E4M3X4``: the saturating hardware
    conversion makes the clamp, and the bytes come out packed); under the interpreter and on a GPU
    before sm_89 the clamp and the integer routine."""
    if HW_CVT and cuda_capability_geq(8, 9):
        return tl.inline_asm_elementwise(F32X4_TO_E4M3X4, "=r,r,r,r,r", [y], dtype=tl.uint8, is_pure=True,
                                         pack=4)
    else:
        return e4m3_byte(clamp_keep_nan(y, 448.0), False).to(tl.uint8)


def e4m3_place_ptx(src: str, out: tuple[str, str]) -> str:
    """PTX lines turning the four e4m3fn bytes of register ``src`` into float16 values times ``2**-8``,
    exactly, with integer operations only (bytes 0, 1 into register ``out[0]``, bytes 2, 3 into
    ``out[1]``, byte k -> element k): for GPUs without a float8 conversion (before sm_89). A float16
    whose sign is the byte's bit 7 and whose bits 7-13 are the byte's bits 0-6 (bit 14 and bits 0-6
    zero) is the e4m3 value times ``2**-8``: the four exponent bits land in the low four bits of the
    float16 exponent field (biases 7 and 15), the three mantissa bits in its top three, and a zero
    exponent gives a float16 subnormal. So per four bytes: the magnitudes ``m`` (bits 0-6 of each
    byte), with bit 7 set where a magnitude is ``0x7F`` (NaN: adding 1 to it carries into bit 7, never
    into the next byte), and the signs moved to bit 0 of each byte (``s``); per two values one byte
    permute builds ``[s(b1), m(b0), s(b0), m(b1)]`` (low byte first) and a rotation right by one bit
    moves every field into place: bit 0 to 31 and bit 16 to 15 (the signs), bits 8-15 to 7-14 and
    24-31 to 23-30 (a NaN byte's flag becomes bit 14, which with bits 7-13 all set makes a float16
    NaN). Nine operations per four values. The caller declares ``.reg .b32 m, n, s``."""
    lines = [f"and.b32 m, {src}, 0x7F7F7F7F;", "add.u32 n, m, 0x01010101;",
             "lop3.b32 m, m, n, 0x80808080, 0xF8;",  # m | (n & 0x80808080)
             f"shr.b32 s, {src}, 7;", "and.b32 s, s, 0x01010101;"]
    for reg, sel in zip(out, ("0x1405", "0x3627")):  # selector nibble k: byte k of the result (4-7: s)
        lines += [f"prmt.b32 {reg}, m, s, {sel};", f"shf.r.wrap.b32 {reg}, {reg}, {reg}, 1;"]
    return "".join(line + "\n" for line in lines)


# The PTX of ``e4m3_place_f16`` (one instance: four e4m3 bytes in $2; elements 0, 1 out in $0 and 2, 3
# in $1, two float16 per register). tests/test_sparse_gqa.py runs it through a model of its
# instructions for every byte value in every lane.
E4M3_PLACE_PTX = tl.constexpr("{\n.reg .b32 m, n, s;\n" + e4m3_place_ptx("$2", ("$0", "$1")) + "}\n")


@triton.jit
def e4m3_place_f16(raw):
    """NVIDIA GPU only (any from sm_80): float16 tensor shaped like the uint8 tensor ``raw`` of e4m3fn
    bytes, each value times ``2**-8`` (exact; NaN bytes -> NaN), its bits placed by integer operations
    and byte permutes, four bytes per instance (``e4m3_place_ptx``). For GPUs before sm_89, which have
    no float8 conversion; the caller takes the ``2**-8`` back (a power of two: exact)."""
    return tl.inline_asm_elementwise(
        asm=E4M3_PLACE_PTX, constraints="=r,=r,r", args=[raw], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def e4m3_to_f16_bits(raw):
    """float16 of e4m3fn bytes ``raw`` (uint8) by integer operations, exactly (subnormals included):
    the sign moved to bit 15 and the exponent and mantissa bits to bits 7-13 make the float16 of the
    value times ``2**-8``, and the product with ``2**8`` is exact. NaN (``0x7F``, ``0xFF``) -> NaN."""
    r = raw.to(tl.int32)
    bits = (((r & 0x80) << 8) | ((r & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.where((r & 0x7F) == 0x7F, float("nan"), bits * 256.0)


@triton.jit
def e4m3_to_f32(raw):
    """float32 of e4m3fn bytes ``raw`` (uint8): the hardware conversion on a GPU of sm_89 or later, the
    bit placement of ``e4m3_place_f16`` on an NVIDIA GPU before (an A100), else (the interpreter, an
    AMD GPU) ``e4m3_to_f16_bits``. The same values on every route; NaN (``0x7F``, ``0xFF``) -> NaN."""
    if cuda_capability_geq(8, 9):
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if _INTERPRETED:
            x = tl.where((raw & 0x7F) == 0x7F, float("nan"), x)
    elif cuda_capability_geq(8, 0):
        if _INTERPRETED:  # the interpreter on a machine with such a GPU: no inline PTX
            x = e4m3_to_f16_bits(raw).to(tl.float32)
        else:
            x = e4m3_place_f16(raw).to(tl.float32) * 256.0
    else:
        x = e4m3_to_f16_bits(raw).to(tl.float32)
    return x


@triton.jit
def half_bits(x, STORE: tl.constexpr, HW_CVT: tl.constexpr):
    """int16 bits of float32 ``x`` rounded to bfloat16 (STORE 1) or float16 (STORE 2), round to nearest
    even; NaN -> the canonical NaN. Hardware conversion on the GPU, integer routine in the interpreter."""
    if STORE == 1:
        if HW_CVT:
            bits = x.to(tl.bfloat16).to(tl.int16, bitcast=True)
        else:
            bits = bf16_bits(x).to(tl.int16)
        return tl.where(x != x, 0x7FC0, bits).to(tl.int16)
    else:
        if HW_CVT:
            bits = x.to(tl.float16).to(tl.int16, bitcast=True)
        else:
            bits = f16_bits(x).to(tl.int16)
        return tl.where(x != x, 0x7E00, bits).to(tl.int16)
