"""How precisely Hopper's tensor cores add up float8 products, and what that leaves in the sparse-GQA
float8 decode (GPU only).

    python scripts/fp8_accumulation.py [--rows 8] [--trials 3]

1. Dot products of e4m3 values, ``K`` = 32 (one float8 ``wgmma`` step) and 128 (a sparse-GQA head, or
   one fp8_656 scale group of sparse MLA), through ``torch._scaled_mm`` (cuBLASLt's float8 GEMM, which
   runs the same tensor-core instruction), against float64 of the same values. The operands are exact
   e4m3 values, so every difference is the hardware's accumulation: the largest error relative to the
   largest result, and the median error relative to each result, with cuBLASLt's fast accumulation and
   without (it promotes partial sums to float32 every so many steps).
2. ``sparse_gqa_decode`` over a float8 cache on the benchmark's inputs (64 / 4 heads, 16 selected pages
   of 128): the Hopper kernel (``Q K^T`` a float8 product with the query as exact e4m3 pieces) and the
   portable Triton kernel (K converted to the query's dtype, products added in float32), each against
   the float32 gather-and-softmax expression of the CPU kernel run on the CPU: the largest error
   relative to the output's largest magnitude, and the two kernels against each other.

Not a test: it prints what ``docs/sparse_gqa.md`` ("Accuracy") and ``docs/sparse_mla_hopper.md`` ("Few heads
from a raw ring") quote.
"""

from __future__ import annotations

import argparse

import torch

from torch_sparse_mla.bench.gqa import _decode_inputs
from torch_sparse_mla.ops import sparse_gqa


def _pieces(q: torch.Tensor) -> torch.Tensor:
    """float32 rows scaled by a power of two into ``[2**7, 2**8)`` as two e4m3 pieces, stacked."""
    amax = q.abs().amax(1, keepdim=True)
    y = q * torch.exp2(7 - torch.floor(torch.log2(amax)))
    hi = y.to(torch.float8_e4m3fn)
    lo = (y - hi.float()).to(torch.float8_e4m3fn)
    return torch.cat([hi, lo], 0)


def tensor_core_sums(trials: int) -> None:
    one = torch.ones((), device="cuda")
    for k in (32, 128):
        for trial in range(trials):
            gen = torch.Generator(device="cuda").manual_seed(trial)
            a = (torch.randn(64, k, device="cuda", generator=gen) * 4).to(torch.float8_e4m3fn)
            b = _pieces(torch.randn(16, k, device="cuda", generator=gen).bfloat16().float())
            exact = a.double() @ b.double().T
            line = []
            for fast in (True, False):
                got = torch._scaled_mm(a, b.T, scale_a=one, scale_b=one, out_dtype=torch.float32,
                                       use_fast_accum=fast).double()
                err = (got - exact).abs()
                rel = (err / exact.abs().clamp_min(torch.finfo(torch.float64).tiny)).median().item()
                line.append(f"{'fast' if fast else 'promoted'}: largest {err.max().item() / exact.abs().max().item():.2e}"
                            f", median relative {rel:.2e}")
            print(f"e4m3 dot products K={k:3d}, trial {trial}: " + "; ".join(line))


def gqa_decode(rows: int) -> None:
    args, _, _ = _decode_inputs("fp8", rows, 1, seed=rows, device="cuda")
    ref = sparse_gqa.sparse_gqa_decode_dense(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    scale = ref.abs().max().item()
    outs = {}
    for path in ("hopper", "portable"):
        out = torch.empty_like(args[0])
        sparse_gqa.sparse_gqa_decode_triton(*args, out=out, path=path)
        outs[path] = out.float().cpu()
        err = (outs[path] - ref).abs().max().item()
        print(f"sparse_gqa_decode fp8 cache, T={rows}, {path:8s}: largest error / largest |out| {err / scale:.2e}")
    diff = (outs["hopper"] - outs["portable"]).abs().max().item()
    print(f"sparse_gqa_decode fp8 cache, T={rows}, hopper - portable: largest / largest |out| {diff / scale:.2e}"
          f" (bf16 spacing at 1: {2.0 ** -7:.2e}, half of it {2.0 ** -8:.2e})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8, help="query rows of the decode call")
    parser.add_argument("--trials", type=int, default=3, help="random operands per K")
    args = parser.parse_args(argv)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    tensor_core_sums(args.trials)
    gqa_decode(args.rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
