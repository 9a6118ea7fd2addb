"""KV cache operators (docs/operators.md): kv_cache_insert and kv_cache_gather in the three formats.

Sections: schema snapshot, reference parity, Triton interpreter parity, opcheck, compile, errors, GPU.
The reference is tests/formats_reference.py (one token at a time, bytes laid out as docs/formats.md draws them).
Every insert test compares the cache's whole storage, page padding included, with the reference's.
"""

from __future__ import annotations

import random

import pytest
import torch
from expecttest import assert_expected_inline

import formats_reference as ref
import torch_sparse_mla as tsm
from common import assert_no_recompiles, poison, requires_cuda, requires_interpreter, set_args
from torch_sparse_mla.ops import kv_cache as kernels
from torch_sparse_mla.ops._rounding import e4m3_place_f16, e4m3_to_f16_bits, e4m3_to_f32
from torch_sparse_mla.ops._triton import tl, triton

ops = torch.ops.sparse_mla
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
FLOATS = {"bf16": BF16, "fp16": F16, "fp32": F32}
FMT_DIM = {"auto": 576, "fp8_656": 576, "fp8_584": 512}
# (page_size, page_pad): DeepSeek-like pages; an odd page size with an odd padding of every page
LAYOUTS = {"ps64": (64, 0), "ps3-pad7": (3, 7)}
NUM_PAGES = 4


# =====================================================================================================
# Inputs and reference helpers
# =====================================================================================================


