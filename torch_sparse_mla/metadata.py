"""Metadata operators of a sparse-attention decode step (contract: docs/operators.md, "Metadata operators").

Each function calls the registered operator ``torch.ops.sparse_mla.<name>``: the functional overload
by default, the ``.out`` overload when output buffers are given (the form to use inside a captured
CUDA graph, where addresses must stay fixed). A plain eager call skips the dispatcher and runs the
same checks and kernels directly (``torch_sparse_mla._library.call``, docs/integration.md). All of them are CUDA-graph safe: the CUDA kernels never
synchronise, never read a value on the host and allocate nothing whose size depends on values.
"""

from __future__ import annotations

import torch

from torch_sparse_mla._library import call, unpack_out



def compressed_slot_mapping(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    compress_ratio: int,
    num_tokens: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slot of each token's compressed KV entry (DeepSeek-V4 compressed layers).

    Token ``i`` of request ``r`` (output index ``query_start_loc[r] + i``) sits at position
    ``p = seq_lens[r] - L_r + i``. When ``p >= 0`` and ``(p + 1) % compress_ratio == 0`` it closes
    compressed entry ``c = p // compress_ratio``, whose slot is
    ``block_table[r, c // block_size] * block_size + c % block_size``. Every other element is -1,
    and so is a slot whose block-table column is out of range or whose block id is negative.

    Args:
        query_start_loc: int32 ``[R + 1]``, cumulative query starts (non-decreasing).
        seq_lens: int32 ``[R]``, context plus this step's queries.
        block_table: int32 ``[R, M]``, pages of the compressed cache.
        block_size: compressed entries per page (uncompressed page size / ``compress_ratio``).
        compress_ratio: tokens per compressed entry (4 or 128 in DeepSeek-V4).
        num_tokens: length of the functional output (default: ``query_start_loc[-1]`` is *not* read;
            pass it, or ``out``). Required unless ``out`` is given.
        out: optional int64 ``[N]`` buffer; every element is written.

    Returns:
        int64 ``[num_tokens]`` (or ``out``).
    """
    if out is not None:
        (out,) = unpack_out("compressed_slot_mapping", out)
        call("compressed_slot_mapping.out", query_start_loc, seq_lens, block_table, block_size, compress_ratio,
                                         out=out)
        return out
    if num_tokens is None:
        raise ValueError("num_tokens: required when no `out` buffer is given (the host never reads "
                         "query_start_loc[-1]); pass the number of tokens in the batch")
    return call("compressed_slot_mapping", query_start_loc, seq_lens, block_table, num_tokens, block_size,
                                       compress_ratio)


def c128a_topk_indices(
    positions: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_decode_tokens: int,
    compress_ratio: int,
    block_size: int,
    width: int,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index lists of DeepSeek-V4 C128A layers: every completed compressed entry of the request.

    For token ``t``: ``n = clamp((positions[t] + 1) // compress_ratio, 0, width)``.
    Decode tokens (``t < num_decode_tokens``): ``decode_indices[t, o]`` is the global slot of
    compressed entry ``o`` (through ``block_table[token_to_req[t]]``, pages of ``block_size``) for
    ``o < n``, else -1; ``decode_lens[t] = n``, or 0 for a padding token (``slot_mapping[t] < 0``).
    Prefill tokens: ``prefill_indices[t - D, o] = o`` for ``o < n``, else -1 (request-local).

    Args:
        positions: int64 ``[T]``; token_to_req: int32 ``[T]``; block_table: int32 ``[R, M]``
            (compressed pages); slot_mapping: int64 ``[T]`` (the uncompressed slot mapping; < 0 is
            padding). Decode tokens come first.
        out: optional ``(decode_indices [>=D, C], decode_lens [>=D], prefill_indices [>=P, C])``
            int32 buffers with ``C >= width``; only rows ``< D`` / ``< P`` and columns ``< width``
            are written, so a graph captured at one width replays at another.

    Returns:
        ``(decode_indices [D, width], decode_lens [D], prefill_indices [P, width])``, int32.
    """
    if out is not None:
        decode_indices, decode_lens, prefill_indices = unpack_out("c128a_topk_indices", out)
        call("c128a_topk_indices.out", positions, token_to_req, block_table, slot_mapping, num_decode_tokens,
                                    compress_ratio, block_size, width, decode_indices=decode_indices,
                                    decode_lens=decode_lens, prefill_indices=prefill_indices)
        return decode_indices, decode_lens, prefill_indices
    return call("c128a_topk_indices", positions, token_to_req, block_table, slot_mapping, num_decode_tokens,
                                   compress_ratio, block_size, width)


def decode_runtime_metadata(
    seq_lens: torch.Tensor,
    *,
    decode_query_len: int = 1,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row lengths of a decode step with ``q = decode_query_len`` query tokens per request.

    Row ``r`` is query token ``r % q`` of request ``r // q``:
    ``kv_segment_lens[r] = seq_lens[r // q]`` and ``qo_offset[r] = seq_lens[r // q] - q + r % q``
    (the absolute position of the row's query token, the last key position it may see).

    Args:
        seq_lens: int32 ``[B]``.
        decode_query_len: ``q >= 1``.
        out: optional ``(kv_segment_lens, qo_offset)``, int32 ``[B * q]`` each.

    Returns:
        ``(kv_segment_lens, qo_offset)``, int32 ``[B * q]``.
    """
    if out is not None:
        kv_segment_lens, qo_offset = unpack_out("decode_runtime_metadata", out)
        call("decode_runtime_metadata.out", seq_lens, decode_query_len, kv_segment_lens=kv_segment_lens,
                                         qo_offset=qo_offset)
        return kv_segment_lens, qo_offset
    return call("decode_runtime_metadata", seq_lens, decode_query_len)


def swa_indices(
    positions: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    window: int,
    block_size: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sliding-window index lists (DeepSeek-V4): the last ``window`` positions of each token.

    For token ``t`` at position ``p``: ``start = max(p - window + 1, 0)``,
    ``n = max(p + 1 - start, 0)``; ``indices[t, o]`` is the slot of position ``start + o`` through
    ``block_table[token_to_req[t]]`` (pages of ``block_size``) for ``o < n``, -1 after (and -1 where
    the page is missing); ``lens[t] = n``, or 0 for a padding token (``slot_mapping[t] < 0``).

    Args:
        positions: int64 ``[T]``; token_to_req: int32 ``[T]``; block_table: int32 ``[R, M]``;
            slot_mapping: int64 ``[T]``.
        out: optional ``(indices [>=T, C >= window], lens [>=T])`` int32 buffers; rows ``< T`` and
            columns ``< window`` are written.

    Returns:
        ``(indices [T, window], lens [T])``, int32.
    """
    if out is not None:
        indices, lens = unpack_out("swa_indices", out)
        call("swa_indices.out", positions, token_to_req, block_table, slot_mapping, window, block_size,
                             indices=indices, lens=lens)
        return indices, lens
    return call("swa_indices", positions, token_to_req, block_table, slot_mapping, window, block_size)


def compressed_topk_to_global(
    local_indices: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    block_size: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map an indexer's request-local top-k compressed entries to global cache slots (DeepSeek-V4 C4A
    layers; with ``block_size`` = the page size, DeepSeek-V3.2's request-local token numbers).

    ``indices[t, j]`` is the slot of entry ``local_indices[t, j]`` through
    ``block_table[token_to_req[t]]`` (pages of ``block_size``), or -1 for an empty entry, a negative
    block id or a column past the table; ``lens[t]`` is 1 + the last ``j`` whose output is not -1
    (0 if none), or 0 for a padding token (``slot_mapping[t] < 0``).

    Args:
        local_indices: int32 ``[T, K]`` (-1 empty); token_to_req: int32 ``[T]``;
            block_table: int32 ``[R, M]``; slot_mapping: int64 ``[T]``.
        out: optional ``(indices [>=T, C >= K], lens [>=T])`` int32 buffers.

    Returns:
        ``(indices [T, K], lens [T])``, int32.
    """
    if out is not None:
        indices, lens = unpack_out("compressed_topk_to_global", out)
        call("compressed_topk_to_global.out", local_indices, token_to_req, block_table, slot_mapping, block_size,
                                           indices=indices, lens=lens)
        return indices, lens
    return call("compressed_topk_to_global", local_indices, token_to_req, block_table, slot_mapping, block_size)
