"""Fakes of sparse_gqa_decode (SPEC section 7).

Each function validates its arguments from metadata only (dtypes, ranks, devices, shapes, the unit
last stride of the cache) and, for the functional overload, returns the empty output. The real
implementations call these first, so the CPU and CUDA kernels can rely on every check below.
"""

from __future__ import annotations

import torch

from ._common import (
    INDEX_DTYPES,
    check_positive,
    check_size,
    check_tensor,
    check_unit_stride,
    expect,
)

# Query and cache dtypes; either may be float8 independently of the other.
VALUE_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)


def output_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """``q.dtype``, or bfloat16 for a float8 query."""
    return torch.bfloat16 if q_dtype == torch.float8_e4m3fn else q_dtype


def _check_scale(name: str, value) -> None:
    if not isinstance(value, (float, int, torch.SymFloat, torch.SymInt)) or isinstance(value, bool):
        raise ValueError(f"{name}: expected a float, got {type(value).__name__}")


def _check_sparse_gqa_decode(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len,
                             softmax_scale, q_scale, k_scale, v_scale):
    """All checks shared by both overloads; returns the output shape ``(T, Hq, Dh)``."""
    check_tensor("q", q, dtypes=VALUE_DTYPES, ndim=3)
    device = q.device
    check_tensor("kv_cache", kv_cache, dtypes=VALUE_DTYPES, ndim=4, device=device)
    check_tensor("topk_pages", topk_pages, dtypes=INDEX_DTYPES, ndim=3, device=device)
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2, device=device)
    check_tensor("kv_segment_lens", kv_segment_lens, dtypes=INDEX_DTYPES, ndim=1, device=device)
    check_tensor("qo_offset", qo_offset, dtypes=INDEX_DTYPES, ndim=1, device=device)

    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[1]
    check_size("kv_cache", kv_cache, 3, 2 * head_dim, "2 * q.shape[2] (K and V halves of head_dim each)")
    check_unit_stride("kv_cache", kv_cache)
    expect(num_kv_heads >= 1,
           lambda: f"kv_cache: expected at least one KV head (shape[1] >= 1), got shape {tuple(kv_cache.shape)}")
    expect(num_q_heads % num_kv_heads == 0,
           lambda: f"q: expected the number of query heads (q.shape[1] = {num_q_heads}) to be a multiple of the "
                   f"number of KV heads (kv_cache.shape[1] = {num_kv_heads})")
    check_size("topk_pages", topk_pages, 0, num_tokens, "q.shape[0] (one row per query token)")
    check_size("topk_pages", topk_pages, 1, num_kv_heads, "kv_cache.shape[1] (one list per KV head)")
    check_size("kv_segment_lens", kv_segment_lens, 0, num_tokens, "q.shape[0]")
    check_size("qo_offset", qo_offset, 0, num_tokens, "q.shape[0]")
    check_positive("decode_query_len", decode_query_len)
    for name, value in (("softmax_scale", softmax_scale), ("q_scale", q_scale), ("k_scale", k_scale),
                        ("v_scale", v_scale)):
        _check_scale(name, value)
    return num_tokens, num_q_heads, head_dim


def sparse_gqa_decode(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len,
                      softmax_scale, q_scale=1.0, k_scale=1.0, v_scale=1.0):
    shape = _check_sparse_gqa_decode(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset,
                                     decode_query_len, softmax_scale, q_scale, k_scale, v_scale)
    return q.new_empty(shape, dtype=output_dtype(q.dtype))


def sparse_gqa_decode_out(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len,
                          softmax_scale, q_scale=1.0, k_scale=1.0, v_scale=1.0, *, out):
    num_tokens, num_q_heads, head_dim = _check_sparse_gqa_decode(
        q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len, softmax_scale,
        q_scale, k_scale, v_scale)
    check_tensor("out", out, dtypes=(output_dtype(q.dtype),), ndim=3, device=q.device)
    check_size("out", out, 0, num_tokens, "q.shape[0]")
    check_size("out", out, 1, num_q_heads, "q.shape[1]")
    check_size("out", out, 2, head_dim, "q.shape[2]")