def make_kv(n: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``[n, dim]`` values whose 64-dim groups span seven decades (large dynamic range inside a
    vector), plus an all-zero 128-dim tile (row 1), an all-zero row (row 2), a -0.0, and the amax 636
    whose ``x / scale`` rounds to 448.00003 in fp8_656 (row 0, column 0)."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-dim // 64)
    decades = torch.empty(n, groups).uniform_(-3.5, 3.5, generator=g)
    x = torch.randn(n, dim, generator=g) * torch.pow(10.0, decades).repeat_interleave(64, dim=1)[:, :dim]
    if n > 0:
        x[0, :128] = x[0, :128].clamp(-600, 600)
        x[0, 0] = 636.0
    if n > 1:
        x[1, :128] = 0.0
        x[1, 130] = -0.0
    if n > 2:
        x[2] = 0.0
    return x.to(dtype)


def make_slots(num_slots: int, n_valid: int, seed: int) -> torch.Tensor:
    """int64 slots: ``n_valid`` distinct valid ones (first and last slot included when possible) and
    every kind of empty entry (-1, other negatives, == num_slots, far past the end), shuffled."""
    rng = random.Random(seed)
    ends = [0, num_slots - 1][:n_valid]
    valid = ends + rng.sample(range(1, num_slots - 1), n_valid - len(ends))
    empty = [-1, -7, -(2**31), num_slots, num_slots + 5, 2**31 - 1]  # int32-safe: gather takes them too
    slots = valid + empty
    rng.shuffle(slots)
    return torch.tensor(slots, dtype=torch.int64)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of ``t``'s storage (page padding and other tokens included), on the CPU."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).cpu().clone()


def naive_insert(cache: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, kv_format: str) -> None:
    num_slots = cache.shape[0] * cache.shape[1]
    for s, x in zip(slots.tolist(), kv):
        if 0 <= s < num_slots:
            ref.write_slot(cache, s, x, kv_format)


def naive_gather(cache: torch.Tensor, slots: torch.Tensor, kv_format: str, dtype: torch.dtype) -> torch.Tensor:
    """The dequantised float64 rows rounded once through float32 (exact: every dequantised value is
    a float32 product computed exactly) to ``dtype``; zero rows for empty slots."""
    num_slots = cache.shape[0] * cache.shape[1]
    dim = FMT_DIM[kv_format] if kv_format != "auto" else cache.shape[2]
    rows = [ref.read_slot(cache, s, kv_format) if 0 <= s < num_slots else torch.zeros(dim, dtype=torch.float64)
            for s in slots.tolist()]
    out = torch.stack(rows) if rows else torch.zeros(0, dim, dtype=torch.float64)
    return ref.stored(out.to(torch.float32), dtype)


# NaN bit patterns beyond the default one: negative, payloads, signalling, CUDA's all-ones mantissa.
_NAN_PATTERNS = {F32: [0x7FFFFFFF, -0x00400000, 0x7F800001, 0x7FC00001], BF16: [0x7FFF, -0x003F, 0x7F81],
                 F16: [0x7E01, -0x0200, 0x7C01]}


def make_non_finite_kv(n: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``make_kv`` rows with NaN (of several bit patterns) and +-inf: row 0 one NaN and one inf among
    finite values in the first tiles and in the last (bf16) dims, row 1 a whole 64-value tile of NaN,
    row 2 a tile of zeros and -inf, row 3 nothing but NaN."""
    x = make_kv(n, dim, F32, seed)
    x[0, 3], x[0, 70], x[0, 200], x[0, dim - 1], x[0, dim - 2] = float("nan"), float("inf"), float("-inf"), \
        float("nan"), float("inf")
    x[1, 64:128] = float("nan")
    x[2, 128:192] = 0.0
    x[2, 130] = float("-inf")
    x[3] = float("nan")
    x = x.to(dtype)
    bits = x.view({F32: torch.int32, BF16: torch.int16, F16: torch.int16}[dtype])
    nan_positions = torch.isnan(x).nonzero().tolist()
    for k, (i, j) in enumerate(nan_positions):
        patterns = _NAN_PATTERNS[dtype]
        bits[i, j] = patterns[k % len(patterns)]
    assert torch.isnan(x).sum() == len(nan_positions)
    return x


def cache_for(kv_format: str, layout: str, *, dim: int = 576, dtype=BF16, device="cpu"):
    page_size, pad = LAYOUTS[layout]
    return ref.make_cache(NUM_PAGES, page_size, kv_format, dim=dim, dtype=dtype, page_pad=pad, device=device)


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    a, b = raw_bytes(got), raw_bytes(want)
    assert a.shape == b.shape
    diff = (a != b).nonzero().flatten()
    assert diff.numel() == 0, f"{diff.numel()} bytes differ, first at storage byte {diff[:8].tolist()}"


# =====================================================================================================
# Schema snapshot
# =====================================================================================================


def test_schemas():
    assert_expected_inline(str(ops.kv_cache_insert.default._schema), """\
sparse_mla::kv_cache_insert(Tensor kv, Tensor slot_mapping, Tensor(a!) kv_cache, str kv_format) -> ()""")
    assert_expected_inline(str(ops.kv_cache_gather.default._schema), """\
sparse_mla::kv_cache_gather(Tensor kv_cache, Tensor slots, str kv_format, ScalarType? dtype=None) -> Tensor""")
    assert_expected_inline(str(ops.kv_cache_gather.out._schema), """\
sparse_mla::kv_cache_gather.out(Tensor kv_cache, Tensor slots, str kv_format, ScalarType? dtype=None, *, Tensor(a!) out) -> ()""")


# =====================================================================================================
# Reference parity (CPU kernels through the registered operators)
# =====================================================================================================


@pytest.mark.parametrize("kv_dtype", list(FLOATS), ids=lambda d: f"kv_{d}")
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kv_format", ref.FORMATS)
def test_insert_matches_reference(kv_format, layout, kv_dtype):
    cache, want = cache_for(kv_format, layout), cache_for(kv_format, layout)
    num_slots = cache.shape[0] * cache.shape[1]
    slots = torch.cat([make_slots(num_slots, min(9, num_slots), seed=len(layout)), torch.tensor([2**40])])
    kv = make_kv(slots.shape[0], FMT_DIM[kv_format], FLOATS[kv_dtype], seed=3)
    tsm.kv_cache_insert(kv, slots, cache, kv_format=kv_format)
    naive_insert(want, kv, slots, kv_format)
    assert_same_bytes(cache, want)


@pytest.mark.parametrize("cache_dtype", list(FLOATS), ids=lambda d: f"cache_{d}")
@pytest.mark.parametrize("kv_dtype", list(FLOATS), ids=lambda d: f"kv_{d}")
def test_insert_auto_any_dim_and_dtype(kv_dtype, cache_dtype):
    # D = 100 (not a power of two), strided kv (every other column of a wider tensor)
    cache = cache_for("auto", "ps3-pad7", dim=100, dtype=FLOATS[cache_dtype])
    want = cache_for("auto", "ps3-pad7", dim=100, dtype=FLOATS[cache_dtype])
    slots = make_slots(12, 8, seed=1)
    kv = make_kv(slots.shape[0], 200, FLOATS[kv_dtype], seed=4)[:, ::2]
    tsm.kv_cache_insert(kv, slots, cache, kv_format="auto")
    naive_insert(want, kv, slots, "auto")
    assert_same_bytes(cache, want)


def test_insert_quantisation_edges():
    """The scales the contract fixes for degenerate tiles, and saturation at 448 instead of NaN."""
    kv = make_kv(3, 576, F32, seed=0)
    c656 = ref.make_cache(1, 3, "fp8_656")
    tsm.kv_cache_insert(kv, torch.arange(3), c656, kv_format="fp8_656")
    fp32_min_bytes = torch.tensor([2.0**-126], dtype=F32).view(torch.uint8)
    assert torch.equal(c656[0, 1, 512:516], fp32_min_bytes)  # tile 0 of row 1 is all zero
    assert torch.equal(c656[0, 2, 512:528], fp32_min_bytes.repeat(4))  # all-zero row
    assert c656[0, 0, 0].item() == 0x7E  # 636 / (636 / 448) = 448.00003 -> 448, not NaN
    assert not ((c656[:, :, :512] & 0x7F) == 0x7F).any()  # no e4m3 NaN anywhere
    assert c656[0, 1, 130].item() == 0x80  # -0.0 keeps its sign

    kv = make_kv(3, 512, F32, seed=0)
    kv[0, 64:128] = 448.0 * 2.0**-5  # amax / 448 is a power of two: e = -5 exactly, no rounding up
    kv[0, 128:192] = 1e30  # a huge tile: e = ceil(log2(1e30 / 448)) = 91
    c584 = ref.make_cache(1, 3, "fp8_584")
    tsm.kv_cache_insert(kv, torch.arange(3), c584, kv_format="fp8_584")
    scale_rows = c584.flatten()[3 * 576 : 3 * 584].view(3, 8)
    assert scale_rows[:, 7].tolist() == [0, 0, 0]  # the 8th byte of every scale row
    assert scale_rows[2, :7].tolist() == [127 - 22] * 7  # amax 0 -> ceil(log2(1e-4 / 448)) = -22
    assert scale_rows[0, 1].item() == 127 - 5
    assert scale_rows[0, 2].item() == 127 + 91
    assert not ((c584.flatten()[:3 * 576].view(3, 576)[:, :448] & 0x7F) == 0x7F).any()


@pytest.mark.parametrize("kv_format", ref.FORMATS)
def test_insert_nothing_to_write(kv_format):
    cache = cache_for(kv_format, "ps3-pad7")
    before = raw_bytes(cache)
    dim = FMT_DIM[kv_format]
    tsm.kv_cache_insert(torch.empty(0, dim, dtype=BF16), torch.empty(0, dtype=torch.int64), cache, kv_format=kv_format)
    tsm.kv_cache_insert(make_kv(4, dim, BF16, 0), torch.tensor([-1, 12, 2**40, -(2**62)]), cache, kv_format=kv_format)
    assert torch.equal(raw_bytes(cache), before)


@pytest.mark.parametrize("dtype", [None, BF16, F16, F32], ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["slots_i32", "slots_i64"])
@pytest.mark.parametrize("kv_format", ref.FORMATS)
def test_gather_matches_reference(kv_format, slot_dtype, dtype):
    # a NaN-poisoned cache in which only the requested slots were written
    cache = cache_for(kv_format, "ps3-pad7")
    written = torch.tensor([0, 4, 5, 11])
    ref.fill_cache(cache, written, make_kv(4, FMT_DIM[kv_format], F32, seed=5), kv_format)
    slots = torch.tensor([5, -1, 11, 12, 0, 4, 5, -100, 2**31 - 1], dtype=slot_dtype)
    want = naive_gather(cache, slots, kv_format, BF16 if dtype is None else dtype)
    got = tsm.kv_cache_gather(cache, slots, kv_format=kv_format, dtype=dtype)
    assert got.dtype == want.dtype and torch.equal(got, want)
    # the out overload, into a strided buffer (a column window of a wider one)
    wide = poison(torch.empty(slots.shape[0], FMT_DIM[kv_format] + 9, dtype=want.dtype))
    out = wide[:, 3 : 3 + FMT_DIM[kv_format]]
    assert tsm.kv_cache_gather(cache, slots, kv_format=kv_format, dtype=dtype, out=out) is out
    assert torch.equal(out, want)
    assert wide[:, :3].isnan().all() and wide[:, 3 + FMT_DIM[kv_format]:].isnan().all()


@pytest.mark.parametrize("kv_dtype", list(FLOATS), ids=lambda d: f"kv_{d}")
@pytest.mark.parametrize("kv_format", ref.FORMATS)
def test_insert_non_finite(kv_format, kv_dtype):
    """NaN stays NaN (canonical bits), +-inf saturates in e4m3fn and stays inf in bf16, and neither
    moves a tile's scale: the finite values of a tile quantise as without them."""
    cache, want = cache_for(kv_format, "ps3-pad7"), cache_for(kv_format, "ps3-pad7")
    kv = make_non_finite_kv(5, FMT_DIM[kv_format], FLOATS[kv_dtype], seed=40)
    slots = torch.tensor([0, 4, 7, 11, 5])
    tsm.kv_cache_insert(kv, slots, cache, kv_format=kv_format)
    naive_insert(want, kv, slots, kv_format)
    assert_same_bytes(cache, want)
    got = tsm.kv_cache_gather(cache, slots, kv_format=kv_format, dtype=F32)
    assert torch.equal(torch.isnan(got), torch.isnan(kv.float()))  # NaN exactly where it was
    if kv_format != "auto":
        finite = torch.isfinite(kv.float())
        quantised = 512 if kv_format == "fp8_656" else 448
        e4m3 = got[:, :quantised]
        assert torch.isfinite(e4m3[~torch.isnan(kv.float()[:, :quantised])]).all()  # inf saturated, finite scales
        assert torch.isinf(got[0, -2]) and got[0, -2] > 0  # the bf16 dims keep infinities
        plain = make_kv(5, FMT_DIM[kv_format], FLOATS[kv_dtype], seed=40)
        clean = cache_for(kv_format, "ps3-pad7")
        tsm.kv_cache_insert(torch.where(finite, kv, plain), slots, clean, kv_format=kv_format)
        row_0 = tsm.kv_cache_gather(clean, slots[:1], kv_format=kv_format, dtype=F32)[0]
        assert torch.equal(got[0, 130:200], row_0[130:200])  # tile 2 of row 0 is finite in both


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["out_bf16", "out_fp16", "out_fp32"])
@pytest.mark.parametrize("kv_format", ref.FORMATS)
def test_gather_non_finite(kv_format, dtype):
    """Non-finite cache contents gather to canonical NaN / inf in every output dtype: e4m3 NaN bytes,
    NaN and inf scales (fp8_656), exponent byte 255 (fp8_584: 0 * inf is NaN), NaN bf16 patterns."""
    cache = non_finite_cache(kv_format)
    slots = torch.arange(6)
    want = naive_gather(cache, slots, kv_format, dtype)
    got = tsm.kv_cache_gather(cache, slots, kv_format=kv_format, dtype=dtype)
    assert torch.isnan(got).any() and torch.isinf(got).any()
    assert torch.equal(int_bits(got), int_bits(want))


def int_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({F32: torch.int32, BF16: torch.int16, F16: torch.int16}[t.dtype])


def non_finite_cache(kv_format: str) -> torch.Tensor:
    """A 2 x 3 cache whose slots 0-5 hold finite records with non-finite bytes written into them."""
    cache = cache_for(kv_format, "ps3-pad7", dtype=F16 if kv_format == "auto" else BF16)
    kv = make_kv(6, FMT_DIM[kv_format], F32, seed=41)
    kv[1] = float("inf")  # a record of +inf (auto: inf; fp8: 448 * the scale of finite amax 0)
    ref.fill_cache(cache, range(6), kv, kv_format)
    if kv_format == "auto":
        bits = cache.view(torch.int16)
        bits[0, 0, 5], bits[0, 2, 7], bits[1, 0, 1] = 0x7E01, -0x0200, 0x7C01  # fp16 NaNs of several kinds
        return cache
    page = lambda p: torch.as_strided(cache, (cache.shape[1] * cache.shape[2],), (1,),  # noqa: E731
                                      cache.storage_offset() + p * cache.stride(0))
    p0 = page(0)
    p0[5], p0[700] = 0x7F, 0xFF  # e4m3 NaN, +-
    if kv_format == "fp8_656":
        p0[656 + 512:656 + 516] = torch.tensor([float("nan")]).view(torch.uint8)  # slot 1: NaN scale of tile 0
        p0[2 * 656 + 516:2 * 656 + 520] = torch.tensor([float("inf")]).view(torch.uint8)  # slot 2: inf scale
        p0[600:602] = torch.tensor([0x7FFF], dtype=torch.int16).view(torch.uint8)  # slot 0: a bf16 NaN
    else:
        p0[3 * 576 + 8 * 2 + 1] = 255  # slot 2, tile 1: exponent byte 255 (an inf scale)
        p0[500:502] = torch.tensor([-0x003F], dtype=torch.int16).view(torch.uint8)  # slot 0: a bf16 NaN
    return cache


def test_gather_empty():
    cache = cache_for("fp8_584", "ps64")
    assert tsm.kv_cache_gather(cache, torch.empty(0, dtype=torch.int32), kv_format="fp8_584").shape == (0, 512)
    out = torch.empty(0, 512, dtype=F16)
    tsm.kv_cache_gather(cache, torch.empty(0, dtype=torch.int64), kv_format="fp8_584", out=out)


@pytest.mark.parametrize("kv_format", ref.FORMATS)
def test_round_trip_within_e4m3_precision(kv_format):
    cache = cache_for(kv_format, "ps64")
    slots = make_slots(cache.shape[0] * cache.shape[1], 40, seed=2)
    kv = make_kv(slots.shape[0], FMT_DIM[kv_format], F32, seed=7)
    tsm.kv_cache_insert(kv, slots, cache, kv_format=kv_format)
    got = tsm.kv_cache_gather(cache, slots, kv_format=kv_format, dtype=F32)
    valid = (slots >= 0) & (slots < cache.shape[0] * cache.shape[1])
    assert (got[~valid] == 0).all()
    x, y = kv[valid].double(), got[valid].double()
    if kv_format == "auto":
        assert torch.equal(y, x.to(BF16).double())
        return
    quantised, tile = (512, 128) if kv_format == "fp8_656" else (448, 64)
    amax = x[:, :quantised].abs().view(-1, quantised // tile, tile).amax(-1).repeat_interleave(tile, dim=1)
    # half an e4m3 ulp (2**-4 relative) of the value, or half the smallest subnormal step of the tile
    # (2**-10 of the scale; the fp8_584 power-of-two scale is < 2 * amax / 448)
    bound = torch.maximum(x[:, :quantised].abs() * 2.0**-4, amax / 448 * 2 * 2.0**-10)
    assert ((y[:, :quantised] - x[:, :quantised]).abs() <= bound).all()
    torch.testing.assert_close(y[:, quantised:], x[:, quantised:], rtol=2.0**-8, atol=0)


# =====================================================================================================
# Triton interpreter parity (the CUDA kernels, run on CPU tensors)
# =====================================================================================================

@triton.jit
def _decode_bytes_kernel(raw_ptr, f32_ptr, f16_ptr, placed_ptr, N: tl.constexpr, PLACE: tl.constexpr):
    offs = tl.arange(0, N)
    raw = tl.load(raw_ptr + offs)
    tl.store(f32_ptr + offs, e4m3_to_f32(raw))
    tl.store(f16_ptr + offs, e4m3_to_f16_bits(raw))
    if PLACE:  # inline PTX: NVIDIA GPUs only, not the interpreter
        tl.store(placed_ptr + offs, e4m3_place_f16(raw).to(tl.float32) * 256.0)


def check_e4m3_decoders(device):
    """The Triton e4m3 decoders on all 256 bytes: ``e4m3_to_f16_bits`` (the integer route of the
    interpreter, of an AMD GPU and of sm_75), ``e4m3_to_f32`` (the hardware conversion from sm_89 on,
    else one of the other two) and, on an NVIDIA GPU, ``e4m3_place_f16`` (the bit placement of sm_80 to
    sm_86, run here whatever the GPU) equal PyTorch's float8_e4m3fn conversion, subnormals, zeros of
    both signs and both NaN bytes included."""
    place = device == "cuda" and torch.version.hip is None
    raw = torch.arange(256, dtype=torch.uint8, device=device)
    f32 = torch.empty(256, device=device)
    f16 = torch.empty(256, dtype=torch.float16, device=device)
    placed = torch.empty(256, device=device)
    _decode_bytes_kernel[(1,)](raw, f32, f16, placed, N=256, PLACE=place)
    want = raw.cpu().view(torch.float8_e4m3fn).float()
    assert want.isnan().sum() == 2
    for got in (f32.cpu(), f16.cpu().float()) + ((placed.cpu(),) if place else ()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        number = ~want.isnan()  # the sign of every number, zeros included (a NaN's sign means nothing)
        assert torch.equal(got[number].view(torch.int32) >> 31, want[number].view(torch.int32) >> 31)


@requires_interpreter
def test_interpreter_e4m3_decoders_every_byte():
    check_e4m3_decoders("cpu")


@requires_cuda
def test_cuda_e4m3_decoders_every_byte():
    check_e4m3_decoders("cuda")


INTERPRETER_INSERT_CASES = {
    # name: (kv_format, layout, kv dtype, auto cache dtype)
    "fp8_656-ps64-kv_bf16": ("fp8_656", "ps64", BF16, None),
    "fp8_656-ps3-pad7-kv_fp32": ("fp8_656", "ps3-pad7", F32, None),
    "fp8_584-ps64-kv_fp32": ("fp8_584", "ps64", F32, None),
    "fp8_584-ps3-pad7-kv_fp16": ("fp8_584", "ps3-pad7", F16, None),
    "fp8_584-ps3-pad7-kv_bf16": ("fp8_584", "ps3-pad7", BF16, None),
    "auto-kv_fp32-cache_bf16": ("auto", "ps3-pad7", F32, BF16),
    "auto-kv_fp32-cache_fp16": ("auto", "ps3-pad7", F32, F16),
    "auto-kv_bf16-cache_fp32": ("auto", "ps64", BF16, F32),
    "auto-kv_fp16-cache_bf16": ("auto", "ps64", F16, BF16),
}


@requires_interpreter
@pytest.mark.parametrize("case", list(INTERPRETER_INSERT_CASES))
def test_interpreter_insert(case):
    kv_format, layout, kv_dtype, cache_dtype = INTERPRETER_INSERT_CASES[case]
    dim = FMT_DIM[kv_format]
    cache = cache_for(kv_format, layout, dtype=cache_dtype)
    want = cache_for(kv_format, layout, dtype=cache_dtype)
    num_slots = cache.shape[0] * cache.shape[1]
    slots = torch.cat([make_slots(num_slots, 8, seed=11), torch.tensor([2**40, -(2**62)])])
    kv = make_kv(slots.shape[0], 2 * dim, kv_dtype, seed=12)[:, 1::2]  # strided: stride(1) == 2
    kernels.kv_cache_insert_triton(kv, slots, cache, kv_format)
    kernels.kv_cache_insert_torch(kv, slots, want, kv_format)
    assert_same_bytes(cache, want)
    naive_insert(want, kv, slots, kv_format)  # and the torch kernel agrees with the reference here too
    assert_same_bytes(cache, want)


@requires_interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's warnings about NaN and inf arithmetic
@pytest.mark.parametrize("kv_dtype", list(FLOATS), ids=lambda d: f"kv_{d}")
@pytest.mark.parametrize("kv_format", ref.FORMATS)
def test_interpreter_non_finite(kv_format, kv_dtype):
    """The Triton kernels store the same canonical NaN and saturated bytes as the reference, and
    gather non-finite contents to the same bits."""
    cache_dtype = F32 if kv_dtype == "bf16" else BF16
    cache = cache_for(kv_format, "ps3-pad7", dtype=cache_dtype)
    want = cache_for(kv_format, "ps3-pad7", dtype=cache_dtype)
    kv = make_non_finite_kv(5, FMT_DIM[kv_format], FLOATS[kv_dtype], seed=42)
    slots = torch.tensor([0, 4, 7, 11, 5])
    kernels.kv_cache_insert_triton(kv, slots, cache, kv_format)
    naive_insert(want, kv, slots, kv_format)
    assert_same_bytes(cache, want)
    source = non_finite_cache(kv_format)
    for dtype in (BF16, F16, F32):
        got = poison(torch.empty(6, FMT_DIM[kv_format], dtype=dtype))
        kernels.kv_cache_gather_triton(source, torch.arange(6), kv_format, dtype, out=got)
        assert torch.equal(int_bits(got), int_bits(naive_gather(source, torch.arange(6), kv_format, dtype)))


@requires_interpreter
@pytest.mark.parametrize("kv_format", ref.FORMATS)
def test_interpreter_rounding(kv_format):
    """The integer rounding of the Triton kernels (which the interpreter runs) on the close calls of
    ``make_rounding_kv``: the same bytes as the PyTorch kernel from every input dtype into every cache
    dtype, and the same bits gathered back into every dtype."""
    cache_dtypes = (BF16, F16, F32) if kv_format == "auto" else (BF16,)
    for kv_dtype in (F32, BF16):
        kv = make_rounding_kv(kv_format, seed=52).to(kv_dtype)
        n = kv.shape[0]
        slots = torch.randperm(3 * n, generator=torch.Generator().manual_seed(n))[:n]
        for cache_dtype in cache_dtypes:
            got = ref.make_cache(n, 3, kv_format, dtype=cache_dtype, page_pad=7)
            want = ref.make_cache(n, 3, kv_format, dtype=cache_dtype, page_pad=7)
            kernels.kv_cache_insert_triton(kv, slots, got, kv_format)
            kernels.kv_cache_insert_torch(kv, slots, want, kv_format)
            assert_same_bytes(got, want)
            for dtype in (BF16, F16, F32):
                out = poison(torch.empty(n, FMT_DIM[kv_format], dtype=dtype))
                kernels.kv_cache_gather_triton(got, slots, kv_format, dtype, out=out)
                assert torch.equal(int_bits(out), int_bits(naive_gather(want, slots, kv_format, dtype)))


@pytest.fixture(params=[1024, 4], ids=["slots_per_program_1", "slots_per_program_4"])
def gather_slots(request, monkeypatch):
    """Slots per program of the gather kernels: one (small calls, as planned) or four (a large call's
    plan, forced on a small one: one slot per 4 of the call)."""
    monkeypatch.setattr(kernels, "_GATHER_ROWS_PER_SLOT", request.param)
    kernels._PLANS.clear()
    yield request.param
    kernels._PLANS.clear()


def test_gather_slots_per_program():
    assert [kernels._gather_slots(n, 8) for n in (1, 128, 1023, 1024, 2048, 4096, 5000, 8192, 2**20)] == \
        [1, 1, 1, 1, 2, 4, 4, 8, 8]
    assert kernels._gather_slots(4096, 2) == 2 and kernels._gather_slots(2**30, 64) == 16


@requires_interpreter
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["out_bf16", "out_fp16", "out_fp32"])
@pytest.mark.parametrize("kv_format", ref.FORMATS)
def test_interpreter_gather(kv_format, dtype, gather_slots):
    cache = cache_for(kv_format, "ps3-pad7", dtype=F16 if kv_format == "auto" else BF16)
    written = torch.tensor([0, 3, 4, 11, 9])
    ref.fill_cache(cache, written, make_kv(5, FMT_DIM[kv_format], F32, seed=13), kv_format)
    for slot_dtype in (torch.int32, torch.int64):
        slots = torch.tensor([4, -1, 11, 9, 12, 0, 3, 2**31 - 1, 4, -3, 11, 0, 9, 3, 3, 4, 0, 11, -1],
                             dtype=slot_dtype)  # 19 rows: several programs, the last partial
        want = naive_gather(cache, slots, kv_format, dtype)
        got = poison(torch.empty(slots.shape[0], FMT_DIM[kv_format], dtype=dtype))
        kernels.kv_cache_gather_triton(cache, slots, kv_format, dtype, out=got)
        assert torch.equal(got, want)
        wide = poison(torch.empty(FMT_DIM[kv_format] + 5, slots.shape[0], dtype=dtype))
        kernels.kv_cache_gather_triton(cache, slots, kv_format, dtype, out=wide[2 : 2 + FMT_DIM[kv_format]].T)
        assert torch.equal(wide[2 : 2 + FMT_DIM[kv_format]].T, want)
        assert wide[:2].isnan().all() and wide[2 + FMT_DIM[kv_format]:].isnan().all()


@requires_interpreter
@pytest.mark.parametrize("dim", [100, 1024, 2100])
def test_interpreter_insert_auto_dims(dim):
    """A bf16 / float32 "auto" cache of any D: the first 1,024 dims are loaded before the slot is
    tested, the rest (D = 2,100: two more steps, the last partial) inside; skipped and out-of-range
    slots write nothing."""
    for kv_dtype, cache_dtype in ((BF16, BF16), (F16, F32)):
        cache = cache_for("auto", "ps3-pad7", dim=dim, dtype=cache_dtype)
        want = cache_for("auto", "ps3-pad7", dim=dim, dtype=cache_dtype)
        slots = torch.tensor([5, -1, 11, 0, 2**40, 7])
        kv = make_kv(slots.shape[0], 2 * dim, kv_dtype, seed=dim)[:, ::2]  # strided
        kernels.kv_cache_insert_triton(kv, slots, cache, "auto")
        naive_insert(want, kv, slots, "auto")
        assert_same_bytes(cache, want)


@requires_interpreter
@pytest.mark.parametrize("dim", [100, 1100])
def test_interpreter_gather_auto_dims(dim, gather_slots):
    """A bf16/fp16 cache of any D gathered to float32 (the dequantising kernel): a row is one tile up to
    1,024 dims (D = 100: 128 with the rest masked) or several (D = 1,100: a full tile, then 76 dims of a
    second), each stored only where it lies inside D; one or several slots per program."""
    cache = torch.randn(3, 4, dim, generator=torch.Generator().manual_seed(dim)).to(F16)
    cache[1, 2] = float("nan")  # a slot no valid index reads
    slots = torch.tensor([5, -1, 11, 0, 12, 7, 2**31 - 1, 3, 11])  # 9 slots: the last program partial
    want = naive_gather(cache, slots, "auto", F32)
    got = poison(torch.empty(slots.shape[0], dim, dtype=F32))
    kernels.kv_cache_gather_triton(cache, slots, "auto", F32, out=got)
    assert torch.equal(got, want)


@requires_interpreter
@pytest.mark.parametrize("dim", [100, 576, 1024, 4100])
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "fp16", "fp32"])
def test_interpreter_gather_auto_copy(dtype, dim, gather_slots):
    """An "auto" cache gathered into its own dtype copies bits (``_kv_cache_copy_kernel``: a row in one
    tile of a power of two of dims and one of the rest; D = 4,100 is past the copy kernel's limit and
    takes the dequantising kernel): NaN patterns of every kind become the canonical NaN, infinities,
    signed zeros and subnormals keep their bits, empty slots give zeros, and the bytes equal the
    dequantising kernel's."""
    pages, page_size = 2, 3
    cache = torch.randn(pages, page_size, dim + 5, generator=torch.Generator().manual_seed(dim)).to(dtype)
    cache = cache[:, :, 2 : 2 + dim]  # a row stride wider than D
    bits = int_bits(cache)
    width = 16 if dtype != F32 else 32
    nans = [0x7FC1, -0x003F, 0x7F81] if dtype == BF16 else [0x7E01, -0x0200, 0x7C01] if dtype == F16 else \
        [0x7F800001, -0x00000001, 0x7FC00123]
    copies = dim <= kernels._COPY_MAX_DIM
    specials = [float("inf"), float("-inf"), -0.0, torch.finfo(dtype).tiny / 4]
    for j, v in enumerate(nans):
        bits[0, 1, j * 7 % dim] = v - (1 << width) if v >= 1 << (width - 1) else v
    for j, v in enumerate(specials):
        cache[1, 0, (3 + j * 11) % dim] = v
    cache[1, 2] = float("nan")  # a slot no valid index reads
    slots = torch.tensor([1, -1, 3, 0, 6, 4, 2**31 - 1, 2, 3])  # 9 slots: the last program partial
    want = naive_gather(cache, slots, "auto", dtype)
    assert (kernels._copy_launch(cache, slots, want, 9) is not None) == copies
    got = poison(torch.empty(slots.shape[0], dim, dtype=dtype))
    kernels.kv_cache_gather_triton(cache, slots, "auto", dtype, out=got)
    assert torch.equal(int_bits(got), int_bits(want))
    assert (int_bits(got[0]) == int_bits(cache[0, 1])).sum() == dim - len(nans)  # only the NaNs changed
    assert torch.equal(got[1], torch.zeros(dim, dtype=dtype)) and torch.equal(got[6], got[1])
    try:
        kernels.GATHER_COPY = False
        other = poison(torch.empty(slots.shape[0], dim, dtype=dtype))
        kernels.kv_cache_gather_triton(cache, slots, "auto", dtype, out=other)
    finally:
        kernels.GATHER_COPY = True
    assert torch.equal(int_bits(other), int_bits(got))


