"""Offsets past 2**31: every kernel computes addresses in 64 bits (the offset rule of ops/_launch.py).

Sections: the static check (the sm_90 TTIR of every kernel, no GPU needed), Triton interpreter runs on
CPU tensors whose views reach past 2**31 elements or bytes (the interpreter does 32-bit integer
arithmetic as the GPU does, so a wrapped offset reads or writes outside the tensor there too; the big
tensors are allocated and never touched, so they cost address space, not memory), and GPU runs with
guard buffers: each written tensor lives inside a larger buffer filled with a sentinel, and after the
call every byte outside the expected writes must still hold it. The GPU tests keep each allocation to a
few GB (under 20 GB per test) and are marked ``large`` (scripts/sanitize.sh leaves them out).

The shapes: an fp8_584 page of more than 2**31 bytes (page_size >= 3,728,271: the scale rows start at
byte 576 * page_size); caches of more than 2**31 bytes or elements; permuted views whose
``index * stride`` passes 2**31 (``kv``, ``out``, ``q``, ``indices``, ``lse``).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import formats_reference as ref
import torch_sparse_mla as tsm
from common import HAS_CUDA, requires_cuda, requires_interpreter, run_offline_compile
from torch_sparse_mla.ops import kv_cache as kv_ops
from torch_sparse_mla.ops import sparse_mla as mla_ops

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
I32, I64 = torch.int32, torch.int64
HUGE_PAGE = 3_728_271  # fp8_584: 576 * page_size > 2**31, so the scale rows start past 2**31 bytes
WIDE = 3_800_000  # a column stride whose product with a column index < 576 passes 2**31
SENTINEL = 0xA5

large = pytest.mark.large


def _huge_storage_ok() -> bool:
    """64-bit address space for a few 10 GB allocations that are never touched."""
    try:
        torch.empty(10 * 2**30, dtype=torch.uint8)
        return True
    except RuntimeError:
        return False


requires_address_space = pytest.mark.skipif(sys.maxsize < 2**40 or not _huge_storage_ok(),
                                            reason="needs to reserve 10 GB of (untouched) address space")


# =====================================================================================================
# Static check: no 32-bit product reaches an address, in any kernel of the families covered here
# =====================================================================================================


@pytest.mark.skipif(not os.path.exists("/usr/bin/env"), reason="needs a POSIX environment")
def test_no_32bit_address_products():
    """scripts/compile_sm90.py compiles every kernel for sm_90 (no GPU needed) and checks the TTIR."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_offline_compile("compile_sm90.py", "--ttir-only", "--check-offsets", "--list", "--cases",
                                 "metadata", "kv_cache", "sparse_mla", "sparse_gqa")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "launches compiled for sm_90" in result.stdout


# =====================================================================================================
# Helpers
# =====================================================================================================


