"""Timing, compilation with progress messages and the result table shared by the two demo steps."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch


def say(message: str) -> None:
    print(message, flush=True)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` (Frobenius norms, float64, on the CPU)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def compile_step(module, device: torch.device):
    """``torch.compile`` of a decode step: ``fullgraph=True`` always; on a GPU also
    ``mode="reduce-overhead"`` (the step is captured in a CUDA graph and replayed). Returns
    ``(compiled_default, compiled_graph)``; the second is None on a CPU. Nothing compiles until the
    first call."""
    default = torch.compile(module, fullgraph=True, dynamic=False)
    graph = None
    if device.type == "cuda":
        graph = torch.compile(module, fullgraph=True, dynamic=False, mode="reduce-overhead")
    return default, graph


def cudagraph_skips() -> int:
    """Compiled regions that ``mode="reduce-overhead"`` ran without a CUDA graph so far."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def check_graphs(compiled_graph, skips_before: int) -> None:
    """On a GPU: the compiled step must have run as a CUDA graph (reduce-overhead skips silently)."""
    if compiled_graph is None:
        return
    skipped = cudagraph_skips() - skips_before
    say(f"  CUDA graphs: the compiled step was captured ({skipped} regions skipped)")
    if skipped:
        raise AssertionError("the compiled step did not run as a CUDA graph (see the log above)")


def warm(fn: Callable[[], object], what: str, calls: int = 1):
    """Run ``fn`` ``calls`` times (the first call compiles) and report how long the first took."""
    say(f"  compiling {what} ...")
    t0 = time.perf_counter()
    result = fn()
    say(f"    done in {time.perf_counter() - t0:.1f} s")
    for _ in range(calls - 1):
        result = fn()
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_loop(fn: Callable[[], object], device: torch.device, iters: int, repeats: int = 3) -> float:
    """Microseconds per call of ``fn`` called back to back (median over ``repeats`` loops of
    ``iters`` calls, one synchronisation per loop): ``max(host time, device time)`` per call, what a
    decode loop that issues steps one after another sees."""
    fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(samples)


def capture_graph(fn: Callable[[], object], device: torch.device) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph. ``fn`` must be capturable: it is run twice on a side stream
    first (Triton kernels and inductor code compile there), then captured once."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graph(fn: Callable[[], object], device: torch.device, iters: int, repeats: int = 3) -> float:
    """Device microseconds of ``fn`` captured in a CUDA graph (:func:`capture_graph`; median replay
    time)."""
    return time_loop(capture_graph(fn, device).replay, device, iters, repeats)


@dataclasses.dataclass
class Row:
    stage: str
    ours: float | None  # microseconds
    plain: float | None
    note: str = ""


def format_table(title: str, rows: list[Row]) -> str:
    def us(x):
        if x is None:
            return "n/a"
        return f"{x / 1000:.2f} ms" if x >= 10_000 else f"{x:.1f} us"

    header = ("stage", "torch_sparse_mla", "plain PyTorch", "speed-up")
    cells = [header]
    for r in rows:
        speedup = f"{r.plain / r.ours:.1f}x" if r.ours and r.plain else ""
        cells.append((r.stage + (f" ({r.note})" if r.note else ""), us(r.ours), us(r.plain), speedup))
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = [title]
    for j, c in enumerate(cells):
        lines.append("  " + c[0].ljust(widths[0]) + "  " + "  ".join(x.rjust(w) for x, w in zip(c[1:], widths[1:])))
        if j == 0:
            lines.append("  " + "-" * (sum(widths) + 6))
    return "\n".join(lines)


def stage_row(name: str, fn_ours, fn_plain, device: torch.device, iters: int, compile_plain: bool) -> Row:
    """One stage's time: on a GPU each side is captured alone in a CUDA graph and replayed (the plain
    stage compiled with ``fullgraph=True`` first when ``compile_plain``); on a CPU both run eagerly."""
    if device.type != "cuda":
        return Row(name, time_loop(fn_ours, device, iters), time_loop(fn_plain, device, iters))
    if compile_plain:
        fn_plain = torch.compile(fn_plain, fullgraph=True, dynamic=False)
        warm(fn_plain, f"the plain-PyTorch stage '{name}'")
    return Row(name, time_graph(fn_ours, device, iters), time_graph(fn_plain, device, iters))


def whole_step_rows(ours, compiled, compiled_graph, plain, args, device: torch.device, iters: int,
                    compile_plain: bool) -> list[Row]:
    """Whole-step times (back-to-back steps, host included): eager, ``torch.compile`` and, on a GPU,
    the CUDA graph of ``mode="reduce-overhead"``, for the library's step and the plain one; on a GPU
    also the step captured by hand in one ``torch.cuda.graph`` (the library's eager step, the plain
    step compiled with ``fullgraph=True``) and replayed back to back, which leaves out the host work of
    a ``reduce-overhead`` call (``docs/integration.md``)."""
    rows = [Row("whole step, eager", time_loop(lambda: ours(*args), device, iters),
                time_loop(lambda: plain(*args), device, iters))]
    if compiled_graph is not None:  # on a CPU the default-mode step is the one already compiled
        warm(lambda: compiled(*args), "the step (torch.compile fullgraph=True, default mode)")
    plain_default = plain_graph = None
    if compile_plain:
        plain_default, plain_graph = compile_step(plain, device)
        warm(lambda: plain_default(*args), "the plain-PyTorch step (torch.compile fullgraph=True)")
    rows.append(Row("whole step, torch.compile", time_loop(lambda: compiled(*args), device, iters),
                    time_loop(lambda: plain_default(*args), device, iters) if plain_default is not None else None,
                    "" if compile_plain else "plain step not compiled: --compile-plain"))
    if compiled_graph is None:
        rows.append(Row("whole step, CUDA graph", None, None, "needs a GPU"))
        return rows
    if plain_graph is not None:
        warm(lambda: plain_graph(*args), "the plain-PyTorch step (mode=reduce-overhead)", calls=3)
    rows.append(Row("whole step, CUDA graph", time_loop(lambda: compiled_graph(*args), device, iters),
                    time_loop(lambda: plain_graph(*args), device, iters) if plain_graph is not None else None,
                    "reduce-overhead"))
    rows.append(Row("whole step, one CUDA graph", time_graph(lambda: ours(*args), device, iters),
                    time_graph(lambda: plain_default(*args), device, iters) if plain_default is not None else None,
                    "torch.cuda.graph, captured by hand"))
    return rows