# =====================================================================================================
# opcheck
# =====================================================================================================


def opcheck_cases():
    for kv_format in ref.FORMATS:
        dim = FMT_DIM[kv_format]
        cache = torch.zeros_like(cache_for(kv_format, "ps3-pad7"))  # no NaN: opcheck compares caches
        num_slots = cache.shape[0] * cache.shape[1]
        kernels.kv_cache_insert_torch(make_kv(num_slots, dim, F32, 20), torch.arange(num_slots), cache, kv_format)
        slots = make_slots(num_slots, 6, seed=21)
        yield f"insert-{kv_format}", ops.kv_cache_insert.default, (
            make_kv(slots.shape[0], dim, BF16, 22), slots, cache.clone(), kv_format), {}
        yield f"gather-{kv_format}", ops.kv_cache_gather.default, (cache, slots.int(), kv_format), {}
        yield f"gather.out-{kv_format}", ops.kv_cache_gather.out, (cache, slots, kv_format, F32), {
            "out": torch.empty(slots.shape[0], dim, dtype=F32)}


@pytest.mark.parametrize("case", list(opcheck_cases()), ids=lambda c: c[0])
def test_opcheck(case):
    _, op, args, kwargs = case
    torch.library.opcheck(op, args, kwargs)


# =====================================================================================================
# torch.compile: one graph, no graph breaks, no recompiles across batch sizes
# =====================================================================================================


