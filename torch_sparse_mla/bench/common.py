"""Benchmark harness: timing, ceilings, roofline, tables and the roofline plot.

A family's module (``bench/mla.py``, ``gqa.py``, ``metadata.py``, ``kv_cache.py``) exposes
``cases(quick=False, device="cuda", smoke=False)`` yielding :class:`Case` objects: one call of the
library operator and one call of the plain-PyTorch reference (``bench/baselines.py``, compiled with
``fullgraph=True`` by :func:`compile_reference`) on the same inputs, with the FLOPs and the bytes one
call must move. ``smoke=True`` shrinks every configuration so the factories can be exercised on a CPU
(the test suite does, without timing).

How a case is timed (``measure``):

- **graph**: the operator's call captured in a CUDA graph (``calls_per_graph`` calls, 1 by default)
  and replayed under ``triton.testing.do_bench`` (median; L2 is flushed before every replay). A
  call that cannot be captured is an error: capture is the library's promise, so the harness stops
  rather than time something else.
- **eager**: back-to-back plain calls with one synchronisation at the end (median per call over a
  few loops). Each call then costs ``max(host time, GPU time)``: where the host's launch cost
  exceeds the kernel time, this column shows it. (``do_bench`` is not used here: the L2 flush it
  issues before each call hides up to its own duration of host time.)
- **ref graph**: the compiled reference captured and timed like the operator. A reference that
  cannot be captured gets no time (and no ratio) and a note, never an eager time.
- **clean L2** (``--clean-l2``): both graphs timed again, L2 emptied before each replay by *reading*
  a 256 MB buffer instead of writing it. ``do_bench``'s flush writes zeros, which leaves L2 full of
  modified lines: the timed call's first reads evict them, so its reads share the memory bus with up
  to an L2 of write-backs that belong to the flush. A call inside a decode step follows kernels that
  mostly read (weights), so its L2 holds unmodified lines; the clean columns time that state.
- **floor** (unless ``floors=False``): a kernel that only streams the case's bytes (reads
  ``bytes - written`` from contiguous memory, or ``floor_read`` where the case counts bytes that
  several rows read, writes ``written``), captured and timed like the operator (``bench/floor.py``).
  No call that moves those bytes replays faster under this timer, so ``floor / ours`` is how close
  the operator comes to what the GPU does with its bytes, graph replay cost included, in the same
  run; with ``--clean-l2`` the floor is timed after both flushes.
- **roofline**: ``max(flops / peak_flops, bytes / peak_bandwidth) / graph time``, with the two
  ceilings given on the command line or measured at start (:func:`measure_peaks`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

#: torch.compile backend of the references; the CPU smoke test sets "eager" (Dynamo tracing with
#: fullgraph=True, no code generation).
REFERENCE_BACKEND = "inductor"


def compile_reference(fn: Callable) -> Callable:
    """The reference as a user would run it: ``torch.compile(fn, fullgraph=True)`` (static shapes)."""
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=REFERENCE_BACKEND)


@dataclasses.dataclass
class Case:
    name: str  # the configuration, e.g. "fp8_656 H=128 K=2048 T=256"
    flops: float  # floating-point operations of one call (0 for index and copy operators)
    bytes: float  # fewest bytes one call must move through device memory
    run: Callable[[], object]  # one call of the library operator (inputs and outputs prebuilt)
    reference: Callable[[], object] | None  # one call of the compiled plain-PyTorch reference
    check: Callable[[], str] | None = None  # how far run() is from reference(): "rel 2.1e-03", "exact", ...
    operator: str = ""  # the library operator timed
    host_overhead: bool = False  # a T = 1 configuration: row of the host-overhead table
    written: float = 0.0  # of ``bytes``, those written (the floor kernel reads the rest)
    floor_read: float | None = None  # what the floor reads, where fewer than ``bytes - written`` are distinct


@dataclasses.dataclass
class Peaks:
    flops: float  # FLOP/s (dense bf16 tensor-core)
    bytes: float  # bytes/s (device memory, read + written)
    how: str  # "given" or "measured: ..."


def rel_err(got: torch.Tensor, want: torch.Tensor) -> str:
    got, want = got.float(), want.float()
    return f"rel {((got - want).norm() / want.norm().clamp_min(1e-30)).item():.1e}"


def mismatches(got, want) -> str:
    """Element-wise comparison of tensors (or tuples of tensors) that should be identical."""
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    bad = sum(int((a != b).sum()) for a, b in zip(got, want))
    return "exact" if bad == 0 else f"{bad} differ"


# -- timing ---------------------------------------------------------------------------------------------


class CaptureError(RuntimeError):
    pass


_FLUSH_BYTES = 256 << 20


def _replay_ms_clean_l2(replay: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 200) -> float:
    """``do_bench``'s procedure (repetitions from a first estimate, events around each call, median)
    with L2 emptied by a read of 256 MB before each call instead of a write."""
    buf = torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    acc = torch.empty((), dtype=torch.int64, device="cuda")

    def flush():
        torch.sum(buf, dim=0, out=acc)

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(5):
        flush()
        replay()
    end.record()
    torch.cuda.synchronize()
    estimate = start.elapsed_time(end) / 5  # ms per flush and call
    for _ in range(max(1, int(warmup_ms / estimate))):
        flush()
        replay()
    n = max(1, int(rep_ms / estimate))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        flush()
        s.record()
        replay()
        e.record()
    torch.cuda.synchronize()
    return float(torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends)]).median())


def graph_us(fn: Callable[[], object], calls: int = 1, clean_l2: bool = False) -> float:
    """Median microseconds per call of ``fn`` replayed from a CUDA graph of ``calls`` calls, L2
    emptied before each replay by ``do_bench``'s write of zeros or (``clean_l2``) by a read. Raises
    :class:`CaptureError` when ``fn`` cannot be captured."""
    import triton.testing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compiles Triton kernels and inductor code outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception as exc:  # noqa: BLE001 - re-raised with the reason
        torch.cuda.synchronize()
        raise CaptureError(f"{type(exc).__name__}: {exc}") from exc
    if clean_l2:
        ms = _replay_ms_clean_l2(graph.replay)
    else:
        ms = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    return ms * 1e3 / calls


def eager_us(fn: Callable[[], object], calls: int = 200, loops: int = 10) -> float:
    """Microseconds per call of ``fn`` called ``calls`` times back to back (one synchronisation per
    loop): ``max(host time, GPU time)`` per call, the fastest of ``loops`` loops. Other work on the
    host only ever adds time, so the minimum is the estimate of the call's own cost that repeats
    between runs (the median of five loops moved by several µs between runs of the same code)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def eager_ops_us(fn: Callable[[], object]) -> float:
    """:func:`eager_us` with every public call sent through ``torch.ops.sparse_mla`` (the dispatcher)."""
    from torch_sparse_mla import _library

    with _library.dispatcher_calls():
        return eager_us(fn)


