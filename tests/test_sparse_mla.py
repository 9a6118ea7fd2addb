"""Tests of sparse_mla_decode (SPEC section 6) and of the shared cache decoding (ops/_formats.py).

Sections: schema snapshot, reference parity (CPU kernel), Triton interpreter parity, opcheck,
torch.compile, error messages, CUDA. The reference below is naive and independent of the library:
Python loops over tokens and list entries, slots decoded one at a time by tests/formats_reference.py,
float64 math. Every cache slot that no valid entry selects holds NaN bytes (make_cache), and entries
past ``topk_length`` point at such slots, so a kernel that reads anything it should not fails.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from expecttest import assert_expected_inline

import torch_sparse_mla
from torch_sparse_mla.meta_kernels._formats import FORMAT_IDS
from torch_sparse_mla.ops import sparse_mla as mla_ops
from torch_sparse_mla.ops._formats import dequantize_torch, e4m3_to_float32, load_kv_tile

from common import (assert_no_recompiles, check_alignment_needs, forget_signatures, poison, records_split_launches,
                    require_gluon, requires_cuda, requires_hopper, requires_interpreter, run_offline_compile)
import formats_reference as fr

_ops = torch.ops.sparse_mla


# =====================================================================================================
# Inputs and the naive reference
# =====================================================================================================


@dataclasses.dataclass(frozen=True)
class Spec:
    kv_format: str = "fp8_656"
    T: int = 2
    H: int = 16
    K: int = 64
    K2: int = 0  # extra list width (0: no extra cache)
    dim: int | None = None  # auto only (default 576)
    head_dim_v: int = 512
    dtype: torch.dtype = torch.bfloat16
    lengths: bool = False  # topk_length (and extra_topk_length), including values outside [0, K]
    sink: str | None = None  # None, "finite" or "inf" (a mix of finite, +inf and -inf)
    bad_indices: bool = False  # -1, negative and past-the-end entries
    empty_row: bool = False  # token 0 has no valid candidate
    page_pad: int = 0
    noncontig_q: bool = False
    scale: float = 0.06  # softmax_scale (0.3 gives peaky softmaxes)
    page_size: int = 16
    pool: int = 96  # filled (non-NaN) slots per cache; indices are drawn from them (duplicates happen)
    extra_page_pad: int | None = None  # default: 2 * page_pad + 3 (an odd page stride)
    # fp8_584, when non-zero: pool rows 0 and 1 get dims 384-447 (one scale tile) of largest magnitude
    # huge_tile and huge_tile / 3, and q is zero on those dims (the scores stay ordinary)
    huge_tile: float = 0.0

    @property
    def D(self) -> int:
        return fr.DIM.get(self.kv_format, self.dim or 576)

    def __str__(self) -> str:
        parts = [self.kv_format, f"T{self.T}", f"H{self.H}", f"K{self.K}"]
        if self.K2:
            parts.append(f"K2_{self.K2}")
        if self.kv_format == "auto" and self.dim:
            parts.append(f"D{self.dim}")
        if self.head_dim_v != 512:
            parts.append(f"dv{self.head_dim_v}")
        if self.dtype != torch.bfloat16:
            parts.append(str(self.dtype).replace("torch.", ""))
        for flag in ("lengths", "bad_indices", "empty_row", "noncontig_q"):
            if getattr(self, flag):
                parts.append(flag)
        if self.sink:
            parts.append(f"sink_{self.sink}")
        if self.page_pad:
            parts.append(f"pad{self.page_pad}")
        if self.scale != 0.06:
            parts.append(f"scale{self.scale}")
        if self.huge_tile:
            parts.append(f"tile{self.huge_tile:g}")
        return "-".join(parts)


def _make_cache(spec: Spec, gen: torch.Generator):
    """A poisoned cache with ``spec.pool`` filled slots; returns ``(cache, filled, poisoned)`` slots."""
    pages = max(4, math.ceil(2 * spec.pool / spec.page_size))
    cache = fr.make_cache(pages, spec.page_size, spec.kv_format, dim=spec.D, dtype=spec.dtype,
                          page_pad=spec.page_pad)
    perm = torch.randperm(pages * spec.page_size, generator=gen)
    filled, poisoned = perm[: spec.pool], perm[spec.pool:]
    # Rows of very different magnitudes exercise the per-tile scales.
    values = torch.randn(spec.pool, spec.D, generator=gen) * 2.0 ** torch.randint(-2, 3, (spec.pool, 1), generator=gen)
    if spec.huge_tile:
        for row, amax in ((0, spec.huge_tile), (1, spec.huge_tile / 3)):
            values[row, 384:448] *= amax / values[row, 384:448].abs().max()
    fr.fill_cache(cache, filled.tolist(), values, spec.kv_format)
    return cache, filled, poisoned


def _make_list(spec: Spec, width: int, cache_info, gen: torch.Generator):
    """int32 ``[T, width]`` lists drawn from the filled slots (duplicates happen), and lengths or None."""
    cache, filled, poisoned = cache_info
    num_slots = cache.shape[0] * cache.shape[1]
    idx = filled[torch.randint(0, len(filled), (spec.T, width), generator=gen)]
    lengths = None
    if spec.lengths and spec.T > 0:
        lengths = torch.randint(-2, width + 3, (spec.T,), generator=gen)
        lengths[-1] = width + 5  # past K: clamped
        if spec.T > 1:
            lengths[0] = max(1, width // 2)
        col = torch.arange(width)
        unused = col[None, :] >= lengths.clamp(0, width)[:, None]
        # Entries past the length point at NaN slots: they must not be read.
        nan_slots = poisoned[torch.randint(0, len(poisoned), (spec.T, width), generator=gen)]
        idx = torch.where(unused, nan_slots, idx)
        lengths = lengths.to(torch.int32)
    if spec.bad_indices:
        bad = torch.tensor([-1, -2, num_slots, num_slots + 7, 2**31 - 1, -(2**31)])
        where = torch.rand(spec.T, width, generator=gen) < 0.3
        idx = torch.where(where, bad[torch.randint(0, len(bad), (spec.T, width), generator=gen)], idx)
    if spec.empty_row and spec.T > 0:
        idx[0] = torch.where(torch.arange(width) % 2 == 0, -1, num_slots + 3)
    return idx.to(torch.int32), lengths


def make_inputs(spec: Spec, seed: int = 0, value_seed: int | None = None) -> dict:
    """CPU keyword arguments of ``sparse_mla_decode`` for ``spec``. The caches depend on ``seed`` only;
    ``value_seed`` (default ``seed``) draws q, the lists, lengths and sinks, so inputs made with one
    ``seed`` and several ``value_seed`` share their caches' contents."""
    gen = torch.Generator().manual_seed(seed)
    main = _make_cache(spec, gen)
    # The extra cache has its own page size and padding: the kernels must not mix up the two layouts.
    extra_pad = spec.page_pad * 2 + 3 if spec.extra_page_pad is None else spec.extra_page_pad
    extra_spec = dataclasses.replace(spec, page_size=spec.page_size // 2, page_pad=extra_pad)
    extra = _make_cache(extra_spec, gen) if spec.K2 else None
    gen = torch.Generator().manual_seed(1000 + (seed if value_seed is None else value_seed))
    idx, lengths = _make_list(spec, spec.K, main, gen)
    if spec.noncontig_q:
        q = torch.randn(spec.T, spec.D, spec.H, generator=gen).to(spec.dtype).transpose(1, 2)
    else:
        q = torch.randn(spec.T, spec.H, spec.D, generator=gen).to(spec.dtype)
    if spec.huge_tile:
        q[:, :, 384:448] = 0
    kwargs = dict(q=q, kv_cache=main[0], indices=idx, softmax_scale=spec.scale, kv_format=spec.kv_format,
                  head_dim_v=spec.head_dim_v, topk_length=lengths)
    if spec.K2:
        xidx, xlengths = _make_list(spec, spec.K2, extra, gen)
        kwargs.update(extra_kv_cache=extra[0], extra_indices=xidx, extra_topk_length=xlengths)
    if spec.sink == "finite":
        kwargs["attn_sink"] = torch.randn(spec.H, generator=gen) * 2
    elif spec.sink == "inf":
        sink = torch.randn(spec.H, generator=gen)
        sink[0::3] = float("inf")
        sink[1::3] = float("-inf")
        kwargs["attn_sink"] = sink
    return kwargs


FLT_MAX = torch.finfo(torch.float32).max


def reference(q, kv_cache, indices, softmax_scale, kv_format="auto", head_dim_v=512, topk_length=None,
              attn_sink=None, extra_kv_cache=None, extra_indices=None, extra_topk_length=None, score_k_dtype=None):
    """float64 ``(out, lse)``, one token and one list entry at a time. ``lse`` of a token with
    candidates saturates at +-FLT_MAX (the float32 output cannot hold more, and +inf means "no
    candidate"), and a ``|softmax_scale|`` above FLT_MAX counts as FLT_MAX (docs/sparse_mla.md).
    ``score_k_dtype``: the scores use the dequantised K rounded to float32, then to this dtype, as the
    generic fp8_656 path (``head_dim_v != 512``) does before its tensor-core product."""
    softmax_scale = math.copysign(min(abs(softmax_scale), FLT_MAX), softmax_scale)
    num_tokens, num_heads, _ = q.shape
    out = torch.zeros(num_tokens, num_heads, head_dim_v, dtype=torch.float64)
    lse = torch.full((num_tokens, num_heads), math.inf, dtype=torch.float64)
    lists = [(kv_cache, indices, topk_length)]
    if extra_kv_cache is not None:
        lists.append((extra_kv_cache, extra_indices, extra_topk_length))
    decoded = {}
    for t in range(num_tokens):
        keys = []
        for which, (cache, idx, lengths) in enumerate(lists):
            width = idx.shape[1]
            n = width if lengths is None else min(max(int(lengths[t]), 0), width)
            num_slots = cache.shape[0] * cache.shape[1]
            for j in range(n):
                slot = int(idx[t, j])
                if 0 <= slot < num_slots:
                    if (which, slot) not in decoded:
                        decoded[(which, slot)] = fr.read_slot(cache, slot, kv_format)
                    keys.append(decoded[(which, slot)])
        if not keys:
            continue
        k = torch.stack(keys)
        ks = k if score_k_dtype is None else k.to(torch.float32).to(score_k_dtype).to(torch.float64)
        scores = softmax_scale * (q[t].to(torch.float64) @ ks.T)  # [H, n]
        m = scores.max(dim=1, keepdim=True).values
        e = torch.exp(scores - m)
        total = e.sum(dim=1)
        lse[t] = (m[:, 0] + torch.log(total)).clamp(-FLT_MAX, FLT_MAX)
        o = (e / total[:, None]) @ k[:, :head_dim_v]
        if attn_sink is not None:
            o = o / (1 + torch.exp(attn_sink.to(torch.float64) - lse[t]))[:, None]
        out[t] = o
    return out, lse


def assert_matches(out, lse, ref_out, ref_lse, *, tensor_cores: bool):
    """Within bf16 rounding of the float64 reference.

    Scores are float32 on every path (the fp8_656 scales are applied after the tensor-core product of
    the raw e4m3 values), so ``lse`` is close to float64. ``tensor_cores``: P and V were rounded to
    the MMA dtype (relative 2^-9 each) before ``P @ V``; otherwise only the output's own rounding
    remains. With the tests' data these bounds hold with a margin of about 3x. The generic
    tensor-core path of fp8_656 with ``head_dim_v != 512`` rounds the dequantised K to the query dtype
    for its scores: compare it with ``expected`` (a reference that does the same).
    """
    # The output dtype's spacing at zero (its smallest subnormal): an output of that size rounds to a
    # neighbour whatever the reference (e.g. a large sink scales a float16 output down to ~1e-8).
    floor = torch.finfo(out.dtype).smallest_normal * torch.finfo(out.dtype).eps
    out, lse = out.cpu().to(torch.float64), lse.cpu().to(torch.float64)
    assert not out.isnan().any(), "NaN in out"
    assert not lse.isnan().any(), "NaN in lse"
    no_candidate = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), no_candidate), "lse = +inf exactly for the tokens without candidates"
    assert (lse[no_candidate] > 0).all()
    assert (out[no_candidate] == 0).all(), "out = 0 for the tokens without candidates"
    vmax = ref_out.abs().max().item() if ref_out.numel() else 0.0
    if tensor_cores:
        lse_tol, out_atol, out_rtol = 5e-4, 2**-7 * vmax, 2**-7
    else:
        lse_tol, out_atol, out_rtol = 1e-4, 1e-5 * vmax, 2**-8
    torch.testing.assert_close(lse[~no_candidate], ref_lse[~no_candidate], atol=lse_tol, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=out_atol + floor, rtol=out_rtol)


