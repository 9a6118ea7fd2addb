"""Property tests (hypothesis) of every operator against the naive references, and determinism.

Each operator gets random shapes (zero-size batches and K = 1 included) and index values drawn from
the values an engine's scheduler can produce by mistake, mixed with valid ones:
{INT32_MIN, -123456, -2, -1, 0, capacity - 1, capacity, capacity + 1, INT32_MAX} for int32 indices
(``capacity``: the size of the table or cache the index refers to), the int64 extremes for positions
and slots, lengths below 0 and above K, negative block ids, rows without a single valid entry, sinks
of +-inf; cache slots that no valid entry may read hold NaN bytes. Backends: the CPU kernels (through
the registered operators), the Triton kernels through the interpreter (CPU machines), the CUDA kernels
(GPU machines).

Example counts come from a profile: ``ci`` (default without a GPU: few examples, derandomised, so the
suite stays fast and reproducible) or ``gpu`` (default with a GPU: ten times more, random). Set
``TSM_HYPOTHESIS_PROFILE=ci|gpu|thorough`` to choose (``thorough``: a hundred times ``ci``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import formats_reference as ref
import torch_sparse_mla as tsm
from common import HAS_CUDA, INTERPRETER, examples, same_layout_copy
from test_kv_cache import naive_gather, naive_insert, raw_bytes
from test_metadata import (
    Batch,
    ref_c128a,
    ref_compressed_slot_mapping,
    ref_decode_runtime_metadata,
    ref_swa,
    ref_topk_to_global,
    use_slot_search,
)
from test_sparse_gqa import NVFP4, Cfg, poison_unread_nvfp4
from test_sparse_gqa import _keys_read as gqa_keys_read
from test_sparse_gqa import _nvfp4_cache as gqa_nvfp4_cache
from test_sparse_gqa import assert_same_bytes as gqa_assert_same_bytes
from test_sparse_gqa import make_cache as gqa_make_cache
from test_sparse_gqa import naive_insert as gqa_naive_insert
from test_sparse_gqa import total_scale as gqa_total_scale
from test_sparse_gqa import assert_matches_reference as gqa_assert_matches
from test_sparse_mla import assert_matches
from test_sparse_mla import reference as mla_reference
from torch_sparse_mla.ops import kv_cache as kv_ops
from torch_sparse_mla.ops import metadata as md_ops
from torch_sparse_mla.ops import sparse_gqa as gqa_ops
from torch_sparse_mla.ops import sparse_mla as mla_ops

I32, I64 = torch.int32, torch.int64
BF16, F16, F32, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1



# The cuda backend carries the `cuda` marker, so marker selections (scripts/sanitize.sh) include it.
BACKENDS = (["cpu"] + (["interpreter"] if INTERPRETER else [])
            + ([pytest.param("cuda", marks=pytest.mark.cuda)] if HAS_CUDA else []))
backends = pytest.mark.parametrize("backend", BACKENDS)


class _RecordOps(TorchDispatchMode):
    """Notes every call of a ``torch.ops.sparse_mla`` operator that reaches the dispatcher (the public
    functions hand every call to it while a dispatch mode is active): the operator and copies of its
    arguments as they were before the call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "sparse_mla":
            self.calls.append((func, _copies((args, kwargs))))
        return func(*args, **kwargs)


def _copies(tree):
    return tree_map(lambda x: same_layout_copy(x) if isinstance(x, torch.Tensor) else x, tree)


def assert_fakes_match(calls) -> None:
    """Each recorded call made again through the functional overload of its operator (an ``out``
    call without its ``out`` tensors), once on copies of its arguments and once on fake copies
    (``FakeTensorMode``, what ``torch.compile`` traces with): the fake accepts the arguments the kernel
    accepted and its outputs have the real ones' shapes, dtypes and strides (of every dim longer than
    one)."""
    for func, (args, kwargs) in calls:
        values = {**dict(zip((a.name for a in func._schema.arguments), args)), **kwargs}
        if "num_tokens" not in values and "out" in values:  # compressed_slot_mapping: the out tensor's length
            values["num_tokens"] = values["out"].shape[0]
        functional = getattr(torch.ops.sparse_mla, func._schema.name.split("::")[1]).default
        named = {a.name: values[a.name] for a in functional._schema.arguments if a.name in values}
        real = tree_flatten(functional(**_copies(named)))[0]
        with FakeTensorMode() as mode:
            fake = tree_flatten(functional(**tree_map(
                lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, named)))[0]
        assert len(real) == len(fake), functional
        for r, f in zip(real, fake):
            if isinstance(r, torch.Tensor):
                long_dims = [d for d in range(r.dim()) if r.shape[d] > 1]
                assert (r.shape, r.dtype, [r.stride(d) for d in long_dims]) == \
                    (f.shape, f.dtype, [f.stride(d) for d in long_dims]), (functional, r.stride(), f.stride())


