"""Hopper (sm_90) kernels of ``sparse_gqa_decode`` for float8 value caches and NVFP4 caches, in Gluon.

The portable Triton kernel (``ops/sparse_gqa.py``) keeps one or two tiles in flight per program and
converts both K and V to float16 before its tile products. This kernel keeps up to four blocks of keys in
flight per CTA, never converts K, and runs two softmax consumers per CTA:

- **One CTA per (row, KV head, block of 16 query heads, split).** A block is 64 keys of one selected
  page (``cdiv(page_size, 64)`` blocks per page); a split is a range of blocks (at most 64 pages).
- **Three partitions** (``gl.warp_specialize``; 80 registers per thread and 75-79 KB (float8) or 83-85 KB
  (NVFP4) of shared memory, so two CTAs fit on an SM):

  - *producer* (4 warps): resolves the split's page list up front into a shared-memory table
    (physical page and visible key count of each selected page), then per block copies the 64 K rows
    and the 64 V rows (128 bytes each, ``cp.async`` with zero fill for keys the row may not see) into
    a ring of ``NUM_STAGES`` raw stages, up to ``NUM_STAGES`` blocks ahead; each thread's
    ``cp.async.mbarrier.arrive`` hands a block over once its copies have landed. It only copies.
  - *two consumers* (4 warps each) take alternate blocks, each with its own online softmax: per block
    ``S^T = K Q^T`` ``[64 keys, 16 heads]`` with float8 ``wgmma`` straight from the raw K stage and,
    while that runs, the block's V bytes converted into the registers of the ``A`` operand of
    ``O^T += V^T P^T`` (``_v_regs``); then each thread gives the stage back to the producer, and runs
    the softmax down the key axis (which keys the row may see comes from the producer's page table),
    ``P^T`` to shared memory and ``O^T += V^T P^T`` ``[128 dims, 16 heads]``. The second hands its
    state to the first (through a ring stage nothing uses any more), which merges and writes the
    result.

- **Exact products.** ``wgmma`` with float8 operands needs both in float8. The query row is scaled by
  a power of two that brings its largest magnitude into ``[2**7, 2**8)`` and written as a sum of
  e4m3 pieces, each the nearest e4m3 value of what the previous ones left: two for a bfloat16 query
  (what the first leaves of a bfloat16 value has at most 4 significant bits), three for float16.
  Every element of at least ``2**-9`` (bfloat16) or ``2**-6`` (float16) of its row's largest is then
  represented exactly, smaller ones to within ``2**-18`` of the largest (e4m3's subnormal grid). The
  products accumulate in float32. V values are exact in float16 (the hardware conversion
  ``cvt.rn.f16x2.e4m3x2``); ``P`` is rounded to float16.
- **Split-K** writes the partials of the portable kernel (``m``, ``l``, ``acc`` rows of
  ``ops/sparse_gqa.py``), which its combine kernel merges; right after its stores each CTA lets that
  kernel (launched with programmatic dependent launch) be scheduled.

For an NVFP4 cache (the same kernel, ``NQ = 0``) the structure is the same and the producer is one
warp (its copies are 16 bytes per thread each, from one per-thread address per block plus constant
offsets); its stages hold a block's E2M1 bytes and E4M3 group scales (9 KB instead of 16), and its
consumers expand V into a float16 tile and K straight into the registers of the ``Q K^T`` MMA's A operand
(``value * scale * 2**-7``, exact) and run float16 ``wgmma``; the query is staged as float16 in K's
column order (``_nv_kdim``), the V tile's columns are in ``_nv_dim`` order (undone by the epilogue).

Requirements (:func:`supported`; anything else takes the portable kernel): an sm_90 device, a bfloat16
or float16 query with ``Dh = 128``, a 16-byte aligned cache, and either a float8 value cache whose page,
head and row strides are multiples of 16 bytes or an NVFP4 cache laid out as the format says with a
page stride that is a multiple of 16 bytes. Gluon does not run under the Triton interpreter: this kernel is
tested on the GPU only (``tests/test_sparse_gqa.py``, the ``hopper`` tests). ``docs/sparse_gqa_hopper.md``
has the design and the measurements.
"""

from __future__ import annotations

import torch

from ..meta_kernels.sparse_gqa import is_nvfp4, kv_heads
from ._formats import e2m1_place_ptx
from ._launch import KernelLaunch, LaunchPlan, cdiv, hopper_ptx_options, next_pow2
from .sparse_mla_hopper import HAS_GLUON, _is_sm90, warn_portable_on_sm90

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .sparse_mla_hopper import _cta_barrier, _launch_dependents, async_load

BLOCK_N = 64  # keys per block (one ring stage)
BLOCK_H = 16  # query heads per CTA (larger groups take several head blocks)
HEAD_DIM = 128
NUM_STAGES = 4  # raw stages of the ring: up to NUM_STAGES blocks in flight
# Registers per thread: the kernel's (two CTAs of 12 warps per SM) and the worker partitions' (the second
# consumer, the producer; setmaxnreg), the first consumer (the default partition) gets the rest: 104. The
# producer keeps its loop in 24 without spilling; the consumers' loops spill nothing with 104 and 112
# (docs/sparse_gqa_hopper.md, "Registers to the consumers": 2% faster than 96 / 96 / 48).
_MAXNREG = 80
_WORKER_REGS = (112, 24)
# Warps of the NVFP4 kernel's producer partition: its per-block bookkeeping (stage wait, page lookup,
# arrival) is the same for one warp as for each of four, so one warp issues 98 instructions per block
# where four issued 4 x 90: 10% fewer in the whole kernel, 1.3% faster at T = 256 on an H100
# (docs/sparse_gqa_hopper.md, "What the NVFP4 kernel's warps wait for, and a one-warp producer"). The
# launch keeps 12 warps (the partition is padded to a warpgroup). The float8 producer keeps four warps
# (one would spill: it copies 16 KB per block).
_NV_PRODUCER_WARPS = 1
# CTAs the plan aims at per SM (registers and 75-85 KB of shared memory per CTA allow two)
_CTAS_PER_SM = 2
# Fewest blocks a split keeps (a split of one block has nothing to overlap its copies with).
_MIN_BLOCKS_PER_SPLIT = 2
# Fewest blocks per split for which the consumers take their weights against a reference maximum
# (``_softmax_pv``'s ``LAZY``): it saves work in most blocks but costs a little per CTA, which shows
# where a CTA has only a few blocks (docs/sparse_gqa_hopper.md, "The reference maximum").
_LAZY_MIN_BLOCKS = 16
# Most selected pages one CTA walks (its page table lives in shared memory).
_MAX_PAGES_PER_SPLIT = 64

