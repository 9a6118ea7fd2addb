"""Few-heads Hopper MLA kernel against the 64-head one on the same inputs (CUDA-graph replay, same process,
alternating, best of two). Prints µs and the relative difference of the outputs."""
import torch
from torch_sparse_mla.bench import mla
from torch_sparse_mla.bench.common import graph_us
from torch_sparse_mla.ops import sparse_mla as mla_ops
from torch_sparse_mla.ops import sparse_mla_hopper as hopper
from torch_sparse_mla.ops.sparse_mla import sparse_mla_decode_triton

names = ("q", "kv_cache", "indices", "softmax_scale", "kv_format", "head_dim_v", "topk_length", "attn_sink",
         "extra_kv_cache", "extra_indices", "extra_topk_length")
CONFIGS = [("fp8_656", 16, 2048, 0, t) for t in (1, 4, 16, 32, 64, 128, 256)] + [
    ("fp8_656", 32, 2048, 0, 128), ("fp8_656", 20, 2048, 0, 128), ("fp8_656", 8, 2048, 0, 128),
    ("fp8_584", 16, mla.WINDOW, 512, 128), ("fp8_584", 32, mla.WINDOW, 512, 128), ("auto", 16, 2048, 0, 64)]
# form: (config, producer issues early in the two-stage few-heads kernel, fp8_656 at 16 heads: raw ring)
FORMS = {"few": (None, True, True), "few_stages": (None, True, False), "few_late": (None, False, False),
         "rows64": (dict(transposed=False, block_h=64), True, True)}
for kv_format, heads, k, k_extra, tokens in CONFIGS:
    kwargs = mla._inputs(kv_format, heads, k, k_extra, tokens, "cuda")
    call_args = [kwargs.get(n) for n in names]
    res, outs = {f: [] for f in FORMS}, {}
    for _ in range(2):
        for form, (cfg, early, ring) in FORMS.items():
            hopper._EARLY_ISSUE["few"] = early
            hopper._RAW_RING = ring
            mla_ops._PLANS.clear()  # the plan cache does not key on the flag
            out = torch.empty(tokens, heads, 512, dtype=torch.bfloat16, device="cuda")
            lse = torch.empty(tokens, heads, dtype=torch.float32, device="cuda")

            def run(out=out, lse=lse, cfg=cfg):
                sparse_mla_decode_triton(*call_args, out=out, lse=lse, config=cfg)
            res[form].append(graph_us(run))
            outs[form] = out.float()
    diff = ((outs["few"] - outs["rows64"]).norm() / outs["rows64"].norm()).item()
    late = ((outs["few_late"] - outs["few_stages"]).norm() / outs["few_stages"].norm()).item()
    times = "  ".join(f"{f} {min(res[f]):.1f}" for f in FORMS)
    print(f"{kv_format} H={heads} K={k}+{k_extra} T={tokens}: {times}  ({min(res['rows64']) / min(res['few']):.2f}x)"
          f"  rel diff few vs rows64 {diff:.1e}, few_late vs few_stages {late:.0e}", flush=True)
hopper._EARLY_ISSUE["few"] = True
hopper._RAW_RING = True
