"""``python -m torch_sparse_mla.bench {mla,gqa,all} [--quick] [--out FILE]``

Times every configuration of the chosen families on the current GPU, next to the ``torch.compile``d
PyTorch reference in the same run, prints a Markdown table per family and, with ``--out``, writes them
to FILE with the date, GPU, library versions and commit.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

import torch

from torch_sparse_mla.bench.common import PEAK_BF16_FLOPS, PEAK_BYTES_PER_S, format_table, measure

FAMILIES = ("mla", "gqa")


def _commit() -> str:
    if os.environ.get("TSM_COMMIT"):
        return os.environ["TSM_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cases(family: str, quick: bool):
    if family == "mla":
        from torch_sparse_mla.bench import mla as module
    else:
        from torch_sparse_mla.bench import gqa as module
    return module.cases(quick=quick)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_sparse_mla.bench", description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=FAMILIES + ("all",))
    parser.add_argument("--quick", action="store_true", help="fewer, smaller configurations")
    parser.add_argument("--out", help="write the tables (Markdown) to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("torch_sparse_mla.bench: needs a CUDA GPU (the benchmark times the Triton kernels)", file=sys.stderr)
        return 2
    import triton

    header = (
        f"date {datetime.date.today().isoformat()}, GPU {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, triton {triton.__version__}, commit {_commit()}; "
        f"roofline ceilings {PEAK_BYTES_PER_S / 1e12:.1f} TB/s and {PEAK_BF16_FLOPS / 1e12:.0f} bf16 TFLOP/s "
        "(measured copy bandwidth and matmul rate of this H200 kind)"
    )
    print(header, flush=True)
    sections = []
    for family in FAMILIES if args.family == "all" else (args.family,):
        rows = []
        for case in _cases(family, args.quick):
            row = measure(case)
            rows.append(row)
            print(f"  {family}: {row['config']}: {row['us']:.1f} us ({row['roofline']:.0%} of roofline), "
                  f"reference {row['ref_us']:.1f} us", flush=True)
            del case
            torch.cuda.empty_cache()
        table = format_table(rows)
        print(f"\n### {family}\n\n{table}\n", flush=True)
        sections.append(f"### {family}\n\n{table}\n")
    if args.out:
        with open(args.out, "w") as f:
            f.write(header + "\n\n" + "\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
