"""Metadata operators (docs/operators.md): compressed_slot_mapping, c128a_topk_indices,
decode_runtime_metadata, swa_indices, compressed_topk_to_global.

Sections: schema snapshot, reference parity, Triton interpreter parity, opcheck, compile, errors, GPU.
"""

from __future__ import annotations

import dataclasses
import random
import re

import pytest
import torch
from expecttest import assert_expected_inline
from hypothesis import given
from hypothesis import strategies as st

import torch_sparse_mla as tsm
from common import (INTERPRETER, assert_no_recompiles, cached_entries, examples, poison, requires_cuda,
                    requires_interpreter, run_offline_compile, set_args)
from torch_sparse_mla.ops import metadata as kernels

ops = torch.ops.sparse_mla
I32 = torch.int32
I64 = torch.int64
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)

# =====================================================================================================
# Naive references (Python loops over plain ints)
# =====================================================================================================


def ref_slot(block_table: list[list[int]], req: int, entry: int, block_size: int) -> int:
    if req < 0 or req >= len(block_table) or entry < 0:
        return -1
    col = entry // block_size
    if col >= len(block_table[req]):
        return -1
    block = block_table[req][col]
    return -1 if block < 0 else block * block_size + entry % block_size


def ref_idx32(slot: int) -> int:
    return -1 if slot > INT32_MAX else slot


