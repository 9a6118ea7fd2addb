"""Fakes (and the cache-layout checks) of the KV cache operators, SPEC section 5.

Each function validates its arguments from metadata only (dtypes, ranks, devices, shapes, strides)
and, for the functional overload, returns an empty output of the right shape, dtype and device. The
real implementations call these first. What a valid cache of each ``kv_format`` looks like is
decided in one place, ``meta_kernels/_formats.check_kv_cache``, shared with the attention operators.
"""

from __future__ import annotations

import torch

from ._common import SLOT_DTYPES, dtype_names, check_size, check_tensor
from ._formats import cache_dim, check_format, check_kv_cache

# Values the "auto" cache may hold, kv_cache_insert may read and kv_cache_gather may return.
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GATHER_SLOT_DTYPES = (torch.int32, torch.int64)


def _check_cache(kv_cache, kv_format, device=None):
    """Layout checks shared with the attention operators (``meta_kernels/_formats.check_kv_cache``), with
    float32 also accepted for an ``auto`` cache; returns the latent dimension ``D``."""
    check_format(kv_format)
    dtype = None
    if kv_format == "auto":
        check_tensor("kv_cache", kv_cache, dtypes=FLOAT_DTYPES)
        dtype = kv_cache.dtype
    check_kv_cache("kv_cache", kv_cache, kv_format, device=device, dtype=dtype)
    return cache_dim(kv_cache, kv_format)


# -- kv_cache_insert -----------------------------------------------------------------------------------


def kv_cache_insert(kv, slot_mapping, kv_cache, kv_format):
    check_format(kv_format)
    check_tensor("kv", kv, dtypes=FLOAT_DTYPES, ndim=2)
    device = kv.device
    check_tensor("slot_mapping", slot_mapping, dtypes=SLOT_DTYPES, ndim=1, device=device)
    dim = _check_cache(kv_cache, kv_format, device)
    check_size("kv", kv, 1, dim, "the cache's latent dimension D")
    check_size("slot_mapping", slot_mapping, 0, kv.shape[0], "kv.shape[0]")


# -- kv_cache_gather -----------------------------------------------------------------------------------


def _check_gather(kv_cache, slots, kv_format, dtype):
    dim = _check_cache(kv_cache, kv_format)
    check_tensor("slots", slots, dtypes=GATHER_SLOT_DTYPES, ndim=1, device=kv_cache.device)
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype: expected {dtype_names(FLOAT_DTYPES)} (or None for bfloat16), "
                         f"got {str(dtype).replace('torch.', '')}")
    return dim


def kv_cache_gather(kv_cache, slots, kv_format, dtype=None):
    dim = _check_gather(kv_cache, slots, kv_format, dtype)
    return kv_cache.new_empty((slots.shape[0], dim), dtype=torch.bfloat16 if dtype is None else dtype)


def kv_cache_gather_out(kv_cache, slots, kv_format, dtype=None, *, out):
    dim = _check_gather(kv_cache, slots, kv_format, dtype)
    check_tensor("out", out, dtypes=FLOAT_DTYPES if dtype is None else (dtype,), ndim=2, device=kv_cache.device)
    check_size("out", out, 0, slots.shape[0], "len(slots)")
    check_size("out", out, 1, dim, "the cache's latent dimension D")
