"""Kernels of the metadata operators (SPEC sections 1-4): vectorised PyTorch and Triton.

Every entry point takes the ``out`` overload's arguments (outputs keyword-only) and writes exactly
the region the contract (``docs/operators.md``) gives it. Naming: ``_NAME_kernel`` (Triton) ->
``NAME_triton`` (launcher) and ``NAME_torch`` (PyTorch).

Shared rules, applied identically by both backends:
- a block-table lookup ``block_table[r, c]`` is empty (-1) when ``r`` is outside ``[0, R)``, ``c``
  outside ``[0, M)`` or the block id is negative; nothing out of range is ever read;
- slots are computed in int64; an int32 output whose slot does not fit in int32 is -1;
- no intermediate wraps for any input value: counts derived from an int64 position are computed
  without ``position + 1`` (INT64_MAX would wrap), the int arguments are at most INT32_MAX (checked by
  the fakes), and ``qo_offset`` saturates at INT32_MIN;
- Triton integer ``//`` truncates toward zero, so every division here has a non-negative dividend.
"""

from __future__ import annotations

import torch

from ._launch import KernelLaunch, PlanCache, cdiv, multiprocessor_count
from ._triton import tl, triton

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
_BLOCK_1D = 256  # tokens per program of the 1-D kernels
_BLOCK_COLS = 128  # index columns per program of the 2-D kernels


_PLANS = PlanCache()


def _row_block(cols: int) -> int:
    """Columns per program of a kernel that takes a token's whole index row at once (up to 1,024; a
    longer row takes several programs or iterations)."""
    return min(max(triton.next_power_of_2(max(cols, 1)), _BLOCK_COLS), 1024)


def _row_warps(block: int) -> int:
    return 4 if block <= 512 else 8


def _grid_rows_cols(rows: int, cols: int, block: int = _BLOCK_COLS) -> tuple[int, int]:
    # Tokens go on grid dimension 0 (CUDA caps dimensions 1 and 2 at 65535, a prefill can exceed it);
    # at least one column program, which also writes the token's length.
    return (rows, max(cdiv(cols, block), 1))


# =====================================================================================================
# PyTorch kernels
# =====================================================================================================


def _lookup_slots_torch(block_table: torch.Tensor, req: torch.Tensor, entry: torch.Tensor, block_size: int,
                        valid: torch.Tensor) -> torch.Tensor:
    """int64 slot of request-local entry ``entry`` (broadcast against ``req``), -1 where invalid.

    ``valid`` marks entries that are meant to be looked up; the block-table bounds and a negative
    block id add to it.
    """
    num_req, width = block_table.shape
    entry = entry.to(torch.int64)
    req = req.to(torch.int64)
    col = torch.div(entry, block_size, rounding_mode="floor")
    ok = valid & (entry >= 0) & (col < width) & (req >= 0) & (req < num_req)
    if block_table.numel() == 0:
        return torch.full(ok.shape, -1, dtype=torch.int64, device=ok.device)
    block = block_table[req.clamp(0, num_req - 1), col.clamp(0, width - 1)].to(torch.int64)
    ok = ok & (block >= 0)
    return torch.where(ok, block * block_size + (entry - col * block_size), -1)


def _to_index32(slots: torch.Tensor) -> torch.Tensor:
    return torch.where(slots > INT32_MAX, -1, slots).to(torch.int32)


def compressed_slot_mapping_torch(query_start_loc, seq_lens, block_table, block_size, compress_ratio, *, out):
    n, num_req = out.shape[0], seq_lens.shape[0]
    if n == 0:
        return
    if num_req == 0:
        out.fill_(-1)
        return
    j = torch.arange(n, device=out.device, dtype=torch.int64)
    starts = query_start_loc.to(torch.int64)
    req = torch.searchsorted(starts[:num_req].contiguous(), j, right=True) - 1
    req_c = req.clamp(0, num_req - 1)
    in_req = (req >= 0) & (j < starts[req_c + 1])
    query_len = starts[req_c + 1] - starts[req_c]
    pos = seq_lens.to(torch.int64)[req_c] - query_len + (j - starts[req_c])
    closes = in_req & (pos >= 0) & (torch.remainder(pos + 1, compress_ratio) == 0)
    entry = torch.div(pos, compress_ratio, rounding_mode="floor")
    out.copy_(_lookup_slots_torch(block_table, req_c, entry, block_size, closes))


