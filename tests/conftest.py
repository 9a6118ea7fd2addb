"""Test set-up: the Triton interpreter on machines without a GPU.

``TRITON_INTERPRET=1`` must be in the environment before any kernel module is imported (``triton.jit``
reads it at decoration time), so it is set here, before the test modules import torch_sparse_mla. On a
GPU machine the kernels compile for the GPU and the interpreter tests are skipped; CI (CPU) runs them.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
