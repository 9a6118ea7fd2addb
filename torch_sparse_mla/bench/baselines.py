"""What a user writes without this library: each operator as plain PyTorch.

These functions are the yardstick of every speed claim the project makes. The benchmark
(``python -m torch_sparse_mla.bench``) compiles them with ``torch.compile(fullgraph=True)`` and times
them exactly like the library's operators (CUDA-graph replay of one call, same inputs, same run);
the demo builds its plain-PyTorch decode step from them. They use only tensor operations a model
author would reach for (gather, masks, ``bmm``, ``softmax``) and no code of the library.

They are deliberately the cheapest correct formulation of each operation for well-formed inputs,
which is what makes them a fair bar:

- index and slot arguments are assumed valid where a docstring says so (no ``-1`` entries in the
  attention baselines, no negative slots in the cache writers); the metadata functions do handle
  ``-1`` block ids, missing pages and padding tokens, because their output must mark them;
- no attention sink, length or second cache unless the function's name says so.

Sections: metadata, KV cache (the formats of ``docs/formats.md``), sparse MLA decode, sparse GQA
decode and its cache writer (fp8 and NVFP4 pages). Each function names the operator it stands in for.
"""

from __future__ import annotations

import torch

F8 = torch.float8_e4m3fn
I32, I64 = torch.int32, torch.int64


# =====================================================================================================
# Metadata (stand-ins for compressed_slot_mapping, c128a_topk_indices, decode_runtime_metadata,
# swa_indices, compressed_topk_to_global)
# =====================================================================================================


def _slots(block_table, req, entry, block_size):
    """Global slot of request-local ``entry`` of request ``req`` (``-1`` where the entry is negative,
    its page column is past the table or its block id is negative). ``req`` must be in range."""
    cols = block_table.shape[1]
    col = torch.div(entry, block_size, rounding_mode="floor")
    ok = (entry >= 0) & (col < cols)
    block = block_table[req, col.clamp(0, cols - 1)].to(I64)
    ok = ok & (block >= 0)
    return torch.where(ok, block * block_size + entry % block_size, -1)


def compressed_slot_mapping(query_start_loc, seq_lens, block_table, num_tokens: int, block_size: int,
                            compress_ratio: int):
    """Slot of each token's compressed entry (int64 ``[num_tokens]``, -1 where none is closed)."""
    j = torch.arange(num_tokens, device=seq_lens.device)
    num_reqs = seq_lens.shape[0]
    req = (torch.searchsorted(query_start_loc, j.to(query_start_loc.dtype), right=True) - 1).clamp(0, num_reqs - 1)
    start, end = query_start_loc[req], query_start_loc[req + 1]
    pos = (seq_lens[req] - (end - start) + (j - start)).to(I64)
    closes = (j < end) & (pos >= 0) & ((pos + 1) % compress_ratio == 0)
    entry = torch.div(pos, compress_ratio, rounding_mode="floor")
    return torch.where(closes, _slots(block_table, req, entry, block_size), -1)


def c128a_topk_indices(positions, token_to_req, block_table, slot_mapping, compress_ratio: int, block_size: int,
                       width: int):
    """Decode tokens only: ``(indices int32 [T, width], lens int32 [T])`` of every completed compressed
    entry of the token's request."""
    n = torch.div(positions + 1, compress_ratio, rounding_mode="floor").clamp(0, width)
    entry = torch.arange(width, device=positions.device)[None, :].expand(positions.shape[0], width)
    slots = _slots(block_table, token_to_req.to(I64)[:, None], entry, block_size)
    indices = torch.where(entry < n[:, None], slots, -1).to(I32)
    return indices, torch.where(slot_mapping >= 0, n, 0).to(I32)


def decode_runtime_metadata(seq_lens, decode_query_len: int):
    """``(kv_segment_lens, qo_offset)``, int32 ``[B * decode_query_len]``."""
    kv = seq_lens.repeat_interleave(decode_query_len)
    j = torch.arange(kv.shape[0], device=seq_lens.device) % decode_query_len
    return kv, (kv - decode_query_len + j).to(I32)


