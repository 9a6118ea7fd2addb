"""Hopper (sm_90) kernel of ``sparse_mla_decode``, written in Gluon.

The portable Triton kernel (``ops/sparse_mla.py``) dequantises each piece of K in registers, once per
head block, and cannot stage a dequantised tile in shared memory or overlap the row gathers with the
tensor-core work. This kernel does both, with explicit warp specialisation:

- **One CTA per (token, split, block of 64 heads).** Heads fastest in the grid, so the two head blocks
  of an H = 128 token run side by side and the second one's gathers hit L2. Heads past ``H`` are zero
  rows (masked at the store).
- **Three warpgroups** (``gl.warp_specialize``):

  - *producer* (4 warps): per block of 64 candidates, loads the slot indices, gathers the rows with
    16-byte loads, converts the e4m3 bytes to bf16 with integer instructions (no conversion-unit
    work), and stores the tile ``[64 keys, D]`` into a two-stage shared-memory ring in the swizzled
    layout the tensor cores read; then the per-key validity (and, for ``fp8_656``, the per-key group
    scales), a proxy fence and an mbarrier arrive.
  - *two consumers* (4 warps each) split the output dims: consumer ``w`` owns ``[256 w, 256 w + 256)``
    (a ``[64, 512]`` float32 accumulator does not fit one warpgroup's registers). The first stages Q
    in shared memory once (while the producer already fetches the first block), then waits for a
    stage, computes ``S = Q K^T`` with ``wgmma`` straight from shared memory, runs the online softmax
    in base 2, hands ``P`` and the rescale factor of the
    block to the second through shared memory (``p_ready`` / ``p_free`` mbarriers), and accumulates
    ``O += P V`` for its dims, where V is the same K tile read in place (no copy, no transpose). The
    second only rescales its half of ``O`` and adds ``P V``: ``Q K^T`` is computed once per block.
    Both release the stage (``empty`` barrier, count 2).

- **At most 32 heads** (``H`` = 16 is DeepSeek-V3.2's 128 heads over eight GPUs) take the few-heads
  kernel (``_sparse_mla_decode_hopper_t_kernel``): 16 or 32 heads per CTA, the products transposed
  (``S^T = K Q^T``, ``O^T += V^T P^T``) so the keys are the 64-row M side of ``wgmma`` and the heads its
  N side, one consumer warpgroup and the same producer and ring. A 64-head CTA would spend three
  quarters of its MMA work on padding.
- **Exactness.** ``fp8_584`` scales are powers of two, so the tile holds the exact dequantised values.
  ``fp8_656`` scales are arbitrary floats: the tile holds the raw e4m3 values (exact in bf16), each
  scale group's partial product is scaled in float32 (``S += s_g * (Q_g K_g^T)``) and the probabilities
  are scaled per group before the product with V (``O_g += bf16(P * s_g) V_g``), so the only roundings
  are the ones the contract allows (the second consumer receives ``P`` as fp16, whose rounding is
  below bf16's, and scales it in float32 before its own bf16 rounding). ``auto`` (bf16) tiles are the
  cache values.
- **Split-K** as in the portable kernel: the candidate blocks of a token are divided among
  ``num_splits`` CTAs that write float32 partials ``(acc, m, l)``; the portable combine kernel merges
  them. The combine's workspace layout is shared, so the two kernels interoperate.

Requirements (checked by :func:`supported` on the host; anything else takes the portable kernel): an
sm_90 device, bf16 ``q`` with ``head_dim_v == 512`` and ``D`` 576 (``fp8_656`` or ``auto``) or 512
(``fp8_584`` or ``auto``), 16-byte aligned cache rows (page stride and row stride multiples of 16
bytes). ``q``, ``out`` and every index tensor may have any strides.

Gluon does not run under the Triton interpreter: these kernels are tested on the GPU only
(``tests/test_sparse_mla.py``, the ``hopper`` tests), against the same references as the portable one.
"""

from __future__ import annotations

import warnings

import torch

from ..meta_kernels._formats import FORMAT_IDS
from ._launch import KernelLaunch, LaunchPlan, cdiv, compute_capability, hip, hopper_ptx_options
from ._triton import HAS_TRITON, release, triton

#: Triton releases whose Gluon the Hopper kernels (this module's and ``sparse_gqa_hopper``'s) are written
#: for: each builds them for sm_90a (``scripts/inspect_hopper.py``), and the GPU suite has passed on an
#: H200 with 3.6, 3.8 and 3.9. Gluon is experimental and changes between releases (3.9 renamed
#: ``_reinterpret`` and removed ``async_copy_global_to_shared``: the import below adapts to both), so
#: with any other release the portable Triton kernels serve every call.
GLUON_TRITON_VERSIONS = ((3, 6), (3, 7), (3, 8), (3, 9))


def _release_names() -> list[str]:
    """:data:`GLUON_TRITON_VERSIONS` as "3.6", "3.7", ... (for messages)."""
    return ["%d.%d" % v for v in GLUON_TRITON_VERSIONS]


def gluon_version_supported(version: str) -> bool:
    """Whether Triton ``version`` (``triton.__version__``: "3.8.0", "3.6.0+git1a2b3c") is one of
    :data:`GLUON_TRITON_VERSIONS`."""
    return release(version) in GLUON_TRITON_VERSIONS


HAS_GLUON = False
# Why this Triton gives no Hopper kernels (None where it does): what warn_portable_on_sm90 says.
GLUON_UNAVAILABLE: str | None = None
if HAS_TRITON and not gluon_version_supported(triton.__version__):
    GLUON_UNAVAILABLE = (f"triton {triton.__version__} is not a release the Hopper kernels are written for "
                         f"({', '.join(_release_names())})")
elif HAS_TRITON:
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (
            async_copy,
            fence_async_shared,
            mbarrier,
            warpgroup_mma,
            warpgroup_mma_wait,
        )

        # Two Gluon names the kernels use changed between the releases above: 3.8 added
        # ``async_copy.async_load`` for ``async_copy_global_to_shared`` (which 3.9 removed), and 3.9 made
        # ``shared_memory_descriptor._reinterpret`` public as ``reinterpret``. The kernels use the new
        # names; where a release has only the old ones they name the same builtins.
        async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
        if not hasattr(gl.shared_memory_descriptor, "reinterpret"):
            gl.shared_memory_descriptor.reinterpret = gl.shared_memory_descriptor._reinterpret

        _missing = [n for n in ("warp_specialize", "NVMMADistributedLayout", "inline_asm_elementwise")
                    if not hasattr(gl, n)]
        HAS_GLUON = not _missing
        if _missing:
            GLUON_UNAVAILABLE = f"the Gluon of triton {triton.__version__} has no {', '.join(_missing)}"
    except Exception as exc:  # noqa: BLE001 - any Triton without a usable Gluon for Hopper takes the portable path
        HAS_GLUON = False
        GLUON_UNAVAILABLE = (f"the Gluon of triton {triton.__version__} could not be imported "
                             f"({type(exc).__name__}: {exc})")

BLOCK_H = 64  # heads per CTA: the M of one warpgroup's wgmma
BLOCK_N = 64  # candidates per block (one ring stage)
_MIN_BLOCKS_PER_SPLIT = 2
# Most CTAs for which a split of one block each beats splits of two (small T, short lists).
_ONE_BLOCK_CTAS = 64
# Registers per thread requested for the second consumer and the producer (setmaxnreg), per cache
# format; the first consumer (the default partition: Q K^T, softmax and its half of P V) gets what is
# left of the 64K register file (up to 256). fp8_656's second consumer scales P per group and spills
# 172 bytes at 176 registers; at 200 it spills 68 and the kernel runs 17-21% faster on an H200
# (docs/sparse_mla_hopper.md, "Register split"). The other formats are fastest at (176, 80).
_WORKER_REGS = {"fp8_656": (200, 56), "fp8_584": (176, 80), "auto": (176, 80)}
# The few-heads kernel (two warpgroups): registers per thread of its producer; its consumer gets the rest.
_WORKER_REGS_T = 96

