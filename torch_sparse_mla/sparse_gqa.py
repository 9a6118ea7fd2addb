"""Sparse grouped-query decode over selected pages (MiniMax-M3; contract: docs/operators.md#sparse_gqa_decode)."""

from __future__ import annotations

import torch

from torch_sparse_mla._library import unpack_out

_ops = torch.ops.sparse_mla


def sparse_gqa_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_pages: torch.Tensor,
    block_table: torch.Tensor,
    kv_segment_lens: torch.Tensor,
    qo_offset: torch.Tensor,
    *,
    decode_query_len: int = 1,
    softmax_scale: float | None = None,
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query attention of each decode row over the pages it selected, per KV head.

    Row ``t`` belongs to request ``r = t // decode_query_len``. For KV head ``g`` its keys are the
    positions ``x = b * page_size + o`` of every selected page ``b = topk_pages[t, g, j]`` that is
    valid (``0 <= b < W``, ``r < B``, physical page ``p = block_table[r, b]`` with
    ``0 <= p < kv_cache.shape[0]``), ``0 <= o < page_size``, ``x <= qo_offset[t]`` and
    ``x < kv_segment_lens[t]``; ``k = kv_cache[p, g, o, :Dh]``, ``v = kv_cache[p, g, o, Dh:]``.
    Query head ``h`` uses KV head ``g = h // (Hq / Hkv)`` and gets::

        score = softmax_scale * q_scale * k_scale * <q[t, h], k>      (values converted to float32)
        out[t, h] = v_scale * sum over keys of softmax(score) * v

    A row without any key gets zeros (never NaN). An invalid index of any value (``-1``, past the
    table, a negative block id, a row past the block table) is skipped and never read; keys past a
    row's limit are not read either. Selected pages are assumed distinct (a repeated page counts twice).

    Args:
        q: ``[T, Hq, Dh]`` bfloat16, float16 or float8_e4m3fn (then scaled by ``q_scale``), any strides.
        kv_cache: ``[pages, Hkv, page_size, 2 * Dh]`` bfloat16, float16 or float8_e4m3fn, any strides
            with ``stride(-1) == 1`` (NHD or HND physical order); K is ``[..., :Dh]``, V ``[..., Dh:]``.
            ``Hq`` must be a multiple of ``Hkv``.
        topk_pages: int32 ``[T, Hkv, n_sel]``, request-local page numbers per row and KV head (-1 empty).
        block_table: int32 ``[B, W]``, physical page of each request-local page (-1 empty).
        kv_segment_lens: int32 ``[T]``, the request's sequence length per row.
        qo_offset: int32 ``[T]``, the row's query position (the last key position it may see);
            ``decode_runtime_metadata`` makes both from ``seq_lens``.
        decode_query_len: query tokens per request (rows of one request are consecutive).
        softmax_scale: default ``Dh ** -0.5``.
        q_scale, k_scale, v_scale: dequantisation scales (per tensor) of q, K and V; default 1.0.
        out: optional ``[T, Hq, Dh]`` buffer (any strides) of the output dtype; it is written entirely
            and returned, through the ``.out`` overload (fixed addresses for CUDA graphs).

    Returns:
        ``[T, Hq, Dh]`` in ``q.dtype`` (bfloat16 for a float8 ``q``), or ``out``.

    CUDA-graph safe: the CUDA kernels never synchronise or read a value on the host; the only
    allocation (a float32 workspace when the page lists are split across programs) depends on shapes.
    """
    # None defaults rather than float ones: under torch.compile(dynamic=True) a float default is read
    # as a symbolic input and specialising it makes Dynamo trace the frame twice.
    if softmax_scale is None:
        softmax_scale = float(q.shape[-1]) ** -0.5
    q_scale = 1.0 if q_scale is None else q_scale
    k_scale = 1.0 if k_scale is None else k_scale
    v_scale = 1.0 if v_scale is None else v_scale
    if out is not None:
        (out,) = unpack_out("sparse_gqa_decode", out)
        _ops.sparse_gqa_decode.out(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset,
                                   decode_query_len, softmax_scale, q_scale, k_scale, v_scale, out=out)
        return out
    return _ops.sparse_gqa_decode(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset,
                                  decode_query_len, softmax_scale, q_scale, k_scale, v_scale)
