"""Kernels of torch_sparse_mla: vectorised PyTorch (``NAME_torch``, registered under ``CPU``) and Triton
launchers (``NAME_triton``, registered under ``CUDA``), one module per operator family.

This folder is installed as ``torch_sparse_mla.ops`` (``package-dir`` in ``pyproject.toml``); the
registration is in ``torch_sparse_mla/_library.py``. Imports here are relative, and only ever go from
``ops`` to ``meta_kernels`` (argument checks and format facts), never the other way.

- ``_triton.py``: the Triton import guard; ``_launch.py``: plans, plan caches, cheap launches and the
  constants shared by every launcher; ``_formats.py``: reading the sparse MLA cache formats;
- ``metadata.py``, ``kv_cache.py``, ``sparse_mla.py``, ``sparse_gqa.py``: the operator families.
"""