@pytest.fixture(autouse=True)
def _fakes_agree(request):
    """On the CPU backend, every operator call of a property test's examples also goes through its fake
    (``assert_fakes_match``): the fakes meet the random shapes the examples draw (empty batches, ``K = 1``,
    padded strides), not only the fixed ones of the ``opcheck`` tests."""
    spec = getattr(request.node, "callspec", None)
    if spec is None or spec.params.get("backend") != "cpu":
        yield
        return
    recorder = _RecordOps()
    with recorder:
        yield
    assert recorder.calls, "no operator call reached the dispatcher"
    assert_fakes_match(recorder.calls)


def special32(capacity: int) -> list[int]:
    return [INT32_MIN, -123456, -2, -1, 0, capacity - 1, capacity, capacity + 1, INT32_MAX]


def index32(capacity: int):
    """An int32 index: one of the special values, or a valid one (most of the time)."""
    valid = st.integers(0, max(capacity - 1, 0)) if capacity > 0 else st.just(-1)
    return st.one_of(valid, valid, st.sampled_from([v for v in special32(capacity) if INT32_MIN <= v <= INT32_MAX]))


def int64_extreme(valid_max: int):
    return st.one_of(st.integers(-3, valid_max), st.integers(INT64_MIN, INT64_MAX),
                     st.sampled_from([INT64_MIN, INT64_MIN + 1, INT32_MIN - 1, INT32_MAX, 2**31, INT64_MAX - 1,
                                      INT64_MAX]))


def to(t: torch.Tensor, backend: str) -> torch.Tensor:
    """``t`` on the backend's device with its whole storage: same strides, offset and padding bytes
    (``Tensor.to`` would compact a padded cache)."""
    if backend != "cuda":
        return t
    n = t.untyped_storage().nbytes() // t.element_size()
    flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, (n,), (1,)).to("cuda")
    return flat.as_strided(t.shape, t.stride(), t.storage_offset())


def bits(t: torch.Tensor) -> torch.Tensor:
    """A view whose ``torch.equal`` compares bit patterns (NaN included)."""
    view = {F32: I32, BF16: torch.int16, F16: torch.int16, FP8: torch.uint8}.get(t.dtype)
    return (t.view(view) if view is not None else t).cpu()


# =====================================================================================================
# Metadata
# =====================================================================================================


@st.composite
def metadata_batches(draw):
    """A batch of requests and tokens with arbitrary index values (see the module docstring)."""
    num_reqs = draw(st.integers(0, 5))
    max_blocks = draw(st.integers(1, 4))
    query_lens = [draw(st.integers(0, 5)) for _ in range(num_reqs)]
    qsl = [0]
    for ql in query_lens:
        qsl.append(qsl[-1] + ql)
    seq_lens = [ql + draw(st.integers(-3, 30)) for ql in query_lens]
    table = [[draw(index32(60)) for _ in range(max_blocks)] for _ in range(num_reqs)]
    t = draw(st.integers(0, 8))
    k = draw(st.integers(0, 6))
    positions = [draw(int64_extreme(40)) for _ in range(t)]
    token_to_req = [draw(index32(num_reqs)) for _ in range(t)]
    slot_mapping = [draw(st.sampled_from([-1, 0, 5, INT64_MIN, INT64_MAX])) for _ in range(t)]
    local = [[draw(index32(max_blocks * 4)) for _ in range(k)] for _ in range(t)]
    if t and k and draw(st.booleans()):
        local[0] = [draw(st.sampled_from([-1, INT32_MIN, -123456, INT32_MAX])) for _ in range(k)]  # all invalid
    return Batch(
        query_start_loc=torch.tensor(qsl, dtype=I32),
        seq_lens=torch.tensor(seq_lens, dtype=I32),
        block_table=torch.tensor(table, dtype=I32).reshape(num_reqs, max_blocks),
        positions=torch.tensor(positions, dtype=I64),
        token_to_req=torch.tensor(token_to_req, dtype=I32),
        slot_mapping=torch.tensor(slot_mapping, dtype=I64),
        num_decode=draw(st.integers(0, t)),
        local_indices=torch.tensor(local, dtype=I32).reshape(t, k),
    )


def _lists(b: Batch) -> dict:
    return {"qsl": b.query_start_loc.tolist(), "seq_lens": b.seq_lens.tolist(), "bt": b.block_table.tolist(),
            "pos": b.positions.tolist(), "ttr": b.token_to_req.tolist(), "sm": b.slot_mapping.tolist(),
            "local": b.local_indices.tolist()}


def _i32_out(backend, *shape):
    return to(torch.full(shape, -12345, dtype=I32), backend)


def _two_requests() -> Batch:
    """Two requests of 2 and 1 query tokens whose every token closes an entry (ratio 1) in a valid block."""
    empty = torch.zeros(0, dtype=I64)
    return Batch(query_start_loc=torch.tensor([0, 2, 3], dtype=I32), seq_lens=torch.tensor([5, 7], dtype=I32),
                 block_table=torch.tensor([[1, 2], [3, 4]], dtype=I32), positions=empty, token_to_req=empty.to(I32),
                 slot_mapping=empty, num_decode=0, local_indices=torch.zeros(0, 0, dtype=I32))


