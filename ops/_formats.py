"""The three sparse MLA KV cache formats (``docs/formats.md``), decoded in one place.

Shared by every operator that reads a sparse MLA cache (``sparse_mla_decode``, ``kv_cache_gather``).
The host-side facts and layout checks (``FORMAT_IDS``, ``cache_dim``, ``check_kv_cache``) live in
``meta_kernels/_formats.py``; this module holds the code that reads cache bytes:

- ``dequantize_torch``: vectorised PyTorch, float32 rows of any slots (the CPU kernels);
- ``e4m3_to_float32``: e4m3fn bytes to float32 in PyTorch, several times faster on CPU than the
  dtype conversion (the CPU kernels of both attention operators);
- ``written_slots``: the slot rule of every paged cache writer's CPU kernel (``kv_cache_insert``,
  ``gqa_kv_cache_insert``): which tokens are stored, at which page and row;
- ``load_kv_tile`` / ``load_kv_cols`` (Triton): a ``[BLOCK_N, CHUNK]`` float32 tile of dequantised
  values, decoded in registers (no dequantised copy of the cache ever exists in memory);
- ``load_fp8_656_raw`` / ``load_fp8_656_scales`` (Triton): an fp8_656 scale group's raw e4m3 values
  and the four per-row scales apart, for callers that apply the scale after an exact product;
- ``e2m1_place_ptx``: the inline PTX that turns four bytes of the sparse-GQA NVFP4 cache (eight E2M1
  codes) into float16 bits placed by integer operations and byte permutes (both decode kernels).

Layouts (bytes of one token or page; ``stride(0)`` is the page stride and may include padding):

- ``auto``: ``[pages, page_size, D]`` of bf16/fp16, row ``r`` of page ``p`` at element
  ``p * stride(0) + r * stride(1)``;
- ``fp8_656`` (D = 576): per token, 656 contiguous bytes at ``p * stride(0) + r * 656``: dims 0-511 as
  e4m3, 4 float32 scales (scale ``j`` covers dims ``128j..128j+127``), dims 512-575 as bf16;
- ``fp8_584`` (D = 512): per page, ``page_size`` data rows of 576 bytes (dims 0-447 as e4m3, then
  dims 448-511 as bf16) followed by ``page_size`` scale rows of 8 bytes (7 UE8M0 exponents, exponent
  ``j`` covering dims ``64j..64j+63``, value ``2 ** (byte - 127)``). ``stride(1)`` is not used.

The Triton side reads the fp8 formats byte by byte and assembles float32 scales and bf16 values from
their bytes (little-endian), so it needs no alignment beyond one byte: a page stride that is not a
multiple of 4 (odd padding) is still read correctly. bf16 -> float32 is a shift; UE8M0 -> float32
writes the exponent field directly (byte 0 is the subnormal ``2**-127``, byte 255 is ``inf``).
"""

from __future__ import annotations

import torch

from ..meta_kernels._formats import cache_dim
from ._rounding import _INTERPRETED, e4m3_to_f32, load_as_f32
from ._triton import tl, triton

# =====================================================================================================
# PyTorch
# =====================================================================================================


def written_slots(slot_mapping: torch.Tensor, pages: int, page_size: int):
    """``(keep, page, row)`` for a cache writer: ``keep`` marks the tokens whose slot is valid
    (``0 <= slot < pages * page_size``; the others are skipped), ``page`` and ``row`` locate those
    slots. ``None`` when no token is written."""
    keep = (slot_mapping >= 0) & (slot_mapping < pages * page_size)
    slots = slot_mapping[keep]
    if slots.numel() == 0:
        return None
    return keep, slots // page_size, slots % page_size


