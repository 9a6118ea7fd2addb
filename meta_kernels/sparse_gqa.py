"""Fakes of the sparse GQA operators: ``sparse_gqa_decode`` and ``gqa_kv_cache_insert``.

Each function validates its arguments from metadata only (dtypes, ranks, devices, shapes, strides,
and the values of Python scalars) and, for the functional overload, returns the empty output. The real
implementations call these first, so the CPU and CUDA kernels rely on every check below; in particular
the cache-layout checks prove that every byte a kernel may touch lies inside the cache view.

Cache formats (``docs/sparse_gqa.md``), told apart by dtype:

- **values**: ``[pages, Hkv, page_size, 2 * Dh]`` of bfloat16, float16 or float8_e4m3fn, any strides
  with ``stride(-1) == 1``; K is ``[..., :Dh]``, V ``[..., Dh:]``. A kernel only touches elements of the
  view, so any such view is safe to read; a written cache must not overlap itself.
- **NVFP4**: uint8 ``[pages, 2 * Hkv, page_size, 72]`` with ``Dh = 128``; slot ``2g`` is KV head
  ``g``'s K, slot ``2g + 1`` its V, each ``page_size * 72`` contiguous bytes (64-byte data rows, then
  the scale bytes). The strides must be exactly ``(>= 2 * Hkv * page_size * 72, page_size * 72, 72,
  1)``: every byte the layout places is then an element of the view.
"""

from __future__ import annotations

import math

import torch

from ._common import (
    INDEX_DTYPES,
    INT32_MAX,
    SLOT_DTYPES,
    check_no_self_overlap,
    check_positive,
    check_size,
    check_tensor,
    check_unit_stride,
    dtype_names,
    expect,
)

# Query and value-cache dtypes; either may be float8 independently of the other.
VALUE_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
CACHE_DTYPES = VALUE_DTYPES + (torch.uint8,)  # uint8: NVFP4
# k and v of gqa_kv_cache_insert.
INSERT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

NVFP4_HEAD_DIM = 128
NVFP4_DATA_BYTES = 64  # per token and slot: 128 4-bit codes
NVFP4_SCALE_BYTES = 8  # per token and slot: one e4m3 scale per 16 values
NVFP4_TOKEN_BYTES = NVFP4_DATA_BYTES + NVFP4_SCALE_BYTES  # 72, the cache's last dimension
NVFP4_GROUP = 16  # values per scale

FLOAT32_MAX = 3.4028234663852886e38


