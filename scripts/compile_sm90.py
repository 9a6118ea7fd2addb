"""Compile the library's Triton kernels for sm_90 (or another GPU) without a GPU, check their address
arithmetic and report their resources.

    python scripts/compile_sm90.py [--ttir-only] [--check-offsets] [--check-load-chains] [--check-stores-last]
                                   [--cases NAME ...] [--list] [--arch 90 | --arch gfx942]

The launchers (``ops/*_triton``) run on small CPU tensors with a stand-in Triton driver whose target is
sm_90: every ``KernelLaunch`` compiles its kernel exactly as the JIT would on an H100/H200 (same
signature, same integer and alignment specialisation, and the flags a launcher sets from the tensors'
device, ``_GPU_ONLY_FLAGS``, as for CUDA tensors) and launches nothing. Per kernel it prints the
registers and spills (``ptxas -v``) and the shared memory the launch asks for (against the 232,448
bytes an sm_90 block may use).

``--arch N`` compiles for sm_N instead (75, 80 for an A100, 86, 87, 89, 100, 103, 120, 121): the portable
kernels a GPU other than sm_90 runs, with the float8 choice the launchers make for it
(``float8_conversions``: before sm_89 float8 tensors reach the kernels as bytes and convert by integer
operations) and the sparse-MLA tiles planned for the shared memory a block may use there
(``NVIDIA_SHARED_BYTES``: 166,912 bytes on an A100, 101,376 on sm_86); a launch that asks for more is
marked ``> sm_N limit``, and on sm_100 and sm_103 a build whose accumulators need more tensor memory
than the 512 columns there, which Triton builds as a kernel that only traps, ``columns > tensor memory
limit (a trap)`` (the planner fits its tiles to both; tiles an explicit ``config`` sets are refused
there by the launcher with a ValueError, listed as ``refused by the launcher``). On every NVIDIA target
a build that spills with fewer than 255 registers and no ``maxnreg`` of its own is marked ``spills under
ptxas's 255-register limit``: ptxas, which does not see the dynamic shared memory, aimed it at more
programs per SM than fit (the sparse-MLA decode's register bound, ``docs/sparse_mla.md``, "Registers").
``--arch gfxNNN``
compiles them with Triton's AMD backend for that GPU of a ROCm build of PyTorch (gfx90a for an MI200,
gfx942 for an MI300, gfx950 for an MI350, gfx1100 and gfx1201 for Radeon GPUs), as the launchers plan
them there (float8 tensors as bytes, every float8 conversion by integer operations; the inline PTX is
compiled only for NVIDIA targets; the sparse-MLA tiles planned for the GPU's LDS); the report then
gives vector registers, spilled registers and the local data share (LDS) against the GPU's 64 KB (160
KB on gfx950). Exit status 1 when a kernel does not compile.

``--check-load-chains`` checks that in the cache writers (``LOADS_FIRST``) no load waits for another:
no ``tt.load``'s pointer, mask or default derives from a value loaded from memory, so every load is
issued at the program's start (a mask on the slot's validity would make the rows' loads wait for the
slot's). Exit status 1 when one does.

``--check-stores-last`` checks that in the kernels of ``STORES_LAST`` (the metadata kernels and the
cache writers) no ``tt.load`` follows a ``tt.store`` in the TTIR: a load placed after a store to a
tensor that may alias it waits for that store, one more memory round trip per program (until
2026-12-04 two metadata kernels loaded ``slot_mapping`` after storing their index rows). Loads inside
loops are not checked. Exit status 1 when one does.

``--check-offsets`` checks the offset rule of ``ops/_launch.py`` on the optimised TTIR: no 32-bit
integer multiplication may reach an address (``tt.addptr``) when one of its operands derives from a
kernel argument or from a value loaded from memory (a stride, a size, an index). Products of
compile-time constants, program ids and loop counters may stay 32-bit: they are bounded by a tensor
dimension. (A division or remainder inherits the taint of its dividend only: ``pid % n`` is bounded
by ``pid``.) Exit status 1 when a kernel breaks the rule. ``--ttir-only`` stops each compile after the
TTIR (a few seconds for everything; what the test suite runs).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not for the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

SM90_MAX_SHARED = 232_448  # bytes of shared memory an sm_90 thread block may use (opt-in)
# The opt-in shared memory per thread block of NVIDIA GPUs by compute capability (CUDA's tables: 64 KB
# on sm_75, 163 KB on sm_80 and sm_87, 99 KB on sm_86, sm_89 and sm_12x, 227 KB on sm_90 and sm_10x):
# what ``torch.cuda.get_device_properties(...).shared_memory_per_block_optin`` reports there, and so
# what the sparse-MLA planner fits its tiles to on such a GPU.
NVIDIA_SHARED_BYTES = {75: 65_536, 80: 166_912, 86: 101_376, 87: 166_912, 89: 101_376, 90: SM90_MAX_SHARED,
                       100: SM90_MAX_SHARED, 103: SM90_MAX_SHARED, 120: 101_376, 121: 101_376}


class _OfflineDriver:
    """What the Triton JIT asks of the driver before it compiles; nothing here touches a GPU."""

    arch: int | str = 90  # the compute capability compiled for, or an AMD GPU's gfx name (``--arch``)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        if isinstance(self.arch, str):
            return GPUTarget("hip", self.arch, 32 if self.arch.startswith("gfx1") else 64)
        return GPUTarget("cuda", self.arch, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


driver.set_active(_OfflineDriver())

import torch_sparse_mla  # noqa: E402,F401
from torch_sparse_mla.ops import _launch  # noqa: E402
from torch_sparse_mla.ops import kv_cache as kv_ops  # noqa: E402
from torch_sparse_mla.ops import metadata as md_ops  # noqa: E402
from torch_sparse_mla.ops import sparse_gqa as gqa_ops  # noqa: E402
from torch_sparse_mla.ops import sparse_mla as mla_ops  # noqa: E402


class _StopAfterTTIR(Exception):
    def __init__(self, ttir: str):
        self.ttir = ttir


def _ttir_only(enabled: bool) -> None:
    if not enabled:
        return
    from triton.backends.nvidia.compiler import CUDABackend

    backends = [CUDABackend]
    try:  # a Triton built without its AMD backend compiles for NVIDIA targets only
        from triton.backends.amd.compiler import HIPBackend

        backends.append(HIPBackend)
    except ImportError:
        pass
    for backend in backends:
        def add_stages(self, stages, options, *rest, _original=backend.add_stages):
            _original(self, stages, options, *rest)
            make_ttir = stages["ttir"]

            def ttir_then_stop(src, metadata):
                raise _StopAfterTTIR(str(make_ttir(src, metadata)))

            stages["ttir"] = ttir_then_stop

        backend.add_stages = add_stages


COMPILED: list[tuple[str, str, object]] = []  # (case, kernel name, CompiledKernel or TTIR text)
_CASE = ["?"]


_GPU_ONLY_FLAGS = ("USE_ASM", "HW_CVT")  # meta a launcher sets from the tensors' device: True on a GPU


FAILED: list[tuple[str, str, str]] = []  # (case, kernel name, error)
REFUSED: list[tuple[str, str]] = []  # (case, the call and the launcher's ValueError): not compiled
SHARED_LIMIT = [SM90_MAX_SHARED]  # the target's shared memory per block (main sets it from --arch)
RETRIED: set[int] = set()  # ids of the compiles that stand for a launch retried with one stage


def _gpu_meta(self) -> dict:
    return {k: (True if k in _GPU_ONLY_FLAGS else v) for k, v in self.meta.items()}  # as for CUDA tensors


def _compile(self, args):
    return self.kernel.warmup(*args, grid=self.grid, **_gpu_meta(self), **self.options)


def _record(self, args):
    name = self.kernel.fn.__name__
    try:
        compiled = _compile(self, args)
        if compiled.metadata.shared > SHARED_LIMIT[0] and self.options.get("num_stages", 1) > 1:
            # the GPU would refuse this launch and KernelLaunch._jit_launch_here would retry it without
            # software pipelining (and keep that for later calls): that build is the one the GPU runs
            self.options["num_stages"] = 1
            compiled = _compile(self, args)
            RETRIED.add(id(compiled))
        COMPILED.append((_CASE[0], name, compiled))
    except _StopAfterTTIR as stop:
        COMPILED.append((_CASE[0], name, stop.ttir))
    except Exception as exc:  # noqa: BLE001 - reported with the others, exit status 1
        lines = [line for line in str(exc.__cause__ or exc).splitlines() if line.strip()]
        FAILED.append((_CASE[0], name, f"{type(exc).__name__}: {lines[-1][:300] if lines else ''}"))
    return None


_launch.KernelLaunch._jit_launch_here = _record
# the sparse-MLA planner fits its tiles to the build for the target, as on that GPU (builds not recorded;
# main turns the fit on unless compiles stop at the TTIR)
_launch.KernelLaunch._compile_here = _compile
# the launchers' float8 choice for the target, not for the CPU tensors the cases pass
_launch.float8_conversions = gqa_ops.float8_conversions = (
    lambda device: not isinstance(_OfflineDriver.arch, str) and _OfflineDriver.arch >= 89)
# and their NVIDIA-only compile options (the sparse-MLA decode's register bound) for the target's capability
mla_ops.nvidia_capability = (
    lambda device: None if isinstance(_OfflineDriver.arch, str) else divmod(_OfflineDriver.arch, 10))


# =====================================================================================================
# Cases: the launchers on CPU tensors (values do not matter, shapes and strides do)
# =====================================================================================================

I32, I64 = torch.int32, torch.int64
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _strided(shape, dtype, pad=3):
    """A view whose last-but-one stride is not the dense one (so strides reach the kernel as i32)."""
    full = torch.zeros(*shape[:-1], shape[-1] + pad, dtype=dtype)
    return full[..., : shape[-1]]


def case_metadata():
    r, m, t, k = 3, 5, 7, 9
    qsl = torch.tensor([0, 2, 5, 7], dtype=I32)
    seq_lens, bt = torch.tensor([4, 9, 2], dtype=I32), _strided((r, m), I32)
    # r = 3 requests: a binary search (between SEARCH_GATHER_MAX and SEARCH_TABLE_MIN)
    md_ops.compressed_slot_mapping_triton(qsl, seq_lens, bt, 4, 2, out=torch.empty(t, dtype=I64))
    # 2 requests: each token's start, end and length picked from registers (up to SEARCH_GATHER_MAX); 40:
    # all request starts in one tile (from SEARCH_TABLE_MIN); 3,000 (past SEARCH_TABLE_MAX): a binary search
    for many in (2, 40, 3000):
        md_ops.compressed_slot_mapping_triton(torch.arange(many + 1, dtype=I32), torch.full((many,), 9, dtype=I32),
                                              _strided((many, m), I32), 4, 2, out=torch.empty(many, dtype=I64))
    pos, ttr, sm = torch.zeros(t, dtype=I64), torch.zeros(t, dtype=I32), torch.zeros(t, dtype=I64)
    md_ops.c128a_topk_indices_triton(pos, ttr, bt, sm, 3, 4, 2, 9, decode_indices=_strided((3, 9), I32),
                                     decode_lens=torch.empty(3, dtype=I32), prefill_indices=_strided((4, 9), I32))
    md_ops.decode_runtime_metadata_triton(seq_lens, 2, kv_segment_lens=torch.empty(6, dtype=I32),
                                          qo_offset=torch.empty(6, dtype=I32))
    md_ops.swa_indices_triton(pos, ttr, bt, sm, 6, 4, indices=_strided((t, 6), I32), lens=torch.empty(t, dtype=I32))
    # 1100: one step of 2,048 columns at 16 warps (the call's programs fit one wave); 2100: the row in a loop
    # of 1,024-column steps
    for kk in (k, 1100, 2100):
        md_ops.compressed_topk_to_global_triton(_strided((t, kk), I32), ttr, bt, sm, 4, indices=_strided((t, kk), I32),
                                                lens=torch.empty(t, dtype=I32))


def _cache(kv_format, dtype=BF16, pages=3, page_size=4, dim=576, pad=5):
    width = {"auto": dim, "fp8_656": 656, "fp8_584": 584}[kv_format]
    dtype = dtype if kv_format == "auto" else torch.uint8
    flat = torch.zeros(pages, page_size * width + pad, dtype=dtype)
    return torch.as_strided(flat, (pages, page_size, width), (page_size * width + pad, width, 1))


def case_kv_cache():
    n = 5
    for kv_format, dim in (("auto", 576), ("fp8_656", 576), ("fp8_584", 512)):
        for kv_dtype in (BF16, F16, F32):
            kv = torch.zeros(dim, n, dtype=kv_dtype).t()  # permuted: stride(1) = n
            kv_ops.kv_cache_insert_triton(kv, torch.arange(n), _cache(kv_format), kv_format)
        for out_dtype in (BF16, F32):
            out = torch.empty(dim, n, dtype=out_dtype).t()
            kv_ops.kv_cache_gather_triton(_cache(kv_format), torch.arange(n, dtype=I32), kv_format, out_dtype, out=out)


def _mla(kv_format, t=2, h=16, k=40, k2=0, dim=576, dv=512, dtype=F16, num_splits=None, lengths=True, sink=True,
         config=None, contiguous=False):
    d = {"fp8_656": 576, "fp8_584": 512}.get(kv_format, dim)
    q = torch.zeros(t, h, d, dtype=dtype) if contiguous else torch.zeros(d, h, t, dtype=dtype).permute(2, 1, 0)
    cache = _cache(kv_format, dtype, dim=d)
    idx = torch.zeros(t, k, dtype=I32) if contiguous else _strided((t, k), I32)
    kw = dict(topk_length=torch.zeros(t, dtype=I32) if lengths else None,
              attn_sink=torch.zeros(h) if sink else None)
    if k2:
        kw.update(extra_kv_cache=_cache(kv_format, dtype, page_size=2, dim=d), extra_indices=_strided((t, k2), I32),
                  extra_topk_length=torch.zeros(t, dtype=I32) if lengths else None)
    out = torch.empty(t, h, dv, dtype=dtype) if contiguous else torch.empty(dv, h, t, dtype=dtype).permute(2, 1, 0)
    lse = torch.empty(t, h) if contiguous else torch.empty(h, t).t()
    try:
        mla_ops.sparse_mla_decode_triton(q, cache, idx, 0.1, kv_format, dv, kw["topk_length"], kw["attn_sink"],
                                         kw.get("extra_kv_cache"), kw.get("extra_indices"), kw.get("extra_topk_length"),
                                         out=out, lse=lse, num_splits=num_splits, config=config)
    except ValueError as exc:  # tiles the target cannot build (an explicit config), as the launcher says
        if not str(exc).startswith("config:"):
            raise
        REFUSED.append((_CASE[0], f"{kv_format}, H = {h}, T = {t}, config {config}: {exc}"))


def case_sparse_mla():
    for kv_format in ("fp8_656", "fp8_584", "auto"):
        for dtype in (BF16, F16):
            _mla(kv_format, dtype=dtype, k2=24, num_splits=2)  # split + combine, extra list
            _mla(kv_format, h=64, dtype=dtype, num_splits=1, lengths=False, sink=False, config=dict(block_n=64))
    _mla("auto", dim=96, dv=64, k2=5)
    _mla("fp8_656", dv=448)


def case_sparse_mla_fp8():
    """The float8 formats alone (what a GPU before sm_89 decodes by integer operations), one call each
    with a split and an extra list."""
    for kv_format in ("fp8_656", "fp8_584"):
        _mla(kv_format, dtype=BF16, k2=24, num_splits=2)


def case_sparse_mla_model():
    """The DeepSeek decode shapes with contiguous tensors, as the benchmark runs them: at 64 and 128 heads
    the planner's tiles for a batch that fills the GPU (64 x 64 where they fit the target's shared
    memory), at 16 heads 32-entry blocks."""
    for kv_format in ("fp8_656", "fp8_584"):
        for h, config in ((64, None), (128, None), (16, dict(block_n=32))):
            _mla(kv_format, t=132, h=h, k=2048, dtype=BF16, num_splits=1, lengths=False, sink=False,
                 config=config, contiguous=True)


def case_sparse_mla_large_dims():
    """Head dims past the model's, up to the CUDA limit (D <= 2048), with the planner's tiles."""
    for dim, dv in ((1024, 512), (1024, 1024), (2048, 512), (2048, 1025), (2048, 2048), (2048, 64), (1536, 1536)):
        for t, h in ((200, 64), (2, 128)):  # 64- and 32-entry blocks before the shared-memory fit
            try:
                _mla("auto", t=t, h=h, k=256, dim=dim, dv=dv, dtype=BF16, lengths=False, sink=False,
                     contiguous=True)
            except ValueError as exc:  # the launcher refuses what the target's shared memory cannot hold
                REFUSED.append((_CASE[0], f"D = {dim}, head_dim_v = {dv}, H = {h}, T = {t}: {exc}"))


def case_sparse_gqa():
    t, hq, hkv, dh, ps = 3, 8, 2, 128, 16
    fp8 = torch.float8_e4m3fn
    for q_dtype, kv_dtype in ((BF16, BF16), (F16, fp8), (fp8, fp8), (BF16, torch.uint8), (fp8, torch.uint8)):
        q = torch.zeros(dh, hq, t).to(q_dtype).permute(2, 1, 0)
        if kv_dtype == torch.uint8:  # NVFP4: [pages, 2 Hkv, page_size, 72]
            cache = torch.zeros(4, 2 * hkv, ps, 72, dtype=torch.uint8)
        else:
            cache = torch.zeros(4, ps, hkv, 2 * dh).to(kv_dtype).permute(0, 2, 1, 3)
        topk = torch.zeros(t, hkv, 3, dtype=I32)
        bt = _strided((t, 4), I32)
        lens = torch.zeros(t, dtype=I32)
        for num_splits in (1, 2):
            out = torch.empty(dh, hq, t, dtype=F16 if q_dtype == F16 else BF16).permute(2, 1, 0)
            gqa_ops.sparse_gqa_decode_triton(q, cache, topk, bt, lens, lens, 1, 0.1, 1.0, 1.0, 1.0, out=out,
                                             num_splits=num_splits)
    k = _strided((5, hkv, dh), BF16)
    for cache in (torch.zeros(4, hkv, ps, 2 * dh, dtype=torch.float8_e4m3fn), torch.zeros(4, hkv, ps, 2 * dh),
                  torch.zeros(4, 2 * hkv, ps, 72, dtype=torch.uint8)):  # float8, float32, NVFP4
        gqa_ops.gqa_kv_cache_insert_triton(k, k, torch.zeros(5, dtype=I64), cache, 0.5, 2.0)


def case_sparse_gqa_model():
    """The benchmark's MiniMax-M3 decode shapes through the portable kernel (64/4 heads, head dim 128,
    pages of 128, 16 selected pages, T = 64, one split, contiguous tensors): a float8 and an NVFP4
    cache, the loads a GPU other than sm_90 runs at the model's sizes."""
    t, hq, hkv, dh, ps, n_sel = 64, 64, 4, 128, 128, 16
    q = torch.zeros(t, hq, dh, dtype=BF16)
    for cache in (torch.zeros(32, hkv, ps, 2 * dh, dtype=torch.float8_e4m3fn),
                  torch.zeros(32, 2 * hkv, ps, 72, dtype=torch.uint8)):
        lens = torch.zeros(t, dtype=I32)
        gqa_ops.sparse_gqa_decode_triton(q, cache, torch.zeros(t, hkv, n_sel, dtype=I32), torch.zeros(t, 32, dtype=I32),
                                         lens, lens, 1, 0.1, 1.0, 1.0, 1.0, out=torch.empty_like(q), num_splits=1,
                                         path="portable")


