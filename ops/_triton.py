"""Triton import guard.

On a machine without Triton (macOS, a CPU-only container) the package still imports and every CPU
kernel works; launching a CUDA kernel then raises a clear error instead of the import crashing.
Kernel modules use only ``triton.jit`` and ``tl`` at import time, so this small stand-in is enough to
define them.
"""

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

    class _Constexpr:
        def __init__(self, value=None):
            self.value = value

    class _LanguageStandIn:
        constexpr = _Constexpr

    triton = _TritonStandIn()
    tl = _LanguageStandIn()

# ``cuda_capability_geq(major, minor)`` inside a kernel: whether the GPU it is compiled for has at least
# that compute capability, decided at compile time (Triton 3.5 and later; False under the interpreter
# on a machine without a GPU). The kernels use it to choose integer routines for the float8 conversions
# a GPU before sm_89 lacks.
try:
    from triton.language.target_info import cuda_capability_geq
except ImportError:  # pragma: no cover - no Triton, or one older than the package supports
    cuda_capability_geq = None


def release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a Triton version string ("3.8.0", "3.6.0+git1a2b3c"), or None where it has
    no such prefix. The Hopper kernels and the launch shortcut each support a list of releases."""
    try:
        major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        return None
    return major, minor


__all__ = ["HAS_TRITON", "cuda_capability_geq", "release", "triton", "tl"]
