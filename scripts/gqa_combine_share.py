"""What the split combine adds to a split sparse-GQA decode call (GPU only).

    python scripts/gqa_combine_share.py [--rows 1 4 16] [--rounds 3]

For each cache format and row count (one query token per request, the benchmark's inputs and seeds,
``bench/gqa.py``), times under the benchmark's timer (one call per CUDA graph, L2 flushed before each
replay) the call as shipped (decode + combine) and a graph of its decode launch alone, which writes the
split partials and leaves the output unmerged. The difference is the combine's share of the replay
(``docs/sparse_gqa_hopper.md``, "Small T: what the combine costs"). Rows whose plan has one split have
no combine and are skipped. Not a test.
"""

from __future__ import annotations

import argparse

import torch

from torch_sparse_mla import sparse_gqa_decode
from torch_sparse_mla.bench import gqa
from torch_sparse_mla.bench.common import graph_us
from torch_sparse_mla.ops import sparse_gqa as ops_gqa
from torch_sparse_mla.ops._launch import scratch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    print("| format | T | splits | call µs | decode alone µs | combine µs |\n|---|---|---|---|---|---|")
    for kv_format in gqa.FORMATS:
        for rows in opts.rows:
            args, _, _ = gqa._decode_inputs(kv_format, rows, 1, seed=rows * 10 + 1, device="cuda")
            q, cache, topk, table, kv_lens, qo, query_len, scale = args
            out = torch.empty_like(q)

            def call():
                return sparse_gqa_decode(q, cache, topk, table, kv_lens, qo, decode_query_len=query_len,
                                         softmax_scale=scale, out=out)

            ops_gqa._PLANS.clear()
            call()
            # the decode plan's entry: (workspace numel, decode launch, combine launch or None)
            entry = [e for e in ops_gqa._PLANS.values() if isinstance(e, tuple) and len(e) == 3][-1]
            ws_numel, decode, combine = entry
            if combine is None:
                print(f"| {kv_format} | {rows} | 1 | | | no combine |")
                continue
            ws = scratch(ws_numel, torch.float32, q.device)

            def decode_alone():
                decode(q, cache, topk, table, kv_lens, qo, out, out, out, ws)  # no scale tensors

            times = [(graph_us(call), graph_us(decode_alone)) for _ in range(opts.rounds)]
            whole, alone = min(t[0] for t in times), min(t[1] for t in times)
            splits = decode.grid[0] // (rows * gqa.HKV)
            print(f"| {kv_format} | {rows} | {splits} | {whole:.1f} | {alone:.1f} | {whole - alone:.1f} |", flush=True)


if __name__ == "__main__":
    main()