CASES = {
    "metadata": case_metadata,
    "kv_cache": case_kv_cache,
    "sparse_mla": case_sparse_mla,
    "sparse_mla_fp8": case_sparse_mla_fp8,
    "sparse_mla_model": case_sparse_mla_model,
    "sparse_mla_large_dims": case_sparse_mla_large_dims,
    "sparse_gqa": case_sparse_gqa,
    "sparse_gqa_model": case_sparse_gqa_model,
}
DEFAULT_CASES = ("metadata", "kv_cache", "sparse_mla", "sparse_gqa")


# =====================================================================================================
# The offset check on TTIR
# =====================================================================================================

_DEF = re.compile(r"^\s*(%[\w.$-]+)(?::\d+)?\s*=\s*([\w.]+)(.*)$")
_NAME = re.compile(r"%[\w.$-]+")
_BOUNDED_BY_FIRST = {"arith.divsi", "arith.divui", "arith.remsi", "arith.remui", "arith.floordivsi",
                     "arith.ceildivsi"}


def _result_type(rest: str) -> str:
    body = rest.split(" loc(")[0]
    return body.rsplit(":", 1)[-1].strip() if ":" in body else ""


def _is_i32(ty: str) -> bool:
    return ty == "i32" or bool(re.search(r"x?i32>$", ty))


