"""Time launch configurations of the sparse MLA decode kernel on the benchmark's shapes (GPU only).

    python scripts/sweep_mla.py [--quick]

Prints one line per (configuration, variant): microseconds and the error against the default variant.
Used to choose the defaults of ``ops/sparse_mla.py::_plan``; not a test and not part of the benchmark.
"""

import argparse

import torch

from torch_sparse_mla.bench import mla
from torch_sparse_mla.bench.common import graph_us
from torch_sparse_mla.ops.sparse_mla import sparse_mla_decode_triton

VARIANTS = {
    "default": {},
    "bn64": dict(block_n=64),
    "w4": dict(num_warps=4),
    "bn64_w4_s1": dict(block_n=64, num_warps=4, num_stages=1),
    "bn16_w4": dict(block_n=16, num_warps=4),
    "h128_w16": dict(block_h=128, num_warps=16),
    "s1": dict(num_stages=1),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    names = ("q", "kv_cache", "indices", "softmax_scale", "kv_format", "head_dim_v", "topk_length", "attn_sink",
             "extra_kv_cache", "extra_indices", "extra_topk_length")
    for i, (label, kv_format, num_heads, k, k_extra, num_tokens) in enumerate(mla.CONFIGS):
        if args.quick and i not in mla.QUICK:
            continue
        kwargs = mla._inputs(kv_format, num_heads, k, k_extra, num_tokens, "cuda")
        call_args = [kwargs.get(n) for n in names]
        base = None
        for variant in args.variants.split(","):
            cfg = VARIANTS[variant]
            if cfg.get("block_h", 0) > triton_next_pow2(num_heads):
                continue
            out = torch.empty(num_tokens, num_heads, 512, dtype=torch.bfloat16, device="cuda")
            lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device="cuda")

            def run(out=out, lse=lse, cfg=cfg):
                sparse_mla_decode_triton(*call_args, out=out, lse=lse, config=cfg)

            try:
                us = graph_us(run)
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported
                print(f"{label} H={num_heads} T={num_tokens} {variant}: failed ({type(exc).__name__}: "
                      f"{str(exc)[:120]})", flush=True)
                continue
            base = out.float() if base is None else base
            err = ((out.float() - base).norm() / base.norm()).item()
            print(f"{label} H={num_heads} K={k}+{k_extra} T={num_tokens} {variant:>12}: {us:8.1f} us  "
                  f"(diff vs default {err:.1e})", flush=True)


def triton_next_pow2(n):
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    main()