def swa_indices(positions, token_to_req, block_table, slot_mapping, window: int, block_size: int):
    """``(indices int32 [T, window], lens int32 [T])``: the slots of each token's last ``window``
    positions."""
    start = (positions - window + 1).clamp_min(0)
    n = (positions + 1 - start).clamp_min(0)
    o = torch.arange(window, device=positions.device)
    slots = _slots(block_table, token_to_req.to(I64)[:, None], start[:, None] + o, block_size)
    indices = torch.where(o < n[:, None], slots, -1).to(I32)
    return indices, torch.where(slot_mapping >= 0, n, 0).to(I32)


def compressed_topk_to_global(local_indices, token_to_req, block_table, slot_mapping, block_size: int):
    """``(indices int32 [T, K], lens int32 [T])``: an indexer's request-local entries as global slots."""
    slots = _slots(block_table, token_to_req.to(I64)[:, None], local_indices.to(I64), block_size)
    k = local_indices.shape[1]
    last = torch.where(slots >= 0, torch.arange(1, k + 1, device=slots.device), 0).amax(dim=1)
    return slots.to(I32), torch.where(slot_mapping >= 0, last, 0).to(I32)


# =====================================================================================================
# KV cache (stand-ins for kv_cache_insert and kv_cache_gather; layouts in docs/formats.md)
# =====================================================================================================


def _page_bytes(cache):
    """``[pages, stride(0)]`` uint8 view of a paged byte cache (keeps a padded page stride)."""
    return cache.as_strided((cache.shape[0], cache.stride(0)), (cache.stride(0), 1))


def _e4m3_bytes(x):
    return x.clamp(-448.0, 448.0).to(F8).view(torch.uint8)


def quantize_fp8_584(kv):
    """``(data uint8 [N, 576], exponents uint8 [N, 8])`` of DeepSeek-V4 records: per 64 values
    ``e = ceil(log2(max(amax, 1e-4) / 448))`` (exact, from the float bits), stored as ``e + 127``."""
    x = kv.float()
    n = x.shape[0]
    tiles = x[:, :448].reshape(n, 7, 64)
    y = tiles.abs().amax(dim=-1).clamp_min(1e-4) / 448.0
    bits = y.view(I32)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(I32)
    fp8 = _e4m3_bytes(tiles * torch.exp2(-e.float())[..., None]).reshape(n, 448)
    rope = x[:, 448:].to(torch.bfloat16).view(torch.uint8)
    exps = torch.cat([(e + 127).clamp(0, 255).to(torch.uint8), torch.zeros(n, 1, dtype=torch.uint8, device=x.device)],
                     dim=1)
    return torch.cat([fp8, rope], dim=1), exps


def kv_cache_insert_fp8_584(kv, slot_mapping, kv_cache):
    """Quantise ``kv [N, 512]`` and write it to valid slots (no negative slot) of a ``fp8_584`` cache
    (eagerly; compiled, use ``write_fp8_584_pages``)."""
    write_fp8_584_pages(kv, slot_mapping, _page_bytes(kv_cache), kv_cache.shape[1])


def write_fp8_584_pages(kv, slot_mapping, pages, page_size: int):
    """``kv_cache_insert_fp8_584`` on the cache's page bytes ``[pages, page stride]``, the tensor the
    ``[pages, page_size, 584]`` view is taken from. This is the form that compiles: ``torch.compile``
    cannot scatter through an ``as_strided`` view whose extent is smaller than its storage."""
    data, exps = quantize_fp8_584(kv)
    page, row = torch.div(slot_mapping, page_size, rounding_mode="floor"), slot_mapping % page_size
    pages[page[:, None], (576 * row)[:, None] + torch.arange(576, device=kv.device)] = data
    pages[page[:, None], (576 * page_size + 8 * row)[:, None] + torch.arange(8, device=kv.device)] = exps


