"""Test set-up: the Triton interpreter on machines without a GPU.

``TRITON_INTERPRET=1`` must be in the environment before any kernel module is imported (``triton.jit``
reads it at decoration time), so it is set here, before the test modules import torch_sparse_mla. On a
GPU machine the kernels compile for the GPU and the interpreter tests are skipped; CI (CPU) runs them.
"""

import os
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _mend_interpreter_scalar_index() -> bool:
    """Triton 3.6's interpreter turns a scalar kernel argument used as a Python index (the bound of a
    ``range`` loop) into an ``int`` with ``int(array)`` on a one-element NumPy array, which NumPy 2.4
    refuses (a ``TypeError``; 1.25-2.3 warn, once per conversion: about 2,000 warnings in a run of the
    suite), so every interpreted kernel with such a loop fails there. Triton 3.7 squeezes the array
    first; this gives the interpreter that conversion (on 3.7 the one it has already), for the tests
    only. Returns whether it was applied: only under the interpreter, with a NumPy that refuses or
    deprecates the conversion and a Triton that has the function it wraps."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import numpy as np

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        try:
            int(np.array([1]))
            return False  # this NumPy still converts a one-element array without a word
        except (TypeError, DeprecationWarning):
            pass
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "_tsm_mended", False):
        return False

    def patch_with_squeezed_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_with_squeezed_index._tsm_mended = True
    interpreter._patch_lang_tensor = patch_with_squeezed_index
    return True


def _mend_interpreter_mask_dtype() -> bool:
    """Triton's interpreter keeps a comparison's result as a Boolean array but types its handle with
    the compared operands' type (``slot >= 0`` on an int64 scalar is an int64 handle). Broadcasting
    such a scalar against a block (``(cols < dim) & ok``) fills an int64 array, and the mask of the
    load or store becomes an integer array of 0 and 1. Up to 3.8 the interpreter's native load and
    store accept that; 3.9.0's refuse every mask that is not Boolean ("mask has unsupported dtype").
    The compiler is not affected (the language types the mask int1 and checks it). This converts such
    a mask to Boolean before the native call (nonzero is true, as on the GPU), for the tests only.
    Returns whether it was applied: only under the interpreter, and only with a Triton whose native
    load refuses an integer mask (probed with an all-false mask, which reads nothing)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import numpy as np

    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    native = getattr(interpreter, "_interpreter", None)
    if builder is None or native is None or getattr(builder, "_tsm_mask_mended", False):
        return False
    try:
        native.load(np.zeros(1, np.uint64), np.zeros(1, np.int32), np.zeros(1, np.float32), np.dtype(np.float32))
        return False  # this release takes an integer mask
    except ValueError:
        pass
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):
        if mask.data.dtype == np.bool_:
            return mask
        return interpreter.TensorHandle(mask.data != 0, mask.dtype)

    builder.create_masked_load = lambda self, ptrs, mask, *rest: load(self, ptrs, as_bool(mask), *rest)
    builder.create_masked_store = lambda self, ptrs, value, mask, *rest: store(self, ptrs, value, as_bool(mask), *rest)
    builder._tsm_mask_mended = True
    return True


_mend_interpreter_scalar_index()
_mend_interpreter_mask_dtype()

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