def _completed_entries_torch(positions: torch.Tensor, ratio: int, width: int) -> torch.Tensor:
    """``clamp((p + 1) // ratio, 0, width)`` without computing ``p + 1`` (which wraps at INT64_MAX)."""
    p = positions.clamp(min=0)
    quotient = torch.div(p, ratio, rounding_mode="floor").clamp(max=width)  # before the + 1 (ratio 1, INT64_MAX)
    n = quotient + (p - quotient * ratio == ratio - 1).to(torch.int64)
    return torch.where(positions < 0, 0, n).clamp(max=width)


def _window_len_torch(positions: torch.Tensor, window: int) -> torch.Tensor:
    """``n = p + 1 - max(p - window + 1, 0)``, 0 for ``p < 0``, without wrapping at the int64 ends."""
    return torch.where(positions < 0, 0, positions.clamp(max=window - 1) + 1)


def c128a_topk_indices_torch(positions, token_to_req, block_table, slot_mapping, num_decode_tokens,
                             compress_ratio, block_size, width, *, decode_indices, decode_lens, prefill_indices):
    num_tokens = positions.shape[0]
    n = _completed_entries_torch(positions, compress_ratio, width)
    o = torch.arange(width, device=positions.device, dtype=torch.int64)
    used = o[None, :] < n[:, None]
    d = num_decode_tokens
    if d > 0:
        slots = _lookup_slots_torch(block_table, token_to_req[:d, None], o[None, :], block_size, used[:d])
        decode_indices[:d, :width].copy_(_to_index32(slots))
        decode_lens[:d].copy_(torch.where(slot_mapping[:d] >= 0, n[:d], 0).to(torch.int32))
    if num_tokens > d:
        prefill_indices[: num_tokens - d, :width].copy_(torch.where(used[d:], o[None, :], -1).to(torch.int32))


def decode_runtime_metadata_torch(seq_lens, decode_query_len, *, kv_segment_lens, qo_offset):
    q = decode_query_len
    expanded = seq_lens.repeat_interleave(q)
    kv_segment_lens.copy_(expanded)
    offset = torch.arange(q, device=seq_lens.device, dtype=torch.int64).repeat(seq_lens.shape[0])
    qo_offset.copy_((expanded.to(torch.int64) - q + offset).clamp(min=INT32_MIN))


def swa_indices_torch(positions, token_to_req, block_table, slot_mapping, window, block_size, *, indices, lens):
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return
    n = _window_len_torch(positions, window)
    start = torch.where(positions < 0, 0, positions - n + 1)
    o = torch.arange(window, device=positions.device, dtype=torch.int64)
    used = o[None, :] < n[:, None]
    slots = _lookup_slots_torch(block_table, token_to_req[:, None], start[:, None] + o[None, :], block_size, used)
    indices[:num_tokens, :window].copy_(_to_index32(slots))
    lens[:num_tokens].copy_(torch.where(slot_mapping >= 0, n, 0).to(torch.int32))


def compressed_topk_to_global_torch(local_indices, token_to_req, block_table, slot_mapping, block_size, *,
                                    indices, lens):
    num_tokens, k = local_indices.shape
    if num_tokens == 0:
        return
    slots = _to_index32(_lookup_slots_torch(block_table, token_to_req[:, None], local_indices, block_size,
                                            local_indices >= 0))
    indices[:num_tokens, :k].copy_(slots)
    col = torch.arange(1, k + 1, device=slots.device, dtype=torch.int32)
    last = torch.where(slots >= 0, col[None, :], 0).amax(dim=1) if k > 0 else torch.zeros_like(token_to_req)
    lens[:num_tokens].copy_(torch.where(slot_mapping >= 0, last, 0))


# =====================================================================================================
# Triton kernels
# =====================================================================================================