def cache_step(kv576, kv512, slots, read_slots, cache_auto, cache_656, cache_584):
    """Insert a batch into one cache of each format, then read some slots back."""
    outs = []
    for kv_format, kv, cache in (("auto", kv576, cache_auto), ("fp8_656", kv576, cache_656),
                                 ("fp8_584", kv512, cache_584)):
        tsm.kv_cache_insert(kv, slots, cache, kv_format=kv_format)
        # auto: the default dtype, the cache's own (the copy kernel); the others dequantise to float32
        outs.append(tsm.kv_cache_gather(cache, read_slots, kv_format=kv_format,
                                        dtype=None if kv_format == "auto" else F32))
    return outs


def step_args(n: int, seed: int):
    caches = [cache_for(f, "ps3-pad7") for f in ref.FORMATS]
    slots = make_slots(12, n, seed)
    read_slots = slots.flip(0).to(torch.int32)  # the slots just written, and the empty ones
    return (make_kv(slots.shape[0], 576, BF16, seed), make_kv(slots.shape[0], 512, BF16, seed), slots, read_slots,
            *caches)


def check_step(args, outs):
    kv576, kv512, slots, read_slots, *caches = args
    for kv_format, kv, cache, out in zip(ref.FORMATS, (kv576, kv576, kv512), caches, outs):
        want = cache_for(kv_format, "ps3-pad7")
        naive_insert(want, kv, slots, kv_format)
        assert_same_bytes(cache, want)
        assert torch.equal(out, naive_gather(want, read_slots, kv_format, F32))