def quantize_fp8_656(kv):
    """uint8 ``[N, 656]`` DeepSeek-V3.2 records: per 128 values ``scale = max(amax / 448, 2**-126)``."""
    x = kv.float()
    n = x.shape[0]
    tiles = x[:, :512].reshape(n, 4, 128)
    scale = (tiles.abs().amax(dim=-1) / 448.0).clamp_min(1.1754944e-38)
    fp8 = _e4m3_bytes(tiles / scale[..., None]).reshape(n, 512)
    return torch.cat([fp8, scale.view(torch.uint8), x[:, 512:].to(torch.bfloat16).view(torch.uint8)], dim=1)


def kv_cache_insert_fp8_656(kv, slot_mapping, kv_cache):
    """Quantise ``kv [N, 576]`` and write it to valid slots of a contiguous ``fp8_656`` cache."""
    kv_cache.view(-1, 656)[slot_mapping] = quantize_fp8_656(kv)


def kv_cache_insert_auto(kv, slot_mapping, kv_cache):
    """Write ``kv [N, D]`` to valid slots of a contiguous plain cache."""
    kv_cache.view(-1, kv_cache.shape[-1])[slot_mapping] = kv.to(kv_cache.dtype)


def gather_fp8_584(kv_cache, slots, dtype=torch.bfloat16):
    """Dequantised ``[..., 512]`` vectors of valid ``slots`` (any shape) of a ``fp8_584`` cache."""
    page_size = kv_cache.shape[1]
    flat = _page_bytes(kv_cache)
    s = slots.to(I64)
    page, row = torch.div(s, page_size, rounding_mode="floor"), s % page_size
    ar = torch.arange(576, device=slots.device)
    data = flat[page[..., None], (576 * row)[..., None] + ar]
    exps = flat[page[..., None], (576 * page_size + 8 * row)[..., None] + ar[:7]]
    nope = data[..., :448].contiguous().view(F8).float().unflatten(-1, (7, 64))
    nope = (nope * torch.exp2(exps.float() - 127)[..., None]).flatten(-2)
    rope = data[..., 448:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=-1).to(dtype)


def gather_fp8_656(kv_cache, slots, dtype=torch.bfloat16):
    """Dequantised ``[..., 576]`` vectors of valid ``slots`` of a contiguous ``fp8_656`` cache."""
    rec = kv_cache.view(-1, 656)[slots.to(I64)]
    nope = rec[..., :512].contiguous().view(F8).float().unflatten(-1, (4, 128))
    scale = rec[..., 512:528].contiguous().view(torch.float32)
    rope = rec[..., 528:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(nope * scale[..., None]).flatten(-2), rope], dim=-1).to(dtype)


def gather_auto(kv_cache, slots, dtype=torch.bfloat16):
    """Vectors of valid ``slots`` of a contiguous plain cache."""
    return kv_cache.view(-1, kv_cache.shape[-1])[slots.to(I64)].to(dtype)


# =====================================================================================================
# Sparse MLA decode (stand-ins for sparse_mla_decode): gather, dequantise, bf16 bmm, fp32 softmax, bmm
# =====================================================================================================


def mla_fp8_656(q, cache, idx, scale):
    """q [T, H, 576] bf16; cache uint8 [pages, page_size, 656] contiguous; idx int32 [T, K] valid slots."""
    flat = cache.view(-1, 656)
    rec = flat[idx.long()]                                                  # [T, K, 656]
    T, K = idx.shape
    nope = rec[..., :512].contiguous().view(F8).float().view(T, K, 4, 128)
    sc = rec[..., 512:528].contiguous().view(torch.float32).view(T, K, 4, 1)
    rope = rec[..., 528:].contiguous().view(torch.bfloat16)
    k = torch.cat([(nope * sc).view(T, K, 512).to(torch.bfloat16), rope], -1)  # [T, K, 576]
    s = torch.bmm(q, k.transpose(1, 2)).float() * scale
    p = torch.softmax(s, -1).to(q.dtype)
    return torch.bmm(p, k[..., :512])


