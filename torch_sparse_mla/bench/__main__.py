"""python -m torch_sparse_mla.bench {mla,gqa,metadata,kv_cache,all} [--quick] [--out FILE]

Times every configuration of the chosen families on the current GPU next to the same operation in
plain PyTorch (bench/baselines.py, compiled with fullgraph=True), both replayed from CUDA graphs in
the same run, and prints a Markdown table per family plus a host-overhead table (eager against
graph time at T = 1). Each row also gets its floor: a kernel that only streams the row's bytes,
timed the same way (--no-floors skips it). With --out the tables go to FILE with the date, GPU,
versions, commit and ceilings, and a roofline plot to FILE's name with a .png suffix (when
matplotlib is installed). The roofline ceilings are measured at start unless --peak-tflops and
--peak-tbps are given.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import subprocess
import sys

import torch

from torch_sparse_mla.bench.common import (HOST_PASSES, format_host_overhead, format_table, measure, measure_peaks,
                                           plot_roofline, remeasure_host)

FAMILIES = ("mla", "gqa", "metadata", "kv_cache")
TITLES = {"mla": "sparse_mla_decode", "gqa": "sparse_gqa_decode", "metadata": "metadata operators",
          "kv_cache": "kv_cache_insert / kv_cache_gather"}


def _commit() -> str:
    if os.environ.get("TSM_COMMIT"):
        return os.environ["TSM_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=os.path.dirname(os.path.abspath(__file__)),
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _gpu() -> str | None:
    """The GPU the benchmark times, or None without one."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torch_sparse_mla.bench",
                                description=" ".join(__doc__.splitlines()[2:]))
    p.add_argument("family", choices=FAMILIES + ("all",))
    p.add_argument("--quick", action="store_true", help="fewer configurations")
    p.add_argument("--out", help="write the tables (Markdown) to this file, the roofline plot beside it")
    p.add_argument("--peak-tflops", type=float, help="compute ceiling in TFLOP/s (default: measured)")
    p.add_argument("--peak-tbps", type=float, help="memory ceiling in TB/s (default: measured)")
    p.add_argument("--calls-per-graph", type=int, default=1,
                   help="calls captured per CUDA graph; times are per call (default 1)")
    p.add_argument("--clean-l2", action="store_true",
                   help="also time both graphs with L2 emptied by a read instead of a write of zeros (columns "
                        "'clean L2')")
    p.add_argument("--no-floors", action="store_true",
                   help="skip the floor columns (a kernel that only streams each row's bytes, timed the same way)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    gpu = _gpu()
    if gpu is None:
        print("torch_sparse_mla.bench: needs a CUDA GPU (it times the Triton kernels)", file=sys.stderr)
        return 2
    from torch_sparse_mla.ops._triton import HAS_TRITON, triton

    if not HAS_TRITON:
        print("torch_sparse_mla.bench: needs Triton (it times the Triton kernels; pip install triton)",
              file=sys.stderr)
        return 2

    # Each reference function is compiled once per configuration (static shapes): allow that many.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    peaks = measure_peaks(args.peak_tflops, args.peak_tbps)
    header = (f"date {datetime.date.today().isoformat()}, GPU {gpu}, "
              f"torch {torch.__version__}, triton {triton.__version__}, commit {_commit()}; roofline ceilings "
              f"{peaks.bytes / 1e12:.2f} TB/s and {peaks.flops / 1e12:.0f} bf16 TFLOP/s ({peaks.how}); "
              f"{args.calls_per_graph} call(s) per CUDA graph"
              + ("; also timed with L2 emptied by a read (clean L2)" if args.clean_l2 else ""))
    print(header, flush=True)
    family_rows, all_rows, host_rows = [], [], []
    for family in FAMILIES if args.family == "all" else (args.family,):
        module = importlib.import_module(f"torch_sparse_mla.bench.{family}")
        rows = []
        for case in module.cases(quick=args.quick):
            row = measure(case, peaks, args.calls_per_graph, args.clean_l2, floors=not args.no_floors)
            rows.append(row)
            if case.host_overhead:  # timed eagerly again at the end (remeasure_host)
                host_rows.append((case, row))
            print(f"  {family}: {row['config']}: {row['us']:.1f} us graph, {row['eager_us']:.1f} us eager "
                  f"({row['roofline']:.0%} of roofline); reference {row['ref_us']:.1f} us; floor "
                  f"{row.get('floor_us', float('nan')):.1f} us {row['note']}", flush=True)
            del case
            torch.cuda.empty_cache()
        table = format_table(rows)
        print(f"\n### {TITLES[family]}\n\n{table}\n", flush=True)
        family_rows.append((family, rows))
        all_rows += rows
    if host_rows:
        print(f"host overhead: {HOST_PASSES} more eager passes over the {len(host_rows)} T = 1 rows", flush=True)
        remeasure_host(host_rows)
        host_rows.clear()
    # the family tables again: the T = 1 rows' eager column is now the fastest of all their measurements
    sections = [f"### {TITLES[family]}\n\n{format_table(rows)}\n" for family, rows in family_rows]
    overhead = format_host_overhead(all_rows)
    print(f"\n### Host overhead (T = 1)\n\n{overhead}\n", flush=True)
    sections.append(f"### Host overhead (T = 1)\n\n{overhead}\n")
    if args.out:
        with open(args.out, "w") as f:
            f.write(header + "\n\n" + "\n".join(sections))
        print(f"tables written to {args.out}")
        print(plot_roofline(all_rows, peaks, os.path.splitext(args.out)[0] + ".png", header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