HOST_PASSES = 3


def remeasure_host(pending: list[tuple[Case, dict]], passes: int = HOST_PASSES) -> None:
    """The eager times of the T = 1 rows again, in ``passes`` rounds over all of them once every
    family has run. Other work on the host (the compile workers of the references, other processes)
    only ever adds time, and it comes and goes over seconds: one operator's eager time taken at one
    moment can be several µs above the same call's cost a minute later. Each row keeps the fastest of
    its own measurement and of the passes as ``eager_us`` (and ``eager_ops_us``), and lists the public
    function's measurements in ``eager_passes``, so the table can show the spread."""
    for _ in range(passes):
        for case, row in pending:
            t = eager_us(case.run)
            row.setdefault("eager_passes", [row["eager_us"]]).append(t)
            row["eager_us"] = min(row["eager_us"], t)
            if "eager_ops_us" in row:
                row["eager_ops_us"] = min(row["eager_ops_us"], eager_ops_us(case.run))


def measure_peaks(peak_tflops: float | None, peak_tbps: float | None) -> Peaks:
    """The roofline's two ceilings: given (TFLOP/s, TB/s), or measured on this GPU: a 1 GiB
    device-to-device copy (bytes read + written per second) and an 8192^3 bf16 matmul."""
    import triton.testing

    how = []
    if peak_tbps is None:
        n = 1 << 30
        src = torch.empty(n, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
        peak_tbps = 2 * n / (ms * 1e-3) / 1e12
        how.append("1 GiB device copy")
        del src, dst
    if peak_tflops is None:
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        ms = triton.testing.do_bench(lambda: a @ b, warmup=10, rep=100, return_mode="median")
        peak_tflops = 2 * n**3 / (ms * 1e-3) / 1e12
        how.append("8192^3 bf16 matmul")
        del a, b
    torch.cuda.empty_cache()
    return Peaks(peak_tflops * 1e12, peak_tbps * 1e12, ("measured: " + ", ".join(how)) if how else "given")


def floor_call(read_bytes: float, write_bytes: float) -> Callable[[], object]:
    """A call of the streaming kernel of ``bench/floor.py`` that reads ``read_bytes`` and writes
    ``write_bytes`` on the current GPU (its buffers live as long as the returned function)."""
    from torch_sparse_mla.bench.floor import stream_floor

    return stream_floor(read_bytes, write_bytes)[0]


def measure(case: Case, peaks: Peaks, calls_per_graph: int = 1, clean_l2: bool = False,
            floors: bool = True) -> dict:
    try:
        us = graph_us(case.run, calls_per_graph)
    except CaptureError as exc:
        raise CaptureError(f"{case.name}: the library operator could not be captured in a CUDA graph "
                           f"({exc})") from exc
    row = {"config": case.name, "operator": case.operator, "us": us, "eager_us": eager_us(case.run),
           "host_overhead": case.host_overhead, "flops": case.flops, "bytes": case.bytes}
    if case.host_overhead:  # the same call through torch.ops.sparse_mla (the dispatcher) as well
        row["eager_ops_us"] = eager_ops_us(case.run)
    note = ""
    ref_us = float("nan")
    if case.reference is not None:
        try:
            ref_us = graph_us(case.reference, calls_per_graph)
        except CaptureError as exc:
            note = f"reference not captured ({str(exc).split(':')[0]})"
    if clean_l2:  # both graphs again after a read-only flush (module docstring)
        row["us_clean"] = graph_us(case.run, calls_per_graph, clean_l2=True)
        row["ref_us_clean"] = graph_us(case.reference, calls_per_graph, clean_l2=True) if ref_us == ref_us \
            else float("nan")
        row["ratio_clean"] = row["ref_us_clean"] / row["us_clean"]
    if floors:  # the bytes alone, streamed, under the same timer (module docstring)
        floor = floor_call(case.bytes - case.written if case.floor_read is None else case.floor_read, case.written)
        row["floor_us"] = graph_us(floor, calls_per_graph)
        row["of_floor"] = row["floor_us"] / us
        if clean_l2:
            row["floor_us_clean"] = graph_us(floor, calls_per_graph, clean_l2=True)
            row["of_floor_clean"] = row["floor_us_clean"] / row["us_clean"]
        del floor
    compute_s, memory_s = case.flops / peaks.flops, case.bytes / peaks.bytes
    row.update({
        "TFLOP/s": case.flops / (us * 1e-6) / 1e12,
        "GB/s": case.bytes / (us * 1e-6) / 1e9,
        "roofline": max(compute_s, memory_s) / (us * 1e-6),
        "bound": "compute" if compute_s > memory_s else "memory",
        "ref_us": ref_us,
        "ratio": ref_us / us,
        "check": case.check() if case.check is not None else "",
        "note": note,
    })
    return row


# -- output -----------------------------------------------------------------------------------------------

COLUMNS = [  # (key, header, format)
    ("config", "config", "{}"),
    ("us", "graph µs", "{:.1f}"),
    ("eager_us", "eager µs", "{:.1f}"),
    ("ref_us", "ref graph µs", "{:.1f}"),
    ("ratio", "ref / ours", "{:.2f}x"),
    ("floor_us", "floor µs", "{:.1f}"),
    ("of_floor", "floor / ours", "{:.0%}"),
    ("us_clean", "graph µs, clean L2", "{:.1f}"),
    ("ref_us_clean", "ref graph µs, clean L2", "{:.1f}"),
    ("ratio_clean", "ref / ours, clean L2", "{:.2f}x"),
    ("floor_us_clean", "floor µs, clean L2", "{:.1f}"),
    ("of_floor_clean", "floor / ours, clean L2", "{:.0%}"),
    ("TFLOP/s", "TFLOP/s", "{:.1f}"),
    ("GB/s", "GB/s", "{:.0f}"),
    ("roofline", "roofline", "{:.0%}"),
    ("bound", "bound", "{}"),
    ("check", "vs ref", "{}"),
    ("note", "note", "{}"),
]


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key, "")
    if isinstance(value, float) and value != value:  # NaN
        return "–"
    return fmt.format(value) if value != "" else ""


