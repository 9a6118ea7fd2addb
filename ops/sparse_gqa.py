"""Kernels of the sparse GQA operators: ``sparse_gqa_decode`` and ``gqa_kv_cache_insert``.

Every entry point takes the ``out`` overload's arguments with the schema's defaults, outputs
keyword-only. Naming: ``_sparse_gqa_decode_kernel`` / ``_sparse_gqa_combine_kernel`` /
``_gqa_kv_cache_insert_kernel`` (Triton) -> ``NAME_triton`` (launchers) and ``NAME_torch`` (PyTorch).

Cache formats (``docs/sparse_gqa.md``): a *value* cache ``[pages, Hkv, page_size, 2 * Dh]`` of bf16,
fp16 or float8_e4m3fn (K = ``[..., :Dh]``, V = ``[..., Dh:]``), or an *NVFP4* cache, uint8
``[pages, 2 * Hkv, page_size, 72]`` with Dh = 128: slot ``2g`` holds KV head ``g``'s K, slot ``2g + 1``
its V, each ``page_size * 72`` contiguous bytes (``page_size`` data rows of 64 bytes, 4-bit E2M1 codes
with the low nibble first, then ``page_size * 8`` e4m3 scale bytes, one per 16 values; K scales in
token order, V scales in token-quad order).

Decode rules shared by both backends (the arguments were validated by the fake, from metadata only):
- row ``t`` belongs to request ``r = t // decode_query_len``; a row with ``r >= B`` has no key;
- a selected page ``b`` is used when ``0 <= b < W`` and its physical page ``p = block_table[r, b]``
  satisfies ``0 <= p < kv_cache.shape[0]``; nothing outside those bounds is ever read;
- inside a used page, key ``o`` (position ``x = b * page_size + o``) is used when
  ``x < min(qo_offset[t] + 1, kv_segment_lens[t])``; unused keys are never read (a masked load, not a
  product with zero), so stale, NaN or garbage bytes past a sequence's end cannot reach the output;
- a selected page listed twice counts twice (the contract assumes distinct pages and nothing checks it);
- ``score = softmax_scale * q_scale * k_scale * k_scale_tensor * <q, k>`` and
  ``out = v_scale * v_scale_tensor * softmax(score) @ v`` in float32; a row without keys gets zeros;
- overflow: products of the scale factors and scores are clamped to the finite float32 range, so the
  running maximum is always finite and a score that overflows float32 cannot produce NaN (the keys with
  the largest, saturated scores share the weight).

Insert rounding (both backends write identical bytes): divisions are correctly rounded (IEEE on the
CPU and in the interpreter; on the GPU ``tl.math.div_rn``, or the correctly rounded reciprocal with
Markstein's correction where that is exact, see ``_quotient``; Triton's ``/`` is approximate there);
conversions to e4m3 / bf16 / fp16 round to nearest even (the hardware conversions on the GPU, the
integer routines of ``ops/_rounding.py`` in the interpreter, which truncates in ``.to()``); NaN inputs
are stored as the format's canonical NaN; bf16 inputs are widened by a shift of their bits.
"""

from __future__ import annotations

import math

import torch

from ..meta_kernels.sparse_gqa import (
    FLOAT32_MAX,
    NVFP4_DATA_BYTES,
    NVFP4_GROUP,
    NVFP4_SCALE_BYTES,
    NVFP4_TOKEN_BYTES,
    is_nvfp4,
    kv_heads,
)
from ._formats import e2m1_place_ptx, e4m3_to_float32, written_slots
from ._launch import (LOG2E, KernelLaunch, LaunchPlan, PlanCache, cdiv, float8_conversions, multiprocessor_count,
                      next_pow2, prev_pow2, scratch, wait_for_prior_grid)
from ._rounding import e4m3_place_f16, e4m3_to_f16_bits, e4m3_to_f32, load_as_f32
from ._rounding import clamp_keep_nan as _clamp_keep_nan
from ._rounding import e4m3_byte as _e4m3_byte
from ._rounding import e4m3_bytes as _e4m3_bytes
from ._rounding import half_bits as _half_bits
from ._triton import cuda_capability_geq, tl, triton
from . import sparse_gqa_hopper as hopper

E4M3_MAX = 448.0
# Canonical NaN patterns written for NaN inputs (sign dropped).
NAN_BF16, NAN_F16, NAN_E4M3 = 0x7FC0, 0x7E00, 0x7F


def scale_product(*factors: float) -> float:
    """The product of Python float scales, clamped to the finite float32 range (0 if any factor is 0):
    the kernels compute in float32, and an infinite factor would turn a zero score into NaN."""
    if any(f == 0 for f in factors):
        return 0.0
    p = 1.0
    for f in factors:
        p *= f
        if math.isinf(p):
            break
    return min(max(p, -FLOAT32_MAX), FLOAT32_MAX)


# =====================================================================================================
# PyTorch kernels
# =====================================================================================================

# Gathered float32 elements per chunk of rows in the CPU kernel (bounds its memory to a few hundred MB).
_TORCH_CHUNK_ELEMENTS = 1 << 24


