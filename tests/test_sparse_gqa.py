"""sparse_gqa_decode (SPEC section 7): schema, reference parity, Triton interpreter parity, opcheck,
torch.compile, error messages, CUDA parity and CUDA graphs.

The reference below is written here, independently of the library: Python loops over rows, KV heads
and selected pages, float64 math. Inputs carry every kind of invalid index the SPEC lists, and every
cache element that no valid (row, KV head, page, key) may read is NaN, so a kernel that reads one
produces NaN and fails the comparison.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from expecttest import assert_expected_inline

from torch_sparse_mla import decode_runtime_metadata, sparse_gqa_decode
from torch_sparse_mla.ops import sparse_gqa as gqa_ops
from common import assert_no_recompiles, poison, requires_cuda, requires_interpreter

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
DTYPE_NAMES = {BF16: "bf16", FP16: "fp16", FP8: "fp8"}


# =====================================================================================================
# Inputs and the independent reference
# =====================================================================================================


@dataclasses.dataclass(frozen=True)
class Cfg:
    hq: int = 8
    hkv: int = 1
    dh: int = 64
    page_size: int = 16
    dql: int = 1
    q_dtype: torch.dtype = FP16
    kv_dtype: torch.dtype = FP16
    layout: str = "HND"  # physical order of the cache: HND = [pages, Hkv, page, 2Dh], NHD = [pages, page, Hkv, 2Dh]
    batch: int = 3
    n_sel: int = 4
    extra_rows: int = 1  # rows past the last request (t // decode_query_len >= B): must give zeros

    @property
    def id(self) -> str:
        return (f"q{DTYPE_NAMES[self.q_dtype]}-kv{DTYPE_NAMES[self.kv_dtype]}-h{self.hq}/{self.hkv}-d{self.dh}"
                f"-page{self.page_size}-qlen{self.dql}-{self.layout}")


def make_inputs(cfg: Cfg, seed: int = 0, device="cpu"):
    """Schema-ordered arguments of one call (a dict) and the ``seq_lens`` they were made from.

    Request 1 is padding (``seq_len`` 0); request 0 is full-length and its block table has a missing
    page (-1), an out-of-range physical id and a negative one; selections prefer the request's pages
    but also hold -1 in the middle and pages past the table (``b >= W``); the extra rows have no request.
    """
    gen = torch.Generator().manual_seed(seed)
    ps, batch = cfg.page_size, cfg.batch
    max_len = ps * (cfg.n_sel + 2)
    seq_lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    seq_lens[0] = max_len
    if batch > 1:
        seq_lens[1] = 0
    num_cols = math.ceil(max_len / ps) + 1
    num_pages = batch * num_cols + 3  # three pages nobody owns
    perm = torch.randperm(num_pages, generator=gen)[: batch * num_cols].view(batch, num_cols)
    used_cols = (seq_lens + ps - 1) // ps
    block_table = torch.where(torch.arange(num_cols)[None, :] < used_cols[:, None], perm, -1)
    if batch > 0:
        block_table[0, 0], block_table[0, 1], block_table[0, 2] = -1, num_pages + 5, -7

    num_rows = batch * cfg.dql + cfg.extra_rows
    kv_lens, qo = decode_runtime_metadata(seq_lens.to(torch.int32), decode_query_len=cfg.dql)
    kv_lens = torch.cat([kv_lens, torch.full((cfg.extra_rows,), max_len, dtype=torch.int32)])
    qo = torch.cat([qo, torch.full((cfg.extra_rows,), max_len - 1, dtype=torch.int32)])

    # Distinct pages per (row, KV head): the request's last page first (where the rows of one request
    # see different numbers of keys), then its other columns, then columns past them, in random order.
    cols_sel = torch.arange(num_cols + 2)[None, :]
    if batch > 0:
        req_cols = used_cols[(torch.arange(num_rows) // cfg.dql).clamp(max=batch - 1)][:, None]
    else:
        req_cols = torch.zeros(num_rows, 1, dtype=torch.int64)
    rank = (cols_sel >= req_cols).float() - 2.0 * (cols_sel == req_cols - 1).float()
    priority = torch.rand(num_rows, cfg.hkv, num_cols + 2, generator=gen) + rank[:, None, :]
    topk = priority.argsort(-1)[..., : cfg.n_sel].to(torch.int32)
    if cfg.n_sel >= 3:  # an empty entry inside each list
        j = 1 + (torch.arange(num_rows)[:, None] + torch.arange(cfg.hkv)[None, :]) % (cfg.n_sel - 2)
        topk.scatter_(2, j[..., None], -1)

    if cfg.layout == "HND":
        cache = torch.randn(num_pages, cfg.hkv, ps, 2 * cfg.dh, generator=gen)
    else:
        cache = torch.randn(num_pages, ps, cfg.hkv, 2 * cfg.dh, generator=gen).permute(0, 2, 1, 3)
    q = torch.randn(num_rows, cfg.hq, cfg.dh, generator=gen)
    fp8_q, fp8_kv = cfg.q_dtype == FP8, cfg.kv_dtype == FP8
    if fp8_kv:
        cache = cache * 4
    if fp8_q:
        q = q * 2
    cache[~_keys_read(topk, block_table, kv_lens, qo, cfg.dql, num_pages, ps)] = float("nan")

    dev = torch.device(device)
    args = dict(
        q=q.to(cfg.q_dtype).to(dev), kv_cache=cache.to(cfg.kv_dtype).to(dev), topk_pages=topk.to(dev),
        block_table=block_table.to(torch.int32).to(dev), kv_segment_lens=kv_lens.to(dev), qo_offset=qo.to(dev),
        decode_query_len=cfg.dql, softmax_scale=cfg.dh ** -0.5,
        q_scale=0.5 if fp8_q else 1.0, k_scale=0.25 if fp8_kv else 1.0, v_scale=0.5 if fp8_kv else 1.0,
    )
    return args, seq_lens.to(torch.int32).to(dev)


def _keys_read(topk, block_table, kv_lens, qo, dql, num_pages, ps):
    """bool [pages, Hkv, page_size]: the cache keys some valid (row, KV head, selected page) may read."""
    read = torch.zeros(num_pages, topk.shape[1], ps, dtype=torch.bool)
    batch, num_cols = block_table.shape
    for t in range(topk.shape[0]):
        if t // dql >= batch:
            continue
        limit = min(int(qo[t]) + 1, int(kv_lens[t]))
        for g in range(topk.shape[1]):
            for b in topk[t, g].tolist():
                if 0 <= b < num_cols and 0 <= (p := int(block_table[t // dql, b])) < num_pages:
                    read[p, g, : max(0, min(ps, limit - b * ps))] = True
    return read


def reference(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len, softmax_scale,
              q_scale=1.0, k_scale=1.0, v_scale=1.0):
    """float64 ``[T, Hq, Dh]``, straight from SPEC section 7."""
    num_rows, hq, dh = q.shape
    num_pages, hkv, ps, _ = kv_cache.shape
    batch, num_cols = block_table.shape
    group = hq // hkv
    qd, kv = q.cpu().to(torch.float64), kv_cache.cpu().to(torch.float64)
    topk, table = topk_pages.cpu(), block_table.cpu()
    out = torch.zeros(num_rows, hq, dh, dtype=torch.float64)
    for t in range(num_rows):
        r = t // decode_query_len
        if r >= batch:
            continue
        limit = min(int(qo_offset[t]) + 1, int(kv_segment_lens[t]))
        for g in range(hkv):
            keys, values = [], []
            for b in topk[t, g].tolist():
                if b < 0 or b >= num_cols or not 0 <= (p := int(table[r, b])) < num_pages:
                    continue
                visible = max(0, min(ps, limit - b * ps))  # keys o with b * ps + o < limit
                keys.append(kv[p, g, :visible, :dh])
                values.append(kv[p, g, :visible, dh:])
            if keys and sum(k.shape[0] for k in keys) > 0:
                heads = slice(g * group, (g + 1) * group)
                scores = qd[t, heads] @ torch.cat(keys).T * (softmax_scale * q_scale * k_scale)
                out[t, heads] = v_scale * torch.softmax(scores, dim=-1) @ torch.cat(values)
    return out


def _tolerance(q_dtype):
    # The output is stored in bf16 (bf16 or fp8 q) or fp16; the CUDA kernel also rounds P to bf16.
    return dict(atol=2e-2, rtol=2e-2) if q_dtype != FP16 else dict(atol=4e-3, rtol=4e-3)


def assert_matches_reference(result, args):
    ref = reference(**args)
    assert result.dtype == (BF16 if args["q"].dtype == FP8 else args["q"].dtype)
    assert not torch.isnan(result).any(), "NaN in the output: a kernel read a key it must not read"
    torch.testing.assert_close(result.cpu().to(torch.float64), ref, **_tolerance(args["q"].dtype))
    return ref


def _public(args, **extra):
    a = dict(args)
    positional = [a.pop(k) for k in ("q", "kv_cache", "topk_pages", "block_table", "kv_segment_lens", "qo_offset")]
    return sparse_gqa_decode(*positional, **a, **extra)


def _out_buffer(args, transpose=False):
    q = args["q"]
    dtype = BF16 if q.dtype == FP8 else q.dtype
    if transpose:  # a non-contiguous buffer: heads outermost
        return poison(torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=dtype, device=q.device).transpose(0, 1))
    return poison(torch.empty(q.shape, dtype=dtype, device=q.device))


CPU_CASES = [
    Cfg(hq=8, hkv=1, dh=64, page_size=16, dql=1, q_dtype=BF16, kv_dtype=BF16),
    Cfg(hq=64, hkv=4, dh=128, page_size=32, dql=4, q_dtype=FP16, kv_dtype=FP16, layout="NHD"),
    Cfg(hq=6, hkv=2, dh=256, page_size=16, dql=4, q_dtype=FP8, kv_dtype=FP8),
    Cfg(hq=64, hkv=4, dh=128, page_size=64, dql=1, q_dtype=BF16, kv_dtype=FP8, layout="NHD", n_sel=3),
    Cfg(hq=6, hkv=2, dh=64, page_size=16, dql=4, q_dtype=FP16, kv_dtype=BF16, layout="NHD"),
    Cfg(hq=8, hkv=1, dh=128, page_size=48, dql=1, q_dtype=FP8, kv_dtype=BF16, n_sel=5),  # page size not 2^k
]


def test_inputs_exercise_the_kernel():
    """The factory makes rows with keys, rows without, and NaN the kernels must avoid."""
    args, _ = make_inputs(CPU_CASES[1])
    ref = reference(**args)
    has_keys = ref.abs().sum(dim=(1, 2)) > 0
    assert 0 < int(has_keys.sum()) < ref.shape[0]
    assert torch.isnan(args["kv_cache"].float()).any()


# =====================================================================================================
# Schema snapshot
# =====================================================================================================


def _schema_lines(overload) -> str:
    return str(overload._schema).replace(", ", ",\n")  # one argument per line


def test_schema():
    assert_expected_inline(_schema_lines(torch.ops.sparse_mla.sparse_gqa_decode.default), """\
