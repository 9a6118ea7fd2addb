"""Time launch configurations of the sparse GQA decode kernel on the benchmark's shapes (GPU only).

    python scripts/sweep_gqa.py

One line per (configuration, variant): microseconds and the difference from the default variant.
Used to choose the defaults of ``ops/sparse_gqa.py::launch_config``; not a test, not the benchmark.
"""

import torch

from torch_sparse_mla.bench import gqa
from torch_sparse_mla.bench.common import graph_us
from torch_sparse_mla.ops.sparse_gqa import sparse_gqa_decode_triton

VARIANTS = {
    "default": {},
    "w4": dict(num_warps=4),
    "w4_s2": dict(num_warps=4, num_stages=2),
    "w4_s4": dict(num_warps=4, num_stages=4),
    "bn128_w4": dict(block_n=128, num_warps=4, num_stages=2),
    "bn128_w8": dict(block_n=128, num_warps=8, num_stages=2),
    "bn32_w4": dict(block_n=32, num_warps=4),
    "w8_s2": dict(num_warps=8, num_stages=2),
}


def main():
    for decode_query_len in gqa.QUERY_LENS:
        for num_rows in gqa.ROWS:
            if num_rows % decode_query_len:
                continue
            args, _ = gqa._inputs(num_rows, decode_query_len, seed=num_rows * 10 + decode_query_len, device="cuda")
            base = None
            for name, cfg in VARIANTS.items():
                out = torch.empty_like(args[0])

                def run(out=out, cfg=cfg):
                    sparse_gqa_decode_triton(*args, out=out, config=cfg)

                try:
                    us = graph_us(run)
                except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported
                    print(f"T={num_rows} q_len={decode_query_len} {name}: failed ({type(exc).__name__})", flush=True)
                    continue
                base = out.float() if base is None else base
                err = ((out.float() - base).norm() / base.norm()).item()
                print(f"T={num_rows:>3} q_len={decode_query_len} {name:>9}: {us:7.1f} us (diff {err:.1e})", flush=True)


if __name__ == "__main__":
    main()
