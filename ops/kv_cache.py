"""Kernels of the KV cache operators (SPEC section 5): vectorised PyTorch and Triton.

Every entry point takes the ``out`` overload's arguments, outputs keyword-only (``kv_cache_insert``
writes its ``kv_cache`` argument and has none). Naming: ``_NAME_kernel`` (Triton)
-> ``NAME_triton`` (launcher) and ``NAME_torch`` (PyTorch). Reading a cache goes through
``ops/_formats`` (``dequantize_torch``, ``load_kv_cols``), shared with the attention kernels; writing
one (quantisation) lives here.

Both backends produce the same bytes:
- divisions are IEEE round-to-nearest (``tl.math.div_rn`` in Triton: ``/`` is an approximate division
  on the GPU);
- every float -> e4m3 / bf16 / fp16 rounding in Triton rounds to nearest even, saturating
  (``ops/_rounding.py``): on the GPU by the hardware conversions (``HW_CVT``), under the Triton
  interpreter, which truncates in ``.to()``, by integer arithmetic on the float32 bit pattern
  (``round_to_small_float``); the PyTorch side uses torch's RNE conversions;
- an "auto" cache written from a tensor of its own dtype is a copy of the bits (``COPY``; NaN made
  canonical), with no conversion;
- the UE8M0 exponent ``ceil(log2(y))`` is read from the exponent and mantissa bits of ``y`` (exact;
  ``log2`` is approximate on the GPU);
- bf16 inputs are widened by a shift of their bits (the interpreter's ``.to(float32)`` widens bf16
  subnormals to wrong values; ``_formats.load_kv_cols`` does the same for a bf16 "auto" cache under
  the interpreter);
- non-finite values (``docs/kv_cache.md``): a tile's amax ignores NaN and +-inf; NaN is stored as the
  format's canonical quiet NaN (e4m3fn ``0x7F``, bf16 ``0x7FC0``, fp16 ``0x7E00``, float32
  ``0x7FC00000``), +-inf saturates to +-448 in e4m3fn (which has no infinity) and stays +-inf in
  bf16, fp16 and float32; the PyTorch kernels write the same canonical bytes (torch's own NaN
  patterns differ between conversion paths).
Multi-byte fields of the fp8 formats are written byte by byte, little-endian, so no alignment beyond
one byte is assumed (a page stride padded to an odd number of bytes works).
"""

from __future__ import annotations

import torch

from ..meta_kernels._formats import FORMAT_IDS, cache_dim
from ._formats import dequantize_torch, load_kv_cols, written_slots
from ._launch import KernelLaunch, PlanCache, cdiv, next_pow2, prev_pow2
from ._rounding import e4m3_bytes as _e4m3_bytes_tl
from ._rounding import half_bits as _half_bits
from ._rounding import load_as_f32 as _load_as_f32
from ._triton import tl, triton

E4M3_MAX = 448.0
# Canonical quiet NaN of each stored format (sign and payload are not kept), as the int of its bits.
NAN_BITS = {torch.float8_e4m3fn: 0x7F, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00, torch.float32: 0x7FC00000}
_INT_VIEW = {torch.float8_e4m3fn: torch.uint8, torch.bfloat16: torch.int16, torch.float16: torch.int16,
             torch.float32: torch.int32}
FP32_MIN_NORMAL = 1.1754943508222875e-38  # 2**-126: the SPEC's 1.1754944e-38 rounded to float32
UE8M0_MIN_AMAX = 1e-4  # fp8_584 tiles below this amax share the exponent of 1e-4

# Store dtype codes of the Triton kernels (``STORE_DTYPE`` constexpr): how a float32 value is written.
_STORE_F32, _STORE_BF16, _STORE_F16 = 0, 1, 2
_STORE_CODES = {torch.float32: _STORE_F32, torch.bfloat16: _STORE_BF16, torch.float16: _STORE_F16}

