"""Where a compiled decode step's time goes: the demo's steps as ``mode="reduce-overhead"`` calls and as
one hand-captured CUDA graph (GPU only).

    python scripts/step_overhead.py [--rounds 2] [--only m3|v4]

For the demo's DeepSeek-V4 and FP8 MiniMax-M3 steps at their default sizes (``torch_sparse_mla.demo``),
times in µs, the smallest and the median of the repetitions:

- the step compiled with ``torch.compile(fullgraph=True, mode="reduce-overhead")``, called back to
  back (what the demo's "whole step, CUDA graph" row times), its host time alone (each call after a
  synchronisation, up to its return), and CUDA events around one call;
- the same eager step captured by hand in one ``torch.cuda.graph`` and replayed back to back, and
  events around one replay (the GPU time of the whole step);
- the eager step, back to back;
- the step compiled again with its inputs marked as static addresses
  (``torch._dynamo.mark_static_address``, as an engine's persistent input buffers allow), whose
  ``reduce-overhead`` call then copies no input into the graph's own buffers.
- without CUDA graphs (why a compiled step without graphs is slower than the eager one): the eager
  step with every public call sent through the dispatcher (``_library.DIRECT_CALLS = False``, the
  path compiled code always takes), right after the eager row and again after the static-address
  compile and ``torch._dynamo.reset()`` (``docs/integration.md``, "C++ wrapper"), and the step
  compiled with ``fullgraph=True`` in the default mode with inductor's Python wrapper and with its C++
  wrapper (``cpp_wrapper=True``), back to back and host time alone.

Each round builds fresh steps and compiles them again (``torch._dynamo.reset()`` in between). Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from torch_sparse_mla import _library
from torch_sparse_mla.demo import deepseek_v4, minimax_m3
from torch_sparse_mla.demo._common import capture_graph, compile_step


def _back_to_back(fn, iters: int = 50, reps: int = 5):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / iters * 1e6)
    return out


def _host_alone(fn, iters: int = 50):
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return out


def _events(fn, iters: int = 20):
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) * 1e3)
    return out


def _through_dispatcher(fn):
    """:func:`_back_to_back` of an eager step with every public call sent through the dispatcher."""
    with _library.dispatcher_calls():
        return _back_to_back(fn, iters=20)


def _study(name: str, model: torch.nn.Module, args: list, device: torch.device) -> None:
    _, compiled = compile_step(model, device)
    for _ in range(3):
        compiled(*args)
    graph = capture_graph(lambda: model(*args), device)
    torch.cuda.synchronize()
    rows = {
        "reduce-overhead, back to back": _back_to_back(lambda: compiled(*args)),
        "reduce-overhead, host time alone": _host_alone(lambda: compiled(*args)),
        "reduce-overhead, events around one call": _events(lambda: compiled(*args)),
        "torch.cuda.graph, replays back to back": _back_to_back(graph.replay),
        "torch.cuda.graph, events around one replay": _events(graph.replay),
        "eager, back to back": _back_to_back(lambda: model(*args), iters=20),
    }
    # right after the eager row, and again below after the static-address compile and a reset
    rows["eager through the dispatcher, next to eager"] = _through_dispatcher(lambda: model(*args))
    torch._dynamo.reset()
    for t in args:
        torch._dynamo.mark_static_address(t)
    _, static = compile_step(model, device)
    for _ in range(3):
        static(*args)
    torch.cuda.synchronize()
    rows["reduce-overhead, static inputs, back to back"] = _back_to_back(lambda: static(*args))
    rows["reduce-overhead, static inputs, host time alone"] = _host_alone(lambda: static(*args))
    torch._dynamo.reset()
    rows["eager through the dispatcher, after reset"] = _through_dispatcher(lambda: model(*args))
    for label, cpp in (("compiled, no graph", False), ("compiled, no graph, C++ wrapper", True)):
        torch._dynamo.reset()
        with torch._inductor.config.patch(cpp_wrapper=cpp):
            plain = torch.compile(model, fullgraph=True, dynamic=False)
            for _ in range(3):
                plain(*args)
            torch.cuda.synchronize()
            rows[f"{label}, back to back"] = _back_to_back(lambda: plain(*args), iters=20)
            rows[f"{label}, host time alone"] = _host_alone(lambda: plain(*args))
    for what, times in rows.items():
        print(f"{name:14s} {what:48s} min {min(times):8.1f}  median {statistics.median(times):8.1f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", choices=("m3", "v4"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("step_overhead.py: needs a CUDA GPU")
    device = torch.device("cuda")
    with torch.no_grad():
        for r in range(args.rounds):
            if args.only in (None, "m3"):
                cfg = minimax_m3.Config()
                gen = torch.Generator().manual_seed(1)
                batch = minimax_m3.Batch(cfg, gen, device)
                step = minimax_m3.MiniMaxM3Step(cfg, batch, device)
                minimax_m3.fill_history(step, batch, gen, device)
                _study(f"M3 fp8, round {r}", step, [batch.tensors[k] for k in minimax_m3.STEP_ARGS], device)
                del step
            if args.only in (None, "v4"):
                cfg = deepseek_v4.Config()
                gen = torch.Generator().manual_seed(0)
                batch = deepseek_v4.Batch(cfg, gen)
                step = deepseek_v4.DeepSeekV4Step(cfg, batch, device)
                deepseek_v4.fill_history(step, batch, gen, device)
                x = batch.step_inputs(0, gen, device)
                _study(f"V4, round {r}", step, [x[k] for k in deepseek_v4.STEP_ARGS], device)
                del step
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
