"""Benchmark cases of the sparse GQA operators: MiniMax-M3 MSA decode shapes and the cache writer.

Decode: Hq = 64 query heads over Hkv = 4 KV heads, head_dim 128, pages of 128 tokens, 16 selected
pages per (row, KV head), bfloat16 queries; a float8 cache and an NVFP4 cache; T rows in
{1, 16, 64, 256} with 1 or 4 query tokens per request (T = 1 exists only with one token per request).
Insert: 4096 tokens x 4 KV heads x 128 (bfloat16 K and V) into a float8 and an NVFP4 cache.

Bytes count what a call must move. Decode: the visible keys of every (row, KV head) selection at the
format's bytes per key (256 for float8 K and V, 144 for NVFP4: 2 x (64 data + 8 scale bytes)), each row
reading its pages itself even when the rows of one request select the same pages, plus q, the output
and the index lists; the floor column (``bench/common.py``) reads each (request, KV head, key) once.
Insert: K and V read, the slots, and the bytes written. FLOPs (decode): ``4 * Hq / Hkv * Dh`` per
visible key of each (row, KV head) (QK^T and PV).

The reference of every case is the plain-PyTorch function of ``bench/baselines.py`` (what a user
writes without the library) compiled with ``torch.compile(fullgraph=True)``, on the same inputs.
"""

from __future__ import annotations

from typing import Iterator

import torch

from torch_sparse_mla import decode_runtime_metadata, gqa_kv_cache_insert, sparse_gqa_decode
from torch_sparse_mla.bench import baselines
from torch_sparse_mla.bench.common import Case, compile_reference, rel_err

HQ, HKV, HEAD_DIM, PAGE_SIZE, N_SEL = 64, 4, 128, 128, 16
CONTEXT_PAGES = 32  # pages per request: contexts of up to 4096 tokens
ROWS = (1, 16, 64, 256)
QUICK_ROWS = (1, 64)
QUERY_LENS = (1, 4)
SMOKE_ROWS = (4,)  # smoke=True: tiny configurations (SMOKE_CONTEXT_PAGES pages per request, 2 selected)
SMOKE_CONTEXT_PAGES = 4
FORMATS = ("fp8", "nvfp4")
INSERT_TOKENS = 4096
INSERT_ROWS_TOKENS = (64, INSERT_TOKENS)  # the writer's rows: a decode step's batch, and a long prefill
KEY_BYTES = {"fp8": 2 * HEAD_DIM, "nvfp4": 2 * 72}  # K and V of one key of one KV head

_BASELINES = {"fp8": baselines.gqa_fp8, "nvfp4": baselines.gqa_nvfp4}
_INSERT_BASELINES = {"fp8": baselines.gqa_insert_fp8, "nvfp4": baselines.gqa_insert_nvfp4}


