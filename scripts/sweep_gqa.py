"""Time launch configurations of the sparse GQA kernels on the benchmark's shapes (GPU only).

    python scripts/sweep_gqa.py [fp8|nvfp4|insert ...]

One line per (configuration, variant): microseconds (median of CUDA-graph replays) and the relative
difference from the default variant's output. Used to choose the defaults of
``ops/sparse_gqa.py::launch_config`` (and ``insert_plan``); not a test, not the benchmark.
"""

import sys

import torch

from torch_sparse_mla.bench import gqa
from torch_sparse_mla.bench.common import graph_us
from torch_sparse_mla.ops import sparse_gqa as ops

# Decode variants: LaunchPlan overrides (block_n: keys per tile; value caches use one key group per
# warp up to block_n / 16 groups, or the transposed products where `transposed` is set) and split
# counts, each split count in the plan's own tile form and in both forms forced.
DECODE_VARIANTS = {
    "default": {},
    "keygroups": dict(transposed=False),
    "transposed": dict(transposed=True),
    "bn128": dict(block_n=128),
    "bn64": dict(block_n=64),
    "w8": dict(num_warps=8),
    "bn128_w8": dict(block_n=128, num_warps=8),
    "s2": dict(num_stages=2),
    "s4": dict(num_stages=4),
    "bn128_s2": dict(block_n=128, num_stages=2),
}
# The Hopper kernel (float8 caches on sm_90, ops/sparse_gqa_hopper.py): ring depths and split counts.
HOPPER_VARIANTS = {"hopper": {}, "hopper_s2": dict(num_stages=2), "hopper_s3": dict(num_stages=3)}
HOPPER_SPLITS = (1, 2, 4, 8, 16)
SPLIT_VARIANTS = (1, 2, 3, 4, 6, 8, 16)
FORMS = {"": {}, "_kg": dict(transposed=False), "_tr": dict(transposed=True)}
INSERT_PLANS = ((4, 1), (8, 1), (8, 2), (16, 2), (16, 4), (32, 4))  # (rows per program, warps)


def sweep_decode(kv_format):
    for decode_query_len in gqa.QUERY_LENS:
        for num_rows in gqa.ROWS:
            if num_rows % decode_query_len:
                continue
            args, _, _ = gqa._decode_inputs(kv_format, num_rows, decode_query_len,
                                            seed=num_rows * 10 + decode_query_len, device="cuda")
            base = None
            variants = [(name, cfg, None, "portable") for name, cfg in DECODE_VARIANTS.items()]
            variants += [(f"splits{s}{form}", cfg, s, "portable") for s in SPLIT_VARIANTS for form, cfg in FORMS.items()]
            if ops.kernel_path(args[0], args[1]) == "hopper":
                variants += [(name, cfg, None, "hopper") for name, cfg in HOPPER_VARIANTS.items()]
                variants += [(f"hopper_splits{s}", {}, s, "hopper") for s in HOPPER_SPLITS]
            for name, cfg, splits, path in variants:
                out = torch.empty_like(args[0])

                def run(out=out, cfg=cfg, splits=splits, path=path):
                    ops.sparse_gqa_decode_triton(*args, out=out, config=cfg, num_splits=splits, path=path)

                try:
                    us = graph_us(run)
                except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported
                    print(f"{kv_format} T={num_rows} q_len={decode_query_len} {name}: failed ({type(exc).__name__})",
                          flush=True)
                    continue
                base = out.float() if base is None else base
                err = ((out.float() - base).norm() / base.norm()).item()
                print(f"{kv_format} T={num_rows:>3} q_len={decode_query_len} {name:>12}: {us:7.1f} us (diff {err:.1e})",
                      flush=True)


def sweep_insert():
    k_scale, v_scale = gqa.INSERT_SCALES
    for kv_format in gqa.FORMATS:
        k, v, slots, cache = gqa.insert_inputs(kv_format, "cuda")  # the benchmark's inputs
        for rows, warps in INSERT_PLANS:
            def run(rows=rows, warps=warps):
                ops.gqa_kv_cache_insert_triton(k, v, slots, cache, k_scale, v_scale, block_r=rows, num_warps=warps)

            print(f"insert {kv_format} N={gqa.INSERT_TOKENS} rows/program={rows:>3} warps={warps}: "
                  f"{graph_us(run):7.1f} us", flush=True)


def main(argv):
    what = argv or ["fp8", "nvfp4", "insert"]
    for item in what:
        if item == "insert":
            sweep_insert()
        else:
            sweep_decode(item)


if __name__ == "__main__":
    main(sys.argv[1:])
