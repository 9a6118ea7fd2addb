"""Naive, independent reference of the KV cache formats of docs/formats.md (one token at a time).

Shared by the KV-cache and sparse-MLA tests. It reads and writes bytes exactly as that page lays
them out, with Python-level loops and float64 where values are decoded, so it shares no code with the
library's kernels.
"""

from __future__ import annotations

import math

import torch

FORMATS = ("auto", "fp8_656", "fp8_584")
DIM = {"fp8_656": 576, "fp8_584": 512}
TOKEN_BYTES = {"fp8_656": 656, "fp8_584": 584}
E4M3_MAX = 448.0
# Non-finite values (docs/kv_cache.md): a tile's amax ignores NaN and +-inf, +-inf saturates to +-448 in
# e4m3fn, and every NaN is stored as the format's canonical quiet NaN (sign and payload dropped).
CANONICAL_NAN = {torch.float8_e4m3fn: 0x7F, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00, torch.float32: 0x7FC00000}
_BITS = {torch.float8_e4m3fn: torch.uint8, torch.bfloat16: torch.int16, torch.float16: torch.int16,
         torch.float32: torch.int32}


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def _page_bytes(kv_cache: torch.Tensor, page: int) -> torch.Tensor:
    """Flat uint8 view of one page (``page_size * bytes_per_token`` bytes from the page's start)."""
    nbytes = kv_cache.shape[1] * kv_cache.shape[2]
    return torch.as_strided(kv_cache, (nbytes,), (1,), kv_cache.storage_offset() + page * kv_cache.stride(0))


