"""Time variants of the portable sparse-GQA decode kernel against each other in one process (GPU only).

    python scripts/ab_portable.py FORMAT NAME=FILE NAME=FILE ... [--rows 1,16,64,256] [--rounds 2]

Each FILE is a copy of ``ops/sparse_gqa.py`` (the committed one: ``git show HEAD:ops/sparse_gqa.py >
a.py``; an edited one; one whose ``cuda_capability_geq(8, 9)`` tests are made false with ``sed``, to
run on an sm_90 GPU the code a GPU before sm_89 compiles). Each is imported as a module of the package
(``torch_sparse_mla.ops._ab_NAME``, as ``ab_hopper.py`` does, so its relative imports work) with its
own plan cache and kernels, and called through its own launcher with ``path="portable"``. ``FORMAT`` is ``fp8`` or
``nvfp4``; inputs are the benchmark's (``bench/gqa.py``; a row ``64q4`` is T = 64 with four query
tokens per request). For each row and variant: the best of ``--rounds`` CUDA-graph replay medians
(``bench.common.graph_us``; the variants alternate within a round), the rounds, and whether the
output is bitwise the first variant's (else the largest difference). Not a test, not the benchmark.
"""

from __future__ import annotations

import argparse

import torch
from ab_hopper import _modules  # this folder is first on the path of a script run as a file

from torch_sparse_mla.bench.common import graph_us
from torch_sparse_mla.bench.gqa import _decode_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("format", choices=("fp8", "nvfp4"))
    parser.add_argument("variants", nargs="+", help="NAME=FILE, the first is the base of the comparisons")
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--rounds", type=int, default=2)
    opts = parser.parse_args()
    modules = _modules(opts.variants)
    for row in opts.rows.split(","):
        num_rows, _, q_len = row.partition("q")
        num_rows, q_len = int(num_rows), int(q_len or 1)
        args, _, _ = _decode_inputs(opts.format, num_rows, q_len, seed=num_rows * 10 + q_len, device="cuda")
        q, kv, pages, table, lens, qo, dql, scale = args
        runs, outputs, times = {}, {}, {name: [] for name in modules}
        for name, module in modules.items():
            out = torch.empty_like(q)

            def run(module=module, out=out):
                module.sparse_gqa_decode_triton(q, kv, pages, table, lens, qo, dql, scale, out=out, path="portable")
                return out
            runs[name] = run
            outputs[name] = run().clone()
        for _ in range(opts.rounds):
            for name in modules:
                times[name].append(graph_us(runs[name]))
        base = outputs[next(iter(modules))]
        cells = []
        for name in modules:
            same = torch.equal(outputs[name].view(torch.int16), base.view(torch.int16))
            diff = (outputs[name].float() - base.float()).abs().max().item()
            rounds = "/".join(f"{t:.1f}" for t in times[name])
            cells.append(f"{name} {min(times[name]):7.1f} ({rounds}) {'bitwise' if same else f'd={diff:.1e}'}")
        print(f"portable {opts.format} T={row:6s} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