if HAS_GLUON:
    _BH = gl.constexpr(BLOCK_H)
    _BN = gl.constexpr(BLOCK_N)
    # bf16 (`auto`) row copies: [64 rows, 64 bf16] per chunk, a warp instruction takes 4 rows x 128 bytes
    _GB = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
    _FLT_MAX = gl.constexpr(3.4028234663852886e38)
    _LN2 = gl.constexpr(0.6931471805599453)

    # e4m3 -> bf16 for 4 bytes with integer instructions (four per pair of values): a byte permute puts
    # each byte in the low byte of a 16-bit lane and its sign, replicated, in the high byte; a shift left
    # by 4 and a mask keep the sign in bit 15 and exponent+mantissa in bits 4..10, which is the bf16 of the
    # value times 2^-120 (e4m3 subnormals included, as bf16 subnormals); one bf16x2 fma with 2^120 restores
    # the scale exactly. e4m3 NaN (0x7F / 0xFF) becomes +-480 (the cache writer never produces NaN codes).
    _E4M3X4_TO_BF16X4 = gl.constexpr("""
    {
    .reg .b32 t0, t1, u0, u1, k, z;
    mov.b32 k, 0x7B807B80;
    mov.b32 z, 0x80008000;
    prmt.b32 t0, $2, 0, 0x9180;
    prmt.b32 t1, $2, 0, 0xB3A2;
    shl.b32 u0, t0, 4;
    shl.b32 u1, t1, 4;
    and.b32 u0, u0, 0x87F087F0;
    and.b32 u1, u1, 0x87F087F0;
    fma.rn.bf16x2 $0, u0, k, z;
    fma.rn.bf16x2 $1, u1, k, z;
    }
    """)
    # bf16 x bf16 -> bf16 (one rounding; exact for the power-of-two scales of fp8_584).
    _BF16X2_MUL = gl.constexpr("""
    {
    .reg .b32 z;
    mov.b32 z, 0x80008000;
    fma.rn.bf16x2 $0, $1, $2, z;
    }
    """)

    _cta_barrier = getattr(gl, "barrier", None) or getattr(gl, "thread_barrier")

    # The fp8_584 producer's views of a ring stage as [chunk, key, 64] (see _issue_block): raw bytes in
    # _G3 (a thread's 16 bytes of a row, as G8 per chunk).
    _G3 = gl.constexpr(gl.BlockedLayout([1, 1, 16], [1, 8, 4], [1, 4, 1], [2, 1, 0]))
    _R3 = gl.constexpr(gl.SliceLayout(0, gl.SliceLayout(2, _G3)))  # keys
    _C3 = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, _G3)))  # chunks
    # the bf16 tile [64 keys, 512] in 128-byte swizzle as [8 chunks, 64 keys, 64]: the same bytes
    _KL3 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3))
    # the raw staging bytes [16, 64 keys, 64] (unswizzled): rank 3 for slices of several chunks,
    # rank 2 (a stack of 2-D chunks) for one chunk
    _RAW3 = gl.constexpr(gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=1, order=[2, 1, 0]))
    _RAW2 = gl.constexpr(gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=1, order=[1, 0]))
    # the fp8_584 scale table [stage, chunk, key] (float32, unswizzled) of one stage: [chunk, key]
    _SC3 = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))

    @gluon.jit
    def _launch_dependents():
        """Let the kernel launched programmatically dependent on this one (the split combine, see
        ``ops/_launch.py::wait_for_prior_grid``) be scheduled once every CTA of this grid has executed
        this or exited (``griddepcontrol.launch_dependents``)."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _e4m3_to_bf16(raw):
        return gl.inline_asm_elementwise(_E4M3X4_TO_BF16X4, "=r,=r,r", [raw], dtype=gl.bfloat16, is_pure=True,
                                         pack=4)

    @gluon.jit
    def _mul_bf16(a, b):
        return gl.inline_asm_elementwise(_BF16X2_MUL, "=r,r,r", [a, b], dtype=gl.bfloat16, is_pure=True, pack=2)

    @gluon.jit
    def _block_range(pid, num_head_blocks, num_splits, len_ptr, stride_len, topk, xlen_ptr, stride_xlen, x_topk,
                     HAS_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_XLEN: gl.constexpr,
                     SPLIT: gl.constexpr):
        """``(t, hb, blk_lo, blk_hi, nb_main, n_main, n_extra)`` of this CTA: the same in every partition."""
        hb = pid % num_head_blocks
        rest = pid // num_head_blocks
        split = rest % num_splits
        t = (rest // num_splits).to(gl.int64)
        n_main = topk
        if HAS_LEN:
            n_main = gl.minimum(gl.maximum(gl.load(len_ptr + t * stride_len), 0), topk)
        nb_main = (n_main + _BN - 1) // _BN
        nb_total = nb_main
        n_extra = gl.to_tensor(0)
        if HAS_EXTRA:
            n_extra = x_topk
            if HAS_XLEN:
                n_extra = gl.minimum(gl.maximum(gl.load(xlen_ptr + t * stride_xlen), 0), x_topk)
            nb_total += (n_extra + _BN - 1) // _BN
        if SPLIT:
            per_split = (nb_total + num_splits - 1) // num_splits
            blk_lo = split * per_split
            # never below blk_lo (a split past the list's end has no block): the consumers' last hand-off
            # waits on the parity of the block count
            blk_hi = gl.maximum(gl.minimum(blk_lo + per_split, nb_total), blk_lo)
        else:
            blk_lo = gl.to_tensor(0)
            blk_hi = nb_total
        return t, hb, blk_lo, blk_hi, nb_main, n_main, n_extra

    # -------------------------------------------------------------------------------------------------
    # producer
    # -------------------------------------------------------------------------------------------------

    @gluon.jit
    def _block_list(blk, t, nb_main, n_main, n_extra,
                    cache_ptr, stride_cp, stride_cr, page_size, num_slots, idx_ptr, stride_it, stride_ik,
                    xcache_ptr, stride_xp, stride_xr, x_page_size, x_num_slots, xidx_ptr, stride_xt, stride_xk,
                    HAS_EXTRA: gl.constexpr):
        """The cache, list and position of block ``blk`` (blocks past the main list's come from the extra
        list): ``(cache, page stride, row stride, page size, slots, list row, list stride, used, first)``."""
        c_ptr = cache_ptr
        c_sp = stride_cp
        c_sr = stride_cr
        c_ps = page_size
        c_ns = num_slots
        i_ptr = idx_ptr + t * stride_it
        i_st = stride_ik
        n_used = n_main
        first = blk * _BN
        if HAS_EXTRA:
            if blk >= nb_main:
                c_ptr = xcache_ptr
                c_sp = stride_xp
                c_sr = stride_xr
                c_ps = x_page_size
                c_ns = x_num_slots
                i_ptr = xidx_ptr + t * stride_xt
                i_st = stride_xk
                n_used = n_extra
                first = (blk - nb_main) * _BN
        return c_ptr, c_sp, c_sr, c_ps, c_ns, i_ptr, i_st, n_used, first

    @gluon.jit
    def _block_slots(blk, t, nb_main, n_main, n_extra,
                     cache_ptr, stride_cp, stride_cr, page_size, num_slots, idx_ptr, stride_it, stride_ik,
                     xcache_ptr, stride_xp, stride_xr, x_page_size, x_num_slots, xidx_ptr, stride_xt, stride_xk,
                     HAS_EXTRA: gl.constexpr, KV_FORMAT: gl.constexpr):
        """The 64 slot ids of block ``blk`` (-1 past the list's used length; a block past the end loads
        nothing): loaded one block ahead, so the index round trip is off the critical path. For the bf16
        format in the row layout of its copies (no layout change in :func:`_issue_block`)."""
        if KV_FORMAT == 0:
            ROWS: gl.constexpr = gl.SliceLayout(1, _GB)
        else:
            ROWS: gl.constexpr = gl.SliceLayout(1, gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0]))
        c_ptr, c_sp, c_sr, c_ps, c_ns, i_ptr, i_st, n_used, first = _block_list(
            blk, t, nb_main, n_main, n_extra, cache_ptr, stride_cp, stride_cr, page_size, num_slots, idx_ptr,
            stride_it, stride_ik, xcache_ptr, stride_xp, stride_xr, x_page_size, x_num_slots, xidx_ptr, stride_xt,
            stride_xk, HAS_EXTRA)
        offs = first + gl.arange(0, _BN, layout=ROWS)
        in_list = offs < n_used
        return gl.load(i_ptr + offs.to(gl.int64) * i_st, mask=in_list, other=-1)

    @gluon.jit
    def _issue_block(
        blk, stage, slot_ids, t, nb_main, n_main, n_extra,
        cache_ptr, stride_cp, stride_cr, page_size, num_slots, idx_ptr, stride_it, stride_ik,
        xcache_ptr, stride_xp, stride_xr, x_page_size, x_num_slots, xidx_ptr, stride_xt, stride_xk,
        knope, krope, scales, valid_smem,
        KV_FORMAT: gl.constexpr, D: gl.constexpr, HAS_EXTRA: gl.constexpr,
    ):
        """Start the copies of block ``blk`` into ring stage ``stage`` (cp.async, one commit group).

        Bytes that need no conversion go straight to their final place: bf16 cache rows, the bf16 dims
        of the fp8 formats, the fp8_656 scales. The e4m3 bytes land in a raw staging area inside the
        stage's own bf16 tile (its upper half), which :func:`_convert_block` expands in place. Invalid
        keys copy nothing and read as zeros. Also writes the keys' validity (and the fp8_584 scales).

        fp8_584's e4m3 chunks are copied by three operations over ``[chunk, key, byte]`` (4 + 2 + 1 chunks)
        and its exponents stored by one, not one operation per chunk: the compiler puts a partition
        barrier between consecutive writes into one shared allocation where it cannot tell that they do
        not overlap (triton 3.6 always, 3.7 and 3.8 for the raw staging view), and the copies of one block
        never overlap. That form cut the V4 configurations' time by 2-3% on an H200; for fp8_656 and bf16
        it measured no faster, and they keep one copy per chunk ("Fewer partition barriers" in
        docs/sparse_mla_hopper.md)."""
        G8: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        G16: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        ROWS16: gl.constexpr = gl.SliceLayout(1, G16)
        c_ptr, c_sp, c_sr, c_ps, c_ns, i_ptr, i_st, n_used, first = _block_list(
            blk, t, nb_main, n_main, n_extra, cache_ptr, stride_cp, stride_cr, page_size, num_slots, idx_ptr,
            stride_it, stride_ik, xcache_ptr, stride_xp, stride_xr, x_page_size, x_num_slots, xidx_ptr, stride_xt,
            stride_xk, HAS_EXTRA)
        # slot ids are int32: page and row in 32-bit arithmetic (a 64-bit division by the page size is
        # several times longer, on the producer's serial path), the byte offsets in 64
        valid = (slot_ids >= 0) & (slot_ids.to(gl.int64) < c_ns)
        slot = gl.where(valid, slot_ids, 0)
        page32 = slot // c_ps
        row = (slot - page32 * c_ps).to(gl.int64)
        page = page32.to(gl.int64)
        valid_smem.index(stage).store(valid.to(gl.int8))
        kn = knope.index(stage)
        cols16 = gl.arange(0, 64, layout=gl.SliceLayout(0, G16))
        if KV_FORMAT == 0:
            # a warp instruction copies 4 rows x 128 bytes (one swizzle row of each), in _GB
            rbase = page * c_sp + row * c_sr
            ptrs = c_ptr + rbase[:, None] + gl.arange(0, 64, layout=gl.SliceLayout(0, _GB))[None, :]
            vmask = valid[:, None]
            for c in gl.static_range(8):
                async_load(kn.slice(64 * c, 64, dim=1), ptrs + 64 * c, mask=vmask)
            if D == 576:
                async_load(krope.index(stage), ptrs + 512, mask=vmask)
        else:
            vmask8 = valid[:, None]
            vmask16 = gl.convert_layout(valid, ROWS16)[:, None]
            cols8 = gl.arange(0, 64, layout=gl.SliceLayout(0, G8))
            raw = kn.reinterpret(gl.uint8, [16, _BN, 64], _RAW2)
            if KV_FORMAT == 1:
                # fp8_656 record: 512 e4m3 bytes, 4 float32 scales, 64 bf16 values (656 bytes per token).
                # Staging: raw chunk c at index 8 + c. One copy per chunk here: the 3-D form below
                # measured no faster for this format ("Fewer partition barriers").
                rbase = page * c_sp + row * 656
                ptrs = c_ptr + rbase[:, None] + cols8[None, :]
                for c in gl.static_range(8):
                    async_load(raw.index(8 + c), ptrs + 64 * c, mask=vmask8)
                rope_base = gl.convert_layout(rbase + 528, ROWS16)
                rope_ptrs = (c_ptr + rope_base[:, None]).to(gl.pointer_type(gl.bfloat16), bitcast=True) + cols16[None, :]
                async_load(krope.index(stage), rope_ptrs, mask=vmask16)
                sc_ptr = (c_ptr + rbase + 512).to(gl.pointer_type(gl.float32), bitcast=True)
                for g in gl.static_range(4):
                    async_load(scales.index(stage * 4 + g), sc_ptr + g, mask=valid)
            else:
                # fp8_584 page: data rows of 576 bytes (448 e4m3, 64 bf16), then 8-byte rows of UE8M0
                # exponents.
                rbase = page * c_sp + row * 576
                rb3 = gl.convert_layout(rbase, _R3)
                v3 = gl.convert_layout(valid, _R3)
                raw3 = kn.reinterpret(gl.uint8, [16, _BN, 64], _RAW3)
                tail_base = gl.convert_layout(rbase + 448, ROWS16)
                tail_ptrs = (c_ptr + tail_base[:, None]).to(gl.pointer_type(gl.bfloat16), bitcast=True) + cols16[None, :]
                async_load(kn.slice(448, 64, dim=1), tail_ptrs, mask=vmask16)
                # staging: raw chunk c at index 4 + c, copied as 4 + 2 + 1 chunks (a slice of n chunks
                # starts at a multiple of n)
                async_load(raw3.slice(4, 4, dim=0), c_ptr + _chunk_offsets3(rb3, 0, 4), mask=v3[None, :, None])
                async_load(raw3.slice(8, 2, dim=0), c_ptr + _chunk_offsets3(rb3, 4, 2), mask=v3[None, :, None])
                async_load(raw.index(10), c_ptr + (rbase + 384)[:, None] + cols8[None, :], mask=vmask8)
                # a key's 7 exponents, stored as float32 rows [stage * 8 + chunk] (row 7: 1.0, unused)
                sbase = gl.convert_layout(page * c_sp + c_ps * 576 + row * 8, _R3)
                chunk = gl.arange(0, 8, layout=_C3)
                e = gl.load(c_ptr + sbase[None, :] + chunk[:, None], mask=v3[None, :] & (chunk < 7)[:, None],
                            other=127).to(gl.int32)
                scales.reinterpret(gl.float32, [2, 8, _BN], _SC3).index(stage).store(
                    _ue8m0_to_bf16(e).to(gl.float32))
        async_copy.commit_group()

    @gluon.jit
    def _chunk_offsets3(rb3, first: gl.constexpr, count: gl.constexpr):
        """Byte offsets ``[count, 64 keys, 64]`` of 64-byte chunks ``first ..`` of the keys' rows at ``rb3``."""
        chunk = first + gl.arange(0, count, layout=_C3)
        byte = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, _G3)))
        return rb3[None, :, None] + (64 * chunk)[:, None, None] + byte[None, None, :]

    @gluon.jit
    def _to_bf16_scaled(raw, sc):
        """e4m3 bytes ``[n, keys, 64]`` to bf16, times the keys' per-chunk scales ``sc`` (``[n, keys]``
        shared float32, powers of two: exact)."""
        v = _e4m3_to_bf16(raw)
        s = sc.load(gl.SliceLayout(2, _G3)).to(gl.bfloat16)
        v, s3 = gl.broadcast(v, s[:, :, None])
        return _mul_bf16(v, s3)

    @gluon.jit
    def _convert_block(stage, knope, scales, KV_FORMAT: gl.constexpr):
        """Expand the staged e4m3 bytes of a stage into its bf16 tile, in place. The raw chunks occupy
        the tile's upper bytes; chunks are read into registers before any store that overlaps them,
        with a partition barrier in between (other threads may still be reading). fp8_584 writes the
        tile as ``[chunk, key, 64]`` (its 128-byte-swizzled layout holds each 64-column chunk as one
        contiguous 8 KB block), so that a group of chunks is one store (see :func:`_issue_block`)."""
        G8: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        kn = knope.index(stage)
        if KV_FORMAT == 1:
            # raw chunk c at bytes [32K + 4K c, +4K); bf16 chunk c at [8K c, +8K).
            raw = kn.reinterpret(gl.uint8, [16, _BN, 64], _RAW2)
            r0 = raw.index(8).load(G8)
            r1 = raw.index(9).load(G8)
            r2 = raw.index(10).load(G8)
            r3 = raw.index(11).load(G8)
            kn.slice(0, 64, dim=1).store(_e4m3_to_bf16(r0))
            kn.slice(64, 64, dim=1).store(_e4m3_to_bf16(r1))
            kn.slice(128, 64, dim=1).store(_e4m3_to_bf16(r2))
            kn.slice(192, 64, dim=1).store(_e4m3_to_bf16(r3))
            r4 = raw.index(12).load(G8)
            r5 = raw.index(13).load(G8)
            r6 = raw.index(14).load(G8)
            r7 = raw.index(15).load(G8)
            _cta_barrier()
            kn.slice(256, 64, dim=1).store(_e4m3_to_bf16(r4))
            kn.slice(320, 64, dim=1).store(_e4m3_to_bf16(r5))
            kn.slice(384, 64, dim=1).store(_e4m3_to_bf16(r6))
            kn.slice(448, 64, dim=1).store(_e4m3_to_bf16(r7))
        else:
            # fp8_584: raw chunk c at bytes [16K + 4K c, +4K), c < 7; bf16 chunk c at [8K c, +8K) (chunks 2
            # and 3 overlap raw chunks 0-3, chunks 4-6 raw chunks 4-6).
            raw3 = kn.reinterpret(gl.uint8, [16, _BN, 64], _RAW3)
            kn3 = kn.reinterpret(gl.bfloat16, [8, _BN, 64], _KL3)
            sc = scales.reinterpret(gl.float32, [2, 8, _BN], _SC3).index(stage)
            lo = raw3.slice(4, 4, dim=0).load(_G3)
            _cta_barrier()
            kn3.slice(0, 4, dim=0).store(_to_bf16_scaled(lo, sc.slice(0, 4, dim=0)))
            r45 = raw3.slice(8, 2, dim=0).load(_G3)
            last = kn.reinterpret(gl.uint8, [16, _BN, 64], _RAW2).index(10).load(G8)
            _cta_barrier()
            kn3.slice(4, 2, dim=0).store(_to_bf16_scaled(r45, sc.slice(4, 2, dim=0)))
            s6 = scales.index(stage * 8 + 6).load(gl.SliceLayout(1, G8)).to(gl.bfloat16)
            v, s6 = gl.broadcast(_e4m3_to_bf16(last), s6[:, None])
            kn.slice(384, 64, dim=1).store(_mul_bf16(v, s6))

    @gluon.jit
    def _producer(
        cache_ptr, stride_cp, stride_cr, page_size, num_slots,
        idx_ptr, stride_it, stride_ik,
        xcache_ptr, stride_xp, stride_xr, x_page_size, x_num_slots,
        xidx_ptr, stride_xt, stride_xk,
        len_ptr, stride_len, topk, xlen_ptr, stride_xlen, x_topk,
        num_head_blocks, num_splits,
        knope, krope, scales, valid_smem, ready, empty,
        KV_FORMAT: gl.constexpr, D: gl.constexpr, HAS_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr,
        HAS_XLEN: gl.constexpr, SPLIT: gl.constexpr,
    ):
        """Pipelined: block i + 1's copies (and block i + 2's slot ids) are in flight while the consumers
        work on block i; block i is converted and handed over as soon as its bytes have landed."""
        t, hb, blk_lo, blk_hi, nb_main, n_main, n_extra = _block_range(
            gl.program_id(0), num_head_blocks, num_splits, len_ptr, stride_len, topk, xlen_ptr, stride_xlen, x_topk,
            HAS_LEN, HAS_EXTRA, HAS_XLEN, SPLIT)
        n = blk_hi - blk_lo
        slots = _block_slots(blk_lo, t, nb_main, n_main, n_extra,
                             cache_ptr, stride_cp, stride_cr, page_size, num_slots, idx_ptr, stride_it, stride_ik,
                             xcache_ptr, stride_xp, stride_xr, x_page_size, x_num_slots, xidx_ptr, stride_xt,
                             stride_xk, HAS_EXTRA, KV_FORMAT)
        if n > 0:
            _issue_block(blk_lo, 0, slots, t, nb_main, n_main, n_extra,
                         cache_ptr, stride_cp, stride_cr, page_size, num_slots, idx_ptr, stride_it, stride_ik,
                         xcache_ptr, stride_xp, stride_xr, x_page_size, x_num_slots, xidx_ptr, stride_xt,
                         stride_xk, knope, krope, scales, valid_smem, KV_FORMAT, D, HAS_EXTRA)
        slots = _block_slots(blk_lo + 1, t, nb_main, n_main, n_extra,
                             cache_ptr, stride_cp, stride_cr, page_size, num_slots, idx_ptr, stride_it, stride_ik,
                             xcache_ptr, stride_xp, stride_xr, x_page_size, x_num_slots, xidx_ptr, stride_xt,
                             stride_xk, HAS_EXTRA, KV_FORMAT)
        for i in range(0, n):
            stage = i % 2
            async_copy.wait_group(0)  # block i has landed
            _cta_barrier()  # every thread's copies (and scale stores) are visible to the partition
            if KV_FORMAT != 0:
                _convert_block(stage, knope, scales, KV_FORMAT)
            fence_async_shared()
            mbarrier.arrive(ready.index(stage))
            if i + 1 < n:
                nxt = (i + 1) % 2
                mbarrier.wait(empty.index(nxt), (((i + 1) // 2) & 1) ^ 1)  # the consumers are done with i - 1
                _issue_block(blk_lo + i + 1, nxt, slots, t, nb_main, n_main, n_extra,
                             cache_ptr, stride_cp, stride_cr, page_size, num_slots, idx_ptr, stride_it, stride_ik,
                             xcache_ptr, stride_xp, stride_xr, x_page_size, x_num_slots, xidx_ptr, stride_xt,
                             stride_xk, knope, krope, scales, valid_smem, KV_FORMAT, D, HAS_EXTRA)
                slots = _block_slots(blk_lo + i + 2, t, nb_main, n_main, n_extra,
                                     cache_ptr, stride_cp, stride_cr, page_size, num_slots, idx_ptr, stride_it,
                                     stride_ik, xcache_ptr, stride_xp, stride_xr, x_page_size, x_num_slots, xidx_ptr,
                                     stride_xt, stride_xk, HAS_EXTRA, KV_FORMAT)

    @gluon.jit
    def _ue8m0_to_bf16(e):
        """bf16 ``2^(e - 127)`` of exponent bytes ``e`` (int32): the exponent field itself; byte 0 is the
        subnormal ``2^-127``."""
        bits = gl.where(e > 0, e << 7, 0x40)
        return bits.to(gl.int16).to(gl.bfloat16, bitcast=True)

    # -------------------------------------------------------------------------------------------------
    # consumers
    # -------------------------------------------------------------------------------------------------

    @gluon.jit
    def _attend(qn, qr, kn, kr, scales, valid_smem, stage, o0, o1, m_i, l_i, qk_scale, score_sign,
                p_smem, stat_smem, p_ready, p_free, i,
                K0: gl.constexpr, NK: gl.constexpr, FOLD: gl.constexpr, D: gl.constexpr):
        """First consumer: online softmax over keys ``[K0, K0 + NK)`` of a ring stage, ``(o0, o1, m_i,
        l_i)`` of dims 0..255 updated; ``P`` and the rescale factor of block ``i`` handed to the second
        consumer."""
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NK, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, 128, 16])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        COLS: gl.constexpr = gl.SliceLayout(0, S_L)
        keys = kn.slice(K0, NK, dim=0)  # [NK keys, 512]
        zero_s = gl.zeros([_BH, NK], gl.float32, layout=S_L)  # ignored (use_acc=False): gives the layout
        if FOLD:
            # S = sum_g s_g * (Q_g K_g^T) + Q_rope K_rope^T on the raw e4m3 values; the scales act in float32.
            acc = warpgroup_mma(qn.slice(0, 64, dim=1), keys.slice(0, 64, dim=1).permute((1, 0)), zero_s,
                                use_acc=False, is_async=True)
            acc = warpgroup_mma(qn.slice(64, 64, dim=1), keys.slice(64, 64, dim=1).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            s = acc * scales.index(stage * 4).slice(K0, NK).load(COLS)[None, :]
            for g in gl.static_range(1, 4):
                acc = warpgroup_mma(qn.slice(128 * g, 64, dim=1), keys.slice(128 * g, 64, dim=1).permute((1, 0)),
                                    acc, use_acc=False, is_async=True)
                acc = warpgroup_mma(qn.slice(128 * g + 64, 64, dim=1),
                                    keys.slice(128 * g + 64, 64, dim=1).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                s = s + acc * scales.index(stage * 4 + g).slice(K0, NK).load(COLS)[None, :]
            s = warpgroup_mma(qr, kr.slice(K0, NK, dim=0).permute((1, 0)), s, is_async=True)
        else:
            if D == 576:
                s = warpgroup_mma(qr, kr.slice(K0, NK, dim=0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                for c in gl.static_range(8):
                    s = warpgroup_mma(qn.slice(64 * c, 64, dim=1), keys.slice(64 * c, 64, dim=1).permute((1, 0)), s,
                                      is_async=True)
            else:
                s = warpgroup_mma(qn.slice(0, 64, dim=1), keys.slice(0, 64, dim=1).permute((1, 0)), zero_s,
                                  use_acc=False, is_async=True)
                for c in gl.static_range(1, 8):
                    s = warpgroup_mma(qn.slice(64 * c, 64, dim=1), keys.slice(64 * c, 64, dim=1).permute((1, 0)), s,
                                      is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        valid = valid_smem.index(stage).slice(K0, NK).load(COLS) != 0
        m_new, alpha, p = _online_softmax(s, valid, m_i, qk_scale, score_sign, 1)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        # Hand-off: wait until the second consumer is done with the previous block's P, store this one
        # (fp16 when it is scaled per group again there, bf16 when it is the MMA operand as it is) and
        # the rescale factors, and arrive once every thread's part is stored (the arrive is one thread's).
        mbarrier.wait(p_free, (i & 1) ^ 1)
        p_smem.store(p.to(p_smem.dtype))
        stat_smem.index(0).store(alpha)
        if not FOLD:
            # P is the second consumer's wgmma operand (the async proxy). fp8_656's P is read back with
            # plain loads, so it needs no proxy fence (a full memory barrier per block on this path).
            fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(p_ready)
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        o0 = o0 * alpha_o
        o1 = o1 * alpha_o
        if FOLD:
            o0, o1 = _pv_scaled(p, scales, stage * 4, keys, o0, o1, 0, COLS, P_L)
        else:
            p0 = gl.convert_layout(p.to(gl.bfloat16), P_L)
            o0 = warpgroup_mma(p0, keys.slice(0, 128, dim=1), o0, is_async=True)
            o1 = warpgroup_mma(p0, keys.slice(128, 128, dim=1), o1, is_async=True)
        o0, o1 = warpgroup_mma_wait(0, deps=(o0, o1))
        return o0, o1, m_new, l_i

    @gluon.jit
    def _online_softmax(s, valid, m_i, qk_scale, score_sign, AXIS: gl.constexpr):
        """One block of the overflow-safe online softmax of docs/sparse_mla.md, on the products ``s`` of
        keys and a query staged with the sign of the scale (:func:`_load_q`), the keys along axis
        ``AXIS`` and ``valid`` their validity: ``u = sign * <q, k>`` (``s`` itself but for a zero sign)
        saturated to finite float32 (NaN from products overflowing both ways counts as -FLT_MAX;
        invalid keys -inf), the running maximum ``m`` over the keys and the weights
        ``exp2(a * (u - m))``. Returns ``(m_new, alpha, p)``, ``alpha`` the rescale factor of what came
        before."""
        u = s
        if score_sign == 0.0:
            u = s * 0.0  # NaN from an overflowed product stays NaN (-> -FLT_MAX below)
        # maximum ignores NaN (maxnum), so NaN -> -FLT_MAX; an invalid key's upper bound -inf wins
        hi = gl.where(valid, _FLT_MAX, float("-inf"))
        if AXIS == 1:
            u = gl.minimum(gl.maximum(u, -_FLT_MAX), hi[None, :])
        else:
            u = gl.minimum(gl.maximum(u, -_FLT_MAX), hi[:, None])
        m_new = gl.maximum(m_i, gl.max(u, axis=AXIS))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no candidate yet: keep exp2 finite
        alpha = gl.exp2((m_i - m_use) * qk_scale)
        if AXIS == 1:
            p = gl.exp2((u - m_use[:, None]) * qk_scale)
        else:
            p = gl.exp2((u - m_use[None, :]) * qk_scale)
        return m_new, alpha, p

    @gluon.jit
    def _pv_scaled(p, scales, group, keys, o0, o1, DIM0: gl.constexpr, COLS: gl.constexpr, P_L: gl.constexpr):
        """fp8_656: ``(o0, o1)``, output dims ``[DIM0, DIM0 + 256)``, plus ``P V`` over one stage. V of
        scale group ``g`` is its raw values, so P takes the group's per-key scale (rows ``group`` and
        ``group + 1`` of the scale table) before its one bf16 rounding."""
        pa = gl.convert_layout((p * scales.index(group).load(COLS)[None, :]).to(gl.bfloat16), P_L)
        o0 = warpgroup_mma(pa, keys.slice(DIM0, 128, dim=1), o0, is_async=True)
        pb = gl.convert_layout((p * scales.index(group + 1).load(COLS)[None, :]).to(gl.bfloat16), P_L)
        o1 = warpgroup_mma(pb, keys.slice(DIM0 + 128, 128, dim=1), o1, is_async=True)
        return o0, o1

    @gluon.jit
    def _consumer(
        q_ptr, stride_qt, stride_qh, stride_qd,
        qn, qr, knope, krope, scales, valid_smem, ready, empty, p_smem, stat_smem, p_ready, p_free,
        len_ptr, stride_len, topk, xlen_ptr, stride_xlen, x_topk,
        sink_ptr, stride_sink,
        out_ptr, stride_ot, stride_oh, stride_od,
        lse_ptr, stride_lt, stride_lh,
        ws_ptr, ws_ml_off,
        num_heads, num_head_blocks, num_splits, qk_scale, score_sign, lse_scale,
        FOLD: gl.constexpr, D: gl.constexpr, HAS_LEN: gl.constexpr,
        HAS_EXTRA: gl.constexpr, HAS_XLEN: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
    ):
        """First consumer: stages Q, then ``Q K^T``, the softmax, the hand-off of P, and output dims
        0..255 (and lse). Q is its own operand only, so it is loaded here, while the producer already
        fetches the first block's slot ids and rows."""
        pid = gl.program_id(0)
        t, hb, blk_lo, blk_hi, nb_main, n_main, n_extra = _block_range(
            pid, num_head_blocks, num_splits, len_ptr, stride_len, topk, xlen_ptr, stride_xlen, x_topk,
            HAS_LEN, HAS_EXTRA, HAS_XLEN, SPLIT)
        _load_q(q_ptr, stride_qt, stride_qh, stride_qd, qn, qr, t, hb, num_heads, score_sign, _BH, D)
        _cta_barrier()  # every warp's part of Q is stored (and fenced) before any warp's first MMA
        # One softmax step per ring stage. (fp8_656's scale folding keeps one more [64, 64] float32 tile
        # live and spills a little; steps of 32 keys avoid that but measured 10-20% slower on an H200.)
        # It must stay one step per stage: the P hand-off's barrier parities count blocks.
        NK: gl.constexpr = _BN
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, 128, 16])
        ROWS: gl.constexpr = gl.SliceLayout(1, gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                          instr_shape=[16, NK, 16]))
        o0 = gl.zeros([_BH, 128], gl.float32, layout=O_L)  # dims [0, 128)
        o1 = gl.zeros([_BH, 128], gl.float32, layout=O_L)  # dims [128, 256)
        m_i = gl.full([_BH], float("-inf"), gl.float32, layout=ROWS)
        l_i = gl.zeros([_BH], gl.float32, layout=ROWS)
        for blk in range(blk_lo, blk_hi):
            i = blk - blk_lo
            stage = i % 2
            mbarrier.wait(ready.index(stage), (i // 2) & 1)
            kn = knope.index(stage)
            kr = krope.index(stage)
            for k0 in gl.static_range(0, _BN, NK):
                o0, o1, m_i, l_i = _attend(qn, qr, kn, kr, scales, valid_smem, stage, o0, o1, m_i, l_i, qk_scale,
                                           score_sign, p_smem, stat_smem, p_ready, p_free, i, k0, NK, FOLD, D)
            mbarrier.arrive(empty.index(stage))
        # The final statistics, for the second consumer's epilogue (one more hand-off).
        mbarrier.wait(p_free, ((blk_hi - blk_lo) & 1) ^ 1)
        stat_smem.index(0).store(m_i)
        stat_smem.index(1).store(l_i)
        _cta_barrier()
        mbarrier.arrive(p_ready)
        _epilogue(o0, o1,
                  gl.convert_layout(m_i, gl.SliceLayout(1, O_L)), gl.convert_layout(l_i, gl.SliceLayout(1, O_L)),
                  pid, t, hb, sink_ptr, stride_sink, out_ptr, stride_ot, stride_oh, stride_od, lse_ptr, stride_lt,
                  stride_lh, ws_ptr, ws_ml_off, num_heads, num_head_blocks, num_splits, lse_scale, 0, HAS_SINK, SPLIT)

    @gluon.jit
    def _consumer_pv(
        knope, scales, ready, empty, p_smem, stat_smem, p_ready, p_free,
        len_ptr, stride_len, topk, xlen_ptr, stride_xlen, x_topk,
        sink_ptr, stride_sink,
        out_ptr, stride_ot, stride_oh, stride_od,
        lse_ptr, stride_lt, stride_lh,
        ws_ptr, ws_ml_off,
        num_heads, num_head_blocks, num_splits, lse_scale,
        FOLD: gl.constexpr, HAS_LEN: gl.constexpr,
        HAS_EXTRA: gl.constexpr, HAS_XLEN: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
    ):
        """Second consumer: no ``Q K^T`` of its own. Per block it takes the first consumer's P and rescale
        factor, rescales its half of O and adds ``P V`` for output dims 256..511."""
        pid = gl.program_id(0)
        t, hb, blk_lo, blk_hi, nb_main, n_main, n_extra = _block_range(
            pid, num_head_blocks, num_splits, len_ptr, stride_len, topk, xlen_ptr, stride_xlen, x_topk,
            HAS_LEN, HAS_EXTRA, HAS_XLEN, SPLIT)
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _BN, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, 128, 16])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        COLS: gl.constexpr = gl.SliceLayout(0, S_L)
        ROWS_O: gl.constexpr = gl.SliceLayout(1, O_L)
        o0 = gl.zeros([_BH, 128], gl.float32, layout=O_L)  # dims [256, 384)
        o1 = gl.zeros([_BH, 128], gl.float32, layout=O_L)  # dims [384, 512)
        for blk in range(blk_lo, blk_hi):
            i = blk - blk_lo
            stage = i % 2
            mbarrier.wait(ready.index(stage), (i // 2) & 1)
            mbarrier.wait(p_ready, i & 1)
            alpha = stat_smem.index(0).load(ROWS_O)[:, None]
            o0 = o0 * alpha
            o1 = o1 * alpha
            kn = knope.index(stage)
            if FOLD:
                o0, o1 = _pv_scaled(p_smem.load(S_L).to(gl.float32), scales, stage * 4 + 2, kn, o0, o1, 256, COLS, P_L)
            else:
                o0 = warpgroup_mma(p_smem, kn.slice(256, 128, dim=1), o0, is_async=True)
                o1 = warpgroup_mma(p_smem, kn.slice(384, 128, dim=1), o1, is_async=True)
            o0, o1 = warpgroup_mma_wait(0, deps=(o0, o1))
            _cta_barrier()  # every warp has read P and alpha before the (one-thread) arrive frees them
            mbarrier.arrive(p_free)
            mbarrier.arrive(empty.index(stage))
        mbarrier.wait(p_ready, (blk_hi - blk_lo) & 1)
        m_o = stat_smem.index(0).load(ROWS_O)
        l_o = stat_smem.index(1).load(ROWS_O)
        _epilogue(o0, o1, m_o, l_o, pid, t, hb, sink_ptr, stride_sink, out_ptr, stride_ot, stride_oh, stride_od,
                  lse_ptr, stride_lt, stride_lh, ws_ptr, ws_ml_off, num_heads, num_head_blocks, num_splits, lse_scale,
                  1, HAS_SINK, SPLIT)

    @gluon.jit
    def _ws_rows(pid, t, heads, num_heads, num_head_blocks, num_splits):
        """The split workspace's rows ``[T, S, H]`` of this CTA's ``heads`` (int64)."""
        split = (pid // num_head_blocks) % num_splits
        return (t * num_splits + split) * num_heads + heads.to(gl.int64)

    @gluon.jit
    def _final_scale(m_o, l_o, heads, head_ok, sink_ptr, stride_sink, lse_scale, HAS_SINK: gl.constexpr):
        """``(lse, factor)`` of the final softmax state: the finite-clamped log-sum-exp (``inf`` for a row
        with no candidate) and the factor that normalises ``O`` (0 for such a row; the sink joins the
        denominator)."""
        has = l_o > 0  # l >= 1 once a candidate was seen (its own weight is exp2(0))
        lse = gl.where(has, m_o, 0.0) * lse_scale + gl.log2(gl.where(has, l_o, 1.0)) * _LN2  # no NaN from -inf * 0
        lse = gl.where(has, gl.minimum(gl.maximum(lse, -_FLT_MAX), _FLT_MAX), float("inf"))
        factor = gl.where(has, 1.0 / gl.where(has, l_o, 1.0), 0.0)
        if HAS_SINK:
            sink = gl.load(sink_ptr + heads.to(gl.int64) * stride_sink, mask=head_ok, other=float("-inf"))
            factor = gl.where(has, factor / (1.0 + gl.exp(sink - gl.where(has, lse, 0.0))), 0.0)
        return lse, factor

    @gluon.jit
    def _epilogue(o0, o1, m_o, l_o, pid, t, hb, sink_ptr, stride_sink, out_ptr, stride_ot, stride_oh, stride_od,
                  lse_ptr, stride_lt, stride_lh, ws_ptr, ws_ml_off, num_heads, num_head_blocks, num_splits, lse_scale,
                  WG: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr):
        """Consumer ``WG``'s half of ``out`` (or of the split workspace); the first also writes ``lse``
        (or ``m``, ``l``). ``m_o``, ``l_o``: the running max and sum of the rows."""
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, 128, 16])
        heads = hb * _BH + gl.arange(0, _BH, layout=gl.SliceLayout(1, O_L))
        head_ok = heads < num_heads
        cols = gl.arange(0, 128, layout=gl.SliceLayout(0, O_L))
        if SPLIT:
            row = _ws_rows(pid, t, heads, num_heads, num_head_blocks, num_splits)
            acc_rows = ws_ptr + row[:, None] * 512 + 256 * WG + cols[None, :]
            gl.store(acc_rows, o0, mask=head_ok[:, None])
            gl.store(acc_rows + 128, o1, mask=head_ok[:, None])
            if WG == 0:
                gl.store(ws_ptr + ws_ml_off + row * 2, m_o, mask=head_ok)
                gl.store(ws_ptr + ws_ml_off + row * 2 + 1, l_o, mask=head_ok)
            _launch_dependents()  # the split combine may be scheduled once every CTA is here
        else:
            lse, factor = _final_scale(m_o, l_o, heads, head_ok, sink_ptr, stride_sink, lse_scale, HAS_SINK)
            out_rows = (out_ptr + t * stride_ot + heads.to(gl.int64)[:, None] * stride_oh
                        + (256 * WG + cols[None, :]).to(gl.int64) * stride_od)
            gl.store(out_rows, (o0 * factor[:, None]).to(gl.bfloat16), mask=head_ok[:, None])
            gl.store(out_rows + 128 * gl.cast(stride_od, gl.int64), (o1 * factor[:, None]).to(gl.bfloat16),
                     mask=head_ok[:, None])
            if WG == 0:
                gl.store(lse_ptr + t * stride_lt + heads.to(gl.int64) * stride_lh, lse, mask=head_ok)

    @gluon.jit
    def _load_q(q_ptr, stride_qt, stride_qh, stride_qd, qn, qr, t, hb, num_heads, score_sign, HB: gl.constexpr,
                D: gl.constexpr):
        """Stage this CTA's ``HB`` query rows (zeros past ``num_heads``) in shared memory, once. The loads
        go out in two batches of four (and the rope) 64-column chunks, so their latencies overlap.
        Negated when ``score_sign`` is negative (exact), so the products need no sign."""
        if HB == _BH:
            G16: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [gl.num_warps(), 1], [1, 0])
        else:  # 16 or 32 rows (the few-heads kernel)
            G16: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        heads = hb * HB + gl.arange(0, HB, layout=gl.SliceLayout(1, G16))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, G16))
        # int64 offsets: a permuted q's strides can make col * stride pass 2^31 (docs/operators.md)
        col_offs = cols.to(gl.int64)[None, :] * stride_qd
        chunk = 64 * gl.cast(stride_qd, gl.int64)
        rows = q_ptr + t * stride_qt + heads.to(gl.int64)[:, None] * stride_qh + col_offs
        ok = (heads < num_heads)[:, None]
        neg = score_sign < 0.0
        for half in gl.static_range(2):
            c0 = rows + (4 * half) * chunk
            x0 = gl.load(c0, mask=ok, other=0.0)
            x1 = gl.load(c0 + chunk, mask=ok, other=0.0)
            x2 = gl.load(c0 + 2 * chunk, mask=ok, other=0.0)
            x3 = gl.load(c0 + 3 * chunk, mask=ok, other=0.0)
            if half == 1 and D == 576:
                xr = gl.load(rows + 8 * chunk, mask=ok, other=0.0)
                qr.store(gl.where(neg, -xr, xr))
            qn.slice(256 * half, 64, dim=1).store(gl.where(neg, -x0, x0))
            qn.slice(256 * half + 64, 64, dim=1).store(gl.where(neg, -x1, x1))
            qn.slice(256 * half + 128, 64, dim=1).store(gl.where(neg, -x2, x2))
            qn.slice(256 * half + 192, 64, dim=1).store(gl.where(neg, -x3, x3))
        fence_async_shared()

    # The list widths are never specialised: Triton turns an integer argument equal to 1 into a
    # constant, and with ``topk == 1`` its alignment analysis gives the row copies a 2-byte width that
    # cp.async cannot do (the compile fails; found on the H200 with one-entry lists).
    @gluon.jit(do_not_specialize=("topk", "x_topk"))
    def _sparse_mla_decode_hopper_kernel(
        q_ptr, stride_qt, stride_qh, stride_qd,  # [T, H, D] bf16
        cache_ptr, stride_cp, stride_cr, page_size, num_slots,  # main cache (bytes for fp8, elements for auto)
        idx_ptr, stride_it, stride_ik, topk,  # int32 [T, K]
        len_ptr, stride_len,  # int32 [T] (HAS_LEN)
        xcache_ptr, stride_xp, stride_xr, x_page_size, x_num_slots,  # extra cache (HAS_EXTRA)
        xidx_ptr, stride_xt, stride_xk, x_topk,  # int32 [T, K2] (HAS_EXTRA)
        xlen_ptr, stride_xlen,  # int32 [T] (HAS_XLEN)
        sink_ptr, stride_sink,  # float32 [H] (HAS_SINK)
        out_ptr, stride_ot, stride_oh, stride_od,  # [T, H, 512] bf16 (not SPLIT)
        lse_ptr, stride_lt, stride_lh,  # float32 [T, H] (not SPLIT)
        ws_ptr, ws_ml_off,  # SPLIT: float32 acc [T, S, H, 512], then (m, l) [T, S, H, 2] at ws_ml_off
        num_heads, num_head_blocks, num_splits,
        qk_scale, score_sign, lse_scale,  # softmax_factors(softmax_scale) of ops/sparse_mla.py
        KV_FORMAT: gl.constexpr, D: gl.constexpr, FOLD: gl.constexpr, HAS_LEN: gl.constexpr,
        HAS_EXTRA: gl.constexpr, HAS_XLEN: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
        WORKER_REGS: gl.constexpr,
    ):
        SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        VL1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        # Shared memory (232,448 bytes per block on sm_90; fp8_656 uses all but ~100 of them): Q, the
        # two-stage ring of K tiles, per-key scales and validity, and the hand-off of P. The rope parts
        # exist only for D = 576 (a stand-in of 8 rows otherwise).
        R_ROWS: gl.constexpr = _BH if D == 576 else 8
        qn = gl.allocate_shared_memory(gl.bfloat16, [_BH, 512], SL)
        qr = gl.allocate_shared_memory(gl.bfloat16, [R_ROWS, 64], SL)
        knope = gl.allocate_shared_memory(gl.bfloat16, [2, _BN, 512], SL)
        krope = gl.allocate_shared_memory(gl.bfloat16, [2, R_ROWS, 64], SL)
        # fp8_656: [stage * 4 + group][key] scales; fp8_584: [stage * 8 + group][key] scales (as float32)
        scales = gl.allocate_shared_memory(gl.float32, [16 if KV_FORMAT == 2 else 8, _BN], VL1)
        valid_smem = gl.allocate_shared_memory(gl.int8, [2, _BN], VL1)
        p_smem = gl.allocate_shared_memory(gl.float16 if FOLD else gl.bfloat16, [_BH, _BN], SL)
        stat_smem = gl.allocate_shared_memory(gl.float32, [2, _BH], VL1)  # alpha of a block; final (m, l)
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(ready.index(s), count=1)  # the producer partition
            mbarrier.init(empty.index(s), count=2)  # the two consumer partitions
        mbarrier.init(p_ready, count=1)  # the first consumer: P (or the final statistics) stored
        mbarrier.init(p_free, count=1)  # the second consumer: done with P
        fence_async_shared()
        gl.warp_specialize(
            [(_consumer, (q_ptr, stride_qt, stride_qh, stride_qd,
                          qn, qr, knope, krope, scales, valid_smem, ready, empty, p_smem, stat_smem, p_ready, p_free,
                          len_ptr, stride_len, topk, xlen_ptr, stride_xlen, x_topk,
                          sink_ptr, stride_sink, out_ptr, stride_ot, stride_oh, stride_od, lse_ptr, stride_lt,
                          stride_lh,
                          ws_ptr, ws_ml_off, num_heads, num_head_blocks, num_splits, qk_scale, score_sign, lse_scale,
                          FOLD, D, HAS_LEN, HAS_EXTRA, HAS_XLEN, HAS_SINK, SPLIT)),
             (_consumer_pv, (knope, scales, ready, empty, p_smem, stat_smem, p_ready, p_free,
                             len_ptr, stride_len, topk, xlen_ptr, stride_xlen, x_topk,
                             sink_ptr, stride_sink, out_ptr, stride_ot, stride_oh, stride_od, lse_ptr, stride_lt,
                             stride_lh,
                             ws_ptr, ws_ml_off, num_heads, num_head_blocks, num_splits, lse_scale,
                             FOLD, HAS_LEN, HAS_EXTRA, HAS_XLEN, HAS_SINK, SPLIT)),
             (_producer, (cache_ptr, stride_cp, stride_cr, page_size, num_slots, idx_ptr, stride_it, stride_ik,
                          xcache_ptr, stride_xp, stride_xr, x_page_size, x_num_slots, xidx_ptr, stride_xt, stride_xk,
                          len_ptr, stride_len, topk, xlen_ptr, stride_xlen, x_topk, num_head_blocks, num_splits,
                          knope, krope, scales, valid_smem, ready, empty,
                          KV_FORMAT, D, HAS_LEN, HAS_EXTRA, HAS_XLEN, SPLIT))],
            [4, 4],
            WORKER_REGS,
        )


    # -------------------------------------------------------------------------------------------------
    # few heads (H <= 32): the transposed products, one consumer
    # -------------------------------------------------------------------------------------------------
    # A 64-row wgmma wastes three quarters of its work on 16 heads. With the products transposed the
    # keys are the M side and the heads the N side (16 or 32): ``S^T = K Q^T`` ([64 keys, HB]) and
    # ``O^T += V^T P^T`` ([512 dims, HB], four accumulators of 128 dims), so one warpgroup does the
    # whole block with a quarter (HB = 16) of the MMA work and no P hand-off. The producer and the ring
    # are those of the 64-head kernel.

    @gluon.jit
    def _scale_vec(sc, HB: gl.constexpr, SC_SMEM: gl.constexpr):
        """The keys' scales of one group, float32 ``[64]``: ``sc`` itself, or loaded from the shared
        memory row ``sc`` (``SC_SMEM``; loaded where used, so they take no registers across the MMAs)."""
        if SC_SMEM:
            S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, HB, 16])
            return sc.load(gl.SliceLayout(1, S_L))
        else:
            return sc

    @gluon.jit
    def _group_t(kn, qn, g: gl.constexpr, like):
        """Scale group ``g``'s ``K_g Q_g^T`` (128 dims) into a fresh accumulator (``like`` only gives its
        layout): two async MMA commit groups."""
        acc = warpgroup_mma(kn.slice(128 * g, 64, dim=1), qn.slice(128 * g, 64, dim=1).permute((1, 0)), like,
                            use_acc=False, is_async=True)
        return warpgroup_mma(kn.slice(128 * g + 64, 64, dim=1), qn.slice(128 * g + 64, 64, dim=1).permute((1, 0)),
                             acc, is_async=True)

    @gluon.jit
    def _scores_t(qn, qr, kn, kr, sc0, sc1, sc2, sc3, HB: gl.constexpr, FOLD: gl.constexpr, D: gl.constexpr,
                  SC_SMEM: gl.constexpr, TWO_ACC: gl.constexpr):
        """``S^T = K Q^T`` of one K tile, float32 ``[64 keys, HB]``; fp8_656 (``FOLD``) scales scale group
        ``g``'s partial product by the keys' scales ``sc<g>`` (see :func:`_scale_vec`) in float32, as the
        64-head kernel does."""
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HB, 16])
        zero_s = gl.zeros([_BN, HB], gl.float32, layout=S_L)  # ignored (use_acc=False): gives the layout
        if FOLD and TWO_ACC:
            # two accumulators in turn: the tensor cores run group g + 1 while group g is scaled (each
            # group is two MMA commit groups; waiting for all but the newest two completes the older)
            a0 = _group_t(kn, qn, 0, zero_s)
            a1 = _group_t(kn, qn, 1, zero_s)
            a0 = warpgroup_mma_wait(2, deps=(a0,))
            s = a0 * _scale_vec(sc0, HB, SC_SMEM)[:, None]
            a0 = _group_t(kn, qn, 2, zero_s)
            a1 = warpgroup_mma_wait(2, deps=(a1,))
            s = s + a1 * _scale_vec(sc1, HB, SC_SMEM)[:, None]
            a1 = _group_t(kn, qn, 3, zero_s)
            a0 = warpgroup_mma_wait(2, deps=(a0,))
            s = s + a0 * _scale_vec(sc2, HB, SC_SMEM)[:, None]
            a0 = warpgroup_mma(kr, qr.permute((1, 0)), zero_s, use_acc=False, is_async=True)  # the rope dims
            a1 = warpgroup_mma_wait(1, deps=(a1,))
            s = s + a1 * _scale_vec(sc3, HB, SC_SMEM)[:, None]
            a0 = warpgroup_mma_wait(0, deps=(a0,))
            s = s + a0
        elif FOLD:
            acc = warpgroup_mma_wait(0, deps=(_group_t(kn, qn, 0, zero_s),))
            s = acc * _scale_vec(sc0, HB, SC_SMEM)[:, None]
            for g in gl.static_range(1, 4):
                acc = warpgroup_mma_wait(0, deps=(_group_t(kn, qn, g, acc),))
                if g == 1:
                    s = s + acc * _scale_vec(sc1, HB, SC_SMEM)[:, None]
                elif g == 2:
                    s = s + acc * _scale_vec(sc2, HB, SC_SMEM)[:, None]
                else:
                    s = s + acc * _scale_vec(sc3, HB, SC_SMEM)[:, None]
            s = warpgroup_mma(kr, qr.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s,))
        else:
            if D == 576:
                s = warpgroup_mma(kr, qr.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                for c in gl.static_range(8):
                    s = warpgroup_mma(kn.slice(64 * c, 64, dim=1), qn.slice(64 * c, 64, dim=1).permute((1, 0)), s,
                                      is_async=True)
            else:
                s = warpgroup_mma(kn.slice(0, 64, dim=1), qn.slice(0, 64, dim=1).permute((1, 0)), zero_s,
                                  use_acc=False, is_async=True)
                for c in gl.static_range(1, 8):
                    s = warpgroup_mma(kn.slice(64 * c, 64, dim=1), qn.slice(64 * c, 64, dim=1).permute((1, 0)), s,
                                      is_async=True)
            s = warpgroup_mma_wait(0, deps=(s,))
        return s

    @gluon.jit
    def _attend_t(s, valid, sc0, sc1, sc2, sc3, kn, pt0, pt1, pt2, pt3, o0, o1, o2, o3, m_i, l_i, qk_scale, score_sign,
                  HB: gl.constexpr, FOLD: gl.constexpr, SC_SMEM: gl.constexpr, ROW_SUMS: gl.constexpr):
        """One block of the few-heads kernels after ``S^T``: the overflow-safe online softmax of the
        64-head kernel down the columns (the keys), ``P^T`` to shared memory (bf16; fp8_656: one copy
        per scale group, each rounded once from ``P * s_g`` in float32) and ``O^T += V^T P^T``, with V
        the K tile read transposed. Returns ``(o0, o1, o2, o3, m_i, l_i)``; the MMAs have completed."""
        m_new, alpha, p = _online_softmax(s, valid, m_i, qk_scale, score_sign, 0)
        if ROW_SUMS:
            l_i = l_i * alpha[None, :] + p
        else:
            l_i = l_i * alpha + gl.sum(p, axis=0)
        if FOLD:
            pt0.store((p * _scale_vec(sc0, HB, SC_SMEM)[:, None]).to(gl.bfloat16))
            pt1.store((p * _scale_vec(sc1, HB, SC_SMEM)[:, None]).to(gl.bfloat16))
            pt2.store((p * _scale_vec(sc2, HB, SC_SMEM)[:, None]).to(gl.bfloat16))
            pt3.store((p * _scale_vec(sc3, HB, SC_SMEM)[:, None]).to(gl.bfloat16))
        else:
            pt0.store(p.to(gl.bfloat16))
        fence_async_shared()
        _cta_barrier()  # every warp's part of P^T is stored before any warp's MMA reads it
        a = alpha[None, :]
        o0 = o0 * a
        o1 = o1 * a
        o2 = o2 * a
        o3 = o3 * a
        if FOLD:
            o0 = warpgroup_mma(kn.slice(0, 128, dim=1).permute((1, 0)), pt0, o0, is_async=True)
            o1 = warpgroup_mma(kn.slice(128, 128, dim=1).permute((1, 0)), pt1, o1, is_async=True)
            o2 = warpgroup_mma(kn.slice(256, 128, dim=1).permute((1, 0)), pt2, o2, is_async=True)
            o3 = warpgroup_mma(kn.slice(384, 128, dim=1).permute((1, 0)), pt3, o3, is_async=True)
        else:
            o0 = warpgroup_mma(kn.slice(0, 128, dim=1).permute((1, 0)), pt0, o0, is_async=True)
            o1 = warpgroup_mma(kn.slice(128, 128, dim=1).permute((1, 0)), pt0, o1, is_async=True)
            o2 = warpgroup_mma(kn.slice(256, 128, dim=1).permute((1, 0)), pt0, o2, is_async=True)
            o3 = warpgroup_mma(kn.slice(384, 128, dim=1).permute((1, 0)), pt0, o3, is_async=True)
        o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
        return o0, o1, o2, o3, m_new, l_i

    @gluon.jit
    def _epilogue_t(o, g: gl.constexpr, m_o, l_o, pid, t, hb, sink_ptr, stride_sink, out_ptr, stride_ot, stride_oh,
                    stride_od, lse_ptr, stride_lt, stride_lh, ws_ptr, ws_ml_off, num_heads, num_head_blocks,
                    num_splits, lse_scale, HB: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr):
        """Output dims ``[128 g, 128 g + 128)`` from ``o`` (``[128 dims, HB]``) into ``out`` (or the split
        workspace); group 0 also writes ``lse`` (or ``m``, ``l``). As :func:`_epilogue`, transposed."""
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HB, 16])
        heads = hb * HB + gl.arange(0, HB, layout=gl.SliceLayout(0, O_L))
        head_ok = heads < num_heads
        dims = 128 * g + gl.arange(0, 128, layout=gl.SliceLayout(1, O_L))
        if SPLIT:
            row = _ws_rows(pid, t, heads, num_heads, num_head_blocks, num_splits)
            gl.store(ws_ptr + row[None, :] * 512 + dims[:, None], o, mask=head_ok[None, :])
            if g == 0:
                gl.store(ws_ptr + ws_ml_off + row * 2, m_o, mask=head_ok)
                gl.store(ws_ptr + ws_ml_off + row * 2 + 1, l_o, mask=head_ok)
            _launch_dependents()  # the split combine may be scheduled once every CTA is here
        else:
            lse, factor = _final_scale(m_o, l_o, heads, head_ok, sink_ptr, stride_sink, lse_scale, HAS_SINK)
            ptrs = (out_ptr + t * stride_ot + heads.to(gl.int64)[None, :] * stride_oh
                    + dims.to(gl.int64)[:, None] * stride_od)
            gl.store(ptrs, (o * factor[None, :]).to(gl.bfloat16), mask=head_ok[None, :])
            if g == 0:
                gl.store(lse_ptr + t * stride_lt + heads.to(gl.int64) * stride_lh, lse, mask=head_ok)

    @gluon.jit
    def _consumer_t(
        q_ptr, stride_qt, stride_qh, stride_qd,
        qn, qr, knope, krope, scales, valid_smem, pt0, pt1, pt2, pt3, ready, empty,
        len_ptr, stride_len, topk, xlen_ptr, stride_xlen, x_topk,
        sink_ptr, stride_sink,
        out_ptr, stride_ot, stride_oh, stride_od,
        lse_ptr, stride_lt, stride_lh,
        ws_ptr, ws_ml_off,
        num_heads, num_head_blocks, num_splits, qk_scale, score_sign, lse_scale,
        HB: gl.constexpr, FOLD: gl.constexpr, D: gl.constexpr, HAS_LEN: gl.constexpr,
        HAS_EXTRA: gl.constexpr, HAS_XLEN: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
    ):
        """The one consumer of the few-heads kernel: stages Q, then per block ``S^T = K Q^T``, the online
        softmax over the keys (a column of ``S^T``), ``P^T`` to shared memory and ``O^T += V^T P^T``."""
        pid = gl.program_id(0)
        t, hb, blk_lo, blk_hi, nb_main, n_main, n_extra = _block_range(
            pid, num_head_blocks, num_splits, len_ptr, stride_len, topk, xlen_ptr, stride_xlen, x_topk,
            HAS_LEN, HAS_EXTRA, HAS_XLEN, SPLIT)
        _load_q(q_ptr, stride_qt, stride_qh, stride_qd, qn, qr, t, hb, num_heads, score_sign, HB, D)
        _cta_barrier()  # every warp's part of Q is stored (and fenced) before the first MMA
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HB, 16])
        KEYS: gl.constexpr = gl.SliceLayout(1, S_L)
        HEADS: gl.constexpr = gl.SliceLayout(0, S_L)
        o0 = gl.zeros([128, HB], gl.float32, layout=S_L)  # O^T, dims [0, 128)
        o1 = gl.zeros([128, HB], gl.float32, layout=S_L)  # dims [128, 256)
        o2 = gl.zeros([128, HB], gl.float32, layout=S_L)  # dims [256, 384)
        o3 = gl.zeros([128, HB], gl.float32, layout=S_L)  # dims [384, 512)
        m_i = gl.full([HB], float("-inf"), gl.float32, layout=HEADS)
        # the softmax sums per key row and head, summed over the keys (across the warps) once after the
        # loop instead of once per block; not where the 32-head fp8_656 consumer would spill for it
        ROW_SUMS: gl.constexpr = HB == 16 or not FOLD
        # fp8_656's scale groups of S^T on two accumulators in turn; at 32 heads the second spills
        TWO_ACC: gl.constexpr = HB == 16
        if ROW_SUMS:
            l_i = gl.zeros([_BN, HB], gl.float32, layout=S_L)
        else:
            l_i = gl.zeros([HB], gl.float32, layout=HEADS)
        for blk in range(blk_lo, blk_hi):
            i = blk - blk_lo
            stage = i % 2
            mbarrier.wait(ready.index(stage), (i // 2) & 1)
            kn = knope.index(stage)
            valid = valid_smem.index(stage).load(KEYS) != 0
            # the scale rows of the stage (fp8_656; other formats do not read them)
            sc0 = scales.index(stage * 4)
            sc1 = scales.index(stage * 4 + 1)
            sc2 = scales.index(stage * 4 + 2)
            sc3 = scales.index(stage * 4 + 3)
            s = _scores_t(qn, qr, kn, krope.index(stage), sc0, sc1, sc2, sc3, HB, FOLD, D, True, TWO_ACC)
            o0, o1, o2, o3, m_i, l_i = _attend_t(s, valid, sc0, sc1, sc2, sc3, kn, pt0, pt1, pt2, pt3,
                                                 o0, o1, o2, o3, m_i, l_i, qk_scale, score_sign, HB, FOLD, True,
                                                 ROW_SUMS)
            mbarrier.arrive(empty.index(stage))  # after the partition's barrier: every warp is done
        if ROW_SUMS:
            l_i = gl.sum(l_i, axis=0)
        _epilogue_t(o0, 0, m_i, l_i, pid, t, hb, sink_ptr, stride_sink, out_ptr, stride_ot, stride_oh, stride_od,
                    lse_ptr, stride_lt, stride_lh, ws_ptr, ws_ml_off, num_heads, num_head_blocks, num_splits,
                    lse_scale, HB, HAS_SINK, SPLIT)
        _epilogue_t(o1, 1, m_i, l_i, pid, t, hb, sink_ptr, stride_sink, out_ptr, stride_ot, stride_oh, stride_od,
                    lse_ptr, stride_lt, stride_lh, ws_ptr, ws_ml_off, num_heads, num_head_blocks, num_splits,
                    lse_scale, HB, HAS_SINK, SPLIT)
        _epilogue_t(o2, 2, m_i, l_i, pid, t, hb, sink_ptr, stride_sink, out_ptr, stride_ot, stride_oh, stride_od,
                    lse_ptr, stride_lt, stride_lh, ws_ptr, ws_ml_off, num_heads, num_head_blocks, num_splits,
                    lse_scale, HB, HAS_SINK, SPLIT)
        _epilogue_t(o3, 3, m_i, l_i, pid, t, hb, sink_ptr, stride_sink, out_ptr, stride_ot, stride_oh, stride_od,
                    lse_ptr, stride_lt, stride_lh, ws_ptr, ws_ml_off, num_heads, num_head_blocks, num_splits,
                    lse_scale, HB, HAS_SINK, SPLIT)

    @gluon.jit(do_not_specialize=("topk", "x_topk"))
    def _sparse_mla_decode_hopper_t_kernel(
        q_ptr, stride_qt, stride_qh, stride_qd,
        cache_ptr, stride_cp, stride_cr, page_size, num_slots,
        idx_ptr, stride_it, stride_ik, topk,
        len_ptr, stride_len,
        xcache_ptr, stride_xp, stride_xr, x_page_size, x_num_slots,
        xidx_ptr, stride_xt, stride_xk, x_topk,
        xlen_ptr, stride_xlen,
        sink_ptr, stride_sink,
        out_ptr, stride_ot, stride_oh, stride_od,
        lse_ptr, stride_lt, stride_lh,
        ws_ptr, ws_ml_off,
        num_heads, num_head_blocks, num_splits,
        qk_scale, score_sign, lse_scale,
        KV_FORMAT: gl.constexpr, D: gl.constexpr, FOLD: gl.constexpr, HAS_LEN: gl.constexpr,
        HAS_EXTRA: gl.constexpr, HAS_XLEN: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
        HB: gl.constexpr, WORKER_REGS: gl.constexpr,
    ):
        """The few-heads kernel: arguments as :func:`_sparse_mla_decode_hopper_kernel`, ``HB`` (16 or 32)
        heads per CTA. Shared memory: Q ``[HB, 576]``, the same two-stage ring, ``P^T`` (four copies for
        fp8_656)."""
        SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        PL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * HB, element_bitwidth=16, rank=2)
        VL1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        R_ROWS: gl.constexpr = _BN if D == 576 else 8  # the rope dims of the ring (a stand-in for D = 512)
        qn = gl.allocate_shared_memory(gl.bfloat16, [HB, 512], SL)
        qr = gl.allocate_shared_memory(gl.bfloat16, [HB, 64], SL)
        knope = gl.allocate_shared_memory(gl.bfloat16, [2, _BN, 512], SL)
        krope = gl.allocate_shared_memory(gl.bfloat16, [2, R_ROWS, 64], SL)
        scales = gl.allocate_shared_memory(gl.float32, [16 if KV_FORMAT == 2 else 8, _BN], VL1)
        valid_smem = gl.allocate_shared_memory(gl.int8, [2, _BN], VL1)
        # P^T: fp8_656 one copy per scale group, each its own allocation (the compiler then puts no
        # partition barrier between the stores of two copies, as it does between two subviews of one)
        pt0 = gl.allocate_shared_memory(gl.bfloat16, [_BN, HB], PL)
        if FOLD:
            pt1 = gl.allocate_shared_memory(gl.bfloat16, [_BN, HB], PL)
            pt2 = gl.allocate_shared_memory(gl.bfloat16, [_BN, HB], PL)
            pt3 = gl.allocate_shared_memory(gl.bfloat16, [_BN, HB], PL)
        else:
            pt1 = pt0
            pt2 = pt0
            pt3 = pt0
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(ready.index(s), count=1)  # the producer partition
            mbarrier.init(empty.index(s), count=1)  # the consumer partition
        fence_async_shared()
        gl.warp_specialize(
            [(_consumer_t, (q_ptr, stride_qt, stride_qh, stride_qd,
                            qn, qr, knope, krope, scales, valid_smem, pt0, pt1, pt2, pt3, ready, empty,
                            len_ptr, stride_len, topk, xlen_ptr, stride_xlen, x_topk,
                            sink_ptr, stride_sink, out_ptr, stride_ot, stride_oh, stride_od, lse_ptr, stride_lt,
                            stride_lh, ws_ptr, ws_ml_off, num_heads, num_head_blocks, num_splits, qk_scale,
                            score_sign, lse_scale, HB, FOLD, D, HAS_LEN, HAS_EXTRA, HAS_XLEN, HAS_SINK, SPLIT)),
             (_producer, (cache_ptr, stride_cp, stride_cr, page_size, num_slots, idx_ptr, stride_it, stride_ik,
                          xcache_ptr, stride_xp, stride_xr, x_page_size, x_num_slots, xidx_ptr, stride_xt, stride_xk,
                          len_ptr, stride_len, topk, xlen_ptr, stride_xlen, x_topk, num_head_blocks, num_splits,
                          knope, krope, scales, valid_smem, ready, empty,
                          KV_FORMAT, D, HAS_LEN, HAS_EXTRA, HAS_XLEN, SPLIT))],
            [4],
            [WORKER_REGS],
        )


# =====================================================================================================
# host side
# =====================================================================================================

def _is_sm90(device: torch.device) -> bool:
    """An NVIDIA sm_90 GPU (H100, H200, H20, H800). Not an AMD GPU of a ROCm build, whose capability
    ``(9, 0)`` is an MI200's GFX version (:func:`_launch.hip`)."""
    return not hip() and compute_capability(device) == (9, 0)


class PortableKernelWarning(UserWarning):
    """An sm_90 GPU runs the portable Triton kernel for a call the Hopper kernel would serve, because
    this Triton gives no Hopper kernels (:data:`GLUON_UNAVAILABLE`)."""


_WARNED: set[str] = set()


def warn_portable_on_sm90(op: str, device: torch.device, layout_ok: bool) -> None:
    """Warn, once per operator and process, where a call on an sm_90 GPU whose layout the Hopper kernel
    takes (``layout_ok``) runs the portable kernel because this Triton gives no Hopper kernels: slower at
    the models' shapes, and otherwise silent. Called where a launcher plans a call."""
    if HAS_GLUON or not layout_ok or op in _WARNED or device.type != "cuda" or not _is_sm90(device):
        return
    _WARNED.add(op)
    names = _release_names()
    warnings.warn(f"torch_sparse_mla: {op} runs its portable Triton kernel on this sm_90 GPU, not its Hopper "
                  f"kernel, which is faster at the models' shapes: {GLUON_UNAVAILABLE}. A triton "
                  f"from {names[0]} to {names[-1]} gives them. (Said once per operator.)",
                  PortableKernelWarning, stacklevel=2)


# Positions of the kernels' arguments that must be 16-byte aligned, ``cache_ptr`` and ``xcache_ptr``
# (``ops/sparse_mla.py::_kernel_args``): the cache-row copies do not compile otherwise
# (``scripts/inspect_hopper.py --alignment``; :func:`supported` checks them).
ALIGNED_ARGS = (4, 15)


def supported(q, kv_cache, kv_format, head_dim_v, extra_kv_cache) -> bool:
    """Whether the Hopper kernel serves this call (else the portable kernel does): an sm_90 device with
    Gluon, and an input layout :func:`layout_supported` accepts."""
    return (HAS_GLUON and q.device.type == "cuda"
            and layout_supported(q, kv_cache, kv_format, head_dim_v, extra_kv_cache) and _is_sm90(q.device))


def layout_supported(q, kv_cache, kv_format, head_dim_v, extra_kv_cache) -> bool:
    """The part of :func:`supported` that needs no GPU: shapes, strides and the caches' 16-byte
    alignment (its ``cp.async`` row copies do not compile for a cache base the JIT cannot prove 16-byte
    aligned; every other pointer may have any alignment)."""
    if q.dtype != torch.bfloat16 or head_dim_v != 512:
        return False
    dim = q.shape[2]
    if not (kv_format in ("fp8_656", "fp8_584") or (kv_format == "auto" and dim in (512, 576))):
        return False
    for cache in (kv_cache, extra_kv_cache):
        if cache is None:
            continue
        size = cache.element_size()
        if (cache.data_ptr() % 16 or (cache.stride(0) * size) % 16
                or (kv_format == "auto" and (cache.stride(1) * size) % 16)):
            return False
    return True


def plan_launch(num_tokens: int, num_heads: int, k_total: int, num_sms: int,
                num_splits: int | None = None) -> LaunchPlan:
    """One CTA per (token, split, 64 heads), one CTA per SM (the ring takes ~220 KB of shared memory):
    split the candidate list as far as the CTAs still fit in one wave (``programs * splits <= SMs``),
    keeping at least ``_MIN_BLOCKS_PER_SPLIT`` blocks of 64 per split (a split of one block cannot
    overlap its gathers with its math). Measured on an H200 (docs/sparse_mla_hopper.md): a second,
    partial wave costs more than the longer lists it saves, e.g. H=128 K=2048 T=16 with 4 splits
    67.5 us against 91.6 us with 5.

    Exception: when one block per CTA still makes at most ``_ONE_BLOCK_CTAS`` CTAs, every block gets
    its own split. There the call is bound by the latency of one CTA's chain (slot ids, gathers,
    math, partials), which a second block lengthens more than the wider combine costs, e.g. fp8_584
    H=64 K=640 T=1: 17.9 us with 10 splits of one block against 20.5 us with 5 of two.

    At most 32 heads (``H`` = 16 is DeepSeek-V3.2's 128 heads over 8 GPUs) take the few-heads kernel
    (``transposed``): 16 or 32 heads per CTA, the products transposed so the heads are the N side of
    the MMA instead of padding a 64-row M side."""
    block_h = few_heads_block(num_heads)
    head_blocks = cdiv(num_heads, block_h)
    programs = max(num_tokens * head_blocks, 1)
    if num_splits is None:
        blocks = cdiv(k_total, BLOCK_N)
        if programs * blocks <= min(_ONE_BLOCK_CTAS, num_sms):
            num_splits = max(blocks, 1)
        else:
            num_splits = max(1, min(num_sms // programs, blocks // _MIN_BLOCKS_PER_SPLIT))
    return LaunchPlan(block_h=block_h, head_blocks=head_blocks, block_n=BLOCK_N, num_splits=num_splits,
                      num_warps=4, num_stages=1, transposed=block_h < BLOCK_H)


def few_heads_block(num_heads: int) -> int:
    """Heads per CTA: 16 or 32 (the few-heads kernel) for at most 32 heads, else ``BLOCK_H``."""
    return 16 if num_heads <= 16 else 32 if num_heads <= 32 else BLOCK_H


def check_plan(plan: LaunchPlan) -> None:
    """A plan (after ``config=`` overrides) names a kernel that exists: the 64-head one (``block_h``
    64) or the few-heads one (``transposed``, ``block_h`` 16 or 32)."""
    if plan.transposed and plan.block_h not in (16, 32):
        raise ValueError(f"config: the few-heads Hopper kernel takes block_h 16 or 32, not {plan.block_h}")
    if not plan.transposed and plan.block_h != BLOCK_H:
        raise ValueError(f"config: the Hopper kernel takes block_h {BLOCK_H} (or 16 / 32 with transposed=True), "
                         f"not {plan.block_h}")


def make_launch(args: tuple, q, kv_format, topk_length, attn_sink, extra_kv_cache, extra_topk_length,
                plan: LaunchPlan) -> KernelLaunch:
    """The main launch of one plan. ``args`` are the run-time arguments both decode kernels share
    (``ops/sparse_mla.py::_kernel_args``); with ``plan.num_splits > 1`` the kernel writes the workspace
    of the portable combine kernel (``acc`` of 512 dims per row)."""
    num_tokens, _, dim = q.shape
    has_extra = extra_kv_cache is not None
    check_plan(plan)
    meta = dict(KV_FORMAT=FORMAT_IDS[kv_format], D=dim, FOLD=kv_format == "fp8_656", HAS_LEN=topk_length is not None,
                HAS_EXTRA=has_extra, HAS_XLEN=has_extra and extra_topk_length is not None,
                HAS_SINK=attn_sink is not None, SPLIT=plan.num_splits > 1)
    if plan.transposed:
        kernel = _sparse_mla_decode_hopper_t_kernel
        meta.update(HB=plan.block_h, WORKER_REGS=_WORKER_REGS_T)
    else:
        kernel = _sparse_mla_decode_hopper_kernel
        meta.update(WORKER_REGS=_WORKER_REGS[kv_format])
    return KernelLaunch(kernel, (num_tokens * plan.num_splits * plan.head_blocks,), args, meta, num_warps=4,
                        device=q.device, aligned=ALIGNED_ARGS, ptx_options=hopper_ptx_options())


__all__ = ["ALIGNED_ARGS", "BLOCK_H", "GLUON_TRITON_VERSIONS", "GLUON_UNAVAILABLE", "HAS_GLUON", "PortableKernelWarning",
           "check_plan", "few_heads_block", "gluon_version_supported", "make_launch", "plan_launch", "supported",
           "warn_portable_on_sm90"]
