"""Benchmark cases of kv_cache_insert and kv_cache_gather in the three formats.

``N`` tokens (one per request of a decode step, or a prefill chunk) written to or read from distinct
random slots of a cache of ``POOL_SLOTS`` slots (pages of 64; DeepSeek-V4's ``fp8_584`` pages padded
to a multiple of 576 bytes), far larger than L2. Values are bf16 in and out.

FLOPs = 0. Bytes: insert reads ``N * D * 2`` and writes ``N * bytes_per_token``; gather the reverse
(plus the slot lists). The references are the plain-PyTorch quantise-and-scatter and
gather-and-dequantise of ``bench/baselines.py``, compiled; the check compares the bytes written
(insert) or the values read (gather).
"""

from __future__ import annotations

from typing import Iterator

import torch

import torch_sparse_mla as tsm
from torch_sparse_mla.bench import baselines
from torch_sparse_mla.bench.common import Case, compile_reference, mismatches

PAGE_SIZE = 64
POOL_SLOTS = 1 << 18
FORMATS = {  # kv_format: (D, bytes per token)
    "fp8_584": (512, 584),
    "fp8_656": (576, 656),
    "auto": (576, 2 * 576),
}
TOKENS = (1, 128, 4096)
QUICK_TOKENS = (1, 4096)
SMOKE_POOL, SMOKE_TOKENS = 256, (5,)


def _cache(kv_format: str, slots: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cache, what the plain writer takes)``: for ``fp8_584`` the writer takes the page bytes
    ``[pages, page stride]`` (compiled code cannot scatter through the ``as_strided`` cache view)."""
    pages = slots // PAGE_SIZE
    if kv_format == "auto":
        cache = torch.zeros(pages, PAGE_SIZE, 576, dtype=torch.bfloat16, device=device)
        return cache, cache
    if kv_format == "fp8_656":
        cache = torch.zeros(pages, PAGE_SIZE, 656, dtype=torch.uint8, device=device)
        return cache, cache
    stride = -(-PAGE_SIZE * 584 // 576) * 576
    flat = torch.zeros(pages, stride, dtype=torch.uint8, device=device)
    return torch.as_strided(flat, (pages, PAGE_SIZE, 584), (stride, 584, 1)), flat


def _full_cache(kv_format: str, pool: int, dim: int, seed: int, device: str) -> torch.Tensor:
    """A cache of ``pool`` slots with every slot written, its values drawn from a generator seeded with
    ``seed`` on ``device`` (the same bytes in every process; the global generator is not used)."""
    full, _ = _cache(kv_format, pool, device)
    gen = torch.Generator(device).manual_seed(seed)
    values = torch.randn(pool, dim, device=device, generator=gen) * 4
    tsm.kv_cache_insert(values, torch.arange(pool, device=device), full, kv_format=kv_format)
    return full


def _insert_fp8_584(kv, slots, pages):
    baselines.write_fp8_584_pages(kv, slots, pages, PAGE_SIZE)


_INSERT = {"fp8_584": _insert_fp8_584, "fp8_656": baselines.kv_cache_insert_fp8_656,
           "auto": baselines.kv_cache_insert_auto}
_GATHER = {"fp8_584": baselines.gather_fp8_584, "fp8_656": baselines.gather_fp8_656, "auto": baselines.gather_auto}


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Every byte of a cache's storage (page padding included)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def cases(quick: bool = False, device: str = "cuda", smoke: bool = False) -> Iterator[Case]:
    """Insert and gather per format and token count (``device="cpu", smoke=True``: tiny ones)."""
    pool = SMOKE_POOL if smoke else POOL_SLOTS
    for kv_format, (dim, token_bytes) in FORMATS.items():
        for n in SMOKE_TOKENS if smoke else QUICK_TOKENS if quick else TOKENS:
            gen = torch.Generator().manual_seed(n + dim)
            slots = torch.randperm(pool, generator=gen)[:n].to(device)
            kv = (torch.randn(n, dim, generator=gen) * 4).to(torch.bfloat16).to(device)
            (ours, _), (theirs, theirs_target) = _cache(kv_format, pool, device), _cache(kv_format, pool, device)
            insert_ref = compile_reference(_INSERT[kv_format])

            def run(kv=kv, slots=slots, cache=ours, kv_format=kv_format):
                tsm.kv_cache_insert(kv, slots, cache, kv_format=kv_format)

            def reference(kv=kv, slots=slots, target=theirs_target, fn=insert_ref):
                fn(kv, slots, target)

            def check(run=run, reference=reference, ours=ours, theirs=theirs):
                run()
                reference()
                return mismatches(_raw(ours), _raw(theirs))

            yield Case(name=f"insert {kv_format} N={n}", flops=0.0, bytes=float(n * (dim * 2 + token_bytes + 8)),
                       written=float(n * token_bytes), run=run, reference=reference, check=check,
                       operator="kv_cache_insert", host_overhead=n == 1)

            full = _full_cache(kv_format, pool, dim, gen.initial_seed(), device)
            out = torch.empty(n, dim, dtype=torch.bfloat16, device=device)
            gather_ref = compile_reference(_GATHER[kv_format])

            def run(cache=full, slots=slots, out=out, kv_format=kv_format):
                return tsm.kv_cache_gather(cache, slots, kv_format=kv_format, out=out)

            def reference(cache=full, slots=slots, fn=gather_ref):
                return fn(cache, slots)

            def check(run=run, reference=reference):
                return mismatches(run(), reference())

            yield Case(name=f"gather {kv_format} N={n}", flops=0.0, bytes=float(n * (dim * 2 + token_bytes + 8)),
                       written=float(n * dim * 2), run=run, reference=reference, check=check,
                       operator="kv_cache_gather", host_overhead=n == 1)
