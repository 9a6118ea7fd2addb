"""Compile the Hopper kernels (sparse MLA, sparse GQA) for sm_90a without a GPU and report their resources.

    python scripts/inspect_hopper.py [--sass DIR] [--gqa] [--alignment] [--only FORMATS]

For each variant (cache format x split x extra list) prints registers (the kernel's ``.maxnreg`` and
each partition's ``setmaxnreg``), spill bytes, shared memory and the counts of the instructions that
matter (``HGMMA`` tensor-core ops, ``SYNCS`` mbarrier ops, 128-bit global loads, local-memory traffic).
Uses the ``ptxas`` Triton builds sm_90 code with (given the options the launchers give it,
``ops/_launch.py::hopper_ptx_options``) and the ``cuobjdump`` shipped inside the triton wheel.
Not a test: a tool to read what the compiler did before spending GPU time (``docs/sparse_mla.md``
records the figures). ``--alignment`` compiles each kernel once per pointer argument with that pointer's
alignment hint removed and says which ones the kernel cannot do without (what ``supported()`` of each
kernel must check, ``ALIGNED_ARGS``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from torch_sparse_mla.ops import sparse_gqa_hopper as gqa_hopper
from torch_sparse_mla.ops import sparse_mla_hopper as hopper
from torch_sparse_mla.ops._launch import hopper_ptx_options

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
VERSION = tuple(int(x) for x in triton.__version__.split(".")[:2])


def compile_variant(kv_format: str, split: bool, extra: bool, sink: bool = True, lengths: bool = True,
                    heads: int = 64):
    """``heads`` 64: the 64-head kernel; 16 or 32: the few-heads kernel with that many heads per CTA."""
    dim = 512 if kv_format == "fp8_584" else 576
    constexprs = dict(KV_FORMAT={"auto": 0, "fp8_656": 1, "fp8_584": 2}[kv_format], D=dim, FOLD=kv_format == "fp8_656",
                      HAS_LEN=lengths, HAS_EXTRA=extra, HAS_XLEN=extra and lengths, HAS_SINK=sink, SPLIT=split,
                      stride_qd=1, stride_od=1)
    if heads == 64:
        fn = hopper._sparse_mla_decode_hopper_kernel
        constexprs.update(WORKER_REGS=hopper._WORKER_REGS[kv_format])
    else:
        fn = hopper._sparse_mla_decode_hopper_t_kernel
        constexprs.update(HB=heads, WORKER_REGS=hopper._WORKER_REGS_T)
    cache_ty = "*bf16" if kv_format == "auto" else "*u8"
    pointer_types = {"q_ptr": "*bf16", "cache_ptr": cache_ty, "xcache_ptr": cache_ty, "idx_ptr": "*i32",
                     "xidx_ptr": "*i32", "len_ptr": "*i32", "xlen_ptr": "*i32", "sink_ptr": "*fp32",
                     "out_ptr": "*bf16", "lse_ptr": "*fp32", "ws_ptr": "*fp32"}
    # as the launcher specialises: strides that are multiples of 16
    div16 = {"stride_qt", "stride_qh", "stride_cp", "stride_xp", "stride_ot", "stride_oh"}
    if kv_format == "auto":
        div16 |= {"stride_cr", "stride_xr"}
    return _compile(fn, constexprs, pointer_types, ("qk_scale", "score_sign", "lse_scale"), div16, {})


_UNALIGNED: set[str] = set()  # pointer arguments compiled without their 16-byte alignment hint (--alignment)


def _compile(fn, constexprs: dict, pointer_types: dict, float_args, div16, options: dict):
    """Compile a Gluon kernel for sm_90a as the launcher specialises it: ``constexprs``; pointers typed
    by ``pointer_types`` and 16-byte aligned (but those in ``_UNALIGNED``); the ``float_args`` float32;
    every other argument int32, those in ``div16`` multiples of 16."""
    from triton.experimental import gluon

    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else pointer_types.get(n, "fp32" if n in float_args else "i32")
                 for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if (signature[n].startswith("*") or n in div16) and n not in _UNALIGNED}
    src = gluon._runtime.GluonASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs)
    ptx_options = hopper_ptx_options()  # as the launchers build them
    if ptx_options is not None:
        options = {**options, "ptx_options": ptx_options}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "enable_fp_fusion": True, **options})


def compile_gqa_variant(split: bool, q_dtype: str, page_size: int = 128, stages: int = gqa_hopper.NUM_STAGES,
                        cache: str = "fp8", lazy: bool = False):
    """The sparse-GQA kernel (``ops/sparse_gqa_hopper.py``) as the launcher specialises it: ``q_dtype``
    ``bf16`` (two query pieces) or ``fp16`` (three), device scales given, a contiguous query and output;
    ``cache`` ``"fp8"`` (a float8 value cache) or ``"nvfp4"`` (an NVFP4 cache: `NQ = 0`); ``lazy`` the
    softmax against a reference maximum (splits of at least ``_LAZY_MIN_BLOCKS`` blocks)."""
    nq = 0 if cache == "nvfp4" else 2 if q_dtype == "bf16" else 3
    fn = gqa_hopper._sparse_gqa_decode_hopper_kernel
    constexprs = dict(PAGE_SIZE=page_size, HB=gqa_hopper.BLOCK_H, NQ=nq, NR=stages, BLOCK_SEL=32, HAS_K_SCALE=True,
                      HAS_V_SCALE=True, SPLIT=split, LAZY=lazy, WORKER_REGS=gqa_hopper._WORKER_REGS, stride_qd=1,
                      stride_od=1)
    pointer_types = {"q_ptr": f"*{q_dtype}", "cache_ptr": "*u8" if cache == "nvfp4" else "*fp8e4nv",
                     "topk_ptr": "*i32", "bt_ptr": "*i32",
                     "kv_lens_ptr": "*i32", "qo_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
                     "out_ptr": f"*{q_dtype}", "ws_ptr": "*fp32"}
    # as supported() requires: a 16-byte aligned cache whose page, head and row strides are multiples of 16
    div16 = {"stride_cp", "stride_ch", "stride_co", "stride_qt", "stride_qh", "stride_ot", "stride_oh"}
    return _compile(fn, constexprs, pointer_types, ("qk_scale", "v_scale"), div16, {"maxnreg": gqa_hopper._MAXNREG})


def barrier_aliases(ck) -> int | None:
    """How many shared-memory scratch buffers (layout conversions, reductions) the compiler placed on an
    mbarrier: runs the shared-memory allocation of the TTGIR -> LLVM lowering again on the compiled
    TTGIR and compares offsets. The allocator reuses the memory of a barrier it considers dead (one that
    is initialised and never used again), but PTX requires an ``mbarrier.inval`` before an mbarrier's
    memory is used for anything else; a one-consumer variant of the sparse-GQA kernel had exactly that
    and gave non-finite rows on an H200 (``docs/sparse_gqa_hopper.md``). ``None`` where this triton's pass API
    differs from 3.6 / 3.7's."""
    try:
        from triton._C.libtriton import ir, nvidia, passes

        ctx = ir.context()
        ir.load_dialects(ctx)
        nvidia.load_dialects(ctx)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.ttgir")
            with open(path, "w") as f:
                f.write(ck.asm["ttgir"])
            mod = ir.parse_mlir_module(path, ctx)
        mod.context = ctx
        pm = ir.pass_manager(ctx)
        passes.ttgpuir.add_combine_tensor_select_and_if(pm)
        passes.ttgpuir.add_allocate_warp_groups(pm)
        passes.convert.add_scf_to_cf(pm)
        passes.gluon.add_inliner(pm)
        nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, 90, 87)
        pm.run(mod, "allocate")
        text = str(mod)
    except Exception:  # noqa: BLE001 - another triton: no answer rather than a wrong one
        return None
    barriers, scratch = [], []
    for line in text.splitlines():
        m = re.search(r"ttg\.local_alloc \{allocation\.offset = (\d+) : i32\} : \(\) -> !ttg\.memdesc<([\dx]+)xi64", line)
        if m:
            count = 1
            for dim in m.group(2).split("x"):
                count *= int(dim)
            barriers.append((int(m.group(1)), int(m.group(1)) + 8 * count))
            continue
        m = re.search(r"allocation\.offset = (\d+)", line)
        if m and "ttg.local_alloc" not in line:
            scratch.append(int(m.group(1)))
    return sum(1 for s in scratch for lo, hi in barriers if lo <= s < hi)


