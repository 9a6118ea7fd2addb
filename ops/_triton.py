"""Triton import guard.

On a machine without Triton (macOS, a CPU-only container) the package still imports and every CPU
kernel works; launching a CUDA kernel then raises a clear error instead of the import crashing.
Kernels use only ``triton.jit``, ``triton.cdiv``, ``triton.next_power_of_2`` and ``tl`` inside
their bodies, so this small stand-in is enough to define them. ``multiprocessor_count`` is the one
device fact the launchers share.
"""

import functools

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    HAS_TRITON = False

    class _Unlaunchable:
        def __init__(self, fn):
            self.fn = fn
            self.__name__ = getattr(fn, "__name__", "kernel")

        def __getitem__(self, grid):
            raise RuntimeError(
                f"torch_sparse_mla: the CUDA kernel {self.__name__} needs Triton; "
                "install it with `pip install triton`"
            )

    class _TritonStandIn:
        @staticmethod
        def jit(fn=None, **_kwargs):
            return _Unlaunchable(fn) if fn is not None else _Unlaunchable

        @staticmethod
        def cdiv(a, b):
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n):
            return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()

    class _LanguageStandIn:
        constexpr = object

    triton = _TritonStandIn()
    tl = _LanguageStandIn()



@functools.lru_cache(maxsize=None)
def _cuda_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(device: torch.device, default: int) -> int:
    """SMs of a CUDA device (cached: launchers size their split heuristics from it on every call);
    ``default`` off CUDA, where the Triton interpreter runs and the grid only needs to stay plausible."""
    if device.type != "cuda":
        return default
    return _cuda_multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


__all__ = ["HAS_TRITON", "multiprocessor_count", "triton", "tl"]
