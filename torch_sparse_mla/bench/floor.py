"""The *floor* of a benchmark row: a kernel that moves the row's byte count and does nothing else.

A call that must read ``R`` bytes and write ``W`` (the case's ``bytes - written`` and ``written``)
cannot replay faster than a kernel that streams ``R`` bytes from contiguous memory and writes ``W``,
timed under the same timer (CUDA-graph replay after the same L2 flush, including the graph's own
replay cost). The benchmark times that kernel for every row (columns ``floor µs`` and
``floor / ours``), so each row states how close the operator comes to what this GPU does with those
bytes, in the same run. Contiguous streaming is the easiest access pattern there is: the operators
gather rows from scattered pages and wait on index loads first, which only adds time.

Program ``p`` of the kernel reads ``READ`` int32 at ``src + p * READ`` (masked at the end) and writes
``WRITE`` int32 at ``dst + p * WRITE``, each the sum of its loads plus its position, so no load can be
dropped by the compiler. A row with nothing written still writes one int32 per program (4 bytes per
16 KB read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

READ = 4096  # int32 read by one program (16 KB)


@triton.jit
def _stream_kernel(src, dst, n_read, n_write, READ: tl.constexpr, WRITE: tl.constexpr, EVICT: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    r = pid * READ + tl.arange(0, READ)
    v = tl.load(src + r, mask=r < n_read, other=0, eviction_policy=EVICT)
    s = tl.sum(v, axis=0)
    w = pid * WRITE + tl.arange(0, WRITE)
    tl.store(dst + w, s + w.to(tl.int32), mask=w < n_write)


def plan(read_bytes: float, write_bytes: float = 0.0) -> tuple[int, int, int, int]:
    """``(programs, write per program, int32 read, int32 written)`` for a call that reads at least
    ``read_bytes`` and writes at least ``write_bytes`` (whole int32; at least one per program)."""
    n_read = max(1, -(-int(read_bytes) // 4))
    n_write = max(0, -(-int(write_bytes) // 4))
    programs = max(-(-n_read // READ), -(-n_write // READ))
    write = triton.next_power_of_2(max(1, -(-n_write // programs)))
    n_write = max(n_write, programs)
    return programs, write, n_read, n_write


def stream_floor(read_bytes: float, write_bytes: float = 0.0, evict_first: bool = False, device: str = "cuda"):
    """One call of the streaming kernel on buffers of its own: reads ``read_bytes`` and writes
    ``write_bytes`` (``evict_first``: its loads marked first to evict from L2). Returns ``(run,
    src, dst)``: ``run()`` launches it."""
    programs, write, n_read, n_write = plan(read_bytes, write_bytes)
    src = torch.randint(0, 1 << 16, (n_read,), device=device, dtype=torch.int32)
    dst = torch.empty(n_write, device=device, dtype=torch.int32)
    policy = "evict_first" if evict_first else ""

    def run():
        _stream_kernel[(programs,)](src, dst, n_read, n_write, READ=READ, WRITE=write, EVICT=policy, num_warps=8)

    return run, src, dst