def _keys_fp8_584(cache, idx):
    """bf16 ``[T, K, 512]`` keys of valid slots ``idx`` of a ``fp8_584`` cache (page stride kept)."""
    pages, page_size, _ = cache.shape
    stride = cache.stride(0)
    flat = cache.as_strided((pages, stride), (stride, 1))
    s_ = idx.long()
    pg, i = s_ // page_size, s_ % page_size
    T, K = idx.shape
    ar = torch.arange(576, device=idx.device)
    data = flat[pg[..., None], (576 * i)[..., None] + ar]                   # [T, K, 576]
    exps = flat[pg[..., None], (576 * page_size + 8 * i)[..., None] + ar[:7]]  # [T, K, 7]
    nope = data[..., :448].contiguous().view(F8).float().view(T, K, 7, 64)
    scl = torch.exp2(exps.float() - 127).view(T, K, 7, 1)
    rope = data[..., 448:].contiguous().view(torch.bfloat16)
    return torch.cat([(nope * scl).view(T, K, 448).to(torch.bfloat16), rope], -1)


def mla_fp8_584(q, cache, idx, scale):
    """q [T, H, 512] bf16; cache uint8 [pages, page_size, 584] with page stride cache.stride(0)
    (data rows of 576 bytes, then 8-byte UE8M0 scale rows); idx int32 [T, K] valid slots."""
    k = _keys_fp8_584(cache, idx)
    s = torch.bmm(q, k.transpose(1, 2)).float() * scale
    p = torch.softmax(s, -1).to(q.dtype)
    return torch.bmm(p, k)


def mla_fp8_584_two_caches(q, cache, idx, extra_cache, extra_idx, scale):
    """DeepSeek-V4's two lists: ``mla_fp8_584`` over the keys of ``idx`` in ``cache`` and of
    ``extra_idx`` in ``extra_cache``, in one softmax (all slots valid)."""
    k = torch.cat([_keys_fp8_584(cache, idx), _keys_fp8_584(extra_cache, extra_idx)], dim=1)
    s = torch.bmm(q, k.transpose(1, 2)).float() * scale
    p = torch.softmax(s, -1).to(q.dtype)
    return torch.bmm(p, k)


def mla_bf16(q, cache, idx, scale):
    """q [T, H, 576] bf16; cache bf16 [pages, page_size, 576]; idx int32 [T, K] valid slots."""
    k = cache.view(-1, cache.shape[-1])[idx.long()]
    s = torch.bmm(q, k.transpose(1, 2)).float() * scale
    return torch.bmm(torch.softmax(s, -1).to(q.dtype), k[..., :512])


def mla_fp8_584_masked(q, cache, idx, lens, sink, extra_cache, extra_idx, extra_lens, scale):
    """The whole DeepSeek-V4 decode attention of one layer: like ``mla_fp8_584_two_caches`` but with
    ``-1`` entries, per-token lengths (int32 ``[T]``) and an attention sink (float32 ``[H]``); the
    extra cache is optional (``None`` for a sliding-window-only layer). A token with no candidate gets
    zeros. Returns ``[T, H, 512]`` in ``q.dtype``."""
    keys, valid = [], []
    lists = [(cache, idx, lens)] + ([(extra_cache, extra_idx, extra_lens)] if extra_cache is not None else [])
    for c, i, n in lists:
        keys.append(_keys_fp8_584(c, i.clamp_min(0)))
        valid.append((i >= 0) & (torch.arange(i.shape[1], device=i.device) < n[:, None]))
    k, ok = torch.cat(keys, dim=1), torch.cat(valid, dim=1)
    s = (torch.bmm(q, k.transpose(1, 2)).float() * scale).masked_fill(~ok[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                        # [T, H], -inf when empty
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0).to(q.dtype)
    out = torch.bmm(p, k).float() * torch.sigmoid(lse - sink)[..., None]
    return out.to(q.dtype)


# =====================================================================================================
# Sparse GQA decode and its cache writer (stand-ins for sparse_gqa_decode and gqa_kv_cache_insert;
# layouts in docs/sparse_gqa.md)
# =====================================================================================================


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