def test_compile_no_recompiles():
    assert_no_recompiles(cache_step, [step_args(n, seed=n) for n in (2, 6, 10)], check_step)


# =====================================================================================================
# Errors: checked on metadata, ValueError naming the argument
# =====================================================================================================


def _valid_call(op: str) -> dict:
    """Keyword arguments of a valid call of the public function ``op`` (an fp8_656 cache of 64-row pages)."""
    cache = cache_for("fp8_656", "ps64")
    slots = torch.arange(4)
    if op == "kv_cache_insert":
        return dict(kv=torch.zeros(4, 576, dtype=BF16), slot_mapping=slots, kv_cache=cache, kv_format="fp8_656")
    return dict(kv_cache=cache, slots=slots, kv_format="fp8_656")


def _u8(*shape):
    return torch.zeros(*shape, dtype=torch.uint8)


# (operator, mutation of a valid call, expected message)
ERRORS = {
    "format": ("kv_cache_insert", set_args(kv_format=lambda a: "fp8"),
               r"kv_format: expected one of 'auto', 'fp8_656', 'fp8_584', got 'fp8'"),
    "kv_dtype": ("kv_cache_insert", set_args(kv=lambda a: a["kv"].int()),
                 r"kv: expected dtype bfloat16 or float16 or float32, got int32"),
    "kv_dim": ("kv_cache_insert",
               set_args(kv_cache=lambda a: cache_for("fp8_584", "ps64"), kv_format=lambda a: "fp8_584"),
               r"kv: expected shape\[1\] == the cache's latent dimension D \(512\)"),
    "slot_dtype": ("kv_cache_insert", set_args(slot_mapping=lambda a: a["slot_mapping"].int()),
                   r"slot_mapping: expected dtype int64, got int32"),
    "slot_len": ("kv_cache_insert", set_args(slot_mapping=lambda a: a["slot_mapping"][:3]),
                 r"slot_mapping: expected shape\[0\] == kv.shape\[0\] \(4\), got shape \(3,\)"),
    "slot_device": ("kv_cache_insert", set_args(slot_mapping=lambda a: a["slot_mapping"].to("meta")),
                    r"slot_mapping: expected a tensor on cpu \(where the first argument is\), got meta"),
    "cache_dtype": ("kv_cache_insert", set_args(kv_cache=lambda a: torch.zeros(2, 4, 656, dtype=BF16)),
                    r"kv_cache: expected dtype uint8, got bfloat16"),
    "cache_width": ("kv_cache_insert", set_args(kv_cache=lambda a: cache_for("fp8_584", "ps64")),
                    r"kv_cache: expected shape\[-1\] == 656"),
    "fp8_656_row_stride": ("kv_cache_insert", set_args(kv_cache=lambda a: _u8(2, 4, 700)[:, :, :656]),
                           r"kv_cache: expected stride\(1\) == 656 for fp8_656"),
    "pages_overlap": ("kv_cache_gather", set_args(kv_format=lambda a: "fp8_584", kv_cache=lambda a: torch.as_strided(
        _u8(5000), (3, 4, 584), (1000, 584, 1))), r"kv_cache: expected stride\(0\) >= page_size \* 584"),
    # The bounds proof: a view whose strides reach fewer bytes than the fp8_584 page layout uses.
    "fp8_584_view_too_small": ("kv_cache_insert", set_args(
        kv=lambda a: a["kv"][:, :512], kv_format=lambda a: "fp8_584",
        kv_cache=lambda a: torch.as_strided(_u8(2 * 2336), (2, 4, 584), (2336, 10, 1))),
        r"kv_cache: expected a view that covers the fp8_584 layout of its pages \(2336 bytes from each page's "
        r"start, so stride\(1\) >= 584\), got shape \(2, 4, 584\) and strides \(2336, 10, 1\)"),
    "fp8_584_view_too_small_gather": ("kv_cache_gather", set_args(
        kv_format=lambda a: "fp8_584", kv_cache=lambda a: torch.as_strided(_u8(4000), (1, 4, 584), (4000, 583, 1))),
        r"kv_cache: expected a view that covers the fp8_584 layout"),
    "auto_last_stride": ("kv_cache_insert", set_args(kv_format=lambda a: "auto",
                                                 kv_cache=lambda a: torch.zeros(2, 4, 1152, dtype=BF16)[:, :, ::2]),
                         r"kv_cache: expected stride\(-1\) == 1"),
    "auto_dtype": ("kv_cache_gather", set_args(kv_format=lambda a: "auto",
                                           kv_cache=lambda a: torch.zeros(2, 4, 576, dtype=torch.int8)),
                   r"kv_cache: expected dtype bfloat16 or float16 or float32, got int8"),
    "slots_dtype": ("kv_cache_gather", set_args(slots=lambda a: a["slots"].float()),
                    r"slots: expected dtype int32 or int64, got float32"),
    "slots_rank": ("kv_cache_gather", set_args(slots=lambda a: a["slots"].view(2, 2)),
                   r"slots: expected a 1-D tensor, got shape \(2, 2\)"),
    "dtype": ("kv_cache_gather", set_args(dtype=lambda a: torch.int8),
              r"dtype: expected bfloat16 or float16 or float32 \(or None for bfloat16\), got int8"),
    "out_dtype": ("kv_cache_gather", set_args(dtype=lambda a: BF16, out=lambda a: torch.empty(4, 576, dtype=F16)),
                  r"out: expected dtype bfloat16, got float16"),
    "out_rows": ("kv_cache_gather", set_args(out=lambda a: torch.empty(5, 576, dtype=BF16)),
                 r"out: expected shape\[0\] == len\(slots\) \(4\), got shape \(5, 576\)"),
    "out_dim": ("kv_cache_gather",
                set_args(kv_format=lambda a: "fp8_584", kv_cache=lambda a: cache_for("fp8_584", "ps64"),
                         out=lambda a: torch.empty(4, 576, dtype=BF16)),
                r"out: expected shape\[1\] == the cache's latent dimension D \(512\)"),
    "out_not_a_tensor": ("kv_cache_gather", set_args(out=lambda a: (torch.empty(4, 576, dtype=BF16),)),
                         r"out: expected a tensor \(the out buffer\), got tuple"),
    # written tensors that alias an input (checked on data pointers in the real implementation)
    "kv_inside_cache": ("kv_cache_insert", set_args(
        kv_format=lambda a: "auto", kv_cache=lambda a: cache_for("auto", "ps64", dtype=F32),
        kv=lambda a: a["kv_cache"][1, :4]), r"kv_cache: overlaps the memory of input kv"),
    "out_inside_cache": ("kv_cache_gather", set_args(
        kv_format=lambda a: "auto", kv_cache=lambda a: cache_for("auto", "ps64", dtype=F32),
        out=lambda a: a["kv_cache"][0, 10:14]), r"out: overlaps the memory of input kv_cache"),
}