def _ttir_defs(ttir: str) -> tuple[dict, set]:
    """``(defs, params)`` of a TTIR text: each defined value -> (op, operand names, result type, line),
    and the kernel's parameter names."""
    defs, params = {}, set()
    for line in ttir.splitlines():
        if "tt.func" in line:
            params.update(re.findall(r"(%[\w.$-]+):", line))
            continue
        m = _DEF.match(line)
        if not m:
            continue
        name, op, rest = m.groups()
        operands = _NAME.findall(rest.split(" loc(")[0].split(":")[0] if ":" in rest else rest)
        defs[name] = (op, operands, _result_type(rest), line.strip())
    return defs, params


def offset_violations(ttir: str) -> list[str]:
    """32-bit multiplications that reach an address and involve an argument or a loaded value."""
    defs, params = _ttir_defs(ttir)

    tainted_cache: dict[str, bool] = {}

    def tainted(v: str, depth=0) -> bool:
        if v in params:
            return True
        if v in tainted_cache or depth > 400:
            return tainted_cache.get(v, False)
        tainted_cache[v] = False  # cycles (loop-carried values) count as untainted until proven otherwise
        d = defs.get(v)
        if d is None:  # a block argument: loop counter, reduction operand
            return False
        op, operands, _, _ = d
        if op == "tt.load":
            result = True
        elif op in _BOUNDED_BY_FIRST:
            result = bool(operands) and tainted(operands[0], depth + 1)
        else:
            result = any(tainted(o, depth + 1) for o in operands)
        tainted_cache[v] = result
        return result

    bad, seen = [], set()
    for name, (op, operands, _, _) in defs.items():
        if op != "tt.addptr" or len(operands) < 2:
            continue
        stack = [operands[1]]
        while stack:
            v = stack.pop()
            if v in seen or v not in defs:
                continue
            seen.add(v)
            vop, vops, vty, vline = defs[v]
            if vop == "tt.load":
                continue  # a loaded value is a leaf of the address; its own address is checked separately
            if vop in ("arith.muli", "arith.shli") and _is_i32(vty) and any(tainted(o) for o in vops):
                bad.append(vline.split(" loc(")[0])
            stack.extend(vops)
    return bad


