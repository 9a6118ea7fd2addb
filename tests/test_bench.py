"""The benchmark's case factories and output helpers, exercised on a CPU (no timing: tests never
assert speed). Every family's ``cases(device="cpu", smoke=True)`` must build its inputs, run the
library operator and its plain-PyTorch reference (traced with fullgraph=True through AOT autograd,
the compile path without code generation) and agree with it; the tables and the roofline plot must
render from a row of every kind."""

from __future__ import annotations

import importlib

import pytest
import torch

from common import HAS_TRITON
from torch_sparse_mla.bench import common

FAMILIES = ("mla", "gqa", "metadata", "kv_cache")


@pytest.mark.parametrize("family", FAMILIES)
def test_cases_smoke(family, monkeypatch):
    monkeypatch.setattr(common, "REFERENCE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    module = importlib.import_module(f"torch_sparse_mla.bench.{family}")
    cases = list(module.cases(device="cpu", smoke=True))
    assert cases, f"{family}: no configuration"
    operators = set()
    for case in cases:
        assert case.bytes > 0 and case.flops >= 0 and case.operator, case.name
        assert case.reference is not None, f"{case.name}: every case has a plain-PyTorch reference"
        result = case.check()
        if result.startswith("rel "):
            assert float(result.split()[1]) < 2e-2, f"{case.name}: {result}"
        elif result.startswith("bytes "):  # a cache writer against a baseline with its own rounding
            assert float(result.split()[1]) < 2e-2, f"{case.name}: {result}"
        else:
            assert result == "exact", f"{case.name}: {result}"
        operators.add(case.operator)
    expected = {"mla": {"sparse_mla_decode"}, "gqa": {"sparse_gqa_decode", "gqa_kv_cache_insert"},
                "metadata": {"swa_indices", "compressed_slot_mapping", "c128a_topk_indices",
                             "compressed_topk_to_global", "decode_runtime_metadata"},
                "kv_cache": {"kv_cache_insert", "kv_cache_gather"}}[family]
    assert expected <= operators


def test_gqa_floor_reads_each_key_once():
    """The sparse-GQA decode rows count every row's keys; their floor reads each (request, KV head, key)
    once. With one query token per request the two agree; with four, rows of a request share pages."""
    from torch_sparse_mla.bench import gqa

    for q_len in (1, 4):
        args, _, keys, distinct = gqa._decode_inputs("fp8", 8, q_len, seed=3, device="cpu", context_pages=6,
                                                     n_sel=3, with_distinct=True)
        _, _, topk, _, kv_lens, qo, _, _ = args
        limit = torch.minimum(qo + 1, kv_lens).tolist()
        seen = {}
        for t in range(8):
            for g in range(gqa.HKV):
                for p in topk[t, g].tolist():
                    n = min(max(limit[t] - p * gqa.PAGE_SIZE, 0), gqa.PAGE_SIZE)
                    seen[t // q_len, g, p] = max(seen.get((t // q_len, g, p), 0), n)
        assert distinct == sum(seen.values())
        assert (distinct == keys) if q_len == 1 else (0 < distinct < keys)
    for case in gqa.cases(device="cpu", smoke=True):
        if case.operator == "sparse_gqa_decode":
            assert case.floor_read <= case.bytes - case.written, case.name
            if "q_len=1" in case.name:
                assert case.floor_read == case.bytes - case.written, case.name


def _same(a, b) -> bool:
    """Bytewise equality of two inputs (an fp8 tensor has no ``torch.equal``); other values by ``==``."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if isinstance(a, torch.Tensor) else a == b


def _drawn_with_other_global_seeds(make):
    """``make(5)`` under two different global seeds (which must not matter), then ``make(6)``."""
    torch.manual_seed(0)
    first = make(5)
    torch.manual_seed(1)
    return first, make(5), make(6)


@pytest.mark.parametrize("kv_format", ["fp8", "nvfp4"])
def test_gqa_inputs_are_the_same_for_the_same_seed(kv_format):
    """The sparse-GQA rows' inputs, the cache contents included, depend on the seed alone (so two runs,
    or two processes of one comparison, time the same bytes), and another seed gives another cache."""
    from torch_sparse_mla.bench import gqa

    def inputs(seed):
        args, _, _ = gqa._decode_inputs(kv_format, 2, 1, seed=seed, device="cpu", context_pages=3, n_sel=2)
        return args

    first, again, other = _drawn_with_other_global_seeds(inputs)
    assert all(_same(a, b) for a, b in zip(first, again))
    assert not _same(first[1], other[1])


@pytest.mark.parametrize("kv_format", ["auto", "fp8_656", "fp8_584"])
def test_kv_cache_gather_cache_is_the_same_for_the_same_seed(kv_format):
    """The gather rows' cache (every slot written) depends on the row's seed alone, not on the global
    generator, and another seed gives other bytes."""
    from torch_sparse_mla.bench import kv_cache

    def cache(seed):
        full = kv_cache._full_cache(kv_format, 2 * kv_cache.PAGE_SIZE, kv_cache.FORMATS[kv_format][0], seed, "cpu")
        return kv_cache._raw(full)

    first, again, other = _drawn_with_other_global_seeds(cache)
    assert _same(first, again)
    assert not _same(first, other)


def test_full_configurations_cover_the_targets():
    """The MLA benchmark times every configuration of the speed targets."""
    from torch_sparse_mla.bench import mla

    configs = {(fmt, h, k, k2, t) for _, fmt, h, k, k2, t in mla.CONFIGS}
    assert {("fp8_656", 128, 2048, 0, t) for t in (256, 128, 64, 4, 1)} <= configs
    assert {("fp8_656", 64, 2048, 0, 128), ("fp8_656", 16, 2048, 0, 128), ("fp8_584", 64, 128, 512, 128),
            ("auto", 128, 2048, 0, 64)} <= configs


def _row(name, operator, flops, nbytes, us, eager, host=False):
    peaks = common.Peaks(800e12, 4e12, "given")
    return {"config": name, "operator": operator, "us": us, "eager_us": eager, "host_overhead": host,
            "eager_ops_us": eager + 10.0,
            "flops": flops, "bytes": nbytes, "TFLOP/s": flops / us / 1e6, "GB/s": nbytes / us / 1e3,
            "roofline": max(flops / peaks.flops, nbytes / peaks.bytes) / (us * 1e-6), "bound": "memory",
            "ref_us": 2 * us, "ratio": 2.0, "check": "exact", "note": ""}


def test_tables_and_plot(tmp_path):
    rows = [_row("fp8_656 H=128 K=2048 T=1", "sparse_mla_decode", 6.0e8, 2.0e6, 20.0, 150.0, host=True),
            _row("swa_indices T=1", "swa_indices", 0.0, 600.0, 3.0, 14.0, host=True),
            _row("insert fp8_584 N=4096", "kv_cache_insert", 0.0, 6.6e6, 4.0, 9.0)]
    table = common.format_table(rows)
    assert table.splitlines()[0].startswith("| config | graph µs | eager µs | ref graph µs | ref / ours")
    assert len(table.splitlines()) == 2 + len(rows)
    overhead = common.format_host_overhead(rows)
    assert "| `sparse_mla_decode` | fp8_656 H=128 K=2048 T=1 | 150.0 | 20.0 | 130.0 | 160.0 | 140.0 |" in overhead
    assert "insert" not in overhead, "only T = 1 rows"
    assert overhead.splitlines()[2].endswith("| 150.0 |"), "one measurement: one value in the passes column"
    path = tmp_path / "bench.png"
    message = common.plot_roofline(rows, common.Peaks(800e12, 4e12, "given"), str(path), "test")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "skipped" in message and not path.exists()
    else:
        assert path.stat().st_size > 0


def test_remeasure_host_keeps_the_fastest_and_lists_each_pass(monkeypatch):
    """Later eager passes over the T = 1 rows: each row keeps the fastest time (public and torch.ops)
    and lists every measurement of the public function in the host-overhead table."""
    from torch_sparse_mla import _library

    times = iter([30.0, 41.0, 12.0, 43.0, 14.0, 45.0])  # public, torch.ops, alternating, 3 passes
    seen_direct = []

    def fake_eager(fn):
        seen_direct.append(_library.DIRECT_CALLS)
        return next(times)

    monkeypatch.setattr(common, "eager_us", fake_eager)
    row = _row("swa_indices T=1", "swa_indices", 0.0, 600.0, 3.0, 20.0, host=True)
    case = common.Case(name="x", flops=0.0, bytes=1.0, run=lambda: None, reference=None)
    common.remeasure_host([(case, row)], passes=3)
    assert seen_direct == [True, False] * 3 and _library.DIRECT_CALLS
    assert row["eager_us"] == 12.0 and row["eager_ops_us"] == 30.0
    assert row["eager_passes"] == [20.0, 30.0, 12.0, 14.0]
    line = common.format_host_overhead([row]).splitlines()[2]
    assert line == "| `swa_indices` | swa_indices T=1 | 12.0 | 3.0 | 9.0 | 30.0 | 27.0 | 20.0 / 30.0 / 12.0 / 14.0 |"


def test_bench_needs_a_gpu(capsys):
    from torch_sparse_mla.bench.__main__ import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the benchmark would run")
    assert main(["metadata"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_main_writes_every_table(tmp_path, monkeypatch, capsys):
    """The command's whole flow on a CPU, with the GPU timers replaced by constants: every family's
    table, the host-overhead table and the header reach the output file. Without Triton the command
    refuses (exit 2) and says why."""
    import functools

    from torch_sparse_mla.bench import __main__ as cli
    from torch_sparse_mla.ops import _triton

    monkeypatch.setattr(cli, "_gpu", lambda: "test device")
    monkeypatch.setattr(_triton, "HAS_TRITON", False)  # where Triton is not installed: a clear refusal
    assert cli.main(["all", "--out", str(tmp_path / "none.md")]) == 2
    assert "needs Triton" in capsys.readouterr().err and not (tmp_path / "none.md").exists()
    monkeypatch.undo()
    if not HAS_TRITON:
        pytest.skip("needs Triton (pip install triton; Linux): the benchmark times its kernels")

    monkeypatch.setattr(common, "REFERENCE_BACKEND", "aot_eager")
    monkeypatch.setattr(common, "graph_us", lambda fn, calls=1, clean_l2=False: (fn(), 8.0 if clean_l2 else 10.0)[1])
    monkeypatch.setattr(common, "eager_us", lambda fn: (fn(), 25.0)[1])
    monkeypatch.setattr(cli, "_gpu", lambda: "test device")
    floors = []  # (read, written) of every floor kernel the rows asked for

    def fake_floor(read, written):
        floors.append((read, written))
        return lambda: None

    monkeypatch.setattr(common, "floor_call", fake_floor)
    for family in FAMILIES:
        module = importlib.import_module(f"torch_sparse_mla.bench.{family}")
        monkeypatch.setattr(module, "cases", functools.partial(module.cases, device="cpu", smoke=True))
    out = tmp_path / "bench.md"
    assert cli.main(["all", "--out", str(out), "--peak-tflops", "100", "--peak-tbps", "1"]) == 0
    text = out.read_text()
    assert text.startswith("date ") and "GPU test device" in text and "(given)" in text
    for title in cli.TITLES.values():
        assert f"### {title}" in text
    assert "### Host overhead (T = 1)" in text
    assert "| config | graph µs | eager µs | ref graph µs | ref / ours | floor µs | floor / ours |" in text
    assert "clean L2" not in text
    assert "plot" in capsys.readouterr().out
    # one floor per row, reading what the row reads and writing what it writes
    rows = sum(len(list(importlib.import_module(f"torch_sparse_mla.bench.{f}").cases())) for f in FAMILIES)
    assert len(floors) == rows
    insert = next(c for c in importlib.import_module("torch_sparse_mla.bench.gqa").cases()
                  if c.operator == "gqa_kv_cache_insert")
    assert (insert.bytes - insert.written, insert.written) in floors and 0 < insert.written < insert.bytes

    # --no-floors: no floor kernel, no floor columns
    floors.clear()
    assert cli.main(["metadata", "--no-floors", "--out", str(out), "--peak-tflops", "100", "--peak-tbps", "1"]) == 0
    assert not floors and "floor" not in out.read_text()

    # --clean-l2: the operator, its reference and its floor timed again after a read-only flush, in five
    # more columns
    assert cli.main(["metadata", "--clean-l2", "--out", str(out), "--peak-tflops", "100", "--peak-tbps", "1"]) == 0
    text = out.read_text()
    assert "also timed with L2 emptied by a read" in text.splitlines()[0]
    table = text.split("### metadata operators")[1].strip().splitlines()
    assert ("| ref / ours | floor µs | floor / ours | graph µs, clean L2 | ref graph µs, clean L2 "
            "| ref / ours, clean L2 | floor µs, clean L2 | floor / ours, clean L2 |") in table[0]
    assert "| 10.0 | 25.0 | 10.0 | 1.00x | 10.0 | 100% | 8.0 | 8.0 | 1.00x | 8.0 | 100% |" in table[2], table[2]


@pytest.mark.parametrize("read, written", [(100_000, 0), (3 * 16384 + 8, 40_000), (20_000, 150_000), (4, 0)])
def test_floor_kernel_reads_and_writes_the_bytes_it_counts(read, written):
    """The floor kernel (``bench/floor.py``, interpreted on a CPU) reads every int32 of its source once
    and writes at least the bytes asked: program ``p``'s outputs are the sum of its 16 KB of the source
    plus their positions. (On a GPU the benchmark runs it; here its arithmetic is checked.)"""
    if torch.cuda.is_available():
        pytest.skip("checked under the Triton interpreter on CPU; the benchmark runs it on the GPU")
    if not HAS_TRITON:
        pytest.skip("needs Triton (pip install triton; Linux): the floor is a Triton kernel")
    from torch_sparse_mla.bench import floor

    programs, write, n_read, n_write = floor.plan(read, written)
    assert n_read * 4 >= read and n_write * 4 >= written and n_write >= programs
    assert programs * floor.READ >= n_read and programs * write >= n_write
    run, src, dst = floor.stream_floor(read, written, device="cpu")
    assert src.numel() == n_read and dst.numel() == n_write
    dst.fill_(-1)
    run()
    padded = torch.zeros(programs * floor.READ, dtype=torch.int64)
    padded[:n_read] = src.long()
    sums = padded.view(programs, floor.READ).sum(1)
    pos = torch.arange(programs * write).view(programs, write)
    want = (sums[:, None] + pos).flatten()[:n_write].to(torch.int32)  # below 2**31: values under 2**16
    assert torch.equal(dst, want)