def _records_584(kv: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(data row [576], scale row [8]) bytes of each fp8_584 record, from the naive reference."""
    out = []
    for x in kv:
        f = ref.encode(x, "fp8_584")
        out.append((torch.cat([f["fp8"], f["bf16"]]), f["exponents"]))
    return out


def _record_offsets_584(slot: int, page_size: int, page_stride: int) -> tuple[int, int]:
    page, row = divmod(slot, page_size)
    base = page * page_stride
    return base + 576 * row, base + 576 * page_size + 8 * row


def _wide_t(rows: int, cols: int, dtype, device="cpu", stride=WIDE) -> torch.Tensor:
    """``[rows, cols]`` view with strides ``(1, stride)``: column ``c`` starts ``c * stride`` elements in."""
    base = torch.empty(cols, stride, dtype=dtype, device=device)
    return base.t()[:rows]


# =====================================================================================================
# Triton interpreter (CPU)
# =====================================================================================================


@requires_interpreter
@requires_address_space
def test_interpreter_fp8_584_page_over_2g():
    """Insert and gather through a 2 GiB page: before the fix the scale row of every token was written
    2 GiB before the cache (``page_size * 576`` in 32 bits)."""
    cache = torch.empty(1, HUGE_PAGE, 584, dtype=torch.uint8)
    flat = cache.view(-1)
    slots = torch.tensor([0, HUGE_PAGE - 1, -1, HUGE_PAGE])
    kv = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    records = _records_584(kv)
    windows = []
    for s in (0, HUGE_PAGE - 1):
        d, e = _record_offsets_584(s, HUGE_PAGE, cache.stride(0))
        windows += [(d - 16, d + 576 + 16), (e - 16, e + 8 + 16)]
    for lo, hi in windows:
        flat[max(lo, 0):hi].fill_(SENTINEL)
    kv_ops.kv_cache_insert_triton(kv, slots, cache, "fp8_584")
    for i, s in enumerate((0, HUGE_PAGE - 1)):
        d, e = _record_offsets_584(s, HUGE_PAGE, cache.stride(0))
        assert torch.equal(flat[d:d + 576], records[i][0])
        assert torch.equal(flat[e:e + 8], records[i][1])
        flat[d:d + 576].fill_(SENTINEL)
        flat[e:e + 8].fill_(SENTINEL)
    for lo, hi in windows:  # nothing else in the windows around the records changed
        assert (flat[max(lo, 0):hi] == SENTINEL).all()
    for s, (data, exps) in zip((0, HUGE_PAGE - 1), records):  # write them back for the gather
        d, e = _record_offsets_584(s, HUGE_PAGE, cache.stride(0))
        flat[d:d + 576], flat[e:e + 8] = data, exps
    out = torch.full((4, 512), float("nan"))
    kv_ops.kv_cache_gather_triton(cache, slots, "fp8_584", F32, out=out)
    want = torch.stack([ref.read_slot(cache, s, "fp8_584") for s in (0, HUGE_PAGE - 1)]).float()
    assert torch.equal(out[:2], want)
    assert (out[2:] == 0).all()


@requires_interpreter
@requires_address_space
@pytest.mark.parametrize("kv_format", ref.FORMATS)
def test_interpreter_permuted_kv_and_out(kv_format):
    """``kv`` and ``out`` as ``[N, D]`` views of ``[D, WIDE]`` tensors: ``column * stride`` > 2**31."""
    dim = ref.DIM.get(kv_format, 576)
    n = 5
    values = torch.randn(n, dim, generator=torch.Generator().manual_seed(1)).to(BF16)
    kv = _wide_t(n, dim, BF16)
    kv.copy_(values)
    slots = torch.tensor([3, 0, -1, 7, 11])
    cache, want = (ref.make_cache(4, 3, kv_format, page_pad=5) for _ in range(2))
    kv_ops.kv_cache_insert_triton(kv, slots, cache, kv_format)
    kv_ops.kv_cache_insert_torch(values, slots, want, kv_format)
    assert torch.equal(cache.view(torch.uint8) if kv_format != "auto" else cache.view(torch.int16),
                       want.view(torch.uint8) if kv_format != "auto" else want.view(torch.int16))
    out = _wide_t(n, dim, BF16)
    out.fill_(float("nan"))
    kv_ops.kv_cache_gather_triton(cache, slots, kv_format, BF16, out=out)
    expected = torch.empty(n, dim, dtype=BF16)
    kv_ops.kv_cache_gather_torch(want, slots, kv_format, BF16, out=expected)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def _mla_small(kv_format, t, h, k, seed, dtype=F16):
    """A small poisoned cache with filled slots, q, indices (int32, some invalid), for the MLA tests."""
    g = torch.Generator().manual_seed(seed)
    dim = ref.DIM.get(kv_format, 576)
    cache = ref.make_cache(6, 8, kv_format, dtype=dtype, page_pad=3)
    filled = torch.randperm(48, generator=g)[:12]
    ref.fill_cache(cache, filled.tolist(), torch.randn(12, dim, generator=g), kv_format)
    idx = filled[torch.randint(0, 12, (t, k), generator=g)].to(I32)
    idx[:, 1] = -1
    q = torch.randn(t, h, dim, generator=g).to(dtype)
    return q, cache, idx


def _mla_reference(q, cache, idx, kv_format, **kw):
    out = torch.empty(q.shape[0], q.shape[1], 512, dtype=q.dtype)
    lse = torch.empty(q.shape[0], q.shape[1])
    mla_ops.sparse_mla_decode_torch(q.contiguous(), cache, idx.contiguous(), 0.06, kv_format, 512, out=out, lse=lse,
                                    **kw)
    return out, lse


def _assert_close_mla(out, lse, want_out, want_lse):
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(lse, want_lse, atol=5e-4, rtol=0)
    torch.testing.assert_close(out.float(), want_out.float(), atol=2**-7 * want_out.abs().max().item(), rtol=2**-7)


@requires_interpreter
@requires_address_space
def test_interpreter_mla_fp8_584_page_over_2g():
    q, small, idx = _mla_small("fp8_584", 2, 16, 8, seed=2)
    # The same records in a cache whose one page spans 2 GiB: slot s of the small cache goes to
    # row s of the big page, and to row HUGE_PAGE - 1 - s, past 2**31 bytes.
    big = torch.empty(1, HUGE_PAGE, 584, dtype=torch.uint8)
    used = sorted(set(idx[idx >= 0].tolist()))
    rows = {s: (HUGE_PAGE - 1 - s if s % 2 else s) for s in used}
    kv_ops.kv_cache_insert_torch(mla_ops.dequantize_torch(small, torch.tensor(used), "fp8_584"),
                                 torch.tensor([rows[s] for s in used]), big, "fp8_584")
    big_idx = torch.where(idx >= 0, torch.tensor([rows.get(s, 0) for s in range(48)], dtype=I32)[idx.clamp(min=0)],
                          idx)
    out = torch.empty(2, 16, 512, dtype=F16)
    lse = torch.empty(2, 16)
    mla_ops.sparse_mla_decode_triton(q, big, big_idx, 0.06, "fp8_584", 512, out=out, lse=lse)
    _assert_close_mla(out, lse, *_mla_reference(q, small, idx, "fp8_584"))


@requires_interpreter
@requires_address_space
def test_interpreter_mla_permuted_q_and_out():
    """``q`` and ``out`` ``[T, H, D]`` with ``stride(2)`` = WIDE: ``dim * stride`` > 2**31."""
    q, cache, idx = _mla_small("auto", 2, 16, 8, seed=3)
    q_wide = torch.empty(576, WIDE, dtype=F16).t()[:32].view(2, 16, 576)
    q_wide.copy_(q)
    out = torch.empty(512, WIDE, dtype=F16).t()[:32].view(2, 16, 512)
    out.fill_(float("nan"))
    lse = torch.empty(2, 16)
    for splits in (1, 2):
        mla_ops.sparse_mla_decode_triton(q_wide, cache, idx, 0.06, "auto", 512, out=out, lse=lse, num_splits=splits)
        _assert_close_mla(out, lse, *_mla_reference(q, cache, idx, "auto"))


@requires_interpreter
@requires_address_space
def test_interpreter_mla_strided_indices_and_lse():
    """``indices [T, K]`` with ``stride(1)`` and ``lse [T, H]`` with ``stride(1)`` whose products with
    the column index pass 2**31 elements (8 GiB of int32 / float32 address space each)."""
    t, h, k = 2, 16, 8
    q, cache, idx = _mla_small("fp8_656", t, h, k, seed=4)
    idx_stride = 2**31 // (k - 1) + 7
    idx_wide = torch.as_strided(torch.empty((k - 1) * idx_stride + t, dtype=I32), (t, k), (1, idx_stride))
    idx_wide.copy_(idx)
    lse_stride = 2**31 // (h - 1) + 5
    lse_wide = torch.as_strided(torch.empty((h - 1) * lse_stride + t), (t, h), (1, lse_stride))
    lse_wide.fill_(float("nan"))
    out = torch.empty(t, h, 512, dtype=F16)
    mla_ops.sparse_mla_decode_triton(q, cache, idx_wide, 0.06, "fp8_656", 512, out=out, lse=lse_wide)
    _assert_close_mla(out, lse_wide, *_mla_reference(q, cache, idx, "fp8_656"))


# =====================================================================================================
# GPU, with guard buffers
# =====================================================================================================


@pytest.fixture
def free_cuda():
    yield
    if HAS_CUDA:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _guarded_uint8(nbytes: int, lead: int, trail: int = 2**20) -> tuple[torch.Tensor, int]:
    """A sentinel-filled uint8 buffer of ``lead + nbytes + trail`` bytes and the offset of the region."""
    buf = torch.full((lead + nbytes + trail,), SENTINEL, dtype=torch.uint8, device="cuda")
    return buf, lead


def _all_sentinel(buf: torch.Tensor) -> bool:
    return bool((buf.view(torch.uint8) == SENTINEL).all())


@requires_cuda
@large
def test_cuda_fp8_584_pages_over_2g(free_cuda):
    """Two 2 GiB pages with 2 GiB of guard before them (where the 32-bit kernels wrote) and 1 MiB
    after: insert four tokens (first and last row of each page) and two empty slots, then gather."""
    page_bytes = HUGE_PAGE * 584
    buf, lead = _guarded_uint8(2 * page_bytes, lead=2**31 + 2**20)
    cache = buf.as_strided((2, HUGE_PAGE, 584), (page_bytes, 584, 1), lead)
    slots = torch.tensor([0, HUGE_PAGE - 1, HUGE_PAGE, 2 * HUGE_PAGE - 1, -1, 2 * HUGE_PAGE], device="cuda")
    kv = torch.randn(6, 512, generator=torch.Generator().manual_seed(5)).to(BF16)
    tsm.kv_cache_insert(kv.cuda(), slots, cache, kv_format="fp8_584")
    torch.cuda.synchronize()
    records = _records_584(kv[:4])
    for s, (data, exps) in zip(slots[:4].tolist(), records):
        d, e = _record_offsets_584(s, HUGE_PAGE, page_bytes)
        assert torch.equal(buf[lead + d:lead + d + 576].cpu(), data), s
        assert torch.equal(buf[lead + e:lead + e + 8].cpu(), exps), s
    out = tsm.kv_cache_gather(cache, slots.int(), kv_format="fp8_584", dtype=F32)
    for i, s in enumerate(slots[:4].tolist()):
        assert torch.equal(out[i].cpu(), ref.read_slot(cache, s, "fp8_584").float().cpu())
    assert (out[4:] == 0).all()
    for s in slots[:4].tolist():  # reset the records: every byte of the buffer is the sentinel again
        d, e = _record_offsets_584(s, HUGE_PAGE, page_bytes)
        buf[lead + d:lead + d + 576].fill_(SENTINEL)
        buf[lead + e:lead + e + 8].fill_(SENTINEL)
    assert _all_sentinel(buf), "a kernel wrote outside the four records"


@requires_cuda
@large
@pytest.mark.parametrize("kv_format", ["auto", "fp8_656"])
def test_cuda_cache_over_2g(kv_format, free_cuda):
    """A cache of more than 2**31 elements (auto, bf16) or bytes (fp8_656): tokens in its last pages,
    insert, gather and sparse_mla_decode against the same tokens in a small cache."""
    page_size, dim = 64, 576
    width = dim if kv_format == "auto" else 656
    pages = 2**31 // (page_size * width) + 4
    elem = 2 if kv_format == "auto" else 1
    buf, lead = _guarded_uint8(pages * page_size * width * elem, lead=2**20)
    if kv_format == "auto":
        cache = buf[lead:lead + pages * page_size * width * 2].view(BF16).view(pages, page_size, dim)
    else:
        cache = buf[lead:lead + pages * page_size * width].view(pages, page_size, width)
    g = torch.Generator().manual_seed(6)
    small_slots = torch.arange(8)
    big_slots = (pages - 2) * page_size + torch.tensor([0, 1, 5, 63, 64, 70, 100, 127])  # last two pages
    kv = torch.randn(8, dim, generator=g).to(BF16)
    small = ref.make_cache(2, 4, kv_format)
    tsm.kv_cache_insert(kv, small_slots, small, kv_format=kv_format)
    tsm.kv_cache_insert(kv.cuda(), big_slots.cuda(), cache, kv_format=kv_format)
    got = tsm.kv_cache_gather(cache, big_slots.cuda(), kv_format=kv_format, dtype=F32)
    want = tsm.kv_cache_gather(small, small_slots, kv_format=kv_format, dtype=F32)
    assert torch.equal(got.cpu(), want)
    q = torch.randn(3, 16, dim, generator=g).to(BF16)
    idx = torch.randint(0, 8, (3, 6), generator=g)
    out, lse = tsm.sparse_mla_decode(q.cuda(), cache, big_slots[idx].int().cuda(), softmax_scale=0.06,
                                     kv_format=kv_format)
    want_out, want_lse = tsm.sparse_mla_decode(q, small, small_slots[idx].int(), softmax_scale=0.06,
                                               kv_format=kv_format)
    _assert_close_mla(out.cpu(), lse.cpu(), want_out, want_lse)
    cache.view(-1).view(torch.uint8)[(pages - 2) * page_size * width * elem:].fill_(SENTINEL)
    assert _all_sentinel(buf), "a kernel wrote outside the last two pages"


@requires_cuda
@large
def test_cuda_permuted_views(free_cuda):
    """``kv``, gather ``out``, MLA ``q`` and ``out`` as views whose ``column * stride`` passes 2**31
    elements (the rest of their storage is the guard)."""
    n, dim = 6, 576
    g = torch.Generator().manual_seed(7)
    values = torch.randn(n, dim, generator=g).to(BF16)

    def wide(rows, cols):
        base = torch.full((cols, WIDE), float("nan"), dtype=BF16, device="cuda")
        return base, base.t()[:rows]

    kv_base, kv = wide(n, dim)
    kv.copy_(values)
    slots = torch.tensor([3, 0, -1, 7, 11, 2])
    for kv_format in ref.FORMATS:
        cache = ref.make_cache(4, 3, kv_format, device="cuda")
        want = ref.make_cache(4, 3, kv_format)
        d = ref.DIM.get(kv_format, dim)  # fp8_584 holds 512 dims: the first 512 columns of the same views
        tsm.kv_cache_insert(kv[:, :d], slots.cuda(), cache, kv_format=kv_format)
        tsm.kv_cache_insert(values[:, :d], slots, want, kv_format=kv_format)
        assert torch.equal(cache.cpu().view(torch.uint8) if kv_format != "auto" else cache.cpu().view(torch.int16),
                           want.view(torch.uint8) if kv_format != "auto" else want.view(torch.int16))
        out_base, out = wide(n, ref.DIM.get(kv_format, 576))
        tsm.kv_cache_gather(cache, slots.cuda(), kv_format=kv_format, out=out)
        expected = tsm.kv_cache_gather(want, slots, kv_format=kv_format)
        assert torch.equal(out.cpu().view(torch.int16), expected.view(torch.int16))
        out.fill_(float("nan"))
        assert out_base.isnan().all(), "gather wrote outside its output view"
        del out_base, out
    q, small, idx = _mla_small("fp8_656", 2, 16, 8, seed=8, dtype=BF16)
    q_base, q_wide = wide(32, 576)
    q_wide.copy_(q.view(32, 576))
    o_base, o_wide = wide(32, 512)
    cache = small.cuda()
    lse = torch.empty(2, 16, device="cuda")
    for splits in (1, 2):
        mla_ops.sparse_mla_decode_triton(q_wide.view(2, 16, 576), cache, idx.cuda(), 0.06, "fp8_656", 512,
                                         out=o_wide.view(2, 16, 512), lse=lse, num_splits=splits)
        _assert_close_mla(o_wide.view(2, 16, 512).cpu(), lse.cpu(), *_mla_reference(q, small, idx, "fp8_656"))
    o_wide.fill_(float("nan"))
    assert o_base.isnan().all(), "sparse_mla_decode wrote outside its output view"


@requires_cuda
@large
def test_cuda_mla_strided_indices_and_lse(free_cuda):
    """``indices`` and ``lse`` whose ``column * stride(1)`` passes 2**31 elements (about 9 GB each)."""
    t, h, k = 2, 16, 8
    q, small, idx = _mla_small("fp8_584", t, h, k, seed=9, dtype=BF16)
    idx_stride = 2**31 // (k - 1) + 7
    idx_wide = torch.as_strided(torch.full(((k - 1) * idx_stride + t,), -1, dtype=I32, device="cuda"), (t, k),
                                (1, idx_stride))
    idx_wide.copy_(idx)
    lse_stride = 2**31 // (h - 1) + 5
    lse_base = torch.full(((h - 1) * lse_stride + t,), float("nan"), device="cuda")
    lse_wide = torch.as_strided(lse_base, (t, h), (1, lse_stride))
    out = torch.empty(t, h, 512, dtype=BF16, device="cuda")
    for splits in (1, 2):
        mla_ops.sparse_mla_decode_triton(q.cuda(), small.cuda(), idx_wide, 0.06, "fp8_584", 512, out=out, lse=lse_wide,
                                         num_splits=splits)
        _assert_close_mla(out.cpu(), lse_wide.cpu(), *_mla_reference(q, small, idx, "fp8_584"))
    lse_wide.fill_(float("nan"))
    assert lse_base.isnan().all(), "sparse_mla_decode wrote outside lse"


# -- sparse_gqa_decode (the current API) --------------------------------------------------------------


def _gqa_small(seed, hq=8, hkv=2, dh=128, page_size=16, pages=6, t=3, n_sel=3):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(pages, hkv, page_size, 2 * dh, generator=g).to(BF16)
    table = torch.randperm(pages, generator=g)[:4].view(1, 4).repeat(t, 1).to(I32)
    topk = torch.randint(0, 4, (t, hkv, n_sel), generator=g).to(I32)
    topk[:, :, 1] = -1
    lens = torch.full((t,), 4 * page_size, dtype=I32)
    q = torch.randn(t, hq, dh, generator=g).to(BF16)
    return q, cache, topk, table, lens


def _gqa(q, cache, topk, table, lens, out=None):
    return tsm.sparse_gqa_decode(q, cache, topk, table, lens, lens - 1, decode_query_len=1, softmax_scale=0.09,
                                 out=out)


@requires_cuda
@large
@pytest.mark.parametrize("cache_dtype", [BF16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_cuda_gqa_cache_over_2g(free_cuda, cache_dtype):
    """A cache of more than 2**31 elements (a float8 one runs the Hopper kernel on sm_90); the selected
    pages are its last ones."""
    q, small, topk, table, lens = _gqa_small(10)
    small = small.to(cache_dtype)
    per_page = small[0].numel()
    pages = 2**31 // per_page + 8
    big = torch.full((pages, *small.shape[1:]), float("nan"), dtype=cache_dtype, device="cuda")
    big[pages - small.shape[0]:] = small.cuda()
    got = _gqa(q.cuda(), big, topk.cuda(), (table + pages - small.shape[0]).cuda(), lens.cuda())
    want = _gqa(q, small, topk, table, lens)
    assert not got.isnan().any()
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=2e-2, rtol=2e-2)


@requires_cuda
@large
@pytest.mark.parametrize("cache_dtype", [BF16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_cuda_gqa_permuted_q_and_out(free_cuda, cache_dtype):
    """``q`` and ``out`` ``[T, Hq, Dh]`` with ``stride(2)`` past 2**31 / Dh (a float8 cache runs the
    Hopper kernel on sm_90)."""
    q, small, topk, table, lens = _gqa_small(11)
    small = small.to(cache_dtype)
    t, hq, dh = q.shape
    stride = 2**31 // (dh - 1) + 3
    q_base = torch.full((dh, stride), float("nan"), dtype=BF16, device="cuda")
    q_wide = q_base.t()[:t * hq].view(t, hq, dh)
    q_wide.copy_(q)
    o_base = torch.full((dh, stride), float("nan"), dtype=BF16, device="cuda")
    o_wide = o_base.t()[:t * hq].view(t, hq, dh)
    _gqa(q_wide, small.cuda(), topk.cuda(), table.cuda(), lens.cuda(), out=o_wide)
    want = _gqa(q, small, topk, table, lens)
    torch.testing.assert_close(o_wide.cpu().float(), want.float(), atol=2e-2, rtol=2e-2)
    o_wide.fill_(float("nan"))
    assert o_base.isnan().all(), "sparse_gqa_decode wrote outside its output view"
