"""Benchmark cases of sparse_mla_decode: DeepSeek-V3.2 / V4 decode shapes.

Each token is a request of its own with a context of ``CONTEXT`` slots (pages of 64 in a cache shared
by the batch), from which it selects ``K`` distinct slots at random: the reads are real, spread over a
cache far larger than L2. DeepSeek-V4 (``fp8_584``): the main list is the token's sliding window (its
last 128 slots, consecutive) and the extra list 512 random compressed entries of a second cache;
pages are padded to a multiple of 576 bytes as the model lays them out.

FLOPs: ``T * 2 * H * K_total * (D + 512)`` (QK^T over the D = 576 / 512 query dims, PV over 512).
Bytes: the distinct cache slots read (times the bytes per token of the format), q, out, lse and the
index lists. The reference is what a user writes without the library (``baselines.mla_fp8_656``,
``mla_fp8_584_two_caches``, ``mla_bf16``: gather, dequantise, bf16 bmm, fp32 softmax, bmm), compiled
with ``fullgraph=True`` and timed like the operator.
"""

from __future__ import annotations

from typing import Iterator

import torch

from torch_sparse_mla import sparse_mla_decode
from torch_sparse_mla.bench import baselines
from torch_sparse_mla.bench.common import Case, compile_reference, rel_err
from torch_sparse_mla.meta_kernels._formats import bytes_per_token, cache_dim

PAGE_SIZE = 64
CONTEXT = 8192  # slots per request (token); K of them are selected
WINDOW = 128  # DeepSeek-V4 sliding window (main list of fp8_584)

# (name, kv_format, H, K main, K extra, T): the configurations of the speed targets
CONFIGS = [
    ("V3.2 fp8_656", "fp8_656", 128, 2048, 0, 256),
    ("V3.2 fp8_656", "fp8_656", 128, 2048, 0, 128),
    ("V3.2 fp8_656", "fp8_656", 128, 2048, 0, 64),
    ("V3.2 fp8_656", "fp8_656", 128, 2048, 0, 4),
    ("V3.2 fp8_656", "fp8_656", 128, 2048, 0, 1),
    ("V3.2 fp8_656", "fp8_656", 64, 2048, 0, 128),
    ("V3.2 fp8_656", "fp8_656", 16, 2048, 0, 128),
    ("V4 fp8_584 window+compressed", "fp8_584", 64, WINDOW, 512, 128),
    ("bf16 cache D=576", "auto", 128, 2048, 0, 64),
]
QUICK = (0, 4, 7, 8)  # indices into CONFIGS
SMOKE_CONTEXT, SMOKE_K, SMOKE_T = 64, 16, 2  # smoke=True: every configuration, tiny


def _reference_for(kv_format: str, kwargs: dict):
    """The plain-PyTorch computation of the case (compiled) and its arguments."""
    if kv_format == "fp8_656":
        fn, args = baselines.mla_fp8_656, (kwargs["q"], kwargs["kv_cache"], kwargs["indices"])
    elif kv_format == "auto":
        fn, args = baselines.mla_bf16, (kwargs["q"], kwargs["kv_cache"], kwargs["indices"])
    else:
        fn, args = baselines.mla_fp8_584_two_caches, (kwargs["q"], kwargs["kv_cache"], kwargs["indices"],
                                                      kwargs["extra_kv_cache"], kwargs["extra_indices"])
    return compile_reference(fn), args + (kwargs["softmax_scale"],)