def ref_compressed_slot_mapping(qsl, seq_lens, block_table, n, block_size, ratio):
    out = [-1] * n
    for r in range(len(seq_lens)):
        length = qsl[r + 1] - qsl[r]
        for i in range(length):
            j = qsl[r] + i
            if not 0 <= j < n:
                continue
            p = seq_lens[r] - length + i
            if p >= 0 and (p + 1) % ratio == 0:
                out[j] = ref_slot(block_table, r, p // ratio, block_size)
    return out


def ref_c128a(positions, token_to_req, block_table, slot_mapping, d, ratio, block_size, width):
    dec, lens, pre = [], [], []
    for t, p in enumerate(positions):
        n = min(max((p + 1) // ratio, 0), width)
        if t < d:
            dec.append([ref_idx32(ref_slot(block_table, token_to_req[t], o, block_size)) if o < n else -1
                        for o in range(width)])
            lens.append(n if slot_mapping[t] >= 0 else 0)
        else:
            pre.append([o if o < n else -1 for o in range(width)])
    return dec, lens, pre


def ref_decode_runtime_metadata(seq_lens, q):
    """``qo_offset`` saturates at INT32_MIN (only reachable with negative ``seq_lens``)."""
    kv = [seq_lens[r // q] for r in range(len(seq_lens) * q)]
    qo = [max(seq_lens[r // q] - q + r % q, INT32_MIN) for r in range(len(seq_lens) * q)]
    return kv, qo


def ref_swa(positions, token_to_req, block_table, slot_mapping, window, block_size):
    idx, lens = [], []
    for t, p in enumerate(positions):
        start = max(p - window + 1, 0)
        n = max(p + 1 - start, 0)
        idx.append([ref_idx32(ref_slot(block_table, token_to_req[t], start + o, block_size)) if o < n else -1
                    for o in range(window)])
        lens.append(n if slot_mapping[t] >= 0 else 0)
    return idx, lens


def ref_topk_to_global(local, token_to_req, block_table, slot_mapping, block_size):
    idx, lens = [], []
    for t, row in enumerate(local):
        out = [ref_idx32(ref_slot(block_table, token_to_req[t], e, block_size)) for e in row]
        last = max([j + 1 for j, s in enumerate(out) if s != -1], default=0)
        idx.append(out)
        lens.append(last if slot_mapping[t] >= 0 else 0)
    return idx, lens


# =====================================================================================================
# Inputs: a DeepSeek-V4-shaped batch with every edge case the contract names
# =====================================================================================================


@dataclasses.dataclass
class Batch:
    query_start_loc: torch.Tensor  # int32 [R+1]
    seq_lens: torch.Tensor  # int32 [R]
    block_table: torch.Tensor  # int32 [R, M]
    positions: torch.Tensor  # int64 [T]
    token_to_req: torch.Tensor  # int32 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    num_decode: int
    local_indices: torch.Tensor  # int32 [T, K]

    def to(self, device):
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})


def make_batch(seed: int, num_decode_reqs: int = 3, num_prefill_reqs: int = 2, max_blocks: int = 6,
               block_size: int = 4, k: int = 13, big_block_ids: bool = False) -> Batch:
    """Decode requests first (1-2 query tokens), then prefill requests (0-9 tokens, a zero-length one
    included); padding tokens (slot -1); negative block ids; a token whose request is out of range;
    a few negative positions; block-table columns too few for long requests."""
    g = random.Random(seed)
    query_lens = [g.randint(1, 2) for _ in range(num_decode_reqs)] + [g.choice([0, 3, 9]) for _ in range(num_prefill_reqs)]
    num_reqs = len(query_lens)
    seq_lens = [ql + g.randint(0, 40) for ql in query_lens]
    if num_reqs:
        seq_lens[-1] = max(query_lens[-1] - 2, 0)  # seq_len < query_len: early tokens get negative positions
    qsl = [0]
    for ql in query_lens:
        qsl.append(qsl[-1] + ql)
    hi = 2**29 if big_block_ids else 50
    block_table = [[g.choice([-1] + list(range(hi - 40, hi))) if g.random() < 0.15 else g.randrange(hi)
                    for _ in range(max_blocks)] for _ in range(num_reqs)]
    positions, token_to_req, slot_mapping = [], [], []
    for r, ql in enumerate(query_lens):
        for i in range(ql):
            positions.append(seq_lens[r] - ql + i)
            token_to_req.append(r)
            slot_mapping.append(-1 if g.random() < 0.2 else g.randrange(1000))
    num_decode = sum(query_lens[:num_decode_reqs])
    if positions:
        token_to_req[g.randrange(len(positions))] = num_reqs + 3  # out-of-range request
    num_tokens = len(positions)
    local = [[g.choice([-1, -7, g.randrange(max_blocks * block_size + 8)]) for _ in range(k)] for _ in range(num_tokens)]
    if num_tokens:
        local[0] = [-1] * k  # an empty row
    return Batch(
        query_start_loc=torch.tensor(qsl, dtype=I32),
        seq_lens=torch.tensor(seq_lens, dtype=I32),
        block_table=torch.tensor(block_table, dtype=I32).reshape(num_reqs, max_blocks),
        positions=torch.tensor(positions, dtype=I64),
        token_to_req=torch.tensor(token_to_req, dtype=I32),
        slot_mapping=torch.tensor(slot_mapping, dtype=I64),
        num_decode=num_decode,
        local_indices=torch.tensor(local, dtype=I32).reshape(num_tokens, k),
    )


BATCHES = {
    "mixed": dict(seed=0),
    "mixed2": dict(seed=1, num_decode_reqs=5, num_prefill_reqs=3),
    "decode_only": dict(seed=2, num_prefill_reqs=0),
    "prefill_only": dict(seed=3, num_decode_reqs=0),
    "few_columns": dict(seed=4, max_blocks=1),
    "big_block_ids": dict(seed=5, big_block_ids=True, block_size=16),
    "empty": dict(seed=6, num_decode_reqs=0, num_prefill_reqs=0),
}


def lists(b: Batch):
    return {
        "qsl": b.query_start_loc.tolist(), "seq_lens": b.seq_lens.tolist(), "bt": b.block_table.tolist(),
        "pos": b.positions.tolist(), "ttr": b.token_to_req.tolist(), "sm": b.slot_mapping.tolist(),
        "local": b.local_indices.tolist(),
    }


# -- one runner per operator: (batch, parameters, backend) -> outputs, compared with the reference ----


def run_compressed_slot_mapping(b: Batch, block_size, ratio, n, backend):
    if backend == "op":
        return tsm.compressed_slot_mapping(b.query_start_loc, b.seq_lens, b.block_table, num_tokens=n,
                                           block_size=block_size, compress_ratio=ratio)
    out = poison(torch.empty(n, dtype=I64, device=b.positions.device))
    backend(b.query_start_loc, b.seq_lens, b.block_table, block_size, ratio, out=out)
    return out


def check_compressed_slot_mapping(b: Batch, block_size, ratio, n, out):
    l = lists(b)
    assert out.tolist() == ref_compressed_slot_mapping(l["qsl"], l["seq_lens"], l["bt"], n, block_size, ratio)


CSM_PARAMS = [(4, 1), (4, 2), (2, 4), (1, 128), (3, 3)]  # (block_size, compress_ratio)


C128A_OUTPUTS = ("decode_indices", "decode_lens", "prefill_indices")


def c128a_outputs(b: Batch, width: int, capacity: int, extra_rows: int = 0):
    t, d = b.positions.shape[0], b.num_decode
    dev = b.positions.device
    return (poison(torch.empty(d + extra_rows, capacity, dtype=I32, device=dev)),
            poison(torch.empty(d + extra_rows, dtype=I32, device=dev)),
            poison(torch.empty(t - d + extra_rows, capacity, dtype=I32, device=dev)))


def check_c128a(b: Batch, ratio, block_size, width, outs, capacity=None):
    l = lists(b)
    dec, lens, pre = ref_c128a(l["pos"], l["ttr"], l["bt"], l["sm"], b.num_decode, ratio, block_size, width)
    d, p = b.num_decode, b.positions.shape[0] - b.num_decode
    decode_indices, decode_lens, prefill_indices = outs
    assert decode_indices[:d, :width].tolist() == (dec or [])
    assert decode_lens[:d].tolist() == lens
    assert prefill_indices[:p, :width].tolist() == (pre or [])
    if capacity is not None:  # columns and rows beyond the live region stay untouched
        assert (decode_indices[:, width:] == -12345).all() and (decode_indices[d:] == -12345).all()
        assert (prefill_indices[:, width:] == -12345).all() and (prefill_indices[p:] == -12345).all()
        assert (decode_lens[d:] == -12345).all()


def check_swa(b: Batch, window, block_size, outs):
    l = lists(b)
    idx, lens = ref_swa(l["pos"], l["ttr"], l["bt"], l["sm"], window, block_size)
    t = b.positions.shape[0]
    assert outs[0][:t, :window].tolist() == (idx or [])
    assert outs[1][:t].tolist() == lens


def check_topk(b: Batch, block_size, outs):
    l = lists(b)
    idx, lens = ref_topk_to_global(l["local"], l["ttr"], l["bt"], l["sm"], block_size)
    t, k = b.local_indices.shape
    assert outs[0][:t, :k].tolist() == (idx or [])
    assert outs[1][:t].tolist() == lens


def check_drm(seq_lens: torch.Tensor, q: int, outs):
    kv, qo = ref_decode_runtime_metadata(seq_lens.tolist(), q)
    assert outs[0].tolist() == kv and outs[1].tolist() == qo


# =====================================================================================================
# Schema snapshot
# =====================================================================================================


def test_schemas():
    assert_expected_inline(str(ops.compressed_slot_mapping.default._schema), """\
sparse_mla::compressed_slot_mapping(Tensor query_start_loc, Tensor seq_lens, Tensor block_table, SymInt num_tokens, int block_size, int compress_ratio) -> Tensor""")
    assert_expected_inline(str(ops.compressed_slot_mapping.out._schema), """\
sparse_mla::compressed_slot_mapping.out(Tensor query_start_loc, Tensor seq_lens, Tensor block_table, int block_size, int compress_ratio, *, Tensor(a!) out) -> ()""")
    assert_expected_inline(str(ops.c128a_topk_indices.default._schema), """\
sparse_mla::c128a_topk_indices(Tensor positions, Tensor token_to_req, Tensor block_table, Tensor slot_mapping, SymInt num_decode_tokens, int compress_ratio, int block_size, int width) -> (Tensor decode_indices, Tensor decode_lens, Tensor prefill_indices)""")
    assert_expected_inline(str(ops.c128a_topk_indices.out._schema), """\
sparse_mla::c128a_topk_indices.out(Tensor positions, Tensor token_to_req, Tensor block_table, Tensor slot_mapping, SymInt num_decode_tokens, int compress_ratio, int block_size, int width, *, Tensor(a!) decode_indices, Tensor(b!) decode_lens, Tensor(c!) prefill_indices) -> ()""")
    assert_expected_inline(str(ops.decode_runtime_metadata.default._schema), """\
sparse_mla::decode_runtime_metadata(Tensor seq_lens, int decode_query_len) -> (Tensor kv_segment_lens, Tensor qo_offset)""")
    assert_expected_inline(str(ops.decode_runtime_metadata.out._schema), """\
sparse_mla::decode_runtime_metadata.out(Tensor seq_lens, int decode_query_len, *, Tensor(a!) kv_segment_lens, Tensor(b!) qo_offset) -> ()""")
    assert_expected_inline(str(ops.swa_indices.default._schema), """\
sparse_mla::swa_indices(Tensor positions, Tensor token_to_req, Tensor block_table, Tensor slot_mapping, int window, int block_size) -> (Tensor indices, Tensor lens)""")
    assert_expected_inline(str(ops.swa_indices.out._schema), """\
sparse_mla::swa_indices.out(Tensor positions, Tensor token_to_req, Tensor block_table, Tensor slot_mapping, int window, int block_size, *, Tensor(a!) indices, Tensor(b!) lens) -> ()""")
    assert_expected_inline(str(ops.compressed_topk_to_global.default._schema), """\
sparse_mla::compressed_topk_to_global(Tensor local_indices, Tensor token_to_req, Tensor block_table, Tensor slot_mapping, int block_size) -> (Tensor indices, Tensor lens)""")
    assert_expected_inline(str(ops.compressed_topk_to_global.out._schema), """\
sparse_mla::compressed_topk_to_global.out(Tensor local_indices, Tensor token_to_req, Tensor block_table, Tensor slot_mapping, int block_size, *, Tensor(a!) indices, Tensor(b!) lens) -> ()""")


# =====================================================================================================
# Reference parity (CPU kernels through the registered operators)
# =====================================================================================================


@pytest.mark.parametrize("batch", list(BATCHES), ids=str)
@pytest.mark.parametrize("block_size,ratio", CSM_PARAMS, ids=lambda v: str(v))
def test_compressed_slot_mapping(batch, block_size, ratio):
    b = make_batch(**BATCHES[batch])
    n = b.positions.shape[0] + 5  # padding past the last request's tokens
    check_compressed_slot_mapping(b, block_size, ratio, n, run_compressed_slot_mapping(b, block_size, ratio, n, "op"))
    out = poison(torch.empty(n, dtype=I64))
    tsm.compressed_slot_mapping(b.query_start_loc, b.seq_lens, b.block_table, block_size=block_size,
                                compress_ratio=ratio, out=out)
    check_compressed_slot_mapping(b, block_size, ratio, n, out)


def test_compressed_slot_mapping_short_out():
    b = make_batch(0)
    n = max(b.positions.shape[0] - 3, 0)  # an out shorter than the batch: later tokens are dropped
    out = poison(torch.empty(n, dtype=I64))
    ops.compressed_slot_mapping.out(b.query_start_loc, b.seq_lens, b.block_table, 2, 2, out=out)
    check_compressed_slot_mapping(b, 2, 2, n, out)


@pytest.mark.parametrize("batch", list(BATCHES), ids=str)
@pytest.mark.parametrize("ratio,block_size,width", [(4, 4, 16), (1, 4, 7), (128, 2, 4), (2, 3, 40)], ids=str)
def test_c128a_topk_indices(batch, ratio, block_size, width):
    b = make_batch(**BATCHES[batch])
    outs = tsm.c128a_topk_indices(b.positions, b.token_to_req, b.block_table, b.slot_mapping,
                                  num_decode_tokens=b.num_decode, compress_ratio=ratio, block_size=block_size,
                                  width=width)
    check_c128a(b, ratio, block_size, width, outs)
    bufs = c128a_outputs(b, width, capacity=width + 5, extra_rows=2)  # wider and taller than needed
    tsm.c128a_topk_indices(b.positions, b.token_to_req, b.block_table, b.slot_mapping, num_decode_tokens=b.num_decode,
                           compress_ratio=ratio, block_size=block_size, width=width, out=bufs)
    check_c128a(b, ratio, block_size, width, bufs, capacity=width + 5)


@pytest.mark.parametrize("q", [1, 2, 4, 32], ids=lambda q: f"q{q}")
@pytest.mark.parametrize("batch_size", [0, 1, 7], ids=lambda b: f"B{b}")
def test_decode_runtime_metadata(q, batch_size):
    seq_lens = torch.randint(0, 3000, (batch_size,), dtype=I32)
    if batch_size:
        seq_lens[0] = 0  # a padded request
    check_drm(seq_lens, q, tsm.decode_runtime_metadata(seq_lens, decode_query_len=q))
    outs = tuple(poison(torch.empty(batch_size * q, dtype=I32)) for _ in range(2))
    check_drm(seq_lens, q, tsm.decode_runtime_metadata(seq_lens, decode_query_len=q, out=outs))


@pytest.mark.parametrize("batch", list(BATCHES), ids=str)
@pytest.mark.parametrize("window,block_size", [(8, 4), (1, 4), (128, 64), (5, 3)], ids=str)
def test_swa_indices(batch, window, block_size):
    b = make_batch(**BATCHES[batch])
    check_swa(b, window, block_size, tsm.swa_indices(b.positions, b.token_to_req, b.block_table, b.slot_mapping,
                                                     window=window, block_size=block_size))
    t = b.positions.shape[0]
    outs = (poison(torch.empty(t + 1, window + 3, dtype=I32)), poison(torch.empty(t + 1, dtype=I32)))
    tsm.swa_indices(b.positions, b.token_to_req, b.block_table, b.slot_mapping, window=window,
                    block_size=block_size, out=outs)
    check_swa(b, window, block_size, outs)
    assert (outs[0][:, window:] == -12345).all() and (outs[0][t:] == -12345).all() and outs[1][t] == -12345


@pytest.mark.parametrize("batch", list(BATCHES), ids=str)
@pytest.mark.parametrize("block_size", [1, 4, 64], ids=lambda s: f"bs{s}")
def test_compressed_topk_to_global(batch, block_size):
    b = make_batch(**BATCHES[batch])
    check_topk(b, block_size, tsm.compressed_topk_to_global(b.local_indices, b.token_to_req, b.block_table,
                                                            b.slot_mapping, block_size=block_size))
    t, k = b.local_indices.shape
    outs = (poison(torch.empty(t, k + 2, dtype=I32)), poison(torch.empty(t + 2, dtype=I32)))
    tsm.compressed_topk_to_global(b.local_indices, b.token_to_req, b.block_table, b.slot_mapping,
                                  block_size=block_size, out=outs)
    check_topk(b, block_size, outs)


def test_non_contiguous_inputs():
    """Strided index tensors (a column of a bigger table, a strided slice) are read through strides."""
    b = make_batch(1)
    wide = torch.full((b.block_table.shape[0], 2 * b.block_table.shape[1]), 999, dtype=I32)
    wide[:, ::2] = b.block_table
    strided = dataclasses.replace(b, block_table=wide[:, ::2], positions=torch.stack([b.positions] * 2, 1)[:, 0])
    assert not strided.block_table.is_contiguous() and not strided.positions.is_contiguous()
    for backend in ([kernels.swa_indices_torch] + ([kernels.swa_indices_triton] if INTERPRETER else [])):
        t = b.positions.shape[0]
        outs = (poison(torch.empty(t, 6, dtype=I32)), poison(torch.empty(t, dtype=I32)))
        backend(strided.positions, strided.token_to_req, strided.block_table, strided.slot_mapping, 6, 4,
                indices=outs[0], lens=outs[1])
        check_swa(b, 6, 4, outs)


@examples(60)
@given(
    query_lens=st.lists(st.integers(0, 6), max_size=6),
    context=st.lists(st.integers(-3, 40), min_size=6, max_size=6),
    blocks=st.lists(st.integers(-2, 30), min_size=1, max_size=24),
    max_blocks=st.integers(1, 4),
    block_size=st.integers(1, 5),
    ratio=st.sampled_from([1, 2, 3, 4, 128]),
    pad=st.integers(0, 4),
)
def test_compressed_slot_mapping_property(query_lens, context, blocks, max_blocks, block_size, ratio, pad):
    """Any batch shape and any values (negative contexts, missing blocks) agree with the reference."""
    num_reqs = len(query_lens)
    qsl = [0]
    for ql in query_lens:
        qsl.append(qsl[-1] + ql)
    seq_lens = [ql + c for ql, c in zip(query_lens, context)]
    table = [[blocks[(r * max_blocks + c) % len(blocks)] for c in range(max_blocks)] for r in range(num_reqs)]
    n = qsl[-1] + pad
    out = tsm.compressed_slot_mapping(torch.tensor(qsl, dtype=I32), torch.tensor(seq_lens, dtype=I32),
                                      torch.tensor(table, dtype=I32).reshape(num_reqs, max_blocks), num_tokens=n,
                                      block_size=block_size, compress_ratio=ratio)
    assert out.tolist() == ref_compressed_slot_mapping(qsl, seq_lens, table, n, block_size, ratio)


# int64 positions at both ends (``positions + 1`` and ``positions - window + 1`` wrap there) and the
# int32 ends of seq_lens; both backends must match the reference's unbounded Python integers.
EXTREME_POSITIONS = [INT64_MIN, INT64_MIN + 1, INT32_MIN - 1, -2, -1, 0, 1, 126, 127, 128, INT32_MAX, 2**31,
                     2**40 + 127, INT64_MAX - 128, INT64_MAX - 1, INT64_MAX]
EXTREME_SEQ_LENS = [INT32_MIN, INT32_MIN + 1, INT32_MIN + 3, -1, 0, 1, INT32_MAX - 1, INT32_MAX]


def extreme_batch() -> Batch:
    b = make_batch(0)
    t = len(EXTREME_POSITIONS)
    g = torch.Generator().manual_seed(0)
    return dataclasses.replace(
        b, positions=torch.tensor(EXTREME_POSITIONS, dtype=I64),
        token_to_req=torch.randint(0, b.block_table.shape[0], (t,), dtype=I32, generator=g),
        slot_mapping=torch.where(torch.arange(t) % 5 == 0, -1, torch.arange(t)), num_decode=t // 2,
        local_indices=torch.randint(-2, 30, (t, 4), dtype=I32, generator=g))


def run_extremes(backend: str) -> None:
    b = extreme_batch()
    t = b.positions.shape[0]
    for ratio, block_size, width in [(128, 4, 7), (1, 64, 9), (3, 2, 300)]:
        bufs = c128a_outputs(b, width, capacity=width)
        fn = tsm.c128a_topk_indices if backend == "cpu" else kernels.c128a_topk_indices_triton
        if backend == "cpu":
            fn(b.positions, b.token_to_req, b.block_table, b.slot_mapping, num_decode_tokens=b.num_decode,
               compress_ratio=ratio, block_size=block_size, width=width, out=bufs)
        else:
            fn(b.positions, b.token_to_req, b.block_table, b.slot_mapping, b.num_decode, ratio, block_size, width,
               **dict(zip(C128A_OUTPUTS, bufs)))
        check_c128a(b, ratio, block_size, width, bufs)
    for window, block_size in [(128, 4), (1, 1), (5, 3)]:
        outs = (poison(torch.empty(t, window, dtype=I32)), poison(torch.empty(t, dtype=I32)))
        if backend == "cpu":
            tsm.swa_indices(b.positions, b.token_to_req, b.block_table, b.slot_mapping, window=window,
                            block_size=block_size, out=outs)
        else:
            kernels.swa_indices_triton(b.positions, b.token_to_req, b.block_table, b.slot_mapping, window, block_size,
                                       indices=outs[0], lens=outs[1])
        check_swa(b, window, block_size, outs)
    seq_lens = torch.tensor(EXTREME_SEQ_LENS, dtype=I32)
    for q in (1, 4):
        outs = tuple(poison(torch.empty(len(EXTREME_SEQ_LENS) * q, dtype=I32)) for _ in range(2))
        if backend == "cpu":
            tsm.decode_runtime_metadata(seq_lens, decode_query_len=q, out=outs)
        else:
            kernels.decode_runtime_metadata_triton(seq_lens, q, kv_segment_lens=outs[0], qo_offset=outs[1])
        check_drm(seq_lens, q, outs)


def test_extreme_values():
    run_extremes("cpu")


# =====================================================================================================
# Triton interpreter parity (the CUDA kernels, run on CPU tensors)
# =====================================================================================================


@requires_interpreter
def test_interpreter_extreme_values():
    run_extremes("interpreter")

INTERP_BATCHES = ["mixed", "few_columns", "big_block_ids", "empty"]


def use_slot_search(monkeypatch, form: str) -> None:
    """Make ``compressed_slot_mapping``'s kernel find each token's request one way whatever the number
    of requests: every request's start, end and context length loaded at once (``gather``), all the
    request starts loaded at once and counted (``table``), or a binary search (``search``)."""
    monkeypatch.setattr(kernels, "SEARCH_GATHER_MAX", 2**31 if form == "gather" else -1)
    monkeypatch.setattr(kernels, "SEARCH_TABLE_MIN", 0 if form == "table" else 2**31)
    monkeypatch.setattr(kernels, "SEARCH_TABLE_MAX", 2**31 if form == "table" else 0)


@pytest.fixture(params=["gather", "table", "search"])
def slot_search(request, monkeypatch):
    """Each of ``compressed_slot_mapping``'s three ways of finding a token's request (``use_slot_search``)."""
    use_slot_search(monkeypatch, request.param)
    return request.param


def _requests_batch(seed: int, g: torch.Generator, query_lens: torch.Tensor, max_context: int,
                    table_cols: int) -> Batch:
    """A batch of requests of ``query_lens`` tokens, each with -1 to ``max_context`` tokens of context
    before them, and a block table of ``table_cols`` columns of random block ids (some -1)."""
    num_reqs = query_lens.shape[0]
    qsl = torch.cat([torch.zeros(1, dtype=I64), query_lens.cumsum(0)]).to(I32)
    seq_lens = (query_lens + torch.randint(-1, max_context + 1, (num_reqs,), generator=g)).to(I32)
    return dataclasses.replace(make_batch(seed), query_start_loc=qsl, seq_lens=seq_lens,
                               block_table=torch.randint(-1, 60, (num_reqs, table_cols), dtype=I32, generator=g),
                               positions=torch.zeros(int(qsl[-1]), dtype=I64))


def many_requests_batch(seed: int, num_reqs: int = 300) -> Batch:
    """``num_reqs`` requests of 0-3 query tokens, most of one (request starts at nearly every token,
    token 255, the last of the first program of 256, always; several at one token where requests are
    empty), short contexts, so that most tokens get a slot."""
    g = torch.Generator().manual_seed(seed)
    query_lens = torch.tensor([0, 1, 1, 1, 1, 2, 3])[torch.randint(0, 7, (num_reqs,), generator=g)]
    for last in (255, 511):  # a request starts at the last token of the first two programs
        ends = query_lens.cumsum(0)
        r = int((ends < last).sum())  # the request holding token ``last``, which it now ends before
        if r + 1 < num_reqs and int(ends[r]) > last:
            query_lens[r] -= int(ends[r]) - last
    b = _requests_batch(seed, g, query_lens, max_context=11, table_cols=8)
    assert 255 in b.query_start_loc.tolist()
    return b


def few_requests_batch(seed: int, num_reqs: int) -> Batch:
    """``num_reqs`` requests of 0-400 query tokens (the first, where there are two or more, ends at
    token 255, the last of the first program of 256), so that a few requests span several programs."""
    g = torch.Generator().manual_seed(seed)
    query_lens = torch.randint(0, 401, (num_reqs,), generator=g)
    if num_reqs > 1:
        query_lens[0] = 255
    return _requests_batch(seed, g, query_lens, max_context=39, table_cols=120)


def garbage_starts(b: Batch, seed: int) -> Batch:
    """``b`` with a ``query_start_loc`` that is not non-decreasing (negative, repeated, past the tokens,
    the int32 ends): the output is unspecified, but every access must stay in bounds."""
    g = torch.Generator().manual_seed(seed)
    r = b.seq_lens.shape[0]
    qsl = torch.randint(-50, b.positions.shape[0] + 50, (r + 1,), dtype=I32, generator=g).to(b.seq_lens.device)
    qsl[0], qsl[r // 3], qsl[r // 2] = INT32_MAX, INT32_MIN, 0
    return dataclasses.replace(b, query_start_loc=qsl)


def check_slots_in_table(b: Batch, block_size: int, out: torch.Tensor):
    """Every element is -1 or a slot of a non-negative block of ``b``'s block table."""
    blocks = b.block_table.cpu().to(I64).flatten()
    allowed = set((blocks[blocks >= 0][:, None] * block_size + torch.arange(block_size)).flatten().tolist())
    assert set(out.tolist()) <= allowed | {-1}


@requires_interpreter
def test_interpreter_compressed_slot_mapping_many_requests(slot_search):
    for seed in range(3):
        b = many_requests_batch(seed) if seed < 2 else few_requests_batch(seed, 3)
        n = b.positions.shape[0] + 70  # padding past the last request, the last program partial
        for block_size, ratio in [(4, 2), (3, 1)]:
            out = run_compressed_slot_mapping(b, block_size, ratio, n, kernels.compressed_slot_mapping_triton)
            check_compressed_slot_mapping(b, block_size, ratio, n, out)
        # strided starts and context lengths (every other element of a wider tensor; the rest poison)
        qsl, lens = b.query_start_loc, b.seq_lens
        wide = dataclasses.replace(b, query_start_loc=torch.stack([qsl, torch.full_like(qsl, -7)], 1)[:, 0],
                                   seq_lens=torch.stack([lens, torch.full_like(lens, 99)], 1)[:, 0])
        assert wide.query_start_loc.stride(0) == 2
        check_compressed_slot_mapping(wide, 3, 1, n, run_compressed_slot_mapping(
            wide, 3, 1, n, kernels.compressed_slot_mapping_triton))
        check_slots_in_table(b, 4, run_compressed_slot_mapping(garbage_starts(b, seed), 4, 1, n,
                                                               kernels.compressed_slot_mapping_triton))


@requires_interpreter
@pytest.mark.parametrize("batch", INTERP_BATCHES, ids=str)
def test_interpreter_compressed_slot_mapping(batch, slot_search):
    b = make_batch(**BATCHES[batch])
    for block_size, ratio in [(4, 2), (1, 128), (3, 3)]:
        n = b.positions.shape[0] + 300  # two programs of 256
        out = run_compressed_slot_mapping(b, block_size, ratio, n, kernels.compressed_slot_mapping_triton)
        check_compressed_slot_mapping(b, block_size, ratio, n, out)


@requires_interpreter
def test_interpreter_compressed_slot_mapping_recorded():
    """The implementation registered for CUDA of the functional overload, run through the interpreter:
    its first call records the Triton launcher's launch (``num_tokens`` sizes the output and is not
    passed to the kernel), later calls replay it with their own tensors."""
    from torch_sparse_mla import _library
    from torch_sparse_mla.meta_kernels import metadata as meta

    impl = _library._functional("compressed_slot_mapping", meta.compressed_slot_mapping,
                                _library._without_num_tokens(kernels.compressed_slot_mapping_triton), True)
    b, c = make_batch(**BATCHES[INTERP_BATCHES[0]]), make_batch(**BATCHES[INTERP_BATCHES[-1]])
    for batch in (b, b, c, b):
        n = batch.positions.shape[0] + 3
        out = impl(batch.query_start_loc, batch.seq_lens, batch.block_table, n, 4, 2)
        check_compressed_slot_mapping(batch, 4, 2, n, out)
    assert any(entry[2] and entry[2][1] for entry in cached_entries(impl))  # a recorded launch was replayed


@requires_interpreter
@pytest.mark.parametrize("batch", INTERP_BATCHES, ids=str)
def test_interpreter_c128a_topk_indices(batch):
    b = make_batch(**BATCHES[batch])
    # 130: one program of 256 columns per token; 1100: two column programs (whole rows up to 1,024)
    for ratio, block_size, width in [(2, 3, 40), (1, 4, 130), (1, 4, 1100)]:
        bufs = c128a_outputs(b, width, capacity=width + 3, extra_rows=1)
        kernels.c128a_topk_indices_triton(b.positions, b.token_to_req, b.block_table, b.slot_mapping, b.num_decode,
                                          ratio, block_size, width, **dict(zip(C128A_OUTPUTS, bufs)))
        check_c128a(b, ratio, block_size, width, bufs, capacity=width + 3)


@requires_interpreter
@pytest.mark.parametrize("batch_size,q", [(0, 1), (5, 1), (70, 4)], ids=str)
def test_interpreter_decode_runtime_metadata(batch_size, q):
    seq_lens = torch.randint(0, 3000, (batch_size,), dtype=I32)
    outs = tuple(poison(torch.empty(batch_size * q, dtype=I32)) for _ in range(2))
    kernels.decode_runtime_metadata_triton(seq_lens, q, kv_segment_lens=outs[0], qo_offset=outs[1])
    check_drm(seq_lens, q, outs)


@requires_interpreter
@pytest.mark.parametrize("batch", INTERP_BATCHES, ids=str)
def test_interpreter_swa_indices(batch):
    b = make_batch(**BATCHES[batch])
    for window, block_size in [(5, 3), (129, 4)]:
        t = b.positions.shape[0]
        outs = (poison(torch.empty(t, window + 2, dtype=I32)), poison(torch.empty(t, dtype=I32)))
        kernels.swa_indices_triton(b.positions, b.token_to_req, b.block_table, b.slot_mapping, window, block_size,
                                   indices=outs[0], lens=outs[1])
        check_swa(b, window, block_size, outs)


@requires_interpreter
@pytest.mark.parametrize("batch", INTERP_BATCHES, ids=str)
def test_interpreter_compressed_topk_to_global(batch):
    for k in (13, 200, 1100, 2100):  # 1100: one step of 2,048 columns (up to 16 tokens); 2100: a loop of 1,024
        b = make_batch(**BATCHES[batch], k=k)
        t = b.local_indices.shape[0]
        outs = (poison(torch.empty(t, k, dtype=I32)), poison(torch.empty(t, dtype=I32)))
        kernels.compressed_topk_to_global_triton(b.local_indices, b.token_to_req, b.block_table, b.slot_mapping, 4,
                                                 indices=outs[0], lens=outs[1])
        check_topk(b, 4, outs)


@requires_interpreter
@pytest.mark.parametrize("fits", [True, False], ids=["one_wave", "past_one_wave"])
def test_interpreter_topk_one_step_while_one_wave(fits, monkeypatch):
    """A row of 1,025-2,048 columns is one 2,048-column step at 16 warps while the call's programs fit
    one wave of the device (``TOPK_ONE_STEP_PROGRAMS_PER_SM`` per multiprocessor), else the loop of
    1,024-column steps at 8 warps; both give the reference's rows."""
    b = make_batch(**BATCHES["few_columns"], k=1500)
    t = b.local_indices.shape[0]
    monkeypatch.setattr(kernels, "multiprocessor_count", lambda device: 2)
    monkeypatch.setattr(kernels, "TOPK_ONE_STEP_PROGRAMS_PER_SM", t // 2 if fits else (t - 1) // 2)
    monkeypatch.setattr(kernels, "_PLANS", kernels.PlanCache())
    outs = (poison(torch.empty(t, 1500, dtype=I32)), poison(torch.empty(t, dtype=I32)))
    kernels.compressed_topk_to_global_triton(b.local_indices, b.token_to_req, b.block_table, b.slot_mapping, 4,
                                             indices=outs[0], lens=outs[1])
    check_topk(b, 4, outs)
    (plan,) = kernels._PLANS.values()
    assert (plan.meta["BLOCK"], plan.meta["LOOP"], plan.options["num_warps"]) == (
        (2048, False, 16) if fits else (1024, True, 8))


def test_loads_precede_stores():
    """No metadata kernel (but ``c128a_topk_indices``, measured slower that way) nor cache writer issues
    a load after one of its stores (``scripts/compile_sm90.py --check-stores-last`` on the sm_90 TTIR):
    the store may alias the loaded tensor, so such a load waits for the store, a memory round trip
    more per program. Until 2026-12-04 ``swa_indices`` and ``compressed_topk_to_global`` loaded
    ``slot_mapping`` after storing their index rows."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_offline_compile("compile_sm90.py", "--ttir-only", "--check-stores-last", "--list", "--cases",
                                 "metadata", "kv_cache", "sparse_gqa")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    checked = re.search(r"(\d+) launches checked for loads after stores", result.stdout)
    assert checked and int(checked.group(1)) >= 5 + 3, result.stdout[-2000:]  # the metadata kernels, writers


# =====================================================================================================
# opcheck
# =====================================================================================================


def opcheck_cases():
    b = make_batch(0)
    t, k = b.local_indices.shape
    d = b.num_decode
    yield "compressed_slot_mapping", ops.compressed_slot_mapping.default, (
        b.query_start_loc, b.seq_lens, b.block_table, t + 2, 4, 2), {}
    yield "compressed_slot_mapping.out", ops.compressed_slot_mapping.out, (
        b.query_start_loc, b.seq_lens, b.block_table, 4, 2), {"out": torch.empty(t + 2, dtype=I64)}
    args = (b.positions, b.token_to_req, b.block_table, b.slot_mapping, d, 2, 4, 9)
    yield "c128a_topk_indices", ops.c128a_topk_indices.default, args, {}
    yield "c128a_topk_indices.out", ops.c128a_topk_indices.out, args, dict(
        zip(("decode_indices", "decode_lens", "prefill_indices"), c128a_outputs(b, 9, 11)))
    yield "decode_runtime_metadata", ops.decode_runtime_metadata.default, (b.seq_lens, 3), {}
    yield "decode_runtime_metadata.out", ops.decode_runtime_metadata.out, (b.seq_lens, 3), {
        "kv_segment_lens": torch.empty(3 * b.seq_lens.shape[0], dtype=I32),
        "qo_offset": torch.empty(3 * b.seq_lens.shape[0], dtype=I32)}
    args = (b.positions, b.token_to_req, b.block_table, b.slot_mapping, 6, 4)
    yield "swa_indices", ops.swa_indices.default, args, {}
    yield "swa_indices.out", ops.swa_indices.out, args, {"indices": torch.empty(t, 6, dtype=I32),
                                                          "lens": torch.empty(t, dtype=I32)}
    args = (b.local_indices, b.token_to_req, b.block_table, b.slot_mapping, 4)
    yield "compressed_topk_to_global", ops.compressed_topk_to_global.default, args, {}
    yield "compressed_topk_to_global.out", ops.compressed_topk_to_global.out, args, {
        "indices": torch.empty(t, k, dtype=I32), "lens": torch.empty(t, dtype=I32)}


@pytest.mark.parametrize("case", list(opcheck_cases()), ids=lambda c: c[0])
def test_opcheck(case):
    _, op, args, kwargs = case
    torch.library.opcheck(op, args, kwargs)


# =====================================================================================================
# torch.compile: one graph, no graph breaks, no recompiles across batch sizes
# =====================================================================================================


def metadata_step(qsl, seq_lens, block_table, positions, token_to_req, slot_mapping, local, num_decode: int):
    slots = tsm.compressed_slot_mapping(qsl, seq_lens, block_table, num_tokens=positions.shape[0], block_size=4,
                                        compress_ratio=2)
    c128a = tsm.c128a_topk_indices(positions, token_to_req, block_table, slot_mapping, num_decode_tokens=num_decode,
                                   compress_ratio=2, block_size=4, width=9)
    drm = tsm.decode_runtime_metadata(seq_lens, decode_query_len=2)
    swa = tsm.swa_indices(positions, token_to_req, block_table, slot_mapping, window=6, block_size=4)
    topk = tsm.compressed_topk_to_global(local, token_to_req, block_table, slot_mapping, block_size=4)
    return slots, *c128a, *drm, *swa, *topk


def batch_args(b: Batch):
    return (b.query_start_loc, b.seq_lens, b.block_table, b.positions, b.token_to_req, b.slot_mapping,
            b.local_indices, b.num_decode)


def check_step(args, outs):
    expected = metadata_step(*args)
    for got, want in zip(outs, expected):
        assert torch.equal(got.cpu(), want.cpu())


def test_compile_no_recompiles():
    # max_blocks=11: no size of the first batch coincides with another (duck sizing would tie them)
    batches = [make_batch(10 + i, num_decode_reqs=2 + 2 * i, num_prefill_reqs=1 + i, max_blocks=11) for i in range(3)]
    assert_no_recompiles(metadata_step, [batch_args(b) for b in batches], check_step)


# =====================================================================================================
# Errors: checked on metadata, ValueError naming the argument
# =====================================================================================================


def _valid_call(op: str, b: Batch) -> dict:
    """Keyword arguments of a valid call of the public function ``op`` on batch ``b``."""
    t, k = b.local_indices.shape
    per_token = dict(token_to_req=b.token_to_req, block_table=b.block_table, slot_mapping=b.slot_mapping)
    return {
        "compressed_slot_mapping": dict(query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
                                        block_table=b.block_table, num_tokens=t, block_size=4, compress_ratio=4),
        "c128a_topk_indices": dict(positions=b.positions, **per_token, num_decode_tokens=b.num_decode,
                                   compress_ratio=4, block_size=4, width=8),
        "decode_runtime_metadata": dict(seq_lens=b.seq_lens, decode_query_len=2),
        "swa_indices": dict(positions=b.positions, **per_token, window=4, block_size=4),
        "compressed_topk_to_global": dict(local_indices=b.local_indices, **per_token, block_size=4),
    }[op]


def _drop(name):
    return lambda a: a.pop(name)


def _i32(*shape):
    return torch.empty(*shape, dtype=I32)


# (operator, mutation of a valid call, expected message)
ERRORS = {
    "positions_dtype": ("swa_indices", set_args(positions=lambda a: a["positions"].int()),
                        r"positions: expected dtype int64, got int32"),
    "block_table_rank": ("swa_indices", set_args(block_table=lambda a: a["block_table"][0]),
                         r"block_table: expected a 2-D tensor"),
    "token_to_req_len": ("swa_indices", set_args(token_to_req=lambda a: a["token_to_req"][1:]),
                         r"token_to_req: expected shape\[0\] == len\(positions\)"),
    "window_zero": ("swa_indices", set_args(window=lambda a: 0), r"window: expected an int >= 1, got 0"),
    "window_past_int32": ("swa_indices", set_args(window=lambda a: 2**31), r"window: expected an int <= 2147483647"),
    "block_size_past_int32": ("compressed_topk_to_global", set_args(block_size=lambda a: 2**40),
                              r"block_size: expected an int <= 2147483647, got 1099511627776"),
    "block_table_device": ("swa_indices", set_args(block_table=lambda a: a["block_table"].to("meta")),
                           r"block_table: expected a tensor on cpu \(where the first argument is\), got meta"),
    # several bad arguments: the first in schema order is named (block_table before slot_mapping)
    "block_table_and_slot_mapping_device": ("compressed_topk_to_global",
                                            set_args(block_table=lambda a: a["block_table"].to("meta"),
                                                     slot_mapping=lambda a: a["slot_mapping"].to("meta")),
                                            r"block_table: expected a tensor on cpu"),
    "query_start_loc_len": ("compressed_slot_mapping", set_args(query_start_loc=lambda a: a["query_start_loc"][:-1]),
                            r"query_start_loc: expected shape\[0\] == len\(seq_lens\) \+ 1"),
    "num_tokens_missing": ("compressed_slot_mapping", _drop("num_tokens"), r"num_tokens: required"),
    "compress_ratio_zero": ("compressed_slot_mapping", set_args(compress_ratio=lambda a: 0),
                            r"compress_ratio: expected an int >= 1"),
    "num_decode_tokens": ("c128a_topk_indices", set_args(num_decode_tokens=lambda a: 999),
                          r"num_decode_tokens: expected <= len\(positions\)"),
    "width_past_int32": ("c128a_topk_indices", set_args(width=lambda a: 2**31),
                         r"width: expected an int <= 2147483647"),
    "decode_indices_width": ("c128a_topk_indices", set_args(out=lambda a: c128a_outputs_for(a, capacity=7)),
                             r"decode_indices: expected shape\[1\] >= width \(8\)"),
    "qo_offset_len": ("decode_runtime_metadata", set_args(out=lambda a: (_i32(2 * a["seq_lens"].shape[0]), _i32(1))),
                      r"qo_offset: expected shape\[0\] == len\(seq_lens\) \* decode_query_len"),
    "lens_dtype": ("compressed_topk_to_global",
                   set_args(out=lambda a: (_i32(*a["local_indices"].shape), a["slot_mapping"].clone())),
                   r"lens: expected dtype int32, got int64"),
    # out= of the public functions: the right number of tensors, named
    "out_not_a_tuple": ("swa_indices", set_args(out=lambda a: _i32(2, 4)),
                        r"out: expected a tuple of 2 tensors \(indices, lens\), got Tensor"),
    "out_too_short": ("c128a_topk_indices", set_args(out=lambda a: c128a_outputs_for(a, capacity=8)[:2]),
                      r"out: expected a tuple of 3 tensors \(decode_indices, decode_lens, prefill_indices\), "
                      r"got tuple of \(Tensor, Tensor\)"),
    "out_not_a_tensor": ("compressed_slot_mapping", set_args(out=lambda a: (torch.empty(3, dtype=I64),)),
                         r"out: expected a tensor \(the out buffer\), got tuple"),
    # an output buffer that aliases an input (checked on data pointers in the real implementation)
    "lens_aliases_input": ("swa_indices",
                           set_args(out=lambda a: (_i32(a["positions"].shape[0], 4), a["token_to_req"])),
                           r"lens: overlaps the memory of input token_to_req"),
    "indices_alias_input": ("compressed_topk_to_global",
                            set_args(out=lambda a: (a["local_indices"], _i32(a["local_indices"].shape[0]))),
                            r"indices: overlaps the memory of input local_indices"),
    "qo_offset_aliases_seq_lens": ("decode_runtime_metadata",
                                   set_args(decode_query_len=lambda a: 1,
                                        out=lambda a: (_i32(a["seq_lens"].shape[0]), a["seq_lens"])),
                                   r"qo_offset: overlaps the memory of input seq_lens"),
    "outputs_overlap": ("c128a_topk_indices",
                        set_args(out=lambda a: (lambda bufs: (bufs[0], bufs[0][0], bufs[2]))(c128a_outputs_for(a, 8))),
                        r"decode_indices: overlaps the memory of output decode_lens"),
    # address ranges are compared, not elements: interleaved views of one buffer are refused (operators.md)
    "outputs_interleave": ("decode_runtime_metadata",
                           set_args(out=lambda a: (lambda big: (big[0::2], big[1::2]))(
                               _i32(2 * a["seq_lens"].shape[0] * a["decode_query_len"]))),
                           r"kv_segment_lens: overlaps the memory of output qo_offset"),
    "out_aliases_query_start_loc": ("compressed_slot_mapping",
                            set_args(out=lambda a: a["query_start_loc"].view(torch.int64)[:1]
                                 if a["query_start_loc"].numel() >= 2 else None),
                            r"out: overlaps the memory of input query_start_loc"),
}


def c128a_outputs_for(args: dict, capacity: int):
    t, d = args["positions"].shape[0], args["num_decode_tokens"]
    return _i32(d, capacity), _i32(d), _i32(t - d, capacity)


@pytest.mark.parametrize("case", list(ERRORS), ids=str)
def test_errors(case):
    op, mutate, match = ERRORS[case]
    args = _valid_call(op, make_batch(0))
    mutate(args)
    with pytest.raises(ValueError, match=match):
        getattr(tsm, op)(**args)


def test_valid_calls_pass():
    """The calls the error table mutates are valid as they are (each error comes from its mutation)."""
    b = make_batch(0)
    for op in ("compressed_slot_mapping", "c128a_topk_indices", "decode_runtime_metadata", "swa_indices",
               "compressed_topk_to_global"):
        getattr(tsm, op)(**_valid_call(op, b))


# =====================================================================================================
# GPU: CUDA parity, manual CUDA-graph capture of every .out overload, reduce-overhead compile
# =====================================================================================================


@requires_cuda
@pytest.mark.parametrize("batch", list(BATCHES), ids=str)
def test_cuda_parity(batch):
    b = make_batch(**BATCHES[batch]).to("cuda")
    t = b.positions.shape[0]
    check_compressed_slot_mapping(b, 4, 2, t + 300, run_compressed_slot_mapping(b, 4, 2, t + 300, "op"))
    check_c128a(b, 2, 3, 40, tsm.c128a_topk_indices(b.positions, b.token_to_req, b.block_table, b.slot_mapping,
                                                    num_decode_tokens=b.num_decode, compress_ratio=2, block_size=3,
                                                    width=40))
    check_swa(b, 129, 4, tsm.swa_indices(b.positions, b.token_to_req, b.block_table, b.slot_mapping, window=129,
                                         block_size=4))
    check_topk(b, 4, tsm.compressed_topk_to_global(b.local_indices, b.token_to_req, b.block_table, b.slot_mapping,
                                                   block_size=4))
    check_drm(b.seq_lens.cpu(), 3, tsm.decode_runtime_metadata(b.seq_lens, decode_query_len=3))


@requires_cuda
@pytest.mark.parametrize("one_step", [True, False], ids=["one_step", "loop"])
def test_cuda_compressed_topk_to_global_long_rows(one_step, monkeypatch):
    """Rows longer than 1,024 columns (a DeepSeek-V3.2 indexer row is 2,048): one step of 2,048 columns
    (small calls) or a loop of 1,024-column steps, whatever the number of tokens."""
    monkeypatch.setattr(kernels, "TOPK_ONE_STEP_PROGRAMS_PER_SM", 2**31 if one_step else 0)
    for k in (1100, 2048):
        b = make_batch(k, k=k).to("cuda")
        t = b.local_indices.shape[0]
        outs = (poison(torch.empty(t, k, dtype=I32, device="cuda")), poison(torch.empty(t, dtype=I32, device="cuda")))
        kernels.compressed_topk_to_global_triton(b.local_indices, b.token_to_req, b.block_table, b.slot_mapping, 4,
                                                 indices=outs[0], lens=outs[1])
        check_topk(b, 4, outs)


@requires_cuda
@pytest.mark.parametrize("form, sizes", [("gather", (1, 2, 5)), ("table", (300, 5000)), ("search", (300, 5000))],
                         ids=["gather", "table", "search"])
def test_cuda_compressed_slot_mapping_many_requests(form, sizes, monkeypatch):
    """The three ways of finding a token's request on the GPU (``gather``, registers per request, at a
    few requests of many tokens); garbage starts stay in bounds (under ``scripts/sanitize.sh``
    memcheck checks that)."""
    use_slot_search(monkeypatch, form)
    for seed, num_reqs in enumerate(sizes):
        b = (few_requests_batch if form == "gather" else many_requests_batch)(seed, num_reqs).to("cuda")
        n = b.positions.shape[0] + 70
        for block_size, ratio in [(4, 2), (3, 1)]:
            out = run_compressed_slot_mapping(b, block_size, ratio, n, kernels.compressed_slot_mapping_triton)
            check_compressed_slot_mapping(b, block_size, ratio, n, out.cpu())
        garbage = run_compressed_slot_mapping(garbage_starts(b, seed), 4, 1, n, kernels.compressed_slot_mapping_triton)
        check_slots_in_table(b, 4, garbage.cpu())


def _fixed_shape_batch(seed: int) -> Batch:
    """Batches of one shape with new values (what a captured graph replays on)."""
    b = make_batch(seed, num_decode_reqs=4, num_prefill_reqs=0)
    g = torch.Generator().manual_seed(seed)
    t = 6
    return dataclasses.replace(
        b,
        query_start_loc=torch.tensor([0, 1, 3, 4, 6], dtype=I32),
        seq_lens=torch.randint(2, 40, (4,), dtype=I32, generator=g),
        block_table=torch.randint(-1, 50, (4, 6), dtype=I32, generator=g),
        positions=torch.randint(-2, 40, (t,), dtype=I64, generator=g),
        token_to_req=torch.tensor([0, 1, 1, 2, 3, 7], dtype=I32),
        slot_mapping=torch.randint(-1, 100, (t,), dtype=I64, generator=g),
        num_decode=4,
        local_indices=torch.randint(-2, 30, (t, 13), dtype=I32, generator=g),
    )


@requires_cuda
def test_cuda_graph_capture_replay():
    static = _fixed_shape_batch(0).to("cuda")
    t, k = static.local_indices.shape
    bufs = {
        "slots": torch.empty(t + 3, dtype=I64, device="cuda"),
        "c128a": tuple(x.cuda() for x in c128a_outputs(_fixed_shape_batch(0), 9, 12)),
        "drm": tuple(torch.empty(4 * 2, dtype=I32, device="cuda") for _ in range(2)),
        "swa": (torch.empty(t, 6, dtype=I32, device="cuda"), torch.empty(t, dtype=I32, device="cuda")),
        "topk": (torch.empty(t, k, dtype=I32, device="cuda"), torch.empty(t, dtype=I32, device="cuda")),
    }

    def step():
        s = static
        ops.compressed_slot_mapping.out(s.query_start_loc, s.seq_lens, s.block_table, 4, 2, out=bufs["slots"])
        ops.c128a_topk_indices.out(s.positions, s.token_to_req, s.block_table, s.slot_mapping, 4, 2, 4, 9,
                                   decode_indices=bufs["c128a"][0], decode_lens=bufs["c128a"][1],
                                   prefill_indices=bufs["c128a"][2])
        ops.decode_runtime_metadata.out(s.seq_lens, 2, kv_segment_lens=bufs["drm"][0], qo_offset=bufs["drm"][1])
        ops.swa_indices.out(s.positions, s.token_to_req, s.block_table, s.slot_mapping, 6, 4,
                            indices=bufs["swa"][0], lens=bufs["swa"][1])
        ops.compressed_topk_to_global.out(s.local_indices, s.token_to_req, s.block_table, s.slot_mapping, 4,
                                          indices=bufs["topk"][0], lens=bufs["topk"][1])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (1, 2, 3):
        new = _fixed_shape_batch(seed)
        for f in dataclasses.fields(Batch):
            if isinstance(getattr(new, f.name), torch.Tensor):
                getattr(static, f.name).copy_(getattr(new, f.name))
        for buf in (bufs["slots"], *bufs["c128a"], *bufs["drm"], *bufs["swa"], *bufs["topk"]):
            poison(buf)
        graph.replay()
        torch.cuda.synchronize()
        check_compressed_slot_mapping(new, 4, 2, t + 3, bufs["slots"].cpu())
        check_c128a(new, 2, 4, 9, tuple(x.cpu() for x in bufs["c128a"]))
        check_drm(new.seq_lens, 2, bufs["drm"])
        check_swa(new, 6, 4, bufs["swa"])
        check_topk(new, 4, bufs["topk"])


class MetadataStep(torch.nn.Module):
    """A decode step's metadata with its state in module buffers (the gpt-fast pattern)."""

    def __init__(self, t: int, k: int):
        super().__init__()
        self.register_buffer("slots", torch.empty(t, dtype=I64))
        self.register_buffer("swa_idx", torch.empty(t, 6, dtype=I32))
        self.register_buffer("swa_lens", torch.empty(t, dtype=I32))

    def forward(self, qsl, seq_lens, block_table, positions, token_to_req, slot_mapping, local):
        ops.compressed_slot_mapping.out(qsl, seq_lens, block_table, 4, 2, out=self.slots)
        ops.swa_indices.out(positions, token_to_req, block_table, slot_mapping, 6, 4, indices=self.swa_idx,
                            lens=self.swa_lens)
        c128a = tsm.c128a_topk_indices(positions, token_to_req, block_table, slot_mapping, num_decode_tokens=4,
                                       compress_ratio=2, block_size=4, width=9)
        drm = tsm.decode_runtime_metadata(seq_lens, decode_query_len=2)
        topk = tsm.compressed_topk_to_global(local, token_to_req, block_table, slot_mapping, block_size=4)
        return self.slots.clone(), self.swa_idx.clone(), self.swa_lens.clone(), *c128a, *drm, *topk


@requires_cuda
def test_reduce_overhead_takes_cuda_graph():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    b0 = _fixed_shape_batch(0)
    t, k = b0.local_indices.shape
    module = MetadataStep(t, k).cuda()
    compiled = torch.compile(module, mode="reduce-overhead", fullgraph=True)
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        for seed in range(4):
            b = _fixed_shape_batch(seed).to("cuda")
            args = (b.query_start_loc, b.seq_lens, b.block_table, b.positions, b.token_to_req, b.slot_mapping,
                    b.local_indices)
            got = [x.clone() for x in compiled(*args)]
            want = module(*args)
            for g_, w_ in zip(got, want):
                assert torch.equal(g_, w_)
            check_swa(b, 6, 4, (got[1], got[2]))
    assert counters["inductor"]["cudagraph_skips"] == 0

