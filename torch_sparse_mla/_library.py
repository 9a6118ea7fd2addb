"""Every schema of the ``sparse_mla`` namespace, and the glue that registers its implementations.

Each operator ``NAME`` has a functional overload that returns new tensors and an ``out`` overload that
writes caller-owned buffers and returns nothing (``kv_cache_insert`` writes the cache and has only
that form). For every overload three implementations are registered:

- a fake (``meta_kernels/<family>.py``, function ``NAME`` / ``NAME_out``): validates the arguments
  from metadata alone and allocates the functional outputs;
- a CPU kernel (``ops/<family>.py``, ``NAME_torch``): vectorised PyTorch;
- a CUDA kernel (``ops/<family>.py``, ``NAME_triton``): a Triton launcher.

The real implementations run the fake first (same checks, same output allocation, so the fake
mirrors the real shape logic exactly) and then one kernel entry point, which always takes the ``out``
overload's positional arguments followed by the output tensors. Registration uses
``torch.library.define``/``impl`` rather than ``custom_op``: it is about 3x cheaper per eager call and
it is the route that allows the ``.out`` overloads.
"""

from __future__ import annotations

import torch

from torch_sparse_mla.meta_kernels import kv_cache as _kv_cache_meta
from torch_sparse_mla.meta_kernels import metadata as _metadata_meta
from torch_sparse_mla.meta_kernels import sparse_gqa as _sparse_gqa_meta
from torch_sparse_mla.meta_kernels import sparse_mla as _sparse_mla_meta
from torch_sparse_mla.ops import kv_cache as _kv_cache_ops
from torch_sparse_mla.ops import metadata as _metadata_ops
from torch_sparse_mla.ops import sparse_gqa as _sparse_gqa_ops
from torch_sparse_mla.ops import sparse_mla as _sparse_mla_ops

NAMESPACE = "sparse_mla"

# name -> (functional schema or None, out schema, output names of the out overload)
SCHEMAS: dict[str, tuple[str | None, str, tuple[str, ...]]] = {
    # -- metadata (SPEC sections 1-4) ---------------------------------------------------------------
    "compressed_slot_mapping": (
        "(Tensor query_start_loc, Tensor seq_lens, Tensor block_table, SymInt num_tokens, "
        "int block_size, int compress_ratio) -> Tensor",
        "(Tensor query_start_loc, Tensor seq_lens, Tensor block_table, int block_size, "
        "int compress_ratio, *, Tensor(a!) out) -> ()",
        ("out",),
    ),
    "c128a_topk_indices": (
        "(Tensor positions, Tensor token_to_req, Tensor block_table, Tensor slot_mapping, "
        "SymInt num_decode_tokens, int compress_ratio, int block_size, int width) "
        "-> (Tensor decode_indices, Tensor decode_lens, Tensor prefill_indices)",
        "(Tensor positions, Tensor token_to_req, Tensor block_table, Tensor slot_mapping, "
        "SymInt num_decode_tokens, int compress_ratio, int block_size, int width, *, "
        "Tensor(a!) decode_indices, Tensor(b!) decode_lens, Tensor(c!) prefill_indices) -> ()",
        ("decode_indices", "decode_lens", "prefill_indices"),
    ),
    "decode_runtime_metadata": (
        "(Tensor seq_lens, int decode_query_len) -> (Tensor kv_segment_lens, Tensor qo_offset)",
        "(Tensor seq_lens, int decode_query_len, *, Tensor(a!) kv_segment_lens, "
        "Tensor(b!) qo_offset) -> ()",
        ("kv_segment_lens", "qo_offset"),
    ),
    "swa_indices": (
        "(Tensor positions, Tensor token_to_req, Tensor block_table, Tensor slot_mapping, "
        "int window, int block_size) -> (Tensor indices, Tensor lens)",
        "(Tensor positions, Tensor token_to_req, Tensor block_table, Tensor slot_mapping, "
        "int window, int block_size, *, Tensor(a!) indices, Tensor(b!) lens) -> ()",
        ("indices", "lens"),
    ),
    "compressed_topk_to_global": (
        "(Tensor local_indices, Tensor token_to_req, Tensor block_table, Tensor slot_mapping, "
        "int block_size) -> (Tensor indices, Tensor lens)",
        "(Tensor local_indices, Tensor token_to_req, Tensor block_table, Tensor slot_mapping, "
        "int block_size, *, Tensor(a!) indices, Tensor(b!) lens) -> ()",
        ("indices", "lens"),
    ),
    # -- KV cache formats (SPEC section 5) ------------------------------------------------------------
    "kv_cache_insert": (
        None,
        "(Tensor kv, Tensor slot_mapping, Tensor(a!) kv_cache, str kv_format) -> ()",
        (),
    ),
    "kv_cache_gather": (
        "(Tensor kv_cache, Tensor slots, str kv_format, ScalarType? dtype=None) -> Tensor",
        "(Tensor kv_cache, Tensor slots, str kv_format, ScalarType? dtype=None, *, "
        "Tensor(a!) out) -> ()",
        ("out",),
    ),
    # -- attention (SPEC sections 6-7) ----------------------------------------------------------------
    "sparse_mla_decode": (
        "(Tensor q, Tensor kv_cache, Tensor indices, float softmax_scale, str kv_format=\"auto\", "
        "int head_dim_v=512, Tensor? topk_length=None, Tensor? attn_sink=None, "
        "Tensor? extra_kv_cache=None, Tensor? extra_indices=None, Tensor? extra_topk_length=None) "
        "-> (Tensor out, Tensor lse)",
        "(Tensor q, Tensor kv_cache, Tensor indices, float softmax_scale, str kv_format=\"auto\", "
        "int head_dim_v=512, Tensor? topk_length=None, Tensor? attn_sink=None, "
        "Tensor? extra_kv_cache=None, Tensor? extra_indices=None, Tensor? extra_topk_length=None, "
        "*, Tensor(a!) out, Tensor(b!) lse) -> ()",
        ("out", "lse"),
    ),
    "sparse_gqa_decode": (
        "(Tensor q, Tensor kv_cache, Tensor topk_pages, Tensor block_table, Tensor kv_segment_lens, "
        "Tensor qo_offset, int decode_query_len, float softmax_scale, float q_scale=1.0, "
        "float k_scale=1.0, float v_scale=1.0) -> Tensor",
        "(Tensor q, Tensor kv_cache, Tensor topk_pages, Tensor block_table, Tensor kv_segment_lens, "
        "Tensor qo_offset, int decode_query_len, float softmax_scale, float q_scale=1.0, "
        "float k_scale=1.0, float v_scale=1.0, *, Tensor(a!) out) -> ()",
        ("out",),
    ),
}