@pytest.mark.parametrize("case", list(ERRORS), ids=str)
def test_errors(case):
    op, mutate, match = ERRORS[case]
    args = _valid_call(op)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        getattr(tsm, op)(**args)


def test_valid_calls_pass():
    """The calls the error table mutates are valid as they are; a fp8_584 view with any stride(1) that
    still covers the page layout is accepted and reads the layout, not stride(1)."""
    for op in ("kv_cache_insert", "kv_cache_gather"):
        getattr(tsm, op)(**_valid_call(op))
    flat = torch.full((3 * 2400,), 0xFF, dtype=torch.uint8)
    odd = torch.as_strided(flat, (3, 4, 584), (2400, 600, 1))  # stride(1) = 600 > 584: the view covers the layout
    plain = ref.make_cache(3, 4, "fp8_584", page_pad=2400 - 4 * 584)
    kv = make_kv(5, 512, F32, seed=3)
    slots = torch.tensor([0, 3, 5, 11, -1])
    tsm.kv_cache_insert(kv, slots, odd, kv_format="fp8_584")
    tsm.kv_cache_insert(kv, slots, plain, kv_format="fp8_584")
    assert torch.equal(raw_bytes(odd), raw_bytes(plain))


# =====================================================================================================
# GPU: CUDA parity, manual CUDA-graph capture, reduce-overhead compile
# =====================================================================================================


