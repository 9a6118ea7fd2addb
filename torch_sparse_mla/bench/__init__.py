"""``python -m torch_sparse_mla.bench``: every operator timed against plain PyTorch (see ``__main__.py``).

Modules: ``common`` (timing, ceilings, tables, plot), ``baselines`` (each operator in plain PyTorch),
and one case module per family: ``mla``, ``gqa``, ``metadata``, ``kv_cache``.
"""