def _nvfp4_slot_values(slot: torch.Tensor, page_size: int, v_order: bool, keep: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., page_size, 128]`` of NVFP4 slots ``slot [..., page_size * 72]`` (uint8, each slot's
    bytes in memory order; a copy, which this zeroes in part): ``e2m1(code) * e4m3(scale)``, without the
    per-tensor scales, and exactly 0 for the tokens whose ``keep [..., page_size]`` (uint8) is 0: their
    codes and scale bytes are zeroed before decoding."""
    data = slot[..., : page_size * NVFP4_DATA_BYTES].unflatten(-1, (page_size, NVFP4_DATA_BYTES))
    data = data.mul_(keep[..., None])
    scale_bytes = slot[..., page_size * NVFP4_DATA_BYTES:]
    if v_order:  # scale j of token o at (o // 4) * 32 + j * 4 + o % 4
        scale_bytes = scale_bytes.unflatten(-1, (page_size // 4, NVFP4_SCALE_BYTES, 4)).transpose(-1, -2)
    scale_bytes = scale_bytes.reshape(*slot.shape[:-1], page_size, NVFP4_SCALE_BYTES) * keep[..., None]
    scales = e4m3_to_float32(scale_bytes)
    codes = torch.stack([data & 15, data >> 4], dim=-1).flatten(-2)  # value 2i: low nibble of byte i
    # Each code as the e4m3 byte of its value times 2^-6 (the sign to bit 7, the exponent and mantissa
    # bits to bits 2-4), decoded, and the 2^6 put back with the scale: an E2M1 value has at most 2
    # significant bits and an e4m3 scale 4, so both products are the exact ``e2m1 * scale``.
    values = e4m3_to_float32(((codes & 8) << 4) | ((codes & 7) << 2))
    values = values.unflatten(-1, (NVFP4_SCALE_BYTES, NVFP4_GROUP)) * (scales[..., None] * 64.0)
    return values.flatten(-2)


def sparse_gqa_decode_dense(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len,
                            softmax_scale, q_scale=1.0, k_scale=1.0, v_scale=1.0, k_scale_tensor=None,
                            v_scale_tensor=None, first_row=0):
    """The whole operator as one gather-and-softmax expression: float32 ``[T, Hq, Dh]``.

    ``first_row`` is the absolute index of ``q``'s first row (the CPU kernel calls this on chunks of
    rows; the request of row ``t`` is ``(first_row + t) // decode_query_len``).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    nvfp4 = is_nvfp4(kv_cache)
    num_pages, page_size = kv_cache.shape[0], kv_cache.shape[2]
    num_kv_heads = kv_heads(kv_cache)
    num_req, max_blocks = block_table.shape
    n_sel = topk_pages.shape[2]
    group = num_q_heads // num_kv_heads
    device = q.device
    if num_tokens * num_q_heads * n_sel * num_pages * num_req * max_blocks * page_size == 0:
        return torch.zeros((num_tokens, num_q_heads, head_dim), dtype=torch.float32, device=device)

    t = torch.arange(first_row, first_row + num_tokens, device=device)
    req = torch.div(t, decode_query_len, rounding_mode="floor")
    b = topk_pages.to(torch.int64)  # [T, Hkv, n]
    page_ok = (b >= 0) & (b < max_blocks) & (req < num_req)[:, None, None]
    phys = block_table[req.clamp(max=num_req - 1)[:, None, None], b.clamp(0, max_blocks - 1)].to(torch.int64)
    page_ok = page_ok & (phys >= 0) & (phys < num_pages)
    limit = torch.minimum(qo_offset.to(torch.int64) + 1, kv_segment_lens.to(torch.int64))  # [T]
    pos = b[..., None] * page_size + torch.arange(page_size, device=device)  # [T, Hkv, n, page_size]
    key_ok = (page_ok[..., None] & (pos < limit[:, None, None, None])).flatten(2)  # [T, Hkv, L]

    heads = torch.arange(num_kv_heads, device=device)[None, :, None]
    phys = phys.clamp(0, num_pages - 1)
    # Clamped indices may point at pages holding NaN or garbage: the keys a row may not see are zeroed
    # exactly, as bytes of the gathered copy before decoding (an integer multiply; the value is then +0
    # in every format), never as values multiplied by zero.
    if nvfp4:
        # The slot's page_size x 72 block is contiguous (checked by the fake): flatten gives memory order.
        keep = key_ok.unflatten(2, (n_sel, page_size)).to(torch.uint8)
        k = _nvfp4_slot_values(kv_cache[phys, 2 * heads].flatten(-2), page_size, False, keep).flatten(2, 3)
        v = _nvfp4_slot_values(kv_cache[phys, 2 * heads + 1].flatten(-2), page_size, True, keep).flatten(2, 3)
    else:
        raw = kv_cache[phys, heads].flatten(2, 3)  # [T, Hkv, L, 2*Dh], a copy in the cache's dtype
        bits = raw.view(torch.uint8 if raw.element_size() == 1 else torch.int16)
        bits = bits.mul_(key_ok[..., None].to(bits.dtype))
        # K and V decoded apart, each into a contiguous float32 operand of its product
        if raw.dtype == torch.float8_e4m3fn:
            k, v = e4m3_to_float32(bits[..., :head_dim]), e4m3_to_float32(bits[..., head_dim:])
        else:
            k, v = (bits[..., half].view(raw.dtype).to(torch.float32)
                    for half in (slice(0, head_dim), slice(head_dim, None)))

    qf = q.to(torch.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = torch.einsum("tgid,tgld->tgil", qf, k) * scale_product(softmax_scale, q_scale, k_scale)
    if k_scale_tensor is not None:
        scores = scores * k_scale_tensor.reshape(())
    # Saturate overflowing scores: the maximum stays finite, exp never sees inf - inf.
    scores = torch.where(key_ok[:, :, None, :], scores.clamp_(-FLOAT32_MAX, FLOAT32_MAX), float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(row_max == float("-inf"), 0.0, row_max)  # rows without keys: exp(-inf) = 0
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    o = torch.einsum("tgil,tgld->tgid", p, v) * (scale_product(v_scale) / torch.where(denom > 0, denom, 1.0))
    if v_scale_tensor is not None:
        o = o * v_scale_tensor.reshape(())
    return o.reshape(num_tokens, num_q_heads, head_dim)


def sparse_gqa_decode_torch(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len,
                            softmax_scale, q_scale=1.0, k_scale=1.0, v_scale=1.0, k_scale_tensor=None,
                            v_scale_tensor=None, *, out):
    """CPU kernel. Arguments: the ``out`` overload's."""
    num_tokens = q.shape[0]
    _, slots, page_size, width = kv_cache.shape
    per_row = max(slots * topk_pages.shape[2] * page_size * max(width, 2 * q.shape[2]) * 2, 1)
    rows = max(_TORCH_CHUNK_ELEMENTS // per_row, 1)
    for start in range(0, num_tokens, rows):
        end = min(start + rows, num_tokens)
        o = sparse_gqa_decode_dense(q[start:end], kv_cache, topk_pages[start:end], block_table,
                                    kv_segment_lens[start:end], qo_offset[start:end], decode_query_len,
                                    softmax_scale, q_scale, k_scale, v_scale, k_scale_tensor, v_scale_tensor,
                                    first_row=start)
        out[start:end].copy_(o)


def _total_scale(scale: float, scale_tensor, device) -> torch.Tensor:
    """float32 ``s = fl32(scale) * scale_tensor[0]`` (a 0-d tensor), as the Triton kernel computes it."""
    s = torch.tensor(scale, dtype=torch.float32, device=device)
    return s if scale_tensor is None else s * scale_tensor.reshape(()).to(device)


def _bits_with_canonical_nan(converted: torch.Tensor, x: torch.Tensor, nan_bits: int, int_dtype) -> torch.Tensor:
    """The integer bits of ``converted`` with NaN entries of ``x`` replaced by ``nan_bits``."""
    return torch.where(torch.isnan(x), torch.tensor(nan_bits, dtype=int_dtype, device=x.device),
                       converted.view(int_dtype))


def _encode_values_torch(x: torch.Tensor, cache_dtype: torch.dtype, s: torch.Tensor) -> torch.Tensor:
    """Bits (int16, or uint8 for float8) of float32 ``x`` stored in a value cache of ``cache_dtype``."""
    if cache_dtype == torch.float8_e4m3fn:
        y = (x / s).clamp(-E4M3_MAX, E4M3_MAX)  # IEEE division; clamp keeps NaN
        return _bits_with_canonical_nan(y.to(cache_dtype), y, NAN_E4M3, torch.uint8)
    nan = NAN_BF16 if cache_dtype == torch.bfloat16 else NAN_F16
    return _bits_with_canonical_nan(x.to(cache_dtype), x, nan, torch.int16)


def nvfp4_encode_torch(x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 ``[..., 64]`` data bytes, uint8 ``[..., 8]`` scale bytes) of float32 ``x [..., 128]`` with
    the total scale ``s`` (0-d float32): per 16 values ``scale = e4m3(amax / (6 * s))`` (round to nearest
    even, saturating at 448; NaN if the group holds a NaN), codes = the E2M1 value nearest to
    ``x / (scale * s)`` (ties to the even code, magnitudes above 6 clamp to 6; sign = the sign bit of
    ``x``; every code 0 when the rounded scale is 0 or NaN)."""
    groups = x.unflatten(-1, (NVFP4_SCALE_BYTES, NVFP4_GROUP))
    amax = groups.abs().amax(dim=-1)  # NaN propagates
    scale_f = (amax / (6.0 * s)).clamp(-E4M3_MAX, E4M3_MAX)
    scale_bytes = _bits_with_canonical_nan(scale_f.to(torch.float8_e4m3fn), scale_f, NAN_E4M3, torch.uint8)
    scale = scale_bytes.view(torch.float8_e4m3fn).to(torch.float32)
    y = (groups / (scale * s)[..., None]).abs()
    mag = ((y > 0.25).int() + (y >= 0.75).int() + (y > 1.25).int() + (y >= 1.75).int() + (y > 2.5).int()
           + (y >= 3.5).int() + (y > 5.0).int())
    sign = (groups.view(torch.int32) < 0).int()
    dead = (scale == 0) | torch.isnan(scale)  # a zero or NaN scale: every code of the group is 0
    codes = torch.where(dead[..., None], 0, mag | (sign << 3)).flatten(-2)
    data = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return data, scale_bytes


def gqa_kv_cache_insert_torch(k, v, slot_mapping, kv_cache, k_scale=1.0, v_scale=1.0, k_scale_tensor=None,
                              v_scale_tensor=None):
    """CPU kernel: quantise ``k[i]``, ``v[i]`` and write them to slot ``slot_mapping[i]``."""
    pages, page_size = kv_cache.shape[0], kv_cache.shape[2]
    written = written_slots(slot_mapping, pages, page_size)
    if written is None:
        return
    keep, page, row = written
    device = kv_cache.device
    ks = _total_scale(k_scale, k_scale_tensor, device)
    vs = _total_scale(v_scale, v_scale_tensor, device)
    kf, vf = k[keep].to(torch.float32), v[keep].to(torch.float32)  # [n, Hkv, Dh]
    if not is_nvfp4(kv_cache):
        head_dim = kf.shape[2]
        int_dtype = torch.uint8 if kv_cache.dtype == torch.float8_e4m3fn else torch.int16
        bits = kv_cache.view(int_dtype)
        bits[page, :, row, :head_dim] = _encode_values_torch(kf, kv_cache.dtype, ks)
        bits[page, :, row, head_dim:] = _encode_values_torch(vf, kv_cache.dtype, vs)
        return
    # NVFP4: byte positions of each written field inside a flat [pages, page bytes] view (the layout,
    # not stride(2), places the scale bytes).
    num_kv_heads = kf.shape[1]
    slot_bytes = page_size * NVFP4_TOKEN_BYTES
    flat = torch.as_strided(kv_cache, (pages, 2 * num_kv_heads * slot_bytes), (kv_cache.stride(0), 1))
    heads = torch.arange(num_kv_heads, device=device)
    j = torch.arange(NVFP4_SCALE_BYTES, device=device)
    data_cols = row[:, None, None] * NVFP4_DATA_BYTES + torch.arange(NVFP4_DATA_BYTES, device=device)
    scale_base = page_size * NVFP4_DATA_BYTES
    for kv_index, (x, s) in enumerate(((kf, ks), (vf, vs))):
        data, scale_bytes = nvfp4_encode_torch(x, s)  # [n, Hkv, 64], [n, Hkv, 8]
        slot_start = ((2 * heads + kv_index) * slot_bytes)[None, :, None]
        if kv_index == 0:
            scale_cols = scale_base + row[:, None, None] * NVFP4_SCALE_BYTES + j
        else:
            scale_cols = scale_base + (row[:, None, None] // 4) * 32 + j * 4 + row[:, None, None] % 4
        flat[page[:, None, None], slot_start + data_cols] = data
        flat[page[:, None, None], slot_start + scale_cols] = scale_bytes


# =====================================================================================================
# Triton: the decode kernel
# =====================================================================================================

# Operand dtype of tl.dot, chosen by the launcher from the query and cache dtypes.
_DOT_FP16, _DOT_BF16, _DOT_FP32 = 0, 1, 2
# Cache format of the KV_FMT constexpr.
_FMT_VALUES, _FMT_NVFP4 = 0, 1


@triton.jit
def _dot(a, b, acc, DOT: tl.constexpr):
    # float32 operands only occur for a float16 query over a bfloat16 cache: exact products, not TF32.
    if DOT == 2:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _values(x):
    """Loaded query or cache values as a float type: float8 that arrives as its bytes (``uint8``: a GPU
    before sm_89, where Triton has no float8 type, and the interpreter) is decoded to float16 by
    integer operations (exact); other dtypes pass unchanged."""
    if x.dtype == tl.uint8:
        y = e4m3_to_f16_bits(x)
    else:
        y = x
    return y


@triton.jit
def _to_dot(x, DOT: tl.constexpr):
    """-> the tl.dot operand dtype."""
    if DOT == 0:
        return x.to(tl.float16)
    elif DOT == 1:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def _pow2_row_scale(rmax):
    """Powers of two ``(up, down)`` per row: ``rmax * up`` lies in ``[2**14, 2**15)`` (so a bfloat16
    query fits float16 without losing a bit), ``up * down == 1``; ``up`` is capped at ``2**64`` so
    ``down`` stays a normal float32 (rows below ``2**-50`` then keep fewer bits: their scores are 0)."""
    e = (rmax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of the row's max |q|
    k = tl.minimum(141 - e, 64)  # rmax * 2**k in [2**14, 2**15) for normal rmax
    up = ((127 + k) << 23).to(tl.float32, bitcast=True)
    down = ((127 - k) << 23).to(tl.float32, bitcast=True)
    return up, down


# The PTX of ``_e2m1_place_asm`` (one instance: four bytes in $4; low nibbles out in $0, $1 and high
# nibbles in $2, $3, two float16 per register, byte k -> element k). tests/test_sparse_gqa.py runs it
# through a small PTX model for every byte value.
E2M1_PLACE_PTX = tl.constexpr("{\n.reg .b32 t, u, e, z;\n" + e2m1_place_ptx("$4", ("$0", "$1"), ("$2", "$3")) + "}\n")


@triton.jit
def _e2m1_place_asm(b):
    """GPU only: ``(lo, hi)`` float16 tensors shaped like the uint8 tensor ``b``: the E2M1 values of the
    low and the high nibble of each byte, times ``2**-14`` (exact), placed as float16 bits by integer
    operations and byte permutes, four bytes per instance (``_formats.e2m1_place_ptx``: the nibble's sign
    to bit 15, its exponent bits to the low two bits of the exponent field and its mantissa bit to the
    top mantissa bit; a zero exponent gives a float16 subnormal). No float8 conversion, so every CUDA GPU
    runs it, those before sm_89 included."""
    return tl.inline_asm_elementwise(
        asm=E2M1_PLACE_PTX,
        constraints="=r,=r,=r,=r,r", args=[b], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


#: What ``_rounding.e4m3_place_f16`` leaves on every value (``2**-8``): the kernel multiplies its score
#: factor (K) and the decoded V tile (by a float16 run-time value, which also keeps the compiler from
#: moving the decoding past the tile's layout change) by this to undo it (exact: a power of two).
E4M3_PLACE_MULT = tl.constexpr(256.0)


@triton.jit
def _cache_values(x, PLACE8: tl.constexpr):
    """Loaded value-cache elements as a float type: with ``PLACE8`` (float8 bytes on an NVIDIA GPU
    before sm_89) float16 times ``2**-8`` (``_rounding.e4m3_place_f16``), else ``_values``."""
    if PLACE8:
        y = e4m3_place_f16(x)
    else:
        y = _values(x)
    return y


@triton.jit
def _e2m1_f32(code):
    """float32 E2M1 value of 4-bit codes (int32): built in the exponent and mantissa fields (exact)."""
    m = code & 7
    mag = tl.where(m >= 2, (((m >> 1) + 126) << 23) | ((m & 1) << 22), tl.where(m == 1, 126 << 23, 0))
    return (mag | ((code & 8) << 28)).to(tl.float32, bitcast=True)


#: What the NVIDIA path of ``_nvfp4_tile`` leaves on every value (``2**-7``): the kernel multiplies
#: its score factor and its accumulators by this to undo it (exact: a power of two).
NVFP4_GPU_MULT = tl.constexpr(128.0)


@triton.jit
def _nvfp4_scales(scale_bytes, x128, PLACE: tl.constexpr):
    """The e4m3 scale bytes as the factors of ``_nvfp4_tile``: with ``PLACE`` (an NVIDIA GPU from sm_80)
    float16 ``scale * 128`` (exact, at most 448 * 128 = 57,344; by the hardware conversion from sm_89, by
    integer operations before), float32 ``scale`` otherwise (the interpreter, an AMD GPU). ``x128`` is
    128.0 as a float16 run-time value: the product with it keeps the compiler from moving the layout
    change of the MMA operand before the decoding (which would shuffle bytes instead of using whole
    words)."""
    if PLACE and cuda_capability_geq(8, 9):
        return scale_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float16) * x128
    elif PLACE:
        return e4m3_to_f16_bits(scale_bytes) * x128
    else:
        return e4m3_to_f32(scale_bytes)


@triton.jit
def _nvfp4_tile(data, factors, PLACE: tl.constexpr):
    """float16 ``(even, odd)`` shaped like ``data``: the values of dims ``2i`` and ``2i + 1`` of each key
    from the data bytes (uint8, byte ``i`` of a key in the last dimension) and ``factors``
    (``_nvfp4_scales`` broadcast to ``data``'s shape: byte ``i`` takes scale ``i // 8``). On an NVIDIA
    GPU from sm_80 (``PLACE``) ``e2m1 * e4m3(scale) * 2**-7`` (``NVFP4_GPU_MULT``): the placed values
    (``2**-14``) times the factors (``2**7``), one float16 multiply per value, exact (at most 6
    significant bits, in ``[2**-17, 21]``, where float16 holds them, subnormals included); otherwise
    ``e2m1 * e4m3(scale)`` (exact in float16: at most 6 * 448, and a multiple of 2**-10), in float32
    first."""
    if PLACE:
        lo, hi = _e2m1_place_asm(data)
    else:
        d = data.to(tl.int32)
        lo = _e2m1_f32(d & 15)
        hi = _e2m1_f32(d >> 4)
    return (lo * factors).to(tl.float16), (hi * factors).to(tl.float16)


@triton.jit
def _tile_page(it, sel_idx, phys, n_keys, CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tile ``it`` of a split's key loop: the position of its first key in its page (page ``it //
    CHUNKS`` of the split's list), the page's physical index and its visible key count (picked out of
    the split's vectors, resolved before the loop)."""
    this_page = sel_idx == it // CHUNKS
    return ((it % CHUNKS) * BLOCK_N, tl.sum(tl.where(this_page, phys, 0), axis=0),
            tl.sum(tl.where(this_page, n_keys, 0), axis=0))


@triton.jit
def _sparse_gqa_decode_kernel(
    q_ptr, stride_q_t, stride_q_h, stride_q_d,  # [T, Hq, Dh]
    kv_ptr, stride_kv_p, stride_kv_h, stride_kv_o,  # value cache: [pages, Hkv, page_size, 2*Dh] (stride(-1) == 1);
    #                                                 NVFP4: uint8, page stride and slot stride in bytes
    topk_ptr, stride_tk_t, stride_tk_h, stride_tk_j,  # int32 [T, Hkv, n_sel]
    bt_ptr, stride_bt_r, stride_bt_c,  # int32 [B, W]
    kv_lens_ptr, stride_kvl,  # int32 [T]
    qo_ptr, stride_qo,  # int32 [T]
    k_scale_ptr, v_scale_ptr,  # float32 device scales (read when HAS_K_SCALE / HAS_V_SCALE)
    out_ptr, stride_o_t, stride_o_h, stride_o_d,  # [T, Hq, Dh]; written when not SPLIT
    ws_ptr, ws_rows,  # SPLIT: float32 workspace of m [R], l [R], acc [R, Dh], R = ws_rows = T * Hq * S
    num_kv_heads, group, num_head_blocks,  # group = Hq / Hkv
    num_pages, num_req, max_blocks, n_sel,
    pages_per_split, num_splits, decode_query_len,
    qk_scale,  # softmax_scale * q_scale * k_scale * log2(e), clamped to float32: scores in base 2
    v_scale,  # clamped to float32
    one,  # 1.0 (a float16 multiplier that keeps the compiler from moving a conversion, see below)
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # query heads per program, >= 16 for tl.dot (padding rows are masked)
    BLOCK_D: tl.constexpr,  # next_pow2(HEAD_DIM)
    KEY_GROUPS: tl.constexpr,  # W: key groups per tile, each with its own softmax state (one per warp)
    KPW: tl.constexpr,  # keys per group and tile (>= 16); a tile holds BLOCK_N = W * KPW keys
    BLOCK_SEL: tl.constexpr,  # next_pow2(pages_per_split), at least 2
    CHUNKS: tl.constexpr,  # key tiles per page, cdiv(PAGE_SIZE, BLOCK_N)
    KV_FMT: tl.constexpr,  # _FMT_VALUES / _FMT_NVFP4
    DOT: tl.constexpr,  # _DOT_FP16 / _DOT_BF16 / _DOT_FP32
    Q_POW2: tl.constexpr,  # scale each query row by a power of two into the float16 range (bf16 q, fp16 dot)
    HAS_K_SCALE: tl.constexpr, HAS_V_SCALE: tl.constexpr,
    SPLIT: tl.constexpr,  # write float32 partials for the combine kernel instead of the output
    USE_ASM: tl.constexpr,  # NVFP4 and float8-byte cache decoding by inline PTX (NVIDIA GPUs from sm_80)
):
    # One program: row t, KV head g, a block of that head's query group, one split of the page list.
    # Each selected page is read once and serves every query head of the block. The tile products take
    # one of two forms, chosen by the launcher (key_groups): transposed (W == 1) or per-warp key groups
    # (W > 1); see the two loops below.
    FLT_MAX: tl.constexpr = 3.4028234663852886e38
    W: tl.constexpr = KEY_GROUPS
    BLOCK_N: tl.constexpr = KEY_GROUPS * KPW
    # The offset rule: every stride and size entering an address is int64.
    stride_q_t = tl.cast(stride_q_t, tl.int64)
    stride_q_h = tl.cast(stride_q_h, tl.int64)
    stride_q_d = tl.cast(stride_q_d, tl.int64)
    stride_kv_p = tl.cast(stride_kv_p, tl.int64)
    stride_kv_h = tl.cast(stride_kv_h, tl.int64)
    stride_kv_o = tl.cast(stride_kv_o, tl.int64)
    stride_tk_t = tl.cast(stride_tk_t, tl.int64)
    stride_tk_h = tl.cast(stride_tk_h, tl.int64)
    stride_tk_j = tl.cast(stride_tk_j, tl.int64)
    stride_bt_r = tl.cast(stride_bt_r, tl.int64)
    stride_bt_c = tl.cast(stride_bt_c, tl.int64)
    stride_kvl = tl.cast(stride_kvl, tl.int64)
    stride_qo = tl.cast(stride_qo, tl.int64)
    stride_o_t = tl.cast(stride_o_t, tl.int64)
    stride_o_h = tl.cast(stride_o_h, tl.int64)
    stride_o_d = tl.cast(stride_o_d, tl.int64)
    ws_rows = tl.cast(ws_rows, tl.int64)

    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    head_block = pid % num_head_blocks
    g = (pid // num_head_blocks) % num_kv_heads
    t = pid // (num_head_blocks * num_kv_heads)
    req = t // decode_query_len

    kv_len = tl.load(kv_lens_ptr + t * stride_kvl).to(tl.int64)
    qo = tl.load(qo_ptr + t * stride_qo).to(tl.int64)
    limit = tl.minimum(qo + 1, kv_len)  # positions x < limit are visible

    # Query rows of the group, kept for the whole page list (broadcast over the key groups). NVFP4
    # tiles come as even and odd dims, so the query is split the same way and each product is the sum
    # of two products.
    i = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = i < group
    h = g * group + i
    q_rows = q_ptr + t * stride_q_t + h.to(tl.int64)[:, None] * stride_q_h
    if KV_FMT == 1:
        HALF: tl.constexpr = HEAD_DIM // 2
        c = tl.arange(0, HALF).to(tl.int64)
        dims = tl.arange(0, HEAD_DIM).to(tl.int64)
        q_full = _values(tl.load(q_rows + dims[None, :] * stride_q_d,
                                 mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)).to(tl.float32)
        q_even, q_odd = tl.split(tl.reshape(q_full, [BLOCK_H, HALF, 2]))
        if Q_POW2:
            up, down = _pow2_row_scale(tl.maximum(tl.max(tl.abs(q_even), 1), tl.max(tl.abs(q_odd), 1)))
            q_even = q_even * up[:, None]
            q_odd = q_odd * up[:, None]
        q_even = _to_dot(q_even, DOT)
        q_odd = _to_dot(q_odd, DOT)
    else:
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q_mask = row_ok[:, None] & d_ok[None, :]
        q = _values(tl.load(q_rows + d.to(tl.int64)[None, :] * stride_q_d, mask=q_mask, other=0.0)).to(tl.float32)
        if Q_POW2:
            up, down = _pow2_row_scale(tl.max(tl.abs(q), 1))
            q = q * up[:, None]
        q = _to_dot(q, DOT)

    # Per-row score factor: base-2 scale times the device scale, undoing the query's power of two.
    qk = tl.full([BLOCK_H], 1.0, tl.float32) * qk_scale
    if HAS_K_SCALE:
        qk = qk * tl.load(k_scale_ptr)
    if Q_POW2:
        qk = qk * down
    # NVFP4 values decoded by bit placement (an NVIDIA GPU from sm_80), decided once: the helpers
    # leave 2**-7 on every value exactly where the score factor and the accumulators take it back
    PLACE: tl.constexpr = USE_ASM and cuda_capability_geq(8, 0)
    if KV_FMT == 1 and PLACE:
        qk = qk * NVFP4_GPU_MULT  # the K values carry 2**-7 (_nvfp4_tile)
    # float8 cache bytes (a GPU before sm_89) decoded by bit placement (_cache_values): every value carries
    # 2**-8, which the score factor takes back for K and the float16 multiply of the V tile for V
    PLACE8: tl.constexpr = PLACE and KV_FMT == 0 and kv_ptr.dtype.element_ty == tl.uint8
    if PLACE8:
        # V takes its 2**8 back in the float16 product of the DOT == 0 branches below, which only
        # float16 operands reach (_dot_dtype gives them for every float8 cache)
        tl.static_assert(DOT == 0, "float8 bytes placed as float16 need float16 MMA operands")
        qk = qk * E4M3_PLACE_MULT
    qk = tl.minimum(tl.maximum(qk, -FLT_MAX), FLT_MAX)  # an overflow saturates instead of giving inf * 0

    # Resolve this split's page list up front (a vector of physical pages and visible key counts), so
    # the loop below has no dependent index loads.
    j_begin = tl.cast(split, tl.int64) * pages_per_split  # the offset rule of ops/_launch.py
    j_end = tl.minimum(j_begin + pages_per_split, n_sel)
    js = j_begin + tl.arange(0, BLOCK_SEL)
    sel_ok = js < j_end
    page = tl.load(topk_ptr + t * stride_tk_t + g * stride_tk_h + js.to(tl.int64) * stride_tk_j, mask=sel_ok,
                   other=-1).to(tl.int64)
    bt_ok = sel_ok & (page >= 0) & (page < max_blocks) & (req < num_req)
    phys = tl.load(bt_ptr + req * stride_bt_r + page * stride_bt_c, mask=bt_ok, other=-1).to(tl.int64)
    page_ok = bt_ok & (phys >= 0) & (phys < num_pages)
    n_keys = tl.minimum(tl.maximum(limit - page * PAGE_SIZE, 0), PAGE_SIZE)
    n_keys = tl.where(page_ok, n_keys, 0)
    phys = tl.where(page_ok, phys, 0)

    sel_idx = tl.arange(0, BLOCK_SEL)
    num_iters = tl.maximum(j_end - j_begin, 0) * CHUNKS
    if KV_FMT == 1:
        cols = tl.arange(0, 64)
        sc = tl.arange(0, 8)
        x128 = tl.cast(one * 128.0, tl.float16)
    elif PLACE8:
        one_dot = tl.cast(one * E4M3_PLACE_MULT, tl.float16)
    else:
        one_dot = tl.cast(one, tl.float16)

    if W == 1:
        # Transposed tile products, keys as the MMA's M dimension: S^T = K Q^T [BLOCK_N, BLOCK_H] and
        # O^T += V^T P^T [Dh, BLOCK_H]. With BLOCK_N >= 64 they map onto Hopper's warpgroup MMA with the
        # query block as its small N, and the loop-invariant Q^T stays in shared memory.
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        if KV_FMT == 1:
            acc_even = tl.zeros([HALF, BLOCK_H], dtype=tl.float32)
            acc_odd = tl.zeros([HALF, BLOCK_H], dtype=tl.float32)
            q_even_t = tl.trans(q_even)
            q_odd_t = tl.trans(q_odd)
            qb = tl.arange(0, 32)
        else:
            acc = tl.zeros([BLOCK_D, BLOCK_H], dtype=tl.float32)
            q_t = tl.trans(q)
        offs_n = tl.arange(0, BLOCK_N)
        for it in range(0, num_iters):
            first, p_phys, p_keys = _tile_page(it, sel_idx, phys, n_keys, CHUNKS, BLOCK_N)
            o = first + offs_n
            key_ok = o < p_keys  # keys past the row's limit are never read; a masked-off tile moves no memory
            if KV_FMT == 1:
                k_slot = kv_ptr + p_phys * stride_kv_p + (2 * g) * stride_kv_h
                v_slot = k_slot + stride_kv_h
                o64 = o.to(tl.int64)
                data_mask = key_ok[:, None] & (cols < 64)[None, :]
                scale_mask = key_ok[:, None] & (sc < 8)[None, :]
                k_data = tl.load(k_slot + (o64 * 64)[:, None] + cols[None, :], mask=data_mask, other=0)
                k_scales = tl.load(k_slot + PAGE_SIZE * 64 + (o64 * 8)[:, None] + sc[None, :], mask=scale_mask,
                                   other=0)
                k_f = _nvfp4_scales(k_scales, x128, PLACE)
                k_f = tl.reshape(tl.broadcast_to(k_f[:, :, None], [BLOCK_N, 8, 8]), [BLOCK_N, 64])
                k_even, k_odd = _nvfp4_tile(k_data, k_f, PLACE)
                s = tl.dot(k_even, q_even_t)
                s = tl.dot(k_odd, q_odd_t, s)
            else:
                row = kv_ptr + p_phys * stride_kv_p + g * stride_kv_h + o.to(tl.int64) * stride_kv_o
                kv_mask = key_ok[:, None] & d_ok[None, :]
                k = _to_dot(_cache_values(tl.load(row[:, None] + d[None, :], mask=kv_mask, other=0.0), PLACE8), DOT)
                s = _dot(k, q_t, tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32), DOT)

            s = tl.minimum(tl.maximum(s * qk[None, :], -FLT_MAX), FLT_MAX)  # base-2 logits, saturated
            s = tl.where(key_ok[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep every weight at 0
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new

            if KV_FMT == 1:
                v_data = tl.load(v_slot + (o64 * 64)[:, None] + cols[None, :], mask=data_mask, other=0)
                # V scales are stored by token quads (byte 4j + r of quad q: scale j of token 4q + r): load
                # the tile's quads as whole 32-byte rows and transpose them in registers, then drop the
                # scales of keys past the limit that share a quad with visible ones (a select: those
                # bytes may be anything, NaN included).
                quads = (it % CHUNKS) * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4)
                quad_ok = quads * 4 < p_keys
                v_quads = tl.load(v_slot + PAGE_SIZE * 64 + (quads.to(tl.int64) * 32)[:, None] + qb[None, :],
                                  mask=quad_ok[:, None] & (qb < 32)[None, :], other=0)
                v_scales = tl.reshape(tl.permute(tl.reshape(v_quads, [BLOCK_N // 4, 8, 4]), (0, 2, 1)), [BLOCK_N, 8])
                v_scales = tl.where(key_ok[:, None], v_scales, 0)
                v_f = _nvfp4_scales(v_scales, x128, PLACE)
                v_f = tl.reshape(tl.broadcast_to(v_f[:, :, None], [BLOCK_N, 8, 8]), [BLOCK_N, 64])
                v_even, v_odd = _nvfp4_tile(v_data, v_f, PLACE)
                p16 = p.to(tl.float16)
                acc_even = tl.dot(tl.trans(v_even), p16, acc_even * alpha[None, :])
                acc_odd = tl.dot(tl.trans(v_odd), p16, acc_odd * alpha[None, :])
            else:
                v = _cache_values(tl.load(row[:, None] + HEAD_DIM + d[None, :], mask=kv_mask, other=0.0), PLACE8)
                if DOT == 0:
                    # The product keeps the float8 -> float16 conversion in registers, before the tile goes
                    # through shared memory as float16 (else the compiler converts after, with byte loads);
                    # with PLACE8 it is 2**8 and undoes the placement's 2**-8 (exact: at most 448).
                    v = v.to(tl.float16) * one_dot
                else:
                    v = _to_dot(v, DOT)
                acc = _dot(tl.trans(v), _to_dot(p, DOT), acc * alpha[None, :], DOT)
        m_all = m_i
        l_all = l_i
        if KV_FMT == 1:
            out_even = tl.trans(acc_even)
            out_odd = tl.trans(acc_odd)
            if PLACE:  # the V values carried 2**-7 (_nvfp4_tile); exact
                out_even = out_even * NVFP4_GPU_MULT
                out_odd = out_odd * NVFP4_GPU_MULT
        else:
            out_acc = tl.trans(acc)
    else:
        # Key groups (value caches): a tile of BLOCK_N keys is W groups of KPW keys. The products are
        # batched over the groups, [W, BLOCK_H, Dh] x [W, Dh, KPW], and each group keeps its own running
        # (max, sum, accumulator), so every warp owns whole rows of the softmax: its max and sum need
        # shuffles inside the warp only, never a block-wide barrier per tile. The W states are merged
        # once, after the page list.
        tl.static_assert(KV_FMT == 0, "NVFP4 tiles use the transposed products (key_groups)")
        m_i = tl.full([W, BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([W, BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([W, BLOCK_H, BLOCK_D], dtype=tl.float32)
        q = tl.broadcast_to(q[None, :, :], [W, BLOCK_H, BLOCK_D])
        qk3 = qk[None, :, None]
        # Key o of a tile: group w holds keys w * KPW .. w * KPW + KPW - 1.
        tile_keys = tl.arange(0, W)[:, None] * KPW + tl.arange(0, KPW)[None, :]  # [W, KPW]
        for it in range(0, num_iters):
            first, p_phys, p_keys = _tile_page(it, sel_idx, phys, n_keys, CHUNKS, BLOCK_N)
            o = first + tile_keys
            key_ok = o < p_keys  # keys past the row's limit are never read; a masked-off tile moves no memory
            row = kv_ptr + p_phys * stride_kv_p + g * stride_kv_h + o.to(tl.int64) * stride_kv_o  # [W, KPW]
            kv_mask = key_ok[:, :, None] & d_ok[None, None, :]
            k = _to_dot(_cache_values(tl.load(row[:, :, None] + d[None, None, :], mask=kv_mask, other=0.0), PLACE8),
                        DOT)
            s = _dot(q, tl.permute(k, (0, 2, 1)), tl.zeros([W, BLOCK_H, KPW], dtype=tl.float32), DOT)

            s = tl.minimum(tl.maximum(s * qk3, -FLT_MAX), FLT_MAX)  # base-2 logits, saturated
            s = tl.where(key_ok[:, None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=2))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep every weight at 0
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, :, None])
            l_i = l_i * alpha + tl.sum(p, axis=2)
            m_i = m_new

            v = _cache_values(tl.load(row[:, :, None] + HEAD_DIM + d[None, None, :], mask=kv_mask, other=0.0),
                              PLACE8)
            if DOT == 0:
                v = v.to(tl.float16) * one_dot  # see the transposed loop
            else:
                v = _to_dot(v, DOT)
            acc = _dot(_to_dot(p, DOT), v, acc * alpha[:, :, None], DOT)

        # Merge the W key groups: weights exp2(m_w - m) (0 for a group without keys).
        m_all = tl.max(m_i, axis=0)  # [BLOCK_H]
        m_merge = tl.where(m_all == float("-inf"), 0.0, m_all)
        group_w = tl.exp2(m_i - m_merge[None, :])  # [W, BLOCK_H]
        l_all = tl.sum(l_i * group_w, axis=0)
        out_acc = tl.sum(acc * group_w[:, :, None], axis=0)

    # The V factor, saturated like the scores (the accumulator is 0 for rows without keys, never inf * 0).
    vf = tl.full([BLOCK_H], 1.0, tl.float32) * v_scale
    if HAS_V_SCALE:
        vf = tl.minimum(tl.maximum(vf * tl.load(v_scale_ptr), -FLT_MAX), FLT_MAX)
    if SPLIT:
        ws_row = (t * num_kv_heads * group + h) * num_splits + split
        tl.store(ws_ptr + ws_row, m_all, mask=row_ok)
        tl.store(ws_ptr + ws_rows + ws_row, l_all, mask=row_ok)
        acc_rows = ws_ptr + 2 * ws_rows + ws_row[:, None] * HEAD_DIM
        if KV_FMT == 1:
            tl.store(acc_rows + 2 * c[None, :], out_even, mask=row_ok[:, None])
            tl.store(acc_rows + 2 * c[None, :] + 1, out_odd, mask=row_ok[:, None])
        else:
            tl.store(acc_rows + d[None, :], out_acc, mask=q_mask)
    else:
        scale = (vf / tl.where(l_all > 0, l_all, 1.0))[:, None]  # no key: the accumulator is 0, the output 0
        o_rows = out_ptr + t * stride_o_t + h.to(tl.int64)[:, None] * stride_o_h
        if KV_FMT == 1:
            tl.store(o_rows + (2 * c)[None, :] * stride_o_d, (out_even * scale).to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None])
            tl.store(o_rows + (2 * c + 1)[None, :] * stride_o_d, (out_odd * scale).to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None])
        else:
            tl.store(o_rows + d.to(tl.int64)[None, :] * stride_o_d, (out_acc * scale).to(out_ptr.dtype.element_ty),
                     mask=q_mask)


@triton.jit
def _sparse_gqa_combine_kernel(
    ws_ptr, ws_rows,  # float32 workspace of m [R], l [R], acc [R, Dh], R = ws_rows = T * Hq * S
    v_scale_ptr,  # float32 device scale (HAS_V_SCALE)
    out_ptr, stride_o_t, stride_o_h, stride_o_d,  # [T, Hq, Dh]
    num_q_heads, num_splits, v_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_HC: tl.constexpr,  # query heads per program
    BLOCK_S: tl.constexpr,  # splits per step (all of them in one step unless there are many)
    BLOCK_SM: tl.constexpr,  # next_pow2(num_splits): the (max, sum) pairs, all loaded at once
    BLOCK_D: tl.constexpr,
    HAS_V_SCALE: tl.constexpr,
    PDL: tl.constexpr,  # launched programmatically dependent: wait for the decode kernel's results
):
    if PDL:
        wait_for_prior_grid()
    # Merge the per-split (max, sum, unnormalised accumulator) triples of a block of query heads. Every
    # split's partial is loaded in one step (not one split after the other), so a few programs finish
    # in about one memory latency. When one step holds every split (BLOCK_S == BLOCK_SM) the
    # accumulators are loaded with the maxima, before the maximum is known: one round of loads, not two.
    FLT_MAX: tl.constexpr = 3.4028234663852886e38
    stride_o_t = tl.cast(stride_o_t, tl.int64)
    stride_o_h = tl.cast(stride_o_h, tl.int64)
    stride_o_d = tl.cast(stride_o_d, tl.int64)
    ws_rows = tl.cast(ws_rows, tl.int64)
    ws_m_ptr = ws_ptr
    ws_l_ptr = ws_ptr + ws_rows
    ws_acc_ptr = ws_ptr + 2 * ws_rows
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_HC + tl.arange(0, BLOCK_HC)
    h_ok = h < num_q_heads
    row = t * num_q_heads + h  # int64
    s_all = tl.arange(0, BLOCK_SM)
    d = tl.arange(0, BLOCK_D)
    ms_mask = h_ok[:, None] & (s_all[None, :] < num_splits)
    m = tl.load(ws_m_ptr + row[:, None] * num_splits + s_all[None, :], mask=ms_mask, other=float("-inf"))
    l = tl.load(ws_l_ptr + row[:, None] * num_splits + s_all[None, :], mask=ms_mask, other=0.0)
    if BLOCK_S == BLOCK_SM:  # every split's accumulator in the same round of loads as the maxima
        part = _split_partials(ws_acc_ptr, row, s_all, ms_mask, d, num_splits, HEAD_DIM)
    m_max = tl.max(m, axis=1)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: all weights 0
    w_all = tl.exp2(m - m_safe[:, None])
    l_sum = tl.sum(w_all * l, axis=1)
    if BLOCK_S == BLOCK_SM:
        acc = tl.sum(w_all[:, :, None] * part, axis=1)
    else:
        s = tl.arange(0, BLOCK_S)
        acc = tl.zeros([BLOCK_HC, BLOCK_D], dtype=tl.float32)
        for s0 in range(0, num_splits, BLOCK_S):
            sp = s0 + s
            sp_mask = h_ok[:, None] & (sp[None, :] < num_splits)
            w = tl.exp2(tl.load(ws_m_ptr + row[:, None] * num_splits + sp[None, :], mask=sp_mask,
                                other=float("-inf")) - m_safe[:, None])  # [BLOCK_HC, BLOCK_S]
            part = _split_partials(ws_acc_ptr, row, sp, sp_mask, d, num_splits, HEAD_DIM)
            acc += tl.sum(w[:, :, None] * part, axis=1)
    vf = tl.full([BLOCK_HC], 1.0, tl.float32) * v_scale
    if HAS_V_SCALE:
        vf = tl.minimum(tl.maximum(vf * tl.load(v_scale_ptr), -FLT_MAX), FLT_MAX)
    scale = vf / tl.where(l_sum > 0, l_sum, 1.0)
    o_ptrs = out_ptr + t * stride_o_t + h.to(tl.int64)[:, None] * stride_o_h + d.to(tl.int64)[None, :] * stride_o_d
    tl.store(o_ptrs, (acc * scale[:, None]).to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & (d[None, :] < HEAD_DIM))


@triton.jit
def _split_partials(ws_acc_ptr, row, sp, mask, d, num_splits, HEAD_DIM: tl.constexpr):
    """The accumulators ``[BLOCK_HC, splits, BLOCK_D]`` of splits ``sp`` of the workspace rows ``row`` (0 where
    ``mask`` is off, and past ``HEAD_DIM``)."""
    acc_rows = (row[:, None] * num_splits + sp[None, :]) * HEAD_DIM  # [BLOCK_HC, splits]
    return tl.load(ws_acc_ptr + acc_rows[:, :, None] + d[None, None, :],
                   mask=mask[:, :, None] & (d < HEAD_DIM)[None, None, :], other=0.0)


# Most pages one program resolves up front (bounds the register vector of the page list).
_MAX_PAGES_PER_PROGRAM = 64
# Partial rows (heads x splits) the combine kernel loads per step: half of it for plans of at most
# _COMBINE_FEW_SPLITS splits (more programs, each loading less). Measured on an H200 (docs/sparse_gqa_hopper.md,
# "Small T: what the combine costs"): with 16 splits (T = 1, 4) 32 rows were as fast or 0.4 µs faster than
# 16; with 4 or 2 splits (T = 16, 24) 16 rows were 0.4-0.7 µs faster than 32.
_COMBINE_ROWS = 32
_COMBINE_FEW_SPLITS = 4
# The splits are grid dimension 1, which CUDA caps at 65535.
_MAX_GRID_Y = 65535

_PLANS = PlanCache()
# The Hopper kernel's combine launched with programmatic dependent launch (scheduled once every decode CTA
# has stored its partials; it waits for the decode grid's completion before reading them).
COMBINE_PDL = True


def _dot_dtype(q_dtype: torch.dtype, kv_cache: torch.Tensor) -> int:
    """float16 operands wherever the cache values are exact in float16 (float16, float8, NVFP4), with a
    bfloat16 query scaled into the float16 range by a power of two per row; bfloat16 operands for a
    bfloat16 cache; float32 for a float16 query over a bfloat16 cache (no lossless 16-bit type)."""
    if kv_cache.dtype == torch.bfloat16:
        return _DOT_FP32 if q_dtype == torch.float16 else _DOT_BF16
    return _DOT_FP16


def key_groups(plan: LaunchPlan, head_dim: int, nvfp4: bool) -> int:
    """W, the key groups of a tile: 1 selects the transposed tile products (keys as the MMA's M: the
    NVFP4 cache, whose decoding needs the registers, blocks whose per-warp accumulator would be large,
    and plans with ``transposed`` set, see :func:`launch_config`); otherwise one group per warp, as many
    as there are warps while every group keeps >= 16 keys and a warp's accumulator ``[BLOCK_H, Dh]``
    stays at 64 float32 registers per thread or fewer."""
    block_d = max(next_pow2(head_dim), 16)
    if nvfp4 or plan.transposed or plan.block_h * block_d > 2048:
        return 1
    return max(1, min(plan.num_warps, plan.block_n // 16))


def launch_config(q: torch.Tensor, kv_cache: torch.Tensor, n_sel: int, num_splits: int | None = None,
                  num_sms: int | None = None) -> LaunchPlan:
    """Block sizes, warps and the split of the page list, from shapes and dtypes only (no autotuning:
    CUDA-graph capture and the interpreter need one fixed configuration per shape).

    ``num_splits`` overrides the split heuristic; ``num_sms`` the multiprocessor count it aims at
    (default: the device's, or ``OFF_CUDA_SMS`` off CUDA so interpreter grids stay small).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    nvfp4 = is_nvfp4(kv_cache)
    num_kv_heads = kv_heads(kv_cache)
    page_size = kv_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_d = max(next_pow2(head_dim), 16)
    # Pad the query group to >= 16 rows (the smallest tl.dot M); very large groups use several blocks.
    block_h = min(max(next_pow2(group), 16), 64 if block_d <= 128 else 32)
    head_blocks = cdiv(group, block_h)
    # Keys per tile (at least 16): up to 64 (4 key groups of 16, see key_groups) for a value cache, up to
    # 128 for NVFP4 (transposed products), 32 for Dh > 128.
    block_n = max(min(prev_pow2(page_size), 128 if nvfp4 else 64 if block_d <= 128 else 32), 16)
    dot = _dot_dtype(q.dtype, kv_cache)

    programs = num_tokens * num_kv_heads * head_blocks
    sms = num_sms or multiprocessor_count(q.device)
    # Too few programs to fill the GPU: the page lists are split, and a value cache then uses the
    # transposed tile products, whose smaller register footprint (126 registers per thread against
    # 210 for the key groups, fp8 Dh=128 compiled for sm_90) fits more programs on an SM.
    few_programs = 0 < programs < sms
    # A head block small enough for per-warp key groups (a warp's [BLOCK_H, Dh] accumulator stays small).
    small_block = block_h * block_d <= 2048
    if num_splits is None:
        num_splits = cdiv(n_sel, _MAX_PAGES_PER_PROGRAM)
        if few_programs:
            # About two programs per SM for NVFP4, three for value caches with small head blocks (the
            # ones that switch form). Measured on an H200 (docs/sparse_gqa.md, "Split-K"): fp8
            # T=1 / 8 / 16 / 24 in 13.3 / 19.2 / 27.3 / 31.9 us against 14.7 / 20.9 / 29.7 / 36.7 with
            # key groups and one program per SM. Large head blocks (transposed at every batch size,
            # more registers per program) keep one per SM.
            per_sm = 2 if nvfp4 else 3 if small_block else 1
            num_splits = max(num_splits, min(cdiv(per_sm * sms, programs), n_sel))
    num_splits = min(max(num_splits, 1), _MAX_GRID_Y)
    per_split = max(cdiv(n_sel, num_splits), 1)
    num_splits = max(cdiv(n_sel, per_split), 1)  # no empty split
    if dot == _DOT_FP32:  # float32 operands (a float16/bfloat16 mix, rare): small tiles, no prefetch
        block_n, num_warps, num_stages = 16, 4, 1
    elif nvfp4 or small_block:
        num_warps, num_stages = 4, 3
    else:
        num_warps, num_stages = (8, 2) if block_h >= 64 else (4, 2)
    return LaunchPlan(block_h, head_blocks, block_n, num_splits, num_warps, num_stages,
                      transposed=few_programs and small_block and not nvfp4)


def pages_per_split(n_sel: int, plan: LaunchPlan) -> int:
    """Selected pages each split program walks (the last split may have fewer)."""
    return max(cdiv(n_sel, plan.num_splits), 1)


def float8_as_bytes(t: torch.Tensor) -> bool:
    """Whether the portable decode kernel takes the float8 tensor ``t`` (the query or a value cache) as
    its bytes: where Triton has no float8 type for its device (``_launch.float8_conversions``)."""
    return t.dtype == torch.float8_e4m3fn and not float8_conversions(t.device)


def _make_launches(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len,
                   qk_scale, v_scale, has_k_scale, has_v_scale, out, plan: LaunchPlan):
    """The kernel launches of one plan. Tensor arguments, in order: q, kv_cache, topk_pages, block_table,
    kv_segment_lens, qo_offset, k scale, v scale, out, workspace (``out`` stands in for absent ones); a
    float8 query or cache is read as its ``uint8`` view where :func:`float8_as_bytes` holds (the launch
    takes the tensors themselves: ``KernelLaunch(reinterpret=...)``)."""
    num_tokens, num_q_heads, head_dim = q.shape
    nvfp4 = is_nvfp4(kv_cache)
    num_pages, page_size = kv_cache.shape[0], kv_cache.shape[2]
    num_kv_heads = kv_heads(kv_cache)
    n_sel = topk_pages.shape[2]
    group = num_q_heads // num_kv_heads
    per_split = pages_per_split(n_sel, plan)
    split = plan.num_splits > 1
    rows = num_tokens * num_q_heads * plan.num_splits
    block_d = max(next_pow2(head_dim), 16)
    dot = _dot_dtype(q.dtype, kv_cache)
    as_bytes = tuple(i for i, t in ((0, q), (4, kv_cache)) if float8_as_bytes(t))  # positions in args
    args = (
        q.view(torch.uint8) if 0 in as_bytes else q, q.stride(0), q.stride(1), q.stride(2),
        kv_cache.view(torch.uint8) if 4 in as_bytes else kv_cache, kv_cache.stride(0), kv_cache.stride(1),
        kv_cache.stride(2),
        topk_pages, topk_pages.stride(0), topk_pages.stride(1), topk_pages.stride(2),
        block_table, block_table.stride(0), block_table.stride(1),
        kv_segment_lens, kv_segment_lens.stride(0),
        qo_offset, qo_offset.stride(0),
        out, out,  # the device scales, when given
        out, out.stride(0), out.stride(1), out.stride(2),
        out, rows,  # the workspace when split
        num_kv_heads, group, plan.head_blocks,
        num_pages, block_table.shape[0], block_table.shape[1], n_sel,
        per_split, plan.num_splits, decode_query_len,
        qk_scale, v_scale, 1.0,
    )
    groups = key_groups(plan, head_dim, nvfp4)
    meta = dict(HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_H=plan.block_h, BLOCK_D=block_d, KEY_GROUPS=groups,
                KPW=plan.block_n // groups, BLOCK_SEL=max(next_pow2(per_split), 2), CHUNKS=cdiv(page_size, plan.block_n),
                KV_FMT=_FMT_NVFP4 if nvfp4 else _FMT_VALUES, DOT=dot,
                Q_POW2=dot == _DOT_FP16 and q.dtype == torch.bfloat16, HAS_K_SCALE=has_k_scale,
                HAS_V_SCALE=has_v_scale, SPLIT=split, USE_ASM=q.device.type == "cuda")
    grid = (num_tokens * num_kv_heads * plan.head_blocks, plan.num_splits)
    main = KernelLaunch(_sparse_gqa_decode_kernel, grid, args, meta, num_warps=plan.num_warps,
                        num_stages=plan.num_stages, device=q.device, reinterpret=as_bytes)
    return main, _make_combine(q, out, plan, v_scale, has_v_scale) if split else None


def _make_combine(q, out, plan: LaunchPlan, v_scale, has_v_scale, pdl: bool = False) -> KernelLaunch:
    """The combine launch of a split plan (both decode kernels write its workspace). Tensor arguments:
    workspace, v scale, out. ``pdl``: launched programmatically dependent on the decode kernel."""
    num_tokens, num_q_heads, head_dim = q.shape
    rows = num_tokens * num_q_heads * plan.num_splits
    block_d = max(next_pow2(head_dim), 16)
    block_sm = next_pow2(plan.num_splits)
    per_step = _COMBINE_ROWS if plan.num_splits > _COMBINE_FEW_SPLITS else max(_COMBINE_ROWS // 2, 1)
    block_s = min(block_sm, per_step)
    block_hc = min(max(per_step // block_s, 1), next_pow2(num_q_heads))
    combine = KernelLaunch(
        _sparse_gqa_combine_kernel, (num_tokens, cdiv(num_q_heads, block_hc)),
        (out, rows, out, out, out.stride(0), out.stride(1), out.stride(2), num_q_heads, plan.num_splits, v_scale),
        dict(HEAD_DIM=head_dim, BLOCK_HC=block_hc, BLOCK_S=block_s, BLOCK_SM=block_sm, BLOCK_D=block_d,
             HAS_V_SCALE=has_v_scale, PDL=pdl),
        num_warps=4, device=q.device, launch_pdl=pdl)
    return combine


def kernel_path(q: torch.Tensor, kv_cache: torch.Tensor) -> str:
    """``"hopper"`` or ``"portable"``: the decode kernel :func:`sparse_gqa_decode_triton` runs for these
    arguments (shapes, strides, dtypes and the cache's 16-byte alignment)."""
    return "hopper" if hopper.supported(q, kv_cache) else "portable"


def sparse_gqa_decode_triton(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len,
                             softmax_scale, q_scale=1.0, k_scale=1.0, v_scale=1.0, k_scale_tensor=None,
                             v_scale_tensor=None, *, out, num_splits=None, config=None, path=None):
    """Launch the decode kernel (and the combine kernel when the page lists are split). Arguments as
    :func:`sparse_gqa_decode_torch`; ``num_splits`` and ``config`` (``LaunchPlan`` fields) override
    the heuristic (tests use them to cover every path with small grids). ``path`` picks the kernel:
    ``"hopper"`` (``ops/sparse_gqa_hopper.py``, the default wherever :func:`sparse_gqa_hopper.supported`
    holds: float8 value caches and NVFP4 caches on sm_90) or ``"portable"`` (the Triton kernel above,
    every other case).
    """
    if out.numel() == 0:
        return
    qk_scale = scale_product(softmax_scale, q_scale, k_scale, LOG2E)
    v_scale = scale_product(v_scale)
    has_k, has_v = k_scale_tensor is not None, v_scale_tensor is not None
    key = (q.shape, q.stride(), q.dtype, kv_cache.shape, kv_cache.stride(), kv_cache.dtype, topk_pages.shape,
           topk_pages.stride(), block_table.shape, block_table.stride(), kv_segment_lens.stride(0),
           qo_offset.stride(0), out.stride(), decode_query_len, qk_scale, v_scale, has_k, has_v, q.device,
           num_splits, None if config is None else tuple(sorted(config.items())), path,
           kv_cache.data_ptr() % 16 == 0)
    entry = _PLANS.get(key)
    if entry is None:
        use_hopper = path != "portable" and hopper.supported(q, kv_cache)
        if path is None and not use_hopper and not hopper.HAS_GLUON:
            hopper.warn_portable_on_sm90("sparse_gqa_decode", q.device, hopper.layout_supported(q, kv_cache))
        if path == "hopper" and not use_hopper:
            raise ValueError("path: the Hopper kernel does not serve these arguments (see "
                             "ops/sparse_gqa_hopper.py::supported)")
        if use_hopper:
            num_kv_heads = kv_heads(kv_cache)
            plan = hopper.plan_launch(q.shape[0], num_kv_heads, q.shape[1] // num_kv_heads, topk_pages.shape[2],
                                      kv_cache.shape[2], multiprocessor_count(q.device), num_splits)
            plan = plan.with_overrides(config)
            main = hopper.make_launch(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset,
                                      decode_query_len, qk_scale, v_scale, has_k, has_v, out, plan)
            launches = (main, _make_combine(q, out, plan, v_scale, has_v, pdl=COMBINE_PDL)
                        if plan.num_splits > 1 else None)
        else:
            plan = launch_config(q, kv_cache, topk_pages.shape[2], num_splits).with_overrides(config)
            launches = _make_launches(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset,
                                      decode_query_len, qk_scale, v_scale, has_k, has_v, out, plan)
        ws_numel = q.shape[0] * q.shape[1] * plan.num_splits * (2 + q.shape[2]) if plan.num_splits > 1 else 0
        entry = _PLANS.put(key, (ws_numel, *launches))
    ws_numel, main, combine = entry
    ks = k_scale_tensor if has_k else out
    vs = v_scale_tensor if has_v else out
    if combine is None:
        main(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, ks, vs, out, out)
        return
    # float32 m [R], l [R], acc [R, Dh] of the R = T * Hq * S partial rows; its size depends on shapes
    # only, so CUDA-graph capture sees a fixed allocation.
    ws = scratch(ws_numel, torch.float32, q.device)  # sized from shapes only
    main(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, ks, vs, out, ws)
    combine(ws, vs, out)


# =====================================================================================================
# Triton: the cache writer
# =====================================================================================================


@triton.jit
def _div_rn(x, y):
    """Correctly rounded float32 ``x / y`` (``div_rn`` does not broadcast: both get the full shape)."""
    return tl.math.div_rn(x, tl.broadcast_to(y, x.shape))


@triton.jit
def _recip_rn(s):
    """Correctly rounded float32 ``1 / s`` of a finite scalar."""
    return tl.math.div_rn(s * 0.0 + 1.0, s)


@triton.jit
def _within(s, bound: tl.constexpr):
    """Whether the scalar ``|s|`` lies in ``[1 / bound, bound]``."""
    return (tl.abs(s) >= 1.0 / bound) & (tl.abs(s) <= bound)


@triton.jit
def _quotient(x, d, r, FAST: tl.constexpr, NONNEG: tl.constexpr = False):
    """float32 ``RN(x / d)`` for ``x`` and ``d``, ``r`` broadcast to ``x``'s shape (``r = RN(1 / d)``).

    ``FAST`` (GPU): one product and two fused corrections, ``q = RN(x r)``, ``e = RN(x - q d)``,
    ``RN(q + e r)``, which is the correctly rounded quotient when ``r`` is the correctly rounded
    reciprocal and nothing over- or underflows (Markstein's theorem; the callers keep ``d`` inside
    ``[2**-60, 2**60]`` and clamp ``x`` so that ``|x r|`` stays small, else they take the other path).
    Otherwise (the interpreter, whose ``fma`` rounds twice) the IEEE division."""
    if FAST:
        d = tl.broadcast_to(d, x.shape)
        r = tl.broadcast_to(r, x.shape)
        q = x * r
        e = tl.fma(q, -d, x)  # not fma(-q, d, x): the compiler then forms -q by a second product
        if NONNEG:  # x >= 0 or NaN and d > 0: a zero quotient is +0.0, as the correction leaves it
            return tl.fma(e, r, q)
        # A zero quotient keeps the sign of x * r (-0.0 / s is -0.0; the correction would add +0.0).
        return tl.where(q == 0.0, q, tl.fma(e, r, q))
    else:
        return _div_rn(x, d)


@triton.jit
def _e2m1_code(y):
    """int32 magnitude code (0..7) of the E2M1 value nearest to float32 ``y`` in ``[0, 7)`` (ties to
    the even code; the callers bound ``y``), from the bits: ``y >= 1`` rounds its mantissa to one bit
    (a carry moves into the exponent), ``y < 1`` rounds ``2 y`` to an integer (adding 2**23 does it,
    exactly)."""
    bits = y.to(tl.int32, bitcast=True)
    # ((bits + 0x1FFFFF + bit 22) >> 22) - 252 with the 252 inside the sum: 1.0 -> 2, 1.5 -> 3, ..., 6.0 -> 7
    normal = (bits + (0x1FFFFF - (252 << 22)) + ((bits >> 22) & 1)) >> 22
    small = (y * 2.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000  # 0, 1 or 2
    return tl.where(bits >= 0x3F800000, normal, small)


@triton.jit
def _gqa_kv_cache_insert_kernel(
    k_ptr, stride_k_n, stride_k_h, stride_k_d,  # [N, Hkv, Dh] float32 / fp16, or the int16 view of bf16
    v_ptr, stride_v_n, stride_v_h, stride_v_d,
    slot_ptr, stride_slot,  # int64 [N]
    cache_ptr,  # value cache as int16 (bf16 / fp16) or uint8 (float8) bits; NVFP4: uint8
    stride_c_p, stride_c_h, stride_c_o,  # value cache: element strides; NVFP4: page and slot strides in bytes
    k_scale_ptr, v_scale_ptr,  # float32 device scales (HAS_K_SCALE / HAS_V_SCALE)
    num_rows, num_slots,
    k_scale, v_scale,  # float32 scales (float8 and NVFP4 caches)
    NUM_KV_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr,  # constants: the divisions by them are cheap
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,  # (token, KV head) rows per program
    KV_FMT: tl.constexpr,  # _FMT_VALUES / _FMT_NVFP4
    STORE: tl.constexpr,  # value cache: 0 float8, 1 bf16, 2 fp16
    IN_BF16: tl.constexpr,
    HAS_K_SCALE: tl.constexpr, HAS_V_SCALE: tl.constexpr,
    HW_CVT: tl.constexpr,  # hardware float conversions (GPU); integer rounding under the interpreter
):
    # Program: BLOCK_R rows r = token * Hkv + head; each row's K and V are quantised and written.
    stride_k_n = tl.cast(stride_k_n, tl.int64)
    stride_k_h = tl.cast(stride_k_h, tl.int64)
    stride_k_d = tl.cast(stride_k_d, tl.int64)
    stride_v_n = tl.cast(stride_v_n, tl.int64)
    stride_v_h = tl.cast(stride_v_h, tl.int64)
    stride_v_d = tl.cast(stride_v_d, tl.int64)
    stride_slot = tl.cast(stride_slot, tl.int64)
    stride_c_p = tl.cast(stride_c_p, tl.int64)
    stride_c_h = tl.cast(stride_c_h, tl.int64)
    stride_c_o = tl.cast(stride_c_o, tl.int64)

    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < num_rows
    n = r // NUM_KV_HEADS
    g = r % NUM_KV_HEADS
    slot = tl.load(slot_ptr + n * stride_slot, mask=live, other=-1)
    ok = live & (slot >= 0) & (slot < num_slots)  # negative or past the cache: skipped
    slot = tl.where(ok, slot, 0)
    page = slot // PAGE_SIZE
    o = slot - page * PAGE_SIZE
    # The total scales are the same for every row: scalars, so that the choice of division below is
    # a uniform branch on them, with no reduction across the program.
    ks = k_scale * 1.0
    vs = v_scale * 1.0
    if HAS_K_SCALE:
        ks = ks * tl.load(k_scale_ptr)
    if HAS_V_SCALE:
        vs = vs * tl.load(v_scale_ptr)
    k_rows = k_ptr + n * stride_k_n + g * stride_k_h
    v_rows = v_ptr + n * stride_v_n + g * stride_v_h

    # Both rows are loaded whole before anything is stored: a load cannot move above a store that may
    # alias it, so V loaded after K's stores would wait a second memory round trip. They are loaded
    # whatever the row's slot (a row whose slot is skipped is read for nothing), so that their loads
    # need not wait for the slots'.
    if KV_FMT == 0:
        d = tl.arange(0, BLOCK_D)
        in_mask = ok[:, None] & (d < HEAD_DIM)[None, :]
        row_mask = live[:, None] & (d < HEAD_DIM)[None, :]
        k = load_as_f32(k_rows[:, None] + d[None, :] * stride_k_d, row_mask, IN_BF16)
        v = load_as_f32(v_rows[:, None] + d[None, :] * stride_v_d, row_mask, IN_BF16)
        dst = cache_ptr + (page * stride_c_p + g * stride_c_h + o * stride_c_o)[:, None] + d[None, :]
        if STORE == 0:
            # Markstein's quotient with the reciprocal of s (see _quotient) is exact when s lies in
            # [2**-60, 2**60] and x * r cannot overflow. Values are first clamped to +-896 |s| (NaN
            # kept): a larger |x| has |x / s| > 448, which the conversion saturates to 448 either way,
            # so the bytes are unchanged and |x r| stays below 2**10. Other scales take the division.
            fast = False
            if HW_CVT:
                fast = _within(ks, 2.0**60) & _within(vs, 2.0**60)
            if fast:
                k_y = _quotient(_clamp_keep_nan(k, 896.0 * tl.abs(ks)), ks, _recip_rn(ks), True)
                v_y = _quotient(_clamp_keep_nan(v, 896.0 * tl.abs(vs)), vs, _recip_rn(vs), True)
            else:
                k_y = _div_rn(k, ks)
                v_y = _div_rn(v, vs)
            tl.store(dst, _e4m3_bytes(k_y, HW_CVT), mask=in_mask)
            tl.store(dst + HEAD_DIM, _e4m3_bytes(v_y, HW_CVT), mask=in_mask)
        else:
            tl.store(dst, _half_bits(k, STORE, HW_CVT), mask=in_mask)
            tl.store(dst + HEAD_DIM, _half_bits(v, STORE, HW_CVT), mask=in_mask)
    else:
        # [row, group, value]: each group's first and second 8 values (HEAD_DIM is 128), so that a
        # group's 16 values, its scale and its 8 data bytes stay in one thread
        half = (tl.arange(0, 8) * 16)[None, :, None] + tl.arange(0, 8)[None, None, :]
        row_mask = live[:, None, None] & (half < HEAD_DIM)
        k_lo = load_as_f32(k_rows[:, None, None] + half * stride_k_d, row_mask, IN_BF16)
        k_hi = load_as_f32(k_rows[:, None, None] + (half + 8) * stride_k_d, row_mask, IN_BF16)
        v_lo = load_as_f32(v_rows[:, None, None] + half * stride_v_d, row_mask, IN_BF16)
        v_hi = load_as_f32(v_rows[:, None, None] + (half + 8) * stride_v_d, row_mask, IN_BF16)
        k_slot = cache_ptr + page * stride_c_p + (2 * g) * stride_c_h
        _nvfp4_write(k_lo, k_hi, ks, k_slot, o, ok, PAGE_SIZE, False, HW_CVT)
        _nvfp4_write(v_lo, v_hi, vs, k_slot + stride_c_h, o, ok, PAGE_SIZE, True, HW_CVT)


@triton.jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _bound_quotient(y):
    """``min(y, 6)`` for ``y >= 0``, and 0 for NaN (an infinite ``|x|`` over an infinite divisor, whose
    comparisons with every E2M1 boundary are false), by comparisons: a minimum would keep or drop the
    NaN depending on the backend."""
    return tl.where(y < 6.0, y, tl.where(y >= 6.0, 6.0, 0.0))


@triton.jit
def _nvfp4_codes(x, d, r, keep, FAST: tl.constexpr):
    """The data bytes of ``x [BLOCK_R, 8 groups, 8 values]`` (float32) with their groups' divisors
    ``d`` and reciprocals ``r`` ([BLOCK_R, 8, 1]): ``[BLOCK_R, 8, 4]`` int32 bytes, value ``2 b`` in
    the low nibble of byte ``b``, ``2 b + 1`` in the high one; 0 where ``keep`` is false."""
    lo, hi = tl.split(tl.reshape(x, [x.shape[0], 8, 4, 2]))
    lo_abs, hi_abs = tl.abs(lo), tl.abs(hi)
    # Quotients above 6 code as 6 (code 7): they are bounded below 7 first, as _e2m1_code needs.
    if FAST:
        # |x| clamped to 6 d (NaN kept): the quotient of the clamp is RN(RN(6 d) / d), within an ulp
        # of 6, and every larger |x| has a quotient that codes as 6 too
        cap = 6.0 * d
        lo_y = _quotient(tl.minimum(lo_abs, cap, propagate_nan=tl.PropagateNan.ALL), d, r, True, True)
        hi_y = _quotient(tl.minimum(hi_abs, cap, propagate_nan=tl.PropagateNan.ALL), d, r, True, True)
    else:
        d_ok = tl.where(keep, d, 1.0)  # groups not kept store 0 whatever the quotient: no 0 / 0 made
        lo_y = _div_rn(lo_abs, d_ok)
        hi_y = _div_rn(hi_abs, d_ok)
        lo_y = _bound_quotient(lo_y)
        hi_y = _bound_quotient(hi_y)
    lo_code = _e2m1_code(lo_y) | ((lo.to(tl.int32, bitcast=True) >> 28) & 8)
    hi_code = _e2m1_code(hi_y) | ((hi.to(tl.int32, bitcast=True) >> 28) & 8)
    return tl.where(keep, lo_code | (hi_code << 4), 0)


@triton.jit
def _nvfp4_write(x_lo, x_hi, s, slot_ptr, o, ok, PAGE_SIZE: tl.constexpr, V_ORDER: tl.constexpr,
                 HW_CVT: tl.constexpr):
    """Quantise the rows ``x [BLOCK_R, 128]`` (float32, loaded whole as ``x_lo``, ``x_hi``: values
    ``16 j .. 16 j + 7`` and ``16 j + 8 .. 16 j + 15`` of group ``j`` at ``[:, j, :]``) with the total
    scale ``s`` (a scalar) and store token ``o``'s 64 data bytes and 8 scale bytes into the NVFP4 slots
    at ``slot_ptr [BLOCK_R]``. A group's values, scale and bytes stay in one thread: no shuffle for its
    maximum, no layout change (through shared memory) before the data bytes' stores."""
    BLOCK_R: tl.constexpr = o.shape[0]
    # amax with NaN kept (a plain hardware max drops NaN): a group holding a NaN gets the NaN scale.
    amax = _max_keep_nan(tl.reduce(tl.abs(x_lo), 2, _max_keep_nan), tl.reduce(tl.abs(x_hi), 2, _max_keep_nan))
    six_s = 6.0 * s
    # Markstein's quotients (see _quotient) are exact for divisors in [2**-60, 2**60] when nothing
    # overflows. With |s| in [2**-50, 2**50], 6 s is such a divisor, and so is every group's
    # d = scale * s whose scale is neither 0 nor NaN (e4m3 magnitudes lie in [2**-9, 448]); groups
    # with such a scale store codes 0 whatever their quotients. The dividends are clamped first (NaN
    # kept), to 896 |6 s| and 6 d: past those the quotients saturate (the scale at 448, the code at
    # 6) either way, so the bytes are unchanged and no product overflows. Other scales divide.
    fast = False
    if HW_CVT:
        fast = _within(s, 2.0**50)
    if fast:
        amax_c = tl.minimum(amax, 896.0 * tl.abs(six_s), propagate_nan=tl.PropagateNan.ALL)
        scale_y = _quotient(amax_c, six_s, _recip_rn(six_s), True)
    else:
        scale_y = _div_rn(amax, six_s)
    scale_y = _clamp_keep_nan(scale_y, 448.0)
    scale_bits = _e4m3_byte(scale_y, HW_CVT)  # NaN -> 0x7F
    scale = e4m3_to_f32(scale_bits.to(tl.uint8))  # exact
    d = (scale * s)[:, :, None]  # [BLOCK_R, 8, 1]
    # A zero or NaN scale (a NaN group, or a NaN scale tensor): every code of the group is 0. Told from
    # the bits: the interpreter decodes the e4m3 NaN as 480.
    keep = (((scale_bits & 0x7F) != 0) & ((scale_bits & 0x7F) != 0x7F))[:, :, None]
    if fast:
        r = _div_rn(tl.full(d.shape, 1.0, tl.float32), d)
    else:
        r = d  # unused: the exact path divides
    bytes_lo = _nvfp4_codes(x_lo, d, r, keep, fast)  # bytes 0..3 of each group
    bytes_hi = _nvfp4_codes(x_hi, d, r, keep, fast)  # bytes 4..7
    data = tl.reshape(tl.permute(tl.join(bytes_lo, bytes_hi), (0, 1, 3, 2)), [BLOCK_R, 8, 8]).to(tl.uint8)
    group = tl.arange(0, 8)
    byte = (group * 8)[None, :, None] + tl.arange(0, 8)[None, None, :]  # byte 8 j + b of the data row
    tl.store(slot_ptr[:, None, None] + (o * 64)[:, None, None] + byte, data,
             mask=ok[:, None, None] & (byte < 64))
    if V_ORDER:
        scale_pos = PAGE_SIZE * 64 + (o // 4) * 32 + o % 4
        scale_ptrs = slot_ptr[:, None] + scale_pos[:, None] + (group * 4)[None, :]
    else:
        scale_ptrs = slot_ptr[:, None] + (PAGE_SIZE * 64 + o * 8)[:, None] + group[None, :]
    tl.store(scale_ptrs, scale_bits.to(tl.uint8), mask=ok[:, None] & (group < 8)[None, :])


def insert_plan(nvfp4: bool) -> tuple[int, int]:
    """``(rows per program, warps)`` of the cache writer: 16 rows in 4 warps for float8 and 16-bit
    caches, 4 rows in one warp for NVFP4. Both give a thread whole runs of 8 values (the NVFP4 writer
    needs a group's halves in one thread). On an H100 the NVFP4 plan took 9% less time than 16 rows in
    4 warps at 4096 tokens x 4 KV heads, 18% less at 16,384 tokens and 0.2-0.6 µs less at 64-1,024, the
    fastest plan at every size (``docs/sparse_gqa.md``, "Cache writer")."""
    return (4, 1) if nvfp4 else (16, 4)


def _int16_view_of_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def gqa_kv_cache_insert_triton(k, v, slot_mapping, kv_cache, k_scale=1.0, v_scale=1.0, k_scale_tensor=None,
                               v_scale_tensor=None, *, block_r=None, num_warps=None):
    """Launch the cache writer. Arguments as :func:`gqa_kv_cache_insert_torch`; ``block_r`` and
    ``num_warps`` override the rows per program and the warps of :func:`insert_plan`."""
    num_tokens, num_kv_heads, head_dim = k.shape
    nvfp4 = is_nvfp4(kv_cache)
    pages, page_size = kv_cache.shape[0], kv_cache.shape[2]
    num_rows = num_tokens * num_kv_heads
    if num_rows == 0 or pages * page_size == 0:
        return
    has_k, has_v = k_scale_tensor is not None, v_scale_tensor is not None
    k_in, v_in = _int16_view_of_bf16(k), _int16_view_of_bf16(v)
    if nvfp4:
        cache, store = kv_cache, 0
    elif kv_cache.dtype == torch.float8_e4m3fn:
        cache, store = kv_cache.view(torch.uint8), 0
    else:
        cache, store = kv_cache.view(torch.int16), 1 if kv_cache.dtype == torch.bfloat16 else 2
    key = ("gqa_kv_cache_insert", k.shape, k.stride(), v.stride(), k.dtype, slot_mapping.stride(0), kv_cache.shape,
           kv_cache.stride(), kv_cache.dtype, float(k_scale), float(v_scale), has_k, has_v, k.device, block_r, num_warps)
    launch = _PLANS.get(key)
    if launch is None:
        rows, warps = insert_plan(nvfp4)
        rows, warps = block_r or rows, num_warps or warps
        args = (k_in, k.stride(0), k.stride(1), k.stride(2), v_in, v.stride(0), v.stride(1), v.stride(2),
                slot_mapping, slot_mapping.stride(0), cache, kv_cache.stride(0), kv_cache.stride(1),
                kv_cache.stride(2), slot_mapping, slot_mapping,  # the device scales, when given
                num_rows, pages * page_size, float(k_scale), float(v_scale))
        meta = dict(NUM_KV_HEADS=num_kv_heads, PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
                    BLOCK_R=rows,
                    KV_FMT=_FMT_NVFP4 if nvfp4 else _FMT_VALUES, STORE=store, IN_BF16=k.dtype == torch.bfloat16,
                    HAS_K_SCALE=has_k, HAS_V_SCALE=has_v, HW_CVT=k.device.type == "cuda")
        launch = _PLANS.put(key, KernelLaunch(_gqa_kv_cache_insert_kernel, (cdiv(num_rows, rows),), args, meta,
                                              num_warps=warps, device=k.device))
    launch(k_in, v_in, slot_mapping, cache, k_scale_tensor if has_k else slot_mapping,
           v_scale_tensor if has_v else slot_mapping)


__all__ = ["gqa_kv_cache_insert_torch", "gqa_kv_cache_insert_triton", "key_groups", "launch_config", "nvfp4_encode_torch",
           "pages_per_split", "scale_product", "sparse_gqa_decode_dense", "sparse_gqa_decode_torch",
           "sparse_gqa_decode_triton", "kernel_path"]