def _cache(kv_format: str, num_pages: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """A full cache of random values (written with gqa_kv_cache_insert for NVFP4), the same on every run
    for the same seed of ``gen`` (drawn on ``device`` by a generator seeded from it; ``gen`` itself is
    not advanced, so the inputs drawn after the cache stay as they were)."""
    dev_gen = torch.Generator(device=device).manual_seed(gen.initial_seed())
    if kv_format == "fp8":
        cache = torch.empty(num_pages, HKV, PAGE_SIZE, 2 * HEAD_DIM, dtype=torch.float8_e4m3fn, device=device)
        for start in range(0, num_pages, 512):  # bounded float32 temporaries
            chunk = cache[start:start + 512]
            chunk.copy_(torch.randn(chunk.shape, device=device, generator=dev_gen) * 2)
        return cache
    cache = torch.empty(num_pages, 2 * HKV, PAGE_SIZE, 72, dtype=torch.uint8, device=device)
    tokens = num_pages * PAGE_SIZE
    for start in range(0, tokens, 1 << 16):
        n = min(1 << 16, tokens - start)
        k, v = (torch.randn(n, HKV, HEAD_DIM, device=device, generator=dev_gen) * 2 for _ in range(2))
        gqa_kv_cache_insert(k, v, torch.arange(start, start + n, device=device), cache)
    return cache


def _decode_inputs(kv_format: str, num_rows: int, decode_query_len: int, seed: int, device: str,
                   context_pages: int = CONTEXT_PAGES, n_sel: int = N_SEL, with_distinct: bool = False):
    """Arguments of the operator (schema order), of the baseline, the number of visible keys of all
    (row, KV head) selections and (``with_distinct``) of distinct (request, KV head, key) among them."""
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
    visible = (limit[:, None, None] - topk_pages.to(torch.int64) * PAGE_SIZE).clamp(0, PAGE_SIZE)
    keys = visible.sum().item()
    # Distinct keys: each (request, KV head, page) once, with the most keys any row of the request sees.
    seen = torch.zeros(batch, HKV, context_pages, dtype=torch.int64)
    seen.view(-1).scatter_reduce_(0, ((req[:, None, None] * HKV + torch.arange(HKV)[None, :, None]) * context_pages
                                      + topk_pages).flatten(), visible.flatten(), "amax")
    distinct = seen.sum().item()

    kv_cache = _cache(kv_format, num_pages, gen, device)
    q = torch.randn(num_rows, HQ, HEAD_DIM, generator=gen).to(device=device, dtype=torch.bfloat16)
    topk_pages, block_table, kv_lens, qo = (x.to(device) for x in (topk_pages, block_table, kv_lens, qo))
    scale = HEAD_DIM ** -0.5
    args = (q, kv_cache, topk_pages, block_table, kv_lens, qo, decode_query_len, scale)
    # The baseline takes one block-table row per query row and the last visible position.
    baseline_args = (q, kv_cache, topk_pages, block_table[req.to(device)], qo, scale)
    return (args, baseline_args, keys, distinct) if with_distinct else (args, baseline_args, keys)


def _decode_cases(kv_format: str, quick: bool, device: str, smoke: bool) -> Iterator[Case]:
    context_pages, n_sel = (SMOKE_CONTEXT_PAGES, 2) if smoke else (CONTEXT_PAGES, N_SEL)
    for decode_query_len in QUERY_LENS:
        for num_rows in SMOKE_ROWS if smoke else QUICK_ROWS if quick else ROWS:
            if num_rows % decode_query_len:
                continue
            args, baseline_args, keys, distinct = _decode_inputs(
                kv_format, num_rows, decode_query_len, seed=num_rows * 10 + decode_query_len, device=device,
                context_pages=context_pages, n_sel=n_sel, with_distinct=True)
            q, kv_cache, topk_pages, block_table, kv_lens, qo, dql, scale = args
            out = torch.empty_like(q)

            def run(args=args, out=out):
                q, kv_cache, topk_pages, block_table, kv_lens, qo, dql, scale = args
                return sparse_gqa_decode(q, kv_cache, topk_pages, block_table, kv_lens, qo, decode_query_len=dql,
                                         softmax_scale=scale, out=out)

            def reference(baseline_args=baseline_args, fn=compile_reference(_BASELINES[kv_format])):
                return fn(*baseline_args)

            def check(run=run, reference=reference):
                return rel_err(run(), reference())

            row_bytes = HQ * HEAD_DIM * 2 * 2 + HKV * n_sel * 4 + 8  # q and out (bf16), page lists, lengths
            yield Case(
                name=f"{kv_format} kv bf16 q Hq={HQ} Hkv={HKV} D={HEAD_DIM} page={PAGE_SIZE} sel={n_sel} "
                     f"T={num_rows} q_len={decode_query_len}",
                flops=4.0 * (HQ // HKV) * HEAD_DIM * keys,
                bytes=float(keys * KEY_BYTES[kv_format] + num_rows * row_bytes),
                written=float(out.numel() * out.element_size()),
                # the floor reads each (request, KV head, key) once: rows of a request may select the same pages
                floor_read=float(distinct * KEY_BYTES[kv_format] + num_rows * (row_bytes - HQ * HEAD_DIM * 2)),
                run=run,
                reference=reference,
                check=check,
                operator="sparse_gqa_decode",
                host_overhead=num_rows == 1,
            )


INSERT_SCALES = (0.05, 0.5)  # k_scale, v_scale of the insert cases


def insert_inputs(kv_format: str, device: str, tokens: int = INSERT_TOKENS, seed: int = 7):
    """``(k, v, slots, cache)`` of an insert case: bf16 K and V, distinct random slots into an empty
    cache of twice as many slots."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = 2 * tokens // PAGE_SIZE  # half the slots are written
    if kv_format == "fp8":
        shape, dtype = (num_pages, HKV, PAGE_SIZE, 2 * HEAD_DIM), torch.float8_e4m3fn
    else:
        shape, dtype = (num_pages, 2 * HKV, PAGE_SIZE, 72), torch.uint8
    cache = torch.zeros(shape, dtype=dtype, device=device)
    k, v = (torch.randn(tokens, HKV, HEAD_DIM, generator=gen).to(device=device, dtype=torch.bfloat16)
            for _ in range(2))
    slots = torch.randperm(num_pages * PAGE_SIZE, generator=gen)[:tokens].to(device)
    return k, v, slots, cache


def insert_bytes(kv_format: str, tokens: int = INSERT_TOKENS) -> float:
    """Bytes an insert call must move: bf16 K and V read, the int64 slots, the bytes written."""
    return float(2 * tokens * HKV * HEAD_DIM * 2 + tokens * 8 + KEY_BYTES[kv_format] * tokens * HKV)


def _insert_case(kv_format: str, device: str, tokens: int = INSERT_TOKENS) -> Case:
    k, v, slots, cache = insert_inputs(kv_format, device, tokens)
    ref_cache = torch.zeros_like(cache)
    k_scale, v_scale = INSERT_SCALES

    def run():
        gqa_kv_cache_insert(k, v, slots, cache, k_scale=k_scale, v_scale=v_scale)

    def reference(fn=compile_reference(_INSERT_BASELINES[kv_format])):
        fn(k, v, slots, ref_cache, k_scale, v_scale)

    def check():
        run()
        reference()
        # Bytes that differ from the plain-PyTorch writer, which picks its own rounding of the NVFP4 group
        # scales (the operator's bytes are checked bit for bit against the contract in the tests).
        a, b = cache.view(torch.uint8), ref_cache.view(torch.uint8)
        return f"bytes {(a != b).float().mean().item():.1e}"

    return Case(
        name=f"gqa_kv_cache_insert {kv_format} N={tokens} Hkv={HKV} D={HEAD_DIM} bf16 k/v",
        flops=0.0,
        bytes=insert_bytes(kv_format, tokens),
        written=float(KEY_BYTES[kv_format] * tokens * HKV),
        run=run,
        reference=reference,
        check=check,
        operator="gqa_kv_cache_insert",
    )


def cases(quick: bool = False, device: str = "cuda", smoke: bool = False) -> Iterator[Case]:
    """The benchmark configurations (``device="cpu", smoke=True``: tiny ones, to exercise the
    factory without a GPU)."""
    for kv_format in FORMATS:
        yield from _decode_cases(kv_format, quick, device, smoke)
    for kv_format in FORMATS:
        for tokens in (64,) if smoke else INSERT_ROWS_TOKENS:
            yield _insert_case(kv_format, device, tokens=tokens)
