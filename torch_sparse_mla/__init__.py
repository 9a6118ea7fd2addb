"""torch_sparse_mla: torch.compile-native custom operators for sparse attention decode.

``import torch_sparse_mla`` registers every operator under ``torch.ops.sparse_mla`` (functional and
``.out`` overloads, fakes, CPU kernels, Triton CUDA kernels) and exports one documented Python function
per operator. See ``docs/operators.md`` for the contracts.
"""

from torch_sparse_mla import _library  # noqa: F401  (registers torch.ops.sparse_mla.*)
from torch_sparse_mla.kv_cache import kv_cache_gather, kv_cache_insert
from torch_sparse_mla.metadata import (
    c128a_topk_indices,
    compressed_slot_mapping,
    compressed_topk_to_global,
    decode_runtime_metadata,
    swa_indices,
)
from torch_sparse_mla.sparse_gqa import gqa_kv_cache_insert, sparse_gqa_decode
from torch_sparse_mla.sparse_mla import sparse_mla_decode

__version__ = "0.1.0"

__all__ = [
    "c128a_topk_indices",
    "compressed_slot_mapping",
    "compressed_topk_to_global",
    "decode_runtime_metadata",
    "gqa_kv_cache_insert",
    "kv_cache_gather",
    "kv_cache_insert",
    "sparse_gqa_decode",
    "sparse_mla_decode",
    "swa_indices",
]
