"""Issue rate of four instructions the sparse-GQA NVFP4 expansion uses, on this GPU (CUDA only):
``cvt.rn.f16x2.e4m3x2`` (F2FP), ``prmt.b32`` (PRMT), ``lop3.b32`` and ``mul.rn.f16x2`` (HMUL2).

    python scripts/conversion_rate.py

Each thread of 16 four-warp programs per SM runs a loop of 16 independent chains of one instruction
(inline PTX), and the line printed is warp-instructions per SM and cycle at 1.98 GHz (an H200's
clock). The conversion's loop also holds the byte moves ptxas adds to feed it a 16-bit operand (count
them with ``cuobjdump -sass``). Not a test: docs/sparse_gqa_hopper.md, "Bit placement instead of
conversions", has the figures.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# one step of chain {d} (its 16-bit halves h{i}, g{i}); x is a constant operand
BODY = {
    "cvt": "mov.b32 {{h{i}, g{i}}}, {d}; cvt.rn.f16x2.e4m3x2 {d}, h{i};",
    "prmt": "prmt.b32 {d}, {d}, x, 0x1404;",
    "lop3": "lop3.b32 {d}, {d}, x, 0x0E0E0E0E, 0xE4;",
    "hmul2": "mul.rn.f16x2 {d}, {d}, x;",
}
CHAINS, REPS, ITERS = 16, 16, 64
CLOCK_HZ = 1.98e9


def asm_for(kind: str) -> str:
    """Inline PTX: ``REPS`` steps of each of ``CHAINS`` chains started from distinct values (so that
    nothing folds), then all of them combined into the output (so that nothing is dead)."""
    regs = [f"r{i}" for i in range(CHAINS)]
    halves = ", ".join(f"h{i}, g{i}" for i in range(CHAINS))
    lines = ["{", f".reg .b32 {', '.join(regs)}, x;", f".reg .b16 {halves};", "mov.b32 x, $1;"]
    lines += [f"add.u32 {r}, $1, {1234567 * (i + 1)};" for i, r in enumerate(regs)]
    lines += [BODY[kind].format(d=r, i=i) for _ in range(REPS) for i, r in enumerate(regs)]
    lines += [f"xor.b32 r0, r0, {r};" for r in regs[1:]] + ["mov.b32 $0, r0;", "}"]
    return "\n".join(lines)


@triton.jit
def _kernel(x_ptr, o_ptr, ASM: tl.constexpr, ITERS: tl.constexpr):
    i = tl.program_id(0) * 128 + tl.arange(0, 128)
    acc = tl.load(x_ptr + i)
    for _ in range(ITERS):
        acc = tl.inline_asm_elementwise(ASM, "=r,r", [acc], dtype=tl.int32, is_pure=True, pack=1)
    tl.store(o_ptr + i, acc)


def main() -> None:
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    programs = n_sm * 16
    x = torch.randint(0, 2**30, (programs * 128,), dtype=torch.int32, device="cuda")
    o = torch.empty_like(x)
    for kind in BODY:
        asm = asm_for(kind)

        def run():
            _kernel[(programs,)](x, o, ASM=asm, ITERS=ITERS, num_warps=4)
        run()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(run, warmup=20, rep=200)
        warp_instructions = programs * 4 * CHAINS * REPS * ITERS
        rate = warp_instructions / n_sm / (ms * 1e-3 * CLOCK_HZ)
        print(f"{kind:6s} {ms * 1e3:9.1f} us  {rate:5.2f} warp-instructions / SM / cycle (at 1.98 GHz)")


if __name__ == "__main__":
    main()
