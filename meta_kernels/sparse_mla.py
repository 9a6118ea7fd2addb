"""Fakes of ``sparse_mla_decode`` (SPEC section 6): argument checks from metadata, output allocation.

The real implementations call these first, so the checks below are exactly what the CPU and CUDA
kernels can rely on: dtypes, ranks, devices, shapes and the cache layout (``check_kv_cache``).
Index values are never read here; the kernels treat every out-of-range entry as empty.
"""

from __future__ import annotations

import math

import torch

from ._common import (
    INDEX_DTYPES,
    check_positive,
    check_size,
    check_tensor,
    expect,
)
from ._formats import cache_dim, check_format, check_kv_cache

Q_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEADS = 128
# The CUDA kernel holds a [heads, D] Q tile and a [keys, D] K tile in shared memory; the launcher
# shrinks both down to 16 x 16 for large D, which fits D <= 2048 in the 227 KB of an sm_90 block.
MAX_CUDA_DIM = 2048


def _check_list(name_cache, cache, name_idx, indices, name_len, lengths, kv_format, q, num_tokens, dim):
    device = q.device
    check_kv_cache(name_cache, cache, kv_format, device=device,
                   dtype=q.dtype if kv_format == "auto" else None)
    cache_d = cache_dim(cache, kv_format)
    if name_cache == "kv_cache":  # q's last dimension follows the main cache
        expect(dim == cache_d, lambda: f"q: expected shape[2] == {cache_d} (values per slot of the {kv_format} "
                                       f"kv_cache), got shape {tuple(q.shape)}")
    else:
        expect(cache_d == dim, lambda: f"{name_cache}: expected {dim} values per slot (q.shape[2]), "
                                       f"got shape {tuple(cache.shape)}")
    check_tensor(name_idx, indices, dtypes=INDEX_DTYPES, ndim=2, device=device)
    check_size(name_idx, indices, 0, num_tokens, "q.shape[0]")
    expect(indices.shape[1] >= 1,
           lambda: f"{name_idx}: expected at least one column (shape[1] >= 1), got shape {tuple(indices.shape)}")
    if lengths is not None:
        check_tensor(name_len, lengths, dtypes=INDEX_DTYPES, ndim=1, device=device)
        check_size(name_len, lengths, 0, num_tokens, "q.shape[0]")


def _check(q, kv_cache, indices, softmax_scale, kv_format, head_dim_v, topk_length, attn_sink,
           extra_kv_cache, extra_indices, extra_topk_length):
    """Validates every argument; returns ``(T, H, head_dim_v)``."""
    check_tensor("q", q, dtypes=Q_DTYPES, ndim=3)
    check_format(kv_format)
    num_tokens, num_heads, dim = q.shape
    expect((num_heads >= 1) & (num_heads <= MAX_HEADS),
           lambda: f"q: expected 1 <= shape[1] (heads) <= {MAX_HEADS}, got shape {tuple(q.shape)}")
    if not isinstance(softmax_scale, (float, int, torch.SymFloat)) or isinstance(softmax_scale, bool):
        raise ValueError(f"softmax_scale: expected a float, got {type(softmax_scale).__name__}")
    if isinstance(softmax_scale, (float, int)) and not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale: expected a finite float, got {softmax_scale}")
    if q.device.type == "cuda":
        expect(dim <= MAX_CUDA_DIM,
               lambda: f"q: expected shape[2] (D) <= {MAX_CUDA_DIM} on CUDA (the kernel's Q and K tiles must fit "
                       f"the shared memory of one block), got shape {tuple(q.shape)}")
    check_positive("head_dim_v", head_dim_v)
    expect(head_dim_v <= dim, lambda: f"head_dim_v: expected <= q.shape[2] ({dim}), got {head_dim_v}")
    _check_list("kv_cache", kv_cache, "indices", indices, "topk_length", topk_length, kv_format, q,
                num_tokens, dim)
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dtypes=(torch.float32,), ndim=1, device=q.device)
        check_size("attn_sink", attn_sink, 0, num_heads, "q.shape[1]")
    if (extra_kv_cache is None) != (extra_indices is None):
        raise ValueError("extra_kv_cache / extra_indices: expected both or neither, got only "
                         + ("extra_kv_cache" if extra_indices is None else "extra_indices"))
    if extra_kv_cache is not None:
        _check_list("extra_kv_cache", extra_kv_cache, "extra_indices", extra_indices, "extra_topk_length",
                    extra_topk_length, kv_format, q, num_tokens, dim)
    elif extra_topk_length is not None:
        raise ValueError("extra_topk_length: given without extra_kv_cache / extra_indices")
    return num_tokens, num_heads, head_dim_v


def sparse_mla_decode(q, kv_cache, indices, softmax_scale, kv_format="auto", head_dim_v=512, topk_length=None,
                      attn_sink=None, extra_kv_cache=None, extra_indices=None, extra_topk_length=None):
    num_tokens, num_heads, dv = _check(q, kv_cache, indices, softmax_scale, kv_format, head_dim_v, topk_length,
                                       attn_sink, extra_kv_cache, extra_indices, extra_topk_length)
    out = q.new_empty((num_tokens, num_heads, dv))
    lse = q.new_empty((num_tokens, num_heads), dtype=torch.float32)
    return out, lse


def sparse_mla_decode_out(q, kv_cache, indices, softmax_scale, kv_format="auto", head_dim_v=512, topk_length=None,
                          attn_sink=None, extra_kv_cache=None, extra_indices=None, extra_topk_length=None, *, out,
                          lse):
    num_tokens, num_heads, dv = _check(q, kv_cache, indices, softmax_scale, kv_format, head_dim_v, topk_length,
                                       attn_sink, extra_kv_cache, extra_indices, extra_topk_length)
    check_tensor("out", out, dtypes=(q.dtype,), ndim=3, device=q.device)
    check_tensor("lse", lse, dtypes=(torch.float32,), ndim=2, device=q.device)
    for d, (size, what) in enumerate(((num_tokens, "q.shape[0]"), (num_heads, "q.shape[1]"), (dv, "head_dim_v"))):
        check_size("out", out, d, size, what)
    check_size("lse", lse, 0, num_tokens, "q.shape[0]")
    check_size("lse", lse, 1, num_heads, "q.shape[1]")