if HAS_GLUON:
    _BN = gl.constexpr(BLOCK_N)
    _FLT_MAX = gl.constexpr(3.4028234663852886e38)

    # Hand-offs between partitions. A partition barrier followed by one thread's ``mbarrier.arrive``
    # orders every thread's shared-memory accesses before the waiting partition's (PTX's causality order
    # is transitive through the barrier), which is all the hardware needs. compute-sanitizer's racecheck
    # takes an arrive as ordering only the accesses of the thread that executes it, and reports such a
    # hand-off as a race (docs/testing.md, "Under compute-sanitizer"). So every thread of the releasing
    # partition arrives as well, with ``cp.async.mbarrier.arrive.noinc``: it triggers once the thread's
    # own copies in flight are complete, and the callers have none in flight, so it arrives at once. An
    # mbarrier released this way expects ``ARRIVALS`` arrivals (one partition of four warps; one more than
    # the releasing partition's threads in general: the NVFP4 producer's is one warp).
    ARRIVALS = gl.constexpr(1 + 128)
    _NVPW = gl.constexpr(_NV_PRODUCER_WARPS)

    @gluon.jit
    def _release(bar):
        """Hand the partition's shared-memory work over to the partition waiting on ``bar``."""
        _cta_barrier()
        mbarrier.arrive(bar)
        async_copy.mbarrier_arrive(bar, increment_count=False)

    @gluon.jit
    def _free_stage(bar):
        """Give a ring stage back to the producer: every consumer thread arrives once (``bar`` expects
        128), right after its last use of the stage (its loads returned, or its MMA wait passed), so the
        phase completes only when every thread is done; no partition barrier (the producer only
        overwrites the stage, and each thread's reads precede its arrival)."""
        async_copy.mbarrier_arrive(bar, increment_count=False)

    # Two e4m3 words of keys k and k + 1 (bytes: dims 4 w .. 4 w + 3) -> four float16x2 registers, the
    # j-th holding dim 4 w + j of key k (low half) and of key k + 1 (high half): two byte permutes pair
    # the keys' bytes, the hardware converts two at a time (exact: every e4m3 value is a float16 value).
    _E4M3_PAIRS_TO_F16X2 = gl.constexpr(
        "{\n.reg .b32 x01, x23;\n.reg .b16 l0, h0, l1, h1;\n"
        "prmt.b32 x01, $4, $5, 0x5140;\nprmt.b32 x23, $4, $5, 0x7362;\n"
        "mov.b32 {l0, h0}, x01;\nmov.b32 {l1, h1}, x23;\n"
        "cvt.rn.f16x2.e4m3x2 $0, l0;\ncvt.rn.f16x2.e4m3x2 $1, h0;\n"
        "cvt.rn.f16x2.e4m3x2 $2, l1;\ncvt.rn.f16x2.e4m3x2 $3, h1;\n}\n")

    @gluon.jit
    def _vreg_dim(r):
        """The head dim held at row ``r`` of ``O^T`` (and of the register V operand, ``_v_regs``): rows
        ``r = 64 b6 + 32 b5 + 16 b4 + 8 b3 + r3`` hold dim ``4 (r3 + 8 b4 + 16 b5) + b3 + 2 b6``."""
        return 4 * ((r & 7) + ((r >> 4) & 3) * 8) + ((r >> 3) & 1) + ((r >> 6) & 1) * 2

    @gluon.jit
    def _v_regs(vraw, stage, A_L: gl.constexpr):
        """Stage ``stage`` of the raw V ring (``[64 keys, 128]`` e4m3 bytes in the 128-byte swizzle) as
        the float16 ``A`` operand of ``O^T += V^T P^T`` in registers (layout ``A_L``, rows in
        ``_vreg_dim`` order): no float16 tile, no barrier before it is written, half the shared-memory
        traffic of the tile. A thread loads the 4-byte words (four dims of one key) its fragment needs,
        keys ``k`` and ``k + 1`` in consecutive registers, and pairs them in the conversion, so the values
        land in the fragment with no shuffle (the fragment's four rows of a thread are four consecutive
        dims); the loads meet no bank conflict (in a warp the four keys of an instruction are 2 apart,
        and the swizzle spreads them)."""
        # [64 keys, 32 words]: registers keys +1 / +8 / +16 / +32, lanes keys +2 / +4 then words +1 / +2
        # / +4, warps words +8 / +16
        LW: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[1, 0], [8, 0], [16, 0], [32, 0]],
            lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
            warp_bases=[[0, 8], [0, 16]], block_bases=[], shape=[_BN, 32])
        W32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        w = vraw.index(stage).reinterpret(gl.int32, [_BN, 32], W32).load(LW)
        o0, o1, o2, o3 = gl.inline_asm_elementwise(_E4M3_PAIRS_TO_F16X2, "=r,=r,=r,=r,r,r", [w],
                                                   dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
                                                   is_pure=True, pack=2)
        v = gl.join(gl.join(o0, o1), gl.join(o2, o3))  # [64, 32 words, j0, j1]: dim 4 w + 2 j1 + j0
        v = gl.reshape(gl.permute(v, [0, 1, 3, 2]), [_BN, 2, 2, 2, 2, 2, 2, 2])  # key, dim bits 6 .. 0
        v = gl.permute(v, [6, 1, 2, 7, 3, 4, 5, 0])  # row bits 6 .. 0 (_vreg_dim), key
        return gl.convert_layout(gl.reshape(v, [128, _BN]), A_L)

    @gluon.jit
    def _cta_range(pid, num_kv_heads, num_head_blocks, num_splits, blocks_per_split, n_blocks):
        """``(t, g, hb, split, blk_lo, blk_hi)`` of this CTA: the same in both partitions."""
        hb = pid % num_head_blocks
        rest = pid // num_head_blocks
        g = rest % num_kv_heads
        rest = rest // num_kv_heads
        split = rest % num_splits
        t = (rest // num_splits).to(gl.int64)
        blk_lo = split * blocks_per_split
        blk_hi = gl.maximum(gl.minimum(blk_lo + blocks_per_split, n_blocks), blk_lo)
        return t, g, hb, split, blk_lo, blk_hi

    # -------------------------------------------------------------------------------------------------
    # producer
    # -------------------------------------------------------------------------------------------------

    @gluon.jit
    def _block_keys(blk, j_lo, page_keys, CPB: gl.constexpr, KEYS: gl.constexpr):
        """Which of block ``blk``'s ``_BN`` keys the row may see (layout ``KEYS``), from the page table."""
        ONE: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        p_keys = gl.sum(page_keys.index(blk // CPB - j_lo).load(ONE), axis=0)
        return (blk % CPB) * _BN + gl.arange(0, _BN, layout=KEYS) < p_keys

    @gluon.jit
    def _block_limit(blk, j_lo, page_keys, CPB: gl.constexpr):
        """How many of block ``blk``'s ``_BN`` keys (a prefix) the row may see."""
        ONE: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        p_keys = gl.sum(page_keys.index(blk // CPB - j_lo).load(ONE), axis=0)
        return gl.minimum(gl.maximum(p_keys - (blk % CPB) * _BN, 0), _BN)

    @gluon.jit
    def _issue_block(blk, stage, j_lo, page_phys, page_keys, cache_ptr, stride_cp, stride_ch, stride_co, g,
                     kraw, vraw, CPB: gl.constexpr):
        """Start the copies of block ``blk`` (K rows, V rows) into raw stage ``stage``; keys the row may
        not see copy nothing and read as zeros."""
        CP: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        ONE: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        jj = blk // CPB - j_lo
        p_phys = gl.sum(page_phys.index(jj).load(ONE), axis=0).to(gl.int64)
        o = (blk % CPB) * _BN + gl.arange(0, _BN, layout=gl.SliceLayout(1, CP))
        valid = _block_keys(blk, j_lo, page_keys, CPB, gl.SliceLayout(1, CP))
        rows = cache_ptr + p_phys * stride_cp + g * stride_ch + o.to(gl.int64) * stride_co
        cols = gl.arange(0, 128, layout=gl.SliceLayout(0, CP))
        ptrs = (rows[:, None] + cols[None, :]).to(gl.pointer_type(gl.uint8), bitcast=True)
        vmask = valid[:, None]
        async_load(kraw.index(stage), ptrs, mask=vmask)
        async_load(vraw.index(stage), ptrs + 128, mask=vmask)

    @gluon.jit
    def _page_table(t, g, blk_lo, blk_hi, topk_ptr, stride_tk_t, stride_tk_h, stride_tk_j,
                    bt_ptr, stride_bt_r, stride_bt_c, kv_lens_ptr, stride_kvl, qo_ptr, stride_qo,
                    num_pages, num_req, max_blocks, n_sel, decode_query_len, page_phys, page_keys,
                    PAGE_SIZE: gl.constexpr, CPB: gl.constexpr, BLOCK_SEL: gl.constexpr, W: gl.constexpr):
        """Store the split's page table (physical page, visible keys of each selected page) in shared
        memory; returns the split's first page index ``j_lo``."""
        req = t // decode_query_len
        kv_len = gl.load(kv_lens_ptr + t * stride_kvl).to(gl.int64)
        qo = gl.load(qo_ptr + t * stride_qo).to(gl.int64)
        limit = gl.minimum(qo + 1, kv_len)  # positions x < limit are visible
        # The split's pages (blocks [blk_lo, blk_hi) lie on pages j_lo .. (blk_hi - 1) // CPB), resolved
        # up front: no dependent index loads in the loop.
        SEL: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])  # the producer's W warps
        j_lo = blk_lo // CPB
        sel = gl.arange(0, BLOCK_SEL, layout=SEL)
        js = (j_lo + sel).to(gl.int64)
        sel_ok = (js < n_sel) & (j_lo + sel <= (blk_hi - 1) // CPB)
        page = gl.load(topk_ptr + t * stride_tk_t + g.to(gl.int64) * stride_tk_h + js * stride_tk_j, mask=sel_ok,
                       other=-1).to(gl.int64)
        bt_ok = sel_ok & (page >= 0) & (page < max_blocks) & (req < num_req)
        phys = gl.load(bt_ptr + req * stride_bt_r + page * stride_bt_c, mask=bt_ok, other=-1).to(gl.int64)
        page_ok = bt_ok & (phys >= 0) & (phys < num_pages)
        n_keys = gl.minimum(gl.maximum(limit - page * PAGE_SIZE, 0), PAGE_SIZE)
        n_keys = gl.where(page_ok, n_keys, 0)
        phys = gl.where(page_ok, phys, 0)
        # kept in shared memory: each block reads its page's two numbers back (a register vector would need
        # a cross-warp reduction per block, or a copy per thread, which spills for long lists)
        VL1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        page_phys.reinterpret(gl.int32, [BLOCK_SEL], VL1).store(phys.to(gl.int32))
        page_keys.reinterpret(gl.int32, [BLOCK_SEL], VL1).store(n_keys.to(gl.int32))
        return j_lo

    @gluon.jit
    def _producer(cache_ptr, stride_cp, stride_ch, stride_co,
                  topk_ptr, stride_tk_t, stride_tk_h, stride_tk_j,
                  bt_ptr, stride_bt_r, stride_bt_c,
                  kv_lens_ptr, stride_kvl, qo_ptr, stride_qo,
                  num_pages, num_req, max_blocks, n_sel,
                  num_kv_heads, num_head_blocks, num_splits, blocks_per_split, decode_query_len,
                  kraw, vraw, ksc, vsc, page_phys, page_keys, pages_ready, ready, kfree,
                  PAGE_SIZE: gl.constexpr, CPB: gl.constexpr, NR: gl.constexpr, BLOCK_SEL: gl.constexpr,
                  NVFP4: gl.constexpr, PW: gl.constexpr):
        """The copying partition of both kernels. With ``NVFP4`` the cache is NVFP4 (``stride_ch`` the
        slot stride, K slot ``2 g``, ``kraw`` / ``vraw`` the data rings and ``ksc`` / ``vsc`` the scale
        rings); otherwise a float8 value cache (``ksc`` / ``vsc`` unused). ``PW`` is its number of warps."""
        stride_cp = gl.cast(stride_cp, gl.int64)
        stride_ch = gl.cast(stride_ch, gl.int64)
        stride_co = gl.cast(stride_co, gl.int64)
        t, g, hb, split, blk_lo, blk_hi = _cta_range(gl.program_id(0), num_kv_heads, num_head_blocks, num_splits,
                                                     blocks_per_split, n_sel * CPB)
        n = blk_hi - blk_lo
        j_lo = _page_table(t, g, blk_lo, blk_hi, topk_ptr, stride_tk_t, stride_tk_h, stride_tk_j,
                           bt_ptr, stride_bt_r, stride_bt_c, kv_lens_ptr, stride_kvl, qo_ptr, stride_qo,
                           num_pages, num_req, max_blocks, n_sel, decode_query_len, page_phys, page_keys,
                           PAGE_SIZE, CPB, BLOCK_SEL, PW)
        _release(pages_ready)  # the consumers read the keys per page too (no copy is in flight yet)

        # Each thread arrives on a stage's `ready` barrier right after issuing its copies of the block:
        # the arrival happens once those copies (and its earlier ones) have landed. The producer waits
        # for nothing else, so up to NR blocks are in flight.
        for i in range(0, n):
            if i >= NR:
                mbarrier.wait(kfree.index(i % NR), ((i - NR) // NR) & 1)  # block i - NR's consumer is done
            if NVFP4:
                _nv_issue_block(blk_lo + i, i % NR, j_lo, page_phys, page_keys, cache_ptr, stride_cp, stride_ch, g,
                                kraw, vraw, ksc, vsc, PAGE_SIZE, CPB, PW)
            else:
                _issue_block(blk_lo + i, i % NR, j_lo, page_phys, page_keys, cache_ptr, stride_cp, stride_ch,
                             stride_co, g, kraw, vraw, CPB)
            async_copy.mbarrier_arrive(ready.index(i % NR), increment_count=False)

    # -------------------------------------------------------------------------------------------------
    # consumers
    # -------------------------------------------------------------------------------------------------

    @gluon.jit
    def _load_q(q_ptr, stride_qt, stride_qh, stride_qd, qs, t, g, hb, group, HB: gl.constexpr, NQ: gl.constexpr,
                STORE: gl.constexpr):
        """This CTA's ``HB`` query rows (zeros past the group) scaled by a power of two per row (largest
        magnitude in ``[2**7, 2**8)``); with ``STORE`` their ``NQ`` e4m3 pieces go to ``qs``. Returns the
        inverse of each row's power of two."""
        QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        i = hb * HB + gl.arange(0, HB, layout=gl.SliceLayout(1, QL))
        ok = i < group
        h = (g * group + i).to(gl.int64)
        d = gl.arange(0, 128, layout=gl.SliceLayout(0, QL)).to(gl.int64)
        x = gl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :] * stride_qd, mask=ok[:, None],
                    other=0.0).to(gl.float32)
        amax = gl.max(gl.abs(x), axis=1)
        e = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of the row's largest |q|
        k = gl.minimum(134 - e, 64)  # amax * 2**k in [2**7, 2**8) for a normal amax
        up = ((127 + k) << 23).to(gl.float32, bitcast=True)
        down = ((127 - k) << 23).to(gl.float32, bitcast=True)
        if STORE:
            y = x * up[:, None]
            p0 = y.to(gl.float8e4nv)
            qs.index(0).store(p0)
            r = y - p0.to(gl.float32)
            p1 = r.to(gl.float8e4nv)
            qs.index(1).store(p1)
            if NQ == 3:
                r = r - p1.to(gl.float32)
                qs.index(2).store(r.to(gl.float8e4nv))
            fence_async_shared()
        return down

    @gluon.jit
    def _merge_and_store(o, m_i, l_rows, t, g, hb, split, group, num_kv_heads, num_splits, v_scale, v_scale_ptr,
                         out_ptr, stride_ot, stride_oh, stride_od, ws_ptr, ws_rows, o_smem, ml_smem, merge_ready,
                         v_mult: gl.constexpr, CID: gl.constexpr, HB: gl.constexpr, HAS_V_SCALE: gl.constexpr,
                         SPLIT: gl.constexpr, NV_DIMS: gl.constexpr):
        """The end of consumer ``CID``: the second hands its state ``(m, l, O^T)`` to the first through
        shared memory (``O^T`` in ``o_smem``, ``[128, HB]`` float32 that nothing else uses any more),
        which merges it into its own and writes the output (or the split's partials); the V values were
        divided by ``v_mult``; the rows of ``O^T`` hold the dims in ``_nv_dim`` order (``NV_DIMS`` 1,
        NVFP4) or in ``_vreg_dim`` order (2, float8)."""
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HB, 16])
        HEADS_O: gl.constexpr = gl.SliceLayout(0, O_L)
        m_o = gl.convert_layout(m_i, HEADS_O)
        l_o = gl.convert_layout(gl.sum(l_rows, axis=0), HEADS_O)
        heads = hb * HB + gl.arange(0, HB, layout=HEADS_O)
        ml = ml_smem.reinterpret(gl.float32, [2 * HB], gl.SwizzledSharedLayout(
            vec=1, per_phase=1, max_phase=1, order=[0]))
        if CID == 1:
            o_smem.store(o)
            ml.slice(0, HB).store(m_o)
            ml.slice(HB, HB).store(l_o)
            _release(merge_ready)
        else:
            mbarrier.wait(merge_ready, 0)
            m1 = ml.slice(0, HB).load(HEADS_O)
            l1 = ml.slice(HB, HB).load(HEADS_O)
            m_all = gl.maximum(m_o, m1)
            m_safe = gl.where(m_all == float("-inf"), 0.0, m_all)
            a0 = gl.exp2(m_o - m_safe)
            a1 = gl.exp2(m1 - m_safe)
            l_o = l_o * a0 + l1 * a1
            o = o * a0[None, :] + o_smem.load(O_L) * a1[None, :]
            m_o = m_all
        if CID == 0:
            # Epilogue: O^T [128 dims, HB]; the V operand held v / v_mult.
            head_ok = heads < group
            h = (g * group + heads).to(gl.int64)
            dims = gl.arange(0, 128, layout=gl.SliceLayout(1, O_L))
            if NV_DIMS == 1:
                dims = _nv_dim(dims)
            else:
                dims = _vreg_dim(dims)
            dims = dims.to(gl.int64)
            o = o * v_mult
            if SPLIT:
                ws_rows = gl.cast(ws_rows, gl.int64)
                row = (t * num_kv_heads * group + h) * num_splits + split
                gl.store(ws_ptr + row, m_o, mask=head_ok)
                gl.store(ws_ptr + ws_rows + row, l_o, mask=head_ok)
                gl.store(ws_ptr + 2 * ws_rows + row[None, :] * 128 + dims[:, None], o, mask=head_ok[None, :])
                _launch_dependents()  # the split combine may be scheduled once every CTA is here
            else:
                vf = gl.full([HB], 1.0, gl.float32, layout=HEADS_O) * v_scale
                if HAS_V_SCALE:
                    vf = gl.minimum(gl.maximum(vf * gl.load(v_scale_ptr), -_FLT_MAX), _FLT_MAX)
                factor = vf / gl.where(l_o > 0, l_o, 1.0)  # no key: the accumulator is 0, the output 0
                ptrs = (out_ptr + t * stride_ot + h[None, :] * stride_oh + dims[:, None] * stride_od)
                gl.store(ptrs, (o * factor[None, :]).to(out_ptr.dtype.element_ty), mask=head_ok[None, :])

    # How far (in binades of the weights, base-2 logits) a score may exceed its head's reference maximum
    # before the maximum is recomputed: the weights stay below 2**_TAU, which float16 holds.
    _TAU = gl.constexpr(8.0)

    # Eight scores $8..$15 against their thresholds $16..$23: 1 in all eight outputs if any score of any
    # lane of the warp exceeds its threshold, else 0 (``vote.sync.any``). The comparisons chain on one
    # predicate (``setp.gt.or``). Written as a comparison, a ``max`` over the thread's elements and a vote
    # of that, triton 3.6, 3.7 and 3.9 pack the eight comparisons into a bit mask first: about 17 more
    # instructions per block (docs/sparse_gqa_hopper.md, "Fewer instructions per block").
    _WARP_ANY_GT8 = gl.constexpr(
        "{\n.reg .pred p, q;\nsetp.gt.f32 p, $8, $16;\n"
        + "".join(f"setp.gt.or.f32 p, ${8 + i}, ${16 + i}, p;\n" for i in range(1, 8))
        + "vote.sync.any.pred q, p, -1;\nselp.s32 $0, 1, 0, q;\n"
        + "".join(f"mov.b32 ${i}, $0;\n" for i in range(1, 8)) + "}\n")

    @gluon.jit
    def _first(a, b):
        """Combine function of a reduction over copies of one value."""
        return a

    @gluon.jit
    def _exact_step(u, o, m_i, l_rows, pt, red, HB: gl.constexpr, ROWS4: gl.constexpr):
        """``_softmax_pv``'s step with the block's maximum: the new running maximum ``m`` of each head
        (over its four warps' partial maxima, through ``red``), the weights ``p`` against it (stored as
        ``P^T`` to ``pt`` and published with a partition barrier), ``O^T`` and the row sums rescaled to
        it. Returns ``(p, O^T, m, l_rows)``."""
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HB, 16])
        # [4 partials, HB heads], every partial of a head in the thread that holds the head's scores
        PARTS: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[1, 0], [2, 0], [0, 1], [0, 8]], lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
            warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, HB])
        red.store(gl.max(gl.reshape(u, [4, 16, HB]), axis=1))
        _cta_barrier()
        m_blk = gl.convert_layout(gl.max(red.load(PARTS), axis=0), m_i.type.layout)
        m_new = gl.maximum(m_i, m_blk)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep every weight at 0
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(u - m_safe[None, :])
        if ROWS4:
            L3: gl.constexpr = l_rows.type.layout
            l_rows = l_rows * gl.convert_layout(alpha, gl.SliceLayout(0, gl.SliceLayout(1, L3)))[None, None, :]
        else:
            l_rows = l_rows * alpha[None, :]
        o = o * gl.convert_layout(alpha, gl.SliceLayout(0, O_L))[None, :]
        pt.store(p.to(gl.float16))
        fence_async_shared()
        _cta_barrier()  # every warp's part of P^T (and of a V tile) is stored before any warp's MMA reads them
        return p, o, m_new, l_rows

    @gluon.jit
    def _softmax_pv(acc, qk, valid, o, m_i, l_rows, v_tile, pt, red, flags, fb, HB: gl.constexpr,
                    ROWS4: gl.constexpr, V_REGS: gl.constexpr, LAZY: gl.constexpr):
        """One block's online-softmax step of a consumer, both kernels: the block's scores ``acc``
        (``S^T``, ``[64 keys, HB heads]``) times the per-head factor ``qk`` are base-2 logits (saturated,
        keys not ``valid`` at ``-inf``); returns ``(O^T, m, l_rows)`` after ``O^T += V^T P^T`` with the
        block's ``V`` tile ``v_tile`` (with ``V_REGS``: ``V^T`` itself, the register operand) and ``P^T``
        staged in ``pt`` (``l_rows`` shaped as ``ROWS4`` says).

        The block's maximum over its keys takes one partition barrier: each warp reduces its 16 keys in
        registers and shuffles, writes its 16 partial maxima to ``red`` ([4 warps, HB]), and after the
        barrier every thread reads the four partials of its heads (the barrier before the ``P V`` MMA
        keeps the next block's writes after these reads).

        With ``LAZY`` ``m`` is a reference maximum per head rather than the running maximum: the block's
        weights are first taken against it (``exp2(u - m)``), and only if a score exceeds it by more than
        ``_TAU`` is the block's maximum taken as above, the weights recomputed and ``O^T`` and the row
        sums rescaled. The weights stay below ``2**_TAU``; the softmax is the same, only its float16
        weights are rounded against a different reference. Each thread tests its own scores, each warp
        votes (``vote.sync.any``), the votes go through ``flags`` (``[4 buffers, 32 lanes, 4 warps]``
        int32; buffer ``fb``, callers alternate two per consumer between its blocks) and are read back
        after the barrier that publishes ``P^T``: most blocks need no cross-warp maximum and no rescale."""
        # base-2 logits, saturated; a key the row may not see at -inf (the upper clamp: one select per key,
        # not per score)
        hi = gl.where(valid, _FLT_MAX, float("-inf"))
        u = gl.minimum(gl.maximum(acc * qk[None, :], -_FLT_MAX), hi[:, None])
        if LAZY:
            m_ref = gl.where(m_i == float("-inf"), 0.0, m_i)  # no key yet: keep every weight at 0
            p = gl.exp2(u - m_ref[None, :])
            # the warp's vote in one instance per thread (all 8 of its scores, HB = 16), in every copy;
            # [4 warps, 2, 8 lane rows, 2, 4 lane columns, 2]: a thread's own copies lie along axes 1, 3, 5
            gl.static_assert(HB == 16)
            thr = gl.broadcast(u, (m_i + _TAU)[None, :])[1]
            over = gl.inline_asm_elementwise(_WARP_ANY_GT8, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
                                             [u, thr], dtype=gl.int32, is_pure=False, pack=8)
            over = gl.reduce(gl.reduce(gl.reduce(gl.reshape(over, [4, 2, 8, 2, 4, 2]), 5, _first), 3, _first), 1,
                             _first)
            vote = gl.permute(gl.reshape(over, [4, 32]), (1, 0))  # [lane, warp]
            if V_REGS:
                # every warp's part of the previous block's P V MMA has read P^T (the NVFP4 consumer
                # meets a partition barrier after that MMA; the float8 one would otherwise rely on the
                # compiler placing one here)
                _cta_barrier()
            flags.index(fb).store(vote)
            pt.store(p.to(gl.float16))
            fence_async_shared()
            _cta_barrier()  # every warp's part of P^T (and of a V tile) and its vote are stored
            # lane 0's word of each warp, in every thread
            VOTES: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[1], [2]], lane_bases=[[0]] * 5, warp_bases=[[0]] * 2, block_bases=[], shape=[4])
            rows = flags.reinterpret(gl.int32, [4 * 32, 4], gl.SwizzledSharedLayout(
                vec=1, per_phase=1, max_phase=1, order=[0]))
            if gl.max(rows.index(32 * fb).load(VOTES), axis=0) != 0:  # no MMA has read this P^T yet
                p, o, m_i, l_rows = _exact_step(u, o, m_i, l_rows, pt, red, HB, ROWS4)
        else:
            p, o, m_i, l_rows = _exact_step(u, o, m_i, l_rows, pt, red, HB, ROWS4)
        # the row sums stay per thread (summed over the keys once, after the loop): no cross-warp
        # reduction per block; with ROWS4 a thread adds its two key rows of each head as they come
        # ([4, 8, HB]: 4 registers, not 8; the NVFP4 consumer, which spills less so), else [64, HB]
        if ROWS4:
            l_rows = l_rows + gl.sum(gl.reshape(p, [4, 2, 8, HB]), axis=1)
        else:
            l_rows = l_rows + p
        if V_REGS:
            o = warpgroup_mma(v_tile, pt, o, is_async=True)
            o, v_tile = warpgroup_mma_wait(0, deps=(o, v_tile))
        else:
            o = warpgroup_mma(v_tile.permute((1, 0)), pt, o, is_async=True)
            o = warpgroup_mma_wait(0, deps=(o,))
        return o, m_i, l_rows

    @gluon.jit
    def _consumer_start(down, qk_scale, k_scale_ptr, q_ready, pages_ready, HEADS: gl.constexpr, CID: gl.constexpr,
                        HAS_K_SCALE: gl.constexpr):
        """Once consumer 0 has staged Q (``down``: the inverse powers of two of its rows): consumer 0
        hands Q over (every warp's part stored and fenced before the first MMA), consumer 1 waits for
        it, both wait for the page table. Returns the per-head score factor (base 2, saturated):
        ``qk_scale`` (the float scales), the device K scale and the query's power of two."""
        if CID == 0:
            _release(q_ready)
        else:
            mbarrier.wait(q_ready, 0)
        mbarrier.wait(pages_ready, 0)
        qk = gl.convert_layout(down, HEADS) * qk_scale
        if HAS_K_SCALE:
            qk = qk * gl.load(k_scale_ptr)
        return gl.minimum(gl.maximum(qk, -_FLT_MAX), _FLT_MAX)

    @gluon.jit
    def _consumer(q_ptr, stride_qt, stride_qh, stride_qd,
                  k_scale_ptr, v_scale_ptr,
                  out_ptr, stride_ot, stride_oh, stride_od,
                  ws_ptr, ws_rows,
                  num_kv_heads, group, num_head_blocks, num_splits, blocks_per_split, n_sel,
                  qk_scale, v_scale,
                  qs, kraw, vraw, vh, pt_smem, ml_smem, red_smem, flag_smem, page_keys, pages_ready, ready, kfree,
                  q_ready, merge_ready,
                  CID: gl.constexpr,
                  CPB: gl.constexpr, NR: gl.constexpr, HB: gl.constexpr, NQ: gl.constexpr,
                  HAS_K_SCALE: gl.constexpr, HAS_V_SCALE: gl.constexpr, SPLIT: gl.constexpr,
                  LAZY: gl.constexpr):
        """Consumer ``CID`` (0 or 1): blocks ``CID, CID + 2, ...`` of the split, with its own online
        softmax; consumer 0 stages Q, merges consumer 1's state into its own and writes the result."""
        pid = gl.program_id(0)
        t, g, hb, split, blk_lo, blk_hi = _cta_range(pid, num_kv_heads, num_head_blocks, num_splits,
                                                     blocks_per_split, n_sel * CPB)
        n = blk_hi - blk_lo
        down = _load_q(q_ptr, stride_qt, stride_qh, stride_qd, qs, t, g, hb, group, HB, NQ, CID == 0)
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HB, 32])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HB, 16])
        KL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        KEYS: gl.constexpr = gl.SliceLayout(1, S_L)
        HEADS: gl.constexpr = gl.SliceLayout(0, S_L)
        qk = _consumer_start(down, qk_scale, k_scale_ptr, q_ready, pages_ready, HEADS, CID, HAS_K_SCALE)
        j_lo = blk_lo // CPB

        if NQ == 2:  # a bfloat16 query's two pieces in one MMA (N = 2 HB: K read once), summed per head after
            SQ_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 2 * HB, 32])
            zero_q = gl.zeros([_BN, 2 * HB], gl.float32, layout=SQ_L)  # ignored (use_acc=False)
            q_two = qs.reinterpret(gl.float8e4nv, [2 * HB, 128], KL)
        else:
            zero_s = gl.zeros([_BN, HB], gl.float32, layout=S_L)  # ignored (use_acc=False): gives the layout
        o = gl.zeros([128, HB], gl.float32, layout=O_L)  # O^T
        m_i = gl.full([HB], float("-inf"), gl.float32, layout=HEADS)
        l_rows = gl.zeros([_BN, HB], gl.float32, layout=S_L)
        VA_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        pt = pt_smem.index(CID)
        for i in range(CID, n, 2):
            s = i % NR
            mbarrier.wait(ready.index(s), (i // NR) & 1)
            fence_async_shared()  # the stage's copies (generic proxy) before the MMA reads them
            k_tile = kraw.index(s).reinterpret(gl.float8e4nv, [_BN, 128], KL)
            if NQ == 2:
                accq = warpgroup_mma(k_tile, q_two.permute((1, 0)), zero_q, use_acc=False, is_async=True)
            else:  # float16: three pieces (N = 48 is no power of two), chained
                acc = warpgroup_mma(k_tile, qs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                acc = warpgroup_mma(k_tile, qs.index(1).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma(k_tile, qs.index(2).permute((1, 0)), acc, is_async=True)
            # while the MMA runs: the block's V bytes into registers, as the A operand of P V
            v_regs = _v_regs(vraw, s, VA_L)
            if NQ == 2:
                accq = warpgroup_mma_wait(0, deps=(accq,))
                acc = gl.convert_layout(gl.sum(gl.reshape(accq, [_BN, 2, HB]), axis=1), S_L)
            else:
                acc = warpgroup_mma_wait(0, deps=(acc,))
            # after this thread's MMA wait (its MMAs have read K) and its V loads: done with the stage
            _free_stage(kfree.index(s))
            valid = _block_keys(blk_lo + i, j_lo, page_keys, CPB, KEYS)

            o, m_i, l_rows = _softmax_pv(acc, qk, valid, o, m_i, l_rows, v_regs, pt, red_smem.index(CID), flag_smem,
                                         2 * CID + (i // 2) % 2, HB, False, True, LAZY)

        # Consumer 1's O^T goes to the K stage of its last block (block 1's, which no block uses, when it
        # had none): a stage is used by blocks s, s + NR, ..., the last of which is that block, so
        # neither the producer nor consumer 0 touches it again.
        last1 = gl.where(n >= 2, (n - 2) | 1, 1)
        o_buf = kraw.index(last1 % NR).reinterpret(gl.float32, [128, HB], gl.SwizzledSharedLayout(
            vec=1, per_phase=1, max_phase=1, order=[1, 0]))
        _merge_and_store(o, m_i, l_rows, t, g, hb, split, group, num_kv_heads, num_splits, v_scale, v_scale_ptr,
                         out_ptr, stride_ot, stride_oh, stride_od, ws_ptr, ws_rows, o_buf, ml_smem, merge_ready,
                         1.0, CID, HB, HAS_V_SCALE, SPLIT, 2)

    # -------------------------------------------------------------------------------------------------
    # NVFP4 caches (docs/sparse_gqa_hopper.md, "NVFP4 on the same structure")
    # -------------------------------------------------------------------------------------------------
    # Sixteen data bytes of two 16-value groups (registers $16, $17 the first group's bytes 0-7, $18, $19
    # the second's; value 2i of a group is the low nibble of its byte i, 2i + 1 the high nibble) and the
    # two groups' E4M3 scales (the low two bytes of $20, the first group's lowest; $21..$35 are copies)
    # -> the float16 of each value * its group's scale * 2**-7, exactly. Each nibble becomes the float16
    # of its E2M1 value * 2**-14 by integer operations and byte permutes (``e2m1_place_ptx``: bits placed,
    # subnormals included, no conversion instruction), multiplied by the float16 scale * 2**7 (exact: at
    # most 448 * 128; the product has at most 6 significant bits and lies in [2**-17, 21], inside
    # float16's exact range). One conversion and one multiply give both scales; each multiply takes one
    # of them as a float16 pair (ptxas selects the half in the multiply itself: no byte moves). Results:
    # the low-nibble values ($0..$3 the first group's bytes 0..7, $4..$7 the second's), then the
    # high-nibble values ($8..$15); callers keep that order (the dims permuted, see ``_nv_dim``). Until
    # this form each nibble was re-encoded as e4m3 and converted by ``cvt.rn.f16x2.e4m3x2``
    # (docs/sparse_gqa_hopper.md, "Bit placement instead of conversions").
    _FP4X32_TO_F16 = gl.constexpr(
        "{\n.reg .b32 t, u, e, z, c, c0, c1;\n.reg .b16 s0, s1, h0, h1;\n"
        "mov.b32 {s0, s1}, $20;\ncvt.rn.f16x2.e4m3x2 c, s0;\nmov.b32 t, 0x58005800;\nmul.rn.f16x2 c, c, t;\n"
        "mov.b32 {h0, h1}, c;\nmov.b32 c0, {h0, h0};\nmov.b32 c1, {h1, h1};\n"
        + e2m1_place_ptx("$16", ("$0", "$1"), ("$8", "$9")) + e2m1_place_ptx("$17", ("$2", "$3"), ("$10", "$11"))
        + e2m1_place_ptx("$18", ("$4", "$5"), ("$12", "$13"))
        + e2m1_place_ptx("$19", ("$6", "$7"), ("$14", "$15"))
        + "".join(f"mul.rn.f16x2 ${i}, ${i}, c0;\n" for i in (0, 1, 2, 3, 8, 9, 10, 11))
        + "".join(f"mul.rn.f16x2 ${i}, ${i}, c1;\n" for i in (4, 5, 6, 7, 12, 13, 14, 15)) + "}\n")

    @gluon.jit
    def _fp4_expand2(data, pair):
        """float16 ``lo, hi`` (each shaped as ``data``) of the E2M1 bytes ``data [..., 2, 8]`` (two scale
        groups, a thread's 16 bytes in one instance) times their group's E4M3 scale times ``2**-7``:
        the low nibbles' values and the high nibbles'. ``pair`` (int32, same shape) holds the first
        group's scale byte in bits 0-7 and the second's in bits 8-15."""
        return gl.inline_asm_elementwise(_FP4X32_TO_F16,
                                         "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,"
                                         "r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
                                         [data, pair], dtype=(gl.float16, gl.float16), is_pure=True, pack=16)

    @gluon.jit
    def _nv_dim(d):
        """The head dim held at tile column ``d`` of an expanded NVFP4 tile: within each 16-value group
        the 8 low-nibble values (dims 0, 2, .., 14 of the group) come first, then the 8 high-nibble ones."""
        return (d // 16) * 16 + (d % 8) * 2 + (d // 8) % 2

    @gluon.jit
    def _nv_kdim(c):
        """The head dim at column ``c`` of the register K operand (``_nv_kregs``) and of the staged query:
        ``c = 64 gi + 32 nib + 16 b2 + 8 b1 + 2 lc + b0`` holds dim ``32 lc + 16 gi + 2 b + nib`` (byte
        ``b = 4 b2 + 2 b1 + b0`` of group ``2 lc + gi``, nibble ``nib``)."""
        b = ((c >> 2) & 6) | (c & 1)
        return 32 * ((c >> 1) & 3) + 16 * ((c >> 6) & 1) + 2 * b + ((c >> 5) & 1)

    @gluon.jit
    def _nv_kregs(dat, sc, stage, A_L: gl.constexpr):
        """Stage ``stage`` of the K data ring ``dat`` [NR, 64 keys, 64 bytes] with its scales ``sc``
        [NR, 32, 16] (a key's 8 group scales in a row) as the float16 ``A`` operand of ``S^T = K Q^T``
        in registers (layout ``A_L``; values times ``2**-7``, columns in ``_nv_kdim`` order). A thread
        loads the 16 bytes (two groups) of each of its two keys that its ``A`` fragment needs, so the
        expanded values land in the fragment with no shuffle and no shared-memory round trip."""
        # [64 keys, 4 lane columns, 2 groups, 8 bytes]: warp w, lane l hold keys 16 w + l // 4 and
        # + 8, the lane column l % 4 (bytes 16 (l % 4) .. + 15 of each key)
        DL4: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 1, 0], [8, 0, 0, 0]],
            lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
            warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]], block_bases=[], shape=[_BN, 4, 2, 8])
        RAW4: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=1, order=[3, 2, 1, 0])
        data = dat.index(stage).reinterpret(gl.uint8, [_BN, 4, 2, 8], RAW4).load(DL4)
        SC2: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        # the two groups' scale bytes of each (key, lane column) in one 16-bit load
        pair = sc.index(stage).reinterpret(gl.uint16, [_BN, 4], SC2).load(gl.SliceLayout(2, gl.SliceLayout(3, DL4)))
        pair = gl.broadcast(gl.expand_dims(gl.expand_dims(pair.to(gl.int32), 2), 3), data)[0]
        lo, hi = _fp4_expand2(data, pair)
        v = gl.reshape(gl.join(lo, hi), [_BN, 4, 2, 2, 2, 2, 2])  # (key, lc, gi, b2, b1, b0, nib)
        v = gl.permute(v, [0, 2, 6, 3, 4, 1, 5])  # (key, gi, nib, b2, b1, lc, b0)
        return gl.convert_layout(gl.reshape(v, [_BN, 128]), A_L)

    @gluon.jit
    def _nv_issue_block(blk, stage, j_lo, page_phys, page_keys, cache_ptr, stride_cp, stride_ch, g,
                        kdat, vdat, ksc, vsc, PAGE_SIZE: gl.constexpr, CPB: gl.constexpr, PW: gl.constexpr):
        """Start the copies of block ``blk`` into stage ``stage``: the 64 keys' K and V data rows (64
        bytes each) and their K and V scale bytes (512 each, contiguous for a block). Only keys the row
        may see are copied, in pairs (K scales) and quads (V scales) led by such a key; the rest read as
        zeros. No commit.

        Run by the producer's ``PW`` warps: each thread copies 16 bytes of ``RC`` rows at a time,
        from one address per thread and block (the block's base plus an offset that is the same for
        every block) and constant offsets per chunk, which the copy instructions take as immediates."""
        RC: gl.constexpr = 8 * PW  # rows per chunk
        DL: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [PW, 1], [1, 0])  # [RC keys, 64 bytes]
        SCL: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [PW, 1], [1, 0])  # [32 chunks, 16 bytes]
        ONE: gl.constexpr = gl.BlockedLayout([1], [32], [PW], [0])
        jj = blk // CPB - j_lo
        p_phys = gl.sum(page_phys.index(jj).load(ONE), axis=0).to(gl.int64)
        p_keys = gl.sum(page_keys.index(jj).load(ONE), axis=0)
        o0 = (blk % CPB) * _BN
        n_vis = p_keys - o0  # the block's keys the row may see: a prefix (may be <= 0 or > _BN)
        slot = cache_ptr + p_phys * stride_cp + (2 * g) * stride_ch  # the K slot; V's is the next one
        r = gl.arange(0, RC, layout=gl.SliceLayout(1, DL))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, DL))
        pk = slot + o0 * 64 + ((r * 64)[:, None] + cols[None, :])
        pv = pk + stride_ch
        for i in gl.static_range(_BN // RC):
            rows_ok = (r + i * RC < n_vis)[:, None]
            async_load(kdat.index(stage).slice(i * RC, RC), pk + i * RC * 64, mask=rows_ok)
            async_load(vdat.index(stage).slice(i * RC, RC), pv + i * RC * 64, mask=rows_ok)
        c = gl.arange(0, 32, layout=gl.SliceLayout(1, SCL))
        b = gl.arange(0, 16, layout=gl.SliceLayout(0, SCL))
        # K: 8 bytes per key; V: 32 bytes per quad of keys, the same total
        ps = slot + (PAGE_SIZE * 64 + o0 * 8) + ((c * 16)[:, None] + b[None, :])
        async_load(ksc.index(stage), ps, mask=(2 * c < n_vis)[:, None])
        async_load(vsc.index(stage), ps + stride_ch, mask=(4 * (c // 2) < n_vis)[:, None])

    @gluon.jit
    def _nv_load_q(q_ptr, stride_qt, stride_qh, stride_qd, qs, t, g, hb, group, HB: gl.constexpr,
                   STORE: gl.constexpr):
        """This CTA's ``HB`` query rows scaled by a power of two per row (largest magnitude in
        ``[2**14, 2**15)``), as float16 into ``qs`` with ``STORE``. Returns the inverse powers of two."""
        QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        i = hb * HB + gl.arange(0, HB, layout=gl.SliceLayout(1, QL))
        ok = i < group
        h = (g * group + i).to(gl.int64)
        d = _nv_kdim(gl.arange(0, 128, layout=gl.SliceLayout(0, QL))).to(gl.int64)  # as K's columns
        x = gl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :] * stride_qd, mask=ok[:, None],
                    other=0.0).to(gl.float32)
        amax = gl.max(gl.abs(x), axis=1)
        e = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF
        k = gl.minimum(141 - e, 64)  # amax * 2**k in [2**14, 2**15) for a normal amax
        up = ((127 + k) << 23).to(gl.float32, bitcast=True)
        down = ((127 - k) << 23).to(gl.float32, bitcast=True)
        if STORE:
            qs.store((x * up[:, None]).to(gl.float16))
            fence_async_shared()
        return down

    @gluon.jit
    def _nv_vtile(dat, sc, stage, limit, tile):
        """Expand stage ``stage`` of the V data ring ``dat`` [NR, 64 keys, 64 bytes] with its scales
        ``sc`` (a [64 keys, 8 groups] view) into the float16 ``tile`` [64, 128] (values times ``2**-7``,
        the columns in ``_nv_dim`` order), the whole block at once (in parts, the compiler would put a
        barrier between the stores into the tile); the scales of the block's keys from ``limit`` on are
        zeroed (their values become exact zeros, whatever bytes the cache holds there)."""
        # [64 keys, 8 groups, 8 bytes]: a thread holds groups l and l + 4 of a key (l its lane % 4), so
        # one 16-byte store of a warp covers four different 16-byte columns of each 128-byte swizzle row
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [8, 4, 1], [4, 1, 1], [2, 1, 0])
        RAW3: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=1, order=[2, 1, 0])
        data = dat.index(stage).reinterpret(gl.uint8, [_BN, 8, 8], RAW3).load(L3)
        scale = sc.load(gl.SliceLayout(2, L3)).to(gl.int32)
        # (key, l, h): group 4 h + l; a thread's two groups' scales paired in one word (h = 0 the low byte)
        s0, s1 = gl.split(gl.permute(gl.reshape(scale, [_BN, 2, 4]), (0, 2, 1)))
        keys = gl.arange(0, _BN, layout=gl.SliceLayout(1, s0.type.layout))
        pair = gl.where((keys < limit)[:, None], s0 | (s1 << 8), 0)
        data = gl.permute(gl.reshape(data, [_BN, 2, 4, 8]), (0, 2, 1, 3))  # (key, l, h, byte)
        pair = gl.convert_layout(pair, gl.SliceLayout(2, gl.SliceLayout(3, data.type.layout)))  # the same registers
        pair = gl.broadcast(gl.expand_dims(gl.expand_dims(pair, 2), 3), data)[0]
        lo, hi = _fp4_expand2(data, pair)
        vals = gl.permute(gl.join(lo, hi), (0, 2, 1, 4, 3))  # (key, h, l, nibble, byte): columns as _nv_dim
        tile.store(gl.reshape(vals, [_BN, 128]))

    @gluon.jit
    def _nv_consumer(q_ptr, stride_qt, stride_qh, stride_qd,
                     k_scale_ptr, v_scale_ptr,
                     out_ptr, stride_ot, stride_oh, stride_od,
                     ws_ptr, ws_rows,
                     num_kv_heads, group, num_head_blocks, num_splits, blocks_per_split, n_sel,
                     qk_scale, v_scale,
                     qs, kdat, vdat, ksc, vsc, vh, pt_smem, ml_smem, red_smem, flag_smem, page_keys, pages_ready,
                     ready, kfree, q_ready, merge_ready,
                     CID: gl.constexpr, CPB: gl.constexpr, NR: gl.constexpr, HB: gl.constexpr,
                     HAS_K_SCALE: gl.constexpr, HAS_V_SCALE: gl.constexpr, SPLIT: gl.constexpr,
                     LAZY: gl.constexpr):
        """As ``_consumer``, for an NVFP4 cache: per block it expands V into its own float16 tile and K
        into registers (values times ``2**-7``), frees the raw stage, and runs ``S^T = K Q^T`` (float16
        ``wgmma``, K from registers) and ``O^T += V^T P^T``."""
        pid = gl.program_id(0)
        t, g, hb, split, blk_lo, blk_hi = _cta_range(pid, num_kv_heads, num_head_blocks, num_splits,
                                                     blocks_per_split, n_sel * CPB)
        n = blk_hi - blk_lo
        down = _nv_load_q(q_ptr, stride_qt, stride_qh, stride_qd, qs, t, g, hb, group, HB, CID == 0)
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HB, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HB, 16])
        KEYS: gl.constexpr = gl.SliceLayout(1, S_L)
        HEADS: gl.constexpr = gl.SliceLayout(0, S_L)
        SC3: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
        # the score factor also undoes the 2**-7 of the expanded K
        qk = _consumer_start(down, qk_scale * 128.0, k_scale_ptr, q_ready, pages_ready, HEADS, CID, HAS_K_SCALE)
        j_lo = blk_lo // CPB

        zero_s = gl.zeros([_BN, HB], gl.float32, layout=S_L)
        o = gl.zeros([128, HB], gl.float32, layout=O_L)  # O^T
        m_i = gl.full([HB], float("-inf"), gl.float32, layout=HEADS)
        l_rows = gl.sum(gl.reshape(gl.zeros([_BN, HB], gl.float32, layout=S_L), [4, 2, 8, HB]), axis=1)
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2)
        v_tile = vh.index(CID)
        pt = pt_smem.index(CID)
        for i in range(CID, n, 2):
            s = i % NR
            mbarrier.wait(ready.index(s), (i // NR) & 1)
            valid = _block_keys(blk_lo + i, j_lo, page_keys, CPB, KEYS)
            limit = _block_limit(blk_lo + i, j_lo, page_keys, CPB)
            # K scales: [64 keys, 8 groups], linear; V scales: token-quad order [16 quads, 8 groups, 4].
            v_sc = vsc.index(s).reinterpret(gl.uint8, [16, 8, 4], SC3).permute((0, 2, 1)).reshape([_BN, 8])
            _nv_vtile(vdat, v_sc, s, limit, v_tile)  # the V tile (read by the P V MMA after a barrier)
            k_regs = _nv_kregs(kdat, ksc, s, A_L)
            _free_stage(kfree.index(s))  # this thread's loads of the raw stage are done
            acc = warpgroup_mma(k_regs, qs.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            acc, k_regs = warpgroup_mma_wait(0, deps=(acc, k_regs))

            o, m_i, l_rows = _softmax_pv(acc, qk, valid, o, m_i, l_rows, v_tile, pt, red_smem.index(CID), flag_smem,
                                         2 * CID + (i // 2) % 2, HB, True, False, LAZY)
            _cta_barrier()  # every warp's MMAs have read the tiles before the next block overwrites them

        # consumer 1's O^T goes to its V tile, unused by then: the first 128 rows of the whole tile viewed
        # as float32 rows of HB (a reinterpreted view must cover its source exactly since triton 3.8)
        o_buf = vh.index(1).reinterpret(gl.float32, [_BN * 64 // HB, HB], gl.SwizzledSharedLayout(
            vec=1, per_phase=1, max_phase=1, order=[1, 0])).slice(0, 128)
        _merge_and_store(o, m_i, gl.sum(l_rows, axis=0), t, g, hb, split, group, num_kv_heads, num_splits,
                         v_scale, v_scale_ptr, out_ptr, stride_ot, stride_oh, stride_od, ws_ptr, ws_rows, o_buf,
                         ml_smem, merge_ready, 128.0, CID, HB, HAS_V_SCALE, SPLIT, 1)

    @gluon.jit
    def _any_consumer(q_ptr, stride_qt, stride_qh, stride_qd, k_scale_ptr, v_scale_ptr,
                      out_ptr, stride_ot, stride_oh, stride_od, ws_ptr, ws_rows,
                      num_kv_heads, group, num_head_blocks, num_splits, blocks_per_split, n_sel,
                      qk_scale, v_scale, qs, kraw, vraw, ksc, vsc, vh, pt_smem, ml_smem, red_smem, flag_smem,
                      page_keys, pages_ready, ready, kfree, q_ready, merge_ready,
                      CID: gl.constexpr, CPB: gl.constexpr, NR: gl.constexpr, HB: gl.constexpr, NQ: gl.constexpr,
                      HAS_K_SCALE: gl.constexpr, HAS_V_SCALE: gl.constexpr, SPLIT: gl.constexpr,
                      LAZY: gl.constexpr):
        """Consumer ``CID`` of either kernel: ``_nv_consumer`` for an NVFP4 cache (``NQ = 0``), else
        ``_consumer`` (``ksc`` / ``vsc`` unused)."""
        if NQ == 0:
            _nv_consumer(q_ptr, stride_qt, stride_qh, stride_qd, k_scale_ptr, v_scale_ptr,
                         out_ptr, stride_ot, stride_oh, stride_od, ws_ptr, ws_rows,
                         num_kv_heads, group, num_head_blocks, num_splits, blocks_per_split, n_sel,
                         qk_scale, v_scale, qs, kraw, vraw, ksc, vsc, vh, pt_smem, ml_smem, red_smem, flag_smem,
                         page_keys, pages_ready, ready, kfree, q_ready, merge_ready, CID, CPB, NR, HB, HAS_K_SCALE,
                         HAS_V_SCALE, SPLIT, LAZY)
        else:
            _consumer(q_ptr, stride_qt, stride_qh, stride_qd, k_scale_ptr, v_scale_ptr,
                      out_ptr, stride_ot, stride_oh, stride_od, ws_ptr, ws_rows,
                      num_kv_heads, group, num_head_blocks, num_splits, blocks_per_split, n_sel,
                      qk_scale, v_scale, qs, kraw, vraw, vh, pt_smem, ml_smem, red_smem, flag_smem, page_keys,
                      pages_ready, ready, kfree, q_ready, merge_ready, CID, CPB, NR, HB, NQ, HAS_K_SCALE, HAS_V_SCALE,
                      SPLIT, LAZY)

    # The list sizes are never specialised: with n_sel, blocks_per_split and num_splits all 1 Triton
    # would fold the block count to the constant 1, and Triton 3.6 then fails to lower the partitions
    # (found on an H200 with a one-page list).
    @gluon.jit(do_not_specialize=("n_sel", "blocks_per_split", "num_splits"))
    def _sparse_gqa_decode_hopper_kernel(
        q_ptr, stride_qt, stride_qh, stride_qd,  # [T, Hq, 128] bf16 / fp16
        cache_ptr, stride_cp, stride_ch, stride_co,  # float8 [pages, Hkv, ps, 256] / NVFP4 [pages, 2 Hkv, ps, 72]
        topk_ptr, stride_tk_t, stride_tk_h, stride_tk_j,  # int32 [T, Hkv, n_sel]
        bt_ptr, stride_bt_r, stride_bt_c,  # int32 [B, W]
        kv_lens_ptr, stride_kvl,  # int32 [T]
        qo_ptr, stride_qo,  # int32 [T]
        k_scale_ptr, v_scale_ptr,  # float32 device scales (HAS_K_SCALE / HAS_V_SCALE)
        out_ptr, stride_ot, stride_oh, stride_od,  # [T, Hq, 128] (not SPLIT)
        ws_ptr, ws_rows,  # SPLIT: the portable kernel's workspace, m [R], l [R], acc [R, 128]
        num_kv_heads, group, num_head_blocks,
        num_pages, num_req, max_blocks, n_sel,
        blocks_per_split, num_splits, decode_query_len,
        qk_scale, v_scale,  # as the portable kernel's
        PAGE_SIZE: gl.constexpr, HB: gl.constexpr, NQ: gl.constexpr, NR: gl.constexpr, BLOCK_SEL: gl.constexpr,
        HAS_K_SCALE: gl.constexpr, HAS_V_SCALE: gl.constexpr, SPLIT: gl.constexpr, LAZY: gl.constexpr,
        WORKER_REGS: gl.constexpr,
    ):
        """Both cache formats: ``NQ`` is the number of float8 query pieces for a float8 value cache
        (2 for a bfloat16 query, 3 for float16), 0 for an NVFP4 cache."""
        CPB: gl.constexpr = (PAGE_SIZE + _BN - 1) // _BN
        VL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        PL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * HB, element_bitwidth=16, rank=2)
        RAW: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=1, order=[1, 0])
        VL1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        if NQ == 0:  # NVFP4: the float16 query, the data and scale rings (K goes to registers)
            qs = gl.allocate_shared_memory(gl.float16, [HB, 128], VL)
            kraw = gl.allocate_shared_memory(gl.uint8, [NR, _BN, 64], RAW)
            vraw = gl.allocate_shared_memory(gl.uint8, [NR, _BN, 64], RAW)
            ksc = gl.allocate_shared_memory(gl.uint8, [NR, 32, 16], RAW)
            vsc = gl.allocate_shared_memory(gl.uint8, [NR, 32, 16], RAW)
        else:  # float8: the query's pieces, the raw K and V rings (K read by the MMA as is)
            KL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
            qs = gl.allocate_shared_memory(gl.float8e4nv, [NQ, HB, 128], KL)
            kraw = gl.allocate_shared_memory(gl.uint8, [NR, _BN, 128], KL)
            vraw = gl.allocate_shared_memory(gl.uint8, [NR, _BN, 128], KL)  # swizzled too: see _consumer
            ksc, vsc = kraw, vraw  # no scale rings (the partitions' shared argument lists name them)
        if NQ == 0:
            vh = gl.allocate_shared_memory(gl.float16, [2, _BN, 128], VL)  # one float16 V tile per consumer
        else:  # float8: V goes to registers (consumer 1's O^T goes through a ring stage at the end)
            vh = kraw
        page_phys = gl.allocate_shared_memory(gl.int32, [BLOCK_SEL, 1], VL1)  # the split's pages (producer)
        page_keys = gl.allocate_shared_memory(gl.int32, [BLOCK_SEL, 1], VL1)
        pt_smem = gl.allocate_shared_memory(gl.float16, [2, _BN, HB], PL)
        ml_smem = gl.allocate_shared_memory(gl.float32, [2, HB], VL1)  # consumer 1's (m, l)
        red_smem = gl.allocate_shared_memory(gl.float32, [2, 4, HB], gl.SwizzledSharedLayout(
            vec=1, per_phase=1, max_phase=1, order=[1, 0]))  # each consumer's per-warp block maxima
        if LAZY:  # each consumer's votes, two blocks' worth (_softmax_pv)
            flag_smem = gl.allocate_shared_memory(gl.int32, [4, 32, 4], gl.SwizzledSharedLayout(
                vec=1, per_phase=1, max_phase=1, order=[1, 0]))
        else:
            flag_smem = red_smem  # unused
        ready = gl.allocate_shared_memory(gl.int64, [NR, 1], mbarrier.MBarrierLayout())
        kfree = gl.allocate_shared_memory(gl.int64, [NR, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        merge_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        pages_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        PW: gl.constexpr = _NVPW if NQ == 0 else 4  # the producer's warps
        for s in gl.static_range(NR):
            mbarrier.init(ready.index(s), count=32 * PW)  # each producer thread, once its copies of a block landed
            mbarrier.init(kfree.index(s), count=128)  # each thread of the block's consumer: done with the stage
        mbarrier.init(q_ready, count=ARRIVALS)  # consumer 0: Q staged
        mbarrier.init(merge_ready, count=ARRIVALS)  # consumer 1: its state handed over
        mbarrier.init(pages_ready, count=1 + 32 * PW)  # the producer: the split's page table (_release)
        fence_async_shared()
        gl.warp_specialize(
            [(_any_consumer, (q_ptr, stride_qt, stride_qh, stride_qd, k_scale_ptr, v_scale_ptr,
                              out_ptr, stride_ot, stride_oh, stride_od, ws_ptr, ws_rows,
                              num_kv_heads, group, num_head_blocks, num_splits, blocks_per_split, n_sel,
                              qk_scale, v_scale, qs, kraw, vraw, ksc, vsc, vh, pt_smem, ml_smem, red_smem, flag_smem,
                              page_keys, pages_ready, ready, kfree, q_ready, merge_ready, 0, CPB, NR, HB, NQ,
                              HAS_K_SCALE, HAS_V_SCALE, SPLIT, LAZY)),
             (_any_consumer, (q_ptr, stride_qt, stride_qh, stride_qd, k_scale_ptr, v_scale_ptr,
                              out_ptr, stride_ot, stride_oh, stride_od, ws_ptr, ws_rows,
                              num_kv_heads, group, num_head_blocks, num_splits, blocks_per_split, n_sel,
                              qk_scale, v_scale, qs, kraw, vraw, ksc, vsc, vh, pt_smem, ml_smem, red_smem, flag_smem,
                              page_keys, pages_ready, ready, kfree, q_ready, merge_ready, 1, CPB, NR, HB, NQ,
                              HAS_K_SCALE, HAS_V_SCALE, SPLIT, LAZY)),
             (_producer, (cache_ptr, stride_cp, stride_ch, stride_co,
                          topk_ptr, stride_tk_t, stride_tk_h, stride_tk_j,
                          bt_ptr, stride_bt_r, stride_bt_c, kv_lens_ptr, stride_kvl, qo_ptr, stride_qo,
                          num_pages, num_req, max_blocks, n_sel,
                          num_kv_heads, num_head_blocks, num_splits, blocks_per_split, decode_query_len,
                          kraw, vraw, ksc, vsc, page_phys, page_keys, pages_ready, ready, kfree,
                          PAGE_SIZE, CPB, NR, BLOCK_SEL, NQ == 0, PW))],
            [4, PW], WORKER_REGS)

# =====================================================================================================
# host side
# =====================================================================================================


# Positions of the kernel's arguments that must be 16-byte aligned: ``cache_ptr`` (the cache-row copies do
# not compile otherwise: ``scripts/inspect_hopper.py --alignment --gqa``; :func:`supported` checks it).
ALIGNED_ARGS = (4,)


def supported(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the Hopper kernel serves this call (else the portable kernel does): an sm_90 device with
    Gluon, and an input layout :func:`layout_supported` accepts."""
    return HAS_GLUON and q.device.type == "cuda" and layout_supported(q, kv_cache) and _is_sm90(q.device)


def layout_supported(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The part of :func:`supported` that needs no GPU: shapes, strides, dtypes and the cache's base
    address. A float8 value cache needs its page, head and row strides in multiples of 16 bytes; an
    NVFP4 cache (uint8, ``[pages, 2 Hkv, page_size, 72]``, its slots ``page_size * 72`` bytes apart by
    the format) its page stride; both a 16-byte aligned base."""
    if kv_cache.dtype not in (torch.float8_e4m3fn, torch.uint8):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[2] != HEAD_DIM or kv_cache.data_ptr() % 16:
        return False
    if kv_cache.dtype == torch.uint8:
        page_size = kv_cache.shape[2]
        return not (kv_cache.stride(0) % 16 or kv_cache.stride()[1:] != (page_size * 72, 72, 1) or page_size % 4)
    return not any(s % 16 for s in kv_cache.stride()[:3])


def plan_launch(num_tokens: int, num_kv_heads: int, group: int, n_sel: int, page_size: int, num_sms: int,
                num_splits: int | None = None) -> LaunchPlan:
    """One CTA per (row, KV head, head block, split), about ``_CTAS_PER_SM`` resident per SM. The
    blocks of 64 keys of a row's selected pages are split over as many CTAs as fill the GPU once,
    keeping at least ``_MIN_BLOCKS_PER_SPLIT`` blocks per split."""
    block_h = BLOCK_H
    head_blocks = cdiv(group, block_h)
    n_blocks = n_sel * cdiv(page_size, BLOCK_N)
    programs = max(num_tokens * num_kv_heads * head_blocks, 1)
    if num_splits is None:
        num_splits = max(1, min(_CTAS_PER_SM * num_sms // programs, n_blocks // _MIN_BLOCKS_PER_SPLIT))
    num_splits = max(num_splits, cdiv(n_sel, _MAX_PAGES_PER_SPLIT))  # bounds the page table a CTA keeps
    num_splits = max(1, min(num_splits, max(n_blocks, 1)))
    per_split = cdiv(max(n_blocks, 1), num_splits)
    num_splits = cdiv(max(n_blocks, 1), per_split)  # no empty split
    return LaunchPlan(block_h=block_h, head_blocks=head_blocks, block_n=BLOCK_N, num_splits=num_splits,
                      num_warps=4, num_stages=NUM_STAGES, transposed=True)


def blocks_per_split(n_sel: int, page_size: int, plan: LaunchPlan) -> int:
    return cdiv(max(n_sel * cdiv(page_size, BLOCK_N), 1), plan.num_splits)


def make_launch(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len, qk_scale,
                v_scale, has_k_scale, has_v_scale, out, plan: LaunchPlan) -> KernelLaunch:
    """The decode launch of one plan. Tensor arguments, in order: q, kv_cache (as uint8), topk_pages,
    block_table, kv_segment_lens, qo_offset, k scale, v scale, out, workspace, as the portable kernel's
    launch (``ops/sparse_gqa.py::_make_launches``)."""
    if plan.block_h != BLOCK_H or plan.block_n != BLOCK_N or plan.num_stages < 2:
        raise ValueError(f"config: the Hopper sparse-GQA kernel takes block_h {BLOCK_H}, block_n {BLOCK_N} and "
                         f"num_stages >= 2, not {plan.block_h}, {plan.block_n}, {plan.num_stages}")
    num_tokens, num_q_heads, _ = q.shape
    num_pages, page_size = kv_cache.shape[0], kv_cache.shape[2]
    nvfp4 = is_nvfp4(kv_cache)
    num_kv_heads = kv_heads(kv_cache)
    n_sel = topk_pages.shape[2]
    group = num_q_heads // num_kv_heads
    per_split = blocks_per_split(n_sel, page_size, plan)
    cpb = cdiv(page_size, BLOCK_N)
    rows = num_tokens * num_q_heads * plan.num_splits
    args = (
        q, q.stride(0), q.stride(1), q.stride(2),
        kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        topk_pages, topk_pages.stride(0), topk_pages.stride(1), topk_pages.stride(2),
        block_table, block_table.stride(0), block_table.stride(1),
        kv_segment_lens, kv_segment_lens.stride(0),
        qo_offset, qo_offset.stride(0),
        out, out,
        out, out.stride(0), out.stride(1), out.stride(2),
        out, rows,
        num_kv_heads, group, plan.head_blocks,
        num_pages, block_table.shape[0], block_table.shape[1], n_sel,
        per_split, plan.num_splits, decode_query_len,
        qk_scale, v_scale,
    )
    meta = dict(PAGE_SIZE=page_size, HB=plan.block_h, NR=plan.num_stages,
                BLOCK_SEL=max(next_pow2(cdiv(per_split, cpb) + 1), 2), HAS_K_SCALE=has_k_scale,
                HAS_V_SCALE=has_v_scale, SPLIT=plan.num_splits > 1, LAZY=per_split >= _LAZY_MIN_BLOCKS,
                WORKER_REGS=_WORKER_REGS)
    meta["NQ"] = 0 if nvfp4 else 3 if q.dtype == torch.float16 else 2
    kernel = _sparse_gqa_decode_hopper_kernel
    grid = (num_tokens * num_kv_heads * plan.head_blocks * plan.num_splits,)
    return KernelLaunch(kernel, grid, args, meta, num_warps=4, device=q.device, maxnreg=_MAXNREG,
                        aligned=ALIGNED_ARGS, ptx_options=hopper_ptx_options())


__all__ = ["ALIGNED_ARGS", "BLOCK_N", "HAS_GLUON", "NUM_STAGES", "make_launch", "plan_launch", "supported",
           "warn_portable_on_sm90"]