def _cache(kv_format: str, num_slots: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """A cache of ``num_slots`` random, well-formed slots, written with plain tensor ops (fast)."""
    pages = -(-num_slots // PAGE_SIZE)
    if kv_format == "auto":
        return torch.randn(pages, PAGE_SIZE, 576, generator=gen, device=device).to(torch.bfloat16)
    if kv_format == "fp8_656":
        cache = torch.empty(pages, PAGE_SIZE, 656, dtype=torch.uint8, device=device)
        fp8 = torch.randn(pages, PAGE_SIZE, 512, generator=gen, device=device) * 100
        cache[..., :512] = fp8.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        scales = torch.rand(pages, PAGE_SIZE, 4, generator=gen, device=device) * 0.02 + 0.001
        cache[..., 512:528] = scales.view(torch.uint8)
        rope = torch.randn(pages, PAGE_SIZE, 64, generator=gen, device=device).to(torch.bfloat16)
        cache[..., 528:] = rope.view(torch.uint8)
        return cache
    page_bytes = -(-PAGE_SIZE * 584 // 576) * 576  # DeepSeek-V4 pads pages to a multiple of 576 bytes
    flat = torch.zeros(pages, page_bytes, dtype=torch.uint8, device=device)
    data = flat[:, : PAGE_SIZE * 576].view(pages, PAGE_SIZE, 576)
    fp8 = torch.randn(pages, PAGE_SIZE, 448, generator=gen, device=device) * 100
    data[..., :448] = fp8.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    rope = torch.randn(pages, PAGE_SIZE, 64, generator=gen, device=device).to(torch.bfloat16)
    data[..., 448:] = rope.view(torch.uint8)
    exps = flat[:, PAGE_SIZE * 576: PAGE_SIZE * 584].view(pages, PAGE_SIZE, 8)
    exps[..., :7] = torch.randint(120, 124, (pages, PAGE_SIZE, 7), generator=gen, device=device, dtype=torch.uint8)
    return torch.as_strided(flat, (pages, PAGE_SIZE, 584), (page_bytes, 584, 1))


def _random_lists(num_tokens: int, k: int, context: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """int32 ``[T, k]``: ``k`` distinct random slots of each token's own ``context``-slot request."""
    picks = torch.rand(num_tokens, context, generator=gen, device=device).topk(k, dim=1).indices
    base = torch.arange(num_tokens, device=device)[:, None] * context
    return (base + picks).to(torch.int32)


def _inputs(kv_format: str, num_heads: int, k: int, k_extra: int, num_tokens: int, device: str,
            context: int = CONTEXT) -> dict:
    gen = torch.Generator(device=device).manual_seed(num_tokens * 1000 + num_heads + k)
    num_slots = num_tokens * context
    cache = _cache(kv_format, num_slots, gen, device)
    dim = cache_dim(cache, kv_format)
    q = torch.randn(num_tokens, num_heads, dim, generator=gen, device=device).to(torch.bfloat16)
    kwargs = dict(q=q, kv_cache=cache, softmax_scale=dim ** -0.5, kv_format=kv_format, head_dim_v=512)
    if k_extra:
        # Sliding window: the token's last WINDOW slots, in order; compressed entries: random in a cache
        # of CONTEXT / 4 entries per request.
        window = k
        ends = torch.randint(window, context + 1, (num_tokens, 1), generator=gen, device=device)
        base = torch.arange(num_tokens, device=device)[:, None] * context
        kwargs["indices"] = (base + ends - window + torch.arange(window, device=device)).to(torch.int32)
        extra_cache = _cache(kv_format, num_slots // 4, gen, device)
        picks = torch.rand(num_tokens, context // 4, generator=gen, device=device).topk(k_extra, dim=1).indices
        kwargs["extra_kv_cache"] = extra_cache
        kwargs["extra_indices"] = (torch.arange(num_tokens, device=device)[:, None] * (context // 4)
                                   + picks).to(torch.int32)
    else:
        kwargs["indices"] = _random_lists(num_tokens, k, context, gen, device)
    return kwargs


def _moved_bytes(kwargs: dict, out: torch.Tensor, lse: torch.Tensor) -> float:
    """Distinct cache slots read, plus q, out, lse and the index lists."""
    total = 0.0
    for cache, idx in ((kwargs["kv_cache"], kwargs["indices"]),
                       (kwargs.get("extra_kv_cache"), kwargs.get("extra_indices"))):
        if cache is None:
            continue
        total += torch.unique(idx).numel() * bytes_per_token(cache, kwargs["kv_format"]) + idx.numel() * 4
    for t in (kwargs["q"], out, lse):
        total += t.numel() * t.element_size()
    return total


def cases(quick: bool = False, device: str = "cuda", smoke: bool = False) -> Iterator[Case]:
    """The benchmark configurations (``device="cpu", smoke=True``: all of them, tiny, to exercise
    the factory without a GPU)."""
    for i, (label, kv_format, num_heads, k, k_extra, num_tokens) in enumerate(CONFIGS):
        if quick and i not in QUICK:
            continue
        context = CONTEXT
        if smoke:
            context, k, k_extra, num_tokens = SMOKE_CONTEXT, min(k, SMOKE_K), min(k_extra, SMOKE_K), SMOKE_T
        kwargs = _inputs(kv_format, num_heads, k, k_extra, num_tokens, device, context)
        dim = kwargs["q"].shape[-1]
        out = torch.empty(num_tokens, num_heads, 512, dtype=torch.bfloat16, device=device)
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=device)

        def run(kwargs=kwargs, out=out, lse=lse):
            return sparse_mla_decode(**kwargs, out=(out, lse))

        reference_fn, ref_args = _reference_for(kv_format, kwargs)

        def reference(reference_fn=reference_fn, ref_args=ref_args):
            return reference_fn(*ref_args)

        def check(run=run, reference=reference):
            return rel_err(run()[0], reference())

        yield Case(
            name=f"{label} H={num_heads} K={k}{f'+{k_extra}' if k_extra else ''} T={num_tokens}",
            flops=float(num_tokens) * 2 * num_heads * (k + k_extra) * (dim + 512),
            bytes=_moved_bytes(kwargs, out, lse),
            written=float(out.numel() * out.element_size() + lse.numel() * lse.element_size()),
            run=run,
            reference=reference,
            check=check,
            operator="sparse_mla_decode",
            host_overhead=num_tokens == 1,
        )
