"""Benchmark cases of sparse_gqa_decode: MiniMax-M3 MSA decode shapes.

Hq = 64 query heads over Hkv = 4 KV heads, head_dim 128, pages of 128 tokens, 16 selected pages per
(row, KV head), float8_e4m3fn cache and bfloat16 queries; T rows in {1, 16, 64, 256} with 1 or 4 query
tokens per request (T = 1 exists only with one query token per request).

Bytes count what the kernel must move: the visible keys of every (row, KV head) selection (each row
reads its pages itself, even when the rows of one request select the same pages), q, the output and the
index lists. FLOPs: ``4 * Hq / Hkv * Dh`` per visible key of each (row, KV head) (QK^T and PV).
The reference is the gather-and-softmax expression of the CPU kernel compiled with ``torch.compile``.
"""

from __future__ import annotations

from typing import Iterator

import torch

from torch_sparse_mla import decode_runtime_metadata, sparse_gqa_decode
from torch_sparse_mla.bench.common import Case, compile_reference, rel_err
from torch_sparse_mla.ops.sparse_gqa import sparse_gqa_decode_dense

HQ, HKV, HEAD_DIM, PAGE_SIZE, N_SEL = 64, 4, 128, 128, 16
CONTEXT_PAGES = 32  # pages per request: contexts of up to 4096 tokens
ROWS = (1, 16, 64, 256)
QUICK_ROWS = (1, 64)
QUERY_LENS = (1, 4)
SMOKE_ROWS = (4,)  # smoke=True: tiny configurations (with SMOKE_CONTEXT_PAGES pages per request)
SMOKE_CONTEXT_PAGES = 4


def _inputs(num_rows: int, decode_query_len: int, seed: int, device: str, context_pages: int = CONTEXT_PAGES,
            n_sel: int = N_SEL):
    """Arguments in schema order and the number of visible keys over all (row, KV head)."""
    gen = torch.Generator().manual_seed(seed)
    batch = num_rows // decode_query_len
    num_pages = batch * context_pages
    seq_lens = torch.randint(n_sel * PAGE_SIZE, context_pages * PAGE_SIZE + 1, (batch,), generator=gen,
                             dtype=torch.int32)
    block_table = torch.randperm(num_pages, generator=gen).view(batch, context_pages).to(torch.int32)
    # Each (row, KV head) selects its request's last page (the local window) and 15 other distinct pages.
    req = torch.arange(num_rows) // decode_query_len
    last = (seq_lens.to(torch.int64) - 1) // PAGE_SIZE
    cols = torch.arange(context_pages)
    rank = (cols[None, :] > last[req][:, None]).float() * 2 - (cols[None, :] == last[req][:, None]).float() * 2
    priority = torch.rand(num_rows, HKV, context_pages, generator=gen) + rank[:, None, :]
    topk_pages = priority.argsort(-1)[..., :n_sel].to(torch.int32)
    kv_lens, qo = decode_runtime_metadata(seq_lens, decode_query_len=decode_query_len)
    limit = torch.minimum(qo + 1, kv_lens).to(torch.int64)
    keys = (limit[:, None, None] - topk_pages.to(torch.int64) * PAGE_SIZE).clamp(0, PAGE_SIZE).sum().item()

    kv_cache = torch.empty(num_pages, HKV, PAGE_SIZE, 2 * HEAD_DIM, dtype=torch.float8_e4m3fn, device=device)
    for start in range(0, num_pages, 512):  # bounded float32 temporaries
        chunk = kv_cache[start:start + 512]
        chunk.copy_(torch.randn(chunk.shape, device=device) * 2)
    q = torch.randn(num_rows, HQ, HEAD_DIM, device=device).to(torch.bfloat16)
    args = (q, kv_cache, topk_pages.to(device), block_table.to(device), kv_lens.to(device), qo.to(device),
            decode_query_len, HEAD_DIM ** -0.5, 1.0, 0.05, 0.5)
    return args, keys


def cases(quick: bool = False, device: str = "cuda", smoke: bool = False) -> Iterator[Case]:
    """The benchmark configurations (``device="cpu", smoke=True``: tiny ones, to exercise the
    factory without a GPU)."""
    context_pages, n_sel = (SMOKE_CONTEXT_PAGES, 2) if smoke else (CONTEXT_PAGES, N_SEL)
    for decode_query_len in QUERY_LENS:
        for num_rows in SMOKE_ROWS if smoke else QUICK_ROWS if quick else ROWS:
            if num_rows % decode_query_len:
                continue
            args, keys = _inputs(num_rows, decode_query_len, seed=num_rows * 10 + decode_query_len,
                                 device=device, context_pages=context_pages, n_sel=n_sel)
            q, kv_cache, topk_pages, block_table, kv_lens, qo, dql, scale, q_scale, k_scale, v_scale = args
            out = torch.empty_like(q)

            def run(args=args, out=out):
                q, kv_cache, topk_pages, block_table, kv_lens, qo, dql, scale, q_scale, k_scale, v_scale = args
                return sparse_gqa_decode(q, kv_cache, topk_pages, block_table, kv_lens, qo, decode_query_len=dql,
                                         softmax_scale=scale, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                                         out=out)

            reference_fn = compile_reference(sparse_gqa_decode_dense)

            def reference(args=args, reference_fn=reference_fn):
                return reference_fn(*args)

            def check(run=run, reference=reference):
                return rel_err(run(), reference())

            row_bytes = HQ * HEAD_DIM * 2 * 2 + HKV * n_sel * 4 + 8  # q and out (bf16), page lists, lengths
            yield Case(
                name=f"fp8 kv bf16 q Hq={HQ} Hkv={HKV} D={HEAD_DIM} page={PAGE_SIZE} sel={n_sel} "
                     f"T={num_rows} q_len={decode_query_len}",
                flops=4.0 * (HQ // HKV) * HEAD_DIM * keys,
                bytes=float(keys * 2 * HEAD_DIM * kv_cache.element_size() + num_rows * row_bytes),
                run=run,
                reference=reference,
                check=check,
                operator="sparse_gqa_decode",
                host_overhead=num_rows == 1,
            )
