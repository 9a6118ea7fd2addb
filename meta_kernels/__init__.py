"""Fakes (meta implementations) of torch_sparse_mla's operators, one module per operator family.

This folder is installed as ``torch_sparse_mla.meta_kernels`` (``package-dir`` in ``pyproject.toml``);
the registration is in ``torch_sparse_mla/_library.py``. Each fake validates its arguments from
metadata only (shapes, strides, dtypes, devices; never values) and allocates the functional outputs.
The real implementations run the same fake first, so fakes and kernels cannot disagree on what is
valid. ``_common.py`` holds the check helpers, ``_formats.py`` the KV cache format facts and layout
checks (also used by the kernels in ``ops/``).
"""
