"""One small call of one new Hopper kernel form against the PyTorch reference; run each form in its own process
under `timeout` so a hang names its kernel. Usage: python exp/smoke_new_kernels.py FORM
FORM: few16_656 few16_656_stages few32_656 few16_584 few16_584_stages few16_auto rows64_ring_656 rows64_ring_584
named_656"""
import sys
import torch
from torch_sparse_mla.bench import mla
from torch_sparse_mla.ops import sparse_mla as mla_ops
from torch_sparse_mla.ops import sparse_mla_hopper as hopper
from torch_sparse_mla.ops.sparse_mla import sparse_mla_decode_torch, sparse_mla_decode_triton

form = sys.argv[1]
fmt = next({"656": "fp8_656", "584": "fp8_584", "auto": "auto"}[p] for p in form.split("_") if p in ("656", "584", "auto"))
heads = 16 if form.startswith("few16") else 32 if form.startswith("few32") else 64
cfg = dict(transposed=False, block_h=64) if heads == 64 else dict(transposed=True, block_h=heads)
hopper._RAW_RING = not form.endswith("stages")
hopper._RAW_RING_64 = {"fp8_584": "ring" in form, "fp8_656": "ring" in form}
hopper._NAMED_HANDOFF = form.startswith("named")
k_extra = 64 if fmt == "fp8_584" else 0
kwargs = mla._inputs(fmt, heads, 256, k_extra, 3, "cuda")
names = ("q", "kv_cache", "indices", "softmax_scale", "kv_format", "head_dim_v", "topk_length", "attn_sink",
         "extra_kv_cache", "extra_indices", "extra_topk_length")
args = [kwargs.get(n) for n in names]
ref_out = torch.empty(3, heads, 512, dtype=torch.bfloat16, device="cuda")
ref_lse = torch.empty(3, heads, dtype=torch.float32, device="cuda")
sparse_mla_decode_torch(*args, out=ref_out, lse=ref_lse)
for splits in (1, 3):
    mla_ops._PLANS.clear()
    out = torch.empty(3, heads, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(3, heads, dtype=torch.float32, device="cuda")
    sparse_mla_decode_triton(*args, out=out, lse=lse, num_splits=splits, config=cfg)
    torch.cuda.synchronize()
    err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
    lse_err = (lse - ref_lse).abs().max().item()
    print(f"{form} splits={splits}: rel err {err:.1e}, lse max abs err {lse_err:.1e}", flush=True)
