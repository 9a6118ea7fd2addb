"""The few-heads kernel (late producer order, two stages) at several split counts (CUDA-graph replay)."""
import torch
from torch_sparse_mla.bench import mla
from torch_sparse_mla.bench.common import graph_us
from torch_sparse_mla.ops import sparse_mla as mla_ops
from torch_sparse_mla.ops import sparse_mla_hopper as hopper
from torch_sparse_mla.ops.sparse_mla import sparse_mla_decode_triton

hopper._RAW_RING = False
hopper._RAW_RING_64 = {"fp8_584": False, "fp8_656": False}
hopper._EARLY_ISSUE["few"] = False
names = ("q", "kv_cache", "indices", "softmax_scale", "kv_format", "head_dim_v", "topk_length", "attn_sink",
         "extra_kv_cache", "extra_indices", "extra_topk_length")
for fmt, heads, k, kx, tokens in [("fp8_656", 16, 2048, 0, 128), ("fp8_656", 16, 2048, 0, 64),
                                  ("fp8_656", 16, 2048, 0, 16), ("fp8_584", 16, mla.WINDOW, 512, 128)]:
    kwargs = mla._inputs(fmt, heads, k, kx, tokens, "cuda")
    args = [kwargs.get(n) for n in names]
    out = torch.empty(tokens, heads, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(tokens, heads, dtype=torch.float32, device="cuda")
    res = {}
    for s in (None, 1, 2, 3, 4, 8):
        mla_ops._PLANS.clear()
        res[s] = graph_us(lambda: sparse_mla_decode_triton(*args, out=out, lse=lse, num_splits=s))
    print(f"{fmt} H={heads} T={tokens}: " + "  ".join(f"splits={s}: {v:.1f}" for s, v in res.items()), flush=True)
