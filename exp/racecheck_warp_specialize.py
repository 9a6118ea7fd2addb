"""A Gluon kernel with nothing but warp specialisation: two partitions that each write their own half of
a global buffer (no shared memory of their own). Under racecheck, any hazard reported is Triton's."""
import sys
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _part(out_ptr, n, base: gl.constexpr):
    offs = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
    gl.store(out_ptr + gl.program_id(0) * 256 + base + offs, offs + n)


@gluon.jit
def _ws_kernel(out_ptr, n, REGS: gl.constexpr):
    if REGS:
        gl.warp_specialize([(_part, (out_ptr, n, 0)), (_part, (out_ptr, n, 128))], [4], [80])
    else:
        gl.warp_specialize([(_part, (out_ptr, n, 0)), (_part, (out_ptr, n, 128))], [4])


if __name__ == "__main__":
    for regs in (False, True):
        out = torch.zeros(8 * 256, dtype=torch.int32, device="cuda")
        _ws_kernel[(8,)](out, 5, REGS=regs, num_warps=4)
        torch.cuda.synchronize()
        ref = (torch.arange(128, device="cuda", dtype=torch.int32) + 5).repeat(16)
        print(f"regs={regs}: correct={torch.equal(out, ref)}", flush=True)
