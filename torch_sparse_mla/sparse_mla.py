"""Sparse MLA decode attention (contract: docs/operators.md#sparse_mla_decode): DeepSeek-V3.2 / V4 style, one
latent KV head."""

from __future__ import annotations

import torch

from torch_sparse_mla._library import call, unpack_out



def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    softmax_scale: float,
    kv_format: str = "auto",
    head_dim_v: int = 512,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each decode token over its own list of cache slots, with all heads.

    For token ``t`` and head ``h``, with ``k_s`` the dequantised vector of slot ``s`` and
    ``v_s = k_s[:head_dim_v]``, over the candidate set ``C_t``::

        score_s  = softmax_scale * <q[t, h], k_s>
        lse[t,h] = log(sum_{s in C_t} exp(score_s))                       (natural log, no sink)
        out[t,h] = sum_{s in C_t} exp(score_s - lse[t,h]) * v_s / (1 + exp(attn_sink[h] - lse[t,h]))

    ``C_t`` holds the entries ``indices[t, :clamp(topk_length[t], 0, K)]`` that are valid slots of
    ``kv_cache`` (``0 <= s < pages * page_size``), plus the same for the extra list in the extra cache;
    duplicates count as separate candidates. Other entries (``-1``, negative, past the end) are empty
    and never read. A token with no candidate gets ``out = 0`` and ``lse = +inf``.

    Args:
        q: ``[T, H, D]`` bf16 or fp16, ``1 <= H <= 128``, any strides. ``D`` is the cache's dimension:
            576 for ``fp8_656``, 512 for ``fp8_584``, ``kv_cache.shape[-1]`` for ``auto``.
        kv_cache: paged cache ``[pages, page_size, *]`` in ``kv_format`` (docs/formats.md): ``auto`` is
            a tensor of ``q.dtype`` with ``D`` values per slot; ``fp8_656`` / ``fp8_584`` are uint8
            with 656 / 584 bytes per slot. The page stride may be padded.
        indices: int32 ``[T, K]``, ``K >= 1``: slots (``page * page_size + offset``), -1 for empty.
        softmax_scale: multiplies ``<q, k>``.
        kv_format: ``"auto"``, ``"fp8_656"`` or ``"fp8_584"``.
        head_dim_v: ``1 <= head_dim_v <= D``; V is the first ``head_dim_v`` values of each K.
        topk_length: optional int32 ``[T]``: only the first ``topk_length[t]`` entries of row ``t``
            are used (clamped to ``[0, K]``).
        attn_sink: optional float32 ``[H]``; ``-inf`` changes nothing, ``+inf`` gives zeros.
        extra_kv_cache, extra_indices, extra_topk_length: a second cache in the same format, its int32
            ``[T, K2]`` lists and optional int32 ``[T]`` lengths, merged into the same softmax
            (DeepSeek-V4: sliding window in the main cache, compressed entries in the extra one).
        out: optional ``(out, lse)`` buffers, ``[T, H, head_dim_v]`` of ``q.dtype`` (any strides) and
            float32 ``[T, H]``; both are written in full and returned.

    Returns:
        ``(out, lse)``: ``[T, H, head_dim_v]`` in ``q.dtype`` and float32 ``[T, H]``.

    Nothing but ``out`` / ``lse`` is written. CUDA-graph safe: the CUDA kernels never synchronise,
    never read a tensor value on the host and allocate only a split-K workspace whose size depends on
    shapes alone; use the ``out`` buffers for fixed addresses.
    """
    if out is not None:
        o, lse = unpack_out("sparse_mla_decode", out)
        call("sparse_mla_decode.out", q, kv_cache, indices, softmax_scale, kv_format, head_dim_v, topk_length,
                                   attn_sink, extra_kv_cache, extra_indices, extra_topk_length, out=o, lse=lse)
        return o, lse
    return call("sparse_mla_decode", q, kv_cache, indices, softmax_scale, kv_format, head_dim_v, topk_length,
                                  attn_sink, extra_kv_cache, extra_indices, extra_topk_length)
