"""Argument checks shared by every fake and, through the fakes, by every real kernel.

The fakes are the single place where an operator's shape logic lives: the real implementations call
them first to validate their arguments and to allocate their outputs, so the two cannot drift apart.
Checks read metadata only (shapes, dtypes, devices, strides), never tensor values, and work on
symbolic shapes: a relation between sizes goes through ``torch._check_with``, which records it as a
runtime assertion under ``torch.compile`` instead of specialising the graph.
"""

from __future__ import annotations

from typing import Iterable

import torch

INDEX_DTYPES = (torch.int32,)
SLOT_DTYPES = (torch.int64,)


def expect(cond, message) -> None:
    """Raise ``ValueError`` unless ``cond`` (a bool or a SymBool) holds.

    ``message`` is a string or a zero-argument callable that builds it (only on failure).
    """
    if cond is True:  # the common eager case: skip the SymBool machinery
        return
    torch._check_with(ValueError, cond, message if callable(message) else (lambda: message))


def dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, *, dtypes=None, ndim: int | None = None, device=None) -> None:
    """Type, dtype, rank and device of one argument."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {dtype_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where the first argument is), got {t.device}")


def check_size(name: str, t: torch.Tensor, dim: int, expected, what: str) -> None:
    """``t.shape[dim] == expected``; ``what`` names the expected size in the message."""
    expect(
        t.shape[dim] == expected,
        lambda: f"{name}: expected shape[{dim}] == {what} ({expected}), got shape {tuple(t.shape)}",
    )


def check_min_size(name: str, t: torch.Tensor, dim: int, minimum, what: str) -> None:
    expect(
        t.shape[dim] >= minimum,
        lambda: f"{name}: expected shape[{dim}] >= {what} ({minimum}), got shape {tuple(t.shape)}",
    )


INT32_MAX = 2**31 - 1


def check_positive(name: str, value, minimum: int = 1, maximum: int | None = None) -> None:
    """An int (or SymInt) in ``[minimum, maximum]``. Model constants (page sizes, windows, widths)
    are bounded by INT32_MAX so that the kernels' int64 slot arithmetic and int32 lengths never wrap."""
    if not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool):
        raise ValueError(f"{name}: expected an int, got {type(value).__name__}")
    expect(value >= minimum, lambda: f"{name}: expected an int >= {minimum}, got {value}")
    if maximum is not None:
        expect(value <= maximum, lambda: f"{name}: expected an int <= {maximum}, got {value}")


def check_unit_stride(name: str, t: torch.Tensor) -> None:
    """The last dimension must be dense (kernels vectorise along it)."""
    if t.dim() > 0 and t.shape[-1] != 1:
        expect(t.stride(-1) == 1, lambda: f"{name}: expected stride(-1) == 1, got strides {tuple(t.stride())}")


def memory_extent(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to the end of its last element (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def check_no_self_overlap(name: str, t: torch.Tensor) -> None:
    """A written tensor whose elements are all distinct in memory (sufficient test: with the dimensions
    sorted by stride, each stride exceeds the largest offset reachable through the smaller ones)."""
    dims = sorted((t.stride(i), t.shape[i]) for i in range(t.dim()) if t.shape[i] > 1)
    reach = 0
    for stride, size in dims:
        expect(stride > reach, lambda: f"{name}: expected a tensor whose elements do not overlap in memory (it is "
                                       f"written), got shape {tuple(t.shape)} and strides {tuple(t.stride())}")
        reach = reach + stride * (size - 1)


def check_no_overlap(names, starts, extents, written) -> None:
    """``ValueError`` when a written tensor overlaps the memory of another tensor argument of the call.

    ``names``, ``starts`` (``data_ptr()``) and ``extents`` (:func:`memory_extent`) per tensor argument,
    ``written``: the positions of the written ones (outputs, or the cache ``kv_cache_insert`` writes).
    Reads may overlap each other; a written tensor may overlap nothing: the kernels read their inputs
    while they write, and an output would clobber another. Needs data pointers, so it runs in the
    real implementations only, on every call (never cached: the same shapes come with other addresses).
    """
    for i in written:
        start = starts[i]
        end = start + extents[i]
        for j, other in enumerate(starts):
            if other < end and start < other + extents[j] and j != i:
                what = "output" if j in written else "input"
                raise ValueError(f"{names[i]}: overlaps the memory of {what} {names[j]}; an output buffer must not "
                                 f"alias another argument of the call (pass a separate buffer)")
