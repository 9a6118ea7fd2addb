"""Host-side facts about the KV cache formats and the metadata-only layout checks of a cache tensor.

Shared by the fakes of every operator that takes a sparse MLA cache (``kv_cache_insert``,
``kv_cache_gather``, ``sparse_mla_decode``) and by the kernels in ``ops/`` (which import from here,
never the other way round). Byte layouts: ``docs/formats.md``.
"""

from __future__ import annotations

import torch

from ._common import check_tensor, expect

FORMAT_IDS = {"auto": 0, "fp8_656": 1, "fp8_584": 2}  # value of the KV_FORMAT constexpr
_FP8_DIM = {"fp8_656": 576, "fp8_584": 512}
_TOKEN_BYTES = {"fp8_656": 656, "fp8_584": 584}
AUTO_DTYPES = (torch.bfloat16, torch.float16)


def check_format(kv_format) -> int:
    """The ``KV_FORMAT`` id of a format name; ``ValueError`` for anything else."""
    if kv_format not in FORMAT_IDS:
        raise ValueError(f"kv_format: expected one of {', '.join(map(repr, FORMAT_IDS))}, got {kv_format!r}")
    return FORMAT_IDS[kv_format]


def cache_dim(kv_cache: torch.Tensor, kv_format: str):
    """``D``, the number of dequantised values per slot (``shape[-1]`` for ``auto``)."""
    return kv_cache.shape[-1] if kv_format == "auto" else _FP8_DIM[kv_format]


def bytes_per_token(kv_cache: torch.Tensor, kv_format: str):
    """Bytes of one slot (data and scales), as counted by the SPEC's table."""
    if kv_format == "auto":
        return kv_cache.shape[-1] * kv_cache.element_size()
    return _TOKEN_BYTES[kv_format]


def check_kv_cache(name: str, kv_cache, kv_format: str, *, device=None, dtype=None) -> None:
    """Layout checks of a paged cache, from metadata only.

    ``auto``: a 3-D tensor of ``dtype`` (bf16/fp16 when not given); fp8 formats: uint8
    ``[pages, page_size, 656 | 584]``. Every format: ``stride(-1) == 1``; ``fp8_656``: ``stride(1) ==
    656``; ``auto``: ``stride(1) >= D``; pages must not overlap (``stride(0) >= page_size * D`` for
    ``auto``, ``page_size * 656 | 584`` bytes otherwise, when there is more than one page).

    Then the bounds proof: every element a kernel may touch lies inside the view. The kernels touch,
    in page ``p``, the elements ``[p * stride(0), p * stride(0) + span)`` with ``span`` =
    ``(page_size - 1) * stride(1) + D`` (``auto``), ``page_size * 656`` (``fp8_656``) or
    ``page_size * 584`` (``fp8_584``: data rows then scale rows, whatever ``stride(1)`` says). The view
    reaches ``(page_size - 1) * stride(1) + W`` elements past the start of its last page (``W`` =
    ``shape[-1]``, unit last stride), and torch keeps a view inside its storage; so the layout is inside
    the storage when ``span`` is at most that. The proof uses shape and strides only, never the
    storage size: under ``torch.compile`` a fake tensor's storage is the view's own extent, so a proof
    on the real storage size would accept in eager mode what the compiled graph rejects.
    """
    check_format(kv_format)
    if kv_format == "auto":
        check_tensor(name, kv_cache, dtypes=(dtype,) if dtype is not None else AUTO_DTYPES, ndim=3, device=device)
        expect(kv_cache.shape[-1] >= 1, lambda: f"{name}: expected shape[-1] >= 1, got shape {tuple(kv_cache.shape)}")
    else:
        check_tensor(name, kv_cache, dtypes=(torch.uint8,), ndim=3, device=device)
        width = _TOKEN_BYTES[kv_format]
        expect(kv_cache.shape[-1] == width,
               lambda: f"{name}: expected shape[-1] == {width} (bytes per token of {kv_format}), "
                       f"got shape {tuple(kv_cache.shape)}")
    pages, page_size, dim = kv_cache.shape
    stride_page, stride_row, stride_col = kv_cache.stride()
    expect((dim <= 1) | (stride_col == 1),
           lambda: f"{name}: expected stride(-1) == 1, got strides {tuple(kv_cache.stride())}")
    if kv_format == "fp8_656":
        expect((page_size <= 1) | (stride_row == 656),
               lambda: f"{name}: expected stride(1) == 656 for fp8_656, got strides {tuple(kv_cache.stride())}")
        row = 656
    elif kv_format == "fp8_584":
        row = 584
    else:
        expect((page_size <= 1) | (stride_row >= dim),
               lambda: f"{name}: expected stride(1) >= shape[-1] ({dim}), got strides {tuple(kv_cache.stride())}")
        row = dim
    expect((pages <= 1) | (stride_page >= page_size * row),
           lambda: f"{name}: expected stride(0) >= page_size * {row} (pages must not overlap), "
                   f"got shape {tuple(kv_cache.shape)} and strides {tuple(kv_cache.stride())}")
    # The bounds proof (see the docstring): the layout's span of a page within the view's.
    span = (page_size - 1) * stride_row + dim if kv_format == "auto" else page_size * row
    view_span = (page_size - 1) * stride_row + dim
    expect((pages == 0) | (page_size == 0) | (span <= view_span),
           lambda: f"{name}: expected a view that covers the {kv_format} layout of its pages ({span} bytes from "
                   f"each page's start, so stride(1) >= {row}), got shape {tuple(kv_cache.shape)} and strides "
                   f"{tuple(kv_cache.stride())}, which reach {view_span} bytes into the last page")