def is_nvfp4(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.uint8


def kv_heads(kv_cache: torch.Tensor) -> int:
    """The KV heads of a sparse-GQA cache: ``shape[1]``, halved for an NVFP4 cache (a K slot and a V slot
    per head)."""
    return kv_cache.shape[1] // 2 if is_nvfp4(kv_cache) else kv_cache.shape[1]


def output_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """``q.dtype``, or bfloat16 for a float8 query."""
    return torch.bfloat16 if q_dtype == torch.float8_e4m3fn else q_dtype


def check_scale(name: str, value, nonzero: bool = False) -> None:
    """A Python float scale: finite and inside the float32 range (the kernels compute in float32).
    Symbolic floats (``torch.compile(dynamic=True)``) are only type-checked."""
    if not isinstance(value, (float, int, torch.SymFloat, torch.SymInt)) or isinstance(value, bool):
        raise ValueError(f"{name}: expected a float, got {type(value).__name__}")
    if isinstance(value, (float, int)):
        if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
            raise ValueError(f"{name}: expected a finite float (inside the float32 range), got {value}")
        if nonzero and value == 0:
            raise ValueError(f"{name}: expected a nonzero float (values are divided by it), got {value}")


def check_scale_tensor(name: str, t, device) -> None:
    """An optional device scale: a float32 tensor of one element on ``device`` (its value is read by the
    kernels on the device, never here)."""
    if t is None:
        return
    check_tensor(name, t, dtypes=(torch.float32,), device=device)
    expect(t.numel() == 1, lambda: f"{name}: expected a tensor of one element, got shape {tuple(t.shape)}")


def check_cache(name: str, kv_cache, device, *, written: bool = False):
    """Layout checks of a sparse GQA cache; returns ``(num_kv_heads, head_dim)``."""
    check_tensor(name, kv_cache, dtypes=CACHE_DTYPES, ndim=4, device=device)
    pages, slots, page_size, width = kv_cache.shape
    if not is_nvfp4(kv_cache):
        expect(width % 2 == 0, lambda: f"{name}: expected an even shape[3] (K and V halves of head_dim each), "
                                       f"got shape {tuple(kv_cache.shape)}")
        expect(slots >= 1, lambda: f"{name}: expected at least one KV head (shape[1] >= 1), "
                                   f"got shape {tuple(kv_cache.shape)}")
        check_unit_stride(name, kv_cache)
        if written:
            check_no_self_overlap(name, kv_cache)
        return slots, width // 2
    expect(width == NVFP4_TOKEN_BYTES,
           lambda: f"{name}: expected shape[3] == {NVFP4_TOKEN_BYTES} for an NVFP4 (uint8) cache (64 data bytes and 8 "
                   f"scale bytes per token), got shape {tuple(kv_cache.shape)}")
    expect((slots >= 2) & (slots % 2 == 0),
           lambda: f"{name}: expected an even shape[1] >= 2 for an NVFP4 (uint8) cache (a K slot and a V slot per KV "
                   f"head), got shape {tuple(kv_cache.shape)}")
    expect(page_size % 4 == 0,
           lambda: f"{name}: expected shape[2] (page_size) to be a multiple of 4 for an NVFP4 (uint8) cache (V scales "
                   f"are stored by token quads), got shape {tuple(kv_cache.shape)}")
    if kv_cache.numel() > 0:
        slot_bytes = page_size * NVFP4_TOKEN_BYTES
        expect((kv_cache.stride(3) == 1) & (kv_cache.stride(2) == NVFP4_TOKEN_BYTES) & (kv_cache.stride(1) == slot_bytes),
               lambda: f"{name}: expected strides (*, {slot_bytes}, {NVFP4_TOKEN_BYTES}, 1) for an NVFP4 (uint8) cache "
                       f"(each slot is page_size * 72 contiguous bytes), got strides {tuple(kv_cache.stride())}")
        expect((pages <= 1) | (kv_cache.stride(0) >= slots * slot_bytes),
               lambda: f"{name}: expected stride(0) >= shape[1] * page_size * 72 ({slots * slot_bytes}) for an NVFP4 "
                       f"(uint8) cache (pages must not overlap), got strides {tuple(kv_cache.stride())}")
    return kv_heads(kv_cache), NVFP4_HEAD_DIM


# -- sparse_gqa_decode ---------------------------------------------------------------------------------


def _check_sparse_gqa_decode(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len,
                             softmax_scale, q_scale, k_scale, v_scale, k_scale_tensor, v_scale_tensor):
    """All checks shared by both overloads; returns the output shape ``(T, Hq, Dh)``."""
    check_tensor("q", q, dtypes=VALUE_DTYPES, ndim=3)
    device = q.device
    num_kv_heads, cache_head_dim = check_cache("kv_cache", kv_cache, device)
    check_tensor("topk_pages", topk_pages, dtypes=INDEX_DTYPES, ndim=3, device=device)
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2, device=device)
    check_tensor("kv_segment_lens", kv_segment_lens, dtypes=INDEX_DTYPES, ndim=1, device=device)
    check_tensor("qo_offset", qo_offset, dtypes=INDEX_DTYPES, ndim=1, device=device)

    num_tokens, num_q_heads, head_dim = q.shape
    if is_nvfp4(kv_cache):
        expect(head_dim == NVFP4_HEAD_DIM,
               lambda: f"q: expected shape[2] == {NVFP4_HEAD_DIM} (head_dim of an NVFP4 kv_cache), got shape {tuple(q.shape)}")
    else:
        check_size("kv_cache", kv_cache, 3, 2 * head_dim, "2 * q.shape[2] (K and V halves of head_dim each)")
    expect(num_q_heads % num_kv_heads == 0,
           lambda: f"q: expected the number of query heads (q.shape[1] = {num_q_heads}) to be a multiple of the "
                   f"number of KV heads ({num_kv_heads}, from kv_cache.shape[1])")
    check_size("topk_pages", topk_pages, 0, num_tokens, "q.shape[0] (one row per query token)")
    check_size("topk_pages", topk_pages, 1, num_kv_heads, "the number of KV heads (one list per KV head)")
    check_size("kv_segment_lens", kv_segment_lens, 0, num_tokens, "q.shape[0]")
    check_size("qo_offset", qo_offset, 0, num_tokens, "q.shape[0]")
    check_positive("decode_query_len", decode_query_len, maximum=INT32_MAX)
    for name, value in (("softmax_scale", softmax_scale), ("q_scale", q_scale), ("k_scale", k_scale),
                        ("v_scale", v_scale)):
        check_scale(name, value)
    check_scale_tensor("k_scale_tensor", k_scale_tensor, device)
    check_scale_tensor("v_scale_tensor", v_scale_tensor, device)
    return num_tokens, num_q_heads, head_dim


