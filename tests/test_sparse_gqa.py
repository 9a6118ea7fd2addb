"""Sparse GQA operators: sparse_gqa_decode and gqa_kv_cache_insert.

Sections: inputs and the independent references; schema snapshots; reference parity (CPU kernels);
Triton interpreter parity; opcheck; torch.compile; error messages; CUDA (parity, CUDA graphs,
reduce-overhead), run on the H200.

The references below are written here, independently of the library: Python loops over rows, KV heads
and selected pages in float64, a byte-level NVFP4 decoder (its own E2M1 and e4m3 tables) and a
value-by-value quantiser that searches the nearest representable value. Inputs carry every kind of
invalid index the operator contract lists, and every cache element that no valid (row, KV head, page,
key) may read is poisoned (NaN, or 0xFF bytes whose NVFP4 scale is NaN), so a kernel that reads one
produces NaN and fails the comparison.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
import random
import re

import numpy as np
import pytest
import torch
from expecttest import assert_expected_inline

from torch_sparse_mla import decode_runtime_metadata, gqa_kv_cache_insert, sparse_gqa_decode
from torch_sparse_mla import _library
from torch_sparse_mla.ops import sparse_gqa as gqa_ops
from common import (REPO, check_alignment_needs, compile_counter, forget_signatures, poison, records_split_launches,
                    require_gluon, requires_cuda, requires_hopper, requires_interpreter, run_offline_compile)

BF16, FP16, FP32, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn
NVFP4 = "nvfp4"  # the uint8 NVFP4 cache format
DTYPE_NAMES = {BF16: "bf16", FP16: "fp16", FP32: "fp32", FP8: "fp8", NVFP4: "nvfp4"}


# =====================================================================================================
# Independent number formats: e4m3, E2M1, bf16 / fp16 bits
# =====================================================================================================


def e4m3_value(byte: int) -> float:
    """The value of an e4m3fn byte (NaN for 0x7F / 0xFF)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, mant = (byte >> 3) & 15, byte & 7
    if exp == 15 and mant == 7:
        return math.nan
    if exp == 0:
        return sign * mant / 8 * 2.0**-6
    return sign * (1 + mant / 8) * 2.0 ** (exp - 7)


E4M3_TABLE = torch.tensor([e4m3_value(b) for b in range(256)], dtype=torch.float64)
_E4M3_MAGNITUDES = [e4m3_value(b) for b in range(0x7F)]  # increasing with the byte
E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1_TABLE = torch.tensor(E2M1_MAGNITUDES + [-x for x in E2M1_MAGNITUDES], dtype=torch.float64)


def e4m3_round(x: float) -> int:
    """The e4m3fn byte nearest to ``x`` (ties to the even mantissa), saturating at 448; NaN -> 0x7F."""
    if math.isnan(x):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = min(abs(x), 448.0)
    i = bisect.bisect_left(_E4M3_MAGNITUDES, a)
    candidates = [b for b in (i - 1, i) if 0 <= b < len(_E4M3_MAGNITUDES)]
    best = min(candidates, key=lambda b: (abs(_E4M3_MAGNITUDES[b] - a), b & 1))
    return sign | best


def e2m1_round(y: float, negative: bool) -> int:
    """The 4-bit E2M1 code nearest to ``y`` (ties to the even code, magnitudes above 6 -> 6; NaN -> 0)
    with the given sign bit."""
    a = abs(y)
    if math.isnan(a):
        mag = 0
    elif a > 6.0:
        mag = 7
    else:
        mag = min(range(8), key=lambda c: (abs(E2M1_MAGNITUDES[c] - a), c & 1))
    return mag | (8 if negative else 0)


def f32(x) -> np.float32:
    return np.float32(x)


def bf16_bits(x: np.float32) -> int:
    """Round-to-nearest-even bf16 bits of a float32; NaN -> 0x7FC0."""
    if np.isnan(x):
        return 0x7FC0
    bits = int(np.array(x, dtype=np.float32).view(np.uint32))
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def f16_bits(x: np.float32) -> int:
    """Round-to-nearest-even fp16 bits of a float32; NaN -> 0x7E00."""
    if np.isnan(x):
        return 0x7E00
    with np.errstate(over="ignore"):
        return int(np.array(x, dtype=np.float16).view(np.uint16))


# =====================================================================================================
# The NVFP4 layout, byte by byte
# =====================================================================================================


def flat_bytes(cache: torch.Tensor) -> torch.Tensor:
    """Every byte of ``cache``'s storage, as a uint8 view (cache padding and other views included)."""
    return torch.empty(0, dtype=torch.uint8, device=cache.device).set_(cache.untyped_storage())


