"""The 64-head Hopper kernel with its P hand-off on named barriers (_NAMED_HANDOFF) on small inputs of every
format, 1 and 3 splits, against the mbarrier hand-off (bitwise). Meant to run under compute-sanitizer."""
import torch
from torch_sparse_mla.bench import mla
from torch_sparse_mla.ops import sparse_mla as mla_ops
from torch_sparse_mla.ops import sparse_mla_hopper as hopper
from torch_sparse_mla.ops.sparse_mla import sparse_mla_decode_triton

names = ("q", "kv_cache", "indices", "softmax_scale", "kv_format", "head_dim_v", "topk_length", "attn_sink",
         "extra_kv_cache", "extra_indices", "extra_topk_length")
ok = True
for kv_format, k, k_extra in (("fp8_656", 256, 0), ("fp8_584", 128, 64), ("auto", 256, 0)):
    kwargs = mla._inputs(kv_format, 64, k, k_extra, 3, "cuda")
    args = [kwargs.get(n) for n in names]
    for splits in (1, 3):
        outs = {}
        for named in (False, True):
            hopper._NAMED_HANDOFF = named
            hopper._RAW_RING_64 = {"fp8_584": False, "fp8_656": False}  # the two-stage kernel has the switch
            mla_ops._PLANS.clear()
            out = torch.empty(3, 64, 512, dtype=torch.bfloat16, device="cuda")
            lse = torch.empty(3, 64, dtype=torch.float32, device="cuda")
            sparse_mla_decode_triton(*args, out=out, lse=lse, num_splits=splits)
            torch.cuda.synchronize()
            outs[named] = (out, lse)
        same = torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
        ok &= same
        print(f"{kv_format} splits={splits}: named == mbarrier: {same}", flush=True)
hopper._NAMED_HANDOFF = False
hopper._RAW_RING_64 = {"fp8_584": True, "fp8_656": True}
mla_ops._PLANS.clear()
raise SystemExit(0 if ok else 1)
