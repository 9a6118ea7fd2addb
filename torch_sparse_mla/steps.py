"""Engine-facing metadata builders: the per-step index tensors of a decode step, in persistent buffers.

An inference engine runs the same decode step over and over with different batches. To capture that
step once in a CUDA graph and replay it, every tensor the step writes must live at a fixed address
with fixed strides. The two builders below own those tensors: each allocates its output buffers once,
sized by the engine's capacities (``max_num_tokens`` / ``max_num_reqs`` and ``max_model_len``), and
fills them every step through the ``out`` overloads of the library's metadata operators. A step
captured at ``T`` tokens then replays correctly for any batch that fits in ``T`` rows (pad the rest
with padding tokens: slot ``-1``), and graphs captured at several sizes share the same buffers,
whose row strides never change.

- :class:`DeepSeekV4MetadataBuilder`: sliding-window indices, the compressed-cache slot mappings of
  the ratio-4 and ratio-128 layers, the C128A index lists, and (per C4A layer) the indexer's top-k
  mapped to global slots.
- :class:`MiniMaxM3MetadataBuilder`: per-row lengths and causal limits of a MiniMax-M3 sparse decode,
  and the slot each row's K/V is written to.

Both are ``torch.nn.Module``s whose buffers are not part of the state dict. Keep one as a submodule of
the model (under any name but ``meta``: an exported program cannot restore the buffers of a submodule
named so, docs/integration.md) or call it from a compiled function: under
``torch.compile(mode="reduce-overhead")`` module buffers have static addresses, so writing them does
not stop the CUDA graph. Everything they run is a registered operator of ``torch.ops.sparse_mla`` (no
host synchronisation, no value-dependent allocation), so a builder call can sit inside the captured
step or outside it. Capacities are checked on shapes only: a batch larger than the builder raises
``ValueError`` naming the limit. Values are not checked (that would need a host synchronisation):
positions must stay below ``max_model_len``. See docs/integration.md for the engine-side picture.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from . import metadata as md
from .ops._launch import cdiv

I32, I64 = torch.int32, torch.int64


def _check_capacity(name: str, size, capacity: int, what: str) -> None:
    """``size <= capacity``, or ``ValueError`` naming the limit.

    ``guard_or_false`` compares a plain or backed size as ``size > capacity`` does: for a symbolic size
    under ``torch.compile`` that guards the graph on ``size <= capacity``, so a larger batch compiles
    again and that trace raises this error (with ``fullgraph=True`` inside dynamo's own error, which
    quotes it). For an unbacked size (``torch._dynamo.decorators.mark_unbacked``) it answers False
    without a guard, which a plain comparison cannot do, and ``torch._check`` bounds the size in the
    graph instead (a larger batch then fails with the compiler's own error)."""
    if guard_or_false(size > capacity):
        raise ValueError(f"{name}: expected at most {capacity} ({what}, the capacity this builder was made with), "
                         f"got {size}; build it with a larger capacity")
    if torch.compiler.is_compiling():
        torch._check(size <= capacity)


def _row_view(buffer: torch.Tensor, rows) -> torch.Tensor:
    """The first ``rows`` rows of a 2-D buffer, flattened: the 1-D ``out`` view a builder hands an operator.

    A view with as many dimensions and the same strides as its buffer (``buffer[:rows]`` of a 1-D one)
    makes ``torch.compile`` compare its length with the buffer's when it functionalises the write
    (``auto_functionalize``'s ``try_use_slice`` in torch 2.11 to 2.15), which fails for an unbacked batch
    size (``torch._dynamo.decorators.mark_unbacked``); a flattened view of a 2-D buffer is described by
    its size, strides and offset instead, which hold for any size."""
    return buffer[:rows].view(-1)


def _check_positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return value


class DeepSeekV4Metadata(NamedTuple):
    """One DeepSeek-V4 decode step's metadata (views of the builder's buffers; ``T`` tokens).

    The index lists feed :func:`~torch_sparse_mla.sparse_mla_decode` directly: ``swa_indices`` /
    ``swa_lens`` as ``indices`` / ``topk_length`` (main cache: the layer's sliding-window cache), and
    for a compressed layer ``c128a_indices`` / ``c128a_lens`` (C128A) or the result of
    :meth:`DeepSeekV4MetadataBuilder.c4a_indices` (C4A) as ``extra_indices`` / ``extra_topk_length``.
    """

    token_to_req: torch.Tensor  #: int32 ``[T]``, the request of each token (the input)
    slot_mapping: torch.Tensor  #: int64 ``[T]``, sliding-window cache slot of each token (-1: padding)
    swa_indices: torch.Tensor  #: int32 ``[T, window]``, slots of the token's last ``window`` positions
    swa_lens: torch.Tensor  #: int32 ``[T]``, used entries of ``swa_indices`` (0 for padding)
    c4_slot_mapping: torch.Tensor  #: int64 ``[T]``, ratio-4 compressed entry closed by the token, or -1
    c128_slot_mapping: torch.Tensor  #: int64 ``[T]``, ratio-128 compressed entry closed by the token, or -1
    c128a_indices: torch.Tensor  #: int32 ``[T, max(max_model_len // 128, 1)]``, every completed ratio-128 entry
    c128a_lens: torch.Tensor  #: int32 ``[T]``, used entries of ``c128a_indices`` (0 for padding)
    c4_block_table: torch.Tensor  #: int32 ``[R, M4]``, the ratio-4 page table (the input)


class DeepSeekV4MetadataBuilder(torch.nn.Module):
    """Builds the metadata of a DeepSeek-V4 decode step into persistent buffers.

    DeepSeek-V4 layers attend to a sliding window of the last ``window`` tokens (every layer; a
    paged cache of ``swa_page_size`` tokens per page) plus, in compressed layers, to compressed
    entries: one per ``4`` tokens (C4A layers; the indexer picks ``index_topk`` of them) or one per
    ``128`` tokens (C128A layers; all completed ones). The compressed caches are paged with
    ``compressed_page_size`` tokens per page, i.e. ``compressed_page_size // ratio`` entries.

    Args:
        max_num_tokens: capacity in tokens (rows of every per-token buffer).
        max_model_len: longest sequence; sizes the C128A lists (``max_model_len // 128`` entries, at least
            one: below 128 tokens one column that stays ``-1``).
        window: sliding window (128 in DeepSeek-V4).
        swa_page_size: tokens per page of the sliding-window cache (64 in vLLM).
        compressed_page_size: tokens covered by one page of a compressed cache (a multiple of 128;
            256 in vLLM: 64 ratio-4 entries or 2 ratio-128 entries per page).
        index_topk: widest indexer top-k list :meth:`c4a_indices` accepts (512 for V4-Flash,
            1024 for V4-Pro).
        device: where the buffers live.

    Buffers (int32 unless stated; ``N = max_num_tokens``): ``swa_idx [N, window]``, ``swa_lens [N]``,
    int64 ``c4_slots [N, 1]`` and ``c128_slots [N, 1]``, ``c128a_idx [N, max(max_model_len // 128, 1)]``,
    ``c128a_lens [N]``, ``c4a_idx [N, index_topk]``, ``c4a_lens [N]``. The operators write whole
    buffers, except the compressed slots, which take the first ``T`` rows; those two are columns so
    that the written view (the first ``T`` rows, flattened) has fewer dimensions than its buffer
    (:func:`_row_view`).
    """

    def __init__(self, *, max_num_tokens: int, max_model_len: int, window: int = 128, swa_page_size: int = 64,
                 compressed_page_size: int = 256, index_topk: int = 512, device=None):
        super().__init__()
        self.max_num_tokens = _check_positive_int("max_num_tokens", max_num_tokens)
        self.max_model_len = _check_positive_int("max_model_len", max_model_len)
        self.window = _check_positive_int("window", window)
        self.swa_page_size = _check_positive_int("swa_page_size", swa_page_size)
        self.compressed_page_size = _check_positive_int("compressed_page_size", compressed_page_size)
        if compressed_page_size % 128:
            raise ValueError(f"compressed_page_size: expected a multiple of 128 (a page holds whole ratio-128 "
                             f"entries), got {compressed_page_size}")
        self.index_topk = _check_positive_int("index_topk", index_topk)
        self.c128a_width = max(max_model_len // 128, 1)
        n = max_num_tokens
        for name, shape, dtype in (
            ("swa_idx", (n, window), I32), ("swa_lens", (n,), I32),
            ("c4_slots", (n, 1), I64), ("c128_slots", (n, 1), I64),
            ("c128a_idx", (n, self.c128a_width), I32), ("c128a_lens", (n,), I32),
            ("c128a_prefill", (0, self.c128a_width), I32),  # decode-only builder: no prefill rows
            ("c4a_idx", (n, index_topk), I32), ("c4a_lens", (n,), I32),
        ):
            buf = torch.full(shape, -1, dtype=dtype, device=device)
            torch._dynamo.mark_static_address(buf)
            self.register_buffer(name, buf, persistent=False)

    def forward(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, positions: torch.Tensor,
                token_to_req: torch.Tensor, slot_mapping: torch.Tensor, swa_block_table: torch.Tensor,
                c4_block_table: torch.Tensor, c128_block_table: torch.Tensor) -> DeepSeekV4Metadata:
        """Fill the step's buffers; returns views of them, which the next call overwrites (to keep them,
        copy them outside a compiled function or into buffers of your own: docs/integration.md,
        "Keeping a builder's metadata").

        Args:
            query_start_loc: int32 ``[R + 1]``, cumulative query starts (decode tokens of each request;
                padded requests have zero tokens).
            seq_lens: int32 ``[R]``, context plus this step's tokens.
            positions: int64 ``[T]``, position of each token (``T <= max_num_tokens``).
            token_to_req: int32 ``[T]``, request of each token.
            slot_mapping: int64 ``[T]``, sliding-window cache slot of each token; ``-1`` marks a
                padding token (empty lists, nothing written). Padding tokens come after the last
                request's tokens: the compressed slots are computed from ``query_start_loc`` and
                ``seq_lens``, so a token with slot ``-1`` inside a request still gets them.
            swa_block_table: int32 ``[R, M]``, pages of the sliding-window cache.
            c4_block_table, c128_block_table: int32 ``[R, M4]`` / ``[R, M128]``, pages of the
                ratio-4 and ratio-128 compressed caches.

        Four operator calls (``swa_indices``, ``compressed_slot_mapping`` twice,
        ``c128a_topk_indices``), all ``out`` overloads; CUDA-graph safe.
        """
        num_tokens = positions.shape[0]
        _check_capacity("positions", num_tokens, self.max_num_tokens, "max_num_tokens")
        c4_page, c128_page = self.compressed_page_size // 4, self.compressed_page_size // 128
        swa_idx, swa_lens = md.swa_indices(positions, token_to_req, swa_block_table, slot_mapping, window=self.window,
                                           block_size=self.swa_page_size, out=(self.swa_idx, self.swa_lens))
        c4_slots = md.compressed_slot_mapping(query_start_loc, seq_lens, c4_block_table, block_size=c4_page,
                                              compress_ratio=4, out=_row_view(self.c4_slots, num_tokens))
        c128_slots = md.compressed_slot_mapping(query_start_loc, seq_lens, c128_block_table, block_size=c128_page,
                                                compress_ratio=128, out=_row_view(self.c128_slots, num_tokens))
        md.c128a_topk_indices(positions, token_to_req, c128_block_table, slot_mapping, num_decode_tokens=num_tokens,
                              compress_ratio=128, block_size=c128_page, width=self.c128a_width,
                              out=(self.c128a_idx, self.c128a_lens, self.c128a_prefill))
        return DeepSeekV4Metadata(
            token_to_req=token_to_req, slot_mapping=slot_mapping,
            swa_indices=swa_idx[:num_tokens], swa_lens=swa_lens[:num_tokens],
            c4_slot_mapping=c4_slots, c128_slot_mapping=c128_slots,
            c128a_indices=self.c128a_idx[:num_tokens], c128a_lens=self.c128a_lens[:num_tokens],
            c4_block_table=c4_block_table,
        )

    def c4a_indices(self, metadata: DeepSeekV4Metadata, local_indices: torch.Tensor):
        """One C4A layer's indexer top-k as global slots of its ratio-4 compressed cache.

        Args:
            metadata: this step's :meth:`forward` result.
            local_indices: int32 ``[T, K]`` (``K <= index_topk``), request-local compressed entry
                numbers chosen by the layer's indexer; ``-1`` empty.

        Returns:
            ``(indices int32 [T, K], lens int32 [T])``, views of the builder's ``c4a_idx`` /
            ``c4a_lens`` (row stride ``index_topk``). Every C4A layer reuses these buffers: consume
            the result (in ``sparse_mla_decode``) before the next layer's call.
        """
        if local_indices.dim() != 2:
            raise ValueError(f"local_indices: expected a 2-D tensor, got shape {tuple(local_indices.shape)}")
        num_tokens, k = local_indices.shape[0], local_indices.shape[1]
        _check_capacity("local_indices", num_tokens, self.max_num_tokens, "max_num_tokens")
        _check_capacity("local_indices.shape[1]", k, self.index_topk, "index_topk")
        indices, lens = md.compressed_topk_to_global(local_indices, metadata.token_to_req, metadata.c4_block_table,
                                                     metadata.slot_mapping, block_size=self.compressed_page_size // 4,
                                                     out=(self.c4a_idx, self.c4a_lens))
        return indices[:num_tokens, :k], lens[:num_tokens]


class MiniMaxM3Metadata(NamedTuple):
    """One MiniMax-M3 decode step's metadata (``B`` requests, ``q`` query tokens each, ``B * q`` rows).

    ``kv_segment_lens``, ``qo_offset`` and ``block_table`` feed
    :func:`~torch_sparse_mla.sparse_gqa_decode`; ``slot_mapping`` tells the cache writer where each
    row's K and V go (``page * page_size + offset``).
    """

    kv_segment_lens: torch.Tensor  #: int32 ``[B * q]``, the request's sequence length per row
    qo_offset: torch.Tensor  #: int32 ``[B * q]``, the row's position (the last key it may see)
    slot_mapping: torch.Tensor  #: int64 ``[B * q]``, cache slot of the row's token (-1: padding)
    block_table: torch.Tensor  #: int32 ``[B, W]``, the page table (the input)


class MiniMaxM3MetadataBuilder(torch.nn.Module):
    """Builds the metadata of a MiniMax-M3 sparse decode step into persistent buffers.

    Every request has ``decode_query_len`` query tokens (rows ``r * q .. r * q + q - 1``; more than
    one with speculative decoding). A padded request has ``seq_lens = 0``: its rows see no key and
    write nothing.

    Args:
        max_num_reqs: capacity in requests (``max_num_reqs * decode_query_len`` rows).
        max_model_len: longest sequence; block tables may have up to
            ``ceil(max_model_len / page_size)`` columns.
        page_size: tokens per page of the paged cache (128 in MiniMax-M3).
        decode_query_len: query tokens per request, ``q``.
        device: where the buffers live.

    Buffers: int32 ``kv_segment_lens [B, q]``, ``qo_offset [B, q]``, int64 ``slots [B, q]``
    (``B = max_num_reqs``; row ``r`` of the metadata is element ``[r // q, r % q]``, and the operators
    write the first ``batch`` rows as one flat view, :func:`_row_view`) and a constant int32
    ``query_start_loc [B + 1]`` (``r * q``).
    """

    def __init__(self, *, max_num_reqs: int, max_model_len: int, page_size: int = 128, decode_query_len: int = 1,
                 device=None):
        super().__init__()
        self.max_num_reqs = _check_positive_int("max_num_reqs", max_num_reqs)
        self.max_model_len = _check_positive_int("max_model_len", max_model_len)
        self.page_size = _check_positive_int("page_size", page_size)
        self.decode_query_len = q = _check_positive_int("decode_query_len", decode_query_len)
        self.max_pages = cdiv(max_model_len, page_size)
        for name, value in (
            ("kv_segment_lens", torch.zeros(max_num_reqs, q, dtype=I32, device=device)),
            ("qo_offset", torch.zeros(max_num_reqs, q, dtype=I32, device=device)),
            ("slots", torch.full((max_num_reqs, q), -1, dtype=I64, device=device)),
            ("query_start_loc", torch.arange(max_num_reqs + 1, dtype=I32, device=device) * q),
        ):
            torch._dynamo.mark_static_address(value)
            self.register_buffer(name, value, persistent=False)

    def forward(self, seq_lens: torch.Tensor, block_table: torch.Tensor) -> MiniMaxM3Metadata:
        """Fill the step's buffers; returns views of them, which the next call overwrites (to keep them,
        copy them outside a compiled function or into buffers of your own: docs/integration.md,
        "Keeping a builder's metadata").

        Args:
            seq_lens: int32 ``[B]`` (``B <= max_num_reqs``), context plus this step's ``q`` tokens;
                0 for a padded request.
            block_table: int32 ``[B, W]``, physical page of each request-local page (``-1`` empty).

        Two operator calls (``decode_runtime_metadata``, and ``compressed_slot_mapping`` with ratio
        1 for the write slots), both ``out`` overloads; CUDA-graph safe.
        """
        if block_table.dim() != 2:
            raise ValueError(f"block_table: expected a 2-D tensor, got shape {tuple(block_table.shape)}")
        batch = seq_lens.shape[0]
        _check_capacity("seq_lens", batch, self.max_num_reqs, "max_num_reqs")
        _check_capacity("block_table.shape[1]", block_table.shape[1], self.max_pages,
                        "ceil(max_model_len / page_size)")
        kv_segment_lens, qo_offset = md.decode_runtime_metadata(
            seq_lens, decode_query_len=self.decode_query_len,
            out=(_row_view(self.kv_segment_lens, batch), _row_view(self.qo_offset, batch)))
        # Ratio 1: every row "closes" the entry of its own position, which is its cache slot.
        slots = md.compressed_slot_mapping(self.query_start_loc[:batch + 1], seq_lens, block_table,
                                           block_size=self.page_size, compress_ratio=1,
                                           out=_row_view(self.slots, batch))
        return MiniMaxM3Metadata(kv_segment_lens=kv_segment_lens, qo_offset=qo_offset, slot_mapping=slots,
                                 block_table=block_table)


__all__ = ["DeepSeekV4Metadata", "DeepSeekV4MetadataBuilder", "MiniMaxM3Metadata", "MiniMaxM3MetadataBuilder"]
