"""Test set-up: the Triton interpreter on machines without a GPU.

``TRITON_INTERPRET=1`` must be in the environment before any kernel module is imported (``triton.jit``
reads it at decoration time), so it is set here, before the test modules import torch_sparse_mla. On a
GPU machine the kernels compile for the GPU and the interpreter tests are skipped; CI (CPU) runs them.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Mark the tests that capture CUDA graphs (``graphs``): their names say so. scripts/sanitize.sh
    runs them under memcheck with PyTorch's caching allocator on (a capture cannot call cudaMalloc)."""
    for item in items:
        name = item.name.split("[")[0]
        if "graph" in name or "reduce_overhead" in name:
            item.add_marker(pytest.mark.graphs)
