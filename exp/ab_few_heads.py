"""Few-heads Hopper MLA kernels against the 64-head ones on the same inputs (CUDA-graph replay, same
process, alternating, best of two). Prints µs per form and the relative difference of the outputs."""
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
ROWS64 = dict(transposed=False, block_h=64)
# form: config and module switches (few-heads producer order, fp8_656 few-heads raw ring, 64-head raw ring)
FORMS = {
    "few": (None, dict(early=True, ring=True, ring64=True)),  # the branch's default
    "few_stages": (None, dict(early=True, ring=False, ring64=True)),
    "few_late": (None, dict(early=False, ring=False, ring64=True)),
    "rows64_ring": (ROWS64, dict(early=True, ring=True, ring64=True)),
    "rows64_main": (ROWS64, dict(early=True, ring=True, ring64=False)),  # main's kernel
}


def switch(early, ring, ring64):
    hopper._EARLY_ISSUE["few"] = early
    hopper._RAW_RING = ring
    hopper._RAW_RING_64 = {"fp8_584": ring64, "fp8_656": ring64}
    mla_ops._PLANS.clear()  # the plan cache keys on shapes, not on these switches


for kv_format, heads, k, k_extra, tokens in CONFIGS:
    kwargs = mla._inputs(kv_format, heads, k, k_extra, tokens, "cuda")
    call_args = [kwargs.get(n) for n in names]
    res, outs = {f: [] for f in FORMS}, {}
    for _ in range(2):
        for form, (cfg, switches) in FORMS.items():
            switch(**switches)
            out = torch.empty(tokens, heads, 512, dtype=torch.bfloat16, device="cuda")
            lse = torch.empty(tokens, heads, dtype=torch.float32, device="cuda")

            def run(out=out, lse=lse, cfg=cfg):
                sparse_mla_decode_triton(*call_args, out=out, lse=lse, config=cfg)
            res[form].append(graph_us(run))
            outs[form] = out.float()
    base = outs["rows64_main"]
    diffs = {f: ((outs[f] - base).norm() / base.norm()).item() for f in FORMS if f != "rows64_main"}
    times = "  ".join(f"{f} {min(res[f]):.1f}" for f in FORMS)
    print(f"{kv_format} H={heads} K={k}+{k_extra} T={tokens}: {times}  "
          f"(main/few {min(res['rows64_main']) / min(res['few']):.2f}x)  rel diff vs main "
          + " ".join(f"{f} {d:.0e}" for f, d in diffs.items()), flush=True)
switch(early=True, ring=True, ring64=True)
