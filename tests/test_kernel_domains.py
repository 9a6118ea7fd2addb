"""Property tests of the attention kernels over the whole domain each serves.

The parity tests of ``test_sparse_mla.py`` and ``test_sparse_gqa.py`` run each kernel on a fixed list
of shapes. Here hypothesis draws every input a kernel serves and its launch plan may vary: head counts
on both sides of each head-block size, list widths on both sides of a block of 64 keys and of the
per-split page table, page sizes smaller than a block and with a partial last block, padded page
strides, both value-cache layouts, device scales, the extra cache, lengths, sinks, invalid indices,
empty rows, split counts and the head-block forms. Inputs come from the same factories as the parity
tests (every cache element no valid entry may read is poisoned) and each example is checked against
the same float64 references.

- The two Hopper kernels (an sm_90 GPU only): every input their ``supported`` accepts (a CPU test
  checks that every draw is one).
- The portable kernels under the Triton interpreter (CPU machines) and, forced with
  ``path="portable"``, on any GPU: the same draws widened to what only they serve.

Example counts follow the profiles of ``common.examples`` (``gpu``, the default on a GPU: 30 examples
per Hopper test, random; ``thorough``: 300). With ``-s`` each example prints one line, which counts the
examples a time-limited run got through.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from common import HAS_CUDA, INTERPRETER, examples, requires_hopper, requires_interpreter, run_offline_compile
from test_sparse_gqa import FP8, NVFP4, Cfg, _out_buffer, assert_matches_reference
from test_sparse_gqa import make_inputs as gqa_inputs
from test_sparse_mla import _HEAD_FORMS, Spec, _outputs_like, _positional, _to_device, assert_matches
from test_sparse_mla import expected as mla_expected
from test_sparse_mla import make_inputs as mla_inputs
from test_sparse_mla import reference as mla_reference
from torch_sparse_mla.ops import sparse_gqa as gqa_ops
from torch_sparse_mla.ops import sparse_mla as mla_ops

BF16, F16 = torch.bfloat16, torch.float16

# Bounds on the size of one example (the float64 references loop in Python, and the NVFP4 factory
# poisons unread keys one at a time).
_GQA_MAX_KEYS = 60_000  # cache keys: pages x KV heads x page size
_GQA_MAX_SELECTED = 12_000  # keys of one (row, KV head)'s selected pages


def _within(batch: int, n_sel: int, hkv: int, page_size: int, max_keys: int) -> tuple[int, int]:
    """``(batch, n_sel)`` cut down (fewer requests first) until the factory's cache (``make_inputs``:
    ``batch * (n_sel + 3) + 3`` pages) holds at most ``max_keys`` keys."""
    def keys():
        return (batch * (n_sel + 3) + 3) * hkv * page_size

    while keys() > max_keys and batch > 1:
        batch -= 1
    while keys() > max_keys and n_sel:
        n_sel //= 2
    return batch, n_sel


@st.composite
def gqa_cases(draw):
    """``(cfg, seed, num_splits, transposed_out)`` of a call the Hopper sparse-GQA kernel serves."""
    nvfp4 = draw(st.booleans())
    # NVFP4 pages hold a multiple of 4 keys (V scales in token quads); float8 pages any number
    page_size = draw(st.sampled_from([4, 16, 64, 100, 128, 200] if nvfp4 else [1, 13, 16, 64, 96, 128, 200]))
    group = draw(st.sampled_from([1, 2, 5, 8, 16, 17, 24, 33, 48]))
    hkv = draw(st.integers(1, max(1, min(4, 128 // group))))
    batch = draw(st.sampled_from([1, 2, 3, 4, 0]))
    # the edges: no page, one block, the 64 pages a CTA's page table holds (more take two splits)
    n_sel = min(draw(st.sampled_from([0, 1, 2, 3, 5, 16, 33, 63, 64, 65, 72])), _GQA_MAX_SELECTED // page_size)

    batch, n_sel = _within(batch, n_sel, hkv, page_size, _GQA_MAX_KEYS)
    cfg = Cfg(hq=hkv * group, hkv=hkv, dh=128, page_size=page_size, dql=draw(st.integers(1, 4)),
              q_dtype=draw(st.sampled_from([BF16, F16])), kv_dtype=NVFP4 if nvfp4 else FP8,
              layout="HND" if nvfp4 else draw(st.sampled_from(["HND", "NHD"])),
              # the Hopper kernel needs page strides in multiples of 16 bytes and a 16-byte aligned base
              page_pad=draw(st.sampled_from([0, 16, 48])), batch=batch, n_sel=n_sel,
              extra_rows=draw(st.integers(0, 2)), scale_tensors=draw(st.booleans()),
              offset=16 if nvfp4 else draw(st.sampled_from([0, 16])))
    return cfg, draw(st.integers(0, 2**16)), draw(st.sampled_from([None, 1, 2, 3, 40])), draw(st.booleans())


@requires_hopper
@examples(3)
@given(case=gqa_cases())
def test_sparse_gqa_hopper_domain(case):
    cfg, seed, num_splits, transposed = case
    print(f"gqa example: {cfg.id} n_sel={cfg.n_sel} batch={cfg.batch} seed={seed} splits={num_splits}")
    args, _ = gqa_inputs(cfg, seed=seed, device="cuda")
    assert gqa_ops.kernel_path(args["q"], args["kv_cache"]) == "hopper", cfg.id
    out = _out_buffer(args, transpose=transposed)
    gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, num_splits=num_splits, path="hopper")
    assert_matches_reference(out, args)


@st.composite
def mla_cases(draw):
    """``(spec, seed, num_splits, form)`` of a call the Hopper sparse-MLA kernel serves."""
    kv_format = draw(st.sampled_from(["fp8_656", "fp8_584", "auto"]))
    k2 = draw(st.sampled_from([0, 0, 1, 40, 130]))
    spec = Spec(
        kv_format=kv_format, T=draw(st.sampled_from([1, 2, 3, 5, 0])),
        H=draw(st.sampled_from([1, 3, 16, 17, 20, 32, 33, 48, 64, 100, 128])),
        K=draw(st.sampled_from([1, 2, 7, 64, 65, 200, 600])), K2=k2,
        dim=draw(st.sampled_from([576, 512])) if kv_format == "auto" else None,
        lengths=draw(st.booleans()), sink=draw(st.sampled_from([None, "finite", "inf"])),
        bad_indices=draw(st.booleans()), empty_row=draw(st.booleans()), noncontig_q=draw(st.booleans()),
        scale=draw(st.sampled_from([0.06, 0.3, -0.2, 0.0])),
        # the extra cache's pages hold half as many slots: an fp8_584 page of an odd number of 584-byte
        # slots is not 16-byte aligned, which the Hopper kernel needs
        page_size=draw(st.sampled_from([4, 16, 64, 100])),
        page_pad=draw(st.sampled_from([0, 16, 64])), extra_page_pad=draw(st.sampled_from([0, 16, 48])),
        pool=draw(st.sampled_from([96, 400])))
    form = draw(st.sampled_from([None, "few16", "few32", "rows64"]))
    return spec, draw(st.integers(0, 2**16)), draw(st.sampled_from([None, 1, 2, 3, 8])), form


@requires_hopper
@examples(3)
@given(case=mla_cases())
def test_sparse_mla_hopper_domain(case):
    spec, seed, num_splits, form = case
    print(f"mla example: {spec} page_size={spec.page_size} pool={spec.pool} seed={seed} splits={num_splits} "
          f"form={form}")
    kwargs = mla_inputs(spec, seed=seed)
    dev = _to_device(kwargs, "cuda")
    assert mla_ops.kernel_path(dev["q"], dev["kv_cache"], spec.kv_format, spec.head_dim_v,
                               dev.get("extra_kv_cache")) == "hopper", str(spec)
    out, lse = _outputs_like(kwargs, "cuda")
    mla_ops.sparse_mla_decode_triton(*_positional(dev), out=out, lse=lse, num_splits=num_splits, path="hopper",
                                     config=None if form is None else _HEAD_FORMS[form])
    assert_matches(out, lse, *mla_reference(**kwargs), tensor_cores=True)


# -- the portable kernels, under the Triton interpreter and on a GPU ---------------------------------------
# The same draws widened to what only the portable kernels serve (every value-cache dtype, head dims of
# 64, pages of any size and any padding, misaligned views, generic head_dim_v and small auto dims). The
# interpreter takes float16 queries only (its bfloat16 products are wrong) and up to about 15 s per
# example, so the ci profile runs two of each; gpu and thorough run 20 and 200. On a GPU the calls ask for
# the portable kernel (``path="portable"``), which serves every GPU but sm_90.

PORTABLE_BACKENDS = pytest.mark.parametrize("backend", (["interpreter"] if INTERPRETER else []) + (
    [pytest.param("cuda", marks=pytest.mark.cuda)] if HAS_CUDA else [])
    or [pytest.param("interpreter", marks=requires_interpreter)])  # neither: skipped with the reason


def _on(backend: str) -> tuple[list[torch.dtype], str]:
    """The query dtypes a backend's examples draw from, and the device of their tensors."""
    return ([F16], "cpu") if backend == "interpreter" else ([BF16, F16], "cuda")


