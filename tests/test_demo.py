"""The runnable examples: the demo's main path at tiny sizes, the README's Usage snippet and the
DeepSeek-V3.2, step-builder and export examples of docs/integration.md, each run exactly as written
(on a GPU when there is one)."""

from __future__ import annotations

import pathlib
import re

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _python_blocks(path: pathlib.Path, after: str = "") -> list[str]:
    text = path.read_text()
    if after:
        text = text[text.index(after):]
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_demo_main_path(capsys):
    from torch_sparse_mla.demo.__main__ import main

    argv = ["--batch-size", "2", "--context-len", "300", "--v4-layers", "1,4,128", "--m3-layers", "1",
            "--heads", "16", "--iters", "1"]
    if torch.cuda.is_available():
        argv += ["--no-compile-plain"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "caches identical: True" in out
    for stage in ("metadata", "cache writes", "attention", "whole step, eager", "whole step, torch.compile",
                  "whole step, CUDA graph"):
        assert out.count(stage) == 2, f"{stage!r} missing from a table"
    # on a GPU each library step is also captured by hand in one torch.cuda.graph and replayed
    assert out.count("whole step, one CUDA graph") == (2 if torch.cuda.is_available() else 0)
    assert out.rstrip().splitlines()[-1].startswith("OK")


def _without_triton(tmp_path) -> dict:
    """The environment of a subprocess that sees no usable Triton: a ``triton`` that refuses to import
    first on the path (a stand-in for none installed, as on macOS or Windows). The package comes from
    where this process imported it: an editable checkout, an installed wheel or the package copy of
    ``scripts/gpu_suite.sh`` (the repository root first on the path would shadow the last two with the
    source folder, which lacks ``ops/``)."""
    import os

    import torch_sparse_mla

    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("raise ImportError('no triton here')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(torch_sparse_mla.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(tmp_path), package_parent, env.get("PYTHONPATH"))))
    return env


def test_demo_without_triton(tmp_path):
    """Triton is a dependency on Linux only: on macOS or Windows the package runs its CPU kernels without
    it. Without a usable Triton the package imports and the demo runs both steps on CPU, saying so,
    instead of stopping at ``import triton`` as it did before 2026-12-05."""
    import subprocess
    import sys

    code = ("import sys; from torch_sparse_mla.ops import _triton; assert not _triton.HAS_TRITON; "
            "from torch_sparse_mla.demo.__main__ import main; "
            "sys.exit(main(['--device', 'cpu', '--batch-size', '2', '--context-len', '300', '--v4-layers', '1,4', "
            "'--m3-layers', '1', '--heads', '16', '--iters', '1']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_without_triton(tmp_path),
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "no triton (the CPU kernels need none)" in result.stdout
    assert result.stdout.count("caches identical: True") >= 2 and result.stdout.rstrip().splitlines()[-1].startswith("OK")


def test_suite_without_triton_skips_the_triton_tests(tmp_path):
    """Without a usable Triton the tests of the Triton kernels are skipped with the reason, not failed
    (before 2026-12-05, 210 failed): the interpreter tests of every file, the benchmark's floor kernel
    and command, run in a subprocess (the whole suite without Triton: docs/testing.md, "Without
    Triton")."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(ROOT / "tests"),
                             "-k", "interpreter or floor_kernel or every_table or non_contiguous"],
                            capture_output=True, text=True, env=_without_triton(tmp_path), cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    summary = result.stdout.rstrip().splitlines()[-1]
    skipped = int(re.search(r"(\d+) skipped", summary).group(1))
    assert "failed" not in summary and skipped >= 150, summary
    assert "needs Triton (pip install triton; Linux)" in result.stdout


def test_demo_compiles_the_plain_steps_only_where_inductor_can(monkeypatch):
    """By default the plain-PyTorch steps are compiled on a GPU of compute capability 8.9 or later
    only: before sm_89 inductor cannot compile their float8 casts (pytorch/pytorch#167082), and on a
    CPU the build takes minutes. Capabilities stand in for GPUs (no GPU is needed)."""
    from torch_sparse_mla.demo.__main__ import default_compile_plain

    assert default_compile_plain(torch.device("cpu"))[0] is False
    for capability, compiled in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True),
                                 ((10, 0), True), ((12, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        decided, why_not = default_compile_plain(torch.device("cuda", 0))
        assert decided is compiled, capability
        assert ("167082" in why_not) is not compiled


def test_readme_usage_snippet_runs(capsys):
    (snippet,) = _python_blocks(ROOT / "README.md", after="## Usage")[:1]
    exec(compile(snippet, "README.md (Usage)", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "torch.Size([2, 16, 512]) torch.Size([2, 16])"
    assert printed[1] == "[17, 17, 5, 5] [15, 16, 3, 4]"


def _run_integration_example(heading: str, index: int) -> None:
    """Run the ``index``-th Python block after ``heading`` in docs/integration.md as written, on the GPU
    when there is one (the examples set ``device = "cpu"``)."""
    snippet = _python_blocks(ROOT / "docs" / "integration.md", after=heading)[index]
    if torch.cuda.is_available():
        snippet = snippet.replace('device = "cpu"', 'device = "cuda"')
    exec(compile(snippet, f"docs/integration.md ({heading.lstrip('# ')})", "exec"), {})


def test_integration_builder_example_runs(capsys):
    _run_integration_example("## The step builders", 0)
    assert capsys.readouterr().out.strip() == "torch.Size([2, 16, 512]) [128, 128] [64, 64]"


def test_integration_v32_example_runs(capsys):
    _run_integration_example("## DeepSeek-V3.2", 1)  # block 0 is the two-line call, not a program
    assert capsys.readouterr().out.strip() == "torch.Size([2, 16, 512]) [1000, 300]"


def test_integration_export_example_runs(capsys):
    _run_integration_example("## torch.export and AOTInductor", 0)  # block 1 is the two-line AOTInductor call
    assert capsys.readouterr().out.strip() == "[True, True, True]"
