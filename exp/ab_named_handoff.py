"""MLA Hopper: P hand-off on named barriers vs mbarriers; CUDA-graph replay, same process, alternating."""
import torch
from torch_sparse_mla.bench import mla
from torch_sparse_mla.bench.common import graph_us
from torch_sparse_mla.ops import sparse_mla_hopper as hopper
from torch_sparse_mla.ops import sparse_mla as mla_ops
from torch_sparse_mla.ops.sparse_mla import sparse_mla_decode_triton
names = ("q", "kv_cache", "indices", "softmax_scale", "kv_format", "head_dim_v", "topk_length", "attn_sink",
         "extra_kv_cache", "extra_indices", "extra_topk_length")
extra = [("V3.2 fp8_656", "fp8_656", 128, 2048, 0, 16), ("V3.2 fp8_656", "fp8_656", 128, 2048, 0, 2),
         ("V4", "fp8_584", 64, mla.WINDOW, 512, 1), ("V4", "fp8_584", 64, mla.WINDOW, 512, 8)]
for label, kv_format, num_heads, k, k_extra, num_tokens in list(mla.CONFIGS) + extra:
    kwargs = mla._inputs(kv_format, num_heads, k, k_extra, num_tokens, "cuda")
    call_args = [kwargs.get(n) for n in names]
    res, outs = {True: [], False: []}, {}
    for rnd in range(2):
        for named in (True, False):
            hopper._NAMED_HANDOFF = named
            mla_ops._PLANS.clear()  # the plan cache keys on shapes, not on the switch
            out = torch.empty(num_tokens, num_heads, 512, dtype=torch.bfloat16, device="cuda")
            lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device="cuda")
            def run(out=out, lse=lse):
                sparse_mla_decode_triton(*call_args, out=out, lse=lse)
            res[named].append(graph_us(run))
            outs[named] = (out.clone(), lse.clone())
    same = torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
    print(f"{kv_format} H={num_heads} K={k}+{k_extra} T={num_tokens}: named {min(res[True]):.1f} "
          f"({', '.join(f'{x:.1f}' for x in res[True])})  mbar {min(res[False]):.1f} "
          f"({', '.join(f'{x:.1f}' for x in res[False])})  bitwise_equal={same}", flush=True)
hopper._NAMED_HANDOFF = False
