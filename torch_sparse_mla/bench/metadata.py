"""Benchmark cases of the metadata operators: one DeepSeek-V4 or MiniMax-M3 decode batch each.

``T`` requests with one decode token each, contexts of up to ``MAX_MODEL_LEN`` tokens, page tables of
random physical pages: a sliding-window table of 64-token pages, compressed tables of 256-token pages
(64 ratio-4 entries or 2 ratio-128 entries per page), window 128, an indexer top-512 (DeepSeek-V4's
C4A) and a top-2,048 of token positions through the 64-token pages (DeepSeek-V3.2's indexer), C128A
lists as wide as ``MAX_MODEL_LEN / 128``.

These operators move little and compute nothing (FLOPs = 0): the bytes count the index outputs
written plus the per-token inputs and page-table entries read. What matters inside a decode step is
the time of one small launch, so ``T = 1`` is in every family. The reference of each is its
plain-PyTorch stand-in from ``bench/baselines.py`` (gathers, comparisons and ``where``), compiled.
"""

from __future__ import annotations

from typing import Iterator

import torch

import torch_sparse_mla as tsm
from torch_sparse_mla.bench import baselines
from torch_sparse_mla.bench.common import Case, compile_reference, mismatches

I32, I64 = torch.int32, torch.int64
MAX_MODEL_LEN = 131072
WINDOW, SWA_PAGE, COMP_PAGE, TOPK = 128, 64, 256, 512
TOKENS = (1, 128, 1024)
QUICK_TOKENS = (1, 1024)
SMOKE_MAX_MODEL_LEN, SMOKE_TOPK, SMOKE_TOKENS = 2048, 16, (3,)
V32_TOPK, SMOKE_V32_TOPK = 2048, 40  # DeepSeek-V3.2's indexer: token positions through 64-token pages


