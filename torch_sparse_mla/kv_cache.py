"""Writing and reading the paged sparse-MLA KV cache (contract: docs/operators.md, layouts: docs/formats.md).

A cache holds one latent vector of ``D`` values per slot (``slot = page * page_size + row``) in one of
three formats (byte layouts in ``docs/formats.md``):

- ``"auto"``: ``[pages, page_size, D]`` of bfloat16, float16 or float32, stored as is;
- ``"fp8_656"`` (DeepSeek-V3.2, D = 576): uint8 ``[pages, page_size, 656]``; dims 0-511 as e4m3 with
  one float32 scale per 128 dims, dims 512-575 as bf16;
- ``"fp8_584"`` (DeepSeek-V4, D = 512): uint8 ``[pages, page_size, 584]``; dims 0-447 as e4m3 with one
  power-of-two (UE8M0) scale per 64 dims, dims 448-511 as bf16; data rows and scale rows are stored
  apart inside each page.

Both functions call registered operators of ``torch.ops.sparse_mla`` and are CUDA-graph safe: the CUDA
kernels never synchronise, never read a value on the host and allocate nothing whose size depends on
values (slot ids are read on the device only).
"""

from __future__ import annotations

import torch

from torch_sparse_mla._library import call, unpack_out



def kv_cache_insert(
    kv: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    kv_format: str = "auto",
) -> None:
    """Quantise ``kv[i]`` and write it to slot ``slot_mapping[i]`` of ``kv_cache``, in place.

    - ``"auto"``: ``kv_cache[page, row] = kv[i]`` converted to the cache dtype (round to nearest even).
    - ``"fp8_656"``: per 128-value tile ``j`` of dims 0-511, ``scale_j = max(amax_j / 448, 2**-126)``
      (float32) is stored and the values become ``e4m3(clamp(x / scale_j, -448, 448))``; dims 512-575
      are stored as bf16.
    - ``"fp8_584"``: per 64-value tile ``j`` of dims 0-447, ``e_j = ceil(log2(max(amax_j, 1e-4) / 448))``
      (exact) is stored as the byte ``clamp(e_j + 127, 0, 255)`` and the values become
      ``e4m3(clamp(x * 2**-e_j, -448, 448))``; the 8th scale byte is 0; dims 448-511 as bf16.

    Every rounding is to nearest, ties to even. A slot that is negative or ``>= pages * page_size`` is
    skipped; nothing else in the cache changes (other tokens' bytes, scale rows, page padding). If
    two entries name the same slot, which one is kept is unspecified.

    Args:
        kv: ``[N, D]`` bfloat16, float16 or float32 (any strides).
        slot_mapping: int64 ``[N]``.
        kv_cache: the cache (see the module docstring); **written** (only the bytes of the slots named).
        kv_format: ``"auto"``, ``"fp8_656"`` or ``"fp8_584"``.

    CUDA-graph safe; works under ``torch.compile(fullgraph=True)`` (a mutating custom op).
    """
    call("kv_cache_insert", kv, slot_mapping, kv_cache, kv_format)


def kv_cache_gather(
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    kv_format: str = "auto",
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantised vectors of the given slots: ``out[i] = dequant(kv_cache, slots[i])``.

    ``fp8_656``: ``value = float(e4m3) * scale_j``; ``fp8_584``: ``value = float(e4m3) * 2**(byte_j -
    127)``; bf16 parts and ``auto`` values are exact. The float32 result is rounded once (to nearest
    even) to ``dtype``. A row whose slot is negative or ``>= pages * page_size`` is 0 (nothing of the
    cache is read for it).

    Args:
        kv_cache: the cache of ``kv_format`` (see the module docstring).
        slots: int32 or int64 ``[N]``.
        kv_format: ``"auto"``, ``"fp8_656"`` or ``"fp8_584"``.
        dtype: bfloat16, float16 or float32; ``None`` means bfloat16 (or ``out.dtype`` when ``out``
            is given).
        out: optional ``[N, D]`` buffer of ``dtype``; **written** entirely.

    Returns:
        ``[N, D]`` of ``dtype`` (``out`` when given).

    CUDA-graph safe; pass ``out`` for a fixed output address inside a captured graph.
    """
    if out is not None:
        (out,) = unpack_out("kv_cache_gather", out)
        call("kv_cache_gather.out", kv_cache, slots, kv_format, dtype, out=out)
        return out
    return call("kv_cache_gather", kv_cache, slots, kv_format, dtype)