@requires_cuda
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kv_format", ref.FORMATS)
def test_cuda_parity(kv_format, layout):
    """The CUDA kernels write the same bytes and read the same values as the CPU kernels."""
    page_size, pad = LAYOUTS[layout]
    dim = FMT_DIM[kv_format]
    for kv_dtype in (BF16, F16, F32):
        cpu = ref.make_cache(40, page_size, kv_format, page_pad=pad)
        gpu = ref.make_cache(40, page_size, kv_format, page_pad=pad, device="cuda")
        num_slots = 40 * page_size
        slots = make_slots(num_slots, min(300, num_slots), seed=30)
        kv = make_kv(slots.shape[0], dim, kv_dtype, seed=31)
        tsm.kv_cache_insert(kv, slots, cpu, kv_format=kv_format)
        tsm.kv_cache_insert(kv.cuda(), slots.cuda(), gpu, kv_format=kv_format)
        assert_same_bytes(gpu, cpu)
        for dtype in (BF16, F16, F32):
            want = tsm.kv_cache_gather(cpu, slots, kv_format=kv_format, dtype=dtype)
            got = tsm.kv_cache_gather(gpu, slots.int().cuda(), kv_format=kv_format, dtype=dtype)
            assert torch.equal(got.cpu(), want)


def test_insert_warps():
    """4 warps per insert program; 2 for the fp8 formats from _INSERT_TWO_WARPS_MIN tokens on."""
    edge = kernels._INSERT_TWO_WARPS_MIN
    for kv_format in ref.FORMATS:
        many = 4 if kv_format == "auto" else 2
        assert [kernels.insert_warps(n, kv_format) for n in (1, 128, edge - 1, edge, 2**20)] == [4, 4, 4, many, many]


