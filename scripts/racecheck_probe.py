"""What compute-sanitizer's racecheck takes as ordering in a warp-specialised Gluon kernel.

A producer partition (4 warps) writes a [32, 64] int32 tile into one of two shared-memory stages and
hands it to the default partition (4 warps) through an mbarrier; the consumer reads it back, writes it
to global memory and frees the stage through a second mbarrier. Eight rounds per CTA, four CTAs.

  DATA  0: the producer writes the tile with plain stores
        1: with cp.async (global -> shared)
        2: no tile at all (the partitions only wait and arrive)
  PROD, FREE: how the stage is handed over, and freed
        0: a partition barrier, then one thread's mbarrier.arrive (count 1): the kernels' usual form
        1: every thread's cp.async.mbarrier.arrive.noinc (count 128)
        2: both (count 129): what ops/sparse_gqa_hopper.py's ``_release`` does

usage (sm_90, from the repository root):
  compute-sanitizer --tool racecheck --racecheck-report analysis python scripts/racecheck_probe.py DATA PROD FREE
  python scripts/racecheck_probe.py --compile   # no GPU: every form compiles for sm_90a, with its arrivals

Results on an H200 (docs/testing.md): 0 0 0 reports the tile's stores against the consumer's loads;
1 0 0, 0 1 1, 0 2 2, 1 1 1, 1 2 2 do not; every form, 2 0 0 and 2 1 1 included, reports one hazard of
Triton's ``warp_specialize`` start-up (accesses attributed to the kernel's first line and to the
``warp_specialize`` call), which involves no buffer of the kernel's own.
"""
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, mbarrier

_barrier = getattr(gl, "barrier", None) or getattr(gl, "thread_barrier")
# triton 3.8 added async_load, 3.9 removed async_copy_global_to_shared (as in ops/sparse_mla_hopper.py)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
TILE: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])


@gluon.jit
def _hand_over(bar, FORM: gl.constexpr):
    if FORM != 1:
        _barrier()
        mbarrier.arrive(bar)
    if FORM != 0:
        async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _offsets():
    rows = gl.arange(0, 32, layout=gl.SliceLayout(1, TILE))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, TILE))
    return rows[:, None] * 64 + cols[None, :]


@gluon.jit
def _producer(src_ptr, stages, bars, DATA: gl.constexpr, PROD: gl.constexpr, ROUNDS: gl.constexpr):
    offs = _offsets()
    for i in range(ROUNDS):
        s = i % 2
        if i >= 2:
            mbarrier.wait(bars.index(2 + s), ((i - 2) // 2) & 1)  # the consumer freed stage s
        if DATA == 0:
            stages.index(s).store(gl.load(src_ptr + i * 2048 + offs))
        elif DATA == 1:
            _async_load(stages.index(s), src_ptr + i * 2048 + offs)
            if PROD != 1:  # a one-thread arrive needs every thread's copies landed first
                async_copy.commit_group()
                async_copy.wait_group(0)
        _hand_over(bars.index(s), PROD)


@gluon.jit
def _consumer(out_ptr, stages, bars, DATA: gl.constexpr, FREE: gl.constexpr, ROUNDS: gl.constexpr):
    offs = _offsets()
    for i in range(ROUNDS):
        s = i % 2
        mbarrier.wait(bars.index(s), (i // 2) & 1)
        if DATA != 2:
            gl.store(out_ptr + i * 2048 + offs, stages.index(s).load(TILE))
        _hand_over(bars.index(2 + s), FREE)


@gluon.jit
def _probe_kernel(src_ptr, out_ptr, DATA: gl.constexpr, PROD: gl.constexpr, FREE: gl.constexpr,
                  ROUNDS: gl.constexpr):
    src_ptr += gl.program_id(0) * ROUNDS * 2048
    out_ptr += gl.program_id(0) * ROUNDS * 2048
    stages = gl.allocate_shared_memory(gl.int32, [2, 32, 64], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(bars.index(s), count=(1, 128, 129)[PROD])  # stage s written
        mbarrier.init(bars.index(2 + s), count=(1, 128, 129)[FREE])  # stage s free
    _barrier()
    gl.warp_specialize([(_consumer, (out_ptr, stages, bars, DATA, FREE, ROUNDS)),
                        (_producer, (src_ptr, stages, bars, DATA, PROD, ROUNDS))], [4], [80])


FORMS = [(d, p, f) for d in range(3) for p, f in ((0, 0), (1, 1), (2, 2))]


def arrivals(ptx: str) -> tuple[int, int]:
    """mbarrier arrivals in PTX: one thread's (Gluon's ``mbarrier.arrive``, predicated on the thread
    index) and every thread's own (``cp.async.mbarrier.arrive.noinc``)."""
    import re

    one = len(re.findall(r"^\s*@%p\d+ mbarrier\.arrive\.", ptx, re.M))
    every = len(re.findall(r"^\s*cp\.async\.mbarrier\.arrive\.noinc\.", ptx, re.M))
    return one, every


def compile_forms() -> int:
    """Compile every form for sm_90a (no GPU needed) and check the PTX's arrivals: a one-thread
    ``mbarrier.arrive`` exactly in forms 0 and 2, every thread's ``cp.async.mbarrier.arrive.noinc``
    exactly in forms 1 and 2."""
    import triton
    from triton.backends.compiler import GPUTarget

    bad = 0
    for data, prod, free in FORMS:
        src = gluon._runtime.GluonASTSource(
            _probe_kernel, signature={"src_ptr": "*i32", "out_ptr": "*i32", "DATA": "constexpr", "PROD": "constexpr",
                                      "FREE": "constexpr", "ROUNDS": "constexpr"},
            constexprs={"DATA": data, "PROD": prod, "FREE": free, "ROUNDS": 8},
            attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        one, every = arrivals(ptx)
        ok = (one > 0) == (prod != 1) and (every > 0) == (prod != 0)
        bad += not ok
        print(f"DATA={data} PROD={prod} FREE={free}: one-thread arrives {one}, per-thread arrives {every}"
              f"{'' if ok else '  UNEXPECTED'}", flush=True)
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compile"]:
        return compile_forms()
    data, prod, free = (int(a) for a in argv)
    ctas, rounds = 4, 8
    src = torch.randint(0, 1 << 30, (ctas * rounds * 2048,), dtype=torch.int32, device="cuda")
    out = torch.zeros_like(src)
    _probe_kernel[(ctas,)](src, out, DATA=data, PROD=prod, FREE=free, ROUNDS=rounds, num_warps=4)
    torch.cuda.synchronize()
    ok = torch.equal(out, src) if data != 2 else bool((out == 0).all())
    print(f"DATA={data} PROD={prod} FREE={free}: {'correct' if ok else 'WRONG'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:4]))