# The gather kernel reads a slot's whole row in one tile (up to 1,024 dims), then stores it. Tiles of
# fewer dims made each tile's loads wait for the previous tile's stores (the compiler cannot move a load
# of the cache above a store to ``out``: they may alias), one memory round trip per tile, nine for
# D = 576. Slots per program: one per ``_GATHER_ROWS_PER_SLOT`` slots of the call (a power of two, at
# least one), at most as many as keep a tile at 4,096 values (16 at most): small calls are bound by one
# program's chain of loads, so more programs with fewer slots each finish sooner. An H200, one call per
# CUDA graph, µs at N = 1 / 128 / 4096 with 1 / 2 / 4 / 8 slots per program: fp8_584 5.70 / 6.08 / 6.30 /
# 7.07, 6.06 / 6.11 / 6.37 / 7.23, 13.47 / 11.62 / 10.24 / 10.46; fp8_656 (1 / 1 / 2 / 4 slots) 6.05 /
# 6.08 / 6.27 / 6.46, 6.46 / 6.46 / 6.59 / 7.01, 14.08 / 14.14 / 12.51 / 11.42 (8 before: 7.07 / 7.23 /
# 10.46 and 6.46 / 7.01 / 11.42).
_GATHER_MAX_CHUNK = 1024
_GATHER_TILE = 4096
_GATHER_BLOCK_N = 16
_GATHER_ROWS_PER_SLOT = 1024
# An "auto" cache gathered into its own dtype is a copy of bits (``_kv_cache_copy_kernel``); off, it
# takes the dequantising kernel as the other formats do (the same bytes; kept for comparisons).
GATHER_COPY = True
# A row of D up to 1,024 that is not a power of two is gathered as two tiles, the largest power of two in
# D and the rest (D = 576: 512 + 64, docs/kv_cache.md); off, as one tile of next_pow2(D) with the lanes
# past D masked (the same values; kept for comparisons).
GATHER_SPLIT = True

_PLANS = PlanCache()


# =====================================================================================================
# PyTorch kernels
# =====================================================================================================


def canonical_nan_(t: torch.Tensor, nan: torch.Tensor) -> torch.Tensor:
    """Write the canonical NaN bits of ``t.dtype`` where ``nan`` is set (in place, any strides)."""
    t.view(_INT_VIEW[t.dtype]).masked_fill_(nan, NAN_BITS[t.dtype])
    return t


