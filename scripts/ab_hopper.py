"""Time variants of a Hopper kernel module against each other in one process (GPU only).

    python scripts/ab_hopper.py gqa FORMAT NAME=FILE NAME=FILE ... [--rows 1,16,64,256,64q4] [--rounds 2]
    python scripts/ab_hopper.py mla FORMAT NAME=FILE NAME=FILE ... [--rows 1,4,64,256] [--heads 128]
                                [--k 2048] [--extra 0]

Each FILE is a copy of ``ops/sparse_gqa_hopper.py`` (``gqa``) or ``ops/sparse_mla_hopper.py``
(``mla``), for example the committed one (``git show HEAD:ops/sparse_gqa_hopper.py > a.py``) and an
edited one. Each is imported as a module of the package (``torch_sparse_mla.ops._ab_NAME``, so its
relative imports work) and put in place of the shipped module for its turn; the calls go through the
launcher of ``ops/sparse_gqa.py`` / ``ops/sparse_mla.py`` with its plan cache cleared, not through the
public operator, whose first call of a signature records the launches it made and replays them for
later calls (``_library.py``), so that a second variant would silently run the first one's kernel.
Every line says which module's kernel each variant's plan holds, to make that visible.

Inputs are the benchmark's (``bench/gqa.py``, ``bench/mla.py``); ``FORMAT`` is ``fp8`` or ``nvfp4``
(gqa), ``fp8_656``, ``fp8_584`` or ``auto`` (mla); a gqa row ``64q4`` is T = 64 with four query tokens
per request. For each row and variant: the best of ``--rounds`` CUDA-graph replay medians
(``bench.common.graph_us``; the variants alternate within a round), the rounds, and the largest
difference from the first variant's output relative to its largest magnitude (``!`` when an output
holds a non-finite value). Not a test, not the benchmark.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil

import torch

from torch_sparse_mla.bench.common import graph_us
from torch_sparse_mla.ops import sparse_gqa, sparse_mla


def _modules(specs: list[str]) -> dict:
    """The variants imported as modules of the package; their copies inside it are removed again once
    imported (in an editable install the package's ``ops`` is the checkout's)."""
    ops_dir = os.path.dirname(sparse_gqa.__file__)
    modules = {}
    for spec in specs:
        name, path = spec.split("=", 1)
        target = os.path.join(ops_dir, f"_ab_{name}.py")
        shutil.copy(path, target)
        try:
            modules[name] = importlib.import_module(f"torch_sparse_mla.ops._ab_{name}")
        finally:
            os.remove(target)
    return modules


def _gqa_call(kv_format: str, row: str):
    from torch_sparse_mla.bench.gqa import _decode_inputs
    num_rows, _, q_len = row.partition("q")
    num_rows, q_len = int(num_rows), int(q_len or 1)
    args, _, _ = _decode_inputs(kv_format, num_rows, q_len, seed=num_rows * 10 + q_len, device="cuda")
    q, kv, pages, table, lens, qo, dql, scale = args
    out = torch.empty_like(q)

    def run():
        sparse_gqa.sparse_gqa_decode_triton(q, kv, pages, table, lens, qo, dql, scale, out=out, path="hopper")
        return out
    return run


def _mla_call(kv_format: str, row: str, heads: int, k: int, extra: int):
    from torch_sparse_mla.bench.mla import _inputs
    kwargs = _inputs(kv_format, heads, k, extra, int(row), "cuda")
    q = kwargs["q"]
    out = torch.empty(q.shape[0], heads, 512, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[0], heads, dtype=torch.float32, device=q.device)

    def run():
        sparse_mla.sparse_mla_decode_triton(**kwargs, out=out, lse=lse, path="hopper")
        return out
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=("gqa", "mla"))
    parser.add_argument("format")
    parser.add_argument("variants", nargs="+", help="NAME=FILE, the first is the base of the differences")
    parser.add_argument("--rows", default=None, help="comma-separated T values (gqa: T or TqQ_LEN)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--extra", type=int, default=0)
    opts = parser.parse_args()
    launcher = sparse_gqa if opts.family == "gqa" else sparse_mla
    modules = _modules(opts.variants)
    rows = (opts.rows or ("1,16,64,256,64q4" if opts.family == "gqa" else "1,4,64,256")).split(",")
    shipped = launcher.hopper
    try:
        for row in rows:
            run = (_gqa_call(opts.format, row) if opts.family == "gqa"
                   else _mla_call(opts.format, row, opts.heads, opts.k, opts.extra))
            outputs, kernels, times = {}, {}, {name: [] for name in modules}
            for name, module in modules.items():
                launcher.hopper = module
                launcher._PLANS.clear()
                outputs[name] = run().float().clone()
                entry = next(iter(launcher._PLANS.values()))
                kernels[name] = {x.kernel.fn.__module__.rsplit(".", 1)[-1] for x in entry if hasattr(x, "kernel")}
            for _ in range(opts.rounds):
                for name, module in modules.items():
                    launcher.hopper = module
                    launcher._PLANS.clear()
                    times[name].append(graph_us(run))
            base = outputs[next(iter(modules))]
            scale = max(base.abs().max().item(), 1e-30)
            cells = []
            for name in modules:
                diff = (outputs[name] - base).abs().max().item() / scale
                bad = "" if torch.isfinite(outputs[name]).all() else " !"
                rounds = "/".join(f"{t:.1f}" for t in times[name])
                ran = ",".join(sorted(kernels[name]))
                cells.append(f"{name} {min(times[name]):7.1f} ({rounds}) d={diff:.1e}{bad} [{ran}]")
            print(f"{opts.family} {opts.format} T={row:6s} | " + " | ".join(cells), flush=True)
    finally:
        launcher.hopper = shipped
        launcher._PLANS.clear()


if __name__ == "__main__":
    main()