@backends
@examples(40)
@given(b=metadata_batches(), block_size=st.sampled_from([1, 2, 4, 64]), ratio=st.sampled_from([1, 2, 3, 4, 128]),
       pad=st.integers(0, 3), form=st.sampled_from(["default", "gather", "table", "search"]))
@example(b=_two_requests(), block_size=4, ratio=1, pad=1, form="table")  # every output a slot, in each form
@example(b=_two_requests(), block_size=4, ratio=1, pad=1, form="gather")
@example(b=_two_requests(), block_size=4, ratio=1, pad=1, form="search")
def test_compressed_slot_mapping(backend, b, block_size, ratio, pad, form):
    l = _lists(b)
    n = l["qsl"][-1] + pad
    args = [to(x, backend) for x in (b.query_start_loc, b.seq_lens, b.block_table)]
    out = to(torch.full((n,), -12345, dtype=I64), backend)
    if backend == "interpreter":
        # ``form``: one of the kernel's ways of finding a token's request whatever the number of
        # requests (``search``: the binary search), or its default choice
        with pytest.MonkeyPatch.context() as mp:
            if form != "default":
                use_slot_search(mp, form)
            md_ops.compressed_slot_mapping_triton(*args, block_size, ratio, out=out)
    else:
        tsm.compressed_slot_mapping(*args, block_size=block_size, compress_ratio=ratio, out=out)
    assert out.tolist() == ref_compressed_slot_mapping(l["qsl"], l["seq_lens"], l["bt"], n, block_size, ratio)


@backends
@examples(40)
@given(b=metadata_batches(), ratio=st.sampled_from([1, 3, 4, 128]), block_size=st.sampled_from([1, 3, 64]),
       width=st.sampled_from([0, 1, 5, 130]))
def test_c128a_topk_indices(backend, b, ratio, block_size, width):
    l = _lists(b)
    t, d = len(l["pos"]), b.num_decode
    outs = (_i32_out(backend, d, width + 1), _i32_out(backend, d), _i32_out(backend, t - d, width + 1))
    args = [to(x, backend) for x in (b.positions, b.token_to_req, b.block_table, b.slot_mapping)]
    if backend == "interpreter":
        md_ops.c128a_topk_indices_triton(*args, d, ratio, block_size, width, decode_indices=outs[0],
                                         decode_lens=outs[1], prefill_indices=outs[2])
    else:
        tsm.c128a_topk_indices(*args, num_decode_tokens=d, compress_ratio=ratio, block_size=block_size, width=width,
                               out=outs)
    dec, lens, pre = ref_c128a(l["pos"], l["ttr"], l["bt"], l["sm"], d, ratio, block_size, width)
    assert outs[0][:, :width].tolist() == (dec or []) and outs[1].tolist() == lens
    assert outs[2][:, :width].tolist() == (pre or [])
    assert (outs[0][:, width:] == -12345).all() and (outs[2][:, width:] == -12345).all()


@backends
@examples(40)
@given(seq_lens=st.lists(st.one_of(st.integers(0, 5000), st.sampled_from([INT32_MIN, INT32_MIN + 1, -1, INT32_MAX])),
                         max_size=6), q=st.integers(1, 5))
def test_decode_runtime_metadata(backend, seq_lens, q):
    s = to(torch.tensor(seq_lens, dtype=I32), backend)
    outs = (_i32_out(backend, len(seq_lens) * q), _i32_out(backend, len(seq_lens) * q))
    if backend == "interpreter":
        md_ops.decode_runtime_metadata_triton(s, q, kv_segment_lens=outs[0], qo_offset=outs[1])
    else:
        tsm.decode_runtime_metadata(s, decode_query_len=q, out=outs)
    kv, qo = ref_decode_runtime_metadata(seq_lens, q)
    assert outs[0].tolist() == kv and outs[1].tolist() == qo


@backends
@examples(40)
@given(b=metadata_batches(), window=st.sampled_from([1, 3, 128, 129]), block_size=st.sampled_from([1, 4, 64]))
def test_swa_indices(backend, b, window, block_size):
    l = _lists(b)
    t = len(l["pos"])
    outs = (_i32_out(backend, t, window), _i32_out(backend, t))
    args = [to(x, backend) for x in (b.positions, b.token_to_req, b.block_table, b.slot_mapping)]
    if backend == "interpreter":
        md_ops.swa_indices_triton(*args, window, block_size, indices=outs[0], lens=outs[1])
    else:
        tsm.swa_indices(*args, window=window, block_size=block_size, out=outs)
    idx, lens = ref_swa(l["pos"], l["ttr"], l["bt"], l["sm"], window, block_size)
    assert outs[0].tolist() == idx and outs[1].tolist() == lens


@backends
@examples(40)
@given(b=metadata_batches(), block_size=st.sampled_from([1, 4, 64]))
def test_compressed_topk_to_global(backend, b, block_size):
    l = _lists(b)
    t, k = b.local_indices.shape
    outs = (_i32_out(backend, t, k), _i32_out(backend, t))
    args = [to(x, backend) for x in (b.local_indices, b.token_to_req, b.block_table, b.slot_mapping)]
    if backend == "interpreter":
        md_ops.compressed_topk_to_global_triton(*args, block_size, indices=outs[0], lens=outs[1])
    else:
        tsm.compressed_topk_to_global(*args, block_size=block_size, out=outs)
    idx, lens = ref_topk_to_global(l["local"], l["ttr"], l["bt"], l["sm"], block_size)
    assert outs[0].tolist() == idx and outs[1].tolist() == lens