def nvfp4_positions(cache: torch.Tensor, page: int, slot: int, token: int, v_order: bool):
    """Storage byte offsets of one token's 64 data bytes and 8 scale bytes in an NVFP4 slot."""
    ps = cache.shape[2]
    base = cache.storage_offset() + page * cache.stride(0) + slot * ps * 72
    data = [base + 64 * token + i for i in range(64)]
    if v_order:
        scales = [base + 64 * ps + (token // 4) * 32 + 4 * j + token % 4 for j in range(8)]
    else:
        scales = [base + 64 * ps + 8 * token + j for j in range(8)]
    return data, scales


def nvfp4_decode_slot(cache: torch.Tensor, page: int, slot: int, v_order: bool) -> torch.Tensor:
    """float64 ``[page_size, 128]``: the decoded values of one slot, from its bytes."""
    storage = flat_bytes(cache).cpu()
    positions = [nvfp4_positions(cache, page, slot, token, v_order) for token in range(cache.shape[2])]
    data = storage[torch.tensor([pos[0] for pos in positions])].long()  # [page_size, 64]
    scales = E4M3_TABLE[storage[torch.tensor([pos[1] for pos in positions])].long()]  # [page_size, 8]
    codes = torch.stack([data & 15, data >> 4], dim=2).flatten(1)  # value 2i: the low nibble of byte i
    return E2M1_TABLE[codes] * scales.repeat_interleave(16, dim=1)


def nvfp4_encode_token(x: torch.Tensor, s: np.float32):
    """(64 data bytes, 8 scale bytes) of one token ``x [128]`` with total scale ``s`` (float32),
    value by value."""
    xs = [f32(v) for v in x.to(torch.float32).tolist()]
    data, scale_bytes = [0] * 64, []
    with np.errstate(all="ignore"):
        for j in range(8):
            group = xs[16 * j: 16 * j + 16]
            amax = f32(max(abs(v) for v in group)) if not any(np.isnan(v) for v in group) else f32(np.nan)
            byte = e4m3_round(float(amax / f32(f32(6.0) * s)))
            scale_bytes.append(byte)
            scale = f32(e4m3_value(byte))
            for i, v in enumerate(group):
                if scale == 0 or np.isnan(scale):
                    code = 0
                else:
                    code = e2m1_round(float(v / f32(scale * s)), bool(np.signbit(v)))
                pos = 16 * j + i
                data[pos // 2] |= code << (4 * (pos % 2))
    return data, scale_bytes


def total_scale(scale: float, scale_tensor) -> np.float32:
    s = f32(scale)
    return s if scale_tensor is None else f32(s * f32(scale_tensor.reshape(()).item()))


def naive_insert(cache, k, v, slot_mapping, k_scale=1.0, v_scale=1.0, k_scale_tensor=None, v_scale_tensor=None):
    """Writes ``cache`` (CPU) byte by byte as the operator contract says."""
    pages, ps = cache.shape[0], cache.shape[2]
    ks, vs = total_scale(k_scale, k_scale_tensor), total_scale(v_scale, v_scale_tensor)
    storage = flat_bytes(cache)
    nvfp4 = cache.dtype == torch.uint8
    for i, slot in enumerate(slot_mapping.tolist()):
        if not 0 <= slot < pages * ps:
            continue
        page, row = divmod(slot, ps)
        for g in range(k.shape[1]):
            for kv_index, (x, s) in enumerate(((k[i, g], ks), (v[i, g], vs))):
                if nvfp4:
                    data, scale_bytes = nvfp4_encode_token(x, s)
                    data_pos, scale_pos = nvfp4_positions(cache, page, 2 * g + kv_index, row, v_order=kv_index == 1)
                    storage[data_pos] = torch.tensor(data, dtype=torch.uint8)
                    storage[scale_pos] = torch.tensor(scale_bytes, dtype=torch.uint8)
                    continue
                dh = x.shape[0]
                dst = cache[page, g, row, kv_index * dh:(kv_index + 1) * dh]
                xs = [f32(e) for e in x.to(torch.float32).tolist()]
                with np.errstate(all="ignore"):
                    if cache.dtype == FP8:
                        bits = [e4m3_round(float(e / s)) for e in xs]
                        dst.view(torch.uint8).copy_(torch.tensor(bits, dtype=torch.uint8))
                    else:
                        to_bits = bf16_bits if cache.dtype == BF16 else f16_bits
                        bits = [to_bits(e) for e in xs]
                        dst.view(torch.int16).copy_(torch.tensor(bits, dtype=torch.int32).to(torch.int16))


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return flat_bytes(t).cpu().clone()


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    a, b = raw_bytes(got), raw_bytes(want)
    assert a.shape == b.shape
    diff = (a != b).nonzero().flatten()
    assert diff.numel() == 0, f"{diff.numel()} bytes differ, first at storage bytes {diff[:8].tolist()}"


# =====================================================================================================
# Decode inputs and the independent reference
# =====================================================================================================


@dataclasses.dataclass(frozen=True)
class Cfg:
    hq: int = 8
    hkv: int = 1
    dh: int = 64
    page_size: int = 16
    dql: int = 1
    q_dtype: torch.dtype = FP16
    kv_dtype: object = FP16  # a torch dtype, or NVFP4
    layout: str = "HND"  # value caches: HND = [pages, Hkv, page, 2Dh] in memory, NHD = [pages, page, Hkv, 2Dh]
    page_pad: int = 0  # extra elements (bytes for NVFP4) at the end of every page: a padded page stride
    batch: int = 3
    n_sel: int = 4
    extra_rows: int = 1  # rows past the last request (t // decode_query_len >= B): must give zeros
    scale_tensors: bool = False  # pass k_scale_tensor / v_scale_tensor
    offset: int = 3  # value caches: storage offset of the view (elements); 3 misaligns it, 16 keeps a float8 cache 16-byte aligned

    @property
    def id(self) -> str:
        layout = "" if self.kv_dtype == NVFP4 else f"-{self.layout}"
        return (f"q{DTYPE_NAMES[self.q_dtype]}-kv{DTYPE_NAMES[self.kv_dtype]}-h{self.hq}/{self.hkv}-d{self.dh}"
                f"-page{self.page_size}-qlen{self.dql}{layout}" + (f"-pad{self.page_pad}" if self.page_pad else "")
                + ("-scale_tensors" if self.scale_tensors else "") + ("" if self.offset == 3 else f"-off{self.offset}"))


def _value_cache(cfg: Cfg, num_pages: int, gen: torch.Generator) -> torch.Tensor:
    """float32 values in the cache layout of ``cfg`` (a view with the padded page stride)."""
    hkv, ps, width = cfg.hkv, cfg.page_size, 2 * cfg.dh
    page_elems = hkv * ps * width
    storage = torch.randn(num_pages * (page_elems + cfg.page_pad) + cfg.offset, generator=gen)
    if cfg.layout == "HND":
        shape, strides = (num_pages, hkv, ps, width), (page_elems + cfg.page_pad, ps * width, width, 1)
    else:
        shape, strides = (num_pages, hkv, ps, width), (page_elems + cfg.page_pad, width, hkv * width, 1)
    return torch.as_strided(storage, shape, strides, cfg.offset)


def _nvfp4_cache(cfg: Cfg, num_pages: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 NVFP4 cache with random codes and finite random scales (a few subnormal or zero), its pages
    padded by ``page_pad`` bytes and the view placed at an odd storage offset (5; ``cfg.offset`` where it
    is not the default 3); unused bytes are 0xFF."""
    slots, ps = 2 * cfg.hkv, cfg.page_size
    page_bytes = slots * ps * 72
    offset = 5 if cfg.offset == 3 else cfg.offset
    storage = torch.full((num_pages * (page_bytes + cfg.page_pad) + offset,), 0xFF, dtype=torch.uint8)
    cache = torch.as_strided(storage, (num_pages, slots, ps, 72), (page_bytes + cfg.page_pad, ps * 72, 72, 1),
                             offset)
    slot_bytes = cache.flatten(2)  # [pages, slots, ps * 72]: each slot's bytes in memory order
    slot_bytes[..., : 64 * ps] = torch.randint(0, 256, (num_pages, slots, 64 * ps), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0x28, 0x48, (num_pages, slots, 8 * ps), generator=gen, dtype=torch.uint8)  # 0.125 .. 3.75
    odd = torch.rand(scales.shape, generator=gen)
    scales = torch.where(odd < 0.03, torch.randint(0, 8, scales.shape, generator=gen, dtype=torch.uint8), scales)
    slot_bytes[..., 64 * ps:] = scales
    return cache


def poison_unread_nvfp4(cache: torch.Tensor, read: torch.Tensor) -> None:
    """Every data and scale byte of the keys ``read`` (bool ``[pages, Hkv, page_size]``) leaves out set
    to 0xFF (a NaN scale), in both the K and the V slot."""
    storage = flat_bytes(cache)
    for p, g, o in (~read).nonzero().tolist():
        for kv_index in (0, 1):
            data, scales = nvfp4_positions(cache, p, 2 * g + kv_index, o, v_order=kv_index == 1)
            storage[data + scales] = 0xFF


def make_inputs(cfg: Cfg, seed: int = 0, device="cpu"):
    """Schema-ordered arguments of one call (a dict) and the ``seq_lens`` they were made from.

    Request 1 is padding (``seq_len`` 0); request 0 is full-length and its block table has a missing
    page (-1), an out-of-range physical id and a negative one; selections prefer the request's pages
    but also hold -1 in the middle and pages past the table (``b >= W``); the extra rows have no request.
    """
    gen = torch.Generator().manual_seed(seed)
    ps, batch = cfg.page_size, cfg.batch
    max_len = ps * (cfg.n_sel + 2)
    seq_lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    if batch > 0:
        seq_lens[0] = max_len
    if batch > 1:
        seq_lens[1] = 0
    num_cols = math.ceil(max_len / ps) + 1
    num_pages = batch * num_cols + 3  # three pages nobody owns
    perm = torch.randperm(num_pages, generator=gen)[: batch * num_cols].view(batch, num_cols)
    used_cols = (seq_lens + ps - 1) // ps
    block_table = torch.where(torch.arange(num_cols)[None, :] < used_cols[:, None], perm, -1)
    if batch > 0:
        block_table[0, 0], block_table[0, 1], block_table[0, 2] = -1, num_pages + 5, -7

    num_rows = batch * cfg.dql + cfg.extra_rows
    kv_lens, qo = decode_runtime_metadata(seq_lens.to(torch.int32), decode_query_len=cfg.dql)
    kv_lens = torch.cat([kv_lens, torch.full((cfg.extra_rows,), max_len, dtype=torch.int32)])
    qo = torch.cat([qo, torch.full((cfg.extra_rows,), max_len - 1, dtype=torch.int32)])

    # Distinct pages per (row, KV head): the request's last page first (where the rows of one request
    # see different numbers of keys), then its other columns, then columns past them, in random order.
    cols_sel = torch.arange(num_cols + 2)[None, :]
    if batch > 0:
        req_cols = used_cols[(torch.arange(num_rows) // cfg.dql).clamp(max=batch - 1)][:, None]
    else:
        req_cols = torch.zeros(num_rows, 1, dtype=torch.int64)
    rank = (cols_sel >= req_cols).float() - 2.0 * (cols_sel == req_cols - 1).float()
    priority = torch.rand(num_rows, cfg.hkv, num_cols + 2, generator=gen) + rank[:, None, :]
    topk = priority.argsort(-1)[..., : cfg.n_sel].to(torch.int32)
    if cfg.n_sel >= 3:  # an empty entry inside each list
        j = 1 + (torch.arange(num_rows)[:, None] + torch.arange(cfg.hkv)[None, :]) % (cfg.n_sel - 2)
        topk.scatter_(2, j[..., None], -1)

    read = _keys_read(topk, block_table, kv_lens, qo, cfg.dql, num_pages, ps)
    if cfg.kv_dtype == NVFP4:
        cache = _nvfp4_cache(cfg, num_pages, gen)
        poison_unread_nvfp4(cache, read)
    else:
        cache = _value_cache(cfg, num_pages, gen)
        if cfg.kv_dtype == FP8:
            cache.mul_(4)
        cache[~read] = float("nan")
        storage = cache.as_strided((cache.untyped_storage().nbytes() // 4,), (1,), 0)
        pad_mask = torch.ones_like(storage, dtype=torch.bool)
        pad_mask.as_strided(cache.shape, cache.stride(), cache.storage_offset()).fill_(False)
        storage[pad_mask] = float("nan")  # page padding too
        cache = _cast_view(cache, cfg.kv_dtype)
    q = torch.randn(num_rows, cfg.hq, cfg.dh, generator=gen)
    fp8_q, quantised_kv = cfg.q_dtype == FP8, cfg.kv_dtype in (FP8, NVFP4)
    if fp8_q:
        q = q * 2

    dev = torch.device(device)
    args = dict(
        q=q.to(cfg.q_dtype).to(dev), kv_cache=_to_device(cache, dev), topk_pages=topk.to(dev),
        block_table=block_table.to(torch.int32).to(dev), kv_segment_lens=kv_lens.to(dev), qo_offset=qo.to(dev),
        decode_query_len=cfg.dql, softmax_scale=cfg.dh ** -0.5,
        q_scale=0.5 if fp8_q else 1.0, k_scale=0.25 if quantised_kv else 1.0, v_scale=0.5 if quantised_kv else 1.0,
        k_scale_tensor=torch.tensor([0.75], device=dev) if cfg.scale_tensors else None,
        v_scale_tensor=torch.tensor([1.5], device=dev) if cfg.scale_tensors else None,
    )
    return args, seq_lens.to(torch.int32).to(dev)


def _cast_view(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float32 view ``cache`` converted to ``dtype`` with the same strides and storage offset."""
    storage = cache.as_strided((cache.untyped_storage().nbytes() // 4,), (1,), 0).to(dtype)
    return torch.as_strided(storage, cache.shape, cache.stride(), cache.storage_offset())


def _to_device(cache: torch.Tensor, device) -> torch.Tensor:
    """``cache`` moved with its whole storage, so strides, offset and padding bytes are kept."""
    storage = torch.empty(0, dtype=cache.dtype, device=cache.device).set_(cache.untyped_storage()).to(device)
    return torch.as_strided(storage, cache.shape, cache.stride(), cache.storage_offset())


def _keys_read(topk, block_table, kv_lens, qo, dql, num_pages, ps):
    """bool [pages, Hkv, page_size]: the cache keys some valid (row, KV head, selected page) may read."""
    read = torch.zeros(num_pages, topk.shape[1], ps, dtype=torch.bool)
    batch, num_cols = block_table.shape
    for t in range(topk.shape[0]):
        if t // dql >= batch:
            continue
        limit = min(int(qo[t]) + 1, int(kv_lens[t]))
        for g in range(topk.shape[1]):
            for b in topk[t, g].tolist():
                if 0 <= b < num_cols and 0 <= (p := int(block_table[t // dql, b])) < num_pages:
                    read[p, g, : max(0, min(ps, limit - b * ps))] = True
    return read


def reference(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len, softmax_scale,
              q_scale=1.0, k_scale=1.0, v_scale=1.0, k_scale_tensor=None, v_scale_tensor=None):
    """float64 ``[T, Hq, Dh]``, straight from the operator contract."""
    num_rows, hq, dh = q.shape
    nvfp4 = kv_cache.dtype == torch.uint8
    num_pages, ps = kv_cache.shape[0], kv_cache.shape[2]
    hkv = kv_cache.shape[1] // 2 if nvfp4 else kv_cache.shape[1]
    batch, num_cols = block_table.shape
    group = hq // hkv
    qd = q.cpu().to(torch.float64)
    cache = kv_cache.cpu() if nvfp4 else kv_cache.cpu().to(torch.float64)
    topk, table = topk_pages.cpu(), block_table.cpu()
    k_factor = k_scale * (1.0 if k_scale_tensor is None else float(k_scale_tensor.item()))
    v_factor = v_scale * (1.0 if v_scale_tensor is None else float(v_scale_tensor.item()))
    decoded = {}

    def kv_of(p, g):
        if not nvfp4:
            return cache[p, g, :, :dh], cache[p, g, :, dh:]
        if (p, g) not in decoded:
            decoded[p, g] = (nvfp4_decode_slot(kv_cache, p, 2 * g, False), nvfp4_decode_slot(kv_cache, p, 2 * g + 1, True))
        return decoded[p, g]

    out = torch.zeros(num_rows, hq, dh, dtype=torch.float64)
    for t in range(num_rows):
        r = t // decode_query_len
        if r >= batch:
            continue
        limit = min(int(qo_offset[t]) + 1, int(kv_segment_lens[t]))
        for g in range(hkv):
            keys, values = [], []
            for b in topk[t, g].tolist():
                if b < 0 or b >= num_cols or not 0 <= (p := int(table[r, b])) < num_pages:
                    continue
                visible = max(0, min(ps, limit - b * ps))  # keys o with b * ps + o < limit
                k, v = kv_of(p, g)
                keys.append(k[:visible])
                values.append(v[:visible])
            if keys and sum(k.shape[0] for k in keys) > 0:
                heads = slice(g * group, (g + 1) * group)
                scores = qd[t, heads] @ torch.cat(keys).T * (softmax_scale * q_scale * k_factor)
                out[t, heads] = v_factor * torch.softmax(scores, dim=-1) @ torch.cat(values)
    return out


def _tolerance(q_dtype):
    # The output is stored in bf16 (bf16 or fp8 q) or fp16; the bf16 CUDA kernel also rounds P to bf16.
    return dict(atol=2e-2, rtol=2e-2) if q_dtype != FP16 else dict(atol=4e-3, rtol=4e-3)


def assert_matches_reference(result, args, tol: dict | None = None):
    """``result`` against the float64 reference, relative to the output's range; ``tol`` (``atol``,
    ``rtol``) replaces the query dtype's tolerance."""
    ref = reference(**args)
    assert result.dtype == (BF16 if args["q"].dtype == FP8 else args["q"].dtype)
    assert not torch.isnan(result).any(), "NaN in the output: a kernel read a key it must not read"
    # NVFP4 values reach 6 * 448: compare relative to the range (a call without rows has none)
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    torch.testing.assert_close(result.cpu().to(torch.float64) / scale, ref / scale,
                               **(tol or _tolerance(args["q"].dtype)))
    return ref


def _public(args, **extra):
    a = dict(args)
    positional = [a.pop(k) for k in ("q", "kv_cache", "topk_pages", "block_table", "kv_segment_lens", "qo_offset")]
    return sparse_gqa_decode(*positional, **a, **extra)


def _out_buffer(args, transpose=False):
    q = args["q"]
    dtype = BF16 if q.dtype == FP8 else q.dtype
    if transpose:  # a non-contiguous buffer: heads outermost
        return poison(torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=dtype, device=q.device).transpose(0, 1))
    return poison(torch.empty(q.shape, dtype=dtype, device=q.device))


CPU_CASES = [
    Cfg(hq=8, hkv=1, dh=64, page_size=16, dql=1, q_dtype=BF16, kv_dtype=BF16),
    Cfg(hq=64, hkv=4, dh=128, page_size=32, dql=4, q_dtype=FP16, kv_dtype=FP16, layout="NHD"),
    Cfg(hq=6, hkv=2, dh=256, page_size=16, dql=4, q_dtype=FP8, kv_dtype=FP8, page_pad=5),
    Cfg(hq=64, hkv=4, dh=128, page_size=64, dql=1, q_dtype=BF16, kv_dtype=FP8, layout="NHD", n_sel=3,
        scale_tensors=True),
    Cfg(hq=6, hkv=2, dh=64, page_size=16, dql=4, q_dtype=FP16, kv_dtype=BF16, layout="NHD"),
    Cfg(hq=8, hkv=1, dh=128, page_size=48, dql=1, q_dtype=FP8, kv_dtype=BF16, n_sel=5),  # page size not 2^k
    Cfg(hq=8, hkv=2, dh=128, page_size=16, dql=2, q_dtype=BF16, kv_dtype=NVFP4, page_pad=7),
    Cfg(hq=16, hkv=1, dh=128, page_size=12, dql=1, q_dtype=FP16, kv_dtype=NVFP4, scale_tensors=True),
    Cfg(hq=4, hkv=2, dh=128, page_size=16, dql=4, q_dtype=FP8, kv_dtype=NVFP4, batch=2, n_sel=3),
]


def test_inputs_exercise_the_kernel():
    """The factory makes rows with keys, rows without, and poison the kernels must avoid."""
    for cfg in (CPU_CASES[1], CPU_CASES[6]):
        args, _ = make_inputs(cfg)
        ref = reference(**args)
        has_keys = ref.abs().sum(dim=(1, 2)) > 0
        assert 0 < int(has_keys.sum()) < ref.shape[0]
        cache = args["kv_cache"]
        if cache.dtype == torch.uint8:
            assert (raw_bytes(cache) == 0xFF).sum() > 1000
        else:
            assert torch.isnan(cache.float()).any()


def test_reference_nvfp4_decoder_against_the_layout():
    """The test's decoder reads what the layout says: a hand-built token (codes 0..15, scale 2)."""
    cache = torch.zeros(1, 2, 4, 72, dtype=torch.uint8)
    storage = flat_bytes(cache)
    data, scales = nvfp4_positions(cache, 0, 1, 2, v_order=True)  # V slot, token 2
    storage[data] = torch.tensor([(2 * i % 16) | ((2 * i + 1) % 16) << 4 for i in range(64)], dtype=torch.uint8)
    storage[scales] = 0x40  # e4m3 2.0
    assert scales == [4 * 72 + 4 * 64 + 2 + 4 * j for j in range(8)]  # slot 1; quad order: token 2 of quad 0
    values = nvfp4_decode_slot(cache, 0, 1, v_order=True)[2]
    expected = torch.tensor([E2M1_TABLE[c].item() * 2 for c in list(range(16)) * 8], dtype=torch.float64)
    assert torch.equal(values, expected)
    assert E2M1_TABLE[9].item() == -0.5 and E2M1_TABLE[15].item() == -6.0
    assert e4m3_value(0x7E) == 448 and e4m3_value(0x01) == 2.0**-9 and math.isnan(e4m3_value(0xFF))


# =====================================================================================================
# gqa_kv_cache_insert inputs
# =====================================================================================================

INSERT_FORMATS = [BF16, FP16, FP8, NVFP4]


def make_cache(kv_dtype, pages=3, hkv=2, page_size=8, dh=128, page_pad=5, device="cpu"):
    """A cache whose every byte (page padding included) is random, so untouched bytes are recognisable."""
    gen = torch.Generator().manual_seed(7)
    if kv_dtype == NVFP4:
        page_elems, shape = 2 * hkv * page_size * 72, (pages, 2 * hkv, page_size, 72)
        strides = (page_elems + page_pad, page_size * 72, 72, 1)
        storage = torch.randint(0, 256, (pages * (page_elems + page_pad) + 3,), generator=gen, dtype=torch.uint8)
    else:
        page_elems, shape = hkv * page_size * 2 * dh, (pages, hkv, page_size, 2 * dh)
        strides = (page_elems + page_pad, page_size * 2 * dh, 2 * dh, 1)
        width = 1 if kv_dtype == FP8 else 2
        storage = torch.randint(0, 256, ((pages * (page_elems + page_pad) + 3) * width,), generator=gen,
                                dtype=torch.uint8).view(kv_dtype)
    return torch.as_strided(storage.to(device), shape, strides, 3)


def make_kv(n: int, hkv: int, dh: int, dtype, seed: int) -> torch.Tensor:
    """``[n, Hkv, Dh]`` values with seven decades of dynamic range between 16-value groups, plus: an
    all-zero group, exact E2M1 ties under a scale of 1 (group amax 6), a -0.0, a huge group (its scale
    saturates at 448), a group whose scale rounds to 0, values past 448 for the float8 cache, and a
    value of 1e30."""
    g = torch.Generator().manual_seed(seed)
    groups = dh // 16
    decades = torch.empty(n, hkv, groups).uniform_(-3.5, 3.5, generator=g)
    x = torch.randn(n, hkv, dh, generator=g) * torch.pow(10.0, decades).repeat_interleave(16, dim=2)
    if n > 0:
        x[0, 0, :16] = 0.0
        x[0, 0, 16:32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75,
                                       -2.5, -3.5, -5.0, 7.0])
        x[0, 0, 32] = 1.0
        x[0, 0, 33] = -0.0
        x[0, 0, 48:64] = 1e5
        x[0, 0, 64:80] = 1e-9
        x[0, 0, 80] = 1000.0
    if n > 1:
        x[1, 1, 0] = 1e30  # past 2**60: the GPU writer's block takes its division path (inf in fp16)
    return x.to(dtype)


def make_slots(num_slots: int, n_valid: int, seed: int) -> torch.Tensor:
    """int64 slots: ``n_valid`` distinct valid ones (first and last included) and every kind of
    skipped entry (negative, == num_slots, far past the end), shuffled."""
    gen = torch.Generator().manual_seed(seed)
    valid = torch.randperm(num_slots - 2, generator=gen)[: n_valid - 2] + 1
    empty = torch.tensor([-1, -7, -(2**62), num_slots, num_slots + 5, 2**40])
    slots = torch.cat([torch.tensor([0, num_slots - 1]), valid, empty])
    return slots[torch.randperm(slots.shape[0], generator=gen)]


def _insert_inputs(kv_dtype, in_dtype=FP32, scale_tensors=False, seed=0, device="cpu"):
    cache = make_cache(kv_dtype, device=device)
    num_slots = cache.shape[0] * cache.shape[2]
    slots = make_slots(num_slots, 9, seed)
    k = make_kv(slots.shape[0], 2, 128, in_dtype, seed=seed + 1)
    v = make_kv(slots.shape[0], 2, 128, in_dtype, seed=seed + 2)
    scales = dict(k_scale=0.5, v_scale=3.0)
    if scale_tensors:
        scales.update(k_scale_tensor=torch.tensor([0.375], device=device),
                      v_scale_tensor=torch.tensor([2.5], device=device))
    return cache, k.to(device), v.to(device), slots.to(device), scales


# =====================================================================================================
# Schema snapshots
# =====================================================================================================


def _schema_lines(overload) -> str:
    return str(overload._schema).replace(", ", ",\n")  # one argument per line


def test_schema():
    assert_expected_inline(_schema_lines(torch.ops.sparse_mla.sparse_gqa_decode.default), """\
sparse_mla::sparse_gqa_decode(Tensor q,
Tensor kv_cache,
Tensor topk_pages,
Tensor block_table,
Tensor kv_segment_lens,
Tensor qo_offset,
int decode_query_len,
float softmax_scale,
float q_scale=1.,
float k_scale=1.,
float v_scale=1.,
Tensor? k_scale_tensor=None,
Tensor? v_scale_tensor=None) -> Tensor""")
    assert_expected_inline(_schema_lines(torch.ops.sparse_mla.sparse_gqa_decode.out), """\
sparse_mla::sparse_gqa_decode.out(Tensor q,
Tensor kv_cache,
Tensor topk_pages,
Tensor block_table,
Tensor kv_segment_lens,
Tensor qo_offset,
int decode_query_len,
float softmax_scale,
float q_scale=1.,
float k_scale=1.,
float v_scale=1.,
Tensor? k_scale_tensor=None,
Tensor? v_scale_tensor=None,
*,
Tensor(a!) out) -> ()""")
    assert_expected_inline(_schema_lines(torch.ops.sparse_mla.gqa_kv_cache_insert.default), """\
sparse_mla::gqa_kv_cache_insert(Tensor k,
Tensor v,
Tensor slot_mapping,
Tensor(a!) kv_cache,
float k_scale=1.,
float v_scale=1.,
Tensor? k_scale_tensor=None,
Tensor? v_scale_tensor=None) -> ()""")


# =====================================================================================================
# Reference parity (CPU kernels)
# =====================================================================================================


@pytest.mark.parametrize("cfg", CPU_CASES, ids=lambda c: c.id)
def test_cpu_matches_reference(cfg):
    args, _ = make_inputs(cfg, seed=1)
    assert_matches_reference(_public(args), args)
    out = _out_buffer(args, transpose=True)
    assert _public(args, out=out) is out
    assert_matches_reference(out, args)


def test_cpu_chunked_rows(monkeypatch):
    """The CPU kernel processes rows in chunks: the request of a row must not depend on its chunk."""
    monkeypatch.setattr(gqa_ops, "_TORCH_CHUNK_ELEMENTS", 1)  # one row per chunk
    for cfg in (Cfg(hq=6, hkv=2, dql=4, batch=2), Cfg(hq=4, hkv=2, dh=128, dql=4, batch=2, kv_dtype=NVFP4)):
        args, _ = make_inputs(cfg, seed=2)
        assert_matches_reference(_public(args), args)


@pytest.mark.parametrize("kv_dtype", [FP16, NVFP4], ids=lambda d: DTYPE_NAMES[d])
@pytest.mark.parametrize("what", ["no_rows", "no_selection", "no_requests", "no_pages"])
def test_cpu_empty_inputs(what, kv_dtype):
    args, _ = make_inputs(Cfg(hq=4, hkv=2, dh=128, dql=2, batch=2, extra_rows=0, kv_dtype=kv_dtype), seed=3)
    if what == "no_rows":
        for k in ("q", "topk_pages", "kv_segment_lens", "qo_offset"):
            args[k] = args[k][:0]
    elif what == "no_selection":
        args["topk_pages"] = args["topk_pages"][..., :0]
    elif what == "no_requests":
        args["block_table"] = args["block_table"][:0]
    else:
        args["kv_cache"] = args["kv_cache"][:0]
    result = _public(args)
    assert result.shape == args["q"].shape
    assert (result == 0).all()


def _overflow_inputs(kv_dtype=FP16):
    """One row, one KV head, 8 keys whose products with q are +1 (keys 0, 3, 5) or -1: with a huge
    softmax_scale every score overflows float32."""
    q = torch.zeros(1, 4, 128, dtype=FP16)
    q[..., 0] = 1.0
    signs = torch.tensor([1, -1, -1, 1, -1, 1, -1, -1], dtype=torch.float32)
    values = torch.randn(8, 2, 128, generator=torch.Generator().manual_seed(0))
    if kv_dtype == NVFP4:
        cache = torch.zeros(1, 2, 8, 72, dtype=torch.uint8)
        k = torch.zeros(8, 1, 128)
        k[:, 0, 0] = signs
        gqa_kv_cache_insert(k, values[:, None, 1], torch.arange(8), cache)
        vals = torch.stack([nvfp4_decode_slot(cache, 0, 1, True)[o] for o in range(8)]).float()
    else:
        cache = torch.zeros(1, 1, 8, 256, dtype=kv_dtype)
        cache[0, 0, :, 0] = signs.to(kv_dtype)
        cache[0, 0, :, 128:] = values[:, 1].to(kv_dtype)
        vals = cache[0, 0, :, 128:].float()
    args = dict(q=q, kv_cache=cache, topk_pages=torch.zeros(1, 1, 1, dtype=torch.int32),
                block_table=torch.zeros(1, 1, dtype=torch.int32), kv_segment_lens=torch.tensor([8], dtype=torch.int32),
                qo_offset=torch.tensor([7], dtype=torch.int32), decode_query_len=1, softmax_scale=3e38)
    return args, vals[signs > 0].double().mean(0)


@pytest.mark.parametrize("kv_dtype", [FP16, NVFP4], ids=lambda d: DTYPE_NAMES[d])
def test_cpu_score_overflow_is_not_nan(kv_dtype):
    """Scores beyond float32 saturate: the keys with the largest (saturated) scores share the weight,
    which is also the limit of the softmax; never NaN."""
    args, expected = _overflow_inputs(kv_dtype)
    for extra in ({}, {"q_scale": 1e30, "k_scale": 1e30}):
        out = _public(args, **extra)
        assert torch.isfinite(out.float()).all()
        torch.testing.assert_close(out[0].double(), expected.expand(4, 128).to(FP16).double(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("scale_tensors", [False, True], ids=["float_scales", "scale_tensors"])
@pytest.mark.parametrize("in_dtype", [BF16, FP16, FP32], ids=lambda d: f"in_{DTYPE_NAMES[d]}")
@pytest.mark.parametrize("kv_dtype", INSERT_FORMATS, ids=lambda d: DTYPE_NAMES[d])
def test_insert_matches_reference(kv_dtype, in_dtype, scale_tensors):
    """Every byte of the storage (page padding and other tokens included) equals the independent
    reference's: the written tokens are encoded exactly, nothing else changes."""
    cache, k, v, slots, scales = _insert_inputs(kv_dtype, in_dtype, scale_tensors)
    want = make_cache(kv_dtype)
    gqa_kv_cache_insert(k, v, slots, cache, **scales)
    naive_insert(want, k, v, slots, **scales)
    assert_same_bytes(cache, want)


def test_insert_nvfp4_edge_cases():
    """The scale and code rules on hand-made groups (KV head 0 of token 0, K, total scale 1)."""
    cache = make_cache(NVFP4)
    k = make_kv(1, 2, 128, FP32, seed=3)
    gqa_kv_cache_insert(k, k, torch.tensor([0]), cache)
    data, scales = nvfp4_positions(cache, 0, 0, 0, v_order=False)
    storage = flat_bytes(cache)
    scale_bytes, data_bytes = storage[scales].tolist(), storage[data].tolist()
    codes = [data_bytes[i // 2] >> (4 * (i % 2)) & 15 for i in range(128)]
    assert scale_bytes[0] == 0 and codes[:16] == [0] * 16  # all-zero group: scale 0, every code 0
    # amax 7: 7 / 6 = 1.1667 rounds to the e4m3 1.125 (0x39); x / 1.125 -> the nearest E2M1 value
    assert scale_bytes[1] == 0x39
    assert codes[16:32] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 7]
    assert codes[33] == 8  # -0.0 keeps its sign bit
    assert scale_bytes[3] == 0x7E and codes[48:64] == [7] * 16  # 1e5 / 6 saturates at 448, codes clamp at 6
    assert scale_bytes[4] == 0 and codes[64:80] == [0] * 16  # 1e-9 / 6 rounds to a zero scale


def test_insert_nvfp4_ties_to_even():
    """With the scale exactly 1 (amax 6), the values halfway between E2M1 neighbours go to the even code."""
    cache = make_cache(NVFP4)
    k = torch.zeros(1, 2, 128)
    k[0, 0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.26, 0.74, 1.26, 1.74, 2.51, 3.49,
                                 5.01, -6.0])
    gqa_kv_cache_insert(k, k, torch.tensor([1]), cache)
    data, scales = nvfp4_positions(cache, 0, 0, 1, v_order=False)
    storage = flat_bytes(cache)
    assert storage[scales[0]].item() == 0x38  # e4m3 1.0
    b = storage[data].tolist()
    codes = [b[i // 2] >> (4 * (i % 2)) & 15 for i in range(16)]
    assert codes == [0, 2, 2, 4, 4, 6, 6, 7, 1, 1, 3, 3, 5, 5, 7, 15]


@pytest.mark.parametrize("kv_dtype", INSERT_FORMATS, ids=lambda d: DTYPE_NAMES[d])
def test_insert_nan_inputs(kv_dtype):
    """NaN is stored as the format's canonical NaN (an NVFP4 group with a NaN gets the NaN scale)."""
    cache, k, v, slots, scales = _insert_inputs(kv_dtype, FP32, seed=5)
    k[:, 1, 3] = float("nan")
    v[:, 0, 100] = -float("nan")
    want = make_cache(kv_dtype)
    gqa_kv_cache_insert(k, v, slots, cache, **scales)
    naive_insert(want, k, v, slots, **scales)
    assert_same_bytes(cache, want)
    slot = int(slots[(slots >= 0) & (slots < 24)][0])
    page, row = divmod(slot, cache.shape[2])
    if kv_dtype == NVFP4:
        _, scale_pos = nvfp4_positions(cache, page, 2, row, v_order=False)
        assert flat_bytes(cache)[scale_pos[0]].item() == 0x7F
    else:
        assert torch.isnan(cache[page, 1, row, 3].float())


@pytest.mark.parametrize("kv_dtype", INSERT_FORMATS, ids=lambda d: DTYPE_NAMES[d])
def test_insert_nothing_to_write(kv_dtype):
    cache, k, v, slots, scales = _insert_inputs(kv_dtype)
    before = raw_bytes(cache)
    gqa_kv_cache_insert(k[:0], v[:0], slots[:0], cache)
    gqa_kv_cache_insert(k[:4], v[:4], torch.tensor([-1, 24, 2**40, -(2**62)]), cache, **scales)
    assert torch.equal(raw_bytes(cache), before)


def test_writer_loads_wait_for_no_load():
    """Both cache writers (this one and ``kv_cache_insert``) issue every load at their start: no load's
    pointer, mask or default derives from a loaded value (``scripts/compile_sm90.py
    --check-load-chains`` on their sm_90 TTIR). Until 2026-12-04 this writer masked the K and V rows'
    loads by their slot's validity, which made them wait for the slot's load (0.3-0.4 µs a call on an
    H200)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_offline_compile("compile_sm90.py", "--ttir-only", "--check-load-chains", "--list", "--cases",
                                 "kv_cache", "sparse_gqa")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    checked = re.search(r"(\d+) cache-writer launches checked", result.stdout)
    assert checked and int(checked.group(1)) >= 3 + 2, result.stdout[-2000:]  # GQA: 3 formats, MLA: several


@pytest.mark.parametrize("kv_dtype", INSERT_FORMATS, ids=lambda d: DTYPE_NAMES[d])
def test_insert_then_decode_round_trip(kv_dtype):
    """Tokens written by gqa_kv_cache_insert, read back by sparse_gqa_decode, give attention over the
    quantised values, close to attention over the originals."""
    hkv, dh, ps, n = 2, 128, 16, 40
    if kv_dtype == NVFP4:
        cache = torch.full((3, 2 * hkv, ps, 72), 0xFF, dtype=torch.uint8)
    else:
        cache = torch.full((3, hkv, ps, 2 * dh), float("nan")).to(kv_dtype)
    gen = torch.Generator().manual_seed(11)
    k, v = torch.randn(n, hkv, dh, generator=gen), torch.randn(n, hkv, dh, generator=gen)
    slots = torch.cat([torch.arange(32, 32 + 8), torch.arange(0, 32)])  # pages 2 (part), 0, 1
    scales = dict(k_scale=0.25, v_scale=0.125) if kv_dtype in (FP8, NVFP4) else {}
    gqa_kv_cache_insert(k, v, slots, cache, **scales)
    q = torch.randn(2, 4, dh, generator=gen).to(FP16)
    block_table = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    lens = torch.tensor([40, 40], dtype=torch.int32)
    topk = torch.tensor([[[0, 1, 2]] * hkv, [[2, 0, -1]] * hkv], dtype=torch.int32)
    args = dict(q=q, kv_cache=cache, topk_pages=topk, block_table=block_table.expand(2, 3).contiguous(),
                kv_segment_lens=lens, qo_offset=lens - 1, decode_query_len=1, softmax_scale=dh ** -0.5, **scales)
    out = _public(args)
    assert_matches_reference(out, args)  # the stored values, decoded independently
    # and close to attention over the unquantised values (position p of the sequence is row p of k / v)
    order = torch.argsort(slots)
    kk, vv = k[order], v[order]  # sorted by slot == position
    want = torch.zeros(2, 4, dh, dtype=torch.float64)
    for t, pages in enumerate(([0, 1, 2], [2, 0])):
        pos = torch.cat([torch.arange(16 * p, min(16 * p + 16, 40)) for p in pages])
        for h in range(4):
            g = h // 2
            p = torch.softmax(q[t, h].double() @ kk[pos, g].double().T * dh ** -0.5, 0)
            want[t, h] = p @ vv[pos, g].double()
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < {BF16: 1e-2, FP16: 5e-3, FP8: 8e-2, NVFP4: 0.3}[kv_dtype], err


# =====================================================================================================
# Triton interpreter parity (CPU tensors; tl.dot operands must be fp16/fp32 there, see the docs)
# =====================================================================================================

INTERPRETER_CASES = [
    Cfg(hq=8, hkv=1, dh=64, page_size=16, dql=4, batch=2, n_sel=6),
    Cfg(hq=6, hkv=2, dh=128, page_size=32, dql=1, q_dtype=FP8, kv_dtype=FP8, layout="NHD", n_sel=6, page_pad=3),
    Cfg(hq=64, hkv=4, dh=256, page_size=16, dql=1, q_dtype=FP16, kv_dtype=FP8, batch=2, n_sel=3),
    Cfg(hq=80, hkv=1, dh=64, page_size=48, dql=4, q_dtype=FP16, kv_dtype=BF16, batch=2, layout="NHD"),  # 2 head blocks
    Cfg(hq=16, hkv=2, dh=128, page_size=64, dql=1, q_dtype=BF16, kv_dtype=FP8, batch=2, scale_tensors=True),  # q scaled to fp16
    Cfg(hq=8, hkv=2, dh=128, page_size=16, dql=2, q_dtype=BF16, kv_dtype=NVFP4, batch=2, page_pad=9),
    Cfg(hq=4, hkv=1, dh=128, page_size=32, dql=1, q_dtype=FP16, kv_dtype=NVFP4, batch=3, scale_tensors=True),
    Cfg(hq=6, hkv=2, dh=128, page_size=16, dql=4, q_dtype=FP8, kv_dtype=NVFP4, batch=1, n_sel=3),
]


@requires_interpreter
@pytest.mark.parametrize("num_splits", [None, 1, 3], ids=lambda s: f"splits={s or 'auto'}")
@pytest.mark.parametrize("cfg", INTERPRETER_CASES, ids=lambda c: c.id)
def test_triton_interpreter_matches_reference(cfg, num_splits):
    args, _ = make_inputs(cfg, seed=4)
    out = _out_buffer(args, transpose=num_splits == 3)
    gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, num_splits=num_splits)
    assert_matches_reference(out, args)


@requires_interpreter
@pytest.mark.parametrize("typed", [False, True], ids=["as_bytes", "typed"])
def test_triton_interpreter_float8_as_bytes_or_typed(typed, monkeypatch):
    """A float8 query and cache reach the portable kernel as their bytes (``uint8`` views, converted by
    integer operations) where Triton has no float8 type for the device (before sm_89; the interpreter),
    else typed (sm_89 and later, forced here): both give the reference's result, and the launch reads
    the two tensors as the planned dtypes while it is called with the tensors themselves (so that the
    record-and-replay of ``_library.py`` finds them). Under the interpreter the e4m3 conversions take
    the integer route either way (decided when the kernel is compiled), so the typed run tests the
    launcher's choice and the typed loads."""
    monkeypatch.setattr(gqa_ops, "float8_conversions", lambda device: typed)
    monkeypatch.setattr(gqa_ops, "_PLANS", gqa_ops.PlanCache())
    args, _ = make_inputs(INTERPRETER_CASES[1], seed=9)
    assert args["q"].dtype == args["kv_cache"].dtype == FP8
    out = _out_buffer(args)
    gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, num_splits=2, path="portable")
    (_, main, _), = gqa_ops._PLANS.values()
    assert main.kernel.fn.__name__ == "_sparse_gqa_decode_kernel"
    assert main.dtypes == (None if typed else (torch.uint8, torch.uint8) + (None,) * 8)
    assert_matches_reference(out, args)
    # The launches of a call are recorded for replay (what the registered CUDA implementation does
    # with a signature's first call): every tensor they take is one of the call's own, views included.
    record = _library._record(gqa_ops.sparse_gqa_decode_triton, tuple(args.values()), {"out": poison(out)})
    assert record is not None
    replayed = _out_buffer(args)
    assert _library._replay(record, (*args.values(), replayed))
    torch.testing.assert_close(replayed, out, rtol=0, atol=0)


@requires_interpreter
@pytest.mark.parametrize("cfg", INTERPRETER_CASES[:2], ids=lambda c: c.id)
def test_triton_interpreter_combine_in_steps(cfg, monkeypatch):
    """The split combine merges the partials in one round of loads when every split fits one step
    (the plans' case), and in steps of ``_COMBINE_ROWS`` splits after a pass for the maximum otherwise:
    both give the reference's result (6 splits; steps of 2 forced)."""
    args, _ = make_inputs(cfg, seed=7)
    for rows, one_step in ((32, True), (2, False)):
        monkeypatch.setattr(gqa_ops, "_COMBINE_ROWS", rows)
        gqa_ops._PLANS.clear()
        out = _out_buffer(args)
        gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, num_splits=6, path="portable")
        (_, _, combine), = gqa_ops._PLANS.values()
        gqa_ops._PLANS.clear()
        assert (combine.meta["BLOCK_S"] == combine.meta["BLOCK_SM"]) is one_step
        assert_matches_reference(out, args)


@requires_interpreter
@pytest.mark.parametrize("transposed", [False, True], ids=["key_groups", "transposed"])
@pytest.mark.parametrize("cfg", INTERPRETER_CASES[:2], ids=lambda c: c.id)
def test_triton_interpreter_tile_forms(cfg, transposed):
    """Both tile forms of a value cache with a small head block (the plan picks one by batch size)."""
    assert_tile_form_matches(make_inputs(cfg, seed=6)[0], transposed, split_counts=(1, 3))


def assert_tile_form_matches(args, transposed: bool, split_counts):
    """The decode in one tile form (``LaunchPlan.transposed``) at each split count, against the reference."""
    for num_splits in split_counts:
        out = _out_buffer(args)
        gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, num_splits=num_splits,
                                         config=dict(transposed=transposed), path="portable")
        assert_matches_reference(out, args)


@requires_interpreter
def test_triton_interpreter_recorded_split_launches():
    """The ``out`` implementation registered for CUDA, through the interpreter: the first call of a
    split signature records the decode and combine launches and the workspace's size; later calls of
    the signature (new values) replay them, each with a workspace of its own, and match the reference."""
    impl = _library.IMPLS["sparse_gqa_decode.out", "CUDA"]
    cfg = Cfg(hq=8, hkv=1, dh=64, page_size=16, batch=1, extra_rows=0, n_sel=6)
    for seed in (1, 2, 3):
        args, _ = make_inputs(cfg, seed=seed)
        assert gqa_ops.launch_config(args["q"], args["kv_cache"], cfg.n_sel).num_splits > 1
        out = _out_buffer(args)
        impl(*args.values(), out=out)
        assert_matches_reference(out, args)
    assert records_split_launches(impl)


@requires_interpreter
@pytest.mark.parametrize("kv_dtype", [FP16, NVFP4], ids=lambda d: DTYPE_NAMES[d])
def test_triton_interpreter_block_n_128(kv_dtype):
    """The 128-key tile (pages of 128) used on the GPU for the benchmark shapes."""
    args, _ = make_inputs(Cfg(hq=16, hkv=1, dh=128, page_size=128, q_dtype=FP16, kv_dtype=kv_dtype, batch=2,
                              n_sel=2), seed=5)
    out = _out_buffer(args)
    gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, config=dict(block_n=128))
    assert_matches_reference(out, args)


@requires_interpreter
def test_triton_interpreter_no_selection():
    args, _ = make_inputs(Cfg(batch=2, extra_rows=0), seed=5)
    args["topk_pages"] = args["topk_pages"][..., :0]
    out = _out_buffer(args)
    gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out)
    assert (out == 0).all()


@requires_interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the scores overflow on purpose
@pytest.mark.filterwarnings("error:invalid value encountered:RuntimeWarning")  # and make no NaN anywhere
@pytest.mark.parametrize("kv_dtype", [FP16, NVFP4], ids=lambda d: DTYPE_NAMES[d])
def test_triton_interpreter_score_overflow_is_not_nan(kv_dtype):
    args, expected = _overflow_inputs(kv_dtype)
    for num_splits in (1, 2):
        out = poison(torch.empty(1, 4, 128, dtype=FP16))
        gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, num_splits=num_splits)
        torch.testing.assert_close(out[0].double(), expected.expand(4, 128).to(FP16).double(), atol=2e-3, rtol=2e-3)


def _run_ptx(asm: str, word: int, inputs: dict | None = None, n_out: int = 4) -> list[int]:
    """A model of the few PTX instructions the e4m3 and NVFP4 decoders and the Hopper kernel's vote use,
    run on input registers (``word`` in ``$4``, or ``inputs``); returns the output registers
    ``$0..$(n_out - 1)`` as 32-bit words. ``vote.sync.any`` is modelled for one lane (a lane alone votes its own predicate)."""
    regs = dict(inputs) if inputs is not None else {"$4": word}
    preds = {}
    mask = 0xFFFFFFFF

    def val(x):
        return regs[x] if x in regs else int(x, 0)

    def f16(bits):
        return np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0]

    def f32(bits):
        return np.array([bits & mask], dtype=np.uint32).view(np.float32)[0]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):  # mov.b32 {lo, hi}, src
            lo, hi, src = re.match(r"\{(\w+), (\w+)\}, (\S+)", rest).groups()
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        if op == "mov.b32" and "{" in rest:  # mov.b32 dst, {lo, hi}
            dst, lo, hi = re.match(r"(\S+), \{(\w+), (\w+)\}", rest).groups()
            regs[dst] = (val(lo) & 0xFFFF) | ((val(hi) & 0xFFFF) << 16)
            continue
        dst, *ops = [x.strip() for x in rest.split(",")]
        if op in ("setp.gt.f32", "setp.gt.or.f32"):  # the .or form ors in the predicate of its last operand
            preds[dst] = bool(f32(val(ops[0])) > f32(val(ops[1]))) or (op.endswith(".or.f32") and preds[ops[2]])
            continue
        if op == "vote.sync.any.pred":
            assert ops[1] == "-1", line
            preds[dst] = preds[ops[0]]
            continue
        if op == "selp.s32":
            regs[dst] = (val(ops[0]) if preds[ops[2]] else val(ops[1])) & mask
            continue
        a = [val(x) for x in ops]
        if op == "mov.b32":
            regs[dst] = a[0]
        elif op == "shl.b32":
            regs[dst] = (a[0] << a[1]) & mask
        elif op == "shr.b32":
            regs[dst] = a[0] >> a[1]
        elif op == "and.b32":
            regs[dst] = a[0] & a[1]
        elif op == "add.u32":
            regs[dst] = (a[0] + a[1]) & mask
        elif op == "shf.r.wrap.b32":  # funnel shift right of {a[1]:a[0]}; the shift taken modulo 32
            regs[dst] = (((a[1] << 32) | a[0]) >> (a[2] & 31)) & mask
        elif op == "or.b32":
            regs[dst] = a[0] | a[1]
        elif op == "lop3.b32":  # bit i of the table is the result for (a, b, c) bits (i >> 2, i >> 1 & 1, i & 1)
            regs[dst] = sum(((a[3] >> (4 * ((a[0] >> k) & 1) + 2 * ((a[1] >> k) & 1) + ((a[2] >> k) & 1))) & 1) << k
                            for k in range(32))
        elif op == "prmt.b32":  # default mode: each result byte picks a byte of {a, b} (bit 3: its sign)
            pool = a[0] | (a[1] << 32)
            out = 0
            for k in range(4):
                sel = (a[2] >> (4 * k)) & 0xF
                byte = (pool >> (8 * (sel & 7))) & 0xFF
                if sel & 8:
                    byte = 0xFF if byte & 0x80 else 0
                out |= byte << (8 * k)
            regs[dst] = out
        elif op == "mul.rn.f16x2":  # exact products here: float32 then float16 rounds once
            halves = [int(np.array([np.float16(np.float32(f16(a[0] >> s)) * np.float32(f16(a[1] >> s)))]).view(np.uint16)[0])
                      for s in (0, 16)]
            regs[dst] = halves[0] | (halves[1] << 16)
        elif op == "cvt.rn.f16x2.e4m3x2":  # low byte -> low half
            halves = [int(torch.tensor([e4m3_value((a[0] >> s) & 0xFF)], dtype=FP16).view(torch.int16)) & 0xFFFF
                      for s in (0, 8)]
            regs[dst] = halves[0] | (halves[1] << 16)
        else:
            raise AssertionError(f"unmodelled PTX instruction {op}")
    return [regs[f"${i}"] for i in range(n_out)]


def test_nvfp4_gpu_decoder_ptx():
    """The inline PTX of the portable kernel's NVFP4 decoder on a GPU, run through a model of its
    instructions for every byte value in every lane: lane k's low / high nibble comes out as element k
    of the low / high output, equal to E2M1 * 2**-14 (the GPU tests run the real thing), with no
    float8 conversion in it (GPUs before sm_89 run it too)."""
    asm = gqa_ops.E2M1_PLACE_PTX.value
    assert "cvt" not in asm
    for byte in range(256):
        for lane in range(4):
            word = (byte << (8 * lane)) | (0x5A << (8 * ((lane + 1) % 4)))  # another byte next to it
            outs = _run_ptx(asm, word)
            half = (outs[lane // 2] >> (16 * (lane % 2))) & 0xFFFF
            half_hi = (outs[2 + lane // 2] >> (16 * (lane % 2))) & 0xFFFF
            got = [float(np.array([h], dtype=np.uint16).view(np.float16)[0]) for h in (half, half_hi)]
            assert got == [E2M1_TABLE[byte & 15].item() * 2.0**-14, E2M1_TABLE[byte >> 4].item() * 2.0**-14], (byte, lane)


def test_e4m3_place_ptx():
    """The inline PTX of the e4m3 decoder of NVIDIA GPUs before sm_89 (``_rounding.e4m3_place_f16``:
    the sparse-GQA float8 cache, ``e4m3_to_f32`` in every other kernel), run through a model of its
    instructions for every byte value in every lane (the other lanes holding other bytes): lane k
    comes out as element k, the float16 of the e4m3 value times 2**-8, bit for bit (so signed zeros
    and subnormals too), and NaN for the NaN bytes; with no float8 conversion in it."""
    from torch_sparse_mla.ops import _rounding

    asm = _rounding.E4M3_PLACE_PTX.value
    assert "cvt" not in asm
    for byte in range(256):
        for lane in range(4):
            others = [0x7F, 0x80, 0x01, 0xFE]  # NaN, -0, the smallest subnormal, -448 around it
            word = sum(((byte if k == lane else others[(lane + k) % 4]) << (8 * k)) for k in range(4))
            outs = _run_ptx(asm, 0, {"$2": word}, n_out=2)
            half = (outs[lane // 2] >> (16 * (lane % 2))) & 0xFFFF
            got = np.array([half], dtype=np.uint16).view(np.float16)[0]
            value = e4m3_value(byte)
            if math.isnan(value):
                assert np.isnan(got), (byte, lane)
            else:
                want = np.array([value * 2.0**-8], dtype=np.float16)
                assert half == int(want.view(np.uint16)[0]), (byte, lane, got, want)


def test_nvfp4_hopper_decoder_ptx():
    """The Hopper NVFP4 kernel's inline PTX (sixteen data bytes of two scale groups and the groups' two
    scale bytes in, thirty-two float16 out), run through the instruction model for every data byte in
    every position, the scales cycling through normal, subnormal and zero ones (a different one for
    each group): output element k of the low / high half (k < 8 the first group's byte k, else the
    second's byte k - 8) is that byte's low / high nibble as E2M1 * its group's scale * 2**-7 (the GPU
    tests run the real thing)."""
    from torch_sparse_mla.ops import sparse_gqa_hopper

    require_gluon(sparse_gqa_hopper)
    asm = sparse_gqa_hopper._FP4X32_TO_F16.value
    scales = (0x00, 0x01, 0x07, 0x08, 0x38, 0x3F, 0x7E)
    for byte in range(256):
        for pos in range(16):
            first, second = scales[(byte + pos) % len(scales)], scales[(byte + 3 * pos + 1) % len(scales)]
            s = e4m3_value(second if pos >= 8 else first)
            words = [0x1D6C5A93, 0xC3A5F00F, 0x7B3E0C91, 0x0F5AA5E2]  # other bytes around it
            w, sh = divmod(pos, 4)
            words[w] = (words[w] & ~(0xFF << (8 * sh))) | (byte << (8 * sh))
            pair = first | (second << 8) | (0xA5 << 16)  # bits 16-31 are not read
            regs = {**{f"${16 + i}": words[i] for i in range(4)}, **{f"${20 + i}": pair for i in range(16)}}
            outs = _run_ptx(asm, 0, regs, n_out=16)
            halves = [(outs[h * 8 + pos // 2] >> (16 * (pos % 2))) & 0xFFFF for h in (0, 1)]
            got = [float(np.array([x], dtype=np.uint16).view(np.float16)[0]) for x in halves]
            want = [E2M1_TABLE[byte & 15].item() * s * 2.0**-7, E2M1_TABLE[byte >> 4].item() * s * 2.0**-7]
            assert got == want, (first, second, byte, pos)


def test_hopper_vote_ptx():
    """The inline PTX of the Hopper kernel's vote on the reference maximum (eight scores and their
    thresholds in, eight copies of the vote out), modelled for one lane (``vote.sync.any`` of a lane
    alone is its own predicate): 1 when any score exceeds its own threshold, else 0, for scores and
    thresholds that are equal, infinite or NaN, with every score paired with its threshold's register."""
    from torch_sparse_mla.ops import sparse_gqa_hopper

    require_gluon(sparse_gqa_hopper)
    asm = sparse_gqa_hopper._WARP_ANY_GT8.value
    bits = {v: int(np.array([v], dtype=np.float32).view(np.uint32)[0]) for v in
            (0.0, 1.0, -1.0, 8.0, float("inf"), float("-inf"), float("nan"), -3.4028234663852886e38)}

    def run(scores, thresholds):
        regs = {**{f"${8 + i}": bits[x] for i, x in enumerate(scores)},
                **{f"${16 + i}": bits[x] for i, x in enumerate(thresholds)}}
        return _run_ptx(asm, 0, regs, n_out=8)

    rng = random.Random(7)
    values = list(bits)
    for trial in range(400):
        scores = [rng.choice(values) for _ in range(8)]
        thresholds = [rng.choice(values) for _ in range(8)]
        if trial % 3 == 0:  # one score just at or just above its own threshold, the rest below
            k = rng.randrange(8)
            scores = [float("-inf")] * 8
            thresholds = [8.0] * 8
            scores[k] = rng.choice([8.0, float("inf")])
            thresholds[(k + 1) % 8] = float("-inf")  # another lane's threshold lower: must not count
        want = int(any(x > t for x, t in zip(scores, thresholds)))
        assert run(scores, thresholds) == [want] * 8, (scores, thresholds)


def test_launch_config_splits_small_batches():
    """The heuristic splits page lists only when rows x KV heads cannot fill the device."""
    q = torch.empty(1, 64, 128, dtype=BF16)
    cache = torch.empty(8, 4, 128, 256, dtype=FP8)
    small = gqa_ops.launch_config(q, cache, 16, num_sms=132)
    assert small.num_splits == 16 and gqa_ops.pages_per_split(16, small) == 1 and small.block_h == 16
    large = gqa_ops.launch_config(torch.empty(256, 64, 128, dtype=BF16), cache, 16, num_sms=132)
    assert large.num_splits == 1
    long_list = gqa_ops.launch_config(torch.empty(256, 64, 128, dtype=BF16), cache, 200, num_sms=132)
    assert gqa_ops.pages_per_split(200, long_list) <= 64  # bounds the page-list vector of a program
    assert gqa_ops.launch_config(q, cache, 16, num_splits=100).num_splits == 16  # never an empty split
    nvfp4 = torch.empty(8, 8, 128, 72, dtype=torch.uint8)
    assert gqa_ops.launch_config(q, nvfp4, 16, num_sms=132).num_splits == small.num_splits
    # About three programs per SM for value caches, two for NVFP4 (measured on an H200, docs/sparse_gqa.md).
    q8, q32 = torch.empty(8, 64, 128, dtype=BF16), torch.empty(32, 64, 128, dtype=BF16)
    assert gqa_ops.launch_config(q8, cache, 16, num_sms=132).num_splits == 8  # 32 programs: cdiv(396, 32) = 13 -> 8
    assert gqa_ops.launch_config(q32, cache, 16, num_sms=132).num_splits == 4  # 128 programs: cdiv(396, 128) = 4
    assert gqa_ops.launch_config(q32, nvfp4, 16, num_sms=132).num_splits == 3  # cdiv(264, 128) = 3
    # A [16, 256] head block (transposed at every batch size) keeps about one program per SM.
    wide = gqa_ops.launch_config(torch.empty(8, 64, 256, dtype=BF16), torch.empty(8, 4, 128, 512, dtype=FP8), 16,
                                 num_sms=132)
    assert wide.block_h * 256 > 2048 and wide.num_splits == 4  # 32 programs: cdiv(132, 32) = 5 -> 4


def test_launch_config_tile_form():
    """A value cache uses per-warp key groups where its programs fill the device and the transposed
    products (fewer registers, more programs per SM) where the page lists are split to fill it; the
    split count given by a caller does not change the form, and a plan override does."""
    cache = torch.empty(8, 4, 128, 256, dtype=FP8)
    nvfp4 = torch.empty(8, 8, 128, 72, dtype=torch.uint8)
    few, many = torch.empty(8, 64, 128, dtype=BF16), torch.empty(64, 64, 128, dtype=BF16)  # 32 / 256 programs
    for num_splits in (None, 1, 3):
        plan = gqa_ops.launch_config(few, cache, 16, num_splits, num_sms=132)
        assert plan.transposed and gqa_ops.key_groups(plan, 128, False) == 1
        plan = gqa_ops.launch_config(many, cache, 16, num_splits, num_sms=132)
        assert not plan.transposed and gqa_ops.key_groups(plan, 128, False) == 4
    assert gqa_ops.key_groups(plan.with_overrides(dict(transposed=True)), 128, False) == 1
    assert not gqa_ops.launch_config(few, nvfp4, 16, num_sms=132).transposed  # NVFP4 is transposed anyway
    assert gqa_ops.key_groups(gqa_ops.launch_config(many, nvfp4, 16, num_sms=132), 128, True) == 1
    wide = torch.empty(8, 64, 256, dtype=BF16)  # a [16, 256] head block: transposed for every batch size
    wide_cache = torch.empty(8, 4, 128, 512, dtype=FP8)
    wide_plan = gqa_ops.launch_config(wide, wide_cache, 16, num_sms=132)  # few programs: the form does not switch
    assert not wide_plan.transposed and gqa_ops.key_groups(wide_plan, 256, False) == 1
    assert gqa_ops.key_groups(gqa_ops.launch_config(wide, wide_cache, 16, num_sms=4), 256, False) == 1


INTERPRETER_INSERT_CASES = [
    (BF16, FP32, False), (FP16, BF16, True), (FP8, BF16, False), (FP8, FP32, True), (NVFP4, FP32, False),
    (NVFP4, BF16, True), (NVFP4, FP16, False),
]


@requires_interpreter
@pytest.mark.filterwarnings("error::RuntimeWarning")  # no 0 / 0 or x / 0 made, even in groups stored as 0
@pytest.mark.parametrize("case", INTERPRETER_INSERT_CASES,
                         ids=lambda c: f"{DTYPE_NAMES[c[0]]}-in_{DTYPE_NAMES[c[1]]}" + ("-scale_tensors" if c[2] else ""))
def test_interpreter_insert_bit_exact(case):
    """The Triton kernel writes exactly the CPU kernel's bytes (and the reference's), NaN included."""
    kv_dtype, in_dtype, scale_tensors = case
    cache, k, v, slots, scales = _insert_inputs(kv_dtype, in_dtype, scale_tensors, seed=2)
    k[1, 0, 7] = float("nan")
    wide = torch.zeros(k.shape[0], k.shape[1], 2 * k.shape[2], dtype=k.dtype)
    wide[..., ::2] = k
    k = wide[..., ::2]  # strided inputs: k every other element, v a transposed copy
    v = v.transpose(0, 1).contiguous().transpose(0, 1)
    want = make_cache(kv_dtype)
    gqa_ops.gqa_kv_cache_insert_triton(k, v, slots, cache, **scales, block_r=4)
    gqa_ops.gqa_kv_cache_insert_torch(k, v, slots, want, **scales)
    assert_same_bytes(cache, want)
    independent = make_cache(kv_dtype)
    naive_insert(independent, k, v, slots, **scales)
    assert_same_bytes(cache, independent)


# =====================================================================================================
# opcheck
# =====================================================================================================


def _schema_args(args):
    return tuple(args.values())


@pytest.mark.parametrize("cfg", [Cfg(hq=4, hkv=2, dql=2, batch=2, q_dtype=BF16, kv_dtype=BF16),
                                 Cfg(hq=4, hkv=2, dh=128, dql=2, batch=2, q_dtype=FP16, kv_dtype=NVFP4,
                                     scale_tensors=True)], ids=lambda c: c.id)
def test_opcheck(cfg):
    args, _ = make_inputs(cfg, seed=6)
    torch.library.opcheck(torch.ops.sparse_mla.sparse_gqa_decode.default, _schema_args(args))
    torch.library.opcheck(torch.ops.sparse_mla.sparse_gqa_decode.out, _schema_args(args),
                          {"out": _out_buffer(args).zero_()})


def test_opcheck_fp8():
    # opcheck's test_schema cannot run float8 CPU tensors (torch's schema-check mode multiplies them);
    # the fake and AOT-dispatch checks can.
    args, _ = make_inputs(Cfg(hq=4, hkv=2, dql=2, batch=2, q_dtype=FP8, kv_dtype=FP8), seed=7)
    for overload, kwargs in ((torch.ops.sparse_mla.sparse_gqa_decode.default, {}),
                             (torch.ops.sparse_mla.sparse_gqa_decode.out, {"out": _out_buffer(args).zero_()})):
        torch.library.opcheck(overload, _schema_args(args), kwargs,
                              test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("kv_dtype", INSERT_FORMATS, ids=lambda d: DTYPE_NAMES[d])
def test_opcheck_insert(kv_dtype):
    cache, k, v, slots, scales = _insert_inputs(kv_dtype, BF16, scale_tensors=True)
    cache = cache.clone() if kv_dtype == NVFP4 else torch.zeros_like(cache)  # no NaN: opcheck compares caches
    args = (k, v, slots, cache, scales["k_scale"], scales["v_scale"], scales["k_scale_tensor"],
            scales["v_scale_tensor"])
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.sparse_mla.gqa_kv_cache_insert.default, args,
                          test_utils=utils if kv_dtype == FP8 else utils + ("test_schema",))


# =====================================================================================================
# torch.compile: one graph, no recompiles across batch sizes
# =====================================================================================================


def assert_no_recompiles(fn, arg_sets, check):
    """Compile ``fn`` with ``fullgraph=True, dynamic=True``, run it on every argument set (different
    batch sizes), compare each result with ``check(args, result)``, and assert that no call after the
    first compiles again. (Under ``dynamic=True`` torch traces Python float defaults, such as
    ``q_scale=1.0``, as symbols and restarts the first trace once to specialise them: the first call may
    count two compilations of the same frame.)"""
    torch._dynamo.reset()
    counter = compile_counter()
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    first = None
    for args in arg_sets:
        check(args, compiled(*args))
        first = counter.frame_count if first is None else first
    assert first <= 2 and counter.frame_count == first, f"recompiled: {first} then {counter.frame_count} compilations"


def test_compile_no_recompiles():
    # Sizes chosen so that no two dimensions are equal on the first call (duck sizing would tie them).
    cfg = Cfg(hq=6, hkv=3, dh=64, page_size=16, dql=2, n_sel=5, extra_rows=0)

    def step(q, kv_cache, topk_pages, block_table, seq_lens):
        kv_lens, qo = decode_runtime_metadata(seq_lens, decode_query_len=2)
        return sparse_gqa_decode(q, kv_cache, topk_pages, block_table, kv_lens, qo, decode_query_len=2,
                                 softmax_scale=0.125)

    arg_sets, expected = [], []
    for batch in (2, 5, 9):
        args, seq_lens = make_inputs(dataclasses.replace(cfg, batch=batch), seed=batch)
        arg_sets.append((args["q"], args["kv_cache"], args["topk_pages"], args["block_table"], seq_lens))
        expected.append(dict(args, softmax_scale=0.125))

    by_query = {id(a[0]): e for a, e in zip(arg_sets, expected)}

    def check(call_args, result):
        assert_matches_reference(result, by_query[id(call_args[0])])

    assert_no_recompiles(step, arg_sets, check)


def test_compile_insert_and_decode_no_recompiles():
    """One decode step of an NVFP4 cache: write this step's K/V, then attend; device scales."""

    def step(k, v, slots, q, cache, topk_pages, block_table, seq_lens, k_scale_tensor, v_scale_tensor):
        gqa_kv_cache_insert(k, v, slots, cache, k_scale=0.5, k_scale_tensor=k_scale_tensor,
                            v_scale_tensor=v_scale_tensor)
        kv_lens, qo = decode_runtime_metadata(seq_lens, decode_query_len=1)
        return sparse_gqa_decode(q, cache, topk_pages, block_table, kv_lens, qo, softmax_scale=0.1, k_scale=0.5,
                                 k_scale_tensor=k_scale_tensor, v_scale_tensor=v_scale_tensor)

    arg_sets, mirrors = [], {}
    for batch in (3, 5, 9):  # no size equal to another on the first call (duck sizing would tie them)
        gen = torch.Generator().manual_seed(batch)
        cache = torch.zeros(batch * 2 + 1, 4, 16, 72, dtype=torch.uint8)
        seq_lens = torch.randint(1, 33, (batch,), generator=gen, dtype=torch.int32)
        block_table = torch.arange(batch * 2, dtype=torch.int32).view(batch, 2)
        slots = torch.arange(batch * 32)
        k, v = torch.randn(batch * 32, 2, 128, generator=gen), torch.randn(batch * 32, 2, 128, generator=gen)
        q = torch.randn(batch, 8, 128, generator=gen).to(BF16)
        topk = torch.tensor([0, 1], dtype=torch.int32).expand(batch, 2, 2).contiguous()
        args = (k, v, slots, q, cache, topk, block_table, seq_lens, torch.tensor([0.75]), torch.tensor([2.0]))
        mirrors[id(q)] = args
        arg_sets.append(args)

    def check(call_args, result):
        k, v, slots, q, cache, topk, block_table, seq_lens, kst, vst = mirrors[id(call_args[3])]
        want = torch.zeros_like(cache)
        gqa_ops.gqa_kv_cache_insert_torch(k, v, slots, want, 0.5, 1.0, kst, vst)
        assert_same_bytes(cache, want)
        kv_lens, qo = decode_runtime_metadata(seq_lens, decode_query_len=1)
        assert_matches_reference(result, dict(q=q, kv_cache=cache, topk_pages=topk, block_table=block_table,
                                              kv_segment_lens=kv_lens, qo_offset=qo, decode_query_len=1,
                                              softmax_scale=0.1, k_scale=0.5, k_scale_tensor=kst,
                                              v_scale_tensor=vst))

    assert_no_recompiles(step, arg_sets, check)


# =====================================================================================================
# Error messages
# =====================================================================================================


def _nvfp4_args(args, cache):
    args.update(kv_cache=cache, q=torch.randn(args["q"].shape[0], args["q"].shape[1], 128).to(FP16))


_BAD_INPUTS = {
    "q_dtype": (lambda a: a.update(q=a["q"].float()), "q: expected dtype"),
    "q_rank": (lambda a: a.update(q=a["q"][0]), "q: expected a 3-D tensor"),
    "kv_cache_dtype": (lambda a: a.update(kv_cache=a["kv_cache"].float()), "kv_cache: expected dtype"),
    "kv_cache_head_dim": (lambda a: a.update(kv_cache=a["kv_cache"][..., :-2]), r"kv_cache: expected shape\[3\]"),
    "kv_cache_stride": (lambda a: a.update(kv_cache=a["kv_cache"].transpose(2, 3).contiguous().transpose(2, 3)),
                        r"kv_cache: expected stride\(-1\) == 1"),
    "heads_not_multiple": (lambda a: a.update(q=a["q"][:, :3]), "q: expected the number of query heads"),
    "topk_pages_dtype": (lambda a: a.update(topk_pages=a["topk_pages"].long()), "topk_pages: expected dtype int32"),
    "topk_pages_rows": (lambda a: a.update(topk_pages=a["topk_pages"][1:]), r"topk_pages: expected shape\[0\]"),
    "topk_pages_heads": (lambda a: a.update(topk_pages=a["topk_pages"][:, :1]), r"topk_pages: expected shape\[1\]"),
    "block_table_rank": (lambda a: a.update(block_table=a["block_table"][0]), "block_table: expected a 2-D tensor"),
    "kv_segment_lens_len": (lambda a: a.update(kv_segment_lens=a["kv_segment_lens"][1:]),
                            r"kv_segment_lens: expected shape\[0\]"),
    "qo_offset_dtype": (lambda a: a.update(qo_offset=a["qo_offset"].long()), "qo_offset: expected dtype int32"),
    "decode_query_len": (lambda a: a.update(decode_query_len=0), "decode_query_len: expected an int >= 1"),
    "decode_query_len_past_int32": (lambda a: a.update(decode_query_len=2**31),
                                    r"decode_query_len: expected an int <= 2147483647"),
    "softmax_scale_nan": (lambda a: a.update(softmax_scale=float("nan")), "softmax_scale: expected a finite float"),
    "q_scale_inf": (lambda a: a.update(q_scale=float("inf")), "q_scale: expected a finite float"),
    "k_scale_neg_inf": (lambda a: a.update(k_scale=-float("inf")), "k_scale: expected a finite float"),
    "v_scale_past_float32": (lambda a: a.update(v_scale=1e39), r"v_scale: expected a finite float \(inside"),
    "k_scale_tensor_dtype": (lambda a: a.update(k_scale_tensor=torch.ones(1, dtype=torch.float64)),
                             "k_scale_tensor: expected dtype float32"),
    "v_scale_tensor_numel": (lambda a: a.update(v_scale_tensor=torch.ones(2)),
                             "v_scale_tensor: expected a tensor of one element, got shape \\(2,\\)"),
    "k_scale_tensor_device": (lambda a: a.update(k_scale_tensor=torch.ones(1, device="meta")),
                              "k_scale_tensor: expected a tensor on cpu"),
    "nvfp4_last_dim": (lambda a: _nvfp4_args(a, torch.zeros(6, 4, 16, 70, dtype=torch.uint8)),
                       r"kv_cache: expected shape\[3\] == 72"),
    "nvfp4_odd_slots": (lambda a: _nvfp4_args(a, torch.zeros(6, 3, 16, 72, dtype=torch.uint8)),
                        r"kv_cache: expected an even shape\[1\] >= 2"),
    "nvfp4_page_size": (lambda a: _nvfp4_args(a, torch.zeros(6, 4, 6, 72, dtype=torch.uint8)),
                        r"kv_cache: expected shape\[2\] \(page_size\) to be a multiple of 4"),
    "nvfp4_permuted": (lambda a: _nvfp4_args(a, torch.zeros(6, 16, 4, 72, dtype=torch.uint8).transpose(1, 2)),
                       r"kv_cache: expected strides \(\*, 1152, 72, 1\)"),
    "nvfp4_row_stride": (lambda a: _nvfp4_args(a, torch.zeros(6, 4, 16, 80, dtype=torch.uint8)[..., :72]),
                         r"kv_cache: expected strides \(\*, 1152, 72, 1\)"),
    "nvfp4_view_smaller_than_layout": (  # slots closer together than their page_size * 72 bytes
        lambda a: _nvfp4_args(a, torch.as_strided(torch.zeros(30000, dtype=torch.uint8), (6, 4, 16, 72),
                                                  (4608, 1000, 72, 1))),
        r"kv_cache: expected strides \(\*, 1152, 72, 1\)"),
    "nvfp4_pages_overlap": (
        lambda a: _nvfp4_args(a, torch.as_strided(torch.zeros(20000, dtype=torch.uint8), (6, 4, 16, 72),
                                                  (3000, 1152, 72, 1))),
        r"kv_cache: expected stride\(0\) >= shape\[1\] \* page_size \* 72 \(4608\)"),
    "nvfp4_head_dim": (lambda a: a.update(kv_cache=torch.zeros(6, 4, 16, 72, dtype=torch.uint8)),
                       r"q: expected shape\[2\] == 128 \(head_dim of an NVFP4 kv_cache\)"),
}


@pytest.mark.parametrize("case", list(_BAD_INPUTS), ids=str)
def test_bad_inputs_raise(case):
    args, _ = make_inputs(Cfg(hq=4, hkv=2, dql=2, batch=2), seed=8)
    mutate, message = _BAD_INPUTS[case]
    mutate(args)
    with pytest.raises(ValueError, match=message):
        _public(args)


@pytest.mark.parametrize("case", ["dtype", "shape"], ids=str)
def test_bad_out_raises(case):
    args, _ = make_inputs(Cfg(hq=4, hkv=2, dql=2, batch=2), seed=9)
    out = _out_buffer(args)
    out = out.float() if case == "dtype" else out[:, :2]
    with pytest.raises(ValueError, match="out: expected"):
        _public(args, out=out)


def test_public_softmax_scale_is_required():
    args, _ = make_inputs(Cfg(hq=4, hkv=2, dql=2, batch=2), seed=9)
    del args["softmax_scale"]
    with pytest.raises(TypeError, match="softmax_scale"):
        _public(args)


_BAD_INSERTS = {
    "k_dtype": (lambda a: a.update(k=a["k"].int()), "k: expected dtype bfloat16 or float16 or float32, got int32"),
    "v_dtype_differs": (lambda a: a.update(v=a["v"].half()), "v: expected dtype float32 \\(the dtype of k\\), got float16"),
    "k_rank": (lambda a: a.update(k=a["k"][0]), "k: expected a 3-D tensor"),
    "k_heads": (lambda a: a.update(k=a["k"][:, :1], v=a["v"][:, :1]), r"k: expected shape\[1\] == the cache's number of KV heads"),
    "k_head_dim": (lambda a: a.update(k=a["k"][..., :64], v=a["v"][..., :64]), r"k: expected shape\[2\] == the cache's head_dim \(128\)"),
    "v_shape": (lambda a: a.update(v=a["v"][1:]), r"v: expected shape\[0\] == k.shape\[0\]"),
    "slot_dtype": (lambda a: a.update(slot_mapping=a["slot_mapping"].int()), "slot_mapping: expected dtype int64"),
    "slot_len": (lambda a: a.update(slot_mapping=a["slot_mapping"][1:]), r"slot_mapping: expected shape\[0\] == k.shape\[0\]"),
    "k_scale_zero": (lambda a: a.update(k_scale=0.0), "k_scale: expected a nonzero float"),
    "v_scale_nan": (lambda a: a.update(v_scale=float("nan")), "v_scale: expected a finite float"),
    "scale_tensor_dtype": (lambda a: a.update(v_scale_tensor=torch.ones(1, dtype=BF16)), "v_scale_tensor: expected dtype float32"),
    "cache_overlaps_itself": (lambda a: a.update(kv_cache=torch.zeros(1, 2, 8, 256, dtype=FP16).expand(3, 2, 8, 256)),
                              "kv_cache: expected a tensor whose elements do not overlap in memory"),
    "cache_nvfp4_strides": (lambda a: a.update(kv_cache=torch.zeros(3, 8, 4, 72, dtype=torch.uint8).transpose(1, 2)),
                            r"kv_cache: expected strides \(\*, 576, 72, 1\)"),
    "cache_dtype": (lambda a: a.update(kv_cache=torch.zeros(3, 2, 8, 256)), "kv_cache: expected dtype"),
}


@pytest.mark.parametrize("case", list(_BAD_INSERTS), ids=str)
def test_bad_insert_raises(case):
    cache, k, v, slots, scales = _insert_inputs(FP16)
    args = dict(k=k, v=v, slot_mapping=slots, kv_cache=cache, **scales)
    mutate, message = _BAD_INSERTS[case]
    mutate(args)
    with pytest.raises(ValueError, match=message):
        gqa_kv_cache_insert(args.pop("k"), args.pop("v"), args.pop("slot_mapping"), args.pop("kv_cache"), **args)


# =====================================================================================================
# CUDA (run on the H200): parity, CUDA graphs, reduce-overhead compile
# =====================================================================================================

CUDA_CASES = [
    Cfg(hq=64, hkv=4, dh=128, page_size=128, dql=1, q_dtype=BF16, kv_dtype=FP8, batch=4, n_sel=6, layout="NHD"),
    Cfg(hq=64, hkv=4, dh=128, page_size=64, dql=4, q_dtype=BF16, kv_dtype=BF16, batch=3, n_sel=5),
    Cfg(hq=8, hkv=1, dh=256, page_size=16, dql=4, q_dtype=FP16, kv_dtype=FP16, batch=3, layout="NHD", page_pad=3),
    Cfg(hq=6, hkv=2, dh=64, page_size=32, dql=1, q_dtype=FP8, kv_dtype=FP8, batch=4),
    Cfg(hq=16, hkv=2, dh=128, page_size=256, dql=2, q_dtype=FP16, kv_dtype=BF16, batch=3, n_sel=3),
    Cfg(hq=128, hkv=1, dh=128, page_size=48, dql=1, q_dtype=BF16, kv_dtype=BF16, batch=3),  # 2 head blocks
    Cfg(hq=64, hkv=4, dh=128, page_size=128, dql=1, q_dtype=BF16, kv_dtype=NVFP4, batch=3, n_sel=4, page_pad=16),
    Cfg(hq=16, hkv=2, dh=128, page_size=64, dql=4, q_dtype=FP8, kv_dtype=NVFP4, batch=2, scale_tensors=True),
    Cfg(hq=8, hkv=1, dh=128, page_size=16, dql=1, q_dtype=FP16, kv_dtype=NVFP4, batch=4, page_pad=5),  # odd padding
    Cfg(hq=64, hkv=4, dh=128, page_size=128, dql=2, q_dtype=BF16, kv_dtype=FP8, batch=3, scale_tensors=True),
]


@requires_cuda
@pytest.mark.parametrize("num_splits", [None, 1, 4], ids=lambda s: f"splits={s or 'auto'}")
@pytest.mark.parametrize("cfg", CUDA_CASES, ids=lambda c: c.id)
def test_cuda_matches_reference(cfg, num_splits):
    args, _ = make_inputs(cfg, seed=10, device="cuda")
    out = _out_buffer(args, transpose=num_splits == 4)
    gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, num_splits=num_splits)
    assert_matches_reference(out, args)
    assert_matches_reference(_public(args), args)


@requires_cuda
@pytest.mark.parametrize("transposed", [False, True], ids=["key_groups", "transposed"])
@pytest.mark.parametrize("cfg", [c for c in CUDA_CASES if c.kv_dtype != NVFP4], ids=lambda c: c.id)
def test_cuda_tile_forms(cfg, transposed):
    """Both tile forms of every value-cache case, unsplit and split (the plan picks one by batch size)."""
    assert_tile_form_matches(make_inputs(cfg, seed=11, device="cuda")[0], transposed, split_counts=(1, 4))


@requires_cuda
@pytest.mark.parametrize("transposed", [False, True], ids=["key_groups", "transposed"])
@pytest.mark.parametrize("cfg", [c for c in CUDA_CASES if c.kv_dtype == FP8] + [
    Cfg(hq=5, hkv=1, dh=72, page_size=16, dql=2, q_dtype=FP16, kv_dtype=FP8, batch=3, n_sel=5)], ids=lambda c: c.id)
def test_cuda_float8_as_bytes_matches_typed(cfg, transposed, monkeypatch):
    """The portable kernel as a GPU before sm_89 runs it, forced on this GPU: the float8 query and cache
    taken as their bytes, the cache decoded by bit placement (``e4m3_place_f16``) and the query by
    integer operations, against the typed route of this GPU (hardware conversions), both tile forms,
    unsplit and split: bitwise the same output, also where NaN cache bytes lie in keys that are read
    (a NaN V value makes its rows NaN on both). Odd Dh (72: masked columns, rows not 4-byte aligned)
    included."""
    args, _ = make_inputs(cfg, seed=21, device="cuda")
    kv = args["kv_cache"]
    read = ~kv.float().isnan()  # make_inputs sets every value nobody reads to NaN
    gen = torch.Generator().manual_seed(5)
    for half in (0, 1):  # two K values and two V values of keys that are read become the byte 0x7F
        where = read[..., half * cfg.dh:(half + 1) * cfg.dh].nonzero()
        where = where[torch.randperm(len(where), generator=gen)[:2].to(where.device)]
        where[:, 3] += half * cfg.dh
        kv[tuple(where.T)] = float("nan")
    outs = {}
    for typed in (True, False):
        monkeypatch.setattr(gqa_ops, "float8_conversions", lambda device, typed=typed: typed)
        monkeypatch.setattr(gqa_ops, "_PLANS", gqa_ops.PlanCache())
        for num_splits in (1, 3):
            out = _out_buffer(args)
            gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, num_splits=num_splits,
                                             config=dict(transposed=transposed), path="portable")
            outs[typed, num_splits] = out
        for _, main, _ in gqa_ops._PLANS.values():
            assert main.dtypes == (None if typed else (torch.uint8 if cfg.q_dtype == FP8 else None, torch.uint8)
                                   + (None,) * 8)
    for num_splits in (1, 3):
        typed_out, bytes_out = outs[True, num_splits], outs[False, num_splits]
        nan_rows = typed_out.isnan().any(-1)
        assert nan_rows.any() and not nan_rows.all()
        torch.testing.assert_close(bytes_out, typed_out, rtol=0, atol=0, equal_nan=True)


@requires_cuda
@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("kv_dtype", [FP8, NVFP4], ids=lambda d: DTYPE_NAMES[d])
def test_cuda_tile_sizes(kv_dtype, block_n):
    cfg = Cfg(hq=64, hkv=4, dh=128, page_size=128, dql=2, q_dtype=BF16, kv_dtype=kv_dtype, batch=3, n_sel=4)
    args, _ = make_inputs(cfg, seed=15, device="cuda")
    for num_warps in (4, 8):
        out = _out_buffer(args)
        gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, config=dict(block_n=block_n, num_warps=num_warps),
                                         path="portable")
        assert_matches_reference(out, args)


@requires_cuda
@pytest.mark.parametrize("kv_dtype", [FP16, FP8, NVFP4], ids=lambda d: DTYPE_NAMES[d])
def test_cuda_score_overflow_is_not_nan(kv_dtype):
    args, expected = _overflow_inputs(kv_dtype)
    args = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    for num_splits in (1, 2):
        out = poison(torch.empty(1, 4, 128, dtype=FP16, device="cuda"))
        gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, num_splits=num_splits)
        torch.testing.assert_close(out[0].cpu().double(), expected.expand(4, 128).to(FP16).double(), atol=2e-3,
                                   rtol=2e-3)


@requires_cuda
@pytest.mark.parametrize("kv_dtype", [FP8, NVFP4], ids=lambda d: DTYPE_NAMES[d])
@pytest.mark.parametrize("dql", [1, 4], ids=lambda q: f"qlen{q}")
def test_cuda_large_batch_matches_torch_kernel(dql, kv_dtype):
    """The benchmark's shapes against the PyTorch kernel, which the CPU tests tie to the reference."""
    cfg = Cfg(hq=64, hkv=4, dh=128, page_size=128, dql=dql, q_dtype=BF16, kv_dtype=kv_dtype, batch=64 // dql,
              n_sel=16, extra_rows=3, offset=16)
    args, _ = make_inputs(cfg, seed=11, device="cuda")
    expected = _out_buffer(args)
    gqa_ops.sparse_gqa_decode_torch(*args.values(), out=expected)
    scale = float(expected.float().abs().max())
    portable = _out_buffer(args)
    gqa_ops.sparse_gqa_decode_triton(*args.values(), out=portable, path="portable")
    for out in (_public(args), portable):  # the default (the Hopper kernel for float8 on sm_90) and the portable one
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.float() / scale, expected.float() / scale, atol=2e-2, rtol=2e-2)


@requires_cuda
@pytest.mark.parametrize("kv_dtype", [FP8, NVFP4], ids=lambda d: DTYPE_NAMES[d])
def test_cuda_graph_capture_and_replay(kv_dtype):
    """Capture once; replay with new inputs and new device scales (no re-capture)."""
    cfg = Cfg(hq=16, hkv=2, dh=128, page_size=64, dql=2, q_dtype=BF16, kv_dtype=kv_dtype, batch=4, extra_rows=0,
              scale_tensors=True)
    args, seq_lens = make_inputs(cfg, seed=12, device="cuda")
    static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    static["kv_cache"] = _to_device(args["kv_cache"], "cuda").clone()  # contiguous copy of the same values
    static_seq_lens = seq_lens.clone()
    out = _out_buffer(args)

    def step():
        decode_runtime_metadata(static_seq_lens, decode_query_len=cfg.dql,
                                out=(static["kv_segment_lens"], static["qo_offset"]))
        _public(static, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for seed, (ks, vs) in zip((13, 14, 15), ((0.75, 1.5), (2.0, 0.25), (1e-3, 8.0))):
        new, new_seq_lens = make_inputs(cfg, seed=seed, device="cuda")
        static_seq_lens.copy_(new_seq_lens)
        for k in ("q", "kv_cache", "topk_pages", "block_table"):
            static[k].copy_(new[k])
        static["k_scale_tensor"].fill_(ks)
        static["v_scale_tensor"].fill_(vs)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(out, dict(static, kv_segment_lens=new["kv_segment_lens"],
                                           qo_offset=new["qo_offset"]))


@requires_cuda
@pytest.mark.parametrize("kv_dtype", [FP8, NVFP4], ids=lambda d: DTYPE_NAMES[d])
def test_cuda_compile_reduce_overhead(kv_dtype):
    """A decode step (cache write + attention) compiled with reduce-overhead: one CUDA graph, no skips;
    the device scales change between replays."""
    from torch._dynamo.utils import counters

    hkv, ps, pages = 2, 64, 12

    class DecodeStep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            if kv_dtype == NVFP4:
                cache = torch.zeros(pages, 2 * hkv, ps, 72, dtype=torch.uint8, device="cuda")
            else:
                cache = torch.zeros(pages, hkv, ps, 256, dtype=kv_dtype, device="cuda")
            self.register_buffer("kv_cache", cache)
            self.register_buffer("k_scale", torch.ones(1, device="cuda"))
            self.register_buffer("v_scale", torch.ones(1, device="cuda"))

        def forward(self, k, v, slots, q, topk_pages, block_table, seq_lens):
            gqa_kv_cache_insert(k, v, slots, self.kv_cache, k_scale_tensor=self.k_scale, v_scale_tensor=self.v_scale)
            kv_lens, qo = decode_runtime_metadata(seq_lens, decode_query_len=1)
            return sparse_gqa_decode(q, self.kv_cache, topk_pages, block_table, kv_lens, qo, softmax_scale=0.1,
                                     k_scale_tensor=self.k_scale, v_scale_tensor=self.v_scale)

    module = DecodeStep()
    mirror = torch.zeros_like(module.kv_cache).cpu()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(module, mode="reduce-overhead", fullgraph=True)
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        for step in range(4):  # warm-up, record, then replays with new inputs and scales
            gen = torch.Generator().manual_seed(step)
            k, v = torch.randn(24, hkv, 128, generator=gen), torch.randn(24, hkv, 128, generator=gen)
            slots = torch.randperm(pages * ps, generator=gen)[:24]
            q = torch.randn(3, 8, 128, generator=gen).to(BF16)
            block_table = torch.randperm(pages, generator=gen)[:12].view(3, 4).to(torch.int32)
            topk = torch.randint(-1, 4, (3, hkv, 3), generator=gen, dtype=torch.int32)
            seq_lens = torch.randint(1, 4 * ps, (3,), generator=gen, dtype=torch.int32)
            module.k_scale.fill_(0.5 + step)
            module.v_scale.fill_(2.0 / (1 + step))
            kst, vst = module.k_scale.cpu(), module.v_scale.cpu()
            result = compiled(k.cuda(), v.cuda(), slots.cuda(), q.cuda(), topk.cuda(), block_table.cuda(),
                              seq_lens.cuda()).clone()
            gqa_ops.gqa_kv_cache_insert_torch(k, v, slots, mirror, 1.0, 1.0, kst, vst)
            assert_same_bytes(module.kv_cache, mirror)
            kv_lens, qo = decode_runtime_metadata(seq_lens, decode_query_len=1)
            assert_matches_reference(result, dict(q=q, kv_cache=mirror, topk_pages=topk, block_table=block_table,
                                                  kv_segment_lens=kv_lens, qo_offset=qo, decode_query_len=1,
                                                  softmax_scale=0.1, k_scale_tensor=kst, v_scale_tensor=vst))
    assert counters["inductor"]["cudagraph_skips"] == 0


# -- the Hopper kernel (ops/sparse_gqa_hopper.py): float8 value caches on sm_90, not under the interpreter --

HOPPER_CASES = [
    # MiniMax-M3: 16 query heads per KV head, pages of 128
    Cfg(hq=64, hkv=4, dh=128, page_size=128, dql=1, q_dtype=BF16, kv_dtype=FP8, batch=4, n_sel=6, offset=16),
    Cfg(hq=64, hkv=4, dh=128, page_size=128, dql=4, q_dtype=BF16, kv_dtype=FP8, batch=3, n_sel=5, layout="NHD",
        scale_tensors=True, offset=0),
    # a padded group of 8, pages smaller than a block, padded page stride
    Cfg(hq=8, hkv=1, dh=128, page_size=16, dql=2, q_dtype=FP16, kv_dtype=FP8, batch=3, page_pad=32, offset=16),
    # 24 heads per KV head: two blocks of 16 (the second half padding); pages of 96 (a partial second block)
    Cfg(hq=24, hkv=1, dh=128, page_size=96, dql=1, q_dtype=BF16, kv_dtype=FP8, batch=3, offset=16),
    # 48 heads per KV head: three blocks of 16; pages of 200 (4 blocks, the last of 8 keys)
    Cfg(hq=96, hkv=2, dh=128, page_size=200, dql=3, q_dtype=FP16, kv_dtype=FP8, batch=2, n_sel=3, layout="NHD",
        page_pad=16, offset=16, scale_tensors=True),
    # NVFP4 caches (16-byte aligned, page strides in multiples of 16 bytes): the MiniMax-M3 shape; small
    # pages with a padded page stride and device scales; 48 heads per KV head on pages of 200
    Cfg(hq=64, hkv=4, dh=128, page_size=128, dql=1, q_dtype=BF16, kv_dtype=NVFP4, batch=4, n_sel=6, offset=16),
    Cfg(hq=8, hkv=1, dh=128, page_size=16, dql=2, q_dtype=FP16, kv_dtype=NVFP4, batch=3, page_pad=32, offset=16,
        scale_tensors=True),
    Cfg(hq=96, hkv=2, dh=128, page_size=200, dql=3, q_dtype=BF16, kv_dtype=NVFP4, batch=2, n_sel=3, page_pad=16,
        offset=16),
]


def test_hopper_kernel_alignment_needs():
    """Without a GPU: the Hopper kernel compiled for sm_90a with one pointer argument at a time not
    known to be 16-byte aligned (how the JIT specialises an unaligned tensor) fails to build exactly
    for the arguments at ``ALIGNED_ARGS``, the ones :func:`supported` checks and a recorded launch
    refuses unaligned (``ops/_launch.py::KernelLaunch``); every other pointer may have any alignment."""
    from torch_sparse_mla.ops import sparse_gqa_hopper as hopper

    check_alignment_needs(hopper, "_sparse_gqa_decode_hopper_kernel", "--gqa")


def test_hopper_kernel_builds_for_sm90_within_limits():
    """Without a GPU: the Hopper sparse-GQA kernel (split x query dtype) compiles for sm_90a with the ptxas
    shipped in the triton wheel (``scripts/inspect_hopper.py --gqa``), at 80 registers per thread and
    shared memory for two CTAs per SM, with float8 and float16 tensor-core products, (nearly) no
    spills, per-block loops no longer than measured, no shared-memory scratch buffer placed on an
    mbarrier, and every hand-off between partitions
    in the form compute-sanitizer's racecheck follows: each one-thread mbarrier arrive comes with every
    thread's own arrive, and the producer's per-block ``ready`` arrive is every thread's
    (docs/testing.md, "Under compute-sanitizer")."""
    import re

    pytest.importorskip("triton.backends.nvidia.compiler")
    from torch_sparse_mla.ops import sparse_gqa_hopper

    require_gluon(sparse_gqa_hopper)
    result = run_offline_compile("inspect_hopper.py", "--gqa")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if " split=" in line]
    assert len(rows) == 16, result.stdout
    for row in rows:
        nvfp4 = " nvfp4 " in row
        smem = int(re.search(r"smem=(\d+)", row).group(1))
        spill_stores = int(re.search(r"spill st/ld=(\d+)/", row).group(1))
        counts = {k: int(v) for k, v in re.findall(r"\b(HGMMA|QGMMA|SYNCS|PREEXIT)=(\d+)", row)}
        assert re.search(r"maxnreg=\['80'\]", row), row
        assert 2 * (smem + 1024) <= 228 * 1024, row  # two CTAs per SM (1 KB reserved per CTA)
        # spill stores: 0-24 bytes with triton 3.6 to 3.9 since the register split of 97d6e77 (44-100 before in
        # some variants; docs/sparse_gqa_hopper.md, "Registers to the consumers"), none in the per-block loops
        # (checked below)
        assert spill_stores <= 32, row
        # float8: float8 Q K^T and float16 P V; NVFP4: float16 for both
        assert counts["HGMMA"] > 0 and (counts["QGMMA"] == 0 if nvfp4 else counts["QGMMA"] > 0), row
        assert counts["SYNCS"] > 0, row
        # a split kernel lets its combine (programmatic dependent launch) be scheduled once its partials are
        # stored (griddepcontrol.launch_dependents); an unsplit one has no dependent
        assert (counts["PREEXIT"] > 0) == (" split=1" in row), row
        assert re.search(r"barrier_alias=0\b", row), row  # no scratch buffer on an mbarrier (docs/sparse_gqa_hopper.md)
        arrive_one = int(re.search(r"arrive_one=(\d+)", row).group(1))
        arrive_all = int(re.search(r"arrive_all=(\d+)", row).group(1))
        assert arrive_one > 0 and arrive_all >= arrive_one + 1, row
        # one per-block loop per partition (triton 3.6 and 3.7.1 place them in the order consumer 1,
        # producer, consumer 0; 3.8 the producer's last), with the instructions they had when measured
        # (docs/sparse_gqa_hopper.md, "Fewer instructions per block"; triton 3.6 and 3.7.1: a consumer's loop
        # float8 298-327, NVFP4 489-500 (505-514 before); with the reference maximum, its rarely taken
        # exact-maximum branch included, float8 371-407 (388-424 before), NVFP4 564-571 (599-605 before);
        # the producer 82-90, NVFP4's one-warp producer since 7d239d1 98 with 3.7.1 and 125 with 3.6, whose ptxas
        # puts 21 never-executed LDS and 10 NOPs between the copies; 3.8 and 3.9 within these limits too): a
        # longer consumer loop is a slower kernel; no spill store or reload in a loop
        lazy = " lazy=1" in row
        loops = [int(n) for n in re.search(r"loops=([\d,]+)", row).group(1).split(",")]
        loop_spills = [int(n) for n in re.search(r"loop_spills=([\d,]+)", row).group(1).split(",")]
        assert len(loops) == 3 and len(loop_spills) == 3, row
        producer, *consumers = sorted(loops)
        limit = (580 if nvfp4 else 415) if lazy else (510 if nvfp4 else 360)
        assert max(consumers) <= limit and producer <= (130 if nvfp4 else 100), row
        assert max(loop_spills) == 0, row


def test_racecheck_probe_builds_for_sm90():
    """Without a GPU: every hand-off form of ``scripts/racecheck_probe.py`` (the probe of which hand-offs
    compute-sanitizer's racecheck follows, docs/testing.md) compiles for sm_90a with the arrivals it is
    meant to have."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from torch_sparse_mla.ops import sparse_gqa_hopper

    require_gluon(sparse_gqa_hopper)
    result = run_offline_compile("racecheck_probe.py", "--compile")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("arrives") == 18, result.stdout


_RACECHECK_LOG = """\
== racecheck: tests/test_x.py
========= COMPUTE-SANITIZER
========= Error: Race reported between Read access at _k+0x120 in k.py:3
=========     and Write access at _k+0x4730 in k.py:3 [172 hazards]
=========     and Write access at _k+0x8d80 in k.py:7 [269 hazards]
========= 
.========= Error: Race reported between Read access at _k+0x2410 in k.py:5
=========     and Write access at _k+0xfca0 in k.py:4 [320 hazards]
========= 
..========= Error: Race reported between Read access at _k+0x2400 in k.py:5
=========     and Write access at _k+0xfc00 in k.py:4 [8 hazards]
========= 
.========= Warning: Race reported between Write access at _k+0x100 in k.py:4
=========     and Write access at _k+0x200 in gone.py:9 [2 hazards]
========= 
2 passed
========= RACECHECK SUMMARY: 4 hazards displayed (3 errors, 1 warning)
"""
_RACECHECK_SOURCE = """\
@gluon.jit
def _helper(x):
    def _k(a, b):
        buf.store(a)
        b = buf.load(L)
        pass
        gl.warp_specialize([(_p, (a,)), (_c, (b,))], [4], [80])
"""


def test_racecheck_summary_separates_the_warp_specialize_start_up(tmp_path):
    """``scripts/racecheck_summary.py`` (run by ``scripts/sanitize.sh racecheck``) groups a racecheck log's
    reports by kernel and source lines, names as Triton's start-up only reports whose every access is on
    the kernel's ``def`` line or a ``warp_specialize(`` call, quotes the source of the others, and counts
    a report whose source it cannot find as one on the kernel's buffers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("racecheck_summary",
                                                  os.path.join(REPO, "scripts", "racecheck_summary.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "k.py").write_text(_RACECHECK_SOURCE)
    records = mod.parse(_RACECHECK_LOG)
    assert [r["hazards"] for r in records] == [441, 320, 8, 2]
    assert records[0]["accesses"] == [("Read", "k.py", 3), ("Write", "k.py", 3), ("Write", "k.py", 7)]
    lines = mod.summarize(_RACECHECK_LOG, [str(tmp_path)])
    assert lines[-1] == ("racecheck reports: 4; Triton's warp_specialize start-up: 1; "
                         "on the kernels' own buffers: 3")
    start_up = [line for line in lines if "start-up:" in line and "report(s)" in line]
    assert len(start_up) == 1 and "1 report(s), 441 hazards" in start_up[0], lines
    buffers = [line for line in lines if "kernel buffers" in line]
    assert any("2 report(s), 328 hazards" in line and "(b = buf.load(L))" in line and "(buf.store(a))" in line
               for line in buffers), lines
    assert any("gone.py:9" in line for line in buffers), lines


@pytest.mark.parametrize("tokens,n_sel,splits", [(64, 16, 1), (256, 16, 1), (16, 16, 4), (1, 16, 16), (4, 200, 16),
                                                 (300, 200, 4)])
def test_hopper_split_plan(tokens, n_sel, splits):
    """About two CTAs per SM (132 SMs, 4 KV heads of 16 query heads, pages of 128 = 2 blocks), at least two
    blocks per split, at most 64 pages per split."""
    from torch_sparse_mla.ops import sparse_gqa_hopper as hopper

    plan = hopper.plan_launch(tokens, 4, 16, n_sel, 128, 132)
    assert (plan.block_h, plan.head_blocks, plan.num_splits) == (16, 1, splits)
    assert hopper.blocks_per_split(n_sel, 128, plan) <= 128
    assert hopper.plan_launch(tokens, 4, 48, n_sel, 128, 132).head_blocks == 3
    assert hopper.plan_launch(tokens, 4, 16, n_sel, 128, 132, num_splits=5).num_splits == 5


@pytest.mark.parametrize("splits,rows", [(16, 32), (5, 32), (4, 16), (2, 16)])
def test_combine_rows_per_program(splits, rows):
    """The split combine loads 32 partial rows (heads x splits) per program, 16 for plans of at most 4
    splits (measured faster on an H200 at T = 16 and 24, docs/sparse_gqa_hopper.md); every split of a
    head in one step."""
    from torch_sparse_mla.ops import sparse_gqa_hopper as hopper

    plan = hopper.plan_launch(1, 4, 16, 16, 128, 132, num_splits=splits)
    q = torch.empty(1, 64, 128)
    meta = gqa_ops._make_combine(q, torch.empty_like(q), plan, 1.0, False).meta
    assert meta["BLOCK_S"] == meta["BLOCK_SM"] and meta["BLOCK_S"] * meta["BLOCK_HC"] == rows


def test_hopper_path_off_cuda():
    """Off an sm_90 GPU (here: CPU tensors) the portable kernel serves every call; asking for the Hopper
    kernel is an error."""
    args, _ = make_inputs(Cfg(hq=16, hkv=1, dh=128, page_size=16, q_dtype=BF16, kv_dtype=FP8, offset=16), seed=1)
    assert gqa_ops.kernel_path(args["q"], args["kv_cache"]) == "portable"
    with pytest.raises(ValueError, match="Hopper kernel does not serve"):
        gqa_ops.sparse_gqa_decode_triton(*args.values(), out=_out_buffer(args), path="hopper")


@requires_hopper
@pytest.mark.parametrize("num_splits", [None, 1, 3, 40], ids=lambda s: f"splits={s or 'auto'}")
@pytest.mark.parametrize("cfg", HOPPER_CASES, ids=lambda c: c.id)
def test_cuda_hopper_matches_reference(cfg, num_splits):
    args, _ = make_inputs(cfg, seed=21, device="cuda")
    assert gqa_ops.kernel_path(args["q"], args["kv_cache"]) == "hopper"
    out = _out_buffer(args, transpose=num_splits == 3)
    gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, num_splits=num_splits, path="hopper")
    assert_matches_reference(out, args)


@requires_hopper
@pytest.mark.parametrize("stages", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("kv_dtype", [FP8, NVFP4], ids=DTYPE_NAMES.get)
def test_cuda_hopper_ring_depths(stages, kv_dtype):
    """Every ring depth (raw stages) the plan may be given, on lists much longer than the ring."""
    cfg = Cfg(hq=32, hkv=2, dh=128, page_size=64, dql=1, q_dtype=BF16, kv_dtype=kv_dtype, batch=3, n_sel=12,
              offset=16)
    args, _ = make_inputs(cfg, seed=22, device="cuda")
    for num_splits in (1, 2):
        out = _out_buffer(args)
        gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, num_splits=num_splits, path="hopper",
                                         config=dict(num_stages=stages))
        assert_matches_reference(out, args)


@requires_hopper
@pytest.mark.parametrize("spread", [1.0, 8.0, 64.0])
@pytest.mark.parametrize("kv_dtype", [FP8, NVFP4], ids=DTYPE_NAMES.get)
def test_cuda_hopper_reference_maximum(kv_dtype, spread):
    """Splits of at least ``_LAZY_MIN_BLOCKS`` blocks take a block's weights against a reference maximum
    and recompute it only when a score exceeds it by more than a margin (docs/sparse_gqa_hopper.md,
    "The reference maximum"). With the softmax scale multiplied by ``spread`` the scores span many binades,
    so later blocks often pass the margin, in some heads and warps of a block and not in others, and the
    recomputation runs mid-list as well as on each consumer's first block; split and unsplit, against
    the reference."""
    from torch_sparse_mla.ops import sparse_gqa_hopper as hopper

    cfg = Cfg(hq=32, hkv=2, dh=128, page_size=64, dql=2, q_dtype=BF16, kv_dtype=kv_dtype, batch=3, n_sel=32,
              offset=16)
    args, _ = make_inputs(cfg, seed=24, device="cuda")
    args["softmax_scale"] *= spread
    for num_splits in (1, 2):
        plan = hopper.plan_launch(args["q"].shape[0], 2, 16, 32, 64, 132, num_splits=num_splits)
        assert hopper.blocks_per_split(32, 64, plan) >= hopper._LAZY_MIN_BLOCKS
        out = _out_buffer(args)
        gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, num_splits=num_splits, path="hopper")
        assert_matches_reference(out, args)


@requires_hopper
@pytest.mark.parametrize("num_splits", [None, 3], ids=lambda s: f"splits={s or 'auto'}")
@pytest.mark.parametrize("cfg", HOPPER_CASES, ids=lambda c: c.id)
def test_cuda_hopper_reference_maximum_everywhere(cfg, num_splits, monkeypatch):
    """Every Hopper case with the reference maximum forced on for splits of any length (it is on only for
    long ones): partial pages, padded head blocks, several head blocks, query lengths above 1."""
    from torch_sparse_mla.ops import sparse_gqa_hopper as hopper

    monkeypatch.setattr(hopper, "_LAZY_MIN_BLOCKS", 1)
    gqa_ops._PLANS.clear()
    try:
        args, _ = make_inputs(cfg, seed=25, device="cuda")
        out = _out_buffer(args)
        gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, num_splits=num_splits, path="hopper")
        assert_matches_reference(out, args)
    finally:
        gqa_ops._PLANS.clear()


@requires_hopper
@pytest.mark.parametrize("kv_dtype", [FP8, NVFP4], ids=DTYPE_NAMES.get)
def test_cuda_hopper_combine_pdl_matches_plain_launch(kv_dtype, monkeypatch):
    """The combine of a split Hopper call launched with programmatic dependent launch (the default on
    sm_90; it may be scheduled before the decode kernel ends and waits for it) writes the same bytes as
    a combine launched after the decode kernel."""
    cfg = Cfg(hq=32, hkv=2, dh=128, page_size=64, dql=1, q_dtype=BF16, kv_dtype=kv_dtype, batch=3, n_sel=12,
              offset=16)
    args, _ = make_inputs(cfg, seed=23, device="cuda")
    outs = []
    try:
        for pdl in (True, False):
            monkeypatch.setattr(gqa_ops, "COMBINE_PDL", pdl)
            gqa_ops._PLANS.clear()
            out = _out_buffer(args)
            gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, num_splits=3, path="hopper")
            outs.append(out)
    finally:
        gqa_ops._PLANS.clear()
    assert torch.equal(outs[0], outs[1])
    assert_matches_reference(outs[0], args)


@requires_hopper
@pytest.mark.parametrize("kv_dtype", [FP8, NVFP4], ids=DTYPE_NAMES.get)
def test_cuda_hopper_is_the_default_on_sm90(kv_dtype):
    """Float8 value caches and NVFP4 caches with Dh = 128, 16-byte aligned, take the Hopper kernel;
    anything else the portable one, and asking for the Hopper kernel there is an error."""
    cfg = dataclasses.replace(HOPPER_CASES[0], kv_dtype=kv_dtype)
    args, _ = make_inputs(cfg, seed=23, device="cuda")
    assert gqa_ops.kernel_path(args["q"], args["kv_cache"]) == "hopper"
    others = [
        make_inputs(dataclasses.replace(cfg, offset=3), seed=23, device="cuda")[0],  # misaligned base
        make_inputs(dataclasses.replace(cfg, page_pad=8), seed=23, device="cuda")[0],  # page stride % 16 != 0
        make_inputs(dataclasses.replace(cfg, q_dtype=FP8), seed=23, device="cuda")[0],  # float8 query
        make_inputs(dataclasses.replace(cfg, kv_dtype=BF16), seed=23, device="cuda")[0],  # a bf16 cache
    ]
    for other in others:
        assert gqa_ops.kernel_path(other["q"], other["kv_cache"]) == "portable"
        with pytest.raises(ValueError, match="Hopper kernel does not serve"):
            gqa_ops.sparse_gqa_decode_triton(*other.values(), out=_out_buffer(other), path="hopper")
        assert_matches_reference(_public(other), other)  # the portable kernel serves them
    out = _public(args)
    portable = _out_buffer(args)
    gqa_ops.sparse_gqa_decode_triton(*args.values(), out=portable, path="portable")
    assert_matches_reference(out, args)
    torch.testing.assert_close(out.float(), portable.float(), atol=2e-2, rtol=2e-2)


@requires_hopper
@pytest.mark.parametrize("kv_dtype", [FP8, NVFP4], ids=DTYPE_NAMES.get)
def test_cuda_hopper_unaligned_cache_after_aligned(kv_dtype):
    """A cache at a misaligned base after an aligned one of the same shapes and strides: the public
    function, the registered operator and its out overload replay the launches a signature's first call
    recorded (here the Hopper kernel's), and for the misaligned cache they run the launcher instead,
    which takes the portable kernel."""
    cfg = dataclasses.replace(HOPPER_CASES[0], kv_dtype=kv_dtype)
    args, _ = make_inputs(cfg, seed=29, device="cuda")
    unaligned, _ = make_inputs(dataclasses.replace(cfg, offset=3), seed=29, device="cuda")
    assert unaligned["kv_cache"].stride() == args["kv_cache"].stride()
    assert gqa_ops.kernel_path(args["q"], args["kv_cache"]) == "hopper"
    forget_signatures("sparse_gqa_decode")  # the aligned call first, whatever tests ran before
    for call in (args, unaligned, args, unaligned):
        assert_matches_reference(_public(call), call)
        assert_matches_reference(torch.ops.sparse_mla.sparse_gqa_decode(*call.values()), call)
        buffer = _out_buffer(call)
        torch.ops.sparse_mla.sparse_gqa_decode.out(*call.values(), out=buffer)
        assert_matches_reference(buffer, call)


@requires_hopper
def test_cuda_hopper_query_pieces_are_exact():
    """The query enters the float8 products as e4m3 pieces of the row scaled by a power of two: for
    bfloat16 (two pieces) and float16 (three) queries whose elements span the row's largest magnitude
    down to 2**-9 of it, the scores are the query's own values (keys with one nonzero dim, 1.0, select
    a query element each; two pieces of a float16 query would be off by up to 2**-8 relative)."""
    dh, keys = 128, 128
    for q_dtype in (BF16, FP16):
        gen = torch.Generator().manual_seed(3)
        q = torch.zeros(1, 16, dh)
        mant = torch.randint(0, 1 << 7, (16, dh), generator=gen) / 128 + 1.0  # 8 significant bits (bf16)
        if q_dtype == FP16:
            mant = torch.randint(0, 1 << 10, (16, dh), generator=gen) / 1024 + 1.0  # 11 bits (fp16)
        expo = torch.randint(-8, 1, (16, dh), generator=gen).float()  # down to 2**-9 of the row's largest
        sign = torch.where(torch.rand(16, dh, generator=gen) < 0.5, -1.0, 1.0)
        q[0] = sign * mant * torch.exp2(expo) * 3.0
        q = q.to(q_dtype)
        cache = torch.zeros(1, 1, keys, 2 * dh)
        cache[0, 0, :, :dh] = torch.eye(keys, dh)  # key o = e_o: score o = q[o]
        cache[0, 0, :, dh:] = torch.eye(keys, dh)  # value o = e_o: the output is the softmax itself
        cache = cache.to(FP8)
        args = dict(q=q.cuda(), kv_cache=cache.cuda(), topk_pages=torch.zeros(1, 1, 1, dtype=torch.int32).cuda(),
                    block_table=torch.zeros(1, 1, dtype=torch.int32).cuda(),
                    kv_segment_lens=torch.tensor([keys], dtype=torch.int32).cuda(),
                    qo_offset=torch.tensor([keys - 1], dtype=torch.int32).cuda(), decode_query_len=1,
                    softmax_scale=1.0)
        assert gqa_ops.kernel_path(args["q"], args["kv_cache"]) == "hopper"
        out = torch.empty(1, 16, dh, dtype=FP16 if q_dtype == FP16 else BF16, device="cuda")
        gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, path="hopper")
        want = torch.softmax(q[0].double(), dim=-1)
        torch.testing.assert_close(out[0].cpu().double(), want, atol=2e-3, rtol=1e-2)


@requires_cuda
@pytest.mark.parametrize("in_dtype", [BF16, FP16, FP32], ids=lambda d: f"in_{DTYPE_NAMES[d]}")
@pytest.mark.parametrize("kv_dtype", INSERT_FORMATS, ids=lambda d: DTYPE_NAMES[d])
def test_cuda_insert_bit_exact(kv_dtype, in_dtype):
    """The CUDA kernel writes exactly the CPU kernel's bytes (NaN, ties, saturation and zero scales
    included), in large batches too."""
    for scale_tensors, n in ((False, None), (True, 4096)):
        cache, k, v, slots, scales = _insert_inputs(kv_dtype, in_dtype, scale_tensors, seed=20)
        if n is not None:  # a big batch into a big cache
            cache = make_cache(kv_dtype, pages=600, hkv=4, page_size=16)
            slots = torch.randperm(600 * 16)[:n]
            k, v = make_kv(n, 4, 128, in_dtype, seed=21), make_kv(n, 4, 128, in_dtype, seed=22)
        k[0, 1, 5] = float("nan")
        gpu = _to_device(cache, "cuda")
        gqa_kv_cache_insert(k.cuda(), v.cuda(), slots.cuda(), gpu,
                            **{n_: (x.cuda() if isinstance(x, torch.Tensor) else x) for n_, x in scales.items()})
        gqa_ops.gqa_kv_cache_insert_torch(k, v, slots, cache, **scales)
        assert_same_bytes(gpu, cache)


@requires_cuda
@pytest.mark.parametrize("kv_dtype", INSERT_FORMATS, ids=lambda d: DTYPE_NAMES[d])
def test_cuda_insert_graph_capture_and_replay(kv_dtype):
    """Capture the insert once; replay with new values, slots and device scales."""
    cache = make_cache(kv_dtype, device="cuda")
    mirror = make_cache(kv_dtype)
    num_slots = cache.shape[0] * cache.shape[2]
    static_k, static_v = torch.zeros(15, 2, 128, device="cuda"), torch.zeros(15, 2, 128, device="cuda")
    static_slots = torch.full((15,), -1, dtype=torch.int64, device="cuda")
    ks, vs = torch.ones(1, device="cuda"), torch.ones(1, device="cuda")

    def step():
        gqa_kv_cache_insert(static_k, static_v, static_slots, cache, k_scale=0.5, k_scale_tensor=ks, v_scale_tensor=vs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # all slots -1: writes nothing
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (1, 2, 3):
        slots = make_slots(num_slots, 9, seed)
        k, v = make_kv(15, 2, 128, FP32, seed), make_kv(15, 2, 128, FP32, seed + 10)
        static_k.copy_(k)
        static_v.copy_(v)
        static_slots.copy_(slots)
        ks.fill_(0.25 * seed)
        vs.fill_(4.0 / seed)
        graph.replay()
        torch.cuda.synchronize()
        gqa_ops.gqa_kv_cache_insert_torch(k, v, slots, mirror, 0.5, 1.0, ks.cpu(), vs.cpu())
        assert_same_bytes(cache, mirror)


def _extreme_insert_inputs(kv_dtype):
    """Values past the saturation (infinities, 1e30), subnormal inputs and signed zeros, whose
    quotients underflow, and total scales inside and outside the range of the GPU writer's reciprocal
    path (2**+-50 for NVFP4, 2**+-60 for float8), a negative one, an extreme pair and a pair whose
    NVFP4 divisors overflow where a group holds an infinity (the quotient inf / inf codes as 0)."""
    cache, k, v, slots, _ = _insert_inputs(kv_dtype, FP32, seed=30)
    k[1, 0, :8] = torch.tensor([float("inf"), -float("inf"), 1e30, -1e30, 1e-40, -1e-40, -0.0, 3e38])
    v[1, 1, 16:24] = torch.tensor([-float("inf"), 1e-45, -1e-45, 2.0**-126, -(2.0**-130), 0.0, -0.0, 5e37])
    k[2, 1, 32:48] = -1e-39  # a whole group of negative subnormals
    scale_pairs = ((2.0**-49, 2.0**49), (2.0**-51, 2.0**51), (2.0**-59, 2.0**59), (2.0**-61, 2.0**61),
                   (-0.75, 1.0 / 3.0), (3e-38, 2.0**70), (2.0**125, 2.0**125))
    return cache, k, v, slots, scale_pairs


@pytest.mark.parametrize("kv_dtype", [FP8, NVFP4], ids=lambda d: DTYPE_NAMES[d])
def test_insert_extreme_scales_and_values(kv_dtype):
    """The CPU kernel against the value-by-value reference on the inputs of the GPU test below."""
    _, k, v, slots, scale_pairs = _extreme_insert_inputs(kv_dtype)
    for k_scale, v_scale in scale_pairs[::2] + scale_pairs[-2:]:
        got, want = make_cache(kv_dtype), make_cache(kv_dtype)
        gqa_kv_cache_insert(k, v, slots, got, k_scale=0.5, v_scale=2.0, k_scale_tensor=torch.tensor([k_scale]),
                            v_scale_tensor=torch.tensor([v_scale]))
        naive_insert(want, k, v, slots, 0.5, 2.0, torch.tensor([k_scale]), torch.tensor([v_scale]))
        assert_same_bytes(got, want)


@requires_cuda
@pytest.mark.parametrize("kv_dtype", [FP8, NVFP4], ids=lambda d: DTYPE_NAMES[d])
def test_cuda_insert_extreme_scales_and_values_bit_exact(kv_dtype):
    """The GPU writer's two division paths meet the CPU kernel's bytes at their edges (see
    _extreme_insert_inputs)."""
    _, k, v, slots, scale_pairs = _extreme_insert_inputs(kv_dtype)
    for k_scale, v_scale in scale_pairs:
        want = make_cache(kv_dtype)
        gpu = _to_device(make_cache(kv_dtype), "cuda")
        gqa_kv_cache_insert(k.cuda(), v.cuda(), slots.cuda(), gpu, k_scale=0.5, v_scale=2.0,
                            k_scale_tensor=torch.tensor([k_scale], device="cuda"),
                            v_scale_tensor=torch.tensor([v_scale], device="cuda"))
        gqa_ops.gqa_kv_cache_insert_torch(k, v, slots, want, 0.5, 2.0, torch.tensor([k_scale]), torch.tensor([v_scale]))
        assert_same_bytes(gpu, want)
