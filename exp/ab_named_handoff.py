"""The 64-head Hopper MLA kernel: main's form (mbarrier hand-off, convert then issue) against the P hand-off on
named barriers, the producer issuing before converting (EARLY) and, for fp8_584, the raw ring (the
consumers convert). CUDA-graph replay, same process, alternating, best of two; outputs compared bitwise
with main's form."""
import torch
from torch_sparse_mla.bench import mla
from torch_sparse_mla.bench.common import graph_us
from torch_sparse_mla.ops import sparse_mla as mla_ops
from torch_sparse_mla.ops import sparse_mla_hopper as hopper
from torch_sparse_mla.ops.sparse_mla import sparse_mla_decode_triton

names = ("q", "kv_cache", "indices", "softmax_scale", "kv_format", "head_dim_v", "topk_length", "attn_sink",
         "extra_kv_cache", "extra_indices", "extra_topk_length")
extra = [("V3.2 fp8_656", "fp8_656", 128, 2048, 0, 16), ("V3.2 fp8_656", "fp8_656", 128, 2048, 0, 2),
         ("V4", "fp8_584", 64, mla.WINDOW, 512, 1), ("V4", "fp8_584", 64, mla.WINDOW, 512, 8)]
# (named hand-off, early issue, raw ring (fp8 formats), fp8_656 raw-ring register split)
FORMS = {"main": (False, False, False, None), "named": (True, False, False, None), "early": (False, True, False, None),
         "ring64": (False, False, True, (208, 48)), "ring64_r216": (False, False, True, (216, 40))}
rows64 = dict(transposed=False, block_h=64)  # the 64-head kernel also where the few-heads one is the default
for label, kv_format, num_heads, k, k_extra, num_tokens in list(mla.CONFIGS) + extra:
    kwargs = mla._inputs(kv_format, num_heads, k, k_extra, num_tokens, "cuda")
    call_args = [kwargs.get(n) for n in names]
    res, outs = {f: [] for f in FORMS}, {}
    for _ in range(2):
        for form, (named, early, ring, regs) in FORMS.items():
            hopper._NAMED_HANDOFF, hopper._EARLY_ISSUE["rows"] = named, early
            hopper._RAW_RING_64 = {"fp8_584": ring, "fp8_656": ring}
            hopper._WORKER_REGS_R64["fp8_656"] = regs or (208, 48)
            mla_ops._PLANS.clear()  # the plan cache keys on shapes, not on these switches
            out = torch.empty(num_tokens, num_heads, 512, dtype=torch.bfloat16, device="cuda")
            lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device="cuda")

            def run(out=out, lse=lse):
                sparse_mla_decode_triton(*call_args, out=out, lse=lse, config=rows64)
            res[form].append(graph_us(run))
            outs[form] = (out.clone(), lse.clone())
    same = {f: torch.equal(outs[f][0], outs["main"][0]) and torch.equal(outs[f][1], outs["main"][1]) for f in FORMS}
    print(f"{kv_format} H={num_heads} K={k}+{k_extra} T={num_tokens}: "
          + "  ".join(f"{f} {min(res[f]):.1f}" for f in FORMS) + f"  bitwise_equal={same}", flush=True)
hopper._NAMED_HANDOFF, hopper._EARLY_ISSUE["rows"] = False, False
hopper._RAW_RING_64 = {"fp8_584": True, "fp8_656": True}
hopper._WORKER_REGS_R64["fp8_656"] = (208, 48)
mla_ops._PLANS.clear()
