"""Engine-facing step builders (torch_sparse_mla/steps.py) and whole decode steps built from them.

Sections: builder parity (the builders' buffers hold exactly what the functional operators return,
at fixed addresses and row strides), capacity errors, torch.compile of a whole DeepSeek-V4 and
MiniMax-M3 step (fullgraph, one frame across batch sizes), and on a GPU: reduce-overhead without
skipped CUDA graphs, and one manual CUDA-graph capture replayed at several batch compositions with
padded rows; and a DeepSeek-V3.2 layer from the operators alone (no builder). The operators
themselves are checked against naive references in their own test files; here the steps are checked
against the same steps run eagerly, and the V3.2 layer against a float64 reference that finds each
chosen position's slot by itself.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

import torch_sparse_mla as tsm
from common import assert_no_recompiles, compile_counter, requires_cuda

I32, I64 = torch.int32, torch.int64

# Small DeepSeek-V4-like geometry (every size distinct, so duck sizing ties nothing together).
V4 = dict(max_model_len=1024, window=16, swa_page_size=16, compressed_page_size=128, index_topk=24)
HEADS, DIM = 16, 512
POOL = 80  # physical pages per cache

# Small MiniMax-M3-like geometry.
M3 = dict(hq=16, hkv=2, dh=64, page=16, sel=4, q_len=2, max_model_len=320)


# =====================================================================================================
# Inputs
# =====================================================================================================


@dataclasses.dataclass
class V4Batch:
    """One decode token per request; ``padded`` trailing requests have no token (their rows are
    padding: position 0, slot -1), as an engine pads a batch up to a captured size."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    token_to_req: torch.Tensor
    slot_mapping: torch.Tensor
    swa_block_table: torch.Tensor
    c4_block_table: torch.Tensor
    c128_block_table: torch.Tensor
    q: torch.Tensor
    kv: torch.Tensor
    compressed_kv: torch.Tensor
    local_topk: torch.Tensor

    def args(self):
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def metadata_args(self):
        return self.args()[:8]

    def to(self, device):
        return V4Batch(*(t.to(device) for t in self.args()))