# name -> (fake/validation module, kernel module)
FAMILIES = {
    "compressed_slot_mapping": (_metadata_meta, _metadata_ops),
    "c128a_topk_indices": (_metadata_meta, _metadata_ops),
    "decode_runtime_metadata": (_metadata_meta, _metadata_ops),
    "swa_indices": (_metadata_meta, _metadata_ops),
    "compressed_topk_to_global": (_metadata_meta, _metadata_ops),
    "kv_cache_insert": (_kv_cache_meta, _kv_cache_ops),
    "kv_cache_gather": (_kv_cache_meta, _kv_cache_ops),
    "sparse_mla_decode": (_sparse_mla_meta, _sparse_mla_ops),
    "sparse_gqa_decode": (_sparse_gqa_meta, _sparse_gqa_ops),
}

_lib = torch.library.Library(NAMESPACE, "DEF")


def _kernel(kernels, name: str, device: torch.device):
    """The CUDA device runs the Triton launcher, every other device the PyTorch kernel."""
    return getattr(kernels, f"{name}_triton" if device.type == "cuda" else f"{name}_torch")


def _functional_to_out_args(name: str, args: tuple) -> tuple:
    """The kernels take the ``out`` overload's positional arguments; only
    ``compressed_slot_mapping`` has a functional-only argument (``num_tokens``, the output length)."""
    if name == "compressed_slot_mapping":
        return args[:3] + args[4:]
    return args


def _full_args(schema, args: tuple) -> tuple:
    """The positional arguments with the schema's defaults filled in: the dispatcher drops trailing
    arguments left at their defaults before calling a Python kernel, and the kernels take them all."""
    params = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) >= len(params):
        return args
    return args + tuple(a.default_value for a in params[len(args):])


def _make_functional(name: str, fake, kernels):
    schema = None

    def functional(*args):
        nonlocal schema
        schema = schema or getattr(torch.ops.sparse_mla, name).default._schema
        args = _full_args(schema, args)
        outputs = fake(*args)
        tensors = outputs if isinstance(outputs, tuple) else (outputs,)
        _kernel(kernels, name, args[0].device)(*_functional_to_out_args(name, args), *tensors)
        return outputs

    functional.__name__ = f"{name}_impl"
    return functional


def _make_out(name: str, out_fake, kernels, out_names: tuple[str, ...], overload: str):
    schema = None

    def out_overload(*args, **outputs):
        nonlocal schema
        schema = schema or getattr(getattr(torch.ops.sparse_mla, name), overload)._schema
        args = _full_args(schema, args)
        out_fake(*args, **outputs)
        _kernel(kernels, name, args[0].device)(*args, *(outputs[n] for n in out_names))

    out_overload.__name__ = f"{name}_out_impl"
    return out_overload


def _register_all() -> None:
    for name, (functional_schema, out_schema, out_names) in SCHEMAS.items():
        fakes, kernels = FAMILIES[name]
        if functional_schema is not None:
            _lib.define(name + functional_schema)
            impl = _make_functional(name, getattr(fakes, name), kernels)
            _lib.impl(name, impl, "CPU")
            _lib.impl(name, impl, "CUDA")
            torch.library.register_fake(f"{NAMESPACE}::{name}", getattr(fakes, name), lib=_lib)
            out_name, out_fake, overload = f"{name}.out", getattr(fakes, f"{name}_out"), "out"
        else:  # a writing operator with a single (default) overload
            out_name, out_fake, overload = name, getattr(fakes, name), "default"
        _lib.define(out_name + out_schema)
        impl = _make_out(name, out_fake, kernels, out_names, overload)
        _lib.impl(out_name, impl, "CPU")
        _lib.impl(out_name, impl, "CUDA")
        torch.library.register_fake(f"{NAMESPACE}::{out_name}", out_fake, lib=_lib)


_register_all()