def _batch(num_tokens: int, max_model_len: int, topk: int, device: str, v32_topk: int = V32_TOPK) -> dict:
    gen = torch.Generator().manual_seed(num_tokens)
    t = num_tokens
    seq = torch.randint(max_model_len // 8, max_model_len - 1, (t,), generator=gen)
    pos = seq - 1
    pool = 1 << 20  # physical pages
    swa_table = torch.randint(0, pool, (t, max_model_len // SWA_PAGE), generator=gen).to(I32)
    comp_cols = max_model_len // COMP_PAGE
    slots = swa_table[torch.arange(t), pos // SWA_PAGE].to(I64) * SWA_PAGE + pos % SWA_PAGE
    completed = (pos + 1) // 4
    local = (torch.rand(t, topk, generator=gen) * completed[:, None]).to(I32)
    local_v32 = (torch.rand(t, v32_topk, generator=gen) * seq[:, None]).to(I32)  # positions < seq_len
    host = dict(
        query_start_loc=torch.arange(t + 1, dtype=I32), seq_lens=seq.to(I32), positions=pos,
        token_to_req=torch.arange(t, dtype=I32), slot_mapping=slots, swa_table=swa_table,
        c4_table=torch.randint(0, pool, (t, comp_cols), generator=gen).to(I32),
        c128_table=torch.randint(0, pool, (t, comp_cols), generator=gen).to(I32), local=local,
        local_v32=local_v32,
    )
    return {k: v.to(device) for k, v in host.items()}


def cases(quick: bool = False, device: str = "cuda", smoke: bool = False) -> Iterator[Case]:
    """One case per operator and batch size (``device="cpu", smoke=True``: tiny ones)."""
    max_len, topk, v32_topk = ((SMOKE_MAX_MODEL_LEN, SMOKE_TOPK, SMOKE_V32_TOPK) if smoke
                               else (MAX_MODEL_LEN, TOPK, V32_TOPK))
    width = max_len // 128
    for t in SMOKE_TOKENS if smoke else QUICK_TOKENS if quick else TOKENS:
        b = _batch(t, max_len, topk, device, v32_topk)
        per_token = 8 + 4 + 8  # positions, token_to_req, slot_mapping

        # -- swa_indices
        idx, lens = (torch.empty(t, WINDOW, dtype=I32, device=device), torch.empty(t, dtype=I32, device=device))
        ref = compile_reference(baselines.swa_indices)
        yield _case("swa_indices", f"window={WINDOW} T={t}", t * (WINDOW * 4 + 4 + per_token + 3 * 4),
                    lambda b=b, idx=idx, lens=lens: tsm.swa_indices(
                        b["positions"], b["token_to_req"], b["swa_table"], b["slot_mapping"], window=WINDOW,
                        block_size=SWA_PAGE, out=(idx, lens)),
                    lambda b=b, ref=ref: ref(b["positions"], b["token_to_req"], b["swa_table"], b["slot_mapping"],
                                             WINDOW, SWA_PAGE), t)

        # -- compressed_slot_mapping (ratio 4)
        out = torch.empty(t, dtype=I64, device=device)
        ref = compile_reference(baselines.compressed_slot_mapping)
        yield _case("compressed_slot_mapping", f"ratio=4 T={t}", t * (8 + 4 + 4 + 4) + 4,
                    lambda b=b, out=out: tsm.compressed_slot_mapping(
                        b["query_start_loc"], b["seq_lens"], b["c4_table"], block_size=COMP_PAGE // 4,
                        compress_ratio=4, out=out),
                    lambda b=b, ref=ref, t=t: ref(b["query_start_loc"], b["seq_lens"], b["c4_table"], t,
                                                  COMP_PAGE // 4, 4), t)

        # -- c128a_topk_indices (decode tokens only)
        bufs = (torch.empty(t, width, dtype=I32, device=device), torch.empty(t, dtype=I32, device=device),
                torch.empty(0, width, dtype=I32, device=device))
        ref = compile_reference(baselines.c128a_topk_indices)
        yield _case("c128a_topk_indices", f"width={width} T={t}",
                    t * (width * 4 + 4 + per_token + (width // 2) * 4),
                    lambda b=b, bufs=bufs, t=t: tsm.c128a_topk_indices(
                        b["positions"], b["token_to_req"], b["c128_table"], b["slot_mapping"], num_decode_tokens=t,
                        compress_ratio=128, block_size=COMP_PAGE // 128, width=width, out=bufs)[:2],
                    lambda b=b, ref=ref: ref(b["positions"], b["token_to_req"], b["c128_table"], b["slot_mapping"],
                                             128, COMP_PAGE // 128, width), t)

        # -- compressed_topk_to_global
        idx, lens = (torch.empty(t, topk, dtype=I32, device=device), torch.empty(t, dtype=I32, device=device))
        ref = compile_reference(baselines.compressed_topk_to_global)
        yield _case("compressed_topk_to_global", f"K={topk} T={t}", t * (topk * 4 * 3 + 4 + per_token),
                    lambda b=b, idx=idx, lens=lens: tsm.compressed_topk_to_global(
                        b["local"], b["token_to_req"], b["c4_table"], b["slot_mapping"], block_size=COMP_PAGE // 4,
                        out=(idx, lens)),
                    lambda b=b, ref=ref: ref(b["local"], b["token_to_req"], b["c4_table"], b["slot_mapping"],
                                             COMP_PAGE // 4), t)
        # the same operator on a DeepSeek-V3.2 indexer row: token positions through the 64-token page table
        idx, lens = (torch.empty(t, v32_topk, dtype=I32, device=device), torch.empty(t, dtype=I32, device=device))
        yield _case("compressed_topk_to_global", f"K={v32_topk} T={t}", t * (v32_topk * 4 * 3 + 4 + per_token),
                    lambda b=b, idx=idx, lens=lens: tsm.compressed_topk_to_global(
                        b["local_v32"], b["token_to_req"], b["swa_table"], b["slot_mapping"], block_size=SWA_PAGE,
                        out=(idx, lens)),
                    lambda b=b, ref=ref: ref(b["local_v32"], b["token_to_req"], b["swa_table"], b["slot_mapping"],
                                             SWA_PAGE), t, host_overhead=False)  # the operator's host row: K=512

        # -- decode_runtime_metadata (MiniMax-M3, one query token per request)
        bufs = (torch.empty(t, dtype=I32, device=device), torch.empty(t, dtype=I32, device=device))
        ref = compile_reference(baselines.decode_runtime_metadata)
        yield _case("decode_runtime_metadata", f"q_len=1 B={t}", t * 12,
                    lambda b=b, bufs=bufs: tsm.decode_runtime_metadata(b["seq_lens"], decode_query_len=1, out=bufs),
                    lambda b=b, ref=ref: ref(b["seq_lens"], 1), t)


def _case(operator: str, config: str, nbytes: float, run, reference, num_tokens: int,
          host_overhead: bool = True) -> Case:
    return Case(name=f"{operator} {config}", flops=0.0, bytes=float(nbytes), run=run, reference=reference,
                check=lambda: mismatches(run(), reference()), operator=operator,
                host_overhead=host_overhead and num_tokens == 1)
