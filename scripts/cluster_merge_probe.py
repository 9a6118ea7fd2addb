"""What merging split partials inside a thread-block cluster costs, against a second kernel (GPU only,
sm_90; measured with Triton 3.6).

    python scripts/cluster_merge_probe.py [--rounds 3]

No decode runs here. ``G`` groups of ``S`` CTAs (4 warps each, with 100 KB of dynamic shared memory so
that two CTAs fit an SM, as the sparse-GQA decode's do) write the split partials of 16 heads (``m``,
``l`` and 16 x 128 float32 accumulators per CTA, as much as a decode CTA writes). Then, timed as
separate CUDA graphs under the benchmark's timer (L2 flushed before each replay):

- ``partials``: the CTAs end;
- ``partials, in clusters``: the same kernel launched as clusters of ``S`` CTAs;
- ``in clusters + merge``: after writing, every thread passes the cluster barrier
  (``barrier.cluster.arrive.release`` / ``wait.acquire``, inline PTX) and each CTA merges heads
  ``rank (mod S)`` of its group from the ``S`` partials into a bfloat16 output;
- ``partials + merge kernel``: the CTAs end and a second kernel of ``G x S`` programs does the same
  merge (a plain launch).

The kernels are built for one CTA per cluster; a cluster launch hands Triton's launch function
metadata whose ``num_ctas`` field is ``S``, so it sets the cluster dimension. Checks that the merged
outputs of the two forms are bitwise equal. Shapes stand for the benchmark's calls: T = 1, 4, 8, 16
and 24 rows of 4 KV heads with the split counts the planner gives them.
(``docs/sparse_gqa_hopper.md``, "Small T: what the combine costs".) Not a test.
"""

from __future__ import annotations

import argparse
import ctypes

import torch
import triton
import triton.language as tl

from torch_sparse_mla.bench.common import graph_us

HEADS, DIM = 16, 128
SMEM = 100 * 1024  # dynamic shared memory per CTA: two CTAs per SM, as the decode kernels
CASES = ((4, 16, 1), (16, 16, 4), (32, 8, 8), (64, 4, 16), (96, 2, 24))  # (G, S, the rows it stands for)


@triton.jit
def _cluster_rank_after_barrier(x):
    """Every thread (one element of ``x`` each) passes the cluster barrier; returns the CTA's rank."""
    return tl.inline_asm_elementwise(
        "mov.u32 $0, %cluster_ctarank; barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;",
        "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _merge(ws_ptr, ml_ptr, out_ptr, group, rank, S: tl.constexpr, PER_CTA: tl.constexpr, HB: tl.constexpr,
           D: tl.constexpr):
    heads = rank + S * tl.arange(0, PER_CTA)
    splits = group * S + tl.arange(0, S)
    m = tl.load(ml_ptr + splits[None, :] * 2 * HB + heads[:, None])
    l = tl.load(ml_ptr + splits[None, :] * 2 * HB + HB + heads[:, None])
    acc = tl.load(ws_ptr + (splits[None, :, None] * HB + heads[:, None, None]) * D + tl.arange(0, D)[None, None, :])
    w = tl.exp2(m - tl.max(m, 1)[:, None])
    o = tl.sum(acc * w[:, :, None], 1) / tl.sum(l * w, 1)[:, None]
    tl.store(out_ptr + (group * HB + heads[:, None]) * D + tl.arange(0, D)[None, :], o.to(tl.bfloat16))


@triton.jit
def _partials_kernel(ws_ptr, ml_ptr, out_ptr, S: tl.constexpr, MERGE: tl.constexpr, PER_CTA: tl.constexpr,
                     HB: tl.constexpr, D: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, HB)[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(ws_ptr + pid * HB * D + offs, (offs % 7).to(tl.float32) + pid)
    h = tl.arange(0, HB)
    tl.store(ml_ptr + pid * 2 * HB + h, (h % 3).to(tl.float32))
    tl.store(ml_ptr + pid * 2 * HB + HB + h, (h + 1).to(tl.float32))
    if MERGE:
        rank = tl.max(_cluster_rank_after_barrier(tl.arange(0, 128)), 0)  # 128 threads: one barrier each
        _merge(ws_ptr, ml_ptr, out_ptr, pid // S, rank, S, PER_CTA, HB, D)


@triton.jit
def _merge_kernel(ws_ptr, ml_ptr, out_ptr, S: tl.constexpr, PER_CTA: tl.constexpr, HB: tl.constexpr,
                  D: tl.constexpr):
    pid = tl.program_id(0)
    _merge(ws_ptr, ml_ptr, out_ptr, pid // S, pid % S, S, PER_CTA, HB, D)


def _launcher(kernel, n_ctas: int, cluster: int, tensors, meta):
    """A function launching ``kernel`` over ``n_ctas`` CTAs in clusters of ``cluster``."""
    compiled = kernel.warmup(*tensors, grid=(n_ctas,), num_warps=4, **meta)
    compiled._init_handles()
    driver = ctypes.CDLL("libcuda.so.1")
    assert driver.cuFuncSetAttribute(ctypes.c_void_p(compiled.function), 8, SMEM) == 0  # max dynamic smem
    packed = (compiled.packed_metadata[0], cluster, SMEM)  # (warps, CTAs per cluster, shared memory)
    values = dict(zip(kernel.arg_names, [t.data_ptr() for t in tensors]))
    args = [values[n] if n in values else meta[n] for n in kernel.arg_names]
    run = compiled.run

    def launch():
        stream = torch.cuda.current_stream().cuda_stream
        run(n_ctas // cluster, 1, 1, stream, compiled.function, packed, None, None, None, *args)

    return launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    print(torch.cuda.get_device_name(), "triton", triton.__version__)
    print("| G x S (rows) | partials | partials, in clusters | in clusters + merge | partials + merge kernel | "
          "outputs equal |\n|---|---|---|---|---|---|")
    for groups, splits, rows in CASES:
        n = groups * splits
        ws = torch.empty(n * HEADS * DIM, device="cuda")
        ml = torch.empty(n * 2 * HEADS, device="cuda")
        out = torch.empty(groups * HEADS * DIM, dtype=torch.bfloat16, device="cuda")
        meta = dict(S=splits, PER_CTA=HEADS // splits, HB=HEADS, D=DIM)
        plain = _launcher(_partials_kernel, n, 1, (ws, ml, out), dict(meta, MERGE=False))
        clustered = _launcher(_partials_kernel, n, splits, (ws, ml, out), dict(meta, MERGE=False))
        fused = _launcher(_partials_kernel, n, splits, (ws, ml, out), dict(meta, MERGE=True))
        merge = _launcher(_merge_kernel, n, 1, (ws, ml, out), meta)
        plain()
        merge()
        want = out.clone()
        out.zero_()
        fused()
        equal = torch.equal(out, want)

        def two_kernels():
            plain()
            merge()

        forms = (plain, clustered, fused, two_kernels)
        times = [[graph_us(f) for f in forms] for _ in range(opts.rounds)]  # the forms alternate
        cells = " | ".join(f"{min(t[i] for t in times):.2f}" for i in range(len(forms)))
        print(f"| {groups} x {splits} (T = {rows}) | {cells} | {equal} |", flush=True)


if __name__ == "__main__":
    main()