def to_stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` converted to ``dtype`` (round to nearest even) with every NaN canonical."""
    return canonical_nan_(x.to(dtype, copy=True), torch.isnan(x))


def _e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3fn bytes of float32 ``x``: round to nearest even, saturating at +-448 (infinities
    included; torch's float -> e4m3fn gives NaN past 448 and ``x / scale`` can round to 448.00003);
    NaN is the canonical 0x7F."""
    return to_stored(x.clamp(-E4M3_MAX, E4M3_MAX), torch.float8_e4m3fn).view(torch.uint8)


def _bf16_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[n, 2 * d]`` little-endian bytes of float32 ``x [n, d]`` rounded to bf16 (NaN canonical)."""
    return to_stored(x, torch.bfloat16).contiguous().view(torch.uint8)


def _finite_amax(tiles: torch.Tensor) -> torch.Tensor:
    """Largest finite magnitude of each tile (NaN and +-inf do not count; 0 if none)."""
    return torch.where(torch.isfinite(tiles), tiles.abs(), 0.0).amax(dim=-1)


def _encode_fp8_656_torch(x: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, 656]`` records of float32 ``x [n, 576]``."""
    n = x.shape[0]
    tiles = x[:, :512].reshape(n, 4, 128)
    scale = (_finite_amax(tiles) / E4M3_MAX).clamp_min(FP32_MIN_NORMAL)  # [n, 4]
    fp8 = _e4m3_bytes(tiles / scale[:, :, None]).reshape(n, 512)
    return torch.cat([fp8, scale.view(torch.uint8), _bf16_bytes(x[:, 512:])], dim=1)


def ue8m0_exponent_torch(amax: torch.Tensor) -> torch.Tensor:
    """int32 ``ceil(log2(max(amax, 1e-4) / 448))``, exactly: the exponent of ``y`` plus one when ``y``
    is not a power of two (``y`` is a normal float32 for every finite ``amax``)."""
    bits = (amax.clamp_min(UE8M0_MIN_AMAX) / E4M3_MAX).view(torch.int32)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def _encode_fp8_584_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 ``[n, 576]`` data rows, uint8 ``[n, 8]`` scale rows) of float32 ``x [n, 512]``."""
    n = x.shape[0]
    tiles = x[:, :448].reshape(n, 7, 64)
    e = ue8m0_exponent_torch(_finite_amax(tiles))  # [n, 7]
    # 2**-e built in the exponent field: exact, and e stays in [-22, 120] for finite inputs.
    inv_scale = ((127 - e).clamp(1, 254) << 23).view(torch.float32)
    fp8 = _e4m3_bytes(tiles * inv_scale[:, :, None]).reshape(n, 448)
    data = torch.cat([fp8, _bf16_bytes(x[:, 448:])], dim=1)
    exps = torch.cat([(e + 127).clamp(0, 255).to(torch.uint8), x.new_zeros((n, 1), dtype=torch.uint8)], dim=1)
    return data, exps


def kv_cache_insert_torch(kv, slot_mapping, kv_cache, kv_format):
    pages, page_size = kv_cache.shape[0], kv_cache.shape[1]
    written = written_slots(slot_mapping, pages, page_size)
    if written is None:
        return
    keep, page, row = written
    if kv_format == "auto":
        kv_cache[page, row] = to_stored(kv[keep], kv_cache.dtype)
        return
    x = kv[keep].to(torch.float32)
    if kv_format == "fp8_656":
        kv_cache[page, row] = _encode_fp8_656_torch(x)  # stride(1) == 656: a token's record is one row
        return
    # fp8_584: two byte views of every page, laid out by the SPEC rather than by stride(1).
    data, exps = _encode_fp8_584_torch(x)
    base, stride_page = kv_cache.storage_offset(), kv_cache.stride(0)
    data_rows = torch.as_strided(kv_cache, (pages, page_size, 576), (stride_page, 576, 1), base)
    scale_rows = torch.as_strided(kv_cache, (pages, page_size, 8), (stride_page, 8, 1), base + 576 * page_size)
    data_rows[page, row] = data
    scale_rows[page, row] = exps


def kv_cache_gather_torch(kv_cache, slots, kv_format, dtype=None, *, out):
    # ``out.dtype`` is the result dtype (the fake checked that ``dtype``, when given, agrees).
    if out.shape[0] == 0:
        return
    vals = dequantize_torch(kv_cache, slots, kv_format)
    canonical_nan_(out.copy_(vals), torch.isnan(vals))


# =====================================================================================================
# Triton kernels
# =====================================================================================================


@triton.jit
def _canonical_f32(x):
    """``x`` with every NaN replaced by the canonical float32 NaN 0x7FC00000."""
    return tl.where(x == x, x, tl.full(x.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True))


@triton.jit
def _store_bytes(ptr, bits, NBYTES: tl.constexpr, mask):
    """Store the low ``NBYTES`` bytes of each int32 of ``bits [M]`` little-endian at ``ptr + NBYTES * i``."""
    k = tl.arange(0, NBYTES)
    i = tl.arange(0, bits.shape[0])
    vals = (bits[:, None] >> (8 * k)[None, :]) & 0xFF
    tl.store(ptr + (NBYTES * i)[:, None] + k[None, :], vals.to(tl.uint8), mask=mask)


@triton.jit
def _store_converted(ptrs, x, mask, STORE_DTYPE: tl.constexpr, HW_CVT: tl.constexpr):
    """Write float32 ``x``: as float32, or as the int16 bits of bf16 / fp16 (RNE; hardware conversions
    with ``HW_CVT``, the integer routine otherwise) through an int16 view."""
    if STORE_DTYPE == 0:
        tl.store(ptrs, _canonical_f32(x), mask=mask)
    else:
        tl.store(ptrs, _half_bits(x, STORE_DTYPE, HW_CVT), mask=mask)


@triton.jit
def _load_auto(ptrs, mask, COPY: tl.constexpr, KV_IS_BF16: tl.constexpr):
    """``auto`` insert: ``COPY``, the raw bits (masked lanes 0); otherwise float32 values."""
    if COPY:
        return tl.load(ptrs, mask=mask, other=0)
    else:
        return _load_as_f32(ptrs, mask, KV_IS_BF16)


@triton.jit
def _store_auto(ptrs, x, mask, COPY: tl.constexpr, ABS_MASK: tl.constexpr, INF_BITS: tl.constexpr,
                NAN_BITS: tl.constexpr, STORE_DTYPE: tl.constexpr, HW_CVT: tl.constexpr):
    """``auto`` insert: writes what ``_load_auto`` returned (``COPY``: the bits, NaN made canonical)."""
    if COPY:
        tl.store(ptrs, _canonical_bits(x, ABS_MASK, INF_BITS, NAN_BITS), mask=mask)
    else:
        _store_converted(ptrs, x, mask, STORE_DTYPE, HW_CVT)


@triton.jit
def _kv_cache_insert_kernel(
    kv_ptr, stride_kv_n, stride_kv_d,  # [N, D] float32 / fp16, or the int16 view of bf16
    slot_ptr, stride_slot,  # int64 [N]
    cache_ptr,  # uint8 (fp8 formats), float32 or the int16 view of a bf16/fp16 auto cache
    stride_page, stride_row,  # kv_cache.stride(0), kv_cache.stride(1) (the latter: auto only)
    num_slots, dim,
    PAGE_SIZE: tl.constexpr,  # kv_cache.shape[1]: the slot's page and row by a shift or a multiply
    KV_FORMAT: tl.constexpr,  # FORMAT_IDS value
    KV_IS_BF16: tl.constexpr,
    STORE_DTYPE: tl.constexpr,  # auto only: _STORE_* code of the cache dtype
    BLOCK_D: tl.constexpr,  # auto only: dims per step
    COPY: tl.constexpr,  # auto only: kv has the cache's dtype; both are passed as int bits, copied
    ABS_MASK: tl.constexpr, INF_BITS: tl.constexpr, NAN_BITS: tl.constexpr,  # COPY: the dtype's patterns
    HW_CVT: tl.constexpr,  # hardware float conversions (GPU); integer rounding under the interpreter
):
    # fp8 formats: the quantised dims come in NUM_TILES tiles of TILE dims (one scale each), padded to
    # TILES_P2 tiles for the register tile; the 64 bf16 dims follow them.
    NUM_TILES: tl.constexpr = 4 if KV_FORMAT == 1 else 7
    TILE: tl.constexpr = 128 if KV_FORMAT == 1 else 64
    TILES_P2: tl.constexpr = 4 if KV_FORMAT == 1 else 8
    FP8_DIMS: tl.constexpr = NUM_TILES * TILE
    ROW_BYTES: tl.constexpr = 656 if KV_FORMAT == 1 else 576  # bytes of a token's data row
    stride_kv_n = tl.cast(stride_kv_n, tl.int64)  # the offset rule (ops/_launch.py)
    stride_kv_d = tl.cast(stride_kv_d, tl.int64)
    stride_slot = tl.cast(stride_slot, tl.int64)
    stride_page = tl.cast(stride_page, tl.int64)
    stride_row = tl.cast(stride_row, tl.int64)
    page_size = tl.cast(PAGE_SIZE, tl.int64)  # page_size * 576 passes 2**31 for large fp8_584 pages
    # One program per token: a record is a few hundred bytes, written once. Every load is issued before
    # the slot is known and before any store: the stores are masked by the slot's validity rather than
    # placed under a branch (a branch lets the compiler sink the loads into it, after the slot's load
    # returns), ``kv`` is ``[N, D]`` and always readable, and a load of ``kv`` cannot move above a store
    # to the cache (they may alias). So a program waits for one memory round trip before it stores, not
    # for the slot's, then the values', then the rope's.
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i * stride_slot)
    kv_row = kv_ptr + i * stride_kv_n
    if KV_FORMAT == 0:
        c = tl.arange(0, BLOCK_D)
        x0 = _load_auto(kv_row + c * stride_kv_d, c < dim, COPY, KV_IS_BF16)  # the first BLOCK_D dims
    else:
        t = tl.arange(0, TILES_P2)
        cols = t[:, None] * TILE + tl.arange(0, TILE)[None, :]  # [TILES_P2, TILE]
        in_tile = (t < NUM_TILES)[:, None] & (cols >= 0)
        x = _load_as_f32(kv_row + cols * stride_kv_d, in_tile, KV_IS_BF16)
        r = tl.arange(0, 64)
        rope = _load_as_f32(kv_row + (FP8_DIMS + r) * stride_kv_d, r < 64, KV_IS_BF16)
    ok = (slot >= 0) & (slot < num_slots)
    slot = tl.where(ok, slot, 0)
    page = slot // page_size
    row = slot - page * page_size
    page_base = page * stride_page  # int64
    if KV_FORMAT == 0:
        row_ptr = cache_ptr + page_base + row * stride_row
        _store_auto(row_ptr + c, x0, (c < dim) & ok, COPY, ABS_MASK, INF_BITS, NAN_BITS, STORE_DTYPE, HW_CVT)
        for c0 in range(BLOCK_D, dim, BLOCK_D):  # D > BLOCK_D (1,024) only
            cols = c0 + tl.arange(0, BLOCK_D)
            live = cols < dim
            x1 = _load_auto(kv_row + cols * stride_kv_d, live, COPY, KV_IS_BF16)
            _store_auto(row_ptr + cols, x1, live & ok, COPY, ABS_MASK, INF_BITS, NAN_BITS, STORE_DTYPE, HW_CVT)
    else:
        record = cache_ptr + page_base + row * ROW_BYTES
        ax = tl.abs(x)
        amax = tl.max(tl.where(ax < float("inf"), ax, 0.0), axis=1)  # finite values only (NaN, inf: 0)
        # div_rn does not broadcast: both operands get the full shape.
        e4m3_max = tl.full([TILES_P2], 448.0, tl.float32)
        if KV_FORMAT == 1:
            scale = tl.maximum(tl.math.div_rn(amax, e4m3_max), 1.1754943508222875e-38)
            q = _e4m3_bytes_tl(tl.math.div_rn(x, tl.broadcast_to(scale[:, None], [TILES_P2, TILE])), HW_CVT)
            _store_bytes(record + 512, scale.to(tl.int32, bitcast=True), 4, (t < NUM_TILES)[:, None] & ok)
        else:
            y_bits = tl.math.div_rn(tl.maximum(amax, 1e-4), e4m3_max).to(tl.int32, bitcast=True)
            e = ((y_bits >> 23) & 0xFF) - 127 + ((y_bits & 0x7FFFFF) != 0).to(tl.int32)
            inv_scale = (tl.minimum(tl.maximum(127 - e, 1), 254) << 23).to(tl.float32, bitcast=True)
            q = _e4m3_bytes_tl(x * inv_scale[:, None], HW_CVT)
            exps = tl.where(t < NUM_TILES, tl.minimum(tl.maximum(e + 127, 0), 255), 0)  # 8th byte: 0
            tl.store(cache_ptr + page_base + page_size * 576 + row * 8 + t, exps.to(tl.uint8), mask=(t >= 0) & ok)
        tl.store(record + cols, q, mask=in_tile & ok)
        # fp8_656: after the 512 e4m3 bytes and 16 scale bytes; fp8_584: after the 448 e4m3 bytes
        _store_bytes(record + (528 if KV_FORMAT == 1 else 448), _half_bits(rope, 1, HW_CVT).to(tl.int32), 2,
                     (r < 64)[:, None] & ok)


def _int16_view_of_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


# Warps per insert program (one token each): 4, and 2 for the float8 formats from
# _INSERT_TWO_WARPS_MIN tokens on. On an H100 the two were within 0.13 µs of each other from 1 to 2,048
# tokens, and 2 warps gained 0.4-0.5 µs at 3,072 tokens, 6-7% at 4,096 and 12-14% at 16,384
# (docs/kv_cache.md, "CUDA").
_INSERT_TWO_WARPS_MIN = 2560


def insert_warps(num_tokens: int, kv_format: str) -> int:
    """Warps per program of the insert kernel for ``num_tokens`` tokens."""
    return 2 if kv_format != "auto" and num_tokens >= _INSERT_TWO_WARPS_MIN else 4


def kv_cache_insert_triton(kv, slot_mapping, kv_cache, kv_format):
    n = kv.shape[0]
    if n == 0:
        return
    key = ("kv_cache_insert", kv.shape, kv.stride(), kv.dtype, slot_mapping.stride(0), kv_cache.shape,
           kv_cache.stride(), kv_cache.dtype, kv_format, kv.device)
    launch = _PLANS.get(key)
    if launch is None:
        store = _STORE_CODES[kv_cache.dtype] if kv_format == "auto" else _STORE_F32
        # bf16/fp16 are moved as their int16 bits (the kernels widen bf16 by a shift and round by hand
        # in the interpreter, see above); the plan is made with the int views, and later calls pass the
        # tensors themselves (KernelLaunch). An "auto" cache written from its own dtype is a copy of the
        # bits (NaN made canonical).
        copy = kv_format == "auto" and kv.dtype == kv_cache.dtype
        abs_mask = inf_bits = nan_bits = 0
        if copy:
            int_dtype, abs_mask, inf_bits, nan_bits = _copy_bits(kv.dtype)
            kv_in, cache = kv.view(int_dtype), kv_cache.view(int_dtype)
        else:
            kv_in = _int16_view_of_bf16(kv)
            cache = kv_cache if store == _STORE_F32 else kv_cache.view(torch.int16)
        pages, page_size = kv_cache.shape[0], kv_cache.shape[1]
        dim = kv.shape[1]
        args = (kv_in, kv.stride(0), kv.stride(1), slot_mapping, slot_mapping.stride(0),
                cache, kv_cache.stride(0), kv_cache.stride(1), pages * page_size, dim)
        meta = dict(PAGE_SIZE=page_size, KV_FORMAT=FORMAT_IDS[kv_format], KV_IS_BF16=kv.dtype == torch.bfloat16,
                    STORE_DTYPE=store, BLOCK_D=min(next_pow2(max(dim, 1)), 1024), COPY=copy, ABS_MASK=abs_mask,
                    INF_BITS=inf_bits, NAN_BITS=nan_bits, HW_CVT=kv.device.type == "cuda")
        launch = _PLANS.put(key, KernelLaunch(_kv_cache_insert_kernel, (n,), args, meta,
                                              num_warps=insert_warps(n, kv_format),
                                              device=kv.device, reinterpret=True))
    launch(kv, slot_mapping, kv_cache)


@triton.jit
def _kv_cache_gather_kernel(
    cache_ptr, stride_page, stride_row, num_slots,  # the cache, as _formats.load_kv_cols reads it
    slots_ptr, stride_slots,  # int32 / int64 [N]
    out_ptr, stride_out_n, stride_out_d,  # [N, D]: float32, or the int16 view of bf16 / fp16
    n,
    PAGE_SIZE: tl.constexpr,
    DIM: tl.constexpr,  # D
    CHUNK: tl.constexpr,  # dims per tile (with TAIL: of the first tile)
    TAIL: tl.constexpr,  # > 0: D is CHUNK dims and a second tile of TAIL (the rest, padded to a power of two)
    KV_FORMAT: tl.constexpr,
    STORE_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # slots per program
    HW_CVT: tl.constexpr,  # hardware float conversions (GPU); integer rounding under the interpreter
):
    stride_slots = tl.cast(stride_slots, tl.int64)  # the offset rule (ops/_launch.py); load_kv_cols
    stride_out_n = tl.cast(stride_out_n, tl.int64)  # widens the cache's strides itself
    stride_out_d = tl.cast(stride_out_d, tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < n
    slot = tl.load(slots_ptr + rows * stride_slots, mask=live, other=-1).to(tl.int64)
    valid = live & (slot >= 0) & (slot < num_slots)
    if TAIL > 0:
        # D = CHUNK + (at most CHUNK) dims: two tiles, the second TAIL wide, both loaded before any store
        head = load_kv_cols(cache_ptr, stride_page, stride_row, PAGE_SIZE, slot, valid, 0, CHUNK, CHUNK, KV_FORMAT)
        tail = load_kv_cols(cache_ptr, stride_page, stride_row, PAGE_SIZE, slot, valid, CHUNK, TAIL, DIM, KV_FORMAT)
        cols = tl.arange(0, CHUNK)
        out_rows = out_ptr + rows[:, None] * stride_out_n
        _store_converted(out_rows + cols[None, :] * stride_out_d, head, live[:, None] & (cols >= 0)[None, :],
                         STORE_DTYPE, HW_CVT)
        ct = CHUNK + tl.arange(0, TAIL)
        _store_converted(out_rows + ct[None, :] * stride_out_d, tail, live[:, None] & (ct < DIM)[None, :],
                         STORE_DTYPE, HW_CVT)
    else:
        for c0 in tl.static_range(0, DIM, CHUNK):
            vals = load_kv_cols(cache_ptr, stride_page, stride_row, PAGE_SIZE, slot, valid, c0, CHUNK, DIM, KV_FORMAT)
            cols = c0 + tl.arange(0, CHUNK)
            ptrs = out_ptr + rows[:, None] * stride_out_n + cols[None, :] * stride_out_d
            _store_converted(ptrs, vals, live[:, None] & (cols < DIM)[None, :], STORE_DTYPE, HW_CVT)


@triton.jit
def _kv_cache_copy_kernel(
    cache_ptr, stride_page, stride_row, num_slots,  # an "auto" cache as int16 / int32 bits
    slots_ptr, stride_slots,  # int32 / int64 [N]
    out_ptr, stride_out_n, stride_out_d,  # [N, D], the same bits type as the cache
    n,
    DIM: tl.constexpr,  # D
    PAGE_SIZE: tl.constexpr,
    HEAD: tl.constexpr,  # prev_pow2(D): the first tile's dims
    TAIL: tl.constexpr,  # next_pow2(D - HEAD), 0 when D is a power of two: the second tile's
    ABS_MASK: tl.constexpr,  # the bits below the sign
    INF_BITS: tl.constexpr,  # the magnitude bits of infinity: above it, NaN
    NAN_BITS: tl.constexpr,  # the canonical NaN
    BLOCK_N: tl.constexpr,  # slots per program
):
    """``kv_cache_gather`` of an "auto" cache into its own dtype: a copy of each slot's bits, with every
    NaN pattern replaced by the canonical one (the result of the dequantising path for the same
    values). A row is at most two tiles (``HEAD`` dims, then the rest), both loaded before anything is
    stored (a load of the cache cannot move above a store to ``out``: they may alias)."""
    stride_page = tl.cast(stride_page, tl.int64)  # the offset rule (ops/_launch.py)
    stride_row = tl.cast(stride_row, tl.int64)
    stride_slots = tl.cast(stride_slots, tl.int64)
    stride_out_n = tl.cast(stride_out_n, tl.int64)
    stride_out_d = tl.cast(stride_out_d, tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < n
    slot = tl.load(slots_ptr + rows * stride_slots, mask=live, other=-1).to(tl.int64)
    valid = live & (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    page = slot // PAGE_SIZE
    base = page * stride_page + (slot - page * PAGE_SIZE) * stride_row
    c = tl.arange(0, HEAD)
    a = tl.load(cache_ptr + base[:, None] + c[None, :], mask=valid[:, None], other=0)
    if TAIL > 0:
        ct = HEAD + tl.arange(0, TAIL)
        in_dim = (ct < DIM)[None, :]
        b = tl.load(cache_ptr + base[:, None] + ct[None, :], mask=valid[:, None] & in_dim, other=0)
    out_rows = out_ptr + rows[:, None] * stride_out_n
    tl.store(out_rows + c[None, :] * stride_out_d, _canonical_bits(a, ABS_MASK, INF_BITS, NAN_BITS),
             mask=live[:, None])
    if TAIL > 0:
        tl.store(out_rows + ct[None, :] * stride_out_d, _canonical_bits(b, ABS_MASK, INF_BITS, NAN_BITS),
                 mask=live[:, None] & in_dim)


@triton.jit
def _canonical_bits(bits, ABS_MASK: tl.constexpr, INF_BITS: tl.constexpr, NAN_BITS: tl.constexpr):
    """Float bits with every NaN pattern (magnitude above infinity's) replaced by ``NAN_BITS``."""
    return tl.where((bits & ABS_MASK) > INF_BITS, NAN_BITS, bits).to(bits.dtype)


def _copy_bits(dtype: torch.dtype) -> tuple[torch.dtype, int, int, int]:
    """The copy kernel's view of ``dtype`` and its patterns: (int dtype, magnitude mask, infinity, NaN)."""
    int_dtype = _INT_VIEW[dtype]
    inf_bits = torch.tensor(float("inf"), dtype=dtype).view(int_dtype).item()
    return int_dtype, (1 << (8 * dtype.itemsize - 1)) - 1, inf_bits, NAN_BITS[dtype]


# Longest row the copy kernel takes (its first tile is the largest power of two in D); values per
# program's first tile (the most slots a program takes, see ``_gather_slots``), warps per program. An H200,
# D = 576 bf16, one call per CUDA graph, µs at N = 1 / 128 / 4096: tiles of 2048 (4 slots) 5.50 / 5.73 /
# 8.26, of 4096 (8 slots) 5.47 / 6.59 / 8.54, of 8192 (16 slots) 5.50 / 9.38 / 11.04; 8 warps or 2 no
# better; the dequantising kernel 5.66 / 7.52 / 13.38; PyTorch's compiled index 4.99 / 5.63 / 8.26.
_COPY_MAX_DIM = 4096
_COPY_TILE = 2048
_COPY_WARPS = 4


def _gather_slots(n: int, tile_rows: int) -> int:
    """Slots per program of a gather of ``n`` slots whose tile holds at most ``tile_rows`` of them."""
    return max(1, min(_GATHER_BLOCK_N, tile_rows, prev_pow2(max(n // _GATHER_ROWS_PER_SLOT, 1))))


def _copy_launch(kv_cache, slots, out, n) -> KernelLaunch | None:
    """The copy kernel's launch for an "auto" cache gathered into its own dtype, or None."""
    dim = kv_cache.shape[2]
    if (out.dtype != kv_cache.dtype or out.dtype not in _STORE_CODES or dim > _COPY_MAX_DIM
            or kv_cache.stride(2) != 1):
        return None
    bits, abs_mask, inf_bits, nan_bits = _copy_bits(out.dtype)
    head = prev_pow2(dim)
    tail = next_pow2(dim - head) if dim > head else 0
    block_n = _gather_slots(n, _COPY_TILE // head)
    page_size = kv_cache.shape[1]
    args = (kv_cache.view(bits), kv_cache.stride(0), kv_cache.stride(1), kv_cache.shape[0] * page_size,
            slots, slots.stride(0), out.view(bits), out.stride(0), out.stride(1), n)
    meta = dict(DIM=dim, PAGE_SIZE=page_size, HEAD=head, TAIL=tail, ABS_MASK=abs_mask, INF_BITS=inf_bits,
                NAN_BITS=nan_bits, BLOCK_N=block_n)
    return KernelLaunch(_kv_cache_copy_kernel, (cdiv(n, block_n),), args, meta, num_warps=_COPY_WARPS,
                        device=out.device, reinterpret=True)


def kv_cache_gather_triton(kv_cache, slots, kv_format, dtype=None, *, out):
    n = out.shape[0]
    if n == 0:
        return
    key = ("kv_cache_gather", kv_cache.shape, kv_cache.stride(), kv_cache.dtype, slots.stride(0), slots.dtype,
           out.shape, out.stride(), out.dtype, kv_format, out.device, GATHER_COPY, GATHER_SPLIT)
    launch = _PLANS.get(key)
    if launch is None and kv_format == "auto" and GATHER_COPY:
        launch = _copy_launch(kv_cache, slots, out, n)
        if launch is not None:
            launch = _PLANS.put(key, launch)
    if launch is None:
        store = _STORE_CODES[out.dtype]
        out_bits = out if store == _STORE_F32 else out.view(torch.int16)  # planned as int16, see the insert
        dim = cache_dim(kv_cache, kv_format)
        args = (kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.shape[0] * kv_cache.shape[1],
                slots, slots.stride(0), out_bits, out.stride(0), out.stride(1), n)
        chunk = min(_GATHER_MAX_CHUNK, next_pow2(dim))
        tail = 0
        if GATHER_SPLIT and dim <= _GATHER_MAX_CHUNK and dim != chunk:
            chunk = prev_pow2(dim)  # D = 576: 512 + 64 (one 1,024-wide tile masks 448 of its lanes)
            tail = next_pow2(dim - chunk)
        block_n = _gather_slots(n, prev_pow2(_GATHER_TILE // (chunk + tail)))
        meta = dict(PAGE_SIZE=kv_cache.shape[1], DIM=dim, CHUNK=chunk, TAIL=tail, KV_FORMAT=FORMAT_IDS[kv_format],
                    STORE_DTYPE=store, BLOCK_N=block_n, HW_CVT=out.device.type == "cuda")
        launch = _PLANS.put(key, KernelLaunch(_kv_cache_gather_kernel, (cdiv(n, block_n),), args, meta,
                                              num_warps=4, device=out.device, reinterpret=True))
    launch(kv_cache, slots, out)
