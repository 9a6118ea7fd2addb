"""What a user writes without this library: plain PyTorch, wrapped in ``torch.compile(fullgraph=True)``.

These are the yardsticks of the benchmark tables: each case times the library operator and, in the same
run with the same timer and inputs, the compiled function here that computes the same thing. They take
the cheapest formulation a user would reach for (gather, dequantise, bf16 ``bmm`` / ``einsum``,
float32 softmax; valid indices only, no lengths, no empty entries), which is what makes them a fair
bar: they share no code with the library's kernels.

- ``gqa_fp8``: sparse GQA decode over a float8 page cache (MiniMax-M3 MSA), one query token per row.
- ``gqa_nvfp4``: the same over the NVFP4 cache (uint8 ``[pages, 2 * Hkv, page_size, 72]``).
- ``gqa_insert_fp8`` / ``gqa_insert_nvfp4``: quantise this step's K and V into those caches.
"""

from __future__ import annotations

import torch

F8 = torch.float8_e4m3fn


def gqa_fp8(q, cache, pages, block_table, qpos, scale):
    """One query token per request. q [T, Hq, Dh] bf16; cache fp8 [P, Hkv, page_size, 2*Dh];
    pages int32 [T, Hkv, n] request-local page numbers (valid); block_table int32 [T, W];
    qpos int32 [T]: the last key position each token may see."""
    T, Hq, Dh = q.shape
    P, Hkv, ps, _ = cache.shape
    G = Hq // Hkv
    phys = torch.gather(block_table, 1, pages.view(T, -1).long()).view(T, Hkv, -1)
    kv = cache[phys, torch.arange(Hkv, device=q.device)[None, :, None]]    # [T, Hkv, n, ps, 2Dh]
    n = pages.shape[-1]
    kv = kv.view(T, Hkv, n * ps, 2 * Dh).to(torch.bfloat16)
    pos = (pages[..., None] * ps + torch.arange(ps, device=q.device)).view(T, Hkv, n * ps)
    ok = pos <= qpos[:, None, None]
    s = torch.einsum("tgqd,tgkd->tgqk", q.view(T, Hkv, G, Dh), kv[..., :Dh]).float() * scale
    s = s.masked_fill(~ok[:, :, None, :], float("-inf"))
    p = torch.softmax(s, -1).to(q.dtype)
    return torch.einsum("tgqk,tgkd->tgqd", p, kv[..., Dh:]).reshape(T, Hq, Dh)


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _nvfp4_values(slot_bytes, ps, v_order):
    """[..., ps * 72] bytes of NVFP4 slots -> [..., ps, 128] bf16 values (e2m1 code times e4m3 scale)."""
    lead = slot_bytes.shape[:-1]
    data = slot_bytes[..., : ps * 64].reshape(*lead, ps, 64).long()
    scales = slot_bytes[..., ps * 64:]
    if v_order:  # V scales are stored by token quads
        scales = scales.reshape(*lead, ps // 4, 8, 4).transpose(-1, -2)
    scales = scales.reshape(*lead, ps, 8).contiguous().view(F8).float()
    lut = torch.tensor(_E2M1, device=slot_bytes.device)
    codes = torch.stack([lut[data & 15], lut[data >> 4]], dim=-1).reshape(*lead, ps, 8, 16)
    return (codes * scales[..., None]).reshape(*lead, ps, 128).to(torch.bfloat16)


def gqa_nvfp4(q, cache, pages, block_table, qpos, scale):
    """As ``gqa_fp8`` over an NVFP4 cache: uint8 [P, 2*Hkv, page_size, 72], slot 2g = K of KV head g,
    slot 2g+1 = its V, each page_size * 72 contiguous bytes (64-byte rows of 4-bit codes, then e4m3
    scales, one per 16 values)."""
    T, Hq, Dh = q.shape
    P, S, ps, _ = cache.shape
    Hkv = S // 2
    G = Hq // Hkv
    phys = torch.gather(block_table, 1, pages.view(T, -1).long()).view(T, Hkv, -1)
    heads = torch.arange(Hkv, device=q.device)[None, :, None]
    slots = cache.reshape(P, S, ps * 72)
    n = pages.shape[-1]
    k = _nvfp4_values(slots[phys, 2 * heads], ps, False).reshape(T, Hkv, n * ps, Dh)
    v = _nvfp4_values(slots[phys, 2 * heads + 1], ps, True).reshape(T, Hkv, n * ps, Dh)
    pos = (pages[..., None] * ps + torch.arange(ps, device=q.device)).view(T, Hkv, n * ps)
    ok = pos <= qpos[:, None, None]
    s = torch.einsum("tgqd,tgkd->tgqk", q.view(T, Hkv, G, Dh), k).float() * scale
    s = s.masked_fill(~ok[:, :, None, :], float("-inf"))
    p = torch.softmax(s, -1).to(q.dtype)
    return torch.einsum("tgqk,tgkd->tgqd", p, v).reshape(T, Hq, Dh)


def gqa_insert_fp8(k, v, slots, cache, k_scale, v_scale):
    """k, v [N, Hkv, Dh] bf16 into cache fp8 [P, Hkv, page_size, 2*Dh] at int64 slots [N] (valid).
    (The writes go through a uint8 view: inductor does not index_put float8 values.)"""
    Dh = k.shape[-1]
    ps = cache.shape[2]
    page, row = slots // ps, slots % ps
    bits = cache.view(torch.uint8)
    bits[page, :, row, :Dh] = (k.float() / k_scale).clamp(-448, 448).to(F8).view(torch.uint8)
    bits[page, :, row, Dh:] = (v.float() / v_scale).clamp(-448, 448).to(F8).view(torch.uint8)


def _nvfp4_encode(x, s):
    """[N, Hkv, 128] -> (uint8 [N, Hkv, 64] codes, uint8 [N, Hkv, 8] e4m3 scales)."""
    g = x.float().unflatten(-1, (8, 16))
    scale = (g.abs().amax(-1) / (6 * s)).clamp(max=448).to(F8)
    y = g / (scale.float() * s)[..., None]
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=x.device)
    codes = torch.bucketize(y.abs(), bounds) | ((y < 0).long() << 3)
    codes = codes.flatten(-2)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8), scale.view(torch.uint8)


def gqa_insert_nvfp4(k, v, slots, cache, k_scale, v_scale):
    """k, v [N, Hkv, 128] bf16 into an NVFP4 cache (see ``gqa_nvfp4``) at int64 slots [N] (valid)."""
    P, S, ps, _ = cache.shape
    Hkv = S // 2
    page, row = slots // ps, slots % ps
    flat = cache.view(P, S, ps * 72)
    heads = torch.arange(Hkv, device=k.device)
    cols = row[:, None] * 64 + torch.arange(64, device=k.device)  # [N, 64]
    j = torch.arange(8, device=k.device)
    for index, (x, s) in enumerate(((k, k_scale), (v, v_scale))):
        data, scale = _nvfp4_encode(x, s)
        if index == 0:
            scale_cols = ps * 64 + row[:, None] * 8 + j
        else:
            scale_cols = ps * 64 + (row[:, None] // 4) * 32 + j * 4 + row[:, None] % 4
        slot_idx = (2 * heads + index)[None, :, None]
        flat[page[:, None, None], slot_idx, cols[:, None, :]] = data
        flat[page[:, None, None], slot_idx, scale_cols[:, None, :]] = scale
