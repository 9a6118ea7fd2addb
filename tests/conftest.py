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

if os.environ.get("TSM_UNDER_SANITIZER") == "1":
    # scripts/sanitize.sh memcheck-graphs: inductor's CUDA-graph trees check after each warm-up that
    # every live block of their memory pool is a tracked output. Under compute-sanitizer that check
    # also finds temporaries that Python has already freed during the warm-up (inductor's own
    # L2-flush buffers of its autotuning, the split workspace of an attention call) and stops the
    # test; without the sanitizer the same tests pass with the check on. Only this debugging check is
    # turned off: the tests' own checks (replayed results, no skipped graph) all run. docs/testing.md.
    import torch._inductor.config

    torch._inductor.config.triton.slow_path_cudagraph_asserts = False


def pytest_collection_modifyitems(config, items):
    """Mark the tests that capture CUDA graphs (``graphs``): their names say so. scripts/sanitize.sh
    runs them under memcheck with PyTorch's caching allocator on (a capture cannot call cudaMalloc)."""
    for item in items:
        name = item.name.split("[")[0]
        if "graph" in name or "reduce_overhead" in name:
            item.add_marker(pytest.mark.graphs)