def make_v4_batch(num_reqs: int, seed: int, padded: int = 0) -> V4Batch:
    g = torch.Generator().manual_seed(seed)
    real = num_reqs - padded
    seq = torch.randint(20, V4["max_model_len"] - 1, (num_reqs,), generator=g)
    seq[real:] = 0
    ql = (torch.arange(num_reqs) < real).long()
    qsl = torch.cat([torch.zeros(1, dtype=I64), ql.cumsum(0)])
    pos = (seq - 1).clamp_min(0)
    ps = V4["swa_page_size"]
    swa_cols = V4["max_model_len"] // ps
    comp_cols = V4["max_model_len"] // V4["compressed_page_size"]
    swa_bt = torch.randint(-1, POOL, (num_reqs, swa_cols), generator=g).to(I32)
    swa_bt[torch.arange(num_reqs), pos // ps] = torch.randint(0, POOL, (num_reqs,), generator=g).to(I32)
    slots = swa_bt[torch.arange(num_reqs), pos // ps].to(I64) * ps + pos % ps
    slots[real:] = -1
    completed = (pos + 1) // 4
    local = torch.randint(0, 10_000, (num_reqs, V4["index_topk"]), generator=g) % completed.clamp_min(1)[:, None]
    local[:, -3:] = -1
    return V4Batch(
        query_start_loc=qsl.to(I32), seq_lens=seq.to(I32), positions=pos, token_to_req=torch.arange(num_reqs).to(I32),
        slot_mapping=slots, swa_block_table=swa_bt,
        c4_block_table=torch.randint(-1, POOL, (num_reqs, comp_cols), generator=g).to(I32),
        c128_block_table=torch.randint(0, POOL, (num_reqs, comp_cols), generator=g).to(I32),
        q=torch.randn(num_reqs, HEADS, DIM, generator=g).to(torch.bfloat16),
        kv=torch.randn(num_reqs, DIM, generator=g), compressed_kv=torch.randn(num_reqs, DIM, generator=g),
        local_topk=local.to(I32),
    )


def _v4_cache(page_size: int, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(POOL, page_size, 584, dtype=torch.uint8)
    slots = torch.arange(POOL * page_size)
    tsm.kv_cache_insert(torch.randn(len(slots), DIM, generator=g), slots, cache, kv_format="fp8_584")
    return cache.to(device)


class V4Step(torch.nn.Module):
    """Three DeepSeek-V4 layers (sliding window only, C4A, C128A) sharing one window cache."""

    def __init__(self, max_num_tokens: int, device="cpu"):
        super().__init__()
        self.builder = tsm.DeepSeekV4MetadataBuilder(max_num_tokens=max_num_tokens, device=device, **V4)
        self.register_buffer("swa", _v4_cache(V4["swa_page_size"], 1, device))
        self.register_buffer("c4", _v4_cache(V4["compressed_page_size"] // 4, 2, device))
        self.register_buffer("c128", _v4_cache(V4["compressed_page_size"] // 128, 3, device))
        self.register_buffer("sink", torch.linspace(-2, 2, HEADS, device=device))

    def metadata_and_writes(self, metadata_args, kv, compressed_kv):
        """The builder, then this step's latent into the window cache and its compressed entry into both
        compressed caches; returns the metadata and the arguments every layer's attention shares."""
        m = self.builder(*metadata_args)
        tsm.kv_cache_insert(kv, m.slot_mapping, self.swa, kv_format="fp8_584")
        tsm.kv_cache_insert(compressed_kv, m.c4_slot_mapping, self.c4, kv_format="fp8_584")
        tsm.kv_cache_insert(compressed_kv, m.c128_slot_mapping, self.c128, kv_format="fp8_584")
        return m, dict(softmax_scale=DIM ** -0.5, kv_format="fp8_584", topk_length=m.swa_lens, attn_sink=self.sink)

    def forward(self, query_start_loc, seq_lens, positions, token_to_req, slot_mapping, swa_block_table,
                c4_block_table, c128_block_table, q, kv, compressed_kv, local_topk):
        m, common = self.metadata_and_writes((query_start_loc, seq_lens, positions, token_to_req, slot_mapping,
                                              swa_block_table, c4_block_table, c128_block_table), kv, compressed_kv)
        out_swa, _ = tsm.sparse_mla_decode(q, self.swa, m.swa_indices, **common)
        c4_idx, c4_len = self.builder.c4a_indices(m, local_topk)
        out_c4, _ = tsm.sparse_mla_decode(q, self.swa, m.swa_indices, extra_kv_cache=self.c4, extra_indices=c4_idx,
                                          extra_topk_length=c4_len, **common)
        out_c128, lse = tsm.sparse_mla_decode(q, self.swa, m.swa_indices, extra_kv_cache=self.c128,
                                              extra_indices=m.c128a_indices, extra_topk_length=m.c128a_lens, **common)
        return out_swa, out_c4, out_c128, lse


@dataclasses.dataclass
class M3Batch:
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    topk_pages: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def args(self):
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def to(self, device):
        return M3Batch(*(t.to(device) for t in self.args()))


M3_COLS = M3["max_model_len"] // M3["page"]


def make_m3_batch(num_reqs: int, seed: int, padded: int = 0) -> M3Batch:
    g = torch.Generator().manual_seed(seed)
    rows = num_reqs * M3["q_len"]
    seq = torch.randint(M3["q_len"], M3["max_model_len"], (num_reqs,), generator=g)
    seq[num_reqs - padded:] = 0
    return M3Batch(
        seq_lens=seq.to(I32),
        block_table=torch.randint(-1, POOL, (num_reqs, M3_COLS), generator=g).to(I32),
        topk_pages=torch.randint(-1, M3_COLS, (rows, M3["hkv"], M3["sel"]), generator=g).to(I32),
        q=torch.randn(rows, M3["hq"], M3["dh"], generator=g).to(torch.bfloat16),
        k=torch.randn(rows, M3["hkv"], M3["dh"], generator=g), v=torch.randn(rows, M3["hkv"], M3["dh"], generator=g),
    )


class M3Step(torch.nn.Module):
    """One MiniMax-M3 layer: metadata, the cache write of this step's K and V, sparse GQA decode."""

    def __init__(self, max_num_reqs: int, device="cpu"):
        super().__init__()
        self.builder = tsm.MiniMaxM3MetadataBuilder(max_num_reqs=max_num_reqs, max_model_len=M3["max_model_len"],
                                                    page_size=M3["page"], decode_query_len=M3["q_len"], device=device)
        g = torch.Generator().manual_seed(4)
        cache = torch.randn(POOL, M3["hkv"], M3["page"], 2 * M3["dh"], generator=g).to(torch.float8_e4m3fn)
        self.register_buffer("cache", cache.to(device))

    def forward(self, seq_lens, block_table, topk_pages, q, k, v):
        m = self.builder(seq_lens, block_table)
        tsm.gqa_kv_cache_insert(k, v, m.slot_mapping, self.cache)  # padding rows (slot -1) write nothing
        out = tsm.sparse_gqa_decode(q, self.cache, topk_pages, m.block_table, m.kv_segment_lens, m.qo_offset,
                                    decode_query_len=M3["q_len"], softmax_scale=M3["dh"] ** -0.5)
        return out, m.slot_mapping.clone()


# =====================================================================================================
# Builder parity: the buffers hold what the functional operators return
# =====================================================================================================


def test_deepseek_v4_builder_matches_operators():
    builder = tsm.DeepSeekV4MetadataBuilder(max_num_tokens=9, **V4)
    addresses = None
    for num_reqs, padded in ((5, 0), (9, 3), (2, 1)):
        b = make_v4_batch(num_reqs, seed=num_reqs, padded=padded)
        m = builder(*b.metadata_args())
        t = num_reqs
        swa = tsm.swa_indices(b.positions, b.token_to_req, b.swa_block_table, b.slot_mapping, window=V4["window"],
                              block_size=V4["swa_page_size"])
        assert torch.equal(m.swa_indices, swa[0]) and torch.equal(m.swa_lens, swa[1])
        for ratio, got in ((4, m.c4_slot_mapping), (128, m.c128_slot_mapping)):
            table = b.c4_block_table if ratio == 4 else b.c128_block_table
            want = tsm.compressed_slot_mapping(b.query_start_loc, b.seq_lens, table, num_tokens=t,
                                               block_size=V4["compressed_page_size"] // ratio, compress_ratio=ratio)
            assert torch.equal(got, want)
        c128a = tsm.c128a_topk_indices(b.positions, b.token_to_req, b.c128_block_table, b.slot_mapping,
                                       num_decode_tokens=t, compress_ratio=128, block_size=1,
                                       width=V4["max_model_len"] // 128)
        assert torch.equal(m.c128a_indices, c128a[0]) and torch.equal(m.c128a_lens, c128a[1])
        for k in (V4["index_topk"], 5):
            got = builder.c4a_indices(m, b.local_topk[:, :k])
            want = tsm.compressed_topk_to_global(b.local_topk[:, :k], b.token_to_req, b.c4_block_table,
                                                 b.slot_mapping, block_size=V4["compressed_page_size"] // 4)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert got[0].stride(0) == V4["index_topk"], "row stride fixed by the buffer, whatever K"
        # Padding rows: empty lists, no compressed write.
        if padded:
            assert (m.swa_lens[-padded:] == 0).all() and (m.c128a_lens[-padded:] == 0).all()
            assert (m.c4_slot_mapping[-padded:] == -1).all()
        # Views of the same buffers every step: same addresses, same row strides.
        now = [m.swa_indices.data_ptr(), m.c128a_indices.data_ptr(), m.c4_slot_mapping.data_ptr(),
               m.swa_indices.stride(0), m.c128a_indices.stride(0)]
        assert addresses is None or now == addresses
        addresses = now


def test_minimax_m3_builder_matches_operators():
    builder = tsm.MiniMaxM3MetadataBuilder(max_num_reqs=6, max_model_len=M3["max_model_len"], page_size=M3["page"],
                                           decode_query_len=M3["q_len"])
    for num_reqs, padded in ((6, 0), (4, 2)):
        b = make_m3_batch(num_reqs, seed=num_reqs, padded=padded)
        m = builder(b.seq_lens, b.block_table)
        kv, qo = tsm.decode_runtime_metadata(b.seq_lens, decode_query_len=M3["q_len"])
        assert torch.equal(m.kv_segment_lens, kv) and torch.equal(m.qo_offset, qo)
        assert m.kv_segment_lens.data_ptr() == builder.kv_segment_lens.data_ptr()
        # The write slot of row r: its own position through the page table (naive).
        want = []
        for r, p in enumerate(qo.tolist()):
            page = b.block_table[r // M3["q_len"], p // M3["page"]].item() if 0 <= p else -1
            want.append(page * M3["page"] + p % M3["page"] if p >= 0 and page >= 0 else -1)
        assert m.slot_mapping.tolist() == want
        assert m.block_table is b.block_table


# =====================================================================================================
# Capacity errors (checked on shapes, message names the limit)
# =====================================================================================================


@pytest.mark.parametrize("model", ["deepseek_v4", "minimax_m3"])
@pytest.mark.parametrize("shapes", ["unbacked", "backed_size_oblivious"])
def test_step_compiles_once_for_batch_sizes_with_one(model, shapes):
    """A batch of one shares the graph of the other sizes in the two dynamic-shape modes that do not
    specialise sizes 0 and 1 (``dynamic=True`` alone compiles a second graph for it): the batch
    dimension of every input marked unbacked, or ``backed_size_oblivious``. Each call equals the eager
    step; the caches and builders end equal. Unbacked sizes needed the builders' 2-D buffers
    (``steps.py::_row_view``) and capacity checks that do not guard on an unbacked size. Inductor's
    caches are off here: with ``backed_size_oblivious`` a cache hit brings back a guard ``2 <= size``
    (torch 2.11 to 2.15), so a batch of one compiles again whenever an earlier process compiled the
    same step (docs/integration.md, "Batch sizes")."""
    torch._dynamo.reset()
    if model == "deepseek_v4":
        step, twin, make = V4Step(8), V4Step(8), make_v4_batch
    else:
        step, twin, make = M3Step(8), M3Step(8), make_m3_batch
    counter = compile_counter()
    oblivious = shapes == "backed_size_oblivious"
    no_caches = (torch._inductor.config.patch(fx_graph_cache=False),
                 torch._functorch.config.patch(enable_autograd_cache=False))
    with torch.fx.experimental._config.patch(backed_size_oblivious=oblivious), no_caches[0], no_caches[1]:
        compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True if oblivious else None)
        for n, padded in ((3, 0), (1, 0), (5, 1), (2, 1), (1, 1)):
            args = make(n, seed=n + padded, padded=padded).args()
            if not oblivious:
                for t in args:
                    torch._dynamo.decorators.mark_unbacked(t, 0)
            for got, want in zip(compiled(*args), twin(*args)):
                assert torch.equal(got, want)
    assert counter.frame_count == 1, f"expected one compiled frame, got {counter.frame_count}"
    for got, want in zip(step.buffers(), twin.buffers()):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _check_cpp_wrapper(model, device):
    """The whole step compiled with inductor's C++ wrapper (``cpp_wrapper=True``: the generated host code
    calls the operators from C++ instead of Python) at three batch sizes, against the eager step: outputs
    and every buffer (caches, builder) equal."""
    torch._dynamo.reset()
    if model == "deepseek_v4":
        step, twin, make = V4Step(8, device), V4Step(8, device), make_v4_batch
    else:
        step, twin, make = M3Step(8, device), M3Step(8, device), make_m3_batch
    with torch._inductor.config.patch(cpp_wrapper=True), torch.no_grad():
        compiled = torch.compile(step, fullgraph=True, dynamic=True)
        for n, padded in ((3, 0), (5, 1), (4, 2)):
            args = make(n, seed=n, padded=padded).to(device).args()
            for got, want in zip(compiled(*args), twin(*args)):
                assert torch.equal(got, want)
    for got, want in zip(step.buffers(), twin.buffers()):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("model", ["deepseek_v4", "minimax_m3"])
def test_step_compiles_with_cpp_wrapper(model):
    _check_cpp_wrapper(model, "cpu")


@requires_cuda
@pytest.mark.parametrize("model", ["deepseek_v4", "minimax_m3"])
def test_cuda_step_compiles_with_cpp_wrapper(model):
    _check_cpp_wrapper(model, "cuda")


@pytest.mark.parametrize("model", ["deepseek_v4", "minimax_m3"])
def test_compiled_step_refuses_a_batch_past_capacity(model):
    """A compiled step (symbolic batch size) given more rows than its builder holds raises an error that
    carries the builder's message, rather than writing past the buffers: the capacity check guards the
    graph, so the larger batch is traced again and that trace raises."""
    torch._dynamo.reset()
    if model == "deepseek_v4":
        step, make, fits, too_many = V4Step(max_num_tokens=4), make_v4_batch, 3, 6
        message = r"positions: expected at most 4 \(max_num_tokens"
    else:
        step, make, fits, too_many = M3Step(max_num_reqs=4), make_m3_batch, 3, 6
        message = r"seq_lens: expected at most 4 \(max_num_reqs"
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    compiled(*make(fits, seed=1).args())
    with pytest.raises(Exception, match=message):
        compiled(*make(too_many, seed=2).args())
    # Unbacked batch dimensions: the capacity becomes the graph's bound on the size, and a larger batch
    # fails too, with the compiler's own error (torch 2.11 to 2.15: a guard that fails as it is made)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    fitting, too_large = make(fits, seed=3).args(), make(too_many, seed=6).args()
    for t in (*fitting, *too_large):
        torch._dynamo.decorators.mark_unbacked(t, 0)
    compiled(*fitting)
    with pytest.raises(Exception):
        compiled(*too_large)


def test_capacity_errors():
    builder = tsm.DeepSeekV4MetadataBuilder(max_num_tokens=4, **V4)
    b = make_v4_batch(5, seed=0)
    with pytest.raises(ValueError, match=r"positions: expected at most 4 \(max_num_tokens.*got 5"):
        builder(*b.metadata_args())
    small = make_v4_batch(3, seed=0)
    m = builder(*small.metadata_args())
    wide = torch.zeros(3, V4["index_topk"] + 1, dtype=I32)
    with pytest.raises(ValueError, match=r"local_indices.shape\[1\]: expected at most 24 \(index_topk"):
        builder.c4a_indices(m, wide)
    with pytest.raises(ValueError, match=r"compressed_page_size: expected a multiple of 128"):
        tsm.DeepSeekV4MetadataBuilder(max_num_tokens=4, max_model_len=1024, compressed_page_size=64)
    with pytest.raises(ValueError, match=r"max_num_tokens: expected an int >= 1, got 0"):
        tsm.DeepSeekV4MetadataBuilder(max_num_tokens=0, max_model_len=1024)
    m3 = tsm.MiniMaxM3MetadataBuilder(max_num_reqs=2, max_model_len=M3["max_model_len"], page_size=M3["page"])
    b3 = make_m3_batch(3, seed=0)
    with pytest.raises(ValueError, match=r"seq_lens: expected at most 2 \(max_num_reqs.*got 3"):
        m3(b3.seq_lens, b3.block_table)
    with pytest.raises(ValueError, match=r"block_table.shape\[1\]: expected at most 20"):
        m3(b3.seq_lens[:2], torch.zeros(2, M3_COLS + 1, dtype=I32))
    # a tensor of the wrong rank: the builder's own check names it (before it reads shape[1])
    with pytest.raises(ValueError, match=r"local_indices: expected a 2-D tensor, got shape \(3,\)"):
        builder.c4a_indices(m, torch.zeros(3, dtype=I32))
    with pytest.raises(ValueError, match=r"block_table: expected a 2-D tensor, got shape \(2,\)"):
        m3(b3.seq_lens[:2], torch.zeros(2, dtype=I32))


# =====================================================================================================
# torch.compile: a whole step, fullgraph, one frame across three batch sizes
# =====================================================================================================


def _check_same(want_fn):
    def check(args, got):
        for g_, w_ in zip(got, want_fn(*args)):
            assert torch.equal(g_, w_)
    return check


def test_deepseek_v4_step_compiles_without_recompiles():
    step, twin = V4Step(max_num_tokens=8), V4Step(max_num_tokens=8)
    batches = [make_v4_batch(n, seed=n, padded=p).args() for n, p in ((3, 0), (5, 1), (6, 2))]
    assert_no_recompiles(step, batches, _check_same(twin))
    assert torch.equal(step.swa, twin.swa) and torch.equal(step.c4, twin.c4) and torch.equal(step.c128, twin.c128)


class V4TwoC4AStep(V4Step):
    """Two C4A layers, as in the model: each maps its own indexer output into the builder's one
    ``c4a_idx`` buffer and attends right after, so the compiled graph must keep the first layer's read of
    that buffer before the second layer's write (the eager order)."""

    def forward(self, *args):  # V4Step's arguments: the eight metadata tensors, q, kv, compressed_kv, local_topk
        *metadata_args, q, kv, compressed_kv, local_topk = args
        m, common = self.metadata_and_writes(metadata_args, kv, compressed_kv)
        outs = []
        for layer_topk in (local_topk, local_topk.flip(1) // 2):  # the second layer's indexer picks others
            idx, lens = self.builder.c4a_indices(m, layer_topk)
            outs.append(tsm.sparse_mla_decode(q, self.swa, m.swa_indices, extra_kv_cache=self.c4, extra_indices=idx,
                                              extra_topk_length=lens, **common)[0])
        return tuple(outs)


def test_deepseek_v4_c4a_layers_share_the_index_buffer_in_order():
    step, twin = V4TwoC4AStep(max_num_tokens=8), V4TwoC4AStep(max_num_tokens=8)
    batches = [make_v4_batch(n, seed=n, padded=p).args() for n, p in ((3, 0), (6, 2))]
    for args in batches:  # the two layers' outputs differ, so a swapped order would show
        first, second = V4TwoC4AStep(max_num_tokens=8)(*args)
        assert not torch.equal(first, second)
    assert_no_recompiles(step, batches, _check_same(twin))


def test_minimax_m3_step_compiles_without_recompiles():
    step, twin = M3Step(max_num_reqs=8), M3Step(max_num_reqs=8)
    batches = [make_m3_batch(n, seed=n, padded=p).args() for n, p in ((3, 0), (5, 1), (6, 2))]
    assert_no_recompiles(step, batches, _check_same(twin))
    assert torch.equal(step.cache.view(torch.uint8), twin.cache.view(torch.uint8))


# =====================================================================================================
# torch.compile: keeping a step's metadata past the next step (docs/integration.md, "Keeping a
# builder's metadata")
# =====================================================================================================


class _Metadata(torch.nn.Module):
    """A builder's call as a compiled function sees it. ``how``: ``"copy"`` returns the metadata as the
    builder gives it (views of its buffers) and copies every field into the caller's buffers passed as
    the last argument; ``"clone"`` returns clones made inside the compiled function."""

    def __init__(self, builder, how):
        super().__init__()
        self.builder, self.how = builder, how

    def forward(self, *args):
        if self.how == "copy":
            *args, into = args
        m = self.builder(*args)
        if self.how == "copy":
            for dst, t in zip(into, m):
                dst[: t.shape[0]].copy_(t)
        return tuple(t.clone() for t in m) if self.how == "clone" else tuple(m)


def _builders(model):
    """Two builders of the same capacity (one compiled, one eager) and two batches of the same size."""
    if model == "deepseek_v4":
        make = functools.partial(tsm.DeepSeekV4MetadataBuilder, max_num_tokens=8, **V4)
        a, b = (make_v4_batch(6, seed=s, padded=1).metadata_args() for s in (11, 12))
    else:
        make = functools.partial(tsm.MiniMaxM3MetadataBuilder, max_num_reqs=8, max_model_len=M3["max_model_len"],
                                 page_size=M3["page"], decode_query_len=M3["q_len"])
        a, b = (make_m3_batch(6, seed=s, padded=1).args()[:2] for s in (11, 12))
    return make(), make(), a, b


def _kept_after_next_step(model, how):
    """Run a compiled builder on batch ``a``, keep its metadata the ``how`` way, run it on batch ``b``;
    return what was kept, the eager metadata of ``a`` and ``b``, and the builder's buffers."""
    torch._dynamo.reset()
    builder, twin, a, b = _builders(model)
    compiled = torch.compile(_Metadata(builder, how), fullgraph=True, dynamic=True)
    want_a = tuple(t.clone() for t in twin(*a))
    into = lambda: tuple(torch.full((64, *t.shape[1:]), -7, dtype=t.dtype) for t in want_a)  # noqa: E731
    extra = lambda: (into(),) if how == "copy" else ()  # noqa: E731
    into_a = extra()
    got_a = compiled(*a, *into_a)
    outside = tuple(t.clone() for t in got_a)  # copies made outside the compiled function
    compiled(*b, *extra())
    want_b = tuple(twin(*b))
    return got_a, outside, into_a, want_a, want_b, {t.untyped_storage().data_ptr() for t in builder.buffers()}


@pytest.mark.parametrize("model", ["deepseek_v4", "minimax_m3"])
def test_compiled_metadata_kept_by_copies_outside_or_into_buffers(model):
    """The two ways docs/integration.md gives to keep a step's metadata: copies made outside the compiled
    function, and copies into the caller's buffers inside it, keep step a's metadata after step b; the
    returned views of the builder's buffers hold step b's (the builder's contract)."""
    got_a, outside, into_a, want_a, want_b, owned = _kept_after_next_step(model, "copy")
    overwritten = 0
    for got, kept, dst, wa, wb in zip(got_a, outside, into_a[0], want_a, want_b):
        assert torch.equal(kept, wa)
        assert torch.equal(dst[: wa.shape[0]], wa) and (dst[wa.shape[0]:] == -7).all()
        if got.untyped_storage().data_ptr() in owned:  # a view of a builder buffer: now step b's metadata
            assert torch.equal(got, wb)
            overwritten += not torch.equal(wa, wb)
    assert overwritten >= 2, "the two batches should differ in the builder's own fields"


@pytest.mark.xfail(strict=False, reason="pytorch/pytorch#195451: inductor (torch 2.11-2.15) removes a clone of a "
                   "buffer slice written in the same graph and returns the buffer itself")
@pytest.mark.parametrize("model", ["deepseek_v4", "minimax_m3"])
def test_compiled_metadata_cloned_inside(model):
    """Clones made inside the compiled function would keep step a's metadata in eager mode; with the
    inductor issue above they are the builder's buffers and hold step b's. XPASS here means a torch
    release fixed it (then update docs/integration.md)."""
    got_a, _, _, want_a, _, _ = _kept_after_next_step(model, "clone")
    for got, wa in zip(got_a, want_a):
        assert torch.equal(got, wa)


# =====================================================================================================
# GPU: reduce-overhead without skipped CUDA graphs; one captured step replayed at several batch
# compositions (padded rows included)
# =====================================================================================================


@requires_cuda
@pytest.mark.parametrize("model", ["deepseek_v4", "minimax_m3"])
def test_reduce_overhead_takes_cuda_graph(model):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    if model == "deepseek_v4":
        step, twin = V4Step(8, "cuda"), V4Step(8, "cuda")
        batches = [make_v4_batch(8, seed=s, padded=p).to("cuda") for s, p in ((0, 0), (1, 3), (2, 7))]
    else:
        step, twin = M3Step(8, "cuda"), M3Step(8, "cuda")
        batches = [make_m3_batch(8, seed=s, padded=p).to("cuda") for s, p in ((0, 0), (1, 3), (2, 7))]
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}), torch.no_grad():
        for b in batches + batches:
            got = [x.clone() for x in compiled(*b.args())]
            want = twin(*b.args())
            for g_, w_ in zip(got, want):
                assert torch.equal(g_, w_)
    assert counters["inductor"]["cudagraph_skips"] == 0


@requires_cuda
@pytest.mark.parametrize("model", ["deepseek_v4", "minimax_m3"])
def test_manual_cuda_graph_replays_at_batch_compositions(model):
    """Capture the whole step once at 8 rows; replay with 8 real requests, then 5 real + 3 padded,
    then 1 real + 7 padded, each equal to the eager step on the same inputs (caches included)."""
    if model == "deepseek_v4":
        step, twin, make = V4Step(8, "cuda"), V4Step(8, "cuda"), make_v4_batch
    else:
        step, twin, make = M3Step(8, "cuda"), M3Step(8, "cuda"), make_m3_batch
    static = make(8, seed=100).to("cuda")
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(*static.args())  # compiles the Triton kernels outside the capture
            twin(*static.args())  # same writes, so the two caches stay equal
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step(*static.args())
        for seed, padded in ((1, 0), (2, 3), (3, 7)):
            new = make(8, seed=seed, padded=padded).to("cuda")
            for dst, src in zip(static.args(), new.args()):
                dst.copy_(src)
            graph.replay()
            want = twin(*new.args())
            for g_, w_ in zip(outputs, want):
                assert torch.equal(g_, w_), f"replay with {padded} padded requests differs from eager"
            for a, b in zip(step.buffers(), twin.buffers()):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "caches differ after replay"


# =====================================================================================================
# DeepSeek-V3.2: a decode step from the operators alone (docs/integration.md): the indexer's
# request-local token numbers to slots with compressed_topk_to_global (block_size = the page size),
# then sparse_mla_decode over the 656-byte FP8 cache
# =====================================================================================================

V32 = dict(page=16, heads=12, topk=24, max_model_len=160)
V32_SCALE = 192 ** -0.5


def make_v32_batch(num_reqs: int, seed: int, padded: int = 0):
    """``(arguments of V32Step, the test's own slot of every (request, position))``: each request's
    context written to the cache through its own page table (pages drawn without replacement from a
    cache whose other bytes are 0xFF, NaN in every field), its decode token at the last position, and
    an indexer's choice of distinct positions of its context (``-1`` past it, one ``-1`` inside a list).
    ``padded`` trailing requests have no context and a decode token with slot -1."""
    g = torch.Generator().manual_seed(seed)
    page, cols = V32["page"], V32["max_model_len"] // V32["page"]
    real = num_reqs - padded
    seq = torch.randint(3, V32["max_model_len"] + 1, (num_reqs,), generator=g)
    seq[real:] = 0
    pool = num_reqs * cols + 2
    block_table = torch.randperm(pool, generator=g)[: num_reqs * cols].view(num_reqs, cols).to(I32)
    block_table[torch.arange(cols)[None, :] >= (seq[:, None] + page - 1) // page] = -1
    cache = torch.full((pool, page, 656), 0xFF, dtype=torch.uint8)
    slot_of = {}
    for r in range(real):
        pos = torch.arange(int(seq[r]))
        slots = block_table[r, pos // page].to(I64) * page + pos % page
        tsm.kv_cache_insert(torch.randn(len(pos), 576, generator=g), slots, cache, kv_format="fp8_656")
        slot_of.update({(r, int(p)): int(s) for p, s in zip(pos, slots)})
    local = torch.full((num_reqs, V32["topk"]), -1, dtype=I32)
    for r in range(real):
        chosen = torch.randperm(int(seq[r]), generator=g)[: V32["topk"]]
        local[r, : len(chosen)] = chosen.to(I32)
    if real:
        local[0, 1] = -1
    slot_mapping = torch.tensor([slot_of[(r, int(seq[r]) - 1)] if r < real else -1 for r in range(num_reqs)])
    q = torch.randn(num_reqs, V32["heads"], 576, generator=g).to(torch.bfloat16)
    args = (q, cache, local, torch.arange(num_reqs).to(I32), block_table, slot_mapping)
    return args, slot_of


class V32Step(torch.nn.Module):
    """One DeepSeek-V3.2 layer's attention. The scale is a constant expression here, as in the other
    steps: a float read from a global or an attribute enters a ``dynamic=True`` trace as a symbolic
    float, which dynamo specialises in a second pass of its first analysis (two frames counted)."""

    def forward(self, q, kv_cache, local_topk, token_to_req, block_table, slot_mapping):
        indices, lens = tsm.compressed_topk_to_global(local_topk, token_to_req, block_table, slot_mapping,
                                                      block_size=V32["page"])
        return tsm.sparse_mla_decode(q, kv_cache, indices, softmax_scale=192 ** -0.5, kv_format="fp8_656",
                                     topk_length=lens)


def _v32_reference(args, slot_of):
    """float64 attention of each token over the cache values at the positions its indexer chose, found
    through the test's own (request, position) -> slot map, not through the library's conversion."""
    q, cache, local, _, _, slot_mapping = args
    out = torch.zeros(q.shape[0], q.shape[1], 512, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("inf"), dtype=torch.float64)
    for r in range(q.shape[0]):
        positions = [int(p) for p in local[r] if p >= 0]
        if slot_mapping[r] < 0 or not positions:
            continue
        slots = torch.tensor([slot_of[(r, p)] for p in positions])
        keys = tsm.kv_cache_gather(cache, slots, kv_format="fp8_656", dtype=torch.float32).double()
        scores = (q[r].double() @ keys.T) * V32_SCALE
        lse[r] = torch.logsumexp(scores, dim=-1)
        out[r] = torch.softmax(scores, dim=-1) @ keys[:, :512]
    return out, lse


def _check_v32_step(device):
    for num_reqs, padded in ((5, 0), (4, 2)):
        args, slot_of = make_v32_batch(num_reqs, seed=num_reqs, padded=padded)
        out, lse = V32Step()(*(a.to(device) for a in args))
        ref_out, ref_lse = _v32_reference(args, slot_of)
        torch.testing.assert_close(out.cpu().double(), ref_out, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=1e-3, rtol=1e-4)
        if padded:
            assert (out[-padded:] == 0).all() and torch.isinf(lse[-padded:]).all()


def test_deepseek_v32_step_matches_reference():
    _check_v32_step("cpu")


@requires_cuda
def test_cuda_deepseek_v32_step_matches_reference():
    """The kernels the launcher picks on the GPU (the few-heads Hopper kernel on sm_90, 12 heads)."""
    _check_v32_step("cuda")


def test_deepseek_v32_step_compiles_without_recompiles():
    batches = [make_v32_batch(n, seed=n, padded=p)[0] for n, p in ((3, 0), (5, 1), (6, 2))]
    assert_no_recompiles(V32Step(), batches, _check_same(V32Step()))


# =====================================================================================================
# torch.export and AOTInductor: a whole step exported once with a dynamic batch size (traced at 3
# requests), then run at 3, 5 and 7 requests (padded ones included) as the exported program, strict
# export's program, the functionalised program (run_decompositions), a save/load round trip, and an
# AOTInductor package; each equal to the eager step on the same inputs, caches included
# =====================================================================================================

EXPORT_MODELS = ["deepseek_v4", "minimax_m3", "deepseek_v32"]
EXPORT_BATCHES = ((3, 0), (5, 1), (7, 2))
# torch 2.13's own pickling of export tree specs warns of its deprecated LeafSpec check
quiet_treespec = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning")


def _export_case(model: str, device: str):
    """``(step, eager twin, make(num_reqs, seed, padded) -> argument tuple, dynamic_shapes)``."""
    from torch.export import Dim

    n = Dim("num_reqs", min=1, max=8)
    if model == "deepseek_v4":
        def make(num, seed, padded):
            return make_v4_batch(num, seed=seed, padded=padded).to(device).args()
        shapes = ({0: n + 1},) + ({0: n},) * 11
        return V4Step(8, device), V4Step(8, device), make, shapes
    if model == "minimax_m3":
        def make(num, seed, padded):
            return make_m3_batch(num, seed=seed, padded=padded).to(device).args()
        shapes = ({0: n}, {0: n}) + ({0: M3["q_len"] * n},) * 4
        return M3Step(8, device), M3Step(8, device), make, shapes

    def make(num, seed, padded):
        return tuple(a.to(device) for a in make_v32_batch(num, seed=seed, padded=padded)[0])
    shapes = ({0: n}, {0: Dim("pages", min=2, max=1 << 20)}, {0: n}, {0: n}, {0: n}, {0: n})
    return V32Step(), V32Step(), make, shapes


def _exported(model: str, form: str, device: str = "cpu"):
    step, twin, make, shapes = _export_case(model, device)
    ep = torch.export.export(step, make(3, 3, 0), dynamic_shapes=shapes, strict=form == "strict")
    if form == "decomposed":
        ep = ep.run_decompositions()
    elif form == "saved":
        buffer = io.BytesIO()
        torch.export.save(ep, buffer)
        buffer.seek(0)
        ep = torch.export.load(buffer)
    return ep, twin, make


def _check_exported_runs(run, twin, make, caches):
    """Run the batches in order through ``run`` and the eager ``twin``: outputs equal, and the named
    caches of ``caches`` (a module, or None) equal the twin's after each step."""
    with torch.no_grad():
        for num, padded in EXPORT_BATCHES:
            args = make(num, 100 + num, padded)
            got, want = run(*args), twin(*args)
            for g_, w_ in zip(got, want, strict=True):
                assert g_.shape == w_.shape and torch.equal(g_, w_), f"{num} requests ({padded} padded) differ"
            for name in ("swa", "c4", "c128", "cache") if caches is not None else ():
                if hasattr(twin, name):
                    got_cache, want_cache = getattr(caches, name), getattr(twin, name)
                    assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8)), name


def _check_exported_step(model: str, form: str, device: str):
    ep, twin, make = _exported(model, form, device)
    module = ep.module()
    _check_exported_runs(module, twin, make, module)


@quiet_treespec
@pytest.mark.parametrize("form", ["program", "strict", "decomposed", "saved"])
@pytest.mark.parametrize("model", EXPORT_MODELS)
def test_exported_step_matches_eager(model, form):
    _check_exported_step(model, form, "cpu")


@quiet_treespec
@requires_cuda
@pytest.mark.parametrize("form", ["program", "decomposed"])
@pytest.mark.parametrize("model", EXPORT_MODELS)
def test_cuda_exported_step_matches_eager(model, form):
    _check_exported_step(model, form, "cuda")


_AOTI_PROBE = """
import sys, torch
device, path = sys.argv[1:]
class Twice(torch.nn.Module):
    def forward(self, x):
        return x * 2
x = torch.ones(4, device=device)
package = torch._inductor.aoti_compile_and_package(torch.export.export(Twice(), (x,)), package_path=path)
assert torch.equal(torch._inductor.aoti_load_package(package)(x), x * 2)
"""


@functools.cache
def _aoti_unavailable(device: str) -> str | None:
    """Why AOTInductor cannot be tested here, or None. It needs a C++ compiler, and on some hosts loading
    any package crashes the process (seen with torch 2.11 on an H200 host: a segmentation fault in
    ``aoti_load_package`` for a one-line model too), so a trivial package is built and loaded in a
    subprocess first."""
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return "AOTInductor compiles C++: needs a C++ compiler"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        probe = subprocess.run([sys.executable, "-c", _AOTI_PROBE, device, os.path.join(tmp, "probe.pt2")],
                               capture_output=True, text=True, env=env, timeout=600)
    if probe.returncode < 0:
        return (f"AOTInductor does not work on this host: building and loading a one-line model's package on "
                f"{device} ended the process with signal {-probe.returncode}")
    if probe.returncode > 0:
        errors = [line for line in probe.stderr.splitlines() if "Error" in line] or ["no error message"]
        return (f"AOTInductor does not work on this host: a one-line model's package on {device} failed: "
                f"{errors[-1].strip()}")
    return None


def _check_aoti_package(model: str, device: str, tmp_path):
    """The package's model holds its own copies of the buffers, so only outputs are compared: each step
    attends over the tokens it has just written, so a lost cache write shows in the outputs too."""
    if (reason := _aoti_unavailable(device)) is not None:
        pytest.skip(reason)
    ep, twin, make = _exported(model, "program", device)
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / f"{model}.pt2"))
    _check_exported_runs(torch._inductor.aoti_load_package(path), twin, make, None)


@quiet_treespec
@pytest.mark.parametrize("model", EXPORT_MODELS)
def test_aoti_package_matches_eager(model, tmp_path):
    _check_aoti_package(model, "cpu", tmp_path)


@quiet_treespec
@requires_cuda
@pytest.mark.parametrize("model", EXPORT_MODELS)
def test_cuda_aoti_package_matches_eager(model, tmp_path):
    _check_aoti_package(model, "cuda", tmp_path)