# =====================================================================================================
# KV cache
# =====================================================================================================

FMT_DIM = {"auto": 96, "fp8_656": 576, "fp8_584": 512}  # auto: a D that is not a power of two


@st.composite
def caches(draw):
    kv_format = draw(st.sampled_from(ref.FORMATS))
    pages, page_size = draw(st.integers(0, 3)), draw(st.sampled_from([1, 3, 16]))
    cache_dtype = draw(st.sampled_from([BF16, F16, F32])) if kv_format == "auto" else BF16
    pad = draw(st.sampled_from([0, 1, 7]))
    cache = ref.make_cache(pages, page_size, kv_format, dim=FMT_DIM["auto"], dtype=cache_dtype, page_pad=pad)
    return kv_format, cache


def slot_values(capacity: int):
    return st.one_of(st.integers(0, max(capacity - 1, 0)) if capacity else st.just(-1),
                     st.sampled_from(special32(capacity) + [INT64_MIN, INT64_MAX, -(2**40), 2**40]))


def draw_slots(data, n: int, capacity: int) -> list[int]:
    """``n`` slots of ``slot_values``; a valid slot drawn twice is replaced by -1 after its first use
    (which of two tokens for one slot wins is unspecified: keep one)."""
    slots = [data.draw(slot_values(capacity)) for _ in range(n)]
    seen = set()
    for i, s in enumerate(slots):
        if 0 <= s < capacity and s in seen:
            slots[i] = -1
        seen.add(s)
    return slots


@backends
@examples(20)
@given(data=st.data(), kv_dtype=st.sampled_from([BF16, F16, F32]), n=st.integers(0, 6),
       non_finite=st.booleans())
def test_kv_cache_insert(backend, data, kv_dtype, n, non_finite):
    kv_format, cache = data.draw(caches())
    capacity = cache.shape[0] * cache.shape[1]
    slots = draw_slots(data, n, capacity)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    dim = FMT_DIM[kv_format]
    kv = (torch.randn(n, dim, generator=g) * 10.0 ** torch.randint(-3, 4, (n, 1), generator=g))
    if non_finite and n:
        kv.view(-1)[torch.randint(0, n * dim, (5,), generator=g)] = torch.tensor(
            [float("nan"), float("inf"), float("-inf"), float("nan"), 0.0])
    kv = kv.to(kv_dtype)
    want = same_layout_copy(cache)
    slot_t = torch.tensor(slots, dtype=I64)
    naive_insert(want, kv, slot_t, kv_format)
    got = to(cache, backend)
    if backend == "interpreter":
        kv_ops.kv_cache_insert_triton(kv, slot_t, got, kv_format)
    else:
        tsm.kv_cache_insert(to(kv, backend), to(slot_t, backend), got, kv_format=kv_format)
    assert torch.equal(raw_bytes(got), raw_bytes(want))


@backends
@examples(20)
@given(data=st.data(), out_dtype=st.sampled_from([BF16, F16, F32]), slot_dtype=st.sampled_from([I32, I64]),
       n=st.integers(0, 7))