def inner_loops(sass: str, min_size: int = 64) -> list[list[str]]:
    """The instructions of each innermost loop of at least ``min_size`` instructions, in address order:
    a backward branch before the kernel's last ``EXIT`` closes a loop from its target to itself (the
    out-of-line retry stubs of mbarrier waits after it jump back into the code they came from), and a
    loop is innermost when no other such loop lies inside it. In these kernels they are the partitions'
    per-block loops."""
    addr = {}
    branches = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if not m:
            continue
        at = int(m.group(1), 16)
        addr[at] = m.group(2)
        b = re.search(r"\bBRA\s+(0x[0-9a-f]+)", m.group(2))
        if b and int(b.group(1), 16) < at:
            branches.append((int(b.group(1), 16), at))
    last_exit = max((a for a, text in addr.items() if re.search(r"\bEXIT\b", text)), default=max(addr, default=0))
    loops = [(lo, hi) for lo, hi in branches if hi < last_exit]
    size = {(lo, hi): sum(1 for a in addr if lo <= a <= hi) for lo, hi in loops}
    big = [lh for lh in loops if size[lh] >= min_size]
    inner = [(lo, hi) for lo, hi in big if not any(lo <= lo2 and hi2 <= hi and (lo2, hi2) != (lo, hi)
                                                  for lo2, hi2 in big)]
    return [[addr[a] for a in sorted(addr) if lo <= a <= hi] for lo, hi in sorted(set(inner))]