def format_table(rows: list[dict]) -> str:
    optional = ("note", "us_clean", "ref_us_clean", "ratio_clean", "floor_us", "of_floor", "floor_us_clean",
                "of_floor_clean")  # shown where some row has them
    cols = [c for c in COLUMNS if c[0] not in optional or any(r.get(c[0]) for r in rows)]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r, k, f) for k, _, f in cols) + " |")
    return "\n".join(lines)


def format_host_overhead(rows: list[dict]) -> str:
    """Per operator at T = 1: eager time, graph time and their difference (the host's cost of one
    call when nothing hides it), for the public function (which skips the dispatcher in plain eager
    calls) and for the same call through ``torch.ops.sparse_mla``; then the public function's eager
    time in each measurement (:func:`remeasure_host`), of which the first column is the fastest."""
    lines = ["| operator | config | eager µs | graph µs | host cost µs | eager µs, torch.ops | host cost µs, torch.ops "
             "| eager µs, each pass |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("host_overhead"):
            ops = r.get("eager_ops_us", float("nan"))
            passes = " / ".join(f"{t:.1f}" for t in r.get("eager_passes", [r["eager_us"]]))
            lines.append(f"| `{r['operator']}` | {r['config']} | {r['eager_us']:.1f} | {r['us']:.1f} | "
                         f"{r['eager_us'] - r['us']:.1f} | {ops:.1f} | {ops - r['us']:.1f} | {passes} |")
    return "\n".join(lines)


def plot_roofline(rows: list[dict], peaks: Peaks, path: str, title: str) -> str:
    """A PNG next to the table: left, achieved TFLOP/s against arithmetic intensity under the two
    ceilings (configurations with FLOPs); right, every configuration's fraction of its roofline with
    its GB/s. Returns a message (the plot is skipped when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "roofline plot skipped: matplotlib is not installed (pip install matplotlib)"
    fig, (left, right) = plt.subplots(1, 2, figsize=(16, max(6, 0.28 * len(rows) + 2)),
                                      gridspec_kw={"width_ratios": [1, 1.3]})
    ridge = peaks.flops / peaks.bytes
    xs = [r["flops"] / r["bytes"] for r in rows if r["flops"] > 0]
    lo, hi = min(xs + [ridge]) / 4, max(xs + [ridge]) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    left.plot(grid, [min(peaks.flops, x * peaks.bytes) / 1e12 for x in grid], color="black", lw=1.5,
              label=f"ceilings: {peaks.bytes / 1e12:.1f} TB/s, {peaks.flops / 1e12:.0f} TFLOP/s")
    for r in rows:
        if r["flops"] > 0:
            left.scatter(r["flops"] / r["bytes"], r["TFLOP/s"], s=25)
            left.annotate(r["config"], (r["flops"] / r["bytes"], r["TFLOP/s"]), fontsize=6,
                          xytext=(3, 3), textcoords="offset points")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("arithmetic intensity (FLOP / byte)")
    left.set_ylabel("achieved TFLOP/s")
    left.set_title("attention operators against the roofline")
    left.legend(loc="lower right", fontsize=8)
    names = [f"{r['operator']}: {r['config']}" for r in rows]
    right.barh(range(len(rows)), [100 * r["roofline"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        right.text(100 * r["roofline"] + 1, i, f"{r['GB/s']:.0f} GB/s, {r['TFLOP/s']:.1f} TFLOP/s", va="center",
                   fontsize=6)
    right.set_yticks(range(len(rows)), names, fontsize=6)
    right.invert_yaxis()
    right.set_xlim(0, 115)
    right.set_xlabel("% of roofline (the larger of the compute and memory floors / time)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return f"roofline plot written to {path}"