@triton.jit
def _lookup_slots(
    block_table_ptr, stride_bt_r, stride_bt_c,  # int32 [R, M]
    num_req, max_blocks,
    req,  # int64, any shape
    entry,  # int64, same shape: request-local entry number
    valid,  # bool, same shape
    BLOCK_SIZE: tl.constexpr,
):
    """int64 slot of ``entry`` through row ``req`` of the block table, -1 where empty; never reads out
    of bounds (the load is masked by the same conditions). The block size is a compile-time constant,
    so the division is a shift (or a multiply) instead of a 64-bit division routine."""
    stride_bt_r = tl.cast(stride_bt_r, tl.int64)
    stride_bt_c = tl.cast(stride_bt_c, tl.int64)
    entry_safe = tl.maximum(entry, 0)
    col = entry_safe // BLOCK_SIZE
    ok = valid & (entry >= 0) & (col < max_blocks) & (req >= 0) & (req < num_req)
    block = tl.load(block_table_ptr + req * stride_bt_r + col * stride_bt_c, mask=ok, other=-1).to(tl.int64)
    ok = ok & (block >= 0)
    return tl.where(ok, block * BLOCK_SIZE + (entry_safe - col * BLOCK_SIZE), -1)


@triton.jit
def _completed_entries(pos, compress_ratio: tl.constexpr, width):
    """``clamp((pos + 1) // compress_ratio, 0, width)`` for an int64 ``pos`` without computing
    ``pos + 1``: the quotient of ``max(pos, 0)``, plus one when its remainder is ``ratio - 1``."""
    pos_safe = tl.maximum(pos, 0)
    quotient = tl.minimum(pos_safe // compress_ratio, width)  # before the + 1 (ratio 1 at INT64_MAX)
    n = quotient + ((pos_safe - quotient * compress_ratio) == compress_ratio - 1).to(tl.int64)
    return tl.minimum(tl.where(pos < 0, 0, n), width)


@triton.jit
def _compressed_slot_mapping_kernel(
    query_start_loc_ptr, stride_qsl,  # int32 [R+1]
    seq_lens_ptr, stride_sl,  # int32 [R]
    block_table_ptr, stride_bt_r, stride_bt_c,  # int32 [R, M]
    out_ptr, stride_out,  # int64 [N]
    num_out, num_req, max_blocks,
    search_steps,  # bit length of R: enough binary-search iterations for R requests (TABLE == 0)
    BLOCK_SIZE: tl.constexpr, RATIO: tl.constexpr, BLOCK: tl.constexpr,
    TABLE: tl.constexpr,  # > 0: the R request starts fit one load of TABLE entries (a power of two)
    GATHER: tl.constexpr,  # with TABLE: the starts, ends and context lengths all loaded at once (few R)
):
    stride_qsl = tl.cast(stride_qsl, tl.int64)
    stride_sl = tl.cast(stride_sl, tl.int64)
    stride_out = tl.cast(stride_out, tl.int64)
    j0 = tl.program_id(0).to(tl.int64) * BLOCK
    j = j0 + tl.arange(0, BLOCK)
    live = j < num_out
    # req = the largest r in [0, R) with query_start_loc[r] <= j, or -1: every output element finds its
    # request by itself, so each element is written exactly once and padding past the last request
    # gets -1. (For a non-decreasing query_start_loc; for any other, req is still in [-1, R).)
    if GATHER:
        # A few requests: every request's start, end and context length in one round of loads, and each
        # token picks its own from registers ([BLOCK, TABLE] compares): no load waits for the token's
        # request (the other forms load them at req, one memory round trip later).
        r = tl.arange(0, TABLE)
        in_r = r < num_req
        starts = tl.load(query_start_loc_ptr + r * stride_qsl, mask=in_r, other=2**31 - 1).to(tl.int64)
        ends = tl.load(query_start_loc_ptr + (r + 1) * stride_qsl, mask=in_r, other=0).to(tl.int64)
        lens = tl.load(seq_lens_ptr + r * stride_sl, mask=in_r, other=0).to(tl.int64)
        req = tl.sum((starts[None, :] <= j[:, None]).to(tl.int32), axis=1).to(tl.int64) - 1
        pick = r[None, :] == req[:, None]  # none where req == -1
        start = tl.sum(tl.where(pick, starts[None, :], 0), axis=1)
        end = tl.sum(tl.where(pick, ends[None, :], 0), axis=1)
        seq_len = tl.sum(tl.where(pick, lens[None, :], 0), axis=1)
    elif TABLE > 0:
        # All R starts in one load, no chain of dependent loads: req(j) = #{r : start_r <= j} - 1, the
        # count at j0 plus a running sum of how many requests start at each of j0 + 1 .. j0 + BLOCK - 1.
        r = tl.arange(0, TABLE)
        starts = tl.load(query_start_loc_ptr + r * stride_qsl, mask=r < num_req, other=2**31 - 1).to(tl.int64)
        base = tl.sum((starts <= j0).to(tl.int32), axis=0) - 1
        off = starts - j0
        new = tl.histogram(tl.where((off > 0) & (off < BLOCK), off, 0).to(tl.int32), BLOCK)  # bin 0: the rest
        req = base + tl.cumsum(tl.where(tl.arange(0, BLOCK) == 0, 0, new), 0).to(tl.int64)
    else:
        lo = tl.zeros([BLOCK], dtype=tl.int64)
        hi = tl.zeros([BLOCK], dtype=tl.int64) + num_req  # search in [lo, hi)
        for _ in range(search_steps):
            mid = (lo + hi) // 2
            go = lo < hi
            start_mid = tl.load(query_start_loc_ptr + mid * stride_qsl, mask=go & live, other=0).to(tl.int64)
            right = go & (start_mid <= j)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(go & ~right, mid, hi)
        req = lo - 1
    has_req = live & (req >= 0)
    if not GATHER:
        start = tl.load(query_start_loc_ptr + req * stride_qsl, mask=has_req, other=0).to(tl.int64)
        end = tl.load(query_start_loc_ptr + (req + 1) * stride_qsl, mask=has_req, other=0).to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + req * stride_sl, mask=has_req, other=0).to(tl.int64)
    pos = seq_len - (end - start) + (j - start)
    pos_safe = tl.maximum(pos, 0)
    closes = has_req & (j < end) & (pos >= 0) & ((pos_safe + 1) % RATIO == 0)
    slot = _lookup_slots(block_table_ptr, stride_bt_r, stride_bt_c, num_req, max_blocks, req,
                         pos_safe // RATIO, closes, BLOCK_SIZE)
    tl.store(out_ptr + j * stride_out, slot, mask=live)


# ``compressed_slot_mapping`` finds each token's request in one of three ways, by the number of
# requests R: R <= SEARCH_GATHER_MAX, every request's start, end and context length loaded at once
# and picked from registers (GATHER); SEARCH_TABLE_MIN <= R <= SEARCH_TABLE_MAX, all R request starts
# loaded at once (one register tile per program) and counted (TABLE); otherwise each token runs a
# binary search, a chain of dependent loads (bit length of R of them): the cheaper form between the
# two ranges (3-7 requests with these values; on an H200 the gather was 0.6 µs slower at 4 requests and
# 1.8 at 7) and past SEARCH_TABLE_MAX, where every program's count over the whole table costs more.
SEARCH_GATHER_MAX = 2  # an H200: 0.3 µs faster than the search at 1 and 2 requests, 0.6 slower at 4
SEARCH_TABLE_MIN = 8
SEARCH_TABLE_MAX = 2048


def compressed_slot_mapping_triton(query_start_loc, seq_lens, block_table, block_size, compress_ratio, *, out):
    n = out.shape[0]
    if n == 0:
        return
    key = ("compressed_slot_mapping", n, query_start_loc.stride(0), seq_lens.shape[0], seq_lens.stride(0),
           block_table.shape, block_table.stride(), out.stride(0), block_size, compress_ratio, out.device,
           SEARCH_GATHER_MAX, SEARCH_TABLE_MIN, SEARCH_TABLE_MAX)
    launch = _PLANS.get(key)
    if launch is None:
        num_req = seq_lens.shape[0]
        gather = num_req <= SEARCH_GATHER_MAX
        table = (triton.next_power_of_2(max(num_req, 1))
                 if gather or SEARCH_TABLE_MIN <= num_req <= SEARCH_TABLE_MAX else 0)
        args = (query_start_loc, query_start_loc.stride(0), seq_lens, seq_lens.stride(0),
                block_table, block_table.stride(0), block_table.stride(1), out, out.stride(0),
                n, num_req, block_table.shape[1], max(num_req.bit_length(), 1))
        launch = _PLANS.put(key, KernelLaunch(_compressed_slot_mapping_kernel, (cdiv(n, _BLOCK_1D),), args,
                                              dict(BLOCK_SIZE=block_size, RATIO=compress_ratio, BLOCK=_BLOCK_1D,
                                                   TABLE=table, GATHER=gather),
                                              num_warps=4, device=out.device))
    launch(query_start_loc, seq_lens, block_table, out)


@triton.jit
def _c128a_topk_indices_kernel(
    positions_ptr, stride_pos,  # int64 [T]
    token_to_req_ptr, stride_ttr,  # int32 [T]
    block_table_ptr, stride_bt_r, stride_bt_c,  # int32 [R, M]
    slot_mapping_ptr, stride_sm,  # int64 [T]
    dec_idx_ptr, stride_di_r, stride_di_c,  # int32 [>=D, >=width]
    dec_lens_ptr, stride_dl,  # int32 [>=D]
    pre_idx_ptr, stride_pi_r, stride_pi_c,  # int32 [>=P, >=width]
    num_decode, num_req, max_blocks, width,
    RATIO: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    stride_pos = tl.cast(stride_pos, tl.int64)
    stride_ttr = tl.cast(stride_ttr, tl.int64)
    stride_sm = tl.cast(stride_sm, tl.int64)
    stride_di_r = tl.cast(stride_di_r, tl.int64)
    stride_di_c = tl.cast(stride_di_c, tl.int64)
    stride_dl = tl.cast(stride_dl, tl.int64)
    stride_pi_r = tl.cast(stride_pi_r, tl.int64)
    stride_pi_c = tl.cast(stride_pi_c, tl.int64)
    t = tl.program_id(0).to(tl.int64)  # one token per program row
    pid_c = tl.program_id(1)
    o = pid_c * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    cols = o < width
    pos = tl.load(positions_ptr + t * stride_pos)
    n = _completed_entries(pos, RATIO, width)
    used = o < n
    if t < num_decode:
        req = tl.load(token_to_req_ptr + t * stride_ttr).to(tl.int64)
        slot = _lookup_slots(block_table_ptr, stride_bt_r, stride_bt_c, num_req, max_blocks,
                             req + tl.zeros_like(o), o, used, BLOCK_SIZE)
        slot = tl.where(slot > 2147483647, -1, slot)
        tl.store(dec_idx_ptr + t * stride_di_r + o * stride_di_c, slot.to(tl.int32), mask=cols)
        if pid_c == 0:
            # Loaded after the index stores, unlike swa_indices and compressed_topk_to_global: loaded
            # before them, an H200 replayed T = 128 0.2-0.3 µs slower in two comparisons (T = 1 and 1024
            # within 0.13 µs; benchmarks.md, History, "Commit c616a44").
            is_real = tl.load(slot_mapping_ptr + t * stride_sm) >= 0
            tl.store(dec_lens_ptr + t * stride_dl, tl.where(is_real, n, 0).to(tl.int32))
    else:
        row = t - num_decode
        tl.store(pre_idx_ptr + row * stride_pi_r + o * stride_pi_c, tl.where(used, o, -1).to(tl.int32), mask=cols)


def c128a_topk_indices_triton(positions, token_to_req, block_table, slot_mapping, num_decode_tokens,
                              compress_ratio, block_size, width, *, decode_indices, decode_lens, prefill_indices):
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return
    key = ("c128a_topk_indices", num_tokens, positions.stride(0), token_to_req.stride(0), block_table.shape,
           block_table.stride(), slot_mapping.stride(0), decode_indices.stride(), decode_lens.stride(0),
           prefill_indices.stride(), num_decode_tokens, compress_ratio, block_size, width, positions.device)
    launch = _PLANS.get(key)
    if launch is None:
        args = (positions, positions.stride(0), token_to_req, token_to_req.stride(0),
                block_table, block_table.stride(0), block_table.stride(1), slot_mapping, slot_mapping.stride(0),
                decode_indices, decode_indices.stride(0), decode_indices.stride(1),
                decode_lens, decode_lens.stride(0),
                prefill_indices, prefill_indices.stride(0), prefill_indices.stride(1),
                num_decode_tokens, block_table.shape[0], block_table.shape[1], width)
        block = _row_block(width)
        grid = _grid_rows_cols(num_tokens, width, block)
        launch = _PLANS.put(key, KernelLaunch(_c128a_topk_indices_kernel, grid, args,
                                              dict(RATIO=compress_ratio, BLOCK_SIZE=block_size, BLOCK=block),
                                              num_warps=_row_warps(block), device=positions.device))
    launch(positions, token_to_req, block_table, slot_mapping, decode_indices, decode_lens, prefill_indices)


@triton.jit
def _decode_runtime_metadata_kernel(
    seq_lens_ptr, stride_sl,  # int32 [B]
    kv_lens_ptr, stride_kv,  # int32 [B*q]
    qo_offset_ptr, stride_qo,  # int32 [B*q]
    num_rows, decode_query_len,
    BLOCK: tl.constexpr,
):
    stride_sl = tl.cast(stride_sl, tl.int64)
    stride_kv = tl.cast(stride_kv, tl.int64)
    stride_qo = tl.cast(stride_qo, tl.int64)
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = r < num_rows
    req = r // decode_query_len
    seq_len = tl.load(seq_lens_ptr + req * stride_sl, mask=live, other=0)
    tl.store(kv_lens_ptr + r * stride_kv, seq_len, mask=live)
    qo = seq_len.to(tl.int64) - decode_query_len + (r - req * decode_query_len)  # saturates, never wraps
    tl.store(qo_offset_ptr + r * stride_qo, tl.maximum(qo, -2147483648).to(tl.int32), mask=live)


def decode_runtime_metadata_triton(seq_lens, decode_query_len, *, kv_segment_lens, qo_offset):
    rows = kv_segment_lens.shape[0]
    if rows == 0:
        return
    key = ("decode_runtime_metadata", rows, seq_lens.stride(0), kv_segment_lens.stride(0), qo_offset.stride(0),
           decode_query_len, seq_lens.device)
    launch = _PLANS.get(key)
    if launch is None:
        args = (seq_lens, seq_lens.stride(0), kv_segment_lens, kv_segment_lens.stride(0), qo_offset,
                qo_offset.stride(0), rows, decode_query_len)
        launch = _PLANS.put(key, KernelLaunch(_decode_runtime_metadata_kernel, (cdiv(rows, _BLOCK_1D),), args,
                                              dict(BLOCK=_BLOCK_1D), num_warps=4, device=seq_lens.device))
    launch(seq_lens, kv_segment_lens, qo_offset)


@triton.jit
def _swa_indices_kernel(
    positions_ptr, stride_pos,  # int64 [T]
    token_to_req_ptr, stride_ttr,  # int32 [T]
    block_table_ptr, stride_bt_r, stride_bt_c,  # int32 [R, M]
    slot_mapping_ptr, stride_sm,  # int64 [T]
    idx_ptr, stride_i_r, stride_i_c,  # int32 [>=T, >=window]
    lens_ptr, stride_l,  # int32 [>=T]
    num_req, max_blocks, window,
    BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    stride_pos = tl.cast(stride_pos, tl.int64)
    stride_ttr = tl.cast(stride_ttr, tl.int64)
    stride_sm = tl.cast(stride_sm, tl.int64)
    stride_i_r = tl.cast(stride_i_r, tl.int64)
    stride_i_c = tl.cast(stride_i_c, tl.int64)
    stride_l = tl.cast(stride_l, tl.int64)
    t = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    o = pid_c * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    pos = tl.load(positions_ptr + t * stride_pos)
    n = tl.where(pos < 0, 0, tl.minimum(pos, window - 1) + 1)  # no pos + 1: INT64_MAX would wrap
    start = tl.where(pos < 0, 0, pos - n + 1)
    req = tl.load(token_to_req_ptr + t * stride_ttr).to(tl.int64)
    is_real = tl.load(slot_mapping_ptr + t * stride_sm) >= 0  # before the stores (_compressed_topk_to_global_kernel)
    slot = _lookup_slots(block_table_ptr, stride_bt_r, stride_bt_c, num_req, max_blocks,
                         req + tl.zeros_like(o), start + o, o < n, BLOCK_SIZE)
    slot = tl.where(slot > 2147483647, -1, slot)
    tl.store(idx_ptr + t * stride_i_r + o * stride_i_c, slot.to(tl.int32), mask=o < window)
    if pid_c == 0:
        tl.store(lens_ptr + t * stride_l, tl.where(is_real, n, 0).to(tl.int32))


def swa_indices_triton(positions, token_to_req, block_table, slot_mapping, window, block_size, *, indices, lens):
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return
    key = ("swa_indices", num_tokens, positions.stride(0), token_to_req.stride(0), block_table.shape,
           block_table.stride(), slot_mapping.stride(0), indices.stride(), lens.stride(0), window, block_size,
           positions.device)
    launch = _PLANS.get(key)
    if launch is None:
        args = (positions, positions.stride(0), token_to_req, token_to_req.stride(0),
                block_table, block_table.stride(0), block_table.stride(1), slot_mapping, slot_mapping.stride(0),
                indices, indices.stride(0), indices.stride(1), lens, lens.stride(0),
                block_table.shape[0], block_table.shape[1], window)
        launch = _PLANS.put(key, KernelLaunch(_swa_indices_kernel, _grid_rows_cols(num_tokens, window), args,
                                              dict(BLOCK_SIZE=block_size, BLOCK=_BLOCK_COLS), num_warps=4,
                                              device=positions.device))
    launch(positions, token_to_req, block_table, slot_mapping, indices, lens)


@triton.jit
def _compressed_topk_to_global_kernel(
    local_ptr, stride_li_r, stride_li_c,  # int32 [T, K]
    token_to_req_ptr, stride_ttr,  # int32 [T]
    block_table_ptr, stride_bt_r, stride_bt_c,  # int32 [R, M]
    slot_mapping_ptr, stride_sm,  # int64 [T]
    idx_ptr, stride_i_r, stride_i_c,  # int32 [>=T, >=K]
    lens_ptr, stride_l,  # int32 [>=T]
    num_req, max_blocks, k,
    BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
    LOOP: tl.constexpr,  # K > BLOCK: the row in a loop of BLOCK columns
):
    # One program per token walks all K columns, so ``lens`` (the last non-empty column + 1) needs
    # no cross-program reduction; ``BLOCK`` covers a whole row up to 1,024 columns (2,048 in calls of
    # one wave, TOPK_ONE_STEP_MAX_COLS), so the lookups of a row are one batch of loads, not a chain.
    stride_li_r = tl.cast(stride_li_r, tl.int64)
    stride_li_c = tl.cast(stride_li_c, tl.int64)
    stride_ttr = tl.cast(stride_ttr, tl.int64)
    stride_sm = tl.cast(stride_sm, tl.int64)
    stride_i_r = tl.cast(stride_i_r, tl.int64)
    stride_i_c = tl.cast(stride_i_c, tl.int64)
    stride_l = tl.cast(stride_l, tl.int64)
    t = tl.program_id(0).to(tl.int64)
    req = tl.load(token_to_req_ptr + t * stride_ttr).to(tl.int64)
    # Loaded before any store: a load placed after a store to ``indices`` (which may alias it) waits
    # for that store, one more memory round trip per program.
    is_real = tl.load(slot_mapping_ptr + t * stride_sm) >= 0
    last = tl.zeros([BLOCK], dtype=tl.int32)
    if LOOP:  # K > BLOCK (1,024)
        for c0 in range(0, k, BLOCK):
            last = _topk_columns(local_ptr + t * stride_li_r, stride_li_c, block_table_ptr, stride_bt_r, stride_bt_c,
                                 idx_ptr + t * stride_i_r, stride_i_c, num_req, max_blocks, k, req, c0, last,
                                 BLOCK_SIZE, BLOCK)
    else:  # the whole row in straight-line code
        last = _topk_columns(local_ptr + t * stride_li_r, stride_li_c, block_table_ptr, stride_bt_r, stride_bt_c,
                             idx_ptr + t * stride_i_r, stride_i_c, num_req, max_blocks, k, req, 0, last,
                             BLOCK_SIZE, BLOCK)
    tl.store(lens_ptr + t * stride_l, tl.where(is_real, tl.max(last, axis=0), 0))


@triton.jit
def _topk_columns(local_row, stride_li_c, block_table_ptr, stride_bt_r, stride_bt_c, idx_row, stride_i_c,
                  num_req, max_blocks, k, req, c0, last, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Columns ``c0 .. c0 + BLOCK - 1`` of one token's row: looks them up, stores them, returns ``last``
    updated with their last non-empty column + 1."""
    o = c0 + tl.arange(0, BLOCK).to(tl.int64)
    cols = o < k
    entry = tl.load(local_row + o * stride_li_c, mask=cols, other=-1).to(tl.int64)
    slot = _lookup_slots(block_table_ptr, stride_bt_r, stride_bt_c, num_req, max_blocks,
                         req + tl.zeros_like(o), entry, cols, BLOCK_SIZE)
    slot = tl.where(slot > 2147483647, -1, slot)
    tl.store(idx_row + o * stride_i_c, slot.to(tl.int32), mask=cols)
    return tl.maximum(last, tl.where(slot >= 0, o + 1, 0).to(tl.int32))


# ``compressed_topk_to_global`` walks a row of up to 1,024 columns in one step (straight-line code, one
# batch of loads), a longer one in a loop of 1,024-column steps, except that a row of up to
# TOPK_ONE_STEP_MAX_COLS columns (a DeepSeek-V3.2 indexer row is 2,048) is one step at 16 warps while
# the call's programs fit one wave: TOPK_ONE_STEP_PROGRAMS_PER_SM per multiprocessor (2,048 threads; the
# sm_90 kernel takes 26 registers a thread, so four programs of 512 threads are resident together).
# Past one wave the loop's smaller programs keep more loads in flight. An H200 (132 multiprocessors:
# one wave up to 528 tokens), K = 2,048, CUDA-graph replay, loop / one step, µs: T = 1 7.33 / 6.05,
# 128 7.58 / 6.69, 256 8.13 / 7.39, 512 8.83 / 8.42, 640 9.38 / 9.98, 1024 11.07 / 11.90.
TOPK_ONE_STEP_MAX_COLS = 2048
TOPK_ONE_STEP_PROGRAMS_PER_SM = 4


def compressed_topk_to_global_triton(local_indices, token_to_req, block_table, slot_mapping, block_size, *,
                                     indices, lens):
    num_tokens, k = local_indices.shape
    if num_tokens == 0:
        return
    key = ("compressed_topk_to_global", local_indices.shape, local_indices.stride(), token_to_req.stride(0),
           block_table.shape, block_table.stride(), slot_mapping.stride(0), indices.stride(), lens.stride(0),
           block_size, local_indices.device)
    launch = _PLANS.get(key)
    if launch is None:
        args = (local_indices, local_indices.stride(0), local_indices.stride(1), token_to_req, token_to_req.stride(0),
                block_table, block_table.stride(0), block_table.stride(1), slot_mapping, slot_mapping.stride(0),
                indices, indices.stride(0), indices.stride(1), lens, lens.stride(0),
                block_table.shape[0], block_table.shape[1], k)
        block = _row_block(k)
        warps = _row_warps(block)
        if (1024 < k <= TOPK_ONE_STEP_MAX_COLS
                and num_tokens <= TOPK_ONE_STEP_PROGRAMS_PER_SM * multiprocessor_count(local_indices.device)):
            block, warps = triton.next_power_of_2(k), 16
        launch = _PLANS.put(key, KernelLaunch(_compressed_topk_to_global_kernel, (num_tokens,), args,
                                              dict(BLOCK_SIZE=block_size, BLOCK=block, LOOP=k > block),
                                              num_warps=warps,
                                              device=local_indices.device))
    launch(local_indices, token_to_req, block_table, slot_mapping, indices, lens)