def test_kv_cache_gather(backend, data, out_dtype, slot_dtype, n):
    kv_format, cache = data.draw(caches())
    capacity = cache.shape[0] * cache.shape[1]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    filled = torch.randperm(capacity, generator=g)[: capacity // 2]  # the other slots stay NaN bytes
    ref.fill_cache(cache, filled.tolist(), torch.randn(len(filled), FMT_DIM[kv_format], generator=g), kv_format)
    values = slot_values(capacity) if slot_dtype == I64 else index32(capacity)
    slots = torch.tensor([data.draw(values) for _ in range(n)], dtype=I64)
    if slot_dtype == I32:
        slots = slots.clamp(INT32_MIN, INT32_MAX)
    slots = slots.to(slot_dtype)
    want = naive_gather(cache, slots.to(I64), kv_format, out_dtype)
    out = to(torch.full((n, FMT_DIM[kv_format]), float("nan"), dtype=out_dtype), backend)
    if backend == "interpreter":
        kv_ops.kv_cache_gather_triton(cache, slots, kv_format, out_dtype, out=out)
    else:
        tsm.kv_cache_gather(to(cache, backend), to(slots, backend), kv_format=kv_format, out=out)
    assert torch.equal(bits(out), bits(want))


# =====================================================================================================
# sparse_mla_decode
# =====================================================================================================


def _mla_cache(kv_format, dim, dtype, pages, page_size, g):
    """A NaN-poisoned cache whose filled slots include the first and the last one."""
    cache = ref.make_cache(pages, page_size, kv_format, dim=dim, dtype=dtype, page_pad=3)
    capacity = pages * page_size
    filled = torch.cat([torch.tensor([0, capacity - 1]), torch.randperm(capacity, generator=g)[: capacity // 2]])
    filled = filled.unique()
    values = torch.randn(len(filled), ref.DIM.get(kv_format, dim), generator=g)
    ref.fill_cache(cache, filled.tolist(), values * 2.0 ** torch.randint(-2, 3, (len(filled), 1), generator=g),
                   kv_format)
    poisoned = torch.tensor(sorted(set(range(capacity)) - set(filled.tolist())) or [0])
    return cache, filled, poisoned


@st.composite
def mla_lists(draw, t, width, cache_info):
    """int32 ``[t, width]`` lists: valid entries point at filled slots, invalid ones have any special
    value, entries past ``lengths`` point at NaN slots (they must not be read); ``lengths`` or None."""
    cache, filled, poisoned = cache_info
    capacity = cache.shape[0] * cache.shape[1]
    invalid = [v for v in special32(capacity) if not 0 <= v < capacity]
    rows = []
    for _ in range(t):
        all_invalid = draw(st.integers(0, 5)) == 0
        rows.append([draw(st.sampled_from(invalid)) if all_invalid or draw(st.integers(0, 3)) == 0
                     else int(filled[draw(st.integers(0, len(filled) - 1))]) for _ in range(width)])
    lengths = None
    if draw(st.booleans()):
        lengths = [draw(st.sampled_from([INT32_MIN, -5, -1, 0, 1, width - 1, width, width + 1, width + 100,
                                         INT32_MAX])) for _ in range(t)]
        for r, n in zip(rows, lengths):
            for j in range(max(min(n, width), 0), width):
                r[j] = int(poisoned[j % len(poisoned)])
    idx = torch.tensor(rows, dtype=I32).reshape(t, width)
    return idx, (None if lengths is None else torch.tensor(lengths, dtype=I32))


_MLA_ARGS = ("q", "kv_cache", "indices", "softmax_scale", "kv_format", "head_dim_v", "topk_length", "attn_sink",
             "extra_kv_cache", "extra_indices", "extra_topk_length")


@backends
@examples(12)
@given(data=st.data(), kv_format=st.sampled_from(ref.FORMATS), t=st.integers(0, 3), h=st.sampled_from([1, 3, 16, 20]),
       k=st.sampled_from([1, 2, 33]), k2=st.sampled_from([0, 1, 9]),
       sink=st.sampled_from([None, "finite", "inf"]), scale=st.sampled_from([0.06, 0.3, -0.2, 0.0, 1e38]))
def test_sparse_mla_decode(backend, data, kv_format, t, h, k, k2, sink, scale):
    dtype = F16 if backend == "interpreter" else data.draw(st.sampled_from([BF16, F16]))
    dim = ref.DIM.get(kv_format, data.draw(st.sampled_from([32, 80, 576])))
    dv = data.draw(st.sampled_from([dim, min(dim, 512), 16]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    main = _mla_cache(kv_format, dim, dtype, 3, data.draw(st.sampled_from([1, 5, 16])), g)
    idx, lengths = data.draw(mla_lists(t, k, main))
    kwargs = dict(q=torch.randn(t, h, dim, generator=g).to(dtype), kv_cache=main[0], indices=idx,
                  softmax_scale=scale, kv_format=kv_format, head_dim_v=dv, topk_length=lengths)
    if k2:
        extra = _mla_cache(kv_format, dim, dtype, 2, 4, g)
        xidx, xlengths = data.draw(mla_lists(t, k2, extra))
        kwargs.update(extra_kv_cache=extra[0], extra_indices=xidx, extra_topk_length=xlengths)
    if sink is not None:
        kwargs["attn_sink"] = torch.randn(h, generator=g) * 2
        if sink == "inf":
            kwargs["attn_sink"][0::2] = float("inf")
            kwargs["attn_sink"][1::3] = float("-inf")
    rounds_k = kv_format == "fp8_656" and dv != 512 and backend != "cpu"
    # The generic fp8_656 path rounds the dequantised K to the query dtype for the scores: compare with a
    # reference that does the same (docs/testing.md, "Property-test profiles"); the overflow case below
    # keeps the exact reference and a bound for that rounding.
    ref_out, ref_lse = mla_reference(**kwargs, score_k_dtype=dtype if rounds_k and scale != 1e38 else None)
    if backend == "interpreter":
        out = torch.full((t, h, dv), float("nan"), dtype=dtype)
        lse = torch.full((t, h), float("nan"))
        mla_ops.sparse_mla_decode_triton(*(kwargs.get(name) for name in _MLA_ARGS), out=out, lse=lse,
                                         num_splits=data.draw(st.sampled_from([None, 1, 2])))
    else:
        moved = {name: to(v, backend) if isinstance(v, torch.Tensor) else v for name, v in kwargs.items()}
        out, lse = tsm.sparse_mla_decode(**moved)
    if scale == 1e38:  # one-hot weights: compare as the overflow tests do
        assert not out.isnan().any() and not lse.isnan().any()
        finite = ~torch.isinf(ref_lse)
        assert torch.equal(torch.isposinf(lse.cpu()), ~finite)
        err = (lse.cpu().double() - ref_lse).abs()[finite]
        tol = 1e-4 + 2e-3 * ref_lse.abs()[finite]
        filled = [(main[0], main[1])] + ([(extra[0], extra[1])] if k2 else [])
        k_abs = torch.cat([ref.dequantize(c, f.tolist(), kv_format)[:, :dim] for c, f in filled]).abs()
        qk_abs = (kwargs["q"].double().abs() @ k_abs.T).amax(-1)  # [t, h], over every filled slot
        # The kernels form q . k in float32: up to dim * 2^-24 of sum |q k| off (products and sums
        # rounded), which a score with cancellation shows against its own size (docs/testing.md).
        tol = tol + dim * 2**-24 * abs(scale) * qk_abs[finite]
        if rounds_k:  # K rounded to the MMA dtype: a score may be off by ~2^-9 of scale * sum |q k| (docs)
            tol = tol + 2**-8 * abs(scale) * qk_abs[finite]
        assert (err <= tol).all(), (err, tol)
        return
    assert_matches(out, lse, ref_out, ref_lse, tensor_cores=backend != "cpu")


# =====================================================================================================
# sparse_gqa_decode (the current API)
# =====================================================================================================


@backends
@examples(12)
@given(data=st.data(), hkv=st.sampled_from([1, 2]), group=st.sampled_from([1, 3, 8]), dh=st.sampled_from([64, 128]),
       page_size=st.sampled_from([16, 48]), dql=st.sampled_from([1, 2]), batch=st.integers(0, 3),
       extra_rows=st.integers(0, 2), n_sel=st.integers(0, 4))
def test_sparse_gqa_decode(backend, data, hkv, group, dh, page_size, dql, batch, extra_rows, n_sel):
    if backend == "interpreter":  # bf16 products are wrong in the interpreter: these pairs multiply in fp16
        q_dtype, kv_dtype = data.draw(st.sampled_from([(F16, F16), (F16, BF16), (F16, FP8), (FP8, FP8),
                                                       (F16, NVFP4)]))
    else:
        q_dtype = data.draw(st.sampled_from([BF16, F16, FP8]))
        kv_dtype = data.draw(st.sampled_from([BF16, F16, FP8, NVFP4]))
    if kv_dtype == NVFP4:
        dh = 128  # the format's 72-byte token rows hold 128 values
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    rows = batch * dql + extra_rows
    num_cols, pages = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 6))
    table = torch.tensor([[data.draw(index32(pages)) for _ in range(num_cols)] for _ in range(batch)],
                         dtype=I32).reshape(batch, num_cols)
    topk = torch.tensor([[[data.draw(index32(num_cols)) for _ in range(n_sel)] for _ in range(hkv)]
                         for _ in range(rows)], dtype=I32).reshape(rows, hkv, n_sel)
    for t in range(rows):  # selected pages are distinct per (row, KV head) (the contract assumes it)
        for h_ in range(hkv):
            seen = set()
            for j in range(n_sel):
                b = int(topk[t, h_, j])
                if b in seen and 0 <= b < num_cols:
                    topk[t, h_, j] = -1
                seen.add(b)
    lens = torch.tensor([data.draw(st.one_of(st.integers(0, num_cols * page_size + 3),
                                             st.sampled_from([INT32_MIN, -1, INT32_MAX]))) for _ in range(rows)],
                        dtype=I32)
    qo = torch.tensor([data.draw(st.one_of(st.integers(-2, num_cols * page_size + 3),
                                           st.sampled_from([INT32_MIN, INT32_MAX]))) for _ in range(rows)], dtype=I32)
    read = gqa_keys_read(topk, table, lens, qo, dql, pages, page_size)
    if kv_dtype == NVFP4:  # random codes and scales, a padded page stride; unread keys' bytes all 0xFF (NaN)
        cfg = Cfg(hkv=hkv, page_size=page_size, page_pad=data.draw(st.sampled_from([0, 7, 16])))
        cache = gqa_nvfp4_cache(cfg, pages, g)
        poison_unread_nvfp4(cache, read)
    else:
        cache = torch.randn(pages, hkv, page_size, 2 * dh, generator=g) * (4 if kv_dtype == FP8 else 1)
        cache[~read] = float("nan")
        if data.draw(st.booleans()):  # NHD physical order
            cache = cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        cache = cache.to(kv_dtype)
    quantised = kv_dtype in (FP8, NVFP4)
    scale_tensors = data.draw(st.booleans())
    args = dict(q=(torch.randn(rows, hkv * group, dh, generator=g) * (2 if q_dtype == FP8 else 1)).to(q_dtype),
                kv_cache=cache, topk_pages=topk, block_table=table, kv_segment_lens=lens, qo_offset=qo,
                decode_query_len=dql, softmax_scale=dh ** -0.5, q_scale=0.5 if q_dtype == FP8 else 1.0,
                k_scale=0.25 if quantised else 1.0, v_scale=0.5 if quantised else 1.0,
                k_scale_tensor=torch.tensor([0.75]) if scale_tensors else None,
                v_scale_tensor=torch.tensor([1.5]) if scale_tensors else None)
    if backend == "interpreter":
        out = torch.full(args["q"].shape, float("nan"), dtype=BF16 if q_dtype == FP8 else q_dtype)
        gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out)
    else:
        a = {name: to(v, backend) if isinstance(v, torch.Tensor) else v for name, v in args.items()}
        out = tsm.sparse_gqa_decode(a.pop("q"), a.pop("kv_cache"), a.pop("topk_pages"), a.pop("block_table"),
                                    a.pop("kv_segment_lens"), a.pop("qo_offset"), **a)
    tol = 4e-3 if q_dtype == F16 and kv_dtype not in (FP8, NVFP4) else 2e-2
    gqa_assert_matches(out, args, tol=dict(atol=tol, rtol=tol))


# =====================================================================================================
# gqa_kv_cache_insert
# =====================================================================================================

# Total scales on both sides of the GPU writer's reciprocal-path bounds (2**+-50 for NVFP4, 2**+-60 for
# float8), ordinary ones and a negative one
GQA_SCALES = [1.0, 0.05, 3.0, -0.75, 2.0**-49, 2.0**49, 2.0**-51, 2.0**51, 2.0**-61, 2.0**61]
# Quotients x / s that are rounding ties: of E2M1 (under a block scale of 1), of e4m3, of bf16 and of
# fp16 (from float32), with representable neighbours, and 6 (a group maximum of 6 s: block scale 1)
GQA_TIES = [0.0, 0.25, 0.5, 0.75, 1.25, 1.75, 2.5, 3.0, 3.5, 5.0, 6.0, 1.0625, 1.1875, 17.0, 1 + 2.0**-8,
            1 + 3 * 2.0**-8, 1 + 2.0**-11, 1 + 3 * 2.0**-11]


@backends
@examples(20)
@given(data=st.data(), kv_dtype=st.sampled_from([BF16, F16, FP8, NVFP4]), in_dtype=st.sampled_from([BF16, F16, F32]),
       hkv=st.sampled_from([1, 2]), n=st.integers(0, 6), non_finite=st.booleans())
def test_gqa_kv_cache_insert(backend, data, kv_dtype, in_dtype, hkv, n, non_finite):
    """The bytes of every cache format against the value-by-value reference: random page counts, sizes
    and padded page strides, slots from the special values, magnitudes from 1e-3 to 1e3 per row with
    NaN and infinities mixed in, and total scales on both sides of the writer's division paths, given
    as floats or as device tensors."""
    dh = 128 if kv_dtype == NVFP4 else data.draw(st.sampled_from([64, 96, 128]))
    # NVFP4 pages hold whole token quads (the V scales' order)
    page_size = data.draw(st.sampled_from([4, 16] if kv_dtype == NVFP4 else [1, 3, 16]))
    pages = data.draw(st.integers(0, 3))
    cache = gqa_make_cache(kv_dtype, pages, hkv, page_size, dh, page_pad=data.draw(st.sampled_from([0, 5, 16])))
    capacity = pages * page_size
    slots = draw_slots(data, n, capacity)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    k, v = (torch.randn(n, hkv, dh, generator=g) * 10.0 ** torch.randint(-3, 4, (n, hkv, 1), generator=g)
            for _ in range(2))
    scales = dict(k_scale=data.draw(st.sampled_from(GQA_SCALES)), v_scale=data.draw(st.sampled_from(GQA_SCALES)))
    if data.draw(st.booleans()):
        scales.update(k_scale_tensor=torch.tensor([data.draw(st.sampled_from(GQA_SCALES))]),
                      v_scale_tensor=torch.tensor([data.draw(st.sampled_from(GQA_SCALES))]))
    if n and data.draw(st.booleans()):  # rounding ties: values x = s * t, every group's first value 6 s
        for x, name in ((k, "k"), (v, "v")):
            # the scales do not apply to 16-bit caches
            total = 1.0 if kv_dtype in (BF16, F16) else float(
                gqa_total_scale(scales[name + "_scale"], scales.get(name + "_scale_tensor")))
            pick = torch.randint(0, len(GQA_TIES), x.shape, generator=g)
            sign = torch.randint(0, 2, x.shape, generator=g) * 2.0 - 1.0
            x.copy_(torch.tensor(GQA_TIES)[pick] * sign * total)
            x[..., ::16] = 6.0 * total
    if non_finite and n:
        for x in (k, v):
            x.view(-1)[torch.randint(0, x.numel(), (4,), generator=g)] = torch.tensor(
                [float("nan"), float("inf"), float("-inf"), 0.0])
    k, v = k.to(in_dtype), v.to(in_dtype)
    slot_t = torch.tensor(slots, dtype=I64)
    want = same_layout_copy(cache)
    gqa_naive_insert(want, k, v, slot_t, **scales)
    got = to(cache, backend)
    if backend == "interpreter":
        gqa_ops.gqa_kv_cache_insert_triton(k, v, slot_t, got, scales["k_scale"], scales["v_scale"],
                                           scales.get("k_scale_tensor"), scales.get("v_scale_tensor"))
    else:
        tsm.gqa_kv_cache_insert(to(k, backend), to(v, backend), to(slot_t, backend), got,
                                **{name: to(x, backend) if isinstance(x, torch.Tensor) else x
                                   for name, x in scales.items()})
    gqa_assert_same_bytes(got, want)  # the whole storage: page padding and unwritten slots unchanged


# =====================================================================================================
# Determinism: the same call twice gives the same bits (CPU, interpreter, CUDA)
# =====================================================================================================


def _mla_inputs(kv_format, t, h, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    dim = ref.DIM.get(kv_format, 576)
    cache, filled, _ = _mla_cache(kv_format, dim, dtype, 8, 16, g)
    idx = filled[torch.randint(0, len(filled), (t, k), generator=g)].to(I32)
    return dict(q=torch.randn(t, h, dim, generator=g).to(dtype), kv_cache=cache, indices=idx, softmax_scale=0.06,
                kv_format=kv_format, head_dim_v=512, topk_length=torch.randint(0, k + 1, (t,), generator=g).to(I32),
                attn_sink=torch.randn(h, generator=g))


def _twice(fn):
    first = [x.clone() for x in fn()]
    second = list(fn())
    for a, b in zip(first, second):
        assert torch.equal(bits(a), bits(b)), "two calls on the same inputs differ"


@backends
@pytest.mark.parametrize("kv_format", ref.FORMATS)
def test_deterministic_mla(backend, kv_format):
    """Split-K and combine included (num_splits 3 in the interpreter; the planner's split on a GPU)."""
    t, k = (2, 80) if backend != "cuda" else (3, 2048)
    dtype = F16 if backend == "interpreter" else BF16
    kwargs = _mla_inputs(kv_format, t, 16, k, dtype, seed=1)
    if backend == "interpreter":
        def call():
            out = torch.empty(t, 16, 512, dtype=dtype)
            lse = torch.empty(t, 16)
            mla_ops.sparse_mla_decode_triton(*(kwargs.get(name) for name in _MLA_ARGS), out=out, lse=lse,
                                             num_splits=3)
            return out, lse
    else:
        moved = {n: to(v, backend) if isinstance(v, torch.Tensor) else v for n, v in kwargs.items()}

        def call():
            return tsm.sparse_mla_decode(**moved)
    _twice(call)


@backends
def test_deterministic_gqa(backend):
    g = torch.Generator().manual_seed(2)
    rows, hkv, dh, ps, pages = 4, 2, 128, 16, 12
    q = torch.randn(rows, 8, dh, generator=g).to(F16)
    cache = torch.randn(pages, hkv, ps, 2 * dh, generator=g).to(F16)
    topk = torch.stack([torch.randperm(pages, generator=g)[:5] for _ in range(rows * hkv)]).view(rows, hkv, 5).to(I32)
    table = torch.arange(pages, dtype=I32).repeat(rows, 1)
    lens = torch.full((rows,), pages * ps, dtype=I32)
    args = [to(x, backend) for x in (q, cache, topk, table, lens, lens - 1)]
    if backend == "interpreter":
        def call():
            out = torch.empty(rows, 8, dh, dtype=F16)
            gqa_ops.sparse_gqa_decode_triton(*args, 1, 0.09, 1.0, 1.0, 1.0, out=out, num_splits=3)
            return (out,)
    else:
        def call():
            return (tsm.sparse_gqa_decode(*args, decode_query_len=1, softmax_scale=0.09),)
    _twice(call)


@backends
def test_deterministic_cache_and_metadata(backend):
    g = torch.Generator().manual_seed(3)
    for kv_format in ref.FORMATS:
        dim = FMT_DIM[kv_format]
        kv = to(torch.randn(20, dim, generator=g).to(BF16), backend)
        slots = to(torch.randperm(48, generator=g)[:20], backend)

        def insert_then_gather():
            cache = to(ref.make_cache(4, 12, kv_format, dim=dim), backend)
            if backend == "interpreter":
                kv_ops.kv_cache_insert_triton(kv, slots, cache, kv_format)
                out = torch.empty(20, dim, dtype=F32)
                kv_ops.kv_cache_gather_triton(cache, slots, kv_format, F32, out=out)
                return raw_bytes(cache), out
            tsm.kv_cache_insert(kv, slots, cache, kv_format=kv_format)
            return raw_bytes(cache), tsm.kv_cache_gather(cache, slots, kv_format=kv_format, dtype=F32)

        _twice(insert_then_gather)
    pos = to(torch.randint(-3, 500, (30,), generator=g), backend)
    ttr = to(torch.randint(0, 4, (30,), generator=g).to(I32), backend)
    table = to(torch.randint(-1, 100, (4, 40), generator=g).to(I32), backend)
    sm = to(torch.randint(-1, 100, (30,), generator=g), backend)

    def metadata():
        if backend == "interpreter":
            idx, lens = _i32_out(backend, 30, 130), _i32_out(backend, 30)
            md_ops.swa_indices_triton(pos, ttr, table, sm, 130, 16, indices=idx, lens=lens)
            return idx, lens
        return tsm.swa_indices(pos, ttr, table, sm, window=130, block_size=16)

    _twice(metadata)
