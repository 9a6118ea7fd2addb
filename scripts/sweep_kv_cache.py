"""Time the slots per program of ``kv_cache_gather`` on the benchmark's shapes (GPU only).

    python scripts/sweep_kv_cache.py [fp8_584|fp8_656|auto ...]

For each format and N in 1 / 128 / 4096 (random distinct slots of a cache of 2**18 slots, pages of
64, as ``bench/kv_cache.py``): the compiled plain-PyTorch gather (``bench/baselines.py``) and the
library's gather kernel with 1, 2, 4, 8 and 16 slots per program (as many as the kernel's tile allows;
for ``auto``, a bf16 cache into bf16, the copy kernel and, as ``dequant``, the dequantising kernel at
its planned slots), microseconds per call (CUDA-graph replay of one call, L2 flushed, the benchmark's
timer), best of two rounds in one process. Every variant's output is compared with the baseline's.
Used to choose ``ops/kv_cache.py::_gather_slots``; not a test, not the benchmark.
"""

from __future__ import annotations

import sys

import torch

from torch_sparse_mla.bench import baselines
from torch_sparse_mla.bench.common import compile_reference, graph_us
from torch_sparse_mla.bench.kv_cache import FORMATS, POOL_SLOTS, TOKENS, _cache
from torch_sparse_mla.ops import kv_cache as ops

REFERENCES = {"fp8_584": baselines.gather_fp8_584, "fp8_656": baselines.gather_fp8_656, "auto": baselines.gather_auto}
SLOTS = (1, 2, 4, 8, 16)


def _variants(kv_format: str, dim: int) -> dict[str, tuple[bool, int | None]]:
    """name -> (copy kernel for ``auto``, forced slots per program or None for the plan's)."""
    if kv_format == "auto":
        tile_rows = ops._COPY_TILE // ops.prev_pow2(dim)
        out = {f"copy x{s}": (True, s) for s in SLOTS if s <= tile_rows}
        out["dequant"] = (False, None)
        return out
    tile_rows = ops._GATHER_TILE // min(ops._GATHER_MAX_CHUNK, ops.next_pow2(dim))
    return {f"x{s}": (False, s) for s in SLOTS if s <= tile_rows}


def sweep(kv_format: str) -> None:
    dim = FORMATS[kv_format][0]
    cache, _ = _cache(kv_format, POOL_SLOTS, "cuda")
    if kv_format == "auto":
        cache.copy_(torch.randn(cache.shape, device="cuda") * 4)
    else:
        ops.kv_cache_insert_triton(torch.randn(POOL_SLOTS, dim, device="cuda") * 4,
                                   torch.arange(POOL_SLOTS, device="cuda"), cache, kv_format)
    reference = compile_reference(REFERENCES[kv_format])
    planned = ops._gather_slots
    for n in TOKENS:
        gen = torch.Generator().manual_seed(n)
        slots = torch.randperm(POOL_SLOTS, generator=gen)[:n].to("cuda")
        want = reference(cache, slots).to(torch.bfloat16)
        best: dict[str, float] = {}
        try:
            for _ in range(2):
                best["baseline"] = min(best.get("baseline", float("inf")), graph_us(lambda: reference(cache, slots)))
                for name, (copy, forced) in _variants(kv_format, dim).items():
                    ops.GATHER_COPY = copy
                    ops._gather_slots = planned if forced is None else (lambda _n, _cap, s=forced: s)
                    ops._PLANS.clear()
                    out = torch.empty(n, dim, dtype=torch.bfloat16, device="cuda")
                    us = graph_us(lambda: ops.kv_cache_gather_triton(cache, slots, kv_format, torch.bfloat16, out=out))
                    if not torch.equal(out, want):
                        raise AssertionError(f"{kv_format} N={n} {name}: output differs from the baseline's")
                    best[name] = min(best.get(name, float("inf")), us)
        finally:
            ops.GATHER_COPY, ops._gather_slots = True, planned
            ops._PLANS.clear()
        print(f"gather {kv_format} N={n} (planned: {planned(n, 16)} slots per program, at most the tile's): "
              + "; ".join(f"{k} {v:.2f}" for k, v in best.items()), flush=True)


def main(argv: list[str]) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("sweep_kv_cache.py times CUDA kernels: it needs a GPU")
    for kv_format in argv or list(FORMATS):
        sweep(kv_format)


if __name__ == "__main__":
    main(sys.argv[1:])
