"""Run a DeepSeek-V4-Flash-shaped and a MiniMax-M3-shaped decode step, built from torch_sparse_mla.

Each step runs eagerly and through torch.compile(fullgraph=True) - on a GPU with
mode="reduce-overhead", so the whole step is one CUDA graph - is checked against a float64
reference, and is timed next to the same step written in plain PyTorch (on a GPU compiled the same
way). On a CPU the steps are smaller, run the CPU kernels and compile without CUDA graphs.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from torch_sparse_mla.demo import deepseek_v4, minimax_m3
from torch_sparse_mla.demo._common import say

# (batch, context) defaults: model-sized on a GPU, small on a CPU (where the point is correctness)
DEFAULTS = {"cuda": (32, 8192), "cpu": (2, 600)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torch_sparse_mla.demo", description=__doc__.splitlines()[0],
                                epilog=" ".join(__doc__.splitlines()[2:]))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda or cpu (default: cuda when a GPU is present)")
    p.add_argument("--batch-size", type=int, help="decode requests per step (default: 32 on a GPU, 2 on a CPU)")
    p.add_argument("--context-len", type=int, help="longest context in tokens (default: 8192 on a GPU, 600 on a CPU)")
    p.add_argument("--v4-layers", default="1,4,128,4",
                   help="compress ratio of each DeepSeek-V4 layer: 1 (sliding window only), 4 (C4A) or 128 (C128A)")
    p.add_argument("--m3-layers", type=int, default=2, help="MiniMax-M3 layers")
    p.add_argument("--m3-format", default="fp8", choices=sorted(minimax_m3.FORMATS), help="MiniMax-M3 cache format")
    p.add_argument("--heads", type=int, help="DeepSeek-V4 query heads (default 64; 16 at tensor-parallel 4)")
    p.add_argument("--iters", type=int, help="calls per timing loop (default: 50 on a GPU, 2 on a CPU)")
    p.add_argument("--only", choices=("v4", "m3"), help="run one of the two steps")
    p.add_argument("--compile-plain", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the plain-PyTorch steps too (default: on a GPU of compute capability 8.9 or later; "
                        "on a CPU inductor's C++ build of them takes minutes, and before sm_89 inductor cannot "
                        "compile their float8 code)")
    return p


def default_compile_plain(device: torch.device) -> tuple[bool, str]:
    """Whether the plain-PyTorch steps are compiled when ``--compile-plain`` is not given, and why not.
    Their float8 casts compile to Triton's float8 types, which Triton refuses before sm_89 (an A100):
    inductor then fails (pytorch/pytorch#167082), where the library's steps, whose float8 work is in
    its own operators, compile."""
    if device.type != "cuda":
        return False, "on a CPU inductor's C++ build of them takes minutes"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return False, (f"inductor cannot compile their float8 code on this sm_{major}{minor} GPU "
                       "(pytorch/pytorch#167082)")
    return True, ""


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("torch_sparse_mla.demo: --device cuda, but torch sees no GPU", file=sys.stderr)
        return 2
    batch, context = DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    batch = args.batch_size or batch
    context = args.context_len or context
    iters = args.iters or (50 if device.type == "cuda" else 2)
    compile_plain, why_not = default_compile_plain(device)
    if args.compile_plain is not None:
        compile_plain = args.compile_plain
    ratios = tuple(int(r) for r in args.v4_layers.split(","))
    if any(r not in (1, 4, 128) for r in ratios):
        print(f"torch_sparse_mla.demo: --v4-layers takes 1, 4 or 128 per layer, got {args.v4_layers}", file=sys.stderr)
        return 2
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = ("CPU: small sizes, CPU kernels, torch.compile without CUDA graphs (on a GPU the same command "
                 "runs model-sized steps as CUDA graphs)")
    from torch_sparse_mla.ops._triton import HAS_TRITON, triton

    if device.type == "cpu":
        # A CUDA build of torch on a machine without a GPU logs "No CUDA runtime is found" when
        # inductor builds C++ kernels: true, and irrelevant to a CPU run.
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    say(f"torch_sparse_mla demo on {where}; torch {torch.__version__}, "
        + (f"triton {triton.__version__}" if HAS_TRITON else "no triton (the CPU kernels need none)"))
    if device.type == "cuda" and not compile_plain and args.compile_plain is None:
        say(f"the plain-PyTorch steps run eagerly: {why_not}; --compile-plain compiles them anyway")
    start = time.perf_counter()
    tables = []
    if args.only in (None, "v4"):
        cfg = deepseek_v4.Config(batch=batch, context=context, ratios=ratios, heads=args.heads or 64)
        tables.append(deepseek_v4.run(cfg, device, iters, compile_plain))
    if args.only in (None, "m3"):
        cfg = minimax_m3.Config(batch=batch, context=context, layers=args.m3_layers, kv_format=args.m3_format)
        tables.append(minimax_m3.run(cfg, device, iters, compile_plain))
    say("")
    for table in tables:
        say(table + "\n")
    say(f"OK ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
