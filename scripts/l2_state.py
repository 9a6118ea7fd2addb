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
T = 1, 16, 64 and 256 for the float8 cache and 64 and 256 for NVFP4, with the compiled baseline at
T = 64, and the two cache writers. Prints microseconds per replay (median) under each flush and their
difference.

Each decode and writer case also has its *floor*: a streaming kernel that reads (and, for a writer,
writes) the case's byte count (``Case.bytes``, the benchmark's count) from contiguous memory and does
nothing else (``bench/floor.py``, the kernel of the benchmark's floor column), captured and timed the
same way. No kernel that moves those bytes replays faster under the same timer. The read floors are
timed twice: with plain loads, and with loads that mark their lines first to evict from L2
(``eviction_policy="evict_first"``), so that they evict each other rather than the flush's modified
lines.
"""

from __future__ import annotations

import argparse

import torch

from torch_sparse_mla.bench.common import graph_us
from torch_sparse_mla.bench.floor import stream_floor as _stream_floor
from torch_sparse_mla.bench.gqa import HKV, INSERT_TOKENS, KEY_BYTES, _decode_cases, _insert_case, insert_bytes


def stream_floor(read_bytes: float, write_bytes: float = 0.0, evict_first: bool = False):
    """The benchmark's floor kernel (``bench/floor.py``) reading ``read_bytes`` and writing ``write_bytes``."""
    return _stream_floor(read_bytes, write_bytes, evict_first)[0]


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
    for kv_format, rows in (("fp8", ("T=1", "T=16", "T=64", "T=256")), ("nvfp4", ("T=64", "T=256"))):
        for case in _decode_cases(kv_format, quick=False, device="cuda", smoke=False):
            if not case.name.endswith(tuple(f"{r} q_len=1" for r in rows)):
                continue
            name = f"decode {kv_format} {case.name.split()[-2]}"
            cases.append((name, case.run))
            if kv_format == "fp8" and "T=64 " in case.name:
                cases.append((f"baseline {kv_format} {case.name.split()[-2]}", case.reference))
            mb = case.bytes / 1e6
            cases.append((f"  floor: read {mb:.1f} MB", stream_floor(case.bytes)))
            cases.append((f"  floor: read {mb:.1f} MB, evict_first", stream_floor(case.bytes, evict_first=True)))
    for kv_format in ("fp8", "nvfp4"):
        cases.append((f"gqa_kv_cache_insert {kv_format}", _insert_case(kv_format, "cuda").run))
        written = KEY_BYTES[kv_format] * INSERT_TOKENS * HKV
        read = insert_bytes(kv_format) - written  # bf16 K and V, the slots
        cases.append((f"  floor: read {read / 1e6:.1f} MB, write {written / 1e6:.1f} MB",
                      stream_floor(read, written)))

    best = {(name, clean): float("inf") for name, _ in cases for clean in (False, True)}
    for _ in range(args.rounds):
        for name, fn in cases:
            for clean in (False, True):
                best[name, clean] = min(best[name, clean], graph_us(fn, clean_l2=clean))
    print(f"{'call':<44} {'dirty µs':>9} {'clean µs':>9} {'dirty - clean':>14}")
    for name, _ in cases:
        d, c = best[name, False], best[name, True]
        print(f"{name:<44} {d:9.1f} {c:9.1f} {d - c:14.1f}")


if __name__ == "__main__":
    main()
