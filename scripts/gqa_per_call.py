"""Per-call time of the sparse GQA operators without the one-call replay floor (GPU only).

    python scripts/gqa_per_call.py [--calls 8] [--rows 1 16 64]

The benchmark (``python -m torch_sparse_mla.bench gqa``) replays one call per CUDA graph, which costs
4.5-4.9 µs on an H200 even for an empty kernel. Here each configuration is also captured as a graph of
``--calls`` calls, every call on its own inputs (its own cache, page selections, query and output for
the decode; its own K, V and slots for the writers), so no call finds another's bytes in L2 and the
graph's launch cost is shared by all of them. Per configuration: the one-call time (the benchmark's
timer), the per-call time of the long graph, and the K/V bytes one call reads over that time. Between
two kernels of one graph there is still a gap (a graph of twenty trivial kernels: about 1.3 µs per
kernel), printed last. Shapes are the benchmark's (``bench/gqa.py``). Not a test.
"""

from __future__ import annotations

import argparse

import torch

from torch_sparse_mla import gqa_kv_cache_insert, sparse_gqa_decode
from torch_sparse_mla.bench.common import graph_us
from torch_sparse_mla.bench.gqa import (FORMATS, INSERT_SCALES, KEY_BYTES, _decode_inputs, insert_bytes,
                                        insert_inputs)


def _decode(inputs):
    (q, kv_cache, topk_pages, block_table, kv_lens, qo, dql, scale), out = inputs
    sparse_gqa_decode(q, kv_cache, topk_pages, block_table, kv_lens, qo, decode_query_len=dql, softmax_scale=scale,
                      out=out)


def _report(name: str, sets: list, call, mbytes: float) -> None:
    one = min(graph_us(lambda: call(sets[0])) for _ in range(2))

    def many():
        for inputs in sets:
            call(inputs)

    per = min(graph_us(many) for _ in range(2)) / len(sets)
    print(f"{name:<34} one call per graph {one:6.1f} µs   {len(sets)} per graph {per:6.1f} µs per call   "
          f"{mbytes:7.1f} MB -> {mbytes / per:5.2f} TB/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=8, help="calls per graph, each on its own inputs")
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 16, 64], help="decode rows T (one token each)")
    args = parser.parse_args()
    for kv_format in FORMATS:
        for rows in args.rows:
            sets, keys = [], 0
            for i in range(args.calls):
                decode_args, _, n = _decode_inputs(kv_format, rows, 1, seed=1000 + 17 * i + rows, device="cuda")
                sets.append((decode_args, torch.empty_like(decode_args[0])))
                keys += n
            _report(f"decode {kv_format} T={rows}", sets, _decode, keys / args.calls * KEY_BYTES[kv_format] / 1e6)
            del sets
            torch.cuda.empty_cache()
        sets = [insert_inputs(kv_format, "cuda", seed=7 + i) for i in range(args.calls)]
        k_scale, v_scale = INSERT_SCALES
        _report(f"gqa_kv_cache_insert {kv_format}", sets,
                lambda s: gqa_kv_cache_insert(*s, k_scale=k_scale, v_scale=v_scale), insert_bytes(kv_format) / 1e6)
        del sets
    tiny = torch.zeros(1, device="cuda")

    def twenty():
        for _ in range(20):
            tiny.zero_()

    print(f"a trivial kernel: one per graph {graph_us(lambda: tiny.zero_()):.2f} µs, "
          f"twenty per graph {graph_us(twenty) / 20:.2f} µs each")


if __name__ == "__main__":
    main()
