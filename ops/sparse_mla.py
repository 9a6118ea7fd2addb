"""Kernels of ``sparse_mla_decode`` (SPEC section 6): vectorised PyTorch and Triton.

Both entry points take the ``out`` overload's arguments (``out`` and ``lse`` keyword-only) and write
every element of both. Shared semantics:

- the candidates of token ``t`` are entries ``j < clamp(topk_length[t], 0, K)`` of ``indices[t]`` whose
  slot is in ``[0, pages * page_size)``, then the same for the extra list and extra cache; duplicates
  count as separate candidates; every other entry is empty and never read;
- ``lse`` is the natural-log sum over the candidates only; the sink scales ``out`` by
  ``1 / (1 + exp(sink - lse))``; a token without candidates gets ``out = 0`` and ``lse = +inf``.

Triton design (``docs/sparse_mla.md`` has the reasoning and the measured register budget):

- grid: one program per ``(token, split, block of BLOCK_H heads)`` on axis 0, heads fastest, so the
  head blocks of one token run side by side and share the cache rows through L2;
- per program: Q is loaded once as four V pieces ``[BLOCK_H, PV]`` (dims ``< head_dim_v``) and one
  tail piece ``[BLOCK_H, PT]`` (dims ``head_dim_v..D``); one loop walks the main then the extra list in
  blocks of BLOCK_N slots, dequantises each piece of the K rows in registers, accumulates
  ``S = Q K^T`` over the pieces on the tensor cores, runs the online softmax in fp32 base 2, and
  reuses the four V pieces of K for ``acc += P V`` (each cache row is read once per head block);
- split-K: when ``T * head_blocks`` does not fill the GPU, the candidate blocks of each token are
  divided among ``num_splits`` programs that write ``(m, l, acc)`` to a float32 workspace (sized
  from shapes); a combine kernel merges them, applies the sink and writes ``out`` and ``lse``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..meta_kernels._formats import FORMAT_IDS
from ._formats import (
    dequantize_torch,
    load_fp8_656_raw,
    load_fp8_656_scales,
    load_kv_cols,
)
from ._launch import (
    DEFAULT_SHARED_BYTES,
    LOG2E,
    KernelLaunch,
    LaunchPlan,
    PlanCache,
    TENSOR_MEMORY_COLUMNS,
    cdiv,
    multiprocessor_count,
    next_pow2,
    nvidia_capability,
    scratch,
    shared_memory_per_block,
    wait_for_prior_grid,
)
from ._triton import tl, triton
from . import sparse_mla_hopper as hopper

FLT_MAX = 3.4028234663852886e38  # the largest finite float32
LN2 = 0.6931471805599453
_FLT_MAX = tl.constexpr(FLT_MAX)
_LN2 = tl.constexpr(LN2)
_TORCH_CHUNK_ELEMENTS = 1 << 24  # float32 elements of dequantised K (and scores) per CPU chunk of tokens
_MIN_BLOCKS_PER_SPLIT = 4  # candidate blocks per split program, so the combine stays cheap
# ptxas's register bound for the decode kernel by compute capability (Triton's ``maxnreg``; elsewhere
# ptxas chooses). ptxas does not see the dynamic shared memory that already holds an SM to one program
# at the planner's tiles, and left to itself it may aim its allocation at two or more programs per SM:
# 128 registers and 2,756 bytes of spill stores per thread for an A100's DeepSeek-V4 tiles (1,244 at
# 255), 32 registers and 5,374 bytes for a D = 2048 build there. With the bound no sm_80 build spills
# more, and on an H100 the portable kernel ran 0-10% faster; on sm_86 and sm_89 it made the model
# shapes' builds spill more, so they keep ptxas's choice (docs/sparse_mla.md, "Registers").
_DECODE_MAXNREG = {(8, 0): 255, (9, 0): 255}


# =====================================================================================================
# PyTorch kernel
# =====================================================================================================


def softmax_factors(softmax_scale: float) -> tuple[float, float, float]:
    """``(a, sign, s)`` of the overflow-safe softmax (``docs/sparse_mla.md``): the weight of a candidate
    is ``exp2(a * (u - max u))`` with ``u = sign * <q, k>``, which equals ``exp(score - max score)``,
    and ``lse = s * max u + ln(sum of weights)``.

    ``s = min(|softmax_scale|, FLT_MAX)``, ``a = min(s * log2(e), FLT_MAX)`` (float64, then float32)
    and ``sign`` the sign of the scale; when ``s * log2(e) < 2**-126`` (a zero scale included):
    ``sign = 0, a = 1``, equal weights. ``a > 0`` always, so ``a * (-inf)`` is never NaN."""
    s = min(abs(float(softmax_scale)), FLT_MAX)
    a = s * LOG2E
    if not a >= 2.0**-126:
        return 1.0, 0.0, s
    return min(a, FLT_MAX), (1.0 if softmax_scale > 0 else -1.0), s


def _list_candidates_torch(q32, kv_cache, indices, lengths, kv_format):
    """float32 dot products ``[t, H, K]`` with ``q``, a candidate mask ``[t, K]`` and the K rows
    ``[t, K, D]`` of one list (rows of non-candidates are 0 and never read)."""
    k = indices.shape[1]
    col = torch.arange(k, device=indices.device)
    used = torch.ones_like(indices, dtype=torch.bool) if lengths is None else col[None, :] < lengths[:, None]
    pages, page_size, _ = kv_cache.shape
    slots = torch.where(used, indices.to(torch.int64), -1)
    valid = (slots >= 0) & (slots < pages * page_size)
    keys = dequantize_torch(kv_cache, slots, kv_format)
    return torch.bmm(q32, keys.transpose(1, 2)), valid, keys


def sparse_mla_decode_dense(q, kv_cache, indices, softmax_scale, kv_format="auto", head_dim_v=512, topk_length=None,
                            attn_sink=None, extra_kv_cache=None, extra_indices=None, extra_topk_length=None):
    """The whole operator as one PyTorch expression (gather, dequantise, softmax) in float32:
    returns float32 ``(out [T, H, head_dim_v], lse [T, H])``. The CPU kernel runs it on chunks of
    tokens. The softmax follows the overflow-safe rule of ``docs/sparse_mla.md``, as the Triton kernel
    does."""
    a, sign, s = softmax_factors(softmax_scale)
    q32 = q.to(torch.float32)
    parts = [_list_candidates_torch(q32, kv_cache, indices, topk_length, kv_format)]
    if extra_kv_cache is not None:
        parts.append(_list_candidates_torch(q32, extra_kv_cache, extra_indices, extra_topk_length, kv_format))
    dots = torch.cat([d for d, _, _ in parts], dim=2)
    valid = torch.cat([v for _, v, _ in parts], dim=1)
    # NaN -> -FLT_MAX, +-inf -> +-FLT_MAX (float32 has nothing else beyond), invalid keys -inf: one pass
    # each (a broadcast masked_fill is about 1.8x slower than where on CPU tensors)
    u = torch.nan_to_num(dots * sign, nan=-FLT_MAX, posinf=FLT_MAX, neginf=-FLT_MAX)
    u = torch.where(valid[:, None, :], u, float("-inf"))
    m = u.amax(dim=2, keepdim=True)
    m = torch.where(torch.isneginf(m), 0.0, m)  # a token without candidates: all -inf
    p = torch.exp2((u - m) * a)
    total = p.sum(dim=2)
    has = total > 0
    # P V one list at a time (no concatenated copy of the values)
    out, k0 = None, 0
    for _, _, kv in parts:
        o = torch.bmm(p[:, :, k0:k0 + kv.shape[1]], kv[:, :, :head_dim_v])
        out, k0 = (o if out is None else out.add_(o)), k0 + kv.shape[1]
    out = out / torch.where(has, total, 1.0)[:, :, None]
    lse = m[:, :, 0] * s + torch.log2(torch.where(has, total, 1.0)) * LN2
    lse = torch.where(has, lse.clamp(-FLT_MAX, FLT_MAX), float("inf"))
    if attn_sink is not None:
        out = out * torch.where(has, torch.sigmoid(lse - attn_sink[None, :]), 0.0)[:, :, None]
    return out, lse


def sparse_mla_decode_torch(q, kv_cache, indices, softmax_scale, kv_format="auto", head_dim_v=512, topk_length=None,
                            attn_sink=None, extra_kv_cache=None, extra_indices=None, extra_topk_length=None, *,
                            out, lse):
    """CPU kernel: the ``out`` overload's arguments."""
    num_tokens, num_heads, dim = q.shape
    if num_tokens == 0:
        return
    k_total = indices.shape[1] + (extra_indices.shape[1] if extra_indices is not None else 0)
    chunk = max(1, _TORCH_CHUNK_ELEMENTS // max(k_total * (dim + num_heads), 1))
    for t0 in range(0, num_tokens, chunk):
        rows = slice(t0, min(t0 + chunk, num_tokens))

        def part(t):
            return None if t is None else t[rows]

        o, l = sparse_mla_decode_dense(
            q[rows], kv_cache, indices[rows], softmax_scale, kv_format, head_dim_v, part(topk_length), attn_sink,
            extra_kv_cache, part(extra_indices), part(extra_topk_length))
        out[rows].copy_(o)
        lse[rows].copy_(l)


# =====================================================================================================
# Triton kernels
# =====================================================================================================


@triton.jit
def _to_mma(x, dtype: tl.constexpr, KV_FORMAT: tl.constexpr):
    """Dequantised float32 cache values in the MMA dtype. For float16 those of an fp8 format are
    clamped to its finite range first (e4m3 * 2**e and bf16 values can exceed 65504): an infinite K
    would saturate the scores and an infinite V times a zero probability gives NaN
    (docs/sparse_mla.md, "Accuracy"). An ``auto`` cache holds values of the query's dtype already."""
    if dtype == tl.float16 and KV_FORMAT != 0:
        x = tl.minimum(tl.maximum(x, -65504.0), 65504.0)
    return x.to(dtype)


@triton.jit
def _qk_piece(
    q,  # [BLOCK_H, PV] query piece (MMA dtype)
    scale,  # FOLD: [BLOCK_N] float32 scale of this piece's scale group (unused otherwise)
    cache_ptr, stride_page, stride_row, page_size, slots, valid,
    COL0: tl.constexpr, PV: tl.constexpr, DV: tl.constexpr, KV_FORMAT: tl.constexpr, FOLD: tl.constexpr,
    V_RAW: tl.constexpr,
):
    """``(q K^T [BLOCK_H, BLOCK_N] float32, V piece [BLOCK_N, PV] in the MMA dtype)`` for dims
    ``[COL0, COL0 + PV)`` (dims ``>= DV`` are 0).

    Generic path: the piece is dequantised in registers and rounded once to the MMA dtype.
    ``FOLD`` (fp8_656, pieces = scale groups): the product runs on the raw e4m3 values, which are
    exact in bf16 and fp16, and the per-row scale multiplies the float32 result, so the scores carry
    no rounding of a dequantised K. ``V_RAW`` (with FOLD, bf16): the V piece is the raw values too and
    ``_pv`` applies the scale to P; fp16 instead dequantises V (P * scale would underflow fp16)."""
    if FOLD:
        raw = load_fp8_656_raw(cache_ptr, stride_page, page_size, slots, valid, COL0 // 128)
        k = raw.to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * scale[None, :]
        if not V_RAW:
            k = _to_mma(raw * scale[:, None], q.dtype, KV_FORMAT)
    else:
        k = _to_mma(load_kv_cols(cache_ptr, stride_page, stride_row, page_size, slots, valid, COL0, PV, DV,
                                 KV_FORMAT), q.dtype, KV_FORMAT)
        s = tl.dot(q, tl.trans(k))
    return s, k


@triton.jit
def _pv(acc, alpha, p, v, scale, V_RAW: tl.constexpr):
    """``acc * alpha + P @ V`` for one V piece; with ``V_RAW`` the piece holds raw e4m3 values and P
    takes their per-row scale (probabilities rounded once to bf16, as the contract allows)."""
    if V_RAW:
        pv = (p * scale[None, :]).to(v.dtype)
    else:
        pv = p.to(v.dtype)
    return tl.dot(pv, v, acc * alpha[:, None])


@triton.jit
def _attend(
    q0, q1, q2, q3, qt,  # query pieces (MMA dtype): dims [i*PV, (i+1)*PV) and [DV, DV + PT)
    cache_ptr, stride_page, stride_row, page_size, num_slots,  # main cache
    idx_row_ptr, stride_ik, n_main,  # this token's main list and its used length
    xcache_ptr, x_stride_page, x_stride_row, x_page_size, x_num_slots,  # extra cache (HAS_EXTRA)
    xidx_row_ptr, x_stride_ik, n_extra,  # this token's extra list and its used length
    blk_lo, blk_hi,  # the blocks of BLOCK_N entries this program walks, numbered across both lists
    nb_main,  # blocks of the main list: block b >= nb_main is block b - nb_main of the extra list
    qk_scale, score_sign,  # softmax_factors(softmax_scale)[:2]: a > 0 and the sign of the scale (or 0)
    BLOCK_H: tl.constexpr, DV: tl.constexpr, PV: tl.constexpr, D: tl.constexpr, PT: tl.constexpr,
    HAS_TAIL: tl.constexpr, BLOCK_N: tl.constexpr, KV_FORMAT: tl.constexpr, FOLD: tl.constexpr,
    V_RAW: tl.constexpr, HAS_EXTRA: tl.constexpr,
):
    """Online softmax over blocks ``[blk_lo, blk_hi)``: ``(acc0..3 [BLOCK_H, PV], m, l [BLOCK_H])``,
    ``acc`` not normalised. ``m`` is the running maximum of the oriented dot products ``u`` and the
    weights are ``exp2(qk_scale * (u - m))`` (the overflow-safe rule, ``docs/sparse_mla.md``). One loop
    serves both lists (the block picks its cache and list by scalar selects): a second loop would
    duplicate the body and double the register pressure."""
    acc0 = tl.zeros([BLOCK_H, PV], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, PV], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, PV], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, PV], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for blk in range(blk_lo, blk_hi):
        if HAS_EXTRA:
            main = blk < nb_main
            c_ptr = tl.where(main, cache_ptr, xcache_ptr)
            c_sp = tl.where(main, stride_page, x_stride_page)
            c_sr = tl.where(main, stride_row, x_stride_row)
            c_ps = tl.where(main, page_size, x_page_size)
            c_ns = tl.where(main, num_slots, x_num_slots)
            i_ptr = tl.where(main, idx_row_ptr, xidx_row_ptr)
            i_st = tl.where(main, stride_ik, x_stride_ik)
            n_used = tl.where(main, n_main, n_extra)
            first = tl.cast(tl.where(main, blk, blk - nb_main), tl.int64) * BLOCK_N
        else:
            c_ptr = cache_ptr
            c_sp = stride_page
            c_sr = stride_row
            c_ps = page_size
            c_ns = num_slots
            i_ptr = idx_row_ptr
            i_st = stride_ik
            n_used = n_main
            first = tl.cast(blk, tl.int64) * BLOCK_N
        offs = first + tl.arange(0, BLOCK_N)
        in_list = offs < n_used
        slots = tl.load(i_ptr + offs * i_st, mask=in_list, other=-1).to(tl.int64)
        valid = in_list & (slots >= 0) & (slots < c_ns)
        if FOLD:
            c0, c1, c2, c3 = load_fp8_656_scales(c_ptr, c_sp, c_ps, slots, valid)
        else:
            c0 = tl.full([BLOCK_N], 1.0, dtype=tl.float32)
            c1 = c0
            c2 = c0
            c3 = c0
        s, k0 = _qk_piece(q0, c0, c_ptr, c_sp, c_sr, c_ps, slots, valid, 0, PV, DV, KV_FORMAT, FOLD,
                          V_RAW)
        s1, k1 = _qk_piece(q1, c1, c_ptr, c_sp, c_sr, c_ps, slots, valid, PV, PV, DV, KV_FORMAT, FOLD,
                           V_RAW)
        s2, k2 = _qk_piece(q2, c2, c_ptr, c_sp, c_sr, c_ps, slots, valid, 2 * PV, PV, DV, KV_FORMAT, FOLD,
                           V_RAW)
        s3, k3 = _qk_piece(q3, c3, c_ptr, c_sp, c_sr, c_ps, slots, valid, 3 * PV, PV, DV, KV_FORMAT, FOLD,
                           V_RAW)
        s = s + s1 + s2 + s3  # K pieces: dequantised in registers; rows not valid are 0, never read
        if HAS_TAIL:
            kt = _to_mma(load_kv_cols(c_ptr, c_sp, c_sr, c_ps, slots, valid, DV, PT, D, KV_FORMAT), q0.dtype,
                         KV_FORMAT)
            s = tl.dot(qt, tl.trans(kt), s)
        u = _oriented_scores(s, valid, score_sign)
        m_new = tl.maximum(m_i, tl.max(u, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no candidate yet: keep exp2 finite
        # u - m <= 0 (or -inf), qk_scale > 0: the exponents never overflow and never give NaN.
        alpha = tl.exp2((m_i - m_use) * qk_scale)
        p = tl.exp2((u - m_use[:, None]) * qk_scale)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc0 = _pv(acc0, alpha, p, k0, c0, V_RAW)
        acc1 = _pv(acc1, alpha, p, k1, c1, V_RAW)
        acc2 = _pv(acc2, alpha, p, k2, c2, V_RAW)
        acc3 = _pv(acc3, alpha, p, k3, c3, V_RAW)
        m_i = m_new
    return acc0, acc1, acc2, acc3, m_i, l_i


@triton.jit
def _oriented_scores(s, valid, score_sign):
    """``u = score_sign * s`` saturated to finite float32 (NaN, from products that overflow both
    ways, counts as ``-FLT_MAX``); ``-inf`` for entries that are not candidates."""
    u = s * score_sign
    u = tl.where(u == u, tl.minimum(tl.maximum(u, -_FLT_MAX), _FLT_MAX), -_FLT_MAX)
    return tl.where(valid[None, :], u, float("-inf"))


@triton.jit
def _finish_rows(m_i, l_i, lse_scale, heads, head_ok, sink_ptr, stride_sink, HAS_SINK: tl.constexpr):
    """Natural-log ``lse`` [BLOCK_H] and the factor that turns ``acc`` into ``out`` (1/l times the
    sink's ``1 / (1 + exp(sink - lse))``); rows without a candidate get ``+inf`` and 0. ``lse`` of a
    row with candidates saturates at +-FLT_MAX, so ``+inf`` keeps meaning "no candidate"."""
    has = l_i > 0  # l >= 1 once a candidate was seen (its own weight is exp2(0))
    # m is -inf in a row without a candidate: selected away first, so that a zero scale gives no NaN
    lse = tl.where(has, m_i, 0.0) * lse_scale + tl.log2(tl.where(has, l_i, 1.0)) * _LN2  # may overflow: saturated next
    lse = tl.where(has, tl.minimum(tl.maximum(lse, -_FLT_MAX), _FLT_MAX), float("inf"))
    factor = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    if HAS_SINK:
        sink = tl.load(sink_ptr + heads * stride_sink, mask=head_ok, other=float("-inf"))
        factor = tl.where(has, factor / (1.0 + tl.exp(sink - tl.where(has, lse, 0.0))), 0.0)
    return lse, factor


@triton.jit
def _store_piece(out_row_ptrs, stride_od, acc, factor, head_ok, COL0: tl.constexpr, PV: tl.constexpr,
                 DV: tl.constexpr):
    cols = COL0 + tl.arange(0, PV)
    mask = head_ok[:, None] & (cols < DV)[None, :]
    val = acc * factor[:, None]
    tl.store(out_row_ptrs[:, None] + cols[None, :] * stride_od, val.to(out_row_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _store_partial(ws_row_ptrs, acc, head_ok, COL0: tl.constexpr, PV: tl.constexpr):
    cols = COL0 + tl.arange(0, PV)
    tl.store(ws_row_ptrs[:, None] + cols[None, :], acc, mask=head_ok[:, None])


@triton.jit(do_not_specialize=["topk", "x_topk"])
def _sparse_mla_decode_kernel(
    q_ptr, stride_qt, stride_qh, stride_qd,  # [T, H, D] bf16/fp16
    cache_ptr, stride_cp, stride_cr, page_size, num_slots,  # main cache
    idx_ptr, stride_it, stride_ik, topk,  # int32 [T, K]
    len_ptr, stride_len,  # int32 [T] (HAS_LEN)
    xcache_ptr, stride_xp, stride_xr, x_page_size, x_num_slots,  # extra cache (HAS_EXTRA)
    xidx_ptr, stride_xt, stride_xk, x_topk,  # int32 [T, K2] (HAS_EXTRA)
    xlen_ptr, stride_xlen,  # int32 [T] (HAS_XLEN)
    sink_ptr, stride_sink,  # float32 [H] (HAS_SINK)
    out_ptr, stride_ot, stride_oh, stride_od,  # [T, H, DV], q dtype (not SPLIT)
    lse_ptr, stride_lt, stride_lh,  # float32 [T, H] (not SPLIT)
    ws_ptr, ws_ml_off,  # SPLIT: float32 workspace: acc [T, S, H, 4 * PV], then (m, l) [T, S, H, 2] at ws_ml_off
    num_heads, num_head_blocks, num_splits, qk_scale, score_sign, lse_scale,  # softmax_factors(softmax_scale)
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    DV: tl.constexpr, PV: tl.constexpr, D: tl.constexpr, PT: tl.constexpr, HAS_TAIL: tl.constexpr,
    KV_FORMAT: tl.constexpr, FOLD: tl.constexpr, V_RAW: tl.constexpr, HAS_LEN: tl.constexpr,
    HAS_EXTRA: tl.constexpr, HAS_XLEN: tl.constexpr, HAS_SINK: tl.constexpr, SPLIT: tl.constexpr,
):
    # The offset rule (ops/_launch.py): every stride and page size that enters an address in int64.
    stride_qt = tl.cast(stride_qt, tl.int64)
    stride_qh = tl.cast(stride_qh, tl.int64)
    stride_qd = tl.cast(stride_qd, tl.int64)
    stride_cp = tl.cast(stride_cp, tl.int64)
    stride_cr = tl.cast(stride_cr, tl.int64)
    page_size = tl.cast(page_size, tl.int64)
    stride_it = tl.cast(stride_it, tl.int64)
    stride_ik = tl.cast(stride_ik, tl.int64)
    stride_len = tl.cast(stride_len, tl.int64)
    stride_xp = tl.cast(stride_xp, tl.int64)
    stride_xr = tl.cast(stride_xr, tl.int64)
    x_page_size = tl.cast(x_page_size, tl.int64)
    stride_xt = tl.cast(stride_xt, tl.int64)
    stride_xk = tl.cast(stride_xk, tl.int64)
    stride_xlen = tl.cast(stride_xlen, tl.int64)
    stride_sink = tl.cast(stride_sink, tl.int64)
    stride_ot = tl.cast(stride_ot, tl.int64)
    stride_oh = tl.cast(stride_oh, tl.int64)
    stride_od = tl.cast(stride_od, tl.int64)
    stride_lt = tl.cast(stride_lt, tl.int64)
    stride_lh = tl.cast(stride_lh, tl.int64)
    pid = tl.program_id(0)
    hb = pid % num_head_blocks
    rest = pid // num_head_blocks
    split = rest % num_splits
    t = (rest // num_splits).to(tl.int64)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    q_rows = q_ptr + t * stride_qt + heads.to(tl.int64)[:, None] * stride_qh
    cv = tl.arange(0, PV)
    q0 = tl.load(q_rows + cv[None, :] * stride_qd, mask=head_ok[:, None] & (cv < DV)[None, :], other=0.0)
    q1 = tl.load(q_rows + (PV + cv)[None, :] * stride_qd, mask=head_ok[:, None] & (PV + cv < DV)[None, :],
                 other=0.0)
    q2 = tl.load(q_rows + (2 * PV + cv)[None, :] * stride_qd,
                 mask=head_ok[:, None] & (2 * PV + cv < DV)[None, :], other=0.0)
    q3 = tl.load(q_rows + (3 * PV + cv)[None, :] * stride_qd,
                 mask=head_ok[:, None] & (3 * PV + cv < DV)[None, :], other=0.0)
    if HAS_TAIL:
        ct = DV + tl.arange(0, PT)
        qt = tl.load(q_rows + ct[None, :] * stride_qd, mask=head_ok[:, None] & (ct < D)[None, :], other=0.0)
    else:
        qt = q0  # unused

    n_main = topk
    if HAS_LEN:
        n_main = tl.minimum(tl.maximum(tl.load(len_ptr + t * stride_len), 0), topk)
    nb_main = (n_main + BLOCK_N - 1) // BLOCK_N
    nb_total = nb_main
    n_extra = 0
    if HAS_EXTRA:
        n_extra = x_topk
        if HAS_XLEN:
            n_extra = tl.minimum(tl.maximum(tl.load(xlen_ptr + t * stride_xlen), 0), x_topk)
        nb_total += (n_extra + BLOCK_N - 1) // BLOCK_N
    if SPLIT:
        per_split = (nb_total + num_splits - 1) // num_splits
        blk_lo = split * per_split
        blk_hi = tl.minimum(blk_lo + per_split, nb_total)
    else:
        blk_lo = 0
        blk_hi = nb_total

    acc0, acc1, acc2, acc3, m_i, l_i = _attend(
        q0, q1, q2, q3, qt,
        cache_ptr, stride_cp, stride_cr, page_size, num_slots, idx_ptr + t * stride_it, stride_ik, n_main,
        xcache_ptr, stride_xp, stride_xr, x_page_size, x_num_slots, xidx_ptr + t * stride_xt, stride_xk, n_extra,
        blk_lo, blk_hi, nb_main, qk_scale, score_sign,
        BLOCK_H, DV, PV, D, PT, HAS_TAIL, BLOCK_N, KV_FORMAT, FOLD, V_RAW, HAS_EXTRA)

    if SPLIT:
        row = (t * num_splits + split) * num_heads + heads.to(tl.int64)  # [T, S, H] row of the workspace
        ws_rows = ws_ptr + row * (4 * PV)
        _store_partial(ws_rows, acc0, head_ok, 0, PV)
        _store_partial(ws_rows, acc1, head_ok, PV, PV)
        _store_partial(ws_rows, acc2, head_ok, 2 * PV, PV)
        _store_partial(ws_rows, acc3, head_ok, 3 * PV, PV)
        tl.store(ws_ptr + ws_ml_off + row * 2, m_i, mask=head_ok)
        tl.store(ws_ptr + ws_ml_off + row * 2 + 1, l_i, mask=head_ok)
    else:
        lse, factor = _finish_rows(m_i, l_i, lse_scale, heads, head_ok, sink_ptr, stride_sink, HAS_SINK)
        tl.store(lse_ptr + t * stride_lt + heads * stride_lh, lse, mask=head_ok)
        out_rows = out_ptr + t * stride_ot + heads.to(tl.int64) * stride_oh
        _store_piece(out_rows, stride_od, acc0, factor, head_ok, 0, PV, DV)
        _store_piece(out_rows, stride_od, acc1, factor, head_ok, PV, PV, DV)
        _store_piece(out_rows, stride_od, acc2, factor, head_ok, 2 * PV, PV, DV)
        _store_piece(out_rows, stride_od, acc3, factor, head_ok, 3 * PV, PV, DV)


@triton.jit
def _combine_strides(stride_sink, stride_ot, stride_oh, stride_od, stride_lt, stride_lh):
    """The combine kernels' strides, widened to int64 (the offset rule of ops/_launch.py)."""
    return (tl.cast(stride_sink, tl.int64), tl.cast(stride_ot, tl.int64), tl.cast(stride_oh, tl.int64),
            tl.cast(stride_od, tl.int64), tl.cast(stride_lt, tl.int64), tl.cast(stride_lh, tl.int64))


@triton.jit
def _combine_rows(num_head_blocks, num_heads, BLOCK_H: tl.constexpr):
    """Token, head indices and their mask of a combine program (axis 0: token-major head blocks)."""
    pid = tl.program_id(0)
    t = (pid // num_head_blocks).to(tl.int64)
    heads = (pid % num_head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    return t, heads, heads < num_heads


@triton.jit
def _sparse_mla_combine_kernel(
    ws_ptr, ws_ml_off,  # float32 workspace: acc [T, S, H, DV_PAD], then (m, l) [T, S, H, 2] at ws_ml_off
    sink_ptr, stride_sink,  # float32 [H] (HAS_SINK)
    out_ptr, stride_ot, stride_oh, stride_od,  # [T, H, DV], q dtype
    lse_ptr, stride_lt, stride_lh,  # float32 [T, H]
    num_heads, num_head_blocks, num_splits, qk_scale, lse_scale,  # softmax_factors(softmax_scale)[0, 2]
    BLOCK_H: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, HAS_SINK: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # launched programmatically dependent: wait for the decode kernel's results
        wait_for_prior_grid()
    stride_sink, stride_ot, stride_oh, stride_od, stride_lt, stride_lh = _combine_strides(
        stride_sink, stride_ot, stride_oh, stride_od, stride_lt, stride_lh)
    ws_acc_ptr = ws_ptr
    ws_ml_ptr = ws_ptr + ws_ml_off
    t, heads, head_ok = _combine_rows(num_head_blocks, num_heads, BLOCK_H)
    cols = tl.arange(0, DV_PAD)
    m_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for s in range(num_splits):
        row = (t * num_splits + s) * num_heads + heads.to(tl.int64)
        m_max = tl.maximum(m_max, tl.load(ws_ml_ptr + row * 2, mask=head_ok, other=float("-inf")))
    m_use = _safe_max(m_max)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, DV_PAD], dtype=tl.float32)
    for s in range(num_splits):
        row = (t * num_splits + s) * num_heads + heads.to(tl.int64)
        m_s = tl.load(ws_ml_ptr + row * 2, mask=head_ok, other=float("-inf"))
        l_s = tl.load(ws_ml_ptr + row * 2 + 1, mask=head_ok, other=0.0)
        w = tl.exp2((m_s - m_use) * qk_scale)  # 0 for a split without candidates (m_s = -inf)
        l_i += l_s * w
        a = tl.load(ws_acc_ptr + row[:, None] * DV_PAD + cols[None, :], mask=head_ok[:, None], other=0.0)
        acc += a * w[:, None]
    lse, factor = _finish_rows(m_use, l_i, lse_scale, heads, head_ok, sink_ptr, stride_sink, HAS_SINK)
    tl.store(lse_ptr + t * stride_lt + heads * stride_lh, lse, mask=head_ok)
    out_rows = out_ptr + t * stride_ot + heads.to(tl.int64) * stride_oh
    _store_piece(out_rows, stride_od, acc, factor, head_ok, 0, DV_PAD, DV)


@triton.jit
def _sparse_mla_combine_fanout_kernel(
    ws_ptr, ws_ml_off,  # float32 workspace: acc [T, S, H, DV_PAD], then (m, l) [T, S, H, 2] at ws_ml_off
    sink_ptr, stride_sink,  # float32 [H] (HAS_SINK)
    out_ptr, stride_ot, stride_oh, stride_od,  # [T, H, DV], q dtype
    lse_ptr, stride_lt, stride_lh,  # float32 [T, H]
    num_heads, num_head_blocks, num_splits, qk_scale, lse_scale,  # softmax_factors(softmax_scale)[0, 2]
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr,
    DV_PAD: tl.constexpr, HAS_SINK: tl.constexpr, PDL: tl.constexpr,
    ONE_STEP: tl.constexpr,  # num_splits <= BLOCK_S: every partial of the tile in one round of loads
):
    """One program per (token, block of BLOCK_H heads, BLOCK_D output dims). The partials of
    BLOCK_S splits are loaded as one [BLOCK_S, BLOCK_H, BLOCK_D] tile, so every split's bytes are in
    flight at once (a loop of one split per step waits on one load per split: latency-bound). With
    ``ONE_STEP`` the maxima, sums and partials are loaded together, before the maximum is known (one
    memory latency instead of two)."""
    if PDL:  # launched programmatically dependent: wait for the decode kernel's results
        wait_for_prior_grid()
    stride_sink, stride_ot, stride_oh, stride_od, stride_lt, stride_lh = _combine_strides(
        stride_sink, stride_ot, stride_oh, stride_od, stride_lt, stride_lh)
    ws_ml_ptr = ws_ptr + ws_ml_off
    t, heads, head_ok = _combine_rows(num_head_blocks, num_heads, BLOCK_H)
    d0 = tl.program_id(1) * BLOCK_D
    cols = d0 + tl.arange(0, BLOCK_D)
    splits = tl.arange(0, BLOCK_S)
    if ONE_STEP:
        ok, rows = _fanout_rows(t, 0, splits, heads, head_ok, num_heads, num_splits)
        m_s = tl.load(ws_ml_ptr + rows * 2, mask=ok, other=float("-inf"))
        l_s = tl.load(ws_ml_ptr + rows * 2 + 1, mask=ok, other=0.0)
        a = tl.load(ws_ptr + rows[:, :, None] * DV_PAD + cols[None, None, :], mask=ok[:, :, None], other=0.0)
        m_use = _safe_max(tl.max(m_s, axis=0))
        w = tl.exp2((m_s - m_use[None, :]) * qk_scale)  # 0 for a split without candidates (m_s = -inf)
        l_i = tl.sum(l_s * w, axis=0)
        acc = tl.sum(a * w[:, :, None], axis=0)
    else:
        m_use, l_i, acc = _fanout_steps(ws_ptr, ws_ml_ptr, t, heads, head_ok, cols, splits, num_heads, num_splits,
                                        qk_scale, BLOCK_S, BLOCK_H, BLOCK_D, DV_PAD)
    lse, factor = _finish_rows(m_use, l_i, lse_scale, heads, head_ok, sink_ptr, stride_sink, HAS_SINK)
    tl.store(lse_ptr + t * stride_lt + heads * stride_lh, lse, mask=head_ok & (d0 == 0))
    out_rows = out_ptr + t * stride_ot + heads.to(tl.int64) * stride_oh
    mask = head_ok[:, None] & (cols < DV)[None, :]
    tl.store(out_rows[:, None] + cols.to(tl.int64)[None, :] * stride_od,
             (acc * factor[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fanout_steps(ws_ptr, ws_ml_ptr, t, heads, head_ok, cols, splits, num_heads, num_splits, qk_scale,
                  BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, DV_PAD: tl.constexpr):
    """The fan-out combine over more than ``BLOCK_S`` splits: the maximum in a first pass, then the
    weighted sums, ``BLOCK_S`` splits per step. Returns ``(m_use, l_i, acc)``."""
    m_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        ok, rows = _fanout_rows(t, s0, splits, heads, head_ok, num_heads, num_splits)
        m_max = tl.maximum(m_max, tl.max(tl.load(ws_ml_ptr + rows * 2, mask=ok, other=float("-inf")), axis=0))
    m_use = _safe_max(m_max)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        ok, rows = _fanout_rows(t, s0, splits, heads, head_ok, num_heads, num_splits)
        m_s = tl.load(ws_ml_ptr + rows * 2, mask=ok, other=float("-inf"))
        l_s = tl.load(ws_ml_ptr + rows * 2 + 1, mask=ok, other=0.0)
        w = tl.exp2((m_s - m_use[None, :]) * qk_scale)  # 0 for a split without candidates (m_s = -inf)
        l_i += tl.sum(l_s * w, axis=0)
        a = tl.load(ws_ptr + rows[:, :, None] * DV_PAD + cols[None, None, :], mask=ok[:, :, None], other=0.0)
        acc += tl.sum(a * w[:, :, None], axis=0)
    return m_use, l_i, acc


@triton.jit
def _fanout_rows(t, s0, splits, heads, head_ok, num_heads, num_splits):
    """``(ok, rows)``: the [BLOCK_S, BLOCK_H] workspace rows of splits ``s0 + splits`` and ``heads`` of
    token ``t``, and which of them exist."""
    ok = ((s0 + splits) < num_splits)[:, None] & head_ok[None, :]
    rows = (t * num_splits + s0 + splits.to(tl.int64))[:, None] * num_heads + heads.to(tl.int64)[None, :]
    return ok, rows


@triton.jit
def _safe_max(m_max):
    """The running maximum to weigh against: 0 where no split has a candidate (every weight is then 0)."""
    return tl.where(m_max == float("-inf"), 0.0, m_max)


def plan_launch(num_tokens: int, num_heads: int, k_total: int, num_sms: int, num_splits: int | None = None, *,
                dim: int = 576, head_dim_v: int = 512, shared_bytes: int = DEFAULT_SHARED_BYTES,
                compiled_build: Callable[[LaunchPlan], tuple[int, int]] | None = None,
                trust_estimate: bool = True) -> LaunchPlan:
    """Launch configuration of the portable kernel, from shapes only (no autotune: it would re-run
    inside CUDA-graph capture).

    - ``block_h = clamp(next_pow2(H), 16, 64)``: no padding of the work to 64 or 128 heads; H > 64
      runs ceil(H / 64) head blocks, each reading the candidate rows once.
    - 8 warps; the float32 accumulator ``[64, 512]`` is 128 registers per thread (64 or fewer below
      64 heads). ``block_n`` = 64 when the grid stays full, else 32: 64 spills a little more (compile
      for sm_90) but keeps twice the cache rows in flight, and measured faster on an H200 (sweep in
      docs/benchmarks.md); 4 warps, 16-entry blocks and 128-head blocks (16 warps) measured slower.
    - split-K when ``T * head_blocks`` programs do not fill the SMs, keeping at least
      ``_MIN_BLOCKS_PER_SPLIT`` candidate blocks per split.
    - Head dims past the model's (``D`` up to ``MAX_CUDA_DIM`` = 2048, checked by the fake):
      ``block_h`` shrinks until the accumulator stays at 128 registers per thread, then ``block_n``
      and ``block_h`` halve (down to 16) until the Q and K tiles fit the shared memory
      (:func:`shared_bytes_estimate`); the model shapes (D = 576 / 512) keep the configuration above.
      ``ValueError`` if even 16 x 16 tiles do not fit ``shared_bytes``.
    - ``compiled_build`` (the launcher passes it on a GPU): the shared memory (bytes) and tensor memory
      (columns) of a plan's kernel as compiled for the device. The estimate describes the sm_90 build;
      other GPUs' builds of the same tiles may need more (an A100's of the DeepSeek-V4 format) or less. A
      plan whose build does not fit ``shared_bytes`` takes one software-pipelining stage instead of two,
      then smaller tiles in the order above, until one fits (``ValueError`` if none does). A build whose
      accumulators need more than the :data:`TENSOR_MEMORY_COLUMNS` of sm_100 and sm_103 (which Triton
      builds as a kernel that only traps: the DeepSeek-V4 format and the bf16 cache at 64 heads) takes
      half the heads per program, ``block_h``, first. With ``trust_estimate`` (sm_90, where the estimate
      lies above the build) tiles the estimate rejects are not compiled; otherwise every candidate is
      compiled, since a build may also need less than the estimate.
    """
    pv, pt, has_tail = _pieces(dim, head_dim_v)
    block_h = min(64, max(16, next_pow2(num_heads)))
    while block_h > 16 and block_h * 4 * pv > 64 * 512:
        block_h //= 2

    def head_blocks_for(bh: int) -> int:
        return cdiv(num_heads, bh)

    def splits_for(bh: int, block_n: int) -> int:
        blocks = cdiv(k_total, block_n)
        programs = max(num_tokens * head_blocks_for(bh), 1)
        return max(1, min(cdiv(num_sms, programs), blocks // _MIN_BLOCKS_PER_SPLIT))

    # 64-entry blocks keep more cache rows in flight (measured on an H200: 16-40% faster at T >= 128,
    # docs/benchmarks.md), unless halving the block count leaves too few split programs to fill the
    # SMs (T = 4, H = 128: 32-entry blocks run 25% faster).
    programs = max(num_tokens * head_blocks_for(block_h), 1)
    block_n = 64 if programs * splits_for(block_h, 64) >= num_sms else 32
    while True:
        needed, columns = shared_bytes_estimate(block_h, block_n, dim, head_dim_v), 0
        if needed <= shared_bytes or (compiled_build is not None and not trust_estimate):
            plan = LaunchPlan(block_h=block_h, head_blocks=head_blocks_for(block_h), block_n=block_n,
                              num_splits=splits_for(block_h, block_n) if num_splits is None else num_splits,
                              num_warps=8, num_stages=2)
            if compiled_build is None:
                return plan
            for stages in (2, 1):
                plan = dataclasses.replace(plan, num_stages=stages)
                needed, columns = compiled_build(plan)
                if columns > TENSOR_MEMORY_COLUMNS:
                    break  # the stages are not what fills it
                if needed <= shared_bytes:
                    return plan
        if columns > TENSOR_MEMORY_COLUMNS and block_h > 16:
            block_h //= 2  # the accumulators of fewer heads
        elif block_n > 16:
            block_n //= 2
        elif block_h > 16:
            block_h //= 2
        elif columns > TENSOR_MEMORY_COLUMNS:
            raise ValueError(
                f"sparse_mla_decode: D = {dim} with head_dim_v = {head_dim_v} needs {columns} columns of tensor "
                f"memory per block even with 16 x 16 tiles; this GPU has {TENSOR_MEMORY_COLUMNS}")
        else:
            raise ValueError(
                f"sparse_mla_decode: D = {dim} with head_dim_v = {head_dim_v} needs {needed} bytes of shared "
                f"memory per block even with 16 x 16 tiles; this GPU allows {shared_bytes}")


def fit_by_compiling(device: torch.device) -> bool:
    """Whether the launcher checks a plan's tiles against the kernel compiled for ``device``
    (``plan_launch``'s ``compiled_build``): on every GPU, not under the interpreter, which compiles
    nothing. ``scripts/compile_sm90.py`` turns it on for the GPU it compiles for."""
    return device.type == "cuda"


def estimate_bounds_build(device: torch.device) -> bool:
    """Whether :func:`shared_bytes_estimate` lies above the compiled kernel's shared memory on ``device``
    (the sm_90 build it was made from), so that the planner need not compile tiles it rejects.
    ``scripts/compile_sm90.py`` answers for the GPU it compiles for."""
    return device.type != "cuda" or hopper._is_sm90(device)


def shared_bytes_estimate(block_h: int, block_n: int, dim: int, head_dim_v: int) -> int:
    """Shared memory of the decode kernel (an upper estimate): the Q tile ``[block_h, W]`` and the K
    tile ``[block_n, W]`` in 16-bit values, ``W = 4 * PV + PT`` (the padded dims), plus a margin; with
    V pieces wider than 128 dims (``head_dim_v > 512``) the compiled kernel also needs about one
    ``[block_n, PV]`` 16-bit piece of layout-conversion scratch. Checked against the sm_90 compile
    (``scripts/compile_sm90.py``, Triton 3.7; docs/sparse_mla.md has the table): the model shapes are
    within the 4 KB margin at 64 heads, where both tiles are staged for ``wgmma``."""
    pv, pt, has_tail = _pieces(dim, head_dim_v)
    width = 4 * pv + (pt if has_tail else 0)
    scratch = block_n * pv * 2 if pv > 128 else 0
    return (block_h + block_n) * width * 2 + scratch + 4096


def _pieces(dim: int, head_dim_v: int) -> tuple[int, int, bool]:
    """``(PV, PT, HAS_TAIL)``: four V pieces of PV dims cover ``head_dim_v`` (512 -> 4 x 128); one tail
    piece of PT dims covers ``D - head_dim_v`` (576 - 512 -> 64). Both at least 16 (``tl.dot``); the
    kernel holds exactly four V pieces because Triton has no lists of tensors."""
    pv = max(16, next_pow2(head_dim_v) // 4)
    tail = dim - head_dim_v
    pt = max(16, next_pow2(tail)) if tail > 0 else 16
    return pv, pt, tail > 0


_PLANS = PlanCache()


def _stand_ins(kv_cache, indices, topk_length, attn_sink, extra_kv_cache, extra_indices, extra_topk_length, lse):
    """``(length, xc, xi, xlength, sink)``: the optional tensors, with any tensor standing in for an
    absent one (the ``HAS_*`` constexprs keep a stand-in from being read)."""
    xc, xi = (extra_kv_cache, extra_indices) if extra_kv_cache is not None else (kv_cache, indices)
    return (topk_length if topk_length is not None else indices, xc, xi,
            extra_topk_length if extra_topk_length is not None else indices,
            attn_sink if attn_sink is not None else lse)


def _kernel_args(q, kv_cache, indices, topk_length, attn_sink, extra_kv_cache, extra_indices, extra_topk_length,
                 out, lse, ws_ml_off, plan: LaunchPlan, factors):
    """The run-time arguments of either decode kernel (portable and Hopper take the same list); the
    tensors in them come in the order ``q, kv_cache, indices, length, xc, xi, xlength, sink, out, lse,
    ws``, and ``lse`` holds the workspace's place."""
    length, xc, xi, xlength, sink = _stand_ins(kv_cache, indices, topk_length, attn_sink, extra_kv_cache,
                                               extra_indices, extra_topk_length, lse)
    pages, page_size, _ = kv_cache.shape
    x_pages, x_page_size, _ = xc.shape
    return (
        q, q.stride(0), q.stride(1), q.stride(2),
        kv_cache, kv_cache.stride(0), kv_cache.stride(1), page_size, pages * page_size,
        indices, indices.stride(0), indices.stride(1), indices.shape[1],
        length, length.stride(0),
        xc, xc.stride(0), xc.stride(1), x_page_size, x_pages * x_page_size,
        xi, xi.stride(0), xi.stride(1), xi.shape[1],
        xlength, xlength.stride(0),
        sink, sink.stride(0),
        out, out.stride(0), out.stride(1), out.stride(2),
        lse, lse.stride(0), lse.stride(1),
        lse, ws_ml_off,  # the workspace
        q.shape[1], plan.head_blocks, plan.num_splits, *factors,
    )


def _make_launches(q, kv_cache, indices, softmax_scale, kv_format, head_dim_v, topk_length, attn_sink,
                   extra_kv_cache, extra_indices, extra_topk_length, out, lse, plan: LaunchPlan):
    """The launches of one plan, and the workspace size."""
    num_tokens, num_heads, dim = q.shape
    pv, pt, has_tail = _pieces(dim, head_dim_v)
    splits = plan.num_splits
    factors = softmax_factors(softmax_scale)
    ws_ml_off = num_tokens * splits * num_heads * 4 * pv
    ws_numel = ws_ml_off + num_tokens * splits * num_heads * 2 if splits > 1 else 0
    has_extra = extra_kv_cache is not None
    args = _kernel_args(q, kv_cache, indices, topk_length, attn_sink, extra_kv_cache, extra_indices,
                        extra_topk_length, out, lse, ws_ml_off, plan, factors)
    fold = kv_format == "fp8_656" and head_dim_v == 512  # the four V pieces are the four scale groups
    meta = dict(
        BLOCK_H=plan.block_h, BLOCK_N=plan.block_n, DV=head_dim_v, PV=pv, D=dim, PT=pt, HAS_TAIL=has_tail,
        KV_FORMAT=FORMAT_IDS[kv_format], FOLD=fold, V_RAW=fold and q.dtype == torch.bfloat16,
        HAS_LEN=topk_length is not None, HAS_EXTRA=has_extra, HAS_XLEN=has_extra and extra_topk_length is not None,
        HAS_SINK=attn_sink is not None, SPLIT=splits > 1,
    )
    main = KernelLaunch(_sparse_mla_decode_kernel, (num_tokens * splits * plan.head_blocks,), args, meta,
                        num_warps=plan.num_warps, num_stages=plan.num_stages, device=q.device,
                        maxnreg=_DECODE_MAXNREG.get(nvidia_capability(q.device)))
    if splits == 1:
        return ws_numel, main, None
    return ws_numel, main, _make_combine(num_tokens, num_heads, head_dim_v, 4 * pv, splits, ws_ml_off, attn_sink,
                                         out, lse, factors)


_COMBINE_HEADS = 16  # heads per program of the per-split combine
# The Hopper kernels' combine launched with programmatic dependent launch (scheduled once every decode CTA
# has stored its partials; it waits for the decode grid's completion before reading them).
COMBINE_PDL = True


def combine_fans_out(num_tokens: int, num_heads: int, num_splits: int) -> bool:
    """Whether a split plan's partials are merged by the fan-out combine (every split's partials of a
    tile loaded at once, many small programs) rather than the per-split one (one program per token and
    16 heads, one split after the other). Measured on an H200 (CUDA-graph replay of the whole call,
    same decode kernel, docs/sparse_mla.md): the fan-out saves 4.4 µs at T = 1, H = 128, 16 splits,
    where the per-split combine runs 8 programs, each waiting on 16 loads in turn; it costs 0.7 µs at
    T = 4 (32 programs) and 5-9 µs with 4-5 splits. So it runs only where the per-split combine would
    have at most 16 programs and there are at least 8 splits."""
    return num_tokens * cdiv(num_heads, _COMBINE_HEADS) <= 16 and num_splits >= 8


def combine_blocks(num_splits: int, num_heads: int, dv_pad: int) -> tuple[int, int, int]:
    """``(BLOCK_S, BLOCK_H, BLOCK_D)`` of the fan-out combine: up to 32 splits per load and a tile of at
    most 4096 float32 partials (32 per thread). Measured on an H200 (docs/sparse_mla_hopper.md, "Split-K
    at small T"): with 32 splits (T = 1, one block of 64 candidates per split) 32 per load instead of 16
    took fp8_656 H = 128 from 23.1 to 20.1 µs and H = 64 from 21.6 to 18.5; tiles of 2048 or 8192
    partials were slower."""
    block_s = min(32, next_pow2(num_splits))
    block_d = min(64, next_pow2(dv_pad))
    block_h = max(1, min(next_pow2(num_heads), 4096 // (block_s * block_d)))
    return block_s, block_h, block_d


def _make_combine(num_tokens, num_heads, head_dim_v, dv_pad, splits, ws_ml_off, attn_sink, out, lse, factors,
                  fan_out: bool | None = None, pdl: bool = False):
    """The combine launch of a split plan (both decode kernels write the same workspace layout);
    tensors in the order ``ws, sink, out, lse`` (``lse`` holds the places of the workspace and of an
    absent sink here). ``fan_out`` overrides :func:`combine_fans_out` (tests reach both kernels)."""
    sink = attn_sink if attn_sink is not None else lse
    if fan_out is None:
        fan_out = combine_fans_out(num_tokens, num_heads, splits)
    if fan_out:
        block_s, block_h, block_d = combine_blocks(splits, num_heads, dv_pad)
        head_blocks_c = cdiv(num_heads, block_h)
        kernel, grid = _sparse_mla_combine_fanout_kernel, (num_tokens * head_blocks_c, cdiv(dv_pad, block_d))
        meta = dict(BLOCK_S=block_s, BLOCK_H=block_h, BLOCK_D=block_d, ONE_STEP=splits <= block_s)
    else:
        block_h = min(_COMBINE_HEADS, next_pow2(num_heads))
        head_blocks_c = cdiv(num_heads, block_h)
        kernel, grid, meta = _sparse_mla_combine_kernel, (num_tokens * head_blocks_c,), dict(BLOCK_H=block_h)
    return KernelLaunch(
        kernel, grid,
        (lse, ws_ml_off, sink, sink.stride(0), out, out.stride(0), out.stride(1), out.stride(2),
         lse, lse.stride(0), lse.stride(1), num_heads, head_blocks_c, splits, factors[0], factors[2]),
        dict(meta, DV=head_dim_v, DV_PAD=dv_pad, HAS_SINK=attn_sink is not None, PDL=pdl),
        num_warps=4, device=out.device, launch_pdl=pdl)


def _make_hopper_launches(q, kv_cache, indices, softmax_scale, kv_format, topk_length, attn_sink, extra_kv_cache,
                          extra_indices, extra_topk_length, out, lse, plan: LaunchPlan):
    num_tokens, num_heads, _ = q.shape
    factors = softmax_factors(softmax_scale)
    ws_ml_off = num_tokens * plan.num_splits * num_heads * 512  # the combine's layout, acc of 512 dims
    args = _kernel_args(q, kv_cache, indices, topk_length, attn_sink, extra_kv_cache, extra_indices,
                        extra_topk_length, out, lse, ws_ml_off, plan, factors)
    main = hopper.make_launch(args, q, kv_format, topk_length, attn_sink, extra_kv_cache, extra_topk_length, plan)
    if plan.num_splits == 1:
        return 0, main, None
    ws_numel = ws_ml_off + num_tokens * plan.num_splits * num_heads * 2
    return ws_numel, main, _make_combine(num_tokens, num_heads, 512, 512, plan.num_splits, ws_ml_off, attn_sink, out,
                                         lse, factors, pdl=COMBINE_PDL)


def kernel_path(q, kv_cache, kv_format="auto", head_dim_v=512, extra_kv_cache=None) -> str:
    """``"hopper"`` or ``"portable"``: the kernel :func:`sparse_mla_decode_triton` runs for these arguments
    (shapes, strides, dtypes and the caches' 16-byte alignment)."""
    return "hopper" if hopper.supported(q, kv_cache, kv_format, head_dim_v, extra_kv_cache) else "portable"


def sparse_mla_decode_triton(q, kv_cache, indices, softmax_scale, kv_format="auto", head_dim_v=512, topk_length=None,
                             attn_sink=None, extra_kv_cache=None, extra_indices=None, extra_topk_length=None, *,
                             out, lse, num_splits=None, config=None, path=None):
    """CUDA kernel: launches the decode kernel (and the combine kernel when split). Arguments as
    :func:`sparse_mla_decode_torch`. ``path`` picks the kernel: ``"hopper"`` (``ops/sparse_mla_hopper.py``;
    the default wherever :func:`sparse_mla_hopper.supported` holds), ``"portable"`` (the Triton kernel
    below; every other case). ``num_splits`` and ``config`` (``LaunchPlan`` fields) override the
    heuristic (tests use them to exercise the split path on small grids, ``scripts/sweep_mla.py``
    times the alternatives)."""
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    has_extra = extra_kv_cache is not None
    key = (q.shape, q.stride(), q.dtype, kv_cache.shape, kv_cache.stride(), kv_cache.dtype, indices.shape,
           indices.stride(),
           None if topk_length is None else topk_length.stride(0),
           None if attn_sink is None else attn_sink.stride(0),
           None if not has_extra else (extra_kv_cache.shape, extra_kv_cache.stride(), extra_indices.shape,
                                       extra_indices.stride()),
           None if extra_topk_length is None else extra_topk_length.stride(0),
           out.stride(), lse.stride(), softmax_scale, kv_format, head_dim_v, q.device, num_splits,
           None if config is None else tuple(sorted(config.items())), path,
           kv_cache.data_ptr() % 16 == 0, has_extra and extra_kv_cache.data_ptr() % 16 == 0)
    entry = _PLANS.get(key)
    if entry is None:
        k_total = indices.shape[1] + (extra_indices.shape[1] if has_extra else 0)
        use_hopper = path != "portable" and hopper.supported(q, kv_cache, kv_format, head_dim_v, extra_kv_cache)
        if path is None and not use_hopper and not hopper.HAS_GLUON:
            hopper.warn_portable_on_sm90("sparse_mla_decode", q.device, hopper.layout_supported(
                q, kv_cache, kv_format, head_dim_v, extra_kv_cache))
        if path == "hopper" and not use_hopper:
            raise ValueError("path: the Hopper kernel does not serve these arguments (see "
                             "ops/sparse_mla_hopper.py::supported)")
        if use_hopper:
            plan = hopper.plan_launch(num_tokens, q.shape[1], k_total, multiprocessor_count(q.device), num_splits)
        else:
            def compiled_build(p: LaunchPlan) -> tuple[int, int]:  # the build of plan p for this GPU, not launched
                _, launch, _ = _make_launches(q, kv_cache, indices, softmax_scale, kv_format, head_dim_v, topk_length,
                                              attn_sink, extra_kv_cache, extra_indices, extra_topk_length, out, lse, p)
                ws = lse if p.num_splits == 1 else torch.empty(4, dtype=torch.float32, device=q.device)
                return launch.build_resources(q, kv_cache, indices, *_stand_ins(
                    kv_cache, indices, topk_length, attn_sink, extra_kv_cache, extra_indices, extra_topk_length, lse),
                    out, lse, ws)

            plan = plan_launch(num_tokens, q.shape[1], k_total, multiprocessor_count(q.device), num_splits,
                               dim=q.shape[2], head_dim_v=head_dim_v, shared_bytes=shared_memory_per_block(q.device),
                               compiled_build=compiled_build if fit_by_compiling(q.device) and not (
                                   config and {"block_h", "block_n", "num_stages"} & set(config)) else None,
                               trust_estimate=estimate_bounds_build(q.device))
        plan = plan.with_overrides(config)
        if plan.head_blocks != cdiv(q.shape[1], plan.block_h):  # a block_h override
            plan = dataclasses.replace(plan, head_blocks=cdiv(q.shape[1], plan.block_h))
        if not use_hopper and config and fit_by_compiling(q.device):
            columns = compiled_build(plan)[1]  # tiles taken as given: refuse a build that only traps
            if columns > TENSOR_MEMORY_COLUMNS:
                raise ValueError(f"config: {plan.block_h} x {plan.block_n} tiles need {columns} columns of tensor "
                                 f"memory; this GPU has {TENSOR_MEMORY_COLUMNS}")
        if use_hopper:
            entry = _make_hopper_launches(q, kv_cache, indices, softmax_scale, kv_format, topk_length, attn_sink,
                                          extra_kv_cache, extra_indices, extra_topk_length, out, lse, plan)
        else:
            entry = _make_launches(q, kv_cache, indices, softmax_scale, kv_format, head_dim_v, topk_length, attn_sink,
                                   extra_kv_cache, extra_indices, extra_topk_length, out, lse, plan)
        entry = _PLANS.put(key, entry)
    ws_numel, main, combine = entry
    length, xc, xi, xlength, sink = _stand_ins(kv_cache, indices, topk_length, attn_sink, extra_kv_cache,
                                               extra_indices, extra_topk_length, lse)
    if combine is None:
        main(q, kv_cache, indices, length, xc, xi, xlength, sink, out, lse, lse)
        return
    ws = scratch(ws_numel, torch.float32, q.device)  # sized from shapes only
    main(q, kv_cache, indices, length, xc, xi, xlength, sink, out, lse, ws)
    combine(ws, sink, out, lse)