def e4m3_to_float32(raw: torch.Tensor) -> torch.Tensor:
    """float32 of e4m3fn bytes ``raw`` (uint8, any shape and strides): the values of
    ``raw.view(torch.float8_e4m3fn).to(torch.float32)``, NaN for 0x7F and 0xFF included.

    Each byte, sign-extended to 16 bits and shifted left by 7, holds its sign in bit 15 (and 14) and its
    exponent and mantissa in bits 7-13: masked to those, it is the float16 of the e4m3 value times 2^-8
    (subnormals included, since both formats' subnormals have the exponent field 0). float16 -> float32
    and the multiply by 2^8 are exact, and all of it is vectorised, where PyTorch's CPU conversion from
    float8 goes one element at a time (about four times slower). The e4m3fn NaN codes come out as
    +-480 and are put back.
    """
    bits = (raw.view(torch.int8).to(torch.int16) << 7) & -16512  # 0xBF80: bit 15 and bits 7-13
    values = bits.view(torch.float16).to(torch.float32).mul_(256.0)
    magnitudes = raw & 0x7F
    if magnitudes.numel() and magnitudes.amax() == 0x7F:  # (a maximum is far cheaper than == and any)
        values = values.masked_fill_(magnitudes == 0x7F, float("nan"))
    return values


def _page_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[pages, page_size * bytes_per_token]`` uint8 view of the pages (``fp8_584`` ignores stride(1))."""
    pages, page_size, width = kv_cache.shape
    # No storage_offset argument: as_strided keeps the view's own, and the expression stays traceable
    # by torch.compile (the benchmark compiles it as the reference).
    return torch.as_strided(kv_cache, (pages, page_size * width), (kv_cache.stride(0), 1))


def dequantize_torch(kv_cache: torch.Tensor, slots: torch.Tensor, kv_format: str) -> torch.Tensor:
    """float32 ``[*slots.shape, D]``: the dequantised vectors of ``slots`` (int32/int64, any shape).

    Rows of invalid slots (``< 0`` or ``>= pages * page_size``) are exactly 0; nothing out of range is
    read (invalid slots gather slot 0, whose bytes are zeroed before decoding, so NaN bytes there never
    leak).
    """
    pages, page_size, _ = kv_cache.shape
    dim = cache_dim(kv_cache, kv_format)
    num_slots = pages * page_size
    slots = slots.to(torch.int64)
    valid = (slots >= 0) & (slots < num_slots)
    if num_slots == 0 or slots.numel() == 0:
        return torch.zeros((*slots.shape, dim), dtype=torch.float32, device=kv_cache.device)
    safe = torch.where(valid, slots, 0).reshape(-1)
    page, row = safe // page_size, safe % page_size
    # Whole records are gathered per slot (no per-byte index); an invalid slot's gathered bytes are zeroed
    # before anything is decoded from them, which makes its row exactly 0.
    if kv_format == "auto":
        return torch.where(valid.reshape(-1, 1), kv_cache[page, row], 0).to(torch.float32).view(*slots.shape, dim)
    keep = valid.reshape(-1, 1).to(torch.uint8)  # (a multiply: much faster than a broadcast masked_fill_)
    n = safe.shape[0]
    if kv_format == "fp8_656":
        raw = kv_cache[page, row].mul_(keep)  # [N, 656]
        groups, group, scales = 4, 128, raw[:, 512:528].view(torch.float32)  # [N, 4]
    else:
        flat = _page_bytes(kv_cache)  # [pages, page_size * 584]: data rows, then scale rows
        raw = flat[:, :page_size * 576].view(pages, page_size, 576)[page, row].mul_(keep)  # [N, 576]
        exps = flat[:, page_size * 576:].view(pages, page_size, 8)[page, row, :7].mul_(keep)
        exps = exps.to(torch.int32)  # [N, 7]; 0 for an invalid slot: a finite scale (2^-127) times 0
        groups, group, scales = 7, 64, torch.where(exps > 0, exps << 23, 0x400000).view(torch.float32)
    # each piece converted once into its place: e4m3 values times their group's scale, then 64 bf16 values
    width = groups * group
    vals = torch.empty((n, dim), dtype=torch.float32, device=kv_cache.device)
    fp8 = e4m3_to_float32(raw[:, :width]).view(n, groups, group)
    torch.mul(fp8, scales[:, :, None], out=vals[:, :width].view(n, groups, group))
    rope_at = width + (16 if kv_format == "fp8_656" else 0)  # fp8_656: 16 scale bytes before them
    vals[:, width:] = raw[:, rope_at:rope_at + 128].view(torch.bfloat16)
    return vals.view(*slots.shape, dim)


# =====================================================================================================
# Triton
# =====================================================================================================

# Two conversions the Triton interpreter gets wrong and the GPU right: it decodes the e4m3fn NaN bytes
# 0x7F / 0xFF as +-480 (the GPU gives NaN), and it widens bf16 subnormals to wrong float32 values. Under
# the interpreter the decoders work around both, so the backends agree (a constexpr: the GPU code is
# unchanged, and there a bf16 value widened and narrowed again to bf16 costs nothing). The e4m3 decoder
# (``_rounding.e4m3_to_f32``) takes the integer route there, or mends the NaN bytes where the
# interpreter runs on a machine with a GPU. (``_INTERPRETED``: ``_rounding``'s.)


@triton.jit
def _load_f32_le(ptr, mask):
    """float32 ``[N]`` from the 4 little-endian bytes at each of ``ptr [N]`` (uint8 pointers, any
    alignment); 0 where masked. One ``[N, 4]`` load: a single 32-bit access per row when aligned."""
    four = tl.arange(0, 4)
    b = tl.load(ptr[:, None] + four[None, :], mask=mask[:, None], other=0).to(tl.int32)
    return tl.sum(b << (8 * four)[None, :], axis=1).to(tl.float32, bitcast=True)  # disjoint bits: sum = OR


@triton.jit
def _load_bf16_le(ptr, mask):
    """float32 of a bf16 stored as 2 little-endian bytes at ``ptr`` (exact); 0 where masked."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.int32)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.int32)
    return ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0_to_f32(e):
    """``2 ** (e - 127)`` for an int32 byte value ``e``, written straight into the exponent field."""
    return tl.where(e > 0, e << 23, 0x400000).to(tl.float32, bitcast=True)