LOADS_FIRST = {"_kv_cache_insert_kernel", "_gqa_kv_cache_insert_kernel"}  # kernels --check-load-chains checks


# kernels --check-stores-last checks (not _c128a_topk_indices_kernel, whose length store waits for its
# slot_mapping load on purpose: see the kernel)
STORES_LAST = LOADS_FIRST | {"_compressed_slot_mapping_kernel", "_decode_runtime_metadata_kernel",
                             "_swa_indices_kernel", "_compressed_topk_to_global_kernel"}


def loads_after_stores(ttir: str) -> list[str]:
    """The ``tt.load`` lines outside loops that come after a ``tt.store`` in the TTIR's text (program
    order). Loads inside a loop body are not checked: a loop that walks a row in tiles (a ``D`` over
    1,024 in ``kv_cache_insert``) loads each tile after storing the previous one by design."""
    found, stored, regions = [], False, []  # regions: True for a loop body, False for any other block
    for raw in ttir.splitlines():
        line = raw.strip()
        if line.startswith("}"):
            kind = regions.pop() if regions else False
            if line.endswith("{"):  # "} else {", "} do {": the same construct's next region
                regions.append(kind)
            continue
        if re.search(r"\btt\.store\b", line):
            stored = True
        elif stored and not any(regions) and re.search(r"= tt\.load\b", line):
            found.append(line.split(" loc(")[0])
        if line.endswith("{"):
            regions.append(bool(re.search(r"\bscf\.(for|while)\b", line)))
    return found


