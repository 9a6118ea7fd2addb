"""Kernels of sparse_gqa_decode (SPEC section 7): vectorised PyTorch and Triton.

Both entry points take the ``out`` overload's arguments (``out`` keyword-only) and write every element
of ``out``. Naming: ``_sparse_gqa_decode_kernel`` / ``_sparse_gqa_combine_kernel`` (Triton) ->
``sparse_gqa_decode_triton`` (launcher) and ``sparse_gqa_decode_torch`` (PyTorch).

Rules shared by both backends (the arguments were validated by the fake, from metadata only):
- row ``t`` belongs to request ``r = t // decode_query_len``; a row with ``r >= B`` has no key;
- a selected page ``b`` is used when ``0 <= b < W`` and its physical page ``p = block_table[r, b]``
  satisfies ``0 <= p < kv_cache.shape[0]``; nothing outside those bounds is ever read;
- inside a used page, key ``o`` (position ``x = b * page_size + o``) is used when
  ``x < min(qo_offset[t] + 1, kv_segment_lens[t])``; unused keys are never read, so stale or NaN
  values past a sequence's end cannot leak into the output;
- a selected page listed twice counts twice (the SPEC assumes distinct pages and nothing checks it);
- stored values are converted to float32; ``score = softmax_scale * q_scale * k_scale * <q, k>``,
  ``out = v_scale * softmax(score) @ v``; a row without keys gets zeros.
"""

from __future__ import annotations

import torch

from ._launch import LOG2E, KernelLaunch, LaunchPlan, PlanCache, cdiv, multiprocessor_count, next_pow2, prev_pow2
from ._triton import tl, triton

# =====================================================================================================
# PyTorch kernels
# =====================================================================================================

# Gathered float32 elements per chunk of rows in the CPU kernel (bounds its memory to a few hundred MB).
_TORCH_CHUNK_ELEMENTS = 1 << 24


