"""Sparse grouped-query decode over selected pages (MiniMax-M3 MSA) and the writer of its paged cache.

Two cache formats (byte layouts in ``docs/sparse_gqa.md``;
contract: ``docs/operators.md``), told apart by dtype:

- a value cache ``[pages, Hkv, page_size, 2 * Dh]`` of bfloat16, float16 or float8_e4m3fn, K in
  ``[..., :Dh]`` and V in ``[..., Dh:]`` (any strides with ``stride(-1) == 1``);
- an NVFP4 cache, uint8 ``[pages, 2 * Hkv, page_size, 72]`` with ``Dh = 128``: 4-bit E2M1 values with
  one e4m3 scale per 16 values; slot ``2g`` of a page is KV head ``g``'s K, slot ``2g + 1`` its V.
"""

from __future__ import annotations

import torch

from torch_sparse_mla._library import call, unpack_out



def sparse_gqa_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_pages: torch.Tensor,
    block_table: torch.Tensor,
    kv_segment_lens: torch.Tensor,
    qo_offset: torch.Tensor,
    *,
    softmax_scale: float,
    decode_query_len: int = 1,
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    k_scale_tensor: torch.Tensor | None = None,
    v_scale_tensor: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query attention of each decode row over the pages it selected, per KV head.

    Row ``t`` belongs to request ``r = t // decode_query_len``. For KV head ``g`` its keys are the
    positions ``x = b * page_size + o`` of every selected page ``b = topk_pages[t, g, j]`` that is
    valid (``0 <= b < W``, ``r < B``, physical page ``p = block_table[r, b]`` with
    ``0 <= p < pages``), ``0 <= o < page_size``, ``x <= qo_offset[t]`` and ``x < kv_segment_lens[t]``.
    Query head ``h`` uses KV head ``g = h // (Hq / Hkv)`` and gets::

        k, v      = the stored K and V values of key (p, g, o) as float32 (NVFP4: e2m1 * e4m3 scale)
        score     = softmax_scale * q_scale * k_scale * k_scale_tensor[0] * <q[t, h], k>
        out[t, h] = v_scale * v_scale_tensor[0] * sum over keys of softmax(score) * v

    (the tensor factors when given). A row without any key gets zeros; no output is NaN for finite
    inputs (scores beyond the float32 range saturate). An invalid index of any value (``-1``, past the
    table, a negative block id, a row past the block table) is skipped and never read; keys past a
    row's limit are not read either. Selected pages are assumed distinct (a repeated page counts twice).

    Args:
        q: ``[T, Hq, Dh]`` bfloat16, float16 or float8_e4m3fn (then scaled by ``q_scale``), any strides.
        kv_cache: a value cache ``[pages, Hkv, page_size, 2 * Dh]`` (bfloat16, float16 or
            float8_e4m3fn, any strides with ``stride(-1) == 1``), or an NVFP4 cache, uint8
            ``[pages, 2 * Hkv, page_size, 72]`` with ``Dh = 128`` and strides
            ``(>= 2 * Hkv * page_size * 72, page_size * 72, 72, 1)``. ``Hq`` must be a multiple of ``Hkv``.
        topk_pages: int32 ``[T, Hkv, n_sel]``, request-local page numbers per row and KV head (-1 empty).
        block_table: int32 ``[B, W]``, physical page of each request-local page (-1 empty).
        kv_segment_lens: int32 ``[T]``, the request's sequence length per row.
        qo_offset: int32 ``[T]``, the row's query position (the last key position it may see);
            ``decode_runtime_metadata`` makes both from ``seq_lens``.
        softmax_scale: the score scale (usually ``Dh ** -0.5``), required.
        decode_query_len: query tokens per request (rows of one request are consecutive).
        q_scale, k_scale, v_scale: per-tensor dequantisation scales of q, K and V (finite floats; None
            means 1.0: a float default would be a symbolic input under ``torch.compile(dynamic=True)``
            and make Dynamo trace the calling frame twice).
        k_scale_tensor, v_scale_tensor: optional float32 tensors of one element on ``q``'s device that
            multiply ``k_scale`` / ``v_scale``; read on the device only, so a captured CUDA graph picks
            up new values at every replay.
        out: optional ``[T, Hq, Dh]`` buffer (any strides) of the output dtype; it is written entirely
            and returned, through the ``.out`` overload (fixed addresses for CUDA graphs).

    Returns:
        ``[T, Hq, Dh]`` in ``q.dtype`` (bfloat16 for a float8 ``q``), or ``out``.

    CUDA-graph safe: the CUDA kernels never synchronise or read a value on the host; the only
    allocation (a float32 workspace when the page lists are split across programs) depends on shapes.
    """
    q_scale = 1.0 if q_scale is None else q_scale
    k_scale = 1.0 if k_scale is None else k_scale
    v_scale = 1.0 if v_scale is None else v_scale
    if out is not None:
        (out,) = unpack_out("sparse_gqa_decode", out)
        call("sparse_gqa_decode.out", q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset,
                                   decode_query_len, softmax_scale, q_scale, k_scale, v_scale, k_scale_tensor,
                                   v_scale_tensor, out=out)
        return out
    return call("sparse_gqa_decode", q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset,
                                  decode_query_len, softmax_scale, q_scale, k_scale, v_scale, k_scale_tensor,
                                  v_scale_tensor)


def gqa_kv_cache_insert(
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
    k_scale_tensor: torch.Tensor | None = None,
    v_scale_tensor: torch.Tensor | None = None,
) -> None:
    """Quantise this step's ``k[i]``, ``v[i]`` and write them to slot ``slot_mapping[i]`` of
    ``kv_cache``, in place (the cache ``sparse_gqa_decode`` reads).

    Token ``i`` goes to page ``slot // page_size``, offset ``slot % page_size``. With ``s`` the total
    scale of K (``fl32(k_scale) * k_scale_tensor[0]`` when the tensor is given, else ``fl32(k_scale)``;
    V likewise), all in float32 with IEEE division:

    - bfloat16 / float16 cache: the values rounded to the cache dtype (scales ignored);
    - float8_e4m3fn cache: ``e4m3(clamp(x / s, -448, 448))``;
    - NVFP4 cache: per 16 values ``scale = e4m3(min(amax / (6 * s), 448))`` (stored), and each value's
      4-bit code is the E2M1 value nearest to ``x / (scale * s)`` (ties to the even code, magnitudes
      above 6 clamp to 6, the sign from ``x``'s sign bit); every code is 0 when the rounded scale is 0
      (or NaN).

    Every rounding is to nearest, ties to even. A NaN input is stored as the format's NaN (NVFP4: its
    group's scale byte is NaN). A slot that is negative or ``>= pages * page_size`` is skipped; only the
    written tokens' bytes change (their data and their own scale bytes). If two entries name the same
    slot, which one is kept is unspecified.

    Args:
        k, v: ``[N, Hkv, Dh]`` bfloat16, float16 or float32 (the same dtype; any strides).
        slot_mapping: int64 ``[N]``.
        kv_cache: a cache in a format ``sparse_gqa_decode`` reads; **written** (only the named slots).
        k_scale, v_scale: finite, nonzero float scales (float8 and NVFP4 caches); None means 1.0.
        k_scale_tensor, v_scale_tensor: optional float32 tensors of one element on ``k``'s device that
            multiply ``k_scale`` / ``v_scale``, read on the device only.

    CUDA-graph safe; works under ``torch.compile(fullgraph=True)`` (a mutating custom op).
    """
    k_scale = 1.0 if k_scale is None else k_scale
    v_scale = 1.0 if v_scale is None else v_scale
    call("gqa_kv_cache_insert", k, v, slot_mapping, kv_cache, k_scale, v_scale, k_scale_tensor, v_scale_tensor)
