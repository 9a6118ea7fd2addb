"""One replayed call timed after two kinds of L2 flush (GPU only; not a test).

    python scripts/l2_state.py [--rounds 2]

The benchmark (``bench/common.py``, ``triton.testing.do_bench``) empties L2 before each replay by
writing zeros over a 256 MB buffer, which leaves L2 full of modified lines: the timed call's first
reads evict them, so its reads share the memory bus with write-backs that belong to the flush. Here
each call is captured in a CUDA graph and timed after that flush (``dirty``) and after a read of the
same 256 MB (``clean``, the benchmark's ``--clean-l2``), both through ``bench.common.graph_us``, in
alternating rounds, best of the rounds.

Cases: a graph of one trivial kernel (the replay floor), a 64 MB device copy (128 MB moved, about
the bytes of a float8 decode at T = 64), the sparse GQA decode of the benchmark (``bench/gqa.py``) at
T = 64 and 256 for both cache formats, with the compiled baseline at T = 64, and the two cache
writers. Prints microseconds per replay (median) under each flush and their difference.
"""

from __future__ import annotations

import argparse

import torch

from torch_sparse_mla.bench.common import graph_us
from torch_sparse_mla.bench.gqa import _decode_cases, _insert_case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best of them is printed")
    args = parser.parse_args()
    cases: list[tuple[str, object]] = []
    tiny = torch.zeros(1, device="cuda")
    cases.append(("trivial kernel", tiny.zero_))
    src = torch.randn(16 << 20, device="cuda")
    dst = torch.empty_like(src)
    cases.append(("copy 64 MB -> 64 MB", lambda: dst.copy_(src)))
    for case in _decode_cases("fp8", quick=False, device="cuda", smoke=False):
        if case.name.endswith(("T=64 q_len=1", "T=256 q_len=1")):
            cases.append((f"decode {case.name.split()[0]} {case.name.split()[-2]}", case.run))
            if "T=64 " in case.name:
                cases.append((f"baseline {case.name.split()[0]} {case.name.split()[-2]}", case.reference))
    for case in _decode_cases("nvfp4", quick=False, device="cuda", smoke=False):
        if case.name.endswith(("T=64 q_len=1", "T=256 q_len=1")):
            cases.append((f"decode {case.name.split()[0]} {case.name.split()[-2]}", case.run))
    for kv_format in ("fp8", "nvfp4"):
        cases.append((f"gqa_kv_cache_insert {kv_format}", _insert_case(kv_format, "cuda").run))

    best = {(name, clean): float("inf") for name, _ in cases for clean in (False, True)}
    for _ in range(args.rounds):
        for name, fn in cases:
            for clean in (False, True):
                best[name, clean] = min(best[name, clean], graph_us(fn, clean_l2=clean))
    print(f"{'call':<34} {'dirty µs':>9} {'clean µs':>9} {'dirty - clean':>14}")
    for name, _ in cases:
        d, c = best[name, False], best[name, True]
        print(f"{name:<34} {d:9.1f} {c:9.1f} {d - c:14.1f}")


if __name__ == "__main__":
    main()