@triton.jit
def load_kv_cols(
    cache_ptr,  # the cache: uint8 for the fp8 formats, bf16/fp16 for auto
    stride_page,  # kv_cache.stride(0), in elements (bytes for uint8)
    stride_row,  # kv_cache.stride(1): used by auto only
    page_size,  # kv_cache.shape[1]
    slots,  # int64 [BLOCK_N] slot ids
    valid,  # bool [BLOCK_N]: rows to load; the caller checked 0 <= slot < pages * page_size
    COL0: tl.constexpr,  # first dim of the tile
    CHUNK: tl.constexpr,  # dims in the tile (a power of two)
    COL_END: tl.constexpr,  # dims >= COL_END are 0 and not read (COL_END <= D)
    KV_FORMAT: tl.constexpr,  # FORMAT_IDS value
):
    """float32 ``[BLOCK_N, CHUNK]``: dims ``COL0 + j`` of each slot, 0 for invalid rows and for dims
    ``>= COL_END``. ``load_kv_tile`` is this with ``COL_END`` = the format's D."""
    stride_page = tl.cast(stride_page, tl.int64)  # the offset rule (ops/_launch.py)
    stride_row = tl.cast(stride_row, tl.int64)
    page_size = tl.cast(page_size, tl.int64)  # page_size * 576 passes 2**31 for large fp8_584 pages
    cols = COL0 + tl.arange(0, CHUNK)
    slot = tl.where(valid, slots, 0).to(tl.int64)
    page = slot // page_size
    row = slot - page * page_size
    page_base = page * stride_page  # int64: pages * page stride passes 2**31 in a large cache
    mask = valid[:, None] & (cols < COL_END)[None, :]
    if KV_FORMAT == 0:
        ptrs = cache_ptr + (page_base + row * stride_row)[:, None] + cols[None, :]
        if _INTERPRETED and cache_ptr.dtype.element_ty == tl.bfloat16:  # bf16 widened by a shift
            vals = load_as_f32(ptrs.to(tl.pointer_type(tl.int16), bitcast=True), mask, True)
        else:
            vals = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        if KV_FORMAT == 1:
            FP8_DIMS: tl.constexpr = 512
            GROUP: tl.constexpr = 128  # dims per scale
            data_base = page_base + row * 656
            bf16_base = data_base + 528
        else:
            FP8_DIMS: tl.constexpr = 448
            GROUP: tl.constexpr = 64
            data_base = page_base + row * 576
            bf16_base = data_base + 448
            scale_base = page_base + page_size * 576 + row * 8
        BLOCK_N: tl.constexpr = slots.shape[0]
        vals = tl.zeros([BLOCK_N, CHUNK], dtype=tl.float32)
        if COL0 < FP8_DIMS:
            fp8_mask = mask & (cols < FP8_DIMS)[None, :]
            raw = tl.load(cache_ptr + data_base[:, None] + cols[None, :], mask=fp8_mask, other=0)
            x = e4m3_to_f32(raw)
            # One scale per row for each group the tile covers, broadcast by a select per group:
            # cheaper than gathering a scale per element.
            FP8_END: tl.constexpr = FP8_DIMS if COL0 + CHUNK > FP8_DIMS else COL0 + CHUNK
            scale = vals
            for g in tl.static_range(COL0 // GROUP, (FP8_END + GROUP - 1) // GROUP):
                if KV_FORMAT == 1:
                    s_g = _load_f32_le(cache_ptr + data_base + 512 + 4 * g, valid)
                else:
                    s_g = _ue8m0_to_f32(tl.load(cache_ptr + scale_base + g, mask=valid, other=0).to(tl.int32))
                scale = tl.where((cols // GROUP == g)[None, :], s_g[:, None], scale)
            vals = tl.where(fp8_mask, x * scale, vals)
        if COL0 + CHUNK > FP8_DIMS:
            bf16_mask = mask & (cols >= FP8_DIMS)[None, :]
            offs = bf16_base[:, None] + 2 * (cols - FP8_DIMS)[None, :]
            vals = tl.where(bf16_mask, _load_bf16_le(cache_ptr + offs, bf16_mask), vals)
    return vals


@triton.jit
def load_kv_tile(
    cache_ptr,  # the cache tensor (uint8 for fp8 formats; bf16/fp16 for auto)
    stride_page,  # kv_cache.stride(0), elements (= bytes for uint8)
    stride_row,  # kv_cache.stride(1) (used by auto only)
    page_size,  # kv_cache.shape[1]
    slots,  # int64 [BLOCK_N] slot ids
    valid,  # bool [BLOCK_N] rows to load; the caller checked 0 <= slot < pages * page_size
    COL0: tl.constexpr,
    CHUNK: tl.constexpr,  # dims [COL0, COL0 + CHUNK), CHUNK a power of two
    KV_FORMAT: tl.constexpr,
):
    """float32 ``[BLOCK_N, CHUNK]`` of dequantised values; 0 for rows where ``valid`` is False.

    fp8 formats: dims past D (576 / 512) are 0 and not read. ``auto``: the caller keeps
    ``COL0 + CHUNK <= D`` (D is not known here); use ``load_kv_cols`` for a ragged last piece.
    """
    if KV_FORMAT == 1:
        END: tl.constexpr = 576
    elif KV_FORMAT == 2:
        END: tl.constexpr = 512
    else:
        END: tl.constexpr = COL0 + CHUNK
    return load_kv_cols(cache_ptr, stride_page, stride_row, page_size, slots, valid, COL0, CHUNK, END, KV_FORMAT)


@triton.jit
def load_fp8_656_raw(
    cache_ptr,  # uint8 fp8_656 cache
    stride_page,  # kv_cache.stride(0), bytes
    page_size,  # kv_cache.shape[1]
    slots,  # int64 [BLOCK_N]
    valid,  # bool [BLOCK_N]: rows to load (0 <= slot < pages * page_size checked by the caller)
    GROUP: tl.constexpr,  # scale group 0..3: dims [128 * GROUP, 128 * GROUP + 128)
):
    """float32 ``[BLOCK_N, 128]``: the e4m3 values of one scale group, not scaled; 0 for invalid rows.
    With ``load_fp8_656_scales``, ``raw * scale[:, None]`` is the dequantised tile; keeping them apart
    lets a caller run exact products on the raw values (e4m3 is exact in bf16 and fp16) and apply the
    scale afterwards in float32."""
    stride_page = tl.cast(stride_page, tl.int64)  # the offset rule (ops/_launch.py)
    page_size = tl.cast(page_size, tl.int64)
    cols = GROUP * 128 + tl.arange(0, 128)
    slot = tl.where(valid, slots, 0).to(tl.int64)
    page = slot // page_size
    row_base = page * stride_page + (slot - page * page_size) * 656
    raw = tl.load(cache_ptr + row_base[:, None] + cols[None, :], mask=valid[:, None], other=0)
    return e4m3_to_f32(raw)


@triton.jit
def load_fp8_656_scales(cache_ptr, stride_page, page_size, slots, valid):
    """The four float32 scales ``[BLOCK_N]`` of each row (0 for invalid rows), from one 16-byte load
    per row (a single vector load when the page stride is a multiple of 16)."""
    stride_page = tl.cast(stride_page, tl.int64)  # the offset rule (ops/_launch.py)
    page_size = tl.cast(page_size, tl.int64)
    slot = tl.where(valid, slots, 0).to(tl.int64)
    page = slot // page_size
    row_base = page * stride_page + (slot - page * page_size) * 656
    b = tl.arange(0, 16)
    raw = tl.load(cache_ptr + (row_base + 512)[:, None] + b[None, :], mask=valid[:, None], other=0).to(tl.int32)
    bits = raw << (8 * (b % 4))[None, :]  # disjoint bit fields: their sum is their OR
    s0 = tl.sum(tl.where((b // 4 == 0)[None, :], bits, 0), axis=1).to(tl.float32, bitcast=True)
    s1 = tl.sum(tl.where((b // 4 == 1)[None, :], bits, 0), axis=1).to(tl.float32, bitcast=True)
    s2 = tl.sum(tl.where((b // 4 == 2)[None, :], bits, 0), axis=1).to(tl.float32, bitcast=True)
    s3 = tl.sum(tl.where((b // 4 == 3)[None, :], bits, 0), axis=1).to(tl.float32, bitcast=True)
    return s0, s1, s2, s3


def e2m1_place_ptx(src: str, lo: tuple[str, str], hi: tuple[str, str]) -> str:
    """PTX lines turning the four bytes of register ``src`` (eight E2M1 codes) into float16 values times
    ``2**-14``, exactly, with integer operations only: the low nibbles' values into registers ``lo``
    (bytes 0, 1 and bytes 2, 3, two float16 each) and the high nibbles' into ``hi``. A float16 whose
    sign is the nibble's sign bit, whose exponent field is ``0 0 0 e1 e0`` and whose top mantissa bit is
    the E2M1 mantissa bit (bits 15 and 9-11 of the half, every other bit 0) is the E2M1 value times
    ``2**-14``: for ``e = 0`` a float16 subnormal, ``m * 2**-15``. So each nibble becomes the byte
    ``s 0 0 0 e1 e0 m 0``, in six operations per four bytes: with ``z`` the sign bits of all eight
    nibbles, one ``lop3`` per half takes bits 1-3 from the magnitudes shifted into place (left by 1 for
    the low nibbles, right by 3 for the high ones) and the rest (bit 7 the sign, else 0) from ``z``,
    shifted for the low nibbles. Then one byte permute per two values puts two such bytes into the high
    bytes of a float16 pair, zeros below. The caller declares ``.reg .b32 t, u, e, z``. (Until the
    portable kernel took this form too, it re-encoded each nibble as an e4m3 byte, the E2M1 value times
    ``2**-6``, and converted two at a time with ``cvt.rn.f16x2.e4m3x2``, a conversion GPUs before sm_89
    lack; ``docs/sparse_gqa.md``, "Decode: ``_sparse_gqa_decode_kernel``".)"""
    def spread(out: tuple[str, str]) -> list[str]:
        # bytes 0, 1 (then 2, 3) of e into the high bytes of the two halves, zeros below (selector 4:
        # byte 0 of the zero operand)
        return [f"prmt.b32 {out[0]}, e, 0, 0x1404;", f"prmt.b32 {out[1]}, e, 0, 0x3424;"]
    # lop3 0xE4: c ? a : b, with c = the field of bits 1-3 of every byte
    lines = ([f"and.b32 z, {src}, 0x88888888;", f"shl.b32 t, {src}, 1;", "shl.b32 u, z, 4;",
              "lop3.b32 e, t, u, 0x0E0E0E0E, 0xE4;"] + spread(lo)
             + [f"shr.b32 t, {src}, 3;", "lop3.b32 e, t, z, 0x0E0E0E0E, 0xE4;"] + spread(hi))
    return "".join(line + "\n" for line in lines)

