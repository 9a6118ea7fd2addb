"""Helpers shared by the test modules (markers, compile and CUDA-graph checks, input factories)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

# Whether Triton is usable: the package's own answer (it imports Triton, or stands in for one it cannot
# import; conftest.py has set TRITON_INTERPRET before this import). Triton is a dependency on Linux only:
# elsewhere (macOS, Windows) the CPU kernels run without it and the tests of the Triton kernels are skipped.
from torch_sparse_mla.ops._triton import HAS_TRITON

HAS_CUDA = torch.cuda.is_available()
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Property-test example counts (docs/testing.md, "Property-test profiles"): ``ci`` (the default without
# a GPU: derandomised, reproducible), ``gpu`` (the default with one: ten times more, random),
# ``thorough`` (a hundred times ``ci``).
_FACTOR = {"ci": 1, "gpu": 10, "thorough": 100}
_PROFILE = os.environ.get("TSM_HYPOTHESIS_PROFILE", "gpu" if HAS_CUDA else "ci")
if _PROFILE not in _FACTOR:
    raise ValueError(f"TSM_HYPOTHESIS_PROFILE: expected one of {sorted(_FACTOR)}, got {_PROFILE!r}")


def examples(n: int):
    """``settings`` for a property test that runs ``n`` examples in the ci profile."""
    return settings(max_examples=n * _FACTOR[_PROFILE], deadline=None, database=None,
                    derandomize=_PROFILE == "ci", print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def same_layout_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s whole storage, viewed with ``t``'s shape, strides and offset (padding bytes
    included, so two copies are byte for byte the same memory)."""
    base = torch.empty(0, dtype=t.dtype, device=t.device)
    return base.set_(t.untyped_storage().clone(), t.storage_offset(), t.shape, t.stride())


def run_offline_compile(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``scripts/<script>`` (an sm_90 compile that needs no GPU) outside the Triton interpreter,
    which the test session may have switched on."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, os.path.join(REPO, "scripts", script), *args], capture_output=True,
                          text=True, env=env, timeout=900)


def require_gluon(hopper) -> None:
    """Skip a test of a Hopper kernel's build or code where module ``hopper`` has none with this Triton."""
    if not hopper.HAS_GLUON:
        pytest.skip("no Hopper kernels with this triton (a release outside GLUON_TRITON_VERSIONS, or no usable "
                    "Gluon)")


def check_alignment_needs(hopper, kernel_name: str, *script_args: str) -> None:
    """``scripts/inspect_hopper.py --alignment`` over ``script_args``: a Hopper kernel (``kernel_name`` in
    module ``hopper``) compiled with one pointer argument at a time not known to be 16-byte aligned must
    fail to build for exactly the arguments at its module's ``ALIGNED_ARGS``, in each variant (two of
    them) the script compiles."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    require_gluon(hopper)
    kernel = getattr(hopper, kernel_name)
    result = run_offline_compile("inspect_hopper.py", "--alignment", *script_args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    verdicts = re.findall(r"^(.+), (\w+) not 16-byte aligned: (compiles|does not compile)", result.stdout, re.M)
    variants = {v for v, _, _ in verdicts}
    assert len(variants) == 2 and len(verdicts) >= 20, result.stdout
    needed = {kernel.arg_names[i] for i in hopper.ALIGNED_ARGS}
    for variant in variants:
        failing = {name for v, name, verdict in verdicts if v == variant and verdict == "does not compile"}
        assert failing == needed, (variant, failing, needed)


def set_args(**values):
    """A mutation for the bad-input tables: replace arguments, in order, by functions of the arguments
    (``a``: the argument dict)."""

    def mutate(a):
        for name, fn in values.items():
            a[name] = fn(a)

    return mutate


_skip_without_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA GPU: on one, bash scripts/gpu_suite.sh runs the whole suite"
)


def requires_cuda(test):
    """Marks a GPU test: skipped without CUDA, selected by ``-m cuda`` (scripts/sanitize.sh)."""
    return pytest.mark.cuda(_skip_without_cuda(test))


def _hopper_kernels_usable() -> bool:
    from torch_sparse_mla.ops.sparse_mla_hopper import HAS_GLUON, _is_sm90

    # the launchers' own test of the device (not an MI200 of a ROCm build, whose GFX version is (9, 0))
    return HAS_CUDA and HAS_GLUON and _is_sm90(torch.device("cuda"))


_skip_without_hopper = pytest.mark.skipif(
    not _hopper_kernels_usable(),
    reason="needs an sm_90 GPU and a Triton the Hopper kernels are written for (GLUON_TRITON_VERSIONS)",
)


def requires_hopper(test):
    """A GPU test of a Hopper kernel: skipped elsewhere, selected by ``-m cuda`` like every GPU test."""
    return pytest.mark.cuda(_skip_without_hopper(test))
requires_interpreter = pytest.mark.skipif(
    not INTERPRETER,
    reason=("Triton interpreter parity runs where TRITON_INTERPRET=1 was set before import (CPU machines, CI)"
            if HAS_TRITON else "needs Triton (pip install triton; Linux): the Triton kernels under its interpreter"),
)


def compile_counter():
    """A torch.compile backend (inductor) that counts compiled frames."""
    from torch._dynamo.testing import CompileCounterWithBackend

    return CompileCounterWithBackend("inductor")


def assert_no_recompiles(fn, arg_sets, check):
    """Compile ``fn`` with ``fullgraph=True, dynamic=True``, run it on every argument set (different
    batch sizes), compare each result with ``check(args, result)``, and assert one compiled frame."""
    torch._dynamo.reset()
    counter = compile_counter()
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for args in arg_sets:
        check(args, compiled(*args))
    assert counter.frame_count == 1, f"expected one compiled frame, got {counter.frame_count}"


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with a value no kernel writes legitimately (checks every element is written)."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(-12345)


def signature_cache(impl):
    """The ``_Validated`` map (signature -> what later calls reuse) of an implementation of
    ``torch_sparse_mla._library`` (registered or direct), read from its closure."""
    from torch_sparse_mla import _library

    return next(c.cell_contents for c in impl.__closure__ if isinstance(c.cell_contents, _library._Validated))


def cached_entries(impl) -> list:
    """The values cached by signature in a registered implementation of ``torch_sparse_mla._library``."""
    return list(signature_cache(impl).values())


def forget_signatures(name: str) -> None:
    """Empty the signature caches of operator ``name``'s CUDA implementations and public direct path, so
    that the next call of each is a first call (its launches recorded again)."""
    from torch_sparse_mla import _library

    for impl in (_library.IMPLS[name, "CUDA"], _library.IMPLS[name + ".out", "CUDA"], _library._DIRECT[name]):
        seen = signature_cache(impl)
        seen.clear()
        seen._forget()


def records_split_launches(impl) -> bool:
    """Whether an ``out`` implementation's cache holds a record of a split call: two launches (decode,
    combine) and one scratch buffer (the workspace) by its size."""
    records = [entry[1] for entry in cached_entries(impl) if entry[1] is not None]
    return any(len(scratch) == 1 and len(launches) == 2 for scratch, launches in records)