@requires_cuda
@pytest.mark.parametrize("kv_format", ref.FORMATS)
def test_cuda_parity_many_tokens(kv_format):
    """Past _INSERT_TWO_WARPS_MIN tokens (the two-warp insert of the fp8 formats) the CUDA insert writes
    the CPU kernel's bytes, close calls of rounding included, and a gather reads the CPU kernel's values."""
    page_size, pad = LAYOUTS["ps3-pad7"]
    n_valid = kernels._INSERT_TWO_WARPS_MIN + 300
    pages = -(-n_valid // page_size) + 40
    cpu = ref.make_cache(pages, page_size, kv_format, page_pad=pad)
    gpu = ref.make_cache(pages, page_size, kv_format, page_pad=pad, device="cuda")
    slots = make_slots(pages * page_size, n_valid, seed=32)
    kv = make_kv(slots.shape[0], FMT_DIM[kv_format], BF16, seed=33).float()
    rounding = make_rounding_kv(kv_format, seed=34)
    kv[:rounding.shape[0]] = rounding[:kv.shape[0]]
    assert kernels.insert_warps(kv.shape[0], kv_format) == (4 if kv_format == "auto" else 2)
    tsm.kv_cache_insert(kv, slots, cpu, kv_format=kv_format)
    tsm.kv_cache_insert(kv.cuda(), slots.cuda(), gpu, kv_format=kv_format)
    assert_same_bytes(gpu, cpu)
    want = tsm.kv_cache_gather(cpu, slots, kv_format=kv_format, dtype=F32)
    got = tsm.kv_cache_gather(gpu, slots.cuda(), kv_format=kv_format, dtype=F32)
    assert torch.equal(int_bits(got.cpu()), int_bits(want))


# The quantised tiles of the fp8 formats (tiles per token, values per tile) and every non-negative e4m3
# value (0 .. 448).
FP8_TILES = {"fp8_656": (4, 128), "fp8_584": (7, 64)}
E4M3_VALUES = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def make_rounding_kv(kv_format: str, seed: int) -> torch.Tensor:
    """float32 rows whose every rounding is a close call. fp8 formats: each quantised tile holds +-448
    times a power of two ``2**k`` (so the scale is exactly ``2**k`` in both formats) and, times the same
    ``2**k``, every e4m3 value, every midpoint of two neighbouring e4m3 values (subnormal ones included)
    and the floats just above and below each midpoint, with random signs; the bf16 dims hold exact bf16
    ties and their neighbours. "auto": random float32 bit patterns (every class: subnormal, NaN, inf)
    and exact bf16 and fp16 ties with their neighbours."""
    g = torch.Generator().manual_seed(seed)
    sign = lambda t: torch.where(torch.rand(t.shape, generator=g) < 0.5, -t, t)  # noqa: E731
    bf16_ties = ((torch.randint(0, 0x7F7F, (256,), generator=g, dtype=torch.int32) << 16) | 0x8000).view(F32)
    bf16_ties = torch.cat([bf16_ties, torch.nextafter(bf16_ties, torch.zeros(1)),
                           torch.nextafter(bf16_ties, torch.full((1,), float("inf")))])
    if kv_format == "auto":
        bits = torch.randint(-(2**31), 2**31 - 1, (3 * 576,), generator=g, dtype=torch.int64).to(torch.int32)
        h = torch.randint(0, 0x7BFF, (256,), generator=g, dtype=torch.int16).view(F16).double()
        ulp = (torch.nextafter(h.to(F16), torch.full((1,), 65504.0, dtype=F16)).double() - h)
        f16_ties = (h + ulp / 2).float()  # exact in float32
        f16_ties = torch.cat([f16_ties, torch.nextafter(f16_ties, torch.zeros(1))])
        vals = torch.cat([bits.view(F32), sign(bf16_ties), sign(f16_ties)])
        vals = torch.cat([vals, torch.zeros((-vals.numel()) % 576)])
        return vals[torch.randperm(vals.numel(), generator=g)].view(-1, 576)
    e4m3 = E4M3_VALUES
    mids = (e4m3[:-1] + e4m3[1:]) / 2
    cands = torch.cat([e4m3, mids, torch.nextafter(mids, torch.zeros(1)), torch.nextafter(mids, e4m3[-1:])])
    tiles, tile = FP8_TILES[kv_format]
    per_row = tiles * (tile - 1)
    rows = -(-cands.numel() // per_row)
    vals = torch.cat([cands, cands[torch.randint(0, cands.numel(), (rows * per_row - cands.numel(),), generator=g)]])
    body = sign(vals[torch.randperm(vals.numel(), generator=g)].view(rows, tiles, tile - 1))
    top = sign(torch.full((rows, tiles, 1), 448.0))
    scale = 2.0 ** torch.randint(-20, 21, (rows, tiles, 1), generator=g).float()
    quantised = (torch.cat([top, body], dim=2) * scale).view(rows, tiles * tile)
    rope = sign(bf16_ties[torch.randint(0, bf16_ties.numel(), (rows, 64), generator=g)])
    return torch.cat([quantised, rope], dim=1)


@requires_cuda
@pytest.mark.parametrize("kv_format", ref.FORMATS)
def test_cuda_rounding_and_non_finite(kv_format):
    """The hardware conversions of the CUDA kernels round every close call as the CPU kernels do, and
    store the same canonical NaN and saturated bytes: inserts of ``make_rounding_kv`` and
    ``make_non_finite_kv`` rows from every input dtype into every cache dtype ("auto") write the same
    bytes, and gathers of those caches and of ``non_finite_cache`` into every dtype read the same bits."""
    cache_dtypes = (BF16, F16, F32) if kv_format == "auto" else (BF16,)
    for kv_dtype in (F32, BF16, F16):
        rounding = make_rounding_kv(kv_format, seed=50)
        if kv_dtype == F16:  # keep the fp16 input finite where the float32 one is
            rounding = rounding.clamp(-65504.0, 65504.0) if kv_format == "auto" else rounding * 2.0**-30
        for kv in (rounding.to(kv_dtype), make_non_finite_kv(6, FMT_DIM[kv_format], kv_dtype, seed=51)):
            for cache_dtype in cache_dtypes:
                n = kv.shape[0]
                cpu = ref.make_cache(-(-n // 3) + 1, 3, kv_format, dtype=cache_dtype, page_pad=7)
                gpu = ref.make_cache(-(-n // 3) + 1, 3, kv_format, dtype=cache_dtype, page_pad=7, device="cuda")
                slots = torch.randperm(cpu.shape[0] * 3, generator=torch.Generator().manual_seed(n))[:n]
                tsm.kv_cache_insert(kv, slots, cpu, kv_format=kv_format)
                tsm.kv_cache_insert(kv.cuda(), slots.cuda(), gpu, kv_format=kv_format)
                assert_same_bytes(gpu, cpu)
                for dtype in (BF16, F16, F32):
                    want = tsm.kv_cache_gather(cpu, slots, kv_format=kv_format, dtype=dtype)
                    got = tsm.kv_cache_gather(gpu, slots.cuda(), kv_format=kv_format, dtype=dtype)
                    assert torch.equal(int_bits(got.cpu()), int_bits(want))
    source = non_finite_cache(kv_format)
    for dtype in (BF16, F16, F32):
        want = tsm.kv_cache_gather(source, torch.arange(6), kv_format=kv_format, dtype=dtype)
        got = tsm.kv_cache_gather(source.cuda(), torch.arange(6, device="cuda"), kv_format=kv_format, dtype=dtype)
        assert torch.equal(int_bits(got.cpu()), int_bits(want))


def test_rounding_kv_hits_ties():
    """``make_rounding_kv`` holds what it promises: exact e4m3 midpoints (fp8 formats, after the
    tile's power of two) and exact bf16 ties (the bf16 dims and "auto")."""
    for kv_format in ref.FORMATS:
        x = make_rounding_kv(kv_format, seed=50)
        bf16 = x if kv_format == "auto" else x[:, -64:]  # the bf16 dims of the fp8 formats
        ties = ((bf16.contiguous().view(torch.int32) & 0xFFFF) == 0x8000).sum().item()
        assert ties >= (200 if kv_format == "auto" else bf16.numel() // 5), kv_format
        if kv_format != "auto":
            tiles, tile = FP8_TILES[kv_format]
            q = x[:, : tiles * tile].view(x.shape[0], tiles, tile)
            scale = q.abs().amax(dim=2, keepdim=True) / 448
            assert torch.equal(scale.log2(), scale.log2().round())  # powers of two
            y = (q / scale).abs()
            down = y.to(torch.float8_e4m3fn).float()
            e4m3 = E4M3_VALUES
            mids = (e4m3[:-1] + e4m3[1:]) / 2
            assert torch.isin(mids, y).all()  # every midpoint occurs
            assert (down <= 448).all()


@requires_cuda
@pytest.mark.parametrize("kv_format", ref.FORMATS)
def test_cuda_graph_capture_replay(kv_format):
    """Capture insert + gather.out once; replay on new kv values and new slots."""
    dim = FMT_DIM[kv_format]
    mirror = cache_for(kv_format, "ps3-pad7")  # CPU cache updated by the CPU kernel alongside
    cache = cache_for(kv_format, "ps3-pad7", device="cuda")
    num_slots = cache.shape[0] * cache.shape[1]

    def batch(seed):
        slots = make_slots(num_slots, 4, seed)  # 4 valid and 6 empty entries: the same length every time
        return make_kv(slots.shape[0], dim, BF16, seed), slots, slots.flip(0).to(torch.int32)

    kv0, slots0, read0 = batch(0)
    n = slots0.shape[0]
    static_kv, static_slots, static_read = kv0.cuda(), slots0.cuda(), read0.cuda()
    out = torch.empty(n, dim, dtype=F32, device="cuda")
    out16 = torch.empty(n, dim, dtype=BF16, device="cuda")  # auto: the copy kernel (a bf16 cache)

    def step():
        ops.kv_cache_insert(static_kv, static_slots, cache, kv_format)
        ops.kv_cache_gather.out(cache, static_read, kv_format, F32, out=out)
        ops.kv_cache_gather.out(cache, static_read, kv_format, BF16, out=out16)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up compiles the kernels outside the capture (and writes batch 0)
    torch.cuda.current_stream().wait_stream(side)
    kernels.kv_cache_insert_torch(kv0, slots0, mirror, kv_format)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (1, 2, 3):
        kv, slots, read = batch(seed)
        static_kv.copy_(kv)
        static_slots.copy_(slots)
        static_read.copy_(read)
        poison(out)
        poison(out16)
        graph.replay()
        torch.cuda.synchronize()
        kernels.kv_cache_insert_torch(kv, slots, mirror, kv_format)
        assert_same_bytes(cache, mirror)
        assert torch.equal(out.cpu(), naive_gather(mirror, read, kv_format, F32))
        assert torch.equal(out16.cpu(), naive_gather(mirror, read, kv_format, BF16))


class CacheStep(torch.nn.Module):
    """One decode step's cache traffic with the caches in module buffers (the gpt-fast pattern)."""

    def __init__(self, caches):
        super().__init__()
        for kv_format, cache in zip(ref.FORMATS, caches):
            self.register_buffer(f"cache_{kv_format}", cache)

    def forward(self, kv576, kv512, slots, read_slots):
        return cache_step(kv576, kv512, slots, read_slots,
                          *(getattr(self, f"cache_{kv_format}") for kv_format in ref.FORMATS))


@requires_cuda
def test_reduce_overhead_takes_cuda_graph():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    mirrors = [ref.make_cache(NUM_PAGES, 64, f) for f in ref.FORMATS]
    module = CacheStep([ref.make_cache(NUM_PAGES, 64, f, device="cuda") for f in ref.FORMATS])
    compiled = torch.compile(module, mode="reduce-overhead", fullgraph=True)
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        for seed in range(4):
            slots = make_slots(NUM_PAGES * 64, 11, seed)  # 11 valid + 6 empty: the same shape every step
            kv576, kv512 = make_kv(slots.shape[0], 576, BF16, seed), make_kv(slots.shape[0], 512, BF16, seed)
            read = slots.flip(0).to(torch.int32)
            got = [x.cpu() for x in compiled(kv576.cuda(), kv512.cuda(), slots.cuda(), read.cuda())]
            want = cache_step(kv576, kv512, slots, read, *mirrors)
            for kv_format, g_, w_, cache, mirror in zip(ref.FORMATS, got, want, module.buffers(), mirrors):
                assert torch.equal(g_, w_), kv_format
                assert_same_bytes(cache, mirror)
    assert counters["inductor"]["cudagraph_skips"] == 0