sparse_mla::sparse_gqa_decode(Tensor q,
Tensor kv_cache,
Tensor topk_pages,
Tensor block_table,
Tensor kv_segment_lens,
Tensor qo_offset,
int decode_query_len,
float softmax_scale,
float q_scale=1.,
float k_scale=1.,
float v_scale=1.) -> Tensor""")
    assert_expected_inline(_schema_lines(torch.ops.sparse_mla.sparse_gqa_decode.out), """\
sparse_mla::sparse_gqa_decode.out(Tensor q,
Tensor kv_cache,
Tensor topk_pages,
Tensor block_table,
Tensor kv_segment_lens,
Tensor qo_offset,
int decode_query_len,
float softmax_scale,
float q_scale=1.,
float k_scale=1.,
float v_scale=1.,
*,
Tensor(a!) out) -> ()""")


# =====================================================================================================
# Reference parity (CPU kernel)
# =====================================================================================================


@pytest.mark.parametrize("cfg", CPU_CASES, ids=lambda c: c.id)
def test_cpu_matches_reference(cfg):
    args, _ = make_inputs(cfg, seed=1)
    assert_matches_reference(_public(args), args)
    out = _out_buffer(args, transpose=True)
    assert _public(args, out=out) is out
    assert_matches_reference(out, args)


def test_cpu_chunked_rows(monkeypatch):
    """The CPU kernel processes rows in chunks: the request of a row must not depend on its chunk."""
    monkeypatch.setattr(gqa_ops, "_TORCH_CHUNK_ELEMENTS", 1)  # one row per chunk
    args, _ = make_inputs(Cfg(hq=6, hkv=2, dql=4, batch=2), seed=2)
    assert_matches_reference(_public(args), args)


@pytest.mark.parametrize("what", ["no_rows", "no_selection", "no_requests", "no_pages"])
def test_cpu_empty_inputs(what):
    args, _ = make_inputs(Cfg(hq=4, hkv=2, dql=2, batch=2, extra_rows=0), seed=3)
    if what == "no_rows":
        for k in ("q", "topk_pages", "kv_segment_lens", "qo_offset"):
            args[k] = args[k][:0]
    elif what == "no_selection":
        args["topk_pages"] = args["topk_pages"][..., :0]
    elif what == "no_requests":
        args["block_table"] = args["block_table"][:0]
    else:
        args["kv_cache"] = args["kv_cache"][:0]
    result = _public(args)
    assert result.shape == args["q"].shape
    assert (result == 0).all()


# =====================================================================================================
# Triton interpreter parity (CPU tensors; tl.dot operands must be fp16/fp32 there, see the docs)
# =====================================================================================================

INTERPRETER_CASES = [
    Cfg(hq=8, hkv=1, dh=64, page_size=16, dql=4, batch=2, n_sel=6),
    Cfg(hq=6, hkv=2, dh=128, page_size=32, dql=1, q_dtype=FP8, kv_dtype=FP8, layout="NHD", n_sel=6),
    Cfg(hq=64, hkv=4, dh=256, page_size=16, dql=1, q_dtype=FP16, kv_dtype=FP8, batch=2, n_sel=3),
    Cfg(hq=80, hkv=1, dh=64, page_size=48, dql=4, q_dtype=FP16, kv_dtype=BF16, batch=2, layout="NHD"),  # 2 head blocks
]


@requires_interpreter
@pytest.mark.parametrize("num_splits", [None, 1, 3], ids=lambda s: f"splits={s or 'auto'}")
@pytest.mark.parametrize("cfg", INTERPRETER_CASES, ids=lambda c: c.id)
def test_triton_interpreter_matches_reference(cfg, num_splits):
    args, _ = make_inputs(cfg, seed=4)
    out = _out_buffer(args, transpose=num_splits == 3)
    gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, num_splits=num_splits)
    assert_matches_reference(out, args)


@requires_interpreter
def test_triton_interpreter_no_selection():
    args, _ = make_inputs(Cfg(batch=2, extra_rows=0), seed=5)
    args["topk_pages"] = args["topk_pages"][..., :0]
    out = _out_buffer(args)
    gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out)
    assert (out == 0).all()


def test_launch_config_splits_small_batches():
    """The heuristic splits page lists only when rows x KV heads cannot fill the device."""
    q = torch.empty(1, 64, 128, dtype=BF16)
    cache = torch.empty(8, 4, 128, 256, dtype=FP8)
    small = gqa_ops.launch_config(q, cache, 16, num_sms=132)
    assert (small.num_splits, gqa_ops.pages_per_split(16, small), small.block_h, small.block_n) == (16, 1, 16, 64)
    medium = gqa_ops.launch_config(torch.empty(16, 64, 128, dtype=BF16), cache, 16, num_sms=132)
    assert (medium.num_splits, gqa_ops.pages_per_split(16, medium)) == (4, 4)
    large = gqa_ops.launch_config(torch.empty(64, 64, 128, dtype=BF16), cache, 16, num_sms=132)
    assert large.num_splits == 1
    long_list = gqa_ops.launch_config(torch.empty(64, 64, 128, dtype=BF16), cache, 200, num_sms=132)
    assert gqa_ops.pages_per_split(200, long_list) <= 64  # bounds the page-list vector of a program
    assert gqa_ops.launch_config(q, cache, 16, num_splits=100).num_splits == 16  # never an empty split


# =====================================================================================================
# opcheck
# =====================================================================================================


def _schema_args(args):
    return tuple(args.values())


def test_opcheck_functional():
    args, _ = make_inputs(Cfg(hq=4, hkv=2, dql=2, batch=2, q_dtype=BF16, kv_dtype=BF16), seed=6)
    torch.library.opcheck(torch.ops.sparse_mla.sparse_gqa_decode.default, _schema_args(args))


def test_opcheck_out():
    args, _ = make_inputs(Cfg(hq=4, hkv=2, dql=2, batch=2), seed=7)
    torch.library.opcheck(torch.ops.sparse_mla.sparse_gqa_decode.out, _schema_args(args),
                          {"out": _out_buffer(args).zero_()})


def test_opcheck_fp8():
    # opcheck's test_schema cannot run float8 CPU tensors (torch's schema-check mode multiplies them);
    # the fake and AOT-dispatch checks can.
    args, _ = make_inputs(Cfg(hq=4, hkv=2, dql=2, batch=2, q_dtype=FP8, kv_dtype=FP8), seed=7)
    for overload, kwargs in ((torch.ops.sparse_mla.sparse_gqa_decode.default, {}),
                             (torch.ops.sparse_mla.sparse_gqa_decode.out, {"out": _out_buffer(args).zero_()})):
        torch.library.opcheck(overload, _schema_args(args), kwargs,
                              test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


# =====================================================================================================
# torch.compile: one graph, no recompiles across batch sizes
# =====================================================================================================


def test_compile_no_recompiles():
    # Sizes chosen so that no two dimensions are equal on the first call (duck sizing would tie them).
    cfg = Cfg(hq=6, hkv=3, dh=64, page_size=16, dql=2, n_sel=5, extra_rows=0)

    def step(q, kv_cache, topk_pages, block_table, seq_lens):
        kv_lens, qo = decode_runtime_metadata(seq_lens, decode_query_len=2)
        return sparse_gqa_decode(q, kv_cache, topk_pages, block_table, kv_lens, qo, decode_query_len=2,
                                 softmax_scale=0.125)

    arg_sets, expected = [], []
    for batch in (2, 5, 9):
        args, seq_lens = make_inputs(dataclasses.replace(cfg, batch=batch), seed=batch)
        arg_sets.append((args["q"], args["kv_cache"], args["topk_pages"], args["block_table"], seq_lens))
        expected.append(args)

    by_query = {id(a[0]): e for a, e in zip(arg_sets, expected)}

    def check(call_args, result):
        assert_matches_reference(result, by_query[id(call_args[0])])

    assert_no_recompiles(step, arg_sets, check)


# =====================================================================================================
# Error messages
# =====================================================================================================

_BAD_INPUTS = {
    "q_dtype": (lambda a: a.update(q=a["q"].float()), "q: expected dtype"),
    "q_rank": (lambda a: a.update(q=a["q"][0]), "q: expected a 3-D tensor"),
    "kv_cache_dtype": (lambda a: a.update(kv_cache=a["kv_cache"].float()), "kv_cache: expected dtype"),
    "kv_cache_head_dim": (lambda a: a.update(kv_cache=a["kv_cache"][..., :-2]), r"kv_cache: expected shape\[3\]"),
    "kv_cache_stride": (lambda a: a.update(kv_cache=a["kv_cache"].transpose(2, 3).contiguous().transpose(2, 3)),
                        r"kv_cache: expected stride\(-1\) == 1"),
    "heads_not_multiple": (lambda a: a.update(q=a["q"][:, :3]), "q: expected the number of query heads"),
    "topk_pages_dtype": (lambda a: a.update(topk_pages=a["topk_pages"].long()), "topk_pages: expected dtype int32"),
    "topk_pages_rows": (lambda a: a.update(topk_pages=a["topk_pages"][1:]), r"topk_pages: expected shape\[0\]"),
    "topk_pages_heads": (lambda a: a.update(topk_pages=a["topk_pages"][:, :1]), r"topk_pages: expected shape\[1\]"),
    "block_table_rank": (lambda a: a.update(block_table=a["block_table"][0]), "block_table: expected a 2-D tensor"),
    "kv_segment_lens_len": (lambda a: a.update(kv_segment_lens=a["kv_segment_lens"][1:]),
                            r"kv_segment_lens: expected shape\[0\]"),
    "qo_offset_dtype": (lambda a: a.update(qo_offset=a["qo_offset"].long()), "qo_offset: expected dtype int32"),
    "decode_query_len": (lambda a: a.update(decode_query_len=0), "decode_query_len: expected an int >= 1"),
}


@pytest.mark.parametrize("case", list(_BAD_INPUTS), ids=str)
def test_bad_inputs_raise(case):
    args, _ = make_inputs(Cfg(hq=4, hkv=2, dql=2, batch=2), seed=8)
    mutate, message = _BAD_INPUTS[case]
    mutate(args)
    with pytest.raises(ValueError, match=message):
        _public(args)


@pytest.mark.parametrize("case", ["dtype", "shape"], ids=str)
def test_bad_out_raises(case):
    args, _ = make_inputs(Cfg(hq=4, hkv=2, dql=2, batch=2), seed=9)
    out = _out_buffer(args)
    out = out.float() if case == "dtype" else out[:, :2]
    with pytest.raises(ValueError, match="out: expected"):
        _public(args, out=out)


# =====================================================================================================
# CUDA (run on the H200): parity, a manually captured CUDA graph, reduce-overhead compile
# =====================================================================================================

CUDA_CASES = [
    Cfg(hq=64, hkv=4, dh=128, page_size=128, dql=1, q_dtype=BF16, kv_dtype=FP8, batch=4, n_sel=6, layout="NHD"),
    Cfg(hq=64, hkv=4, dh=128, page_size=64, dql=4, q_dtype=BF16, kv_dtype=BF16, batch=3, n_sel=5),
    Cfg(hq=8, hkv=1, dh=256, page_size=16, dql=4, q_dtype=FP16, kv_dtype=FP16, batch=3, layout="NHD"),
    Cfg(hq=6, hkv=2, dh=64, page_size=32, dql=1, q_dtype=FP8, kv_dtype=FP8, batch=4),
    Cfg(hq=16, hkv=2, dh=128, page_size=256, dql=2, q_dtype=FP16, kv_dtype=BF16, batch=3, n_sel=3),
    Cfg(hq=128, hkv=1, dh=128, page_size=48, dql=1, q_dtype=BF16, kv_dtype=BF16, batch=3),  # 2 head blocks
]


@requires_cuda
@pytest.mark.parametrize("num_splits", [None, 1, 4], ids=lambda s: f"splits={s or 'auto'}")
@pytest.mark.parametrize("cfg", CUDA_CASES, ids=lambda c: c.id)
def test_cuda_matches_reference(cfg, num_splits):
    args, _ = make_inputs(cfg, seed=10, device="cuda")
    out = _out_buffer(args, transpose=num_splits == 4)
    gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, num_splits=num_splits)
    assert_matches_reference(out, args)
    assert_matches_reference(_public(args), args)


@requires_cuda
@pytest.mark.parametrize("dql", [1, 4], ids=lambda q: f"qlen{q}")
def test_cuda_large_batch_matches_torch_kernel(dql):
    """The benchmark's shapes (no split: 67 rows x 4 KV heads fill the GPU) against the PyTorch kernel,
    which the CPU tests tie to the reference."""
    cfg = Cfg(hq=64, hkv=4, dh=128, page_size=128, dql=dql, q_dtype=BF16, kv_dtype=FP8, batch=64 // dql,
              n_sel=16, extra_rows=3)
    args, _ = make_inputs(cfg, seed=11, device="cuda")
    out = _public(args)
    expected = _out_buffer(args)
    gqa_ops.sparse_gqa_decode_torch(*args.values(), out=expected)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@requires_cuda
def test_cuda_graph_capture_and_replay():
    cfg = Cfg(hq=16, hkv=2, dh=128, page_size=64, dql=2, q_dtype=BF16, kv_dtype=FP8, batch=4, extra_rows=0)
    args, seq_lens = make_inputs(cfg, seed=12, device="cuda")
    static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    static_seq_lens = seq_lens.clone()
    out = _out_buffer(args)

    def step():
        decode_runtime_metadata(static_seq_lens, decode_query_len=cfg.dql,
                                out=(static["kv_segment_lens"], static["qo_offset"]))
        _public(static, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for seed in (13, 14, 15):
        new, new_seq_lens = make_inputs(cfg, seed=seed, device="cuda")
        static_seq_lens.copy_(new_seq_lens)
        for k in ("q", "kv_cache", "topk_pages", "block_table"):
            static[k].copy_(new[k])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(out, new)


@requires_cuda
def test_cuda_compile_reduce_overhead():
    cfg = Cfg(hq=16, hkv=2, dh=128, page_size=64, dql=2, q_dtype=BF16, kv_dtype=FP8, batch=4, extra_rows=0)
    args, _ = make_inputs(cfg, seed=16, device="cuda")

    class DecodeStep(torch.nn.Module):
        def __init__(self, kv_cache, block_table):
            super().__init__()
            self.register_buffer("kv_cache", kv_cache)
            self.register_buffer("block_table", block_table)

        def forward(self, q, seq_lens, topk_pages):
            kv_lens, qo = decode_runtime_metadata(seq_lens, decode_query_len=cfg.dql)
            return sparse_gqa_decode(q, self.kv_cache, topk_pages, self.block_table, kv_lens, qo,
                                     decode_query_len=cfg.dql, softmax_scale=args["softmax_scale"],
                                     k_scale=args["k_scale"], v_scale=args["v_scale"])

    module = DecodeStep(args["kv_cache"].clone(), args["block_table"].clone())
    torch._dynamo.mark_static_address(module.kv_cache)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        compiled = torch.compile(module, mode="reduce-overhead", fullgraph=True)
        for seed in (17, 18, 19, 20):  # warm-up, record, then replays with new inputs
            new, new_seq_lens = make_inputs(cfg, seed=seed, device="cuda")
            module.kv_cache.copy_(new["kv_cache"])
            module.block_table.copy_(new["block_table"])
            result = compiled(new["q"], new_seq_lens, new["topk_pages"]).clone()
            assert_matches_reference(result, new)
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0