def sparse_gqa_decode(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len,
                      softmax_scale, q_scale=1.0, k_scale=1.0, v_scale=1.0, k_scale_tensor=None, v_scale_tensor=None):
    shape = _check_sparse_gqa_decode(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset,
                                     decode_query_len, softmax_scale, q_scale, k_scale, v_scale, k_scale_tensor,
                                     v_scale_tensor)
    return q.new_empty(shape, dtype=output_dtype(q.dtype))


def sparse_gqa_decode_out(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len,
                          softmax_scale, q_scale=1.0, k_scale=1.0, v_scale=1.0, k_scale_tensor=None,
                          v_scale_tensor=None, *, out):
    num_tokens, num_q_heads, head_dim = _check_sparse_gqa_decode(
        q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len, softmax_scale,
        q_scale, k_scale, v_scale, k_scale_tensor, v_scale_tensor)
    check_tensor("out", out, dtypes=(output_dtype(q.dtype),), ndim=3, device=q.device)
    check_size("out", out, 0, num_tokens, "q.shape[0]")
    check_size("out", out, 1, num_q_heads, "q.shape[1]")
    check_size("out", out, 2, head_dim, "q.shape[2]")


# -- gqa_kv_cache_insert -------------------------------------------------------------------------------


def gqa_kv_cache_insert(k, v, slot_mapping, kv_cache, k_scale=1.0, v_scale=1.0, k_scale_tensor=None,
                        v_scale_tensor=None):
    check_tensor("k", k, dtypes=INSERT_DTYPES, ndim=3)
    device = k.device
    check_tensor("v", v, dtypes=INSERT_DTYPES, ndim=3, device=device)
    if v.dtype != k.dtype:
        raise ValueError(f"v: expected dtype {dtype_names((k.dtype,))} (the dtype of k), "
                         f"got {dtype_names((v.dtype,))}")
    check_tensor("slot_mapping", slot_mapping, dtypes=SLOT_DTYPES, ndim=1, device=device)
    num_kv_heads, head_dim = check_cache("kv_cache", kv_cache, device, written=True)
    check_size("k", k, 1, num_kv_heads, "the cache's number of KV heads")
    check_size("k", k, 2, head_dim, "the cache's head_dim")
    for dim, what in ((0, "k.shape[0]"), (1, "k.shape[1]"), (2, "k.shape[2]")):
        check_size("v", v, dim, k.shape[dim], what)
    check_size("slot_mapping", slot_mapping, 0, k.shape[0], "k.shape[0]")
    check_scale("k_scale", k_scale, nonzero=True)
    check_scale("v_scale", v_scale, nonzero=True)
    check_scale_tensor("k_scale_tensor", k_scale_tensor, device)
    check_scale_tensor("v_scale_tensor", v_scale_tensor, device)