@st.composite
def gqa_portable_cases(draw, q_dtypes):
    """``(cfg, seed, num_splits)`` of a portable sparse-GQA call."""
    kv_dtype = draw(st.sampled_from([F16, BF16, FP8, NVFP4]))
    nvfp4 = kv_dtype == NVFP4
    page_size = draw(st.sampled_from([4, 16, 64, 100, 128, 200] if nvfp4 else [1, 13, 16, 64, 96, 128, 200]))
    group = draw(st.sampled_from([1, 2, 5, 8, 16, 17, 24, 33, 48]))
    hkv = draw(st.integers(1, max(1, min(2, 64 // group))))
    batch = draw(st.sampled_from([1, 2, 0]))
    n_sel = min(draw(st.sampled_from([0, 1, 3, 16, 63, 64, 65, 72])), 8000 // page_size)
    batch, n_sel = _within(batch, n_sel, hkv, page_size, 30_000)
    cfg = Cfg(hq=hkv * group, hkv=hkv, dh=128 if nvfp4 else draw(st.sampled_from([64, 128])), page_size=page_size,
              dql=draw(st.integers(1, 3)), q_dtype=draw(st.sampled_from(q_dtypes)), kv_dtype=kv_dtype,
              layout="HND" if nvfp4 else draw(st.sampled_from(["HND", "NHD"])),
              page_pad=draw(st.sampled_from([0, 5, 16])), batch=batch, n_sel=n_sel,
              extra_rows=draw(st.integers(0, 1)), scale_tensors=draw(st.booleans()))
    return cfg, draw(st.integers(0, 2**16)), draw(st.sampled_from([None, 1, 2, 3, 40]))


@PORTABLE_BACKENDS
@examples(2)
@given(data=st.data())
def test_sparse_gqa_portable_domain(backend, data):
    q_dtypes, device = _on(backend)
    cfg, seed, num_splits = data.draw(gqa_portable_cases(q_dtypes))
    print(f"gqa portable example: {cfg.id} n_sel={cfg.n_sel} batch={cfg.batch} seed={seed} splits={num_splits}")
    args, _ = gqa_inputs(cfg, seed=seed, device=device)
    out = _out_buffer(args)
    gqa_ops.sparse_gqa_decode_triton(*args.values(), out=out, num_splits=num_splits, path="portable")
    assert_matches_reference(out, args)


@st.composite
def mla_portable_cases(draw, dtypes):
    """``(spec, seed, num_splits)`` of a portable sparse-MLA call."""
    kv_format = draw(st.sampled_from(["fp8_656", "fp8_584", "auto"]))
    dim = draw(st.sampled_from([576, 512, 80, 32])) if kv_format == "auto" else None
    full = {"fp8_656": 576, "fp8_584": 512}.get(kv_format, dim)
    k2 = draw(st.sampled_from([0, 0, 1, 40]))
    spec = Spec(
        kv_format=kv_format, T=draw(st.sampled_from([1, 2, 3, 0])), H=draw(st.sampled_from([1, 3, 16, 17, 33, 64])),
        K=draw(st.sampled_from([1, 2, 7, 64, 65, 130])), K2=k2, dim=dim,
        head_dim_v=draw(st.sampled_from([min(512, full), full, 16])), dtype=draw(st.sampled_from(dtypes)),
        lengths=draw(st.booleans()), sink=draw(st.sampled_from([None, "finite", "inf"])),
        bad_indices=draw(st.booleans()), empty_row=draw(st.booleans()), noncontig_q=draw(st.booleans()),
        scale=draw(st.sampled_from([0.06, 0.3, -0.2, 0.0])),
        page_size=draw(st.sampled_from([2, 4, 16, 64, 100] if k2 else [1, 4, 16, 64, 100])),  # the extra cache: half
        page_pad=draw(st.sampled_from([0, 3, 16])), extra_page_pad=draw(st.sampled_from([None, 0, 16])))
    return spec, draw(st.integers(0, 2**16)), draw(st.sampled_from([None, 1, 2, 3]))


@PORTABLE_BACKENDS
@examples(2)
@given(data=st.data())
def test_sparse_mla_portable_domain(backend, data):
    q_dtypes, device = _on(backend)
    spec, seed, num_splits = data.draw(mla_portable_cases(q_dtypes))
    print(f"mla portable example: {spec} page_size={spec.page_size} seed={seed} splits={num_splits}")
    kwargs = mla_inputs(spec, seed=seed)
    out, lse = _outputs_like(kwargs, device)
    mla_ops.sparse_mla_decode_triton(*_positional(_to_device(kwargs, device)), out=out, lse=lse,
                                     num_splits=num_splits, path="portable")
    assert_matches(out, lse, *mla_expected(spec, kwargs), tensor_cores=True)


def test_cases_stay_within_the_hopper_domain():
    """Without a GPU: every drawn case has an input layout the Hopper kernels accept
    (``layout_supported``, the part of each ``supported`` that needs no GPU: dtypes, dims, the caches'
    16-byte strides and base), within the size bounds above."""
    from torch_sparse_mla.ops import sparse_gqa_hopper, sparse_mla_hopper

    @examples(20)
    @given(case=gqa_cases())
    def check_gqa(case):
        cfg = case[0]
        args, _ = gqa_inputs(cfg, seed=case[1])
        assert sparse_gqa_hopper.layout_supported(args["q"], args["kv_cache"]), cfg.id
        assert args["kv_cache"].shape[0] * cfg.hkv * cfg.page_size <= _GQA_MAX_KEYS

    @examples(20)
    @given(case=mla_cases())
    def check_mla(case):
        spec = case[0]
        kwargs = mla_inputs(spec, seed=case[1])
        assert sparse_mla_hopper.layout_supported(kwargs["q"], kwargs["kv_cache"], spec.kv_format, spec.head_dim_v,
                                                  kwargs.get("extra_kv_cache")), str(spec)

    check_gqa()
    check_mla()


def test_layout_supported_refuses_what_the_hopper_kernels_cannot_serve():
    """The layout checks can fail: each condition, broken on its own, is refused."""
    from torch_sparse_mla.ops import sparse_gqa_hopper, sparse_mla_hopper

    def shifted(shape, dtype, by):  # a contiguous tensor whose base is `by` elements past an allocation's
        return torch.zeros(math.prod(shape) + by, dtype=dtype)[by:].view(shape)

    def strided(shape, strides, dtype):
        return torch.zeros(shape[0] * strides[0], dtype=dtype).as_strided(shape, strides)

    gqa = sparse_gqa_hopper.layout_supported
    q = torch.zeros(2, 16, 128, dtype=BF16)
    fp8 = torch.zeros(4, 2, 64, 256, dtype=torch.float8_e4m3fn)
    nv = torch.zeros(4, 4, 64, 72, dtype=torch.uint8)
    assert gqa(q, fp8) and gqa(q.half(), fp8) and gqa(q, nv)
    assert not gqa(q.float(), fp8)  # query dtype
    assert not gqa(torch.zeros(2, 16, 64, dtype=BF16), fp8)  # head dim
    assert not gqa(q, fp8.to(BF16))  # a bf16 value cache
    assert not gqa(q, torch.zeros(4, 2, 64, 264, dtype=torch.float8_e4m3fn)[..., :256])  # row stride
    assert not gqa(q, shifted((4, 2, 64, 256), torch.float8_e4m3fn, 8))  # base
    assert not gqa(q, torch.zeros(4, 4, 62, 72, dtype=torch.uint8))  # page size not a multiple of 4
    assert not gqa(q, torch.zeros(4, 4, 64, 80, dtype=torch.uint8)[..., :72])  # not the format's slots
    assert not gqa(q, strided((4, 4, 64, 72), (4 * 64 * 72 + 8, 64 * 72, 72, 1), torch.uint8))  # page stride
    assert not gqa(q, shifted((4, 4, 64, 72), torch.uint8, 4))  # base

    mla = sparse_mla_hopper.layout_supported
    q = torch.zeros(2, 64, 576, dtype=BF16)
    cache = torch.zeros(8, 64, 656, dtype=torch.uint8)
    bf16 = torch.zeros(8, 64, 576, dtype=BF16)
    assert mla(q, cache, "fp8_656", 512, None) and mla(q, bf16, "auto", 512, None)
    assert mla(q, cache, "fp8_656", 512, cache)
    assert not mla(q.half(), cache, "fp8_656", 512, None)  # query dtype
    assert not mla(q, cache, "fp8_656", 448, None)  # value dim
    assert not mla(q[..., :500], bf16[..., :500], "auto", 512, None)  # neither D
    assert not mla(q, shifted((8, 64, 656), torch.uint8, 1), "fp8_656", 512, None)  # base
    assert not mla(q, strided((8, 64, 576), (64 * 576 + 4, 576, 1), BF16), "auto", 512, None)  # page stride
    assert not mla(q, torch.zeros(8, 64, 580, dtype=BF16)[..., :576], "auto", 512, None)  # row stride
    assert not mla(q, cache, "fp8_656", 512, shifted((8, 64, 656), torch.uint8, 2))  # the extra cache's base


@requires_interpreter
@pytest.mark.parametrize("op", ["sparse_mla_decode", "sparse_gqa_decode"])
def test_triton_interpreter_warns_without_hopper_kernels(monkeypatch, op):
    """Where this Triton gives no Hopper kernels each attention launcher asks ``warn_portable_on_sm90``
    (which warns on an sm_90 GPU only: ``test_library.py::test_portable_kernel_warning_on_sm90``) once
    per plan, with the Hopper kernel's layout verdict; with ``path="portable"`` or the Hopper kernels
    present it does not ask."""
    ops = mla_ops if op == "sparse_mla_decode" else gqa_ops
    calls = []
    monkeypatch.setattr(ops.hopper, "warn_portable_on_sm90", lambda *a: calls.append(a))
    monkeypatch.setattr(ops, "_PLANS", ops.PlanCache())
    if op == "sparse_mla_decode":
        kwargs = mla_inputs(Spec(kv_format="fp8_656", T=1, H=16, K=64, dtype=F16), seed=0)
        q, layout = kwargs["q"], ops.hopper.layout_supported(kwargs["q"], kwargs["kv_cache"], "fp8_656", 512, None)

        def call(path):
            out, lse = _outputs_like(kwargs)
            ops.sparse_mla_decode_triton(*_positional(kwargs), out=out, lse=lse, num_splits=1, path=path)
    else:
        args, _ = gqa_inputs(Cfg(hq=8, hkv=1, dh=64, page_size=16, dql=4, batch=2, n_sel=6), seed=3)
        q, layout = args["q"], ops.hopper.layout_supported(args["q"], args["kv_cache"])

        def call(path):
            ops.sparse_gqa_decode_triton(*args.values(), out=_out_buffer(args), num_splits=1, path=path)
    for has_gluon, path in ((False, "portable"), (False, None), (False, None), (True, None)):
        monkeypatch.setattr(ops.hopper, "HAS_GLUON", has_gluon)
        if has_gluon:  # a plan made afresh (the plans' key holds the path, not this)
            monkeypatch.setattr(ops, "_PLANS", ops.PlanCache())
        call(path)
    assert calls == [(op, q.device, layout)]


@pytest.mark.parametrize("arch, target, backend", [("80", "sm_80", "nvidia"), ("gfx942", "gfx942", "amd")],
                         ids=["sm80", "gfx942"])
def test_portable_kernels_compile_for_other_gpus(arch, target, backend):
    """Without a GPU: every portable kernel that reads or writes float8 (the cache writers and gathers,
    the sparse-GQA decode over float8 and NVFP4 caches and float8 queries, the sparse-MLA decode over
    both float8 formats) compiles, as the launchers plan it there (``scripts/compile_sm90.py --arch``):
    - for sm_80 (an A100) through ``ptxas``: Triton has no float8 type and no float8 conversion
      instruction exists there; before the integer routes they failed to compile;
    - for gfx942 (an MI300 on a ROCm build of PyTorch) with Triton's AMD backend: float8 tensors as
      bytes, no inline PTX, and the plans' shared memory within the 64 KB of LDS a workgroup may use.
      The launchers' choices on such a build (no sm_90 kernels, no float8 types, Triton's own launch)
      are ``test_library.py::test_capability_choices_on_rocm``."""
    pytest.importorskip(f"triton.backends.{backend}.compiler")
    result = run_offline_compile("compile_sm90.py", "--arch", arch, "--cases", "kv_cache", "sparse_gqa",
                                 "sparse_mla_fp8")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    compiled = re.search(rf"^(\d+) launches compiled for {target} ", result.stdout, re.M)
    assert compiled and int(compiled.group(1)) >= 30, result.stdout[-2000:]
    assert "limit" not in result.stdout, result.stdout[-4000:]
    kernels = set(re.findall(r"^\w+\s+(_\w+_kernel)\s", result.stdout, re.M))
    assert {"_kv_cache_insert_kernel", "_kv_cache_gather_kernel", "_sparse_gqa_decode_kernel",
            "_gqa_kv_cache_insert_kernel", "_sparse_mla_decode_kernel"} <= kernels, kernels


def test_portable_sparse_mla_model_shapes_fit_an_a100():
    """Without a GPU: the portable sparse-MLA decode at the DeepSeek model shapes (both float8 formats, 64
    and 128 heads, a batch that fills the GPU), planned and built for an A100 (sm_80, 166,912 bytes of
    shared memory per block), asks for no more than that. The planner's estimate describes the sm_90
    build: for the DeepSeek-V4 format the sm_80 build of its 64 x 64 tiles needs 180,736 bytes (180,224
    with one stage), so until the launcher fitted the tiles to the compiled kernel those calls failed
    on an A100 with Triton's out-of-resources error. And no build that spills has fewer than 255
    registers: without the launcher's register bound (``_DECODE_MAXNREG``) ptxas built the DeepSeek-V4
    tiles with 128 registers and 2,756 bytes of spill stores (1,244 with it), its allocation aimed at two
    programs per SM where the shared memory holds one."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_offline_compile("compile_sm90.py", "--arch", "80", "--cases", "sparse_mla_model")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = re.findall(r"^sparse_mla_model\s+_sparse_mla_decode_kernel\s+(\d+)\s+(\d+)\s+(\d+)(.*)$", result.stdout, re.M)
    assert len(rows) == 6, result.stdout[-2000:]
    assert all(int(shared) <= 166_912 and not rest.strip() for _, _, shared, rest in rows), result.stdout[-2000:]
    assert all(int(spill) == 0 or int(regs) == 255 for regs, spill, _, _ in rows), result.stdout[-2000:]


def test_portable_sparse_mla_model_shapes_fit_sm100_tensor_memory():
    """Without a GPU: the portable sparse-MLA decode at the DeepSeek model shapes, planned and built for
    sm_100 (a B200), needs no more than the 512 columns of tensor memory a program may use there. At 64
    heads per program the DeepSeek-V4 format's accumulators need 544, and Triton (3.6 to 3.9) builds
    such a kernel as a single ``trap`` instruction without an error: until the planner fitted its tiles
    to the build's tensor memory, those calls would have ended the process's CUDA context on a B200."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_offline_compile("compile_sm90.py", "--arch", "100", "--cases", "sparse_mla_model")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = re.findall(r"^sparse_mla_model\s+_sparse_mla_decode_kernel\s+(-?\d+)\s+(-?\d+)\s+(\d+)(.*)$", result.stdout,
                      re.M)
    assert len(rows) == 6, result.stdout[-2000:]
    assert all("tensor memory" not in rest and "sm_100 limit" not in rest for *_, rest in rows), result.stdout[-2000:]


@pytest.mark.parametrize("arch", ["80", "86"])
def test_portable_sparse_gqa_model_shapes_do_not_spill_before_sm89(arch):
    """Without a GPU: the portable sparse-GQA decode at the benchmark's MiniMax-M3 shapes (float8 and
    NVFP4 caches, ``scripts/compile_sm90.py --cases sparse_gqa_model``) builds for an A100 (sm_80) and
    an sm_86 GPU without spilling. Until the NVFP4 values were placed as float16 bits on every NVIDIA GPU
    (``sparse_gqa.md``, "NVFP4 before sm_89"), the NVFP4 kernel decoded them in float32 there, took
    255 registers and spilled (8 bytes on sm_80, 40 on sm_86)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_offline_compile("compile_sm90.py", "--arch", arch, "--cases", "sparse_gqa_model")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = re.findall(r"^sparse_gqa_model\s+_sparse_gqa_decode_kernel\s+(\d+)\s+(\d+)\s+(\d+)", result.stdout, re.M)
    assert len(rows) == 2, result.stdout[-2000:]
    assert all(int(spill) == 0 for _, spill, _ in rows), result.stdout[-2000:]
