"""Benchmark harness: timing, roofline and the table written to ``docs/benchmarks.md``.

A family's benchmark module (``bench/mla.py``, ``bench/gqa.py``) exposes ``cases(quick: bool)`` that
yields :class:`Case` objects: two zero-argument callables (the library operator and the
``torch.compile``d PyTorch reference, inputs already built on the GPU) plus the FLOPs and the unique
bytes one call must move. The harness times both in the same run and reports the fraction of the
roofline, ``max(flops / peak_flops, bytes / peak_bandwidth) / time``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

# Ceilings measured on this workplace's H200 (device/KINDS.md): a large device-to-device copy moved
# 4.3 TB/s (bytes read + written); an 8192^3 bf16 matmul ran at about 790 TFLOP/s on random data.
PEAK_BYTES_PER_S = 4.3e12
PEAK_BF16_FLOPS = 790e12


@dataclasses.dataclass
class Case:
    name: str  # the configuration, e.g. "fp8_656 H=128 K=2048 T=256"
    flops: float  # floating-point operations of one call
    bytes: float  # fewest bytes one call must move through device memory
    run: Callable[[], object]  # one call of the library operator
    reference: Callable[[], object] | None  # one call of the compiled PyTorch reference
    check: Callable[[], float] | None = None  # optional: relative error of run() vs reference()


def time_us(fn: Callable[[], object], use_graph: bool = True) -> float:
    """Median microseconds of one call. With ``use_graph`` the call is captured in a CUDA graph
    (10 calls per replay) so launch overhead does not hide the kernel time; falls back to plain
    launches if capture fails."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    if use_graph:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            reps = 10
            with torch.cuda.graph(graph):
                for _ in range(reps):
                    fn()
            ms = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
            return ms * 1e3 / reps
        except Exception:  # noqa: BLE001 - a reference that cannot be captured is timed plainly
            torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    return ms * 1e3


def measure(case: Case) -> dict:
    us = time_us(case.run)
    ref_us = time_us(case.reference) if case.reference is not None else float("nan")
    floor_s = max(case.flops / PEAK_BF16_FLOPS, case.bytes / PEAK_BYTES_PER_S)
    row = {
        "config": case.name,
        "us": us,
        "TFLOP/s": case.flops / (us * 1e-6) / 1e12,
        "GB/s": case.bytes / (us * 1e-6) / 1e9,
        "roofline": floor_s / (us * 1e-6),
        "bound": "compute" if case.flops / PEAK_BF16_FLOPS > case.bytes / PEAK_BYTES_PER_S else "memory",
        "ref_us": ref_us,
        "speedup": ref_us / us,
    }
    if case.check is not None:
        row["rel_err"] = case.check()
    return row


def format_table(rows: list[dict]) -> str:
    cols = ["config", "us", "TFLOP/s", "GB/s", "roofline", "bound", "ref_us", "speedup"]
    if any("rel_err" in r for r in rows):
        cols.append("rel_err")
    fmt = {
        "us": "{:.1f}", "TFLOP/s": "{:.1f}", "GB/s": "{:.0f}", "roofline": "{:.0%}",
        "ref_us": "{:.1f}", "speedup": "{:.2f}x", "rel_err": "{:.1e}",
    }
    head = "| " + " | ".join(cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    lines = [head, sep]
    for r in rows:
        cells = [fmt.get(c, "{}").format(r[c]) if c in r else "" for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