def load_chains(ttir: str) -> list[str]:
    """The ``tt.load`` lines whose pointer, mask or default derives from a value another load returned."""
    defs, _ = _ttir_defs(ttir)

    loaded_cache: dict[str, bool] = {}

    def loaded(v: str, depth=0) -> bool:
        if v in loaded_cache or depth > 400:
            return loaded_cache.get(v, False)
        loaded_cache[v] = False  # cycles (loop-carried values) count as not loaded until proven otherwise
        d = defs.get(v)
        result = d is not None and (d[0] == "tt.load" or any(loaded(o, depth + 1) for o in d[1]))
        loaded_cache[v] = result
        return result

    return [line.split(" loc(")[0] for op, operands, _, line in defs.values()
            if op == "tt.load" and any(loaded(o) for o in operands)]


# =====================================================================================================
# Resource report
# =====================================================================================================


def _ptxas_usage(ptx: str) -> tuple[int, int]:
    from triton.backends.nvidia.compiler import get_ptxas

    arch = _OfflineDriver.arch
    try:
        ptxas = get_ptxas(arch).path  # triton 3.7
    except TypeError:
        ptxas = get_ptxas().path  # triton 3.6
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        gpu = f"sm_{arch}a" if arch in (90, 100) else f"sm_{arch}"
        out = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", f.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return (int(regs.group(1)) if regs else -1), (int(spill.group(1)) if spill else -1)