def sparse_gqa_decode_dense(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len,
                            softmax_scale, q_scale=1.0, k_scale=1.0, v_scale=1.0, first_row=0):
    """The whole operator as one gather-and-softmax expression: float32 ``[T, Hq, Dh]``.

    ``first_row`` is the absolute index of ``q``'s first row (the CPU kernel calls this on chunks of
    rows; the request of row ``t`` is ``(first_row + t) // decode_query_len``). Also the body of the
    ``torch.compile``d reference of the benchmark.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, page_size, _ = kv_cache.shape
    num_req, max_blocks = block_table.shape
    n_sel = topk_pages.shape[2]
    group = num_q_heads // num_kv_heads
    device = q.device
    if num_tokens * num_q_heads * n_sel * num_pages * num_req * max_blocks == 0:
        return torch.zeros((num_tokens, num_q_heads, head_dim), dtype=torch.float32, device=device)

    t = torch.arange(first_row, first_row + num_tokens, device=device)
    req = torch.div(t, decode_query_len, rounding_mode="floor")
    b = topk_pages.to(torch.int64)  # [T, Hkv, n]
    page_ok = (b >= 0) & (b < max_blocks) & (req < num_req)[:, None, None]
    phys = block_table[req.clamp(max=num_req - 1)[:, None, None], b.clamp(0, max_blocks - 1)].to(torch.int64)
    page_ok = page_ok & (phys >= 0) & (phys < num_pages)
    limit = torch.minimum(qo_offset.to(torch.int64) + 1, kv_segment_lens.to(torch.int64))  # [T]
    pos = b[..., None] * page_size + torch.arange(page_size, device=device)  # [T, Hkv, n, page_size]
    key_ok = (page_ok[..., None] & (pos < limit[:, None, None, None])).flatten(2)  # [T, Hkv, L]

    heads = torch.arange(num_kv_heads, device=device)[None, :, None]
    kv = kv_cache[phys.clamp(0, num_pages - 1), heads].flatten(2, 3)  # [T, Hkv, L, 2*Dh], stored dtype
    # ``where`` rather than a product: clamped indices may point at pages holding NaN or garbage.
    kv = torch.where(key_ok[..., None], kv.to(torch.float32), 0.0)
    k, v = kv[..., :head_dim], kv[..., head_dim:]

    qf = q.to(torch.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = torch.einsum("tgid,tgld->tgil", qf, k) * (softmax_scale * q_scale * k_scale)
    scores = scores.masked_fill(~key_ok[:, :, None, :], float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(row_max == float("-inf"), 0.0, row_max)  # rows without keys: exp(-inf) = 0
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    o = torch.einsum("tgil,tgld->tgid", p, v) * (v_scale / torch.where(denom > 0, denom, 1.0))
    return o.reshape(num_tokens, num_q_heads, head_dim)


def sparse_gqa_decode_torch(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len,
                            softmax_scale, q_scale=1.0, k_scale=1.0, v_scale=1.0, *, out):
    """CPU kernel. Arguments: the ``out`` overload's."""
    num_tokens = q.shape[0]
    _, num_kv_heads, page_size, two_dh = kv_cache.shape
    per_row = max(num_kv_heads * topk_pages.shape[2] * page_size * two_dh, 1)
    rows = max(_TORCH_CHUNK_ELEMENTS // per_row, 1)
    for start in range(0, num_tokens, rows):
        end = min(start + rows, num_tokens)
        o = sparse_gqa_decode_dense(q[start:end], kv_cache, topk_pages[start:end], block_table,
                                    kv_segment_lens[start:end], qo_offset[start:end], decode_query_len,
                                    softmax_scale, q_scale, k_scale, v_scale, first_row=start)
        out[start:end].copy_(o)


# =====================================================================================================
# Triton kernels
# =====================================================================================================

# Operand dtype of tl.dot, chosen by the launcher from the query and cache dtypes.
_DOT_FP16, _DOT_BF16, _DOT_FP32 = 0, 1, 2


@triton.jit
def _to_dot(x, DOT: tl.constexpr):
    """float32 -> the tl.dot operand dtype."""
    if DOT == 0:
        return x.to(tl.float16)
    elif DOT == 1:
        return x.to(tl.bfloat16)
    else:
        return x


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    # float32 operands only occur for a float16/bfloat16 mix; they get exact products, not TF32.
    if DOT == 2:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _sparse_gqa_decode_kernel(
    q_ptr, stride_q_t, stride_q_h, stride_q_d,  # [T, Hq, Dh]
    kv_ptr, stride_kv_p, stride_kv_h, stride_kv_o,  # [pages, Hkv, page_size, 2*Dh], stride(-1) == 1
    topk_ptr, stride_tk_t, stride_tk_h, stride_tk_j,  # int32 [T, Hkv, n_sel]
    bt_ptr, stride_bt_r, stride_bt_c,  # int32 [B, W]
    kv_lens_ptr, stride_kvl,  # int32 [T]
    qo_ptr, stride_qo,  # int32 [T]
    out_ptr, stride_o_t, stride_o_h, stride_o_d,  # [T, Hq, Dh]; written when not SPLIT
    ws_ptr, ws_rows,  # SPLIT: float32 workspace of m [R], l [R], acc [R, Dh], R = ws_rows = T * Hq * S
    num_kv_heads, group, num_head_blocks,  # group = Hq / Hkv
    num_pages, num_req, max_blocks, n_sel,
    pages_per_split, num_splits, decode_query_len,
    qk_scale,  # softmax_scale * q_scale * k_scale * log2(e): scores in base 2
    v_scale,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # query heads per program, >= 16 for tl.dot (padding rows are masked)
    BLOCK_D: tl.constexpr,  # next_pow2(HEAD_DIM)
    BLOCK_N: tl.constexpr,  # keys per tile, <= PAGE_SIZE unless the page is smaller than 16
    BLOCK_SEL: tl.constexpr,  # next_pow2(pages_per_split), at least 2
    CHUNKS: tl.constexpr,  # key tiles per page, cdiv(PAGE_SIZE, BLOCK_N)
    DOT: tl.constexpr,  # _DOT_FP16 / _DOT_BF16 / _DOT_FP32
    SPLIT: tl.constexpr,  # write float32 partials for the combine kernel instead of the output
):
    # One program: row t, KV head g, a block of that head's query group, one split of the page list.
    # Each selected page is read once and serves every query head of the block (one tl.dot per tile).
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    head_block = pid % num_head_blocks
    g = (pid // num_head_blocks) % num_kv_heads
    t = pid // (num_head_blocks * num_kv_heads)
    req = t // decode_query_len

    kv_len = tl.load(kv_lens_ptr + t * stride_kvl).to(tl.int64)
    qo = tl.load(qo_ptr + t * stride_qo).to(tl.int64)
    limit = tl.minimum(qo + 1, kv_len)  # positions x < limit are visible

    # Query rows of the group, kept in registers for the whole page list.
    i = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = i < group
    h = g * group + i
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + t * stride_q_t + h[:, None] * stride_q_h + d[None, :] * stride_q_d, mask=q_mask, other=0.0)
    q = _to_dot(q.to(tl.float32), DOT)

    # Resolve this split's page list up front (a vector of physical pages and visible key counts), so
    # the loop below has no dependent index loads.
    j_begin = split * pages_per_split
    j_end = tl.minimum(j_begin + pages_per_split, n_sel)
    js = j_begin + tl.arange(0, BLOCK_SEL)
    sel_ok = js < j_end
    page = tl.load(topk_ptr + t * stride_tk_t + g * stride_tk_h + js * stride_tk_j, mask=sel_ok, other=-1)
    page = page.to(tl.int64)
    bt_ok = sel_ok & (page >= 0) & (page < max_blocks) & (req < num_req)
    phys = tl.load(bt_ptr + req * stride_bt_r + page * stride_bt_c, mask=bt_ok, other=-1).to(tl.int64)
    page_ok = bt_ok & (phys >= 0) & (phys < num_pages)
    n_keys = tl.minimum(tl.maximum(limit - page * PAGE_SIZE, 0), PAGE_SIZE)
    n_keys = tl.where(page_ok, n_keys, 0)
    phys = tl.where(page_ok, phys, 0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    kv_head_ptr = kv_ptr + g * stride_kv_h
    offs_n = tl.arange(0, BLOCK_N)
    sel_idx = tl.arange(0, BLOCK_SEL)
    num_iters = tl.maximum(j_end - j_begin, 0) * CHUNKS
    for it in range(0, num_iters):
        jj = it // CHUNKS
        o = (it % CHUNKS) * BLOCK_N + offs_n
        this_page = sel_idx == jj
        p_phys = tl.sum(tl.where(this_page, phys, 0), axis=0)
        p_keys = tl.sum(tl.where(this_page, n_keys, 0), axis=0)
        key_ok = o < p_keys  # a masked-off tile moves no memory
        kv_mask = key_ok[:, None] & d_ok[None, :]
        tile = kv_head_ptr + p_phys * stride_kv_p + o[:, None].to(tl.int64) * stride_kv_o + d[None, :]
        k = _to_dot(tl.load(tile, mask=kv_mask, other=0.0).to(tl.float32), DOT)
        v = _to_dot(tl.load(tile + HEAD_DIM, mask=kv_mask, other=0.0).to(tl.float32), DOT)

        s = _dot(q, tl.trans(k), DOT) * qk_scale  # [BLOCK_H, BLOCK_N], base-2 logits
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep every weight at 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(_to_dot(p, DOT), v, DOT)
        m_i = m_new

    if SPLIT:
        ws_row = (t * num_kv_heads * group + h) * num_splits + split
        tl.store(ws_ptr + ws_row, m_i, mask=row_ok)
        tl.store(ws_ptr + ws_rows + ws_row, l_i, mask=row_ok)
        tl.store(ws_ptr + 2 * ws_rows + ws_row[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)
    else:
        scale = v_scale / tl.where(l_i > 0, l_i, 1.0)  # no key: acc is 0, the output is 0
        o_ptrs = out_ptr + t * stride_o_t + h[:, None] * stride_o_h + d[None, :] * stride_o_d
        tl.store(o_ptrs, (acc * scale[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _sparse_gqa_combine_kernel(
    ws_ptr, ws_rows,  # float32 workspace of m [R], l [R], acc [R, Dh], R = ws_rows = T * Hq * S
    out_ptr, stride_o_t, stride_o_h, stride_o_d,  # [T, Hq, Dh]
    num_q_heads, num_splits, v_scale,
    HEAD_DIM: tl.constexpr, BLOCK_HC: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Merge the per-split (max, sum, unnormalised accumulator) triples of a block of query heads.
    ws_m_ptr = ws_ptr
    ws_l_ptr = ws_ptr + ws_rows
    ws_acc_ptr = ws_ptr + 2 * ws_rows
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_HC + tl.arange(0, BLOCK_HC)
    h_ok = h < num_q_heads
    s = tl.arange(0, BLOCK_S)
    row = t * num_q_heads + h
    ms_mask = h_ok[:, None] & (s[None, :] < num_splits)
    m = tl.load(ws_m_ptr + row[:, None] * num_splits + s[None, :], mask=ms_mask, other=float("-inf"))
    l = tl.load(ws_l_ptr + row[:, None] * num_splits + s[None, :], mask=ms_mask, other=0.0)
    m_max = tl.max(m, axis=1)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: all weights 0
    l_sum = tl.sum(tl.exp2(m - m_safe[:, None]) * l, axis=1)

    d = tl.arange(0, BLOCK_D)
    mask = h_ok[:, None] & (d[None, :] < HEAD_DIM)
    acc = tl.zeros([BLOCK_HC, BLOCK_D], dtype=tl.float32)
    for sp in range(0, num_splits):
        w = tl.exp2(tl.load(ws_m_ptr + row * num_splits + sp, mask=h_ok, other=float("-inf")) - m_safe)
        part = tl.load(ws_acc_ptr + (row * num_splits + sp)[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
        acc += w[:, None] * part
    scale = v_scale / tl.where(l_sum > 0, l_sum, 1.0)
    o_ptrs = out_ptr + t * stride_o_t + h[:, None] * stride_o_h + d[None, :] * stride_o_d
    tl.store(o_ptrs, (acc * scale[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


# Most pages one program resolves up front (bounds the register vector of the page list).
_MAX_PAGES_PER_PROGRAM = 64
# Query heads per program of the combine kernel.
_COMBINE_HEADS = 16

_PLANS = PlanCache()


def _dot_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> int:
    dtypes = {q_dtype, kv_dtype}
    if torch.bfloat16 in dtypes and torch.float16 in dtypes:
        return _DOT_FP32
    if torch.bfloat16 in dtypes:
        return _DOT_BF16
    return _DOT_FP16  # float16 and float8 (e4m3 values are exact in float16, and P keeps 10 mantissa bits)


def launch_config(q: torch.Tensor, kv_cache: torch.Tensor, n_sel: int, num_splits: int | None = None,
                  num_sms: int | None = None) -> LaunchPlan:
    """Block sizes, warps and the split of the page list, from shapes and dtypes only (no autotuning:
    CUDA-graph capture and the interpreter need one fixed configuration per shape).

    ``num_splits`` overrides the split heuristic; ``num_sms`` the multiprocessor count it aims at
    (default: the device's, or ``OFF_CUDA_SMS`` off CUDA so interpreter grids stay small).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = kv_cache.shape[1], kv_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_d = max(next_pow2(head_dim), 16)
    # Pad the query group to >= 16 rows (the smallest tl.dot M); very large groups use several blocks.
    block_h = min(max(next_pow2(group), 16), 64 if block_d <= 128 else 32)
    head_blocks = cdiv(group, block_h)
    block_n = max(min(prev_pow2(page_size), 64 if block_d <= 128 else 32), 16)
    dot = _dot_dtype(q.dtype, kv_cache.dtype)

    if num_splits is None:
        programs = num_tokens * num_kv_heads * head_blocks
        sms = num_sms or multiprocessor_count(q.device)
        num_splits = cdiv(n_sel, _MAX_PAGES_PER_PROGRAM)
        if 0 < programs < sms:  # too few programs to fill the GPU: aim at about two per SM
            num_splits = max(num_splits, min(cdiv(2 * sms, programs), n_sel))
    num_splits = max(num_splits, 1)
    pages_per_split = max(cdiv(n_sel, num_splits), 1)
    num_splits = max(cdiv(n_sel, pages_per_split), 1)  # no empty split
    # Chosen from ptxas register counts for sm_90 (no spills, <= ~145 registers per thread, so two or
    # more programs share an SM while cp.async keeps one or two tiles in flight per program).
    if dot == _DOT_FP32:  # float32 operands (a float16/bfloat16 mix, rare): small tiles, no prefetch
        block_n, num_warps, num_stages = 16, 8, 1
    elif block_d <= 128:
        # Measured on an H200 (scripts/sweep_gqa.py, docs/benchmarks.md): with groups of <= 32 heads
        # 4 warps run 18-27% faster than 8 at T >= 64 (fp8 cache, Dh 128, pages of 128).
        num_warps, num_stages = (4, 3) if block_h <= 32 else (8, 2)
    else:
        num_warps, num_stages = 4, 2
    return LaunchPlan(block_h, head_blocks, block_n, num_splits, num_warps, num_stages)


def pages_per_split(n_sel: int, plan: LaunchPlan) -> int:
    """Selected pages each split program walks (the last split may have fewer)."""
    return max(cdiv(n_sel, plan.num_splits), 1)


def _make_launches(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len,
                   qk_scale, v_scale, out, plan: LaunchPlan):
    """The kernel launches of one plan; the workspace is a call argument (``out`` holds its place here)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, page_size, _ = kv_cache.shape
    n_sel = topk_pages.shape[2]
    group = num_q_heads // num_kv_heads
    per_split = pages_per_split(n_sel, plan)
    split = plan.num_splits > 1
    rows = num_tokens * num_q_heads * plan.num_splits
    block_d = max(next_pow2(head_dim), 16)
    args = (
        q, q.stride(0), q.stride(1), q.stride(2),
        kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        topk_pages, topk_pages.stride(0), topk_pages.stride(1), topk_pages.stride(2),
        block_table, block_table.stride(0), block_table.stride(1),
        kv_segment_lens, kv_segment_lens.stride(0),
        qo_offset, qo_offset.stride(0),
        out, out.stride(0), out.stride(1), out.stride(2),
        out, rows,  # the workspace when split
        num_kv_heads, group, plan.head_blocks,
        num_pages, block_table.shape[0], block_table.shape[1], n_sel,
        per_split, plan.num_splits, decode_query_len,
        qk_scale, v_scale,
    )
    meta = dict(HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_H=plan.block_h, BLOCK_D=block_d, BLOCK_N=plan.block_n,
                BLOCK_SEL=max(next_pow2(per_split), 2), CHUNKS=cdiv(page_size, plan.block_n),
                DOT=_dot_dtype(q.dtype, kv_cache.dtype), SPLIT=split)
    grid = (num_tokens * num_kv_heads * plan.head_blocks, plan.num_splits)
    main = KernelLaunch(_sparse_gqa_decode_kernel, grid, args, meta, num_warps=plan.num_warps,
                        num_stages=plan.num_stages, device=q.device)
    if not split:
        return main, None
    combine = KernelLaunch(
        _sparse_gqa_combine_kernel, (num_tokens, cdiv(num_q_heads, _COMBINE_HEADS)),
        (out, rows, out, out.stride(0), out.stride(1), out.stride(2), num_q_heads, plan.num_splits, v_scale),
        dict(HEAD_DIM=head_dim, BLOCK_HC=_COMBINE_HEADS, BLOCK_S=next_pow2(plan.num_splits), BLOCK_D=block_d),
        num_warps=4, device=q.device)
    return main, combine


def sparse_gqa_decode_triton(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len,
                             softmax_scale, q_scale=1.0, k_scale=1.0, v_scale=1.0, *, out, num_splits=None,
                             config=None):
    """Launch the decode kernel (and the combine kernel when the page lists are split). Arguments as
    :func:`sparse_gqa_decode_torch`; ``num_splits`` and ``config`` (``LaunchPlan`` fields) override
    the heuristic (tests use them to cover every path with small grids).
    """
    if out.numel() == 0:
        return
    qk_scale = float(softmax_scale) * float(q_scale) * float(k_scale) * LOG2E
    v_scale = float(v_scale)
    key = (q.shape, q.stride(), q.dtype, kv_cache.shape, kv_cache.stride(), kv_cache.dtype, topk_pages.shape,
           topk_pages.stride(), block_table.shape, block_table.stride(), kv_segment_lens.stride(0),
           qo_offset.stride(0), out.stride(), decode_query_len, qk_scale, v_scale, q.device, num_splits,
           None if config is None else tuple(sorted(config.items())))
    entry = _PLANS.get(key)
    if entry is None:
        plan = launch_config(q, kv_cache, topk_pages.shape[2], num_splits).with_overrides(config)
        ws_numel = q.shape[0] * q.shape[1] * plan.num_splits * (2 + q.shape[2]) if plan.num_splits > 1 else 0
        entry = _PLANS.put(key, (ws_numel, *_make_launches(q, kv_cache, topk_pages, block_table, kv_segment_lens,
                                                            qo_offset, decode_query_len, qk_scale, v_scale, out,
                                                            plan)))
    ws_numel, main, combine = entry
    if combine is None:
        main(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, out, out)
        return
    # float32 m [R], l [R], acc [R, Dh] of the R = T * Hq * S partial rows; its size depends on shapes
    # only, so CUDA-graph capture sees a fixed allocation.
    ws = torch.empty(ws_numel, dtype=torch.float32, device=q.device)
    main(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, out, ws)
    combine(ws, out)


__all__ = ["launch_config", "pages_per_split", "sparse_gqa_decode_dense", "sparse_gqa_decode_torch",
           "sparse_gqa_decode_triton"]