def _outputs_like(kwargs, device="cpu"):
    q = kwargs["q"]
    out = poison(torch.empty(q.shape[0], q.shape[1], kwargs["head_dim_v"], dtype=q.dtype, device=device))
    lse = poison(torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=device))
    return out, lse


_ARG_ORDER = ("q", "kv_cache", "indices", "softmax_scale", "kv_format", "head_dim_v", "topk_length", "attn_sink",
              "extra_kv_cache", "extra_indices", "extra_topk_length")


def _positional(kwargs):
    return tuple(kwargs.get(name) for name in _ARG_ORDER)


def _storage_to(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device`` with the same strides and storage offset (keeps padded page strides)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, (n,), (1,))
    return flat.to(device).as_strided(t.shape, t.stride(), t.storage_offset())


def _to_device(kwargs, device):
    return {k: (_storage_to(v, device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}


# =====================================================================================================
# Schema snapshot
# =====================================================================================================


def test_schema():
    assert_expected_inline(
        str(_ops.sparse_mla_decode.default._schema),
        """sparse_mla::sparse_mla_decode(Tensor q, Tensor kv_cache, Tensor indices, float softmax_scale, str kv_format="auto", int head_dim_v=512, Tensor? topk_length=None, Tensor? attn_sink=None, Tensor? extra_kv_cache=None, Tensor? extra_indices=None, Tensor? extra_topk_length=None) -> (Tensor out, Tensor lse)""",
    )
    assert_expected_inline(
        str(_ops.sparse_mla_decode.out._schema),
        """sparse_mla::sparse_mla_decode.out(Tensor q, Tensor kv_cache, Tensor indices, float softmax_scale, str kv_format="auto", int head_dim_v=512, Tensor? topk_length=None, Tensor? attn_sink=None, Tensor? extra_kv_cache=None, Tensor? extra_indices=None, Tensor? extra_topk_length=None, *, Tensor(a!) out, Tensor(b!) lse) -> ()""",
    )


# =====================================================================================================
# Reference parity (CPU kernel, through the public function)
# =====================================================================================================

_SHAPES = [(2, 1, 1), (3, 16, 7), (2, 20, 64), (2, 64, 100), (1, 128, 2048)]
_PARITY = [Spec(kv_format=f, T=t, H=h, K=k) for f in fr.FORMATS for t, h, k in _SHAPES] + [
    Spec(kv_format=f, T=4, H=20, K=40, K2=24, lengths=True, sink="finite", bad_indices=True, empty_row=True,
         page_pad=5, noncontig_q=True)
    for f in fr.FORMATS
] + [
    Spec(kv_format="fp8_656", T=3, H=16, K=64, lengths=True),
    Spec(kv_format="fp8_584", T=3, H=16, K=64, sink="finite"),
    Spec(kv_format="fp8_656", T=3, H=24, K=32, sink="inf"),
    Spec(kv_format="fp8_584", T=3, H=16, K=48, K2=100),
    Spec(kv_format="fp8_656", T=3, H=16, K=48, K2=20, lengths=True),
    Spec(kv_format="auto", T=3, H=16, K=64, bad_indices=True, empty_row=True),
    Spec(kv_format="fp8_584", T=2, H=16, K=64, page_pad=3),
    Spec(kv_format="auto", T=2, H=16, K=64, page_pad=7, noncontig_q=True, dtype=torch.float16),
    Spec(kv_format="fp8_656", T=2, H=16, K=64, scale=0.3),
    Spec(kv_format="fp8_656", T=2, H=16, K=64, head_dim_v=448),
    Spec(kv_format="auto", T=2, H=16, K=64, dim=96, head_dim_v=64, K2=8),
]


@pytest.mark.parametrize("spec", _PARITY, ids=str)
def test_reference_parity(spec):
    kwargs = make_inputs(spec)
    ref_out, ref_lse = reference(**kwargs)
    out, lse = torch_sparse_mla.sparse_mla_decode(**kwargs)
    assert out.dtype == spec.dtype and out.shape == (spec.T, spec.H, spec.head_dim_v)
    assert lse.dtype == torch.float32 and lse.shape == (spec.T, spec.H)
    assert_matches(out, lse, ref_out, ref_lse, tensor_cores=False)


def test_out_overload_writes_every_element():
    kwargs = make_inputs(Spec(kv_format="fp8_584", T=3, H=20, K=16, lengths=True, empty_row=True, sink="inf"))
    out, lse = _outputs_like(kwargs)
    out_t = poison(torch.empty(3, 512, 20, dtype=torch.bfloat16)).transpose(1, 2)  # a strided buffer
    got = torch_sparse_mla.sparse_mla_decode(**kwargs, out=(out_t, lse))
    assert got[0] is out_t and got[1] is lse
    assert_matches(out_t, lse, *reference(**kwargs), tensor_cores=False)


def test_duplicates_count_separately():
    spec = Spec(kv_format="auto", T=1, H=1, K=3, dim=64, head_dim_v=64, pool=2)
    kwargs = make_inputs(spec)
    a, b = kwargs["indices"][0, 0].item(), kwargs["indices"][0, 1].item()
    kwargs["indices"] = torch.tensor([[a, a, b]], dtype=torch.int32)
    out, lse = torch_sparse_mla.sparse_mla_decode(**kwargs)
    k = fr.dequantize(kwargs["kv_cache"], [a, b], "auto")
    s = kwargs["softmax_scale"] * (kwargs["q"][0, 0].double() @ k.T)
    expected_lse = torch.logsumexp(torch.stack([s[0], s[0], s[1]]), 0)
    assert abs(lse.item() - expected_lse.item()) < 1e-4


def test_sink_limits():
    """+inf sink: zeros; -inf sink: identical to no sink; lse never includes the sink."""
    kwargs = make_inputs(Spec(kv_format="fp8_656", T=2, H=3, K=8))
    base_out, base_lse = torch_sparse_mla.sparse_mla_decode(**kwargs)
    sink = torch.tensor([float("inf"), float("-inf"), 0.0])
    out, lse = torch_sparse_mla.sparse_mla_decode(**kwargs, attn_sink=sink)
    assert torch.equal(lse, base_lse)
    assert (out[:, 0] == 0).all()
    assert torch.equal(out[:, 1], base_out[:, 1])
    factor = torch.sigmoid(base_lse[:, 2].double())
    torch.testing.assert_close(out[:, 2].double(), base_out[:, 2].double() * factor[:, None], atol=1e-2, rtol=2**-7)


# Scales whose scores overflow float32 (|score| up to 1e302), reach its limit, or vanish: the weights
# must still be exp(score - max score), the lse saturates, and nothing is NaN (docs/sparse_mla.md).
_EXTREME_SCALES = {"1e38": 1e38, "-1e38": -1e38, "flt_max": FLT_MAX, "1e300": 1e300, "-1e300": -1e300,
                   "1e-40": 1e-40, "zero": 0.0, "-zero": -0.0}


def _assert_extreme_scale(out, lse, ref_out, ref_lse):
    out, lse = out.double(), lse.double()
    assert not out.isnan().any() and not lse.isnan().any()
    no_candidate = torch.isinf(ref_lse)
    assert torch.equal(torch.isposinf(lse), no_candidate), "lse = +inf only for the tokens without candidates"
    # the float32 dot products carry ~2^-20 of sum |q k|: relative to lse, at most ~1e-3 after cancellation
    torch.testing.assert_close(lse[~no_candidate], ref_lse[~no_candidate], rtol=2e-3, atol=1e-4)
    vmax = ref_out.abs().max().item()
    torch.testing.assert_close(out, ref_out, atol=2**-7 * vmax, rtol=2**-7)


@pytest.mark.parametrize("scale", list(_EXTREME_SCALES), ids=str)
def test_softmax_scale_extremes(scale):
    spec = Spec(kv_format="fp8_584", T=3, H=16, K=32, K2=8, lengths=True, sink="finite", empty_row=True,
                scale=_EXTREME_SCALES[scale])
    kwargs = make_inputs(spec)
    _assert_extreme_scale(*torch_sparse_mla.sparse_mla_decode(**kwargs), *reference(**kwargs))


def test_scores_that_all_underflow_are_candidates():
    """Every score of a token is below -FLT_MAX: the token still has candidates (finite lse, the
    weights of its best entries), unlike a token whose list is empty."""
    kwargs = make_inputs(Spec(kv_format="auto", T=2, H=2, K=4, dim=64, head_dim_v=64, empty_row=True, scale=1e38))
    kwargs["q"] = -kwargs["q"].abs()
    kwargs["kv_cache"] = kwargs["kv_cache"].abs()  # every dot product is negative: scores < -1e38
    out, lse = torch_sparse_mla.sparse_mla_decode(**kwargs)
    assert torch.isposinf(lse[0]).all() and (out[0] == 0).all()  # the empty row
    assert (lse[1] == -FLT_MAX).all() and (out[1] != 0).any()
    _assert_extreme_scale(out, lse, *reference(**kwargs))


def test_empty_batch():
    kwargs = make_inputs(Spec(kv_format="fp8_656", T=0, H=16, K=4))
    out, lse = torch_sparse_mla.sparse_mla_decode(**kwargs)
    assert out.shape == (0, 16, 512) and lse.shape == (0, 16)


def _large_tile_case(dtype, huge: float):
    """fp8_584 tiles far from the other rows' magnitudes: two pool rows hold one 64-dim tile of largest
    magnitude ``huge`` and ``huge / 3`` (UE8M0 tile scales far above the other rows' 2^-7 to 2^-5). The
    query is zero on that tile, so the scores stay ordinary and only the values carry it. Returns the
    inputs and the reference."""
    spec = Spec(kv_format="fp8_584", T=3, H=20, K=96, K2=24, dtype=dtype, lengths=True, sink="finite",
                huge_tile=huge, extra_page_pad=16)
    kwargs = make_inputs(spec)
    ref_out, ref_lse = reference(**kwargs)
    tile, rest = ref_out[..., 384:448].abs().max(), ref_out[..., :384].abs().max()
    assert tile > 10 * rest, (tile, rest)  # the large rows carry weight in the outputs
    return kwargs, ref_out, ref_lse


def _assert_tile_ranges(out, lse, ref_out, ref_lse, *, tensor_cores: bool):
    """:func:`assert_matches` on each range of output dims at its own magnitude."""
    for dims in (slice(0, 384), slice(384, 448), slice(448, 512)):
        assert_matches(out[..., dims], lse, ref_out[..., dims], ref_lse, tensor_cores=tensor_cores)


def test_fp8_584_large_tile_scales():
    """The CPU kernel with UE8M0 tile scales up to 2^18 (:func:`_large_tile_case`)."""
    kwargs, ref_out, ref_lse = _large_tile_case(torch.bfloat16, 1e8)
    out, lse = torch_sparse_mla.sparse_mla_decode(**kwargs)
    _assert_tile_ranges(out, lse, ref_out, ref_lse, tensor_cores=False)


def test_e4m3_to_float32_every_byte():
    """The CPU kernels' e4m3fn decoder (integer and float16 operations) gives PyTorch's conversion for
    each of the 256 bytes: the same values and signs of zero, NaN for 0x7F and 0xFF, on strided input
    too; no NaN where none of the bytes is a NaN code."""
    every = torch.arange(256, dtype=torch.uint8)
    want = every.view(torch.float8_e4m3fn).to(torch.float32)
    got = e4m3_to_float32(every)
    assert got.dtype == torch.float32 and got.shape == (256,)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and int(torch.isnan(got).sum()) == 2
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite], want[finite]) and torch.equal(got[finite].signbit(), want[finite].signbit())
    strided = torch.randint(0, 256, (9, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))[:, 3:35:2]
    want = strided.view(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(e4m3_to_float32(strided).nan_to_num(1.0), want.nan_to_num(1.0))
    assert not e4m3_to_float32(every[every % 128 != 127]).isnan().any()
    assert e4m3_to_float32(every[:0]).shape == (0,)


def test_dequantize_torch_matches_reference():
    for kv_format in fr.FORMATS:
        kwargs = make_inputs(Spec(kv_format=kv_format, T=2, K=9, page_pad=3, bad_indices=True))
        cache, idx = kwargs["kv_cache"], kwargs["indices"]
        got = dequantize_torch(cache, idx, kv_format)
        num_slots = cache.shape[0] * cache.shape[1]
        for t in range(2):
            for j in range(9):
                s = int(idx[t, j])
                want = fr.read_slot(cache, s, kv_format).float() if 0 <= s < num_slots else torch.zeros(got.shape[-1])
                assert torch.equal(got[t, j], want), (kv_format, t, j)


# =====================================================================================================
# Triton interpreter parity (CPU tensors through the Triton interpreter; fp16: bf16 dots are wrong there)
# =====================================================================================================

_INTERP = [
    (Spec(kv_format=f, T=2, H=16, K=40, dtype=torch.float16), None) for f in fr.FORMATS
] + [
    (Spec(kv_format=f, T=3, H=20, K=70, K2=40, dtype=torch.float16, lengths=True, sink="inf", bad_indices=True,
          empty_row=True, page_pad=5, noncontig_q=True), 3)
    for f in fr.FORMATS
] + [
    (Spec(kv_format="fp8_656", T=1, H=128, K=64, dtype=torch.float16, sink="finite"), None),
    (Spec(kv_format="fp8_584", T=1, H=80, K=200, K2=64, dtype=torch.float16, lengths=True), 4),
    (Spec(kv_format="auto", T=2, H=1, K=1, dtype=torch.float16), None),
    (Spec(kv_format="auto", T=2, H=3, K=20, dim=96, head_dim_v=64, K2=5, dtype=torch.float16), 2),
    (Spec(kv_format="fp8_656", T=2, H=16, K=64, dtype=torch.float16, head_dim_v=448), None),
    (Spec(kv_format="fp8_584", T=2, H=16, K=64, dtype=torch.float16, head_dim_v=256, scale=0.3), None),
    # more splits than the combine loads at once (16), some of them without a candidate, and output dims
    # that end inside the combine's last 64-dim tile
    (Spec(kv_format="auto", T=2, H=5, K=100, dim=96, head_dim_v=80, dtype=torch.float16, lengths=True,
          sink="finite", empty_row=True), 19),
]


def _rounds_k(spec: Spec) -> bool:
    return spec.kv_format == "fp8_656" and spec.head_dim_v != 512


def expected(spec: Spec, kwargs: dict):
    """The reference of a Triton (interpreter or CUDA) call: where the kernel's generic fp8_656 path
    rounds the dequantised K to the query dtype for the scores, so does the reference (a score then
    differs from the exact one by up to ~2^-9 of ``scale * sum |q k|``, found 0.08 off in an lse)."""
    return reference(**kwargs, score_k_dtype=kwargs["q"].dtype if _rounds_k(spec) else None)


@requires_interpreter
@pytest.mark.parametrize("spec,num_splits", _INTERP, ids=lambda x: str(x) if isinstance(x, Spec) else f"splits{x}")
def test_triton_interpreter_parity(spec, num_splits):
    kwargs = make_inputs(spec)
    out, lse = _outputs_like(kwargs)
    mla_ops.sparse_mla_decode_triton(*_positional(kwargs), out=out, lse=lse, num_splits=num_splits)
    assert_matches(out, lse, *expected(spec, kwargs), tensor_cores=True)


@requires_interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # float32 products overflow on purpose
@pytest.mark.filterwarnings("error:invalid value encountered:RuntimeWarning")  # a NaN made anywhere, even if unused
@pytest.mark.parametrize("scale", ["1e38", "-1e300", "zero"], ids=str)
@pytest.mark.parametrize("num_splits", [1, 2], ids=lambda s: f"splits{s}")
def test_triton_interpreter_softmax_scale_extremes(scale, num_splits):
    spec = Spec(kv_format="fp8_656", T=2, H=16, K=40, K2=8, dtype=torch.float16, lengths=True, sink="finite",
                empty_row=True, scale=_EXTREME_SCALES[scale])
    kwargs = make_inputs(spec)
    out, lse = _outputs_like(kwargs)
    mla_ops.sparse_mla_decode_triton(*_positional(kwargs), out=out, lse=lse, num_splits=num_splits)
    _assert_extreme_scale(out, lse, *reference(**kwargs))


@requires_interpreter
def test_triton_interpreter_fp8_584_large_tile_scales():
    """The portable kernel with large UE8M0 tile scales (:func:`_large_tile_case`), in float16, whose
    range ends at 65504: tiles of magnitude 5e4 (scale 2^7)."""
    kwargs, ref_out, ref_lse = _large_tile_case(torch.float16, 5e4)
    out, lse = _outputs_like(kwargs)
    mla_ops.sparse_mla_decode_triton(*_positional(kwargs), out=out, lse=lse)
    _assert_tile_ranges(out, lse, ref_out, ref_lse, tensor_cores=True)


def _past_fp16_case(kv_format: str):
    """A float16 query over a cache whose slot 0 holds finite values past float16's range (1e5) in its
    last 64 value dims (and, for fp8_656, its bf16 rope dims), which the query weighs at -0.5 so that
    the slot's probability is 0 for every head: the output is slot 1's V row. Returns the inputs and
    the reference."""
    gen = torch.Generator().manual_seed(5)
    dim = 512 if kv_format == "fp8_584" else 576
    cache = fr.make_cache(1, 2, kv_format)
    values = torch.randn(2, dim, generator=gen) * 0.5
    values[0, 448:] = 1e5
    fr.fill_cache(cache, [0, 1], values, kv_format)
    q = torch.randn(2, 3, dim, generator=gen) * 0.01
    q[..., 448:] = -0.5
    kwargs = dict(q=q.half(), kv_cache=cache, indices=torch.tensor([[0, 1], [1, 0]], dtype=torch.int32),
                  softmax_scale=0.04, kv_format=kv_format, head_dim_v=512)
    ref_out, ref_lse = reference(**kwargs)
    assert ref_out.abs().max() < 4 and ref_lse.isfinite().all()
    return kwargs, ref_out, ref_lse


@pytest.mark.parametrize("kv_format", ["fp8_584", "fp8_656"])
def test_fp16_query_values_past_fp16_range(kv_format):
    """The CPU kernel computes in float32: cache values past float16's range are no problem."""
    kwargs, ref_out, ref_lse = _past_fp16_case(kv_format)
    assert_matches(*torch_sparse_mla.sparse_mla_decode(**kwargs), ref_out, ref_lse, tensor_cores=False)


@requires_interpreter
@pytest.mark.parametrize("kv_format", ["fp8_584", "fp8_656"])
def test_triton_interpreter_fp16_query_values_past_fp16_range(kv_format):
    """The portable kernel clamps dequantised values to float16's range before its float16 products:
    an infinite V times the slot's zero probability gave NaN in every output row."""
    kwargs, ref_out, ref_lse = _past_fp16_case(kv_format)
    out, lse = _outputs_like(kwargs)
    mla_ops.sparse_mla_decode_triton(*_positional(kwargs), out=out, lse=lse)
    assert_matches(out, lse, ref_out, ref_lse, tensor_cores=True)


@requires_interpreter
def test_triton_interpreter_small_tiles_large_dims():
    """The tiles the launcher picks for large head dims (16 heads x 16 keys per program, four head
    blocks) on a D = 1024 cache whose V part is 320 dims (a 704-dim tail piece)."""
    plan = mla_ops.plan_launch(200, 64, 256, 132, dim=2048, head_dim_v=512)
    assert (plan.block_h, plan.block_n, plan.head_blocks) == (16, 16, 4)
    spec = Spec(kv_format="auto", T=2, H=40, K=24, dim=1024, head_dim_v=320, dtype=torch.float16, lengths=True,
                sink="finite", pool=32)
    kwargs = make_inputs(spec)
    out, lse = _outputs_like(kwargs)
    mla_ops.sparse_mla_decode_triton(*_positional(kwargs), out=out, lse=lse, config=dict(block_h=16, block_n=16))
    assert_matches(out, lse, *reference(**kwargs), tensor_cores=True)


def test_plan_fits_shared_memory():
    """Tiles from the head dims: the model shapes keep 64 x 64; larger D shrinks the tiles until the
    estimate fits 227 KB; past what 16 x 16 tiles allow the launcher refuses."""
    assert mla_ops.plan_launch(200, 64, 2048, 132) == mla_ops.plan_launch(200, 64, 2048, 132, dim=576, head_dim_v=512)
    assert (mla_ops.plan_launch(200, 64, 2048, 132).block_h, mla_ops.plan_launch(200, 64, 2048, 132).block_n) == (64, 64)
    for dim in (512, 576, 768, 1024, 1536, 2048):
        for dv in (64, 512, dim):
            for t, h in ((200, 64), (2, 128), (1, 16)):
                plan = mla_ops.plan_launch(t, h, 512, 132, dim=dim, head_dim_v=dv)
                assert mla_ops.shared_bytes_estimate(plan.block_h, plan.block_n, dim, dv) <= 232_448
                assert plan.head_blocks * plan.block_h >= h
    with pytest.raises(ValueError, match=r"needs \d+ bytes of shared memory per block even with 16 x 16 tiles"):
        mla_ops.plan_launch(1, 16, 64, 132, dim=2048, head_dim_v=1025, shared_bytes=101_376)


def test_plan_fits_compiled_shared_memory():
    """With the compiled size of each plan's kernel (``compiled_build``, what the launcher passes on a
    GPU), a plan whose build does not fit the GPU takes one stage, then smaller tiles in the planner's
    order (``block_n`` first), until one fits; a build that fits is kept as the estimate chose it, and
    none fitting is a ValueError naming the compiled size."""
    def planned(build, limit, **kw):
        seen = []

        def compiled_build(plan):
            seen.append((plan.block_h, plan.block_n, plan.num_stages))
            return build(plan), 0
        plan = mla_ops.plan_launch(200, 64, 2048, 132, dim=512, head_dim_v=512, shared_bytes=limit,
                                   compiled_build=compiled_build, **kw)
        return plan, seen

    # an sm_80 build of the DeepSeek-V4 format: 180,736 / 180,224 bytes at 64 x 64, 123,136 at 64 x 32
    sizes = {(64, 64, 2): 180_736, (64, 64, 1): 180_224, (64, 32, 2): 123_136}
    plan, seen = planned(lambda p: sizes[(p.block_h, p.block_n, p.num_stages)], 166_912)
    assert seen == [(64, 64, 2), (64, 64, 1), (64, 32, 2)]
    assert (plan.block_h, plan.block_n, plan.num_stages, plan.head_blocks, plan.num_splits) == (64, 32, 2, 1, 1)
    # one stage is enough
    plan, seen = planned(lambda p: 150_000 if p.num_stages == 1 else 170_000, 166_912)
    assert (plan.block_h, plan.block_n, plan.num_stages) == (64, 64, 1) and len(seen) == 2
    # a build that fits keeps the estimate's plan (the one planned without compiling)
    plan, seen = planned(lambda p: 100_000, 232_448)
    assert plan == mla_ops.plan_launch(200, 64, 2048, 132, dim=512, head_dim_v=512) and seen == [(64, 64, 2)]
    # block_h halves once block_n is 16; the given split count stays
    plan, _ = planned(lambda p: 60_000 if p.block_h == 32 else 70_000, 65_536, num_splits=3)
    assert (plan.block_h, plan.block_n, plan.head_blocks, plan.num_splits) == (32, 16, 2, 3)
    with pytest.raises(ValueError, match=r"needs 70000 bytes of shared memory per block even with 16 x 16 tiles"):
        planned(lambda p: 70_000, 65_536)
    # where the estimate does not bound the build (GPUs other than sm_90), the tiles it rejects are
    # compiled too: an sm_86 build of the DeepSeek-V3.2 tiles, 90,624 bytes where the estimate says 151,552
    plan, seen = planned(lambda p: 90_624, 101_376, trust_estimate=False)
    assert (plan.block_h, plan.block_n) == (64, 64) and seen == [(64, 64, 2)]
    plan, seen = planned(lambda p: 90_624, 101_376)
    assert seen[0][:2] != (64, 64) and mla_ops.shared_bytes_estimate(*seen[0][:2], 512, 512) <= 101_376
    plan, seen = planned(lambda p: 50_000 if p.block_h == 16 else 90_000, 60_000, trust_estimate=False)
    assert (plan.block_h, plan.block_n, plan.num_stages) == (16, 16, 2)
    assert seen[::2] == [(64, 64, 2), (64, 32, 2), (64, 16, 2), (32, 16, 2), (16, 16, 2)], seen


def test_plan_fits_compiled_tensor_memory():
    """A build whose accumulators need more tensor memory than sm_100 and sm_103 have (Triton builds it
    as a kernel that only traps: the DeepSeek-V4 format at 64 heads, 544 of 512 columns) takes half the
    heads per program before anything else, keeping its 64-entry blocks; at 16 x 16 tiles it is a
    ValueError naming the columns."""
    limit = mla_ops.TENSOR_MEMORY_COLUMNS
    seen = []

    def compiled_build(plan):
        seen.append((plan.block_h, plan.block_n, plan.num_stages))
        return 147_968, (limit + 32 if plan.block_h == 64 else 0)
    plan = mla_ops.plan_launch(132, 64, 2048, 148, dim=512, head_dim_v=512, shared_bytes=232_448,
                               compiled_build=compiled_build, trust_estimate=False)
    assert seen == [(64, 64, 2), (32, 64, 2)], seen  # the stages are not retried: they do not hold it
    assert (plan.block_h, plan.block_n, plan.num_stages, plan.head_blocks) == (32, 64, 2, 2)
    with pytest.raises(ValueError, match=rf"needs {limit + 1} columns of tensor memory per block even with 16 x 16"):
        mla_ops.plan_launch(132, 64, 2048, 148, dim=512, head_dim_v=512, shared_bytes=232_448,
                            compiled_build=lambda p: (1_000, limit + 1), trust_estimate=False)


@requires_interpreter
def test_config_past_tensor_memory_is_refused(monkeypatch):
    """Tiles a ``config`` sets are taken as given, but where their build needs more tensor memory than
    the GPU has (a kernel that would only trap, ``TENSOR_MEMORY_COLUMNS``) the launcher raises a
    ValueError before launching anything."""
    monkeypatch.setattr(mla_ops, "fit_by_compiling", lambda device: True)
    monkeypatch.setattr(mla_ops, "_PLANS", type(mla_ops._PLANS)())
    monkeypatch.setattr(mla_ops.KernelLaunch, "build_resources",
                        lambda self, *tensors: (1_000, 544 if self.meta["BLOCK_H"] == 64 else 0))
    kwargs = make_inputs(Spec(kv_format="fp8_584", T=1, H=64, K=16))
    out, lse = _outputs_like(kwargs)
    with pytest.raises(ValueError, match=r"config: 64 x 32 tiles need 544 columns of tensor memory; this GPU has 512"):
        mla_ops.sparse_mla_decode_triton(*_positional(kwargs), out=out, lse=lse, path="portable",
                                         config=dict(block_n=32))
    assert not mla_ops._PLANS


@pytest.mark.parametrize("capability, maxnreg", [((8, 0), 255), ((9, 0), 255), ((8, 6), None), ((8, 9), None),
                                                   ((12, 0), None), (None, None)])
def test_decode_register_bound_by_capability(capability, maxnreg, monkeypatch):
    """The portable decode launch asks ptxas for its register bound (Triton's ``maxnreg``) on an A100
    and on sm_90, and leaves the choice to ptxas on other NVIDIA GPUs and where Triton's NVIDIA backend
    does not build the kernel (capability None: AMD GPUs, the interpreter), whose options have no
    ``maxnreg``."""
    monkeypatch.setattr(mla_ops, "nvidia_capability", lambda device: capability)
    t, h, k = 2, 16, 64
    q = torch.zeros(t, h, 576, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    indices = torch.zeros(t, k, dtype=torch.int32)
    out, lse = torch.empty(t, h, 512, dtype=torch.bfloat16), torch.empty(t, h)
    plan = mla_ops.plan_launch(t, h, k, 132)
    _, main, _ = mla_ops._make_launches(q, cache, indices, 0.1, "auto", 512, None, None, None, None, None, out, lse,
                                         plan)
    assert main.options.get("maxnreg") == maxnreg


@requires_interpreter
@pytest.mark.parametrize("kv_format", fr.FORMATS)
def test_triton_interpreter_block_n_64(kv_format):
    """The 64-entry blocks the launcher picks when the grid is full (T * head blocks >= SMs)."""
    assert mla_ops.plan_launch(160, 64, 200, 132).block_n == 64
    spec = Spec(kv_format=kv_format, T=2, H=20, K=100, K2=40, dtype=torch.float16, lengths=True, sink="finite")
    kwargs = make_inputs(spec)
    out, lse = _outputs_like(kwargs)
    mla_ops.sparse_mla_decode_triton(*_positional(kwargs), out=out, lse=lse, config=dict(block_n=64))
    assert_matches(out, lse, *expected(spec, kwargs), tensor_cores=True)


@requires_interpreter
def test_triton_interpreter_split_heuristic():
    """T * head blocks far below the SM count: the launcher splits the list (and still matches)."""
    spec = Spec(kv_format="fp8_584", T=1, H=16, K=1024, dtype=torch.float16, lengths=True)
    plan = mla_ops.plan_launch(1, 16, 1024, 132)
    assert plan.num_splits > 1
    kwargs = make_inputs(spec)
    out, lse = _outputs_like(kwargs)
    mla_ops.sparse_mla_decode_triton(*_positional(kwargs), out=out, lse=lse)
    assert_matches(out, lse, *reference(**kwargs), tensor_cores=True)


@requires_interpreter
def test_triton_interpreter_recorded_split_launches():
    """The ``out`` implementation registered for CUDA, through the interpreter: the first call of a
    split signature records the decode and combine launches and the workspace's size; later calls of
    the signature (new values) replay them, each with a workspace of its own, and match the reference."""
    from torch_sparse_mla import _library

    impl = _library.IMPLS["sparse_mla_decode.out", "CUDA"]
    spec = Spec(kv_format="fp8_584", T=1, H=16, K=256, dtype=torch.float16, lengths=True, sink="finite")
    for seed in (1, 2, 3):
        kwargs = make_inputs(spec, seed=0, value_seed=seed)
        assert mla_ops.plan_launch(1, 16, 256, 4, dim=512, head_dim_v=512).num_splits > 1  # 4 SMs off CUDA
        out, lse = _outputs_like(kwargs)
        impl(*_positional(kwargs), out=out, lse=lse)
        assert_matches(out, lse, *reference(**kwargs), tensor_cores=True)
    assert records_split_launches(impl)


@requires_interpreter
@pytest.mark.parametrize("fan_out,steps", [(True, False), (True, True), (False, False)],
                         ids=["fan-out", "fan-out-steps", "per-split"])
def test_triton_interpreter_both_combines(monkeypatch, fan_out, steps):
    """Either combine kernel merges the same partials into the reference's result: 9 splits, some
    without a candidate, a sink, lengths, an empty row. The fan-out combine loads them in one round
    (9 <= its 32 splits per load) or, with 4 splits per load forced, in three steps after a pass for
    the maximum."""
    monkeypatch.setattr(mla_ops, "combine_fans_out", lambda *args: fan_out)
    if steps:
        monkeypatch.setattr(mla_ops, "combine_blocks", lambda splits, heads, dv_pad: (4, 16, 64))
    mla_ops._PLANS.clear()
    spec = Spec(kv_format="fp8_656", T=2, H=20, K=70, K2=40, dtype=torch.float16, lengths=True, sink="finite",
                empty_row=True, bad_indices=True)
    kwargs = make_inputs(spec)
    out, lse = _outputs_like(kwargs)
    mla_ops.sparse_mla_decode_triton(*_positional(kwargs), out=out, lse=lse, num_splits=9)
    (_, _, combine), = mla_ops._PLANS.values()
    mla_ops._PLANS.clear()
    want = mla_ops._sparse_mla_combine_fanout_kernel if fan_out else mla_ops._sparse_mla_combine_kernel
    assert combine.kernel is want
    if fan_out:
        assert combine.meta["ONE_STEP"] is not steps
    assert_matches(out, lse, *reference(**kwargs), tensor_cores=True)


@pytest.mark.parametrize("tokens,heads,splits,fans_out", [
    (1, 128, 16, True),  # measured: 23.7 against 28.1 µs (per-split: 8 programs, 16 loads each in turn)
    (2, 64, 16, True),
    (4, 128, 16, False),  # measured: 33.4 against 32.7 µs
    (8, 64, 5, False),  # measured: 27.5 against 22.6 µs
    (32, 64, 4, False),  # measured: 38.4 against 29.1 µs
    (1, 16, 4, False),  # few splits: a short chain of loads
])
def test_combine_choice(tokens, heads, splits, fans_out):
    """The fan-out combine runs only where it measured faster on an H200 (docs/sparse_mla.md)."""
    assert mla_ops.combine_fans_out(tokens, heads, splits) is fans_out


@pytest.mark.parametrize("tokens,heads,k,splits", [
    (1, 128, 2048, 32),  # 2 x 32 = 64 CTAs of one block each (23.2 µs; 16 splits of 2 blocks: 23.5)
    (2, 128, 2048, 16),  # 4 x 32 = 128 > 64: splits of 2 blocks (25.6 µs; 32 of one block: 29.2)
    (1, 64, 640, 10),  # fp8_584 T=1: 10 CTAs of one block (17.9 µs; 5 of two blocks: 20.5)
    (4, 64, 640, 10),  # 40 CTAs (20.9 µs; 5 splits: 22.4)
    (8, 64, 640, 5),  # 80 > 64: two blocks per split (22.8 µs; 10 of one block: 23.4)
    (4, 128, 2048, 16),  # 8 * 16 = 128 CTAs <= 132 SMs
    (16, 128, 2048, 4),  # 32 * 4 = 128: not 5 (a second, partial wave)
    (64, 128, 2048, 1),  # 128 CTAs already: no split
    (64, 16, 2048, 2),
    (200, 128, 2048, 1),
    (1, 128, 64, 1),  # one block: nothing to split
])
def test_hopper_split_heuristic(tokens, heads, k, splits):
    """The Hopper kernel's split count keeps one wave of CTAs and two blocks per split, or one block
    per split where that makes at most 64 CTAs (measured on an H200, docs/sparse_mla_hopper.md)."""
    from torch_sparse_mla.ops import sparse_mla_hopper as hopper

    plan = hopper.plan_launch(tokens, heads, k, 132)
    assert plan.num_splits == splits
    assert hopper.plan_launch(tokens, heads, k, 32).num_splits <= max(32 // plan.head_blocks // tokens, 1)
    assert tokens * plan.head_blocks * plan.num_splits <= 132 or plan.num_splits == 1
    assert hopper.plan_launch(tokens, heads, k, 132, num_splits=3).num_splits == 3


@pytest.mark.parametrize("heads,block_h", [(1, 16), (16, 16), (17, 32), (20, 32), (32, 32), (33, 64), (64, 64),
                                           (128, 64)])
def test_hopper_plan_few_heads(heads, block_h):
    """At most 32 heads take the few-heads Hopper kernel (16 or 32 heads per CTA, transposed products);
    ``config`` overrides must name a kernel that exists."""
    from torch_sparse_mla.ops import sparse_mla_hopper as hopper

    plan = hopper.plan_launch(8, heads, 2048, 132)
    assert (plan.block_h, plan.transposed) == (block_h, block_h < 64)
    assert plan.head_blocks == -(-heads // block_h)
    hopper.check_plan(plan)
    if plan.transposed:
        hopper.check_plan(dataclasses.replace(plan, transposed=False, block_h=64))  # the 64-head kernel
        with pytest.raises(ValueError, match="takes block_h 64"):
            hopper.check_plan(dataclasses.replace(plan, transposed=False))
    with pytest.raises(ValueError, match="few-heads Hopper kernel takes block_h 16 or 32"):
        hopper.check_plan(dataclasses.replace(plan, transposed=True, block_h=64))


@pytest.mark.parametrize("kv_format,heads,config,kernel", [
    ("fp8_656", 16, None, "_sparse_mla_decode_hopper_t_kernel"),
    ("fp8_656", 20, None, "_sparse_mla_decode_hopper_t_kernel"),
    ("fp8_584", 16, None, "_sparse_mla_decode_hopper_t_kernel"),
    ("fp8_584", 32, None, "_sparse_mla_decode_hopper_t_kernel"),
    ("auto", 32, None, "_sparse_mla_decode_hopper_t_kernel"),
    ("fp8_656", 128, None, "_sparse_mla_decode_hopper_kernel"),
    ("fp8_584", 64, None, "_sparse_mla_decode_hopper_kernel"),
    ("auto", 64, None, "_sparse_mla_decode_hopper_kernel"),
    ("fp8_584", 16, dict(transposed=False, block_h=64), "_sparse_mla_decode_hopper_kernel"),
    ("fp8_656", 40, dict(transposed=True, block_h=16), "_sparse_mla_decode_hopper_t_kernel"),
])
def test_hopper_launch_picks_kernel(kv_format, heads, config, kernel):
    """Without a GPU: each plan names the kernel meant for it, and the launch's run-time arguments and
    constexprs are exactly that kernel's parameters (``KernelLaunch`` checks them when it is built)."""
    from torch_sparse_mla.ops import sparse_mla_hopper as hopper

    require_gluon(hopper)
    spec = Spec(kv_format=kv_format, T=3, H=heads, K=200, K2=48 if kv_format == "fp8_584" else 0, lengths=True,
                sink="finite", page_pad=32, extra_page_pad=16)
    kwargs = make_inputs(spec)
    out, lse = _outputs_like(kwargs, "cpu")
    plan = hopper.plan_launch(3, heads, 200, 132, num_splits=3).with_overrides(config)
    plan = dataclasses.replace(plan, head_blocks=-(-heads // plan.block_h))
    _, main, combine = mla_ops._make_hopper_launches(
        kwargs["q"], kwargs["kv_cache"], kwargs["indices"], kwargs["softmax_scale"], kv_format, kwargs["topk_length"],
        kwargs["attn_sink"], kwargs.get("extra_kv_cache"), kwargs.get("extra_indices"),
        kwargs.get("extra_topk_length"), out, lse, plan)
    assert main.kernel.__name__ == kernel
    assert main.grid[0] == 3 * 3 * plan.head_blocks and combine is not None


@requires_interpreter
@pytest.mark.parametrize("kv_format", fr.FORMATS)
def test_load_kv_tile_interpreter(kv_format):
    import triton
    import triton.language as tl

    @triton.jit
    def tile_kernel(cache_ptr, stride_page, stride_row, page_size, num_slots, slots_ptr, out_ptr, stride_out,
                    N: tl.constexpr, COL0: tl.constexpr, CHUNK: tl.constexpr, KV_FORMAT: tl.constexpr):
        rows = tl.arange(0, N)
        slots = tl.load(slots_ptr + rows).to(tl.int64)
        valid = (slots >= 0) & (slots < num_slots)
        vals = load_kv_tile(cache_ptr, stride_page, stride_row, page_size, slots, valid, COL0, CHUNK, KV_FORMAT)
        cols = COL0 + tl.arange(0, CHUNK)
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], vals)

    kwargs = make_inputs(Spec(kv_format=kv_format, T=1, K=16, page_pad=3, bad_indices=True, dtype=torch.float16))
    cache, slots = kwargs["kv_cache"], kwargs["indices"][0]
    dim = fr.DIM.get(kv_format, 576)
    want = dequantize_torch(cache, slots, kv_format)
    pieces = [(0, 128), (128, 256), (384, 128), (448, 64), (512, 64), (0, 512)]
    if kv_format == "fp8_584":
        pieces.append((384, 256))  # crosses the fp8 / bf16 boundary and D
    for col0, chunk in pieces:
        if col0 + chunk > dim and kv_format == "auto" or col0 >= dim:
            continue
        got = torch.full((16, col0 + chunk), float("nan"))
        tile_kernel[(1,)](cache, cache.stride(0), cache.stride(1), cache.shape[1], cache.shape[0] * cache.shape[1],
                          slots, got, got.stride(0), N=16, COL0=col0, CHUNK=chunk, KV_FORMAT=FORMAT_IDS[kv_format])
        end = min(col0 + chunk, dim)
        assert torch.equal(got[:, col0:end], want[:, col0:end]), (col0, chunk)
        assert (got[:, end:] == 0).all()


# =====================================================================================================
# opcheck
# =====================================================================================================


def _opcheck_kwargs(device="cpu"):
    return _to_device(make_inputs(Spec(kv_format="fp8_656", T=3, H=4, K=8, K2=4, lengths=True, sink="finite")),
                      device)


def test_opcheck_functional():
    args = _positional(_opcheck_kwargs())
    torch.library.opcheck(_ops.sparse_mla_decode.default, args)


def test_opcheck_out():
    kwargs = _opcheck_kwargs()
    out, lse = _outputs_like(kwargs)
    torch.library.opcheck(_ops.sparse_mla_decode.out, _positional(kwargs), {"out": out, "lse": lse})


# =====================================================================================================
# torch.compile: one frame across batch sizes, functional and out overloads
# =====================================================================================================


def test_compile_no_recompiles():
    def step(q, kv_cache, indices, topk_length, attn_sink):
        out, lse = torch_sparse_mla.sparse_mla_decode(q, kv_cache, indices, softmax_scale=0.06, kv_format="fp8_584",
                                                      topk_length=topk_length, attn_sink=attn_sink)
        out2 = torch.empty_like(out)
        lse2 = torch.empty_like(lse)
        torch_sparse_mla.sparse_mla_decode(q, kv_cache, indices, softmax_scale=0.06, kv_format="fp8_584",
                                           topk_length=topk_length, attn_sink=attn_sink, out=(out2, lse2))
        return out, lse, out2, lse2

    arg_sets, refs = [], []
    for t in (2, 3, 5):
        kw = make_inputs(Spec(kv_format="fp8_584", T=t, H=8, K=12, lengths=True, sink="finite"), seed=t)
        arg_sets.append((kw["q"], kw["kv_cache"], kw["indices"], kw["topk_length"], kw["attn_sink"]))
        refs.append(reference(**kw))

    def check(args, result):
        ref_out, ref_lse = next(r for a, r in zip(arg_sets, refs) if a[0] is args[0])
        out, lse, out2, lse2 = result
        assert_matches(out, lse, ref_out, ref_lse, tensor_cores=False)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)

    assert_no_recompiles(step, arg_sets, check)


# =====================================================================================================
# Error messages
# =====================================================================================================


def _bad(**changes):
    """Valid keyword arguments of the public function, then ``changes`` (name -> function of them);
    ``out`` may be added (a function of the arguments and the valid ``(out, lse)`` buffers)."""

    def make():
        kwargs = make_inputs(Spec(kv_format="fp8_656", T=2, H=4, K=8))
        for name, fn in changes.items():
            kwargs[name] = fn(kwargs, _outputs_like(kwargs)) if name == "out" else fn(kwargs)
        return kwargs

    return make


_ERRORS = [
    ("q_dtype", _bad(q=lambda k: k["q"].float()), r"q: expected dtype bfloat16 or float16, got float32"),
    ("q_rank", _bad(q=lambda k: k["q"][0]), r"q: expected a 3-D tensor"),
    ("too_many_heads", _bad(q=lambda k: torch.zeros(2, 129, 576, dtype=torch.bfloat16)),
     r"q: expected 1 <= shape\[1\]"),
    ("q_dim", _bad(q=lambda k: k["q"][:, :, :512]),
     r"q: expected shape\[2\] == 576 \(values per slot of the fp8_656 kv_cache\)"),
    ("format", _bad(kv_format=lambda k: "fp8"), r"kv_format: expected one of"),
    ("cache_dtype", _bad(kv_cache=lambda k: k["kv_cache"].view(torch.int8)), r"kv_cache: expected dtype uint8"),
    ("cache_width", _bad(kv_cache=lambda k: k["kv_cache"][:, :, :584]), r"kv_cache: expected shape\[-1\] == 656"),
    ("auto_cache_dtype", _bad(kv_format=lambda k: "auto",
                              kv_cache=lambda k: torch.zeros(2, 4, 576, dtype=torch.float16)),
     r"kv_cache: expected dtype bfloat16"),
    ("auto_cache_stride", _bad(kv_format=lambda k: "auto",
                               kv_cache=lambda k: torch.zeros(2, 576, 4, dtype=torch.bfloat16).transpose(1, 2)),
     r"kv_cache: expected stride\(-1\) == 1"),
    ("pages_overlap", _bad(kv_cache=lambda k: torch.as_strided(k["kv_cache"], (4, 16, 656), (656, 656, 1))),
     r"kv_cache: expected stride\(0\) >= page_size \* 656"),
    ("indices_dtype", _bad(indices=lambda k: k["indices"].long()), r"indices: expected dtype int32, got int64"),
    ("indices_rows", _bad(indices=lambda k: k["indices"][:1]), r"indices: expected shape\[0\] == q.shape\[0\]"),
    ("indices_empty", _bad(indices=lambda k: k["indices"][:, :0]), r"indices: expected at least one column"),
    ("topk_length", _bad(topk_length=lambda k: torch.zeros(3, dtype=torch.int32)),
     r"topk_length: expected shape\[0\] == q.shape\[0\]"),
    ("sink_dtype", _bad(attn_sink=lambda k: torch.zeros(4, dtype=torch.bfloat16)),
     r"attn_sink: expected dtype float32"),
    ("sink_heads", _bad(attn_sink=lambda k: torch.zeros(5)), r"attn_sink: expected shape\[0\] == q.shape\[1\]"),
    ("head_dim_v", _bad(head_dim_v=lambda k: 600), r"head_dim_v: expected <= q.shape\[2\] \(576\), got 600"),
    ("extra_alone", _bad(extra_kv_cache=lambda k: k["kv_cache"]), r"extra_kv_cache / extra_indices: expected both"),
    ("extra_length_alone", _bad(extra_topk_length=lambda k: torch.zeros(2, dtype=torch.int32)),
     r"extra_topk_length: given without"),
    ("extra_format", _bad(extra_kv_cache=lambda k: torch.zeros(2, 4, 584, dtype=torch.uint8),
                          extra_indices=lambda k: k["indices"]), r"extra_kv_cache: expected shape\[-1\] == 656"),
    ("scale_nan", _bad(softmax_scale=lambda k: float("nan")), r"softmax_scale: expected a finite float, got nan"),
    ("scale_inf", _bad(softmax_scale=lambda k: float("-inf")), r"softmax_scale: expected a finite float, got -inf"),
    ("cache_view_too_small", _bad(kv_format=lambda k: "fp8_584", q=lambda k: k["q"][:, :, :512],
                                  kv_cache=lambda k: torch.as_strided(torch.zeros(8000, dtype=torch.uint8),
                                                                      (2, 4, 584), (2336, 100, 1))),
     r"kv_cache: expected a view that covers the fp8_584 layout of its pages \(2336 bytes"),
    ("out_dim", _bad(out=lambda k, o: (o[0][:, :, :256], o[1])), r"out: expected shape\[2\] == head_dim_v \(512\)"),
    ("out_dtype", _bad(out=lambda k, o: (o[0].half(), o[1])), r"out: expected dtype bfloat16, got float16"),
    ("lse_dtype", _bad(out=lambda k, o: (o[0], o[1].double())), r"lse: expected dtype float32, got float64"),
    ("lse_heads", _bad(out=lambda k, o: (o[0], o[1][:, :2])), r"lse: expected shape\[1\] == q.shape\[1\] \(4\)"),
    ("out_not_pair", _bad(out=lambda k, o: o[0]), r"out: expected a tuple of 2 tensors \(out, lse\), got Tensor"),
    ("out_aliases_q", _bad(out=lambda k, o: (k["q"][:, :, :512], o[1])),
     r"out: overlaps the memory of input q"),
    ("lse_aliases_out", _bad(out=lambda k, o: (o[0], o[0].view(torch.float32)[:, :, :4].select(2, 0))),
     r"out: overlaps the memory of output lse"),
]


@pytest.mark.parametrize("make,match", [(m, r) for _, m, r in _ERRORS], ids=[i for i, _, _ in _ERRORS])
def test_errors(make, match):
    with pytest.raises(ValueError, match=match):
        torch_sparse_mla.sparse_mla_decode(**make())


def test_cuda_head_dim_limit_in_fake():
    """D > 2048 is refused up front for CUDA tensors (the fake, so under torch.compile too), any D on CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 64, 4096, dtype=torch.bfloat16, device="cuda")
        cache = torch.empty(4, 16, 4096, dtype=torch.bfloat16, device="cuda")
        idx = torch.empty(2, 8, dtype=torch.int32, device="cuda")
        with pytest.raises(ValueError, match=r"q: expected shape\[2\] \(D\) <= 2048 on CUDA"):
            _ops.sparse_mla_decode(q, cache, idx, 0.1, "auto", 512)
        q = torch.empty(2, 64, 2048, dtype=torch.bfloat16, device="cuda")
        cache = torch.empty(4, 16, 2048, dtype=torch.bfloat16, device="cuda")
        out, lse = _ops.sparse_mla_decode(q, cache, idx, 0.1, "auto", 512)
        assert out.shape == (2, 64, 512) and lse.shape == (2, 64)
    kwargs = make_inputs(Spec(kv_format="auto", T=1, H=2, K=3, dim=2100, head_dim_v=64, pool=4))
    assert_matches(*torch_sparse_mla.sparse_mla_decode(**kwargs), *reference(**kwargs), tensor_cores=False)


# =====================================================================================================
# CUDA
# =====================================================================================================

_CUDA = [Spec(kv_format=f, T=t, H=h, K=k) for f in fr.FORMATS for t, h, k in
         [(2, 1, 1), (3, 20, 100), (4, 128, 2048), (40, 64, 300), (150, 16, 64)]] + [
    Spec(kv_format=f, T=5, H=20, K=70, K2=40, lengths=True, sink="inf", bad_indices=True, empty_row=True,
         page_pad=5, noncontig_q=True) for f in fr.FORMATS
] + [
    Spec(kv_format="fp8_656", T=4, H=128, K=512, dtype=torch.float16, sink="finite"),
    Spec(kv_format="auto", T=4, H=16, K=64, dtype=torch.float16, page_pad=7),
    Spec(kv_format="auto", T=3, H=8, K=20, dim=96, head_dim_v=64, K2=5),
    Spec(kv_format="fp8_584", T=2, H=80, K=128, K2=512, lengths=True, page_pad=64),
    Spec(kv_format="fp8_656", T=3, H=16, K=64, head_dim_v=448),
    Spec(kv_format="fp8_656", T=3, H=32, K=256, scale=0.3),
    # head dims past the model's: tiles chosen from D (D = 2048 at 64 heads ran out of shared memory)
    Spec(kv_format="auto", T=2, H=64, K=64, dim=2048, head_dim_v=512, lengths=True, sink="finite"),
    Spec(kv_format="auto", T=2, H=64, K=64, dim=1024, head_dim_v=1024),
    Spec(kv_format="auto", T=200, H=64, K=64, dim=2048, head_dim_v=2048, pool=32),
    Spec(kv_format="auto", T=2, H=128, K=64, dim=1536, head_dim_v=1025, dtype=torch.float16),
    # scores past float32 on the GPU kernel too (checked against the saturating reference)
    Spec(kv_format="fp8_584", T=3, H=16, K=64, K2=8, lengths=True, sink="finite", empty_row=True, scale=1e38),
]


@requires_cuda
@pytest.mark.parametrize("spec", _CUDA, ids=str)
def test_cuda_parity(spec):
    kwargs = make_inputs(spec)
    out, lse = _outputs_like(kwargs, "cuda")
    torch_sparse_mla.sparse_mla_decode(**_to_device(kwargs, "cuda"), out=(out, lse))
    if abs(spec.scale) > 1e30:
        _assert_extreme_scale(out.cpu(), lse.cpu(), *reference(**kwargs))
        return
    assert_matches(out, lse, *expected(spec, kwargs), tensor_cores=True)


@requires_cuda
def test_cuda_fp8_584_large_tile_scales():
    """The kernel the launcher picks (the Hopper one on sm_90) with UE8M0 tile scales up to 2^18
    (:func:`_large_tile_case`), with its own split plan and with one split."""
    kwargs, ref_out, ref_lse = _large_tile_case(torch.bfloat16, 1e8)
    dev = _to_device(kwargs, "cuda")
    for num_splits in (None, 1):
        out, lse = _outputs_like(kwargs, "cuda")
        mla_ops.sparse_mla_decode_triton(*_positional(dev), out=out, lse=lse, num_splits=num_splits)
        _assert_tile_ranges(out, lse, ref_out, ref_lse, tensor_cores=True)


@requires_cuda
@pytest.mark.parametrize("kv_format", ["fp8_584", "fp8_656"])
def test_cuda_portable_plan_fits_compiled_shared_memory(kv_format, monkeypatch):
    """On the GPU the portable launcher fits its tiles to the kernel compiled for it: with the estimate
    taken away and a shared-memory limit below what the 64 x 64 build needs, the plan is made by
    compiling (``KernelLaunch.build_resources``), its build fits the limit and its output is right."""
    limit = 60_000
    monkeypatch.setattr(mla_ops, "shared_bytes_estimate", lambda *args: 0)
    monkeypatch.setattr(mla_ops, "shared_memory_per_block", lambda device: limit)
    monkeypatch.setattr(mla_ops, "_PLANS", type(mla_ops._PLANS)())
    spec = Spec(kv_format=kv_format, T=2, H=64, K=96, dtype=torch.bfloat16, lengths=True, sink="finite")
    kwargs = make_inputs(spec)
    dev = _to_device(kwargs, "cuda")
    sizes = []
    build_resources = mla_ops.KernelLaunch.build_resources

    def record(self, *tensors):
        shared, columns = build_resources(self, *tensors)
        sizes.append(shared)
        return shared, columns
    monkeypatch.setattr(mla_ops.KernelLaunch, "build_resources", record)
    out, lse = _outputs_like(kwargs, "cuda")
    mla_ops.sparse_mla_decode_triton(*_positional(dev), out=out, lse=lse, path="portable")
    assert len(sizes) >= 2 and sizes[0] > limit >= sizes[-1], sizes
    assert_matches(out, lse, *reference(**kwargs), tensor_cores=True)


@requires_cuda
def test_cuda_portable_plan_halves_heads_past_tensor_memory(monkeypatch):
    """On the GPU, a build reported to need more tensor memory than sm_100 and sm_103 have (every build
    of 64 heads per program here, as for the DeepSeek-V4 format on those GPUs) is not launched: the
    launcher's fit plans 32 heads per program, whose output is right."""
    monkeypatch.setattr(mla_ops, "estimate_bounds_build", lambda device: False)
    monkeypatch.setattr(mla_ops, "_PLANS", type(mla_ops._PLANS)())
    spec = Spec(kv_format="fp8_584", T=2, H=64, K=96, dtype=torch.bfloat16, lengths=True, sink="finite")
    kwargs = make_inputs(spec)
    dev = _to_device(kwargs, "cuda")
    build_resources = mla_ops.KernelLaunch.build_resources
    heads = []

    def report(self, *tensors):
        shared, columns = build_resources(self, *tensors)
        heads.append(self.meta["BLOCK_H"])
        return shared, columns + (mla_ops.TENSOR_MEMORY_COLUMNS + 32 if self.meta["BLOCK_H"] == 64 else 0)
    monkeypatch.setattr(mla_ops.KernelLaunch, "build_resources", report)
    out, lse = _outputs_like(kwargs, "cuda")
    mla_ops.sparse_mla_decode_triton(*_positional(dev), out=out, lse=lse, path="portable")
    plan = next(iter(mla_ops._PLANS.values()))[1].meta["BLOCK_H"]
    assert heads[0] == 64 and heads[-1] == 32 and plan == 32, (heads, plan)
    assert_matches(out, lse, *reference(**kwargs), tensor_cores=True)


@requires_cuda
@pytest.mark.parametrize("kv_format", ["fp8_584", "fp8_656"])
def test_cuda_fp16_query_values_past_fp16_range(kv_format):
    """:func:`_past_fp16_case` on the GPU (a float16 query: the portable kernel, also on sm_90)."""
    kwargs, ref_out, ref_lse = _past_fp16_case(kv_format)
    out, lse = _outputs_like(kwargs, "cuda")
    mla_ops.sparse_mla_decode_triton(*_positional(_to_device(kwargs, "cuda")), out=out, lse=lse)
    assert_matches(out, lse, ref_out, ref_lse, tensor_cores=True)


@requires_cuda
def test_cuda_functional_matches_out():
    kwargs = _to_device(make_inputs(Spec(kv_format="fp8_656", T=4, H=128, K=256, lengths=True)), "cuda")
    out, lse = torch_sparse_mla.sparse_mla_decode(**kwargs)
    out2, lse2 = _outputs_like(kwargs, "cuda")
    torch_sparse_mla.sparse_mla_decode(**kwargs, out=(out2, lse2))
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@requires_cuda
@pytest.mark.parametrize("num_tokens", [4, 160], ids=lambda t: f"T{t}")  # split and non-split plans
def test_cuda_graph_capture(num_tokens):
    spec = Spec(kv_format="fp8_584", T=num_tokens, H=64, K=256, K2=32, lengths=True, sink="finite")
    first = make_inputs(spec, seed=0)
    static = _to_device(first, "cuda")
    out, lse = _outputs_like(first, "cuda")
    args = _positional(static)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _ops.sparse_mla_decode.out(*args, out=out, lse=lse)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _ops.sparse_mla_decode.out(*args, out=out, lse=lse)
    for seed in (1, 2, 3):
        # Same caches (the content is the caller's state), new queries, lists, lengths and sinks.
        new = make_inputs(spec, seed=0, value_seed=seed)
        for name in ("q", "indices", "topk_length", "attn_sink", "extra_indices", "extra_topk_length"):
            static[name].copy_(new[name])
        poison(out)
        poison(lse)
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, lse, *reference(**new), tensor_cores=True)


@requires_cuda
def test_cuda_compile_reduce_overhead():
    spec = Spec(kv_format="fp8_656", T=8, H=16, K=128, lengths=True, sink="finite")
    first = make_inputs(spec, seed=0)

    class Decoder(torch.nn.Module):
        def __init__(self, kwargs):
            super().__init__()
            self.register_buffer("kv_cache", _storage_to(kwargs["kv_cache"], "cuda"))
            self.register_buffer("attn_sink", kwargs["attn_sink"].cuda())

        def forward(self, q, indices, topk_length):
            out, lse = torch_sparse_mla.sparse_mla_decode(
                q, self.kv_cache, indices, softmax_scale=spec.scale, kv_format="fp8_656", topk_length=topk_length,
                attn_sink=self.attn_sink)
            return out * 1, lse

    model = Decoder(first)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for seed in (0, 1, 2, 3, 4):
        new = make_inputs(spec, seed=0, value_seed=seed)
        new["attn_sink"] = first["attn_sink"]
        out, lse = step(new["q"].cuda(), new["indices"].cuda(), new["topk_length"].cuda())
        assert_matches(out.clone(), lse.clone(), *reference(**new), tensor_cores=True)
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0


# -- the Hopper kernel (ops/sparse_mla_hopper.py): sm_90 only, not runnable under the interpreter ---------

_HOPPER = [Spec(kv_format=f, T=t, H=h, K=k, dim=d) for f, d in (("fp8_656", None), ("fp8_584", None),
                                                                 ("auto", 576), ("auto", 512))
           for t, h, k in [(2, 1, 1), (3, 20, 7), (1, 128, 2048), (5, 64, 100), (37, 16, 64), (3, 128, 300)]] + [
    Spec(kv_format=f, T=6, H=h, K=70, K2=40, lengths=True, sink="inf", bad_indices=True, empty_row=True,
         page_pad=32, extra_page_pad=16, noncontig_q=True) for f in fr.FORMATS for h in (20, 128)
] + [
    Spec(kv_format="fp8_584", T=4, H=64, K=128, K2=512, lengths=True, sink="finite", page_pad=64,
         extra_page_pad=64),
    Spec(kv_format="fp8_656", T=3, H=64, K=256, scale=0.3, sink="finite"),
    Spec(kv_format="fp8_656", T=200, H=64, K=128, lengths=True),  # more programs than SMs, no split
]


def test_hopper_kernel_alignment_needs():
    """Without a GPU: the Hopper kernel compiled for sm_90a with one pointer argument at a time not
    known to be 16-byte aligned (how the JIT specialises an unaligned tensor) fails to build exactly
    for the arguments at ``ALIGNED_ARGS``, the ones :func:`supported` checks and a recorded launch
    refuses unaligned (``ops/_launch.py::KernelLaunch``); every other pointer may have any alignment."""
    from torch_sparse_mla.ops import sparse_mla_hopper as hopper

    check_alignment_needs(hopper, "_sparse_mla_decode_hopper_kernel", "--only", "fp8_656")


def test_hopper_kernel_builds_for_sm90_within_limits():
    """Without a GPU: every variant of the Hopper kernel (format x split x extra list) compiles for
    sm_90a with the ptxas shipped in the triton wheel (``scripts/inspect_hopper.py``), fits the
    232,448 bytes of shared memory a block may use (fp8_656 with an extra list uses all of them), uses
    the tensor cores and mbarriers, spills at most a few hundred bytes (and hardly inside a loop), keeps
    one per-block loop per partition no longer than measured, few partition barriers in fp8_584's
    producer loop and the few-heads fp8_656 consumer loop, and no shared-memory scratch buffer placed on
    an mbarrier
    (``scripts/inspect_hopper.py::barrier_aliases``)."""
    import re

    pytest.importorskip("triton.backends.nvidia.compiler")
    from torch_sparse_mla.ops import sparse_mla_hopper
    from torch_sparse_mla.ops._launch import DEFAULT_SHARED_BYTES
    require_gluon(sparse_mla_hopper)
    result = run_offline_compile("inspect_hopper.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if " split=" in line]
    assert len(rows) == 27, result.stdout  # (64-head kernel, few-heads kernel at 16 and 32) x 9 variants
    for row in rows:
        smem = int(re.search(r"smem=(\d+)", row).group(1))
        spill_stores = int(re.search(r"spill st/ld=(\d+)/", row).group(1))
        counts = {k: int(v) for k, v in re.findall(r"\b(HGMMA|SYNCS|PREEXIT)=(\d+)", row)}
        assert smem <= DEFAULT_SHARED_BYTES, row  # 232,448 bytes on sm_90
        assert spill_stores <= 512, row
        assert counts["HGMMA"] > 0 and counts["SYNCS"] > 0, row
        # a split kernel lets its combine (programmatic dependent launch) be scheduled once its partials are
        # stored (griddepcontrol.launch_dependents); an unsplit one has no dependent
        assert (counts["PREEXIT"] > 0) == (" split=1" in row), row
        assert re.search(r"barrier_alias=0\b", row), row  # no scratch buffer on an mbarrier
        # one per-block loop per partition (the 64-head kernel's two consumers and producer, the few-heads
        # kernel's consumer and producer), none much longer than the 1,050-1,115 instructions per block of
        # the longest ones when measured (docs/sparse_mla_hopper.md, "Reading the compiled kernel")
        loops = [int(n) for n in re.search(r"loops=([\d,]+)", row).group(1).split(",")]
        assert len(loops) == (3 if " heads=64 " in row else 2), row
        assert max(loops) <= 1250, row
        # at most 8 spill stores or reloads inside a loop (triton 3.6-3.9: 0-8, the most in the 32-head fp8_656
        # consumer; 3.9's ptxas at Triton's register-allocation level put 16 in the 64-head kernel's consumer
        # and 30 in the 32-head one, which ops/_launch.py::hopper_ptx_options avoids)
        loop_spills = [int(n) for n in re.search(r"loop_spills=([\d,]+)", row).group(1).split(",")]
        assert max(loop_spills) <= 8, row
        # fp8_584's producer copies and converts a block in a few operations, so that the compiler orders
        # them with few partition barriers (triton 3.6-3.9: 10, 9, 8, 4 per block; 24 with 3.6 when each
        # 64-byte chunk was an operation of its own; docs/sparse_mla_hopper.md, "Fewer partition
        # barriers"); the other formats keep one operation per chunk, which measured no slower
        producer_bars = int(re.search(r"producer_bars=(-?\d+)", row).group(1))
        assert producer_bars > 0, row
        if row.startswith("fp8_584"):
            assert producer_bars <= 12, row
        # the few-heads fp8_656 consumer stores its four P^T copies into allocations of their own, so that the
        # compiler puts no partition barrier between two of them (triton 3.6-3.9: 5, 5, 3, 3 per block at
        # 16 heads and 8, 8, 9, 9 at 32; 8 and 11 with 3.6 when they were subviews of one allocation;
        # docs/sparse_mla_hopper.md, "Few heads: the P^T copies in allocations of their own")
        consumer_bars = int(re.search(r"consumer_bars=(-?\d+)", row).group(1))
        assert consumer_bars > 0, row
        if row.startswith("fp8_656 heads=16 "):
            assert consumer_bars <= 5, row
        if row.startswith("fp8_656 heads=32 "):
            assert consumer_bars <= 9, row


def test_hopper_kernels_only_with_the_triton_releases_they_are_written_for():
    """The Hopper kernels (sparse MLA and sparse GQA) are enabled only with the Triton releases whose
    Gluon they are written for: Gluon changes between releases (3.9 renamed ``_reinterpret`` and
    removed ``async_copy_global_to_shared``), and any other release takes the portable kernels instead
    of failing to compile at the first call. Where Gluon is enabled the kernels' names for those two
    exist."""
    from torch_sparse_mla.ops import sparse_gqa_hopper
    from torch_sparse_mla.ops import sparse_mla_hopper as hopper
    from torch_sparse_mla.ops._triton import HAS_TRITON, triton

    ok = hopper.gluon_version_supported
    assert ok("3.6.0") and ok("3.7.1") and ok("3.8.0") and ok("3.9.0") and ok("3.6.0+git1a2b3c4")
    assert not any(ok(v) for v in ("3.5.1", "3.10.0", "4.0.0", "nightly", ""))
    assert sparse_gqa_hopper.HAS_GLUON is hopper.HAS_GLUON
    if not (HAS_TRITON and ok(triton.__version__)):
        assert not hopper.HAS_GLUON
    if hopper.HAS_GLUON:
        from triton.experimental.gluon.language.nvidia.ampere import async_copy

        assert hopper.async_load in [getattr(async_copy, n, None) for n in ("async_load",
                                                                            "async_copy_global_to_shared")]
        assert callable(hopper.gl.shared_memory_descriptor.reinterpret)


@requires_hopper
@pytest.mark.parametrize("num_splits", [None, 1, 3], ids=lambda s: f"splits={s or 'auto'}")
@pytest.mark.parametrize("spec", _HOPPER, ids=str)
def test_cuda_hopper_parity(spec, num_splits):
    kwargs = make_inputs(spec)
    dev = _to_device(kwargs, "cuda")
    assert mla_ops.kernel_path(dev["q"], dev["kv_cache"], spec.kv_format, spec.head_dim_v,
                               dev.get("extra_kv_cache")) == "hopper"
    out, lse = _outputs_like(kwargs, "cuda")
    mla_ops.sparse_mla_decode_triton(*_positional(dev), out=out, lse=lse, num_splits=num_splits, path="hopper")
    assert_matches(out, lse, *reference(**kwargs), tensor_cores=True)


@requires_hopper
@pytest.mark.parametrize("num_splits", [3, 8], ids=lambda s: f"splits={s}")
@pytest.mark.parametrize("heads", [20, 128])
def test_cuda_hopper_combine_pdl_matches_plain_launch(heads, num_splits, monkeypatch):
    """The combine of a split Hopper call launched with programmatic dependent launch (the default on
    sm_90; it may be scheduled before the decode kernel ends and waits for it) writes the same bytes as
    a combine launched after the decode kernel, with either combine kernel (3 splits: per split; 8: the
    fan-out one, for these shapes) and either decode kernel (20 heads: few heads; 128: 64-head)."""
    spec = Spec(kv_format="fp8_656", T=2, H=heads, K=600, lengths=True, sink="finite")
    kwargs = make_inputs(spec)
    dev = _to_device(kwargs, "cuda")
    results = []
    try:
        for pdl in (True, False):
            monkeypatch.setattr(mla_ops, "COMBINE_PDL", pdl)
            mla_ops._PLANS.clear()
            out, lse = _outputs_like(kwargs, "cuda")
            mla_ops.sparse_mla_decode_triton(*_positional(dev), out=out, lse=lse, num_splits=num_splits,
                                             path="hopper")
            results.append((out, lse))
    finally:
        mla_ops._PLANS.clear()
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert_matches(*results[0], *reference(**kwargs), tensor_cores=True)


# The Hopper kernels on the shapes where each can run: the few-heads one (16 or 32 heads per CTA,
# transposed products) and the 64-head one, forced every way, also with several head blocks.
_HEAD_FORMS = {
    "few16": dict(transposed=True, block_h=16),
    "few32": dict(transposed=True, block_h=32),
    "rows64": dict(transposed=False, block_h=64),
}


@requires_hopper
@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda s: f"splits={s}")
@pytest.mark.parametrize("form", list(_HEAD_FORMS))
@pytest.mark.parametrize("spec", [
    Spec(kv_format=f, T=5, H=h, K=200, K2=k2, lengths=True, sink="finite", bad_indices=True, empty_row=True,
         page_pad=32, extra_page_pad=16)
    for f, k2 in (("fp8_656", 0), ("fp8_584", 48), ("auto", 0)) for h in (3, 20, 40)
], ids=str)
def test_cuda_hopper_head_forms(spec, form, num_splits):
    kwargs = make_inputs(spec)
    dev = _to_device(kwargs, "cuda")
    out, lse = _outputs_like(kwargs, "cuda")
    mla_ops.sparse_mla_decode_triton(*_positional(dev), out=out, lse=lse, num_splits=num_splits, path="hopper",
                                     config=_HEAD_FORMS[form])
    assert_matches(out, lse, *reference(**kwargs), tensor_cores=True)


@requires_hopper
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # float32 products overflow on purpose
@pytest.mark.parametrize("form", ["few16", "rows64"])
@pytest.mark.parametrize("scale", ["1e38", "-1e300", "zero", "-zero", "-0.3"], ids=str)
def test_cuda_hopper_softmax_scale_extremes(scale, form):
    """Both Hopper kernels under the overflow-safe rule: scores past float32 both ways, a zero scale
    (equal weights) and a negative one (the query is staged negated, so the scores need no sign)."""
    softmax_scale = -0.3 if scale == "-0.3" else _EXTREME_SCALES[scale]
    spec = Spec(kv_format="fp8_656", T=3, H=24, K=300, K2=40, lengths=True, sink="finite", empty_row=True,
                extra_page_pad=16, scale=softmax_scale)
    kwargs = make_inputs(spec)
    out, lse = _outputs_like(kwargs, "cuda")
    mla_ops.sparse_mla_decode_triton(*_positional(_to_device(kwargs, "cuda")), out=out, lse=lse, path="hopper",
                                     config=_HEAD_FORMS[form])
    _assert_extreme_scale(out.cpu(), lse.cpu(), *reference(**kwargs))


@requires_hopper
@pytest.mark.parametrize("form", ["few16", "rows64"])
@pytest.mark.parametrize("kv_format", ["fp8_656", "auto"])
def test_cuda_hopper_running_maximum(kv_format, form):
    """The online softmax's rescales: every head's best score grows from block to block by its own
    step, from a quarter of a binade of the weights to 24 binades (token 0: earlier blocks' weights
    shrink a little or vanish), or shrinks the same way (token 1: nothing is rescaled after the first
    block), over six blocks of 64 keys, so one block holds rows of every kind."""
    heads, blocks = 40, 6
    num_keys = 64 * blocks
    dim = 576
    gen = torch.Generator().manual_seed(7)
    softmax_scale = 0.06
    # per-block step of the best score, in binades of the weights: 0.25 .. 24 across the heads
    steps = torch.logspace(math.log10(0.25), math.log10(24.0), heads, dtype=torch.float64)
    keys = torch.randn(num_keys, dim, generator=gen) * 0.25
    block = torch.arange(num_keys) // 64
    keys[:, 0] = block.to(torch.float32)  # dim 0 carries the growth
    q = torch.randn(2, heads, dim, generator=gen) * 0.25
    q[:, :, 0] = (steps / (softmax_scale * math.log2(math.e))).to(torch.float32)
    page_size = 16
    cache = fr.make_cache(num_keys // page_size + 2, page_size, kv_format, dim=dim)
    slots = torch.randperm(cache.shape[0] * page_size, generator=gen)[:num_keys]
    fr.fill_cache(cache, slots.tolist(), keys, kv_format)
    indices = torch.stack([slots, slots.flip(0)]).to(torch.int32)
    kwargs = dict(q=q.to(torch.bfloat16), kv_cache=cache, indices=indices, softmax_scale=softmax_scale,
                  kv_format=kv_format, head_dim_v=512, topk_length=None)
    out, lse = _outputs_like(kwargs, "cuda")
    mla_ops.sparse_mla_decode_triton(*_positional(_to_device(kwargs, "cuda")), out=out, lse=lse, path="hopper",
                                     num_splits=1, config=_HEAD_FORMS[form])
    assert_matches(out, lse, *reference(**kwargs), tensor_cores=True)


@requires_hopper
def test_cuda_hopper_is_the_default_on_sm90():
    """The registered operator runs the Hopper kernel where it applies, and the same values come out of
    the portable kernel (bitwise equality is not expected: different summation orders)."""
    spec = Spec(kv_format="fp8_656", T=4, H=128, K=512, lengths=True, sink="finite")
    kwargs = make_inputs(spec)
    dev = _to_device(kwargs, "cuda")
    assert mla_ops.kernel_path(dev["q"], dev["kv_cache"], "fp8_656") == "hopper"
    unaligned = _to_device(make_inputs(dataclasses.replace(spec, page_pad=5)), "cuda")
    assert mla_ops.kernel_path(unaligned["q"], unaligned["kv_cache"], "fp8_656") == "portable"
    assert mla_ops.kernel_path(dev["q"].half(), dev["kv_cache"], "fp8_656") == "portable"
    out, lse = torch_sparse_mla.sparse_mla_decode(**dev)
    out_h, lse_h = _outputs_like(kwargs, "cuda")
    mla_ops.sparse_mla_decode_triton(*_positional(dev), out=out_h, lse=lse_h, path="hopper")
    out_p, lse_p = _outputs_like(kwargs, "cuda")
    mla_ops.sparse_mla_decode_triton(*_positional(dev), out=out_p, lse=lse_p, path="portable")
    assert torch.equal(out, out_h) and torch.equal(lse, lse_h)
    assert_matches(out_p, lse_p, *reference(**kwargs), tensor_cores=True)
    with pytest.raises(ValueError, match="path: the Hopper kernel does not serve"):
        mla_ops.sparse_mla_decode_triton(*_positional(unaligned), out=out_h, lse=lse_h, path="hopper")


def _unaligned_copy(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` with the same shape, strides and bytes at a base address 2 bytes past a 16-byte
    boundary (a view at an odd offset of a wider buffer)."""
    nbytes = cache.untyped_storage().nbytes()
    buf = torch.zeros(nbytes + 16, dtype=torch.uint8, device=cache.device)
    buf[2 : 2 + nbytes].copy_(torch.empty(0, dtype=torch.uint8, device=cache.device).set_(cache.untyped_storage()))
    shifted = buf[2 : 2 + nbytes].view(cache.dtype)
    view = shifted.as_strided(cache.shape, cache.stride(), shifted.storage_offset() + cache.storage_offset())
    assert view.data_ptr() % 16 == 2 and torch.equal(view.view(torch.uint8), cache.view(torch.uint8))
    return view


@requires_hopper
@pytest.mark.parametrize("kv_format", ["fp8_656", "auto"])
def test_cuda_hopper_unaligned_cache_base(kv_format):
    """A cache view whose base is not 16-byte aligned takes the portable kernel (the Hopper kernel's
    row copies need an aligned base), also when the same shapes and strides came first with an aligned
    cache: the public function, the registered operator and its out overload replay the launches a
    signature's first call recorded, and for the unaligned cache they run the launcher instead."""
    spec = Spec(kv_format=kv_format, T=3, H=64, K=192, lengths=True, sink="finite")
    kwargs = make_inputs(spec)
    want = reference(**kwargs)
    dev = _to_device(kwargs, "cuda")
    unaligned = dict(dev, kv_cache=_unaligned_copy(dev["kv_cache"]))
    assert mla_ops.kernel_path(dev["q"], dev["kv_cache"], kv_format) == "hopper"
    assert mla_ops.kernel_path(unaligned["q"], unaligned["kv_cache"], kv_format) == "portable"
    forget_signatures("sparse_mla_decode")  # the aligned call first, whatever tests ran before
    for args in (dev, unaligned, dev, unaligned):  # aligned first: its Hopper launches are recorded
        assert_matches(*torch_sparse_mla.sparse_mla_decode(**args), *want, tensor_cores=True)
        assert_matches(*torch.ops.sparse_mla.sparse_mla_decode(*_positional(args)), *want, tensor_cores=True)
        out, lse = _outputs_like(kwargs, "cuda")
        torch.ops.sparse_mla.sparse_mla_decode.out(*_positional(args), out=out, lse=lse)
        assert_matches(out, lse, *want, tensor_cores=True)


@requires_hopper
def test_cuda_hopper_deterministic():
    kwargs = _to_device(make_inputs(Spec(kv_format="fp8_656", T=2, H=128, K=2048)), "cuda")
    first = torch_sparse_mla.sparse_mla_decode(**kwargs)
    for _ in range(3):
        again = torch_sparse_mla.sparse_mla_decode(**kwargs)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