AMD_LDS_BYTES = {"gfx950": 163_840}  # local data share a workgroup may use; 65,536 on the other AMD GPUs


def _amdgcn_usage(amdgcn: str) -> tuple[int, int]:
    """Vector registers and spilled registers (vector and scalar) of an AMD kernel, from the metadata of
    its assembly."""
    def field(name):
        found = re.search(rf"^\s*\.{name}:\s+(\d+)", amdgcn, re.M)
        return int(found.group(1)) if found else -1

    return field("vgpr_count"), max(0, field("vgpr_spill_count")) + max(0, field("sgpr_spill_count"))


def _report(found: dict, title: str, what: str, listing: bool) -> None:
    """Print the kernels in ``found`` ((case, kernel) -> offending TTIR lines), with the lines if
    ``listing``."""
    if not found:
        return
    print(title.format(len(found)))
    for (case, name), lines in sorted(found.items()):
        print(f"  {case}: {name}: {len(lines)} {what}")
        if listing:
            for line in sorted(lines):
                print(f"      {line}")


def _arch(value: str) -> int | str:
    """``--arch``: a compute capability (``90``; one of ``NVIDIA_SHARED_BYTES``) or an AMD GPU's gfx name
    (``gfx942``)."""
    if re.fullmatch(r"gfx[0-9a-f]+", value):
        return value
    if not value.isdigit() or int(value) not in NVIDIA_SHARED_BYTES:
        raise argparse.ArgumentTypeError(f"{value!r}: a gfx name or one of {sorted(NVIDIA_SHARED_BYTES)}")
    return int(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES), choices=list(CASES))
    parser.add_argument("--ttir-only", action="store_true", help="stop each compile after the TTIR")
    parser.add_argument("--check-offsets", action="store_true", help="exit 1 if a kernel breaks the offset rule")
    parser.add_argument("--check-load-chains", action="store_true",
                        help="exit 1 if a load of a cache writer waits for another load")
    parser.add_argument("--check-stores-last", action="store_true",
                        help="exit 1 if a load of a metadata kernel or cache writer follows a store")
    parser.add_argument("--list", action="store_true", help="print each kernel's offending lines")
    parser.add_argument("--arch", type=_arch, default=90,
                        help="the compute capability to compile for (default 90), or an AMD GPU (gfx942)")
    args = parser.parse_args(argv)
    _ttir_only(args.ttir_only)
    _OfflineDriver.arch = args.arch
    amd = isinstance(args.arch, str)
    target = args.arch if amd else f"sm_{args.arch}"
    # the shared memory a block may use on the target, which the portable sparse-MLA planner fits its tiles
    # to on that GPU (the stand-in tensors are CPU tensors, for which the library assumes sm_90's)
    limit = SHARED_LIMIT[0] = AMD_LDS_BYTES.get(args.arch, 65_536) if amd else NVIDIA_SHARED_BYTES[args.arch]
    mla_ops.shared_memory_per_block = lambda device: limit
    mla_ops.fit_by_compiling = lambda device: not args.ttir_only
    mla_ops.estimate_bounds_build = lambda device: args.arch == 90

    for case in args.cases:
        _CASE[0] = case
        CASES[case]()

    failures, chains, late = defaultdict(set), defaultdict(set), defaultdict(set)
    print(f"{'case':<22} {'kernel':<36} {'regs':>5} {'spill B':>8} {'shared B':>9}" if not amd else
          f"{'case':<22} {'kernel':<36} {'VGPRs':>5} {'spilled':>8} {'LDS B':>9}")
    for case, name, compiled in COMPILED:
        ttir = compiled if isinstance(compiled, str) else compiled.asm["ttir"]
        if args.check_offsets:
            for line in offset_violations(ttir):
                failures[(case, name)].add(line)
        if args.check_load_chains and name in LOADS_FIRST:
            for line in load_chains(ttir):
                chains[(case, name)].add(line)
        if args.check_stores_last and name in STORES_LAST:
            for line in loads_after_stores(ttir):
                late[(case, name)].add(line)
        if isinstance(compiled, str):
            continue
        shared = compiled.metadata.shared
        if amd:
            regs, spill = _amdgcn_usage(compiled.asm["amdgcn"])
        else:
            regs, spill = _ptxas_usage(compiled.asm["ptx"])
        flag = f"  > {'LDS' if amd else target} limit" if shared > limit else ""
        columns = _launch.tensor_memory_columns(compiled.metadata)
        if columns > _launch.TENSOR_MEMORY_COLUMNS:  # Triton builds it as a kernel that only traps
            flag += f"  {columns} columns > tensor memory limit (a trap)"
        if not amd and 0 <= regs < 255 and spill > 0 and getattr(compiled.metadata, "maxnreg", None) is None:
            # ptxas, blind to the dynamic shared memory, aimed at more programs per SM than fit
            flag += "  spills under ptxas's 255-register limit"
        if id(compiled) in RETRIED:
            flag += "  one stage (the launcher's retry)"
        print(f"{case:<22} {name:<36} {regs:>5} {spill:>8} {shared:>9}{flag}")
    print(f"{len(COMPILED)} launches compiled for {target} (triton {triton.__version__})")
    for case, name, error in FAILED:
        print(f"does not compile: {case} {name}: {error}")
    for case, call in REFUSED:
        print(f"refused by the launcher: {case} {call}")
    _report(failures, "offset rule broken in {} kernel(s):", "32-bit product(s) reach an address", args.list)
    _report(chains, "a load waits for another in {} cache writer(s):", "load(s) behind a loaded value", args.list)
    if args.check_load_chains:
        checked = sum(1 for _, name, _ in COMPILED if name in LOADS_FIRST)
        print(f"{checked} cache-writer launches checked for load chains")
    _report(late, "a load follows a store in {} kernel(s):", "load(s) after a store", args.list)
    if args.check_stores_last:
        checked = sum(1 for _, name, _ in COMPILED if name in STORES_LAST)
        print(f"{checked} launches checked for loads after stores")
    return 1 if failures or chains or late or FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