def stored(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` rounded to ``dtype`` (nearest even), NaN as the canonical pattern, one at a time."""
    out = values.to(dtype).clone()
    bits = out.view(_BITS[dtype])
    for i, v in enumerate(values.reshape(-1).tolist()):
        if math.isnan(v):
            bits.view(-1)[i] = CANONICAL_NAN[dtype]
    return out


def _e4m3_bytes(values: torch.Tensor) -> torch.Tensor:
    return stored(values.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX), torch.float8_e4m3fn).view(torch.uint8)


def _amax(tile: torch.Tensor) -> float:
    """Largest finite magnitude of a tile (NaN and +-inf ignored)."""
    return max([abs(v) for v in tile.tolist() if math.isfinite(v)], default=0.0)


def _ue8m0_exponent(amax: float) -> int:
    """``ceil(log2(max(amax, 1e-4) / 448))`` with the division in float32, exactly."""
    y = _f32(_f32(max(amax, _f32(1e-4))) / 448.0)
    mantissa, exponent = math.frexp(y)  # y = mantissa * 2**exponent, 0.5 <= mantissa < 1
    return exponent - 1 if mantissa == 0.5 else exponent


def encode(x: torch.Tensor, kv_format: str) -> dict:
    """Quantise one vector ``x [D]``; returns the byte fields of the format."""
    x = x.to(torch.float32)
    if kv_format == "fp8_656":
        fp8, scales = [], []
        for j in range(4):
            tile = x[128 * j : 128 * (j + 1)]
            amax_over_max = (torch.tensor(_amax(tile), dtype=torch.float32) / torch.tensor(E4M3_MAX)).item()
            scale = _f32(max(amax_over_max, 1.1754944e-38))
            scales.append(scale)
            fp8.append(_e4m3_bytes(tile / torch.tensor(scale, dtype=torch.float32)))
        return {
            "fp8": torch.cat(fp8),
            "scales": torch.tensor(scales, dtype=torch.float32).view(torch.uint8),
            "bf16": stored(x[512:576], torch.bfloat16).view(torch.uint8),
        }
    if kv_format == "fp8_584":
        fp8, exps = [], []
        for j in range(7):
            tile = x[64 * j : 64 * (j + 1)]
            e = _ue8m0_exponent(_amax(tile))
            exps.append(min(max(e + 127, 0), 255))
            fp8.append(_e4m3_bytes(tile * (2.0 ** -e)))
        return {
            "fp8": torch.cat(fp8),
            "exponents": torch.tensor(exps + [0], dtype=torch.uint8),
            "bf16": stored(x[448:512], torch.bfloat16).view(torch.uint8),
        }
    raise ValueError(kv_format)


def write_slot(kv_cache: torch.Tensor, slot: int, x: torch.Tensor, kv_format: str) -> None:
    page_size = kv_cache.shape[1]
    page, row = divmod(slot, page_size)
    if kv_format == "auto":
        kv_cache[page, row] = stored(x, kv_cache.dtype)
        return
    f = encode(x, kv_format)
    b = _page_bytes(kv_cache, page)
    if kv_format == "fp8_656":
        base = 656 * row
        b[base : base + 512] = f["fp8"]
        b[base + 512 : base + 528] = f["scales"]
        b[base + 528 : base + 656] = f["bf16"]
    else:
        base = 576 * row
        b[base : base + 448] = f["fp8"]
        b[base + 448 : base + 576] = f["bf16"]
        s = 576 * page_size + 8 * row
        b[s : s + 8] = f["exponents"]


def read_slot(kv_cache: torch.Tensor, slot: int, kv_format: str) -> torch.Tensor:
    """Dequantised float64 vector of one slot."""
    page_size = kv_cache.shape[1]
    page, row = divmod(slot, page_size)
    if kv_format == "auto":
        return kv_cache[page, row].to(torch.float64)
    b = _page_bytes(kv_cache, page)
    if kv_format == "fp8_656":
        base = 656 * row
        vals = b[base : base + 512].clone().view(torch.float8_e4m3fn).to(torch.float64)
        scales = b[base + 512 : base + 528].clone().view(torch.float32).to(torch.float64)
        vals = vals * scales.repeat_interleave(128)
        rope = b[base + 528 : base + 656].clone().view(torch.bfloat16).to(torch.float64)
        return torch.cat([vals, rope])
    base = 576 * row
    vals = b[base : base + 448].clone().view(torch.float8_e4m3fn).to(torch.float64)
    s = 576 * page_size + 8 * row
    exps = b[s : s + 7].to(torch.float64)
    # The scale is the float32 2 ** (byte - 127): byte 255 is inf (so 0 * it is NaN), byte 0 a subnormal.
    vals = vals * torch.pow(2.0, exps - 127).to(torch.float32).to(torch.float64).repeat_interleave(64)
    rope = b[base + 448 : base + 576].clone().view(torch.bfloat16).to(torch.float64)
    return torch.cat([vals, rope])


def make_cache(num_pages: int, page_size: int, kv_format: str, *, dim: int | None = None,
               dtype: torch.dtype = torch.bfloat16, page_pad: int = 0, device="cpu") -> torch.Tensor:
    """An empty cache poisoned with NaN everywhere (every byte 0xFF for the fp8 formats: NaN e4m3,
    NaN float32 scales, NaN bf16). ``page_pad`` extra elements (bytes) pad each page's stride."""
    if kv_format == "auto":
        dim = dim or 576
        per_page = page_size * dim
        flat = torch.full((num_pages, per_page + page_pad), float("nan"), dtype=dtype, device=device)
        return flat[:, :per_page].view(num_pages, page_size, dim) if page_pad == 0 else \
            torch.as_strided(flat, (num_pages, page_size, dim), (per_page + page_pad, dim, 1))
    per_page = page_size * TOKEN_BYTES[kv_format]
    flat = torch.full((num_pages, per_page + page_pad), 0xFF, dtype=torch.uint8, device=device)
    return torch.as_strided(flat, (num_pages, page_size, TOKEN_BYTES[kv_format]),
                            (per_page + page_pad, TOKEN_BYTES[kv_format], 1))


def fill_cache(kv_cache: torch.Tensor, slots, values: torch.Tensor, kv_format: str) -> None:
    """Write ``values[i]`` to ``slots[i]`` (naive insert, for building test caches)."""
    for s, x in zip(list(slots), values):
        write_slot(kv_cache, int(s), x, kv_format)


def dequantize(kv_cache: torch.Tensor, slots, kv_format: str) -> torch.Tensor:
    """float64 ``[N, D]`` of the given slots (no bounds handling: pass valid slots only)."""
    return torch.stack([read_slot(kv_cache, int(s), kv_format) for s in list(slots)])
