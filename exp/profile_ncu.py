"""One warm-up call then one profiled call of a Hopper MLA form (run under ncu with --launch-skip 1).
Usage: python exp/profile_ncu.py FORM   FORM: few_late16 | main128 | main64 | main584 | few584"""
import sys
import torch
from torch_sparse_mla.bench import mla
from torch_sparse_mla.ops import sparse_mla as mla_ops
from torch_sparse_mla.ops import sparse_mla_hopper as hopper
from torch_sparse_mla.ops.sparse_mla import sparse_mla_decode_triton

form = sys.argv[1]
hopper._RAW_RING = False
hopper._RAW_RING_64 = {"fp8_584": False, "fp8_656": False}
hopper._EARLY_ISSUE["few"] = False
mla_ops._PLANS.clear()
fmt, heads, k, kx = {"few_late16": ("fp8_656", 16, 2048, 0), "main128": ("fp8_656", 128, 2048, 0),
                     "main64": ("fp8_656", 64, 2048, 0), "main584": ("fp8_584", 64, mla.WINDOW, 512),
                     "few584": ("fp8_584", 16, mla.WINDOW, 512)}[form]
kwargs = mla._inputs(fmt, heads, k, kx, 128, "cuda")
names = ("q", "kv_cache", "indices", "softmax_scale", "kv_format", "head_dim_v", "topk_length", "attn_sink",
         "extra_kv_cache", "extra_indices", "extra_topk_length")
args = [kwargs.get(n) for n in names]
out = torch.empty(128, heads, 512, dtype=torch.bfloat16, device="cuda")
lse = torch.empty(128, heads, dtype=torch.float32, device="cuda")
for _ in range(2):
    sparse_mla_decode_triton(*args, out=out, lse=lse)
torch.cuda.synchronize()
print(form, "done", flush=True)