def _or_unknown(value) -> str:
    return "?" if value is None else str(value)


def _ptxas() -> str:
    """The ptxas Triton builds sm_90 code with (from 3.9 its newer ``ptxas-blackwell``, whose PTX the
    older ``ptxas`` of the same wheel refuses; ``TRITON_PTXAS_PATH`` and the like override it)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(90).path


def report(ck, label: str, sass_dir: str | None) -> str:
    ptx = ck.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        flags = ["--regAllocOptLevel=2"] if VERSION >= (3, 7) else []  # Triton's own, then the kernels'
        flags += (hopper_ptx_options() or "").split()
        r = subprocess.run([_ptxas(), "-v", *flags, "--gpu-name=sm_90a", p, "-o",
                            os.path.join(d, "k.o")], capture_output=True, text=True)
        c = os.path.join(d, "k.cubin")
        with open(c, "wb") as f:
            f.write(ck.asm["cubin"])
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", c], capture_output=True, text=True).stdout
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    counts = {w: len(re.findall(r"\b" + w + r"[\.\s]", sass))
              for w in ("HGMMA", "QGMMA", "SYNCS", "LDL", "STL", "F2F", "BAR", "PREEXIT")}
    ldg128 = len(re.findall(r"LDG\.E\.128", sass))
    setmax = sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx)))
    maxnreg = re.findall(r"maxnreg (\d+)", ptx)
    # mbarrier arrivals: one thread's and every thread's own (the form compute-sanitizer's racecheck
    # follows; docs/testing.md)
    from racecheck_probe import arrivals  # scripts/, this script's directory

    arrive_one, arrive_all = arrivals(ptx)
    loops = inner_loops(sass)
    loop_spills = [sum(1 for text in body if re.search(r"\b(STL|LDL)\b", text)) for body in loops]  # local memory
    def most_bars(issues: str) -> int:
        """The most partition barriers in any per-block loop with an ``issues`` instruction (-1: none)."""
        return max((sum(1 for text in body if re.match(r"(@!?U?P\w+\s+)?BAR\b", text)) for body in loops
                    if any(re.match(issues + r"\b", text) for text in body)), default=-1)

    producer_bars = most_bars("LDGSTS")  # the producer's loop: the one that issues the cp.async copies
    consumer_bars = most_bars("HGMMA")  # a consumer's loop: one that issues wgmma
    line = (f"{label:44s} maxnreg={maxnreg} setmaxnreg={setmax} "
            f"spill st/ld={spills.group(1) + '/' + spills.group(2) if spills else '?'} smem={ck.metadata.shared} "
            f"LDG128={ldg128} " + " ".join(f"{k}={v}" for k, v in counts.items())
            + f" barrier_alias={_or_unknown(barrier_aliases(ck))} arrive_one={arrive_one} arrive_all={arrive_all}"
            + f" loops={','.join(str(len(body)) for body in loops)} loop_spills={','.join(map(str, loop_spills))}"
            + f" producer_bars={producer_bars} consumer_bars={consumer_bars}")
    if sass_dir:
        os.makedirs(sass_dir, exist_ok=True)
        with open(os.path.join(sass_dir, label.replace(" ", "_") + ".sass"), "w") as f:
            f.write(sass)
    return line


def alignment_report(formats, gqa: bool) -> None:
    """For each pointer argument of a Hopper kernel: does it compile when that pointer is not known to
    be 16-byte aligned (the JIT's specialisation of an unaligned tensor)? Its launcher must check the
    alignment of every pointer for which it does not (``supported()``, ``ALIGNED_ARGS``). Sparse MLA (the
    64-head and the few-heads kernel) in ``formats``, or with ``gqa`` sparse GQA (float8, NVFP4)."""
    if gqa:
        variants = [(f"gqa {c}", lambda c=c: compile_gqa_variant(True, "bf16", cache=c)) for c in ("fp8", "nvfp4")]
    else:
        variants = [(f"mla {f} heads={h}", lambda f=f, h=h: compile_variant(f, split=True, extra=True, heads=h))
                    for f in formats for h in (64, 16)]
    pointers = {"mla": ("q_ptr", "cache_ptr", "xcache_ptr", "idx_ptr", "xidx_ptr", "len_ptr", "xlen_ptr", "sink_ptr",
                        "out_ptr", "lse_ptr", "ws_ptr"),
                "gqa": ("q_ptr", "cache_ptr", "topk_ptr", "bt_ptr", "kv_lens_ptr", "qo_ptr", "k_scale_ptr",
                        "v_scale_ptr", "out_ptr", "ws_ptr")}
    for label, build in variants:
        for name in pointers[label.split()[0]]:
            _UNALIGNED.clear()
            _UNALIGNED.add(name)
            try:
                build()
                verdict = "compiles"
            except Exception as exc:  # noqa: BLE001 - the compiler's failure is the answer
                verdict = f"does not compile ({type(exc).__name__})"
            print(f"{label}, {name} not 16-byte aligned: {verdict}", flush=True)
    _UNALIGNED.clear()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass", help="also write each variant's SASS into this folder")
    parser.add_argument("--only", help="comma-separated formats (auto, fp8_656, fp8_584)")
    parser.add_argument("--heads", default="64,16,32",
                        help="comma-separated heads per CTA: 64 (the 64-head kernel), 16 and 32 (the few-heads kernel)")
    parser.add_argument("--gqa", action="store_true", help="the sparse-GQA kernel instead (split x lazy x query dtype)")
    parser.add_argument("--alignment", action="store_true",
                        help="which pointer arguments must be 16-byte aligned for the kernels to compile "
                             "(sparse MLA in the --only formats, or with --gqa sparse GQA)")
    args = parser.parse_args(argv)
    if not hopper.HAS_GLUON:
        print("no Hopper kernels with this triton (a release outside GLUON_TRITON_VERSIONS, or no usable Gluon)",
              file=sys.stderr)
        return 1
    if args.alignment:
        alignment_report(args.only.split(",") if args.only else ["fp8_656", "fp8_584", "auto"], args.gqa)
        return 0
    if args.gqa:
        print(f"triton {triton.__version__}")
        for cache in ("fp8", "nvfp4"):
            for split in (False, True):
                for lazy in (False, True):
                    for q_dtype in ("bf16", "fp16"):
                        label = f"gqa {cache} q={q_dtype} split={int(split)} lazy={int(lazy)}"
                        print(report(compile_gqa_variant(split, q_dtype, cache=cache, lazy=lazy), label, args.sass),
                              flush=True)
        return 0
    formats = args.only.split(",") if args.only else ["fp8_656", "fp8_584", "auto"]
    print(f"triton {triton.__version__}")
    for heads in (int(h) for h in args.heads.split(",")):
        for kv_format in formats:
            for split, extra in ((False, False), (True, False), (False, True)):
                label = f"{kv_format} heads={heads} split={int(split)} extra={int(extra)}"
                print(report(compile_variant(kv_format, split, extra, heads=heads), label, args.sass), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
