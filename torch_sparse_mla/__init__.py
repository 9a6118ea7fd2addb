"""torch_sparse_mla: torch.compile-native custom operators for sparse attention decode.

``import torch_sparse_mla`` registers every operator under ``torch.ops.sparse_mla`` (functional and
``.out`` overloads, fakes, CPU kernels, Triton CUDA kernels) and exports one documented Python function
per operator, and the engine-facing metadata builders of :mod:`torch_sparse_mla.steps`. See
``docs/operators.md`` for the contracts and ``docs/integration.md`` for use inside an engine.
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
from torch_sparse_mla.steps import (
    DeepSeekV4Metadata,
    DeepSeekV4MetadataBuilder,
    MiniMaxM3Metadata,
    MiniMaxM3MetadataBuilder,
)

__version__ = "0.1.0"

__all__ = [
    "DeepSeekV4Metadata",
    "DeepSeekV4MetadataBuilder",
    "MiniMaxM3Metadata",
    "MiniMaxM3MetadataBuilder",
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
