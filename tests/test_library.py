"""The call path shared by every operator: the public functions' direct eager calls (they skip the
dispatcher only where that cannot be observed) and the launcher's shortcut past Triton's Python
launch path (``ops/_launch.py``)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import torch_sparse_mla as tsm
from torch_sparse_mla import _library
from torch_sparse_mla.ops import _launch
from torch_sparse_mla.ops._triton import release

from common import requires_cuda, requires_interpreter, same_layout_copy, signature_cache
from test_multi_gpu import operator_cases


@pytest.fixture
def dispatched(monkeypatch):
    """Names of the overloads that went through ``torch.ops.sparse_mla`` (the dispatcher)."""
    calls = []
    for name, op in list(_library._OVERLOADS.items()):
        def spy(*args, _name=name, _op=op, **kwargs):
            calls.append(_name)
            return _op(*args, **kwargs)
        monkeypatch.setitem(_library._OVERLOADS, name, spy)
    return calls


def swa_inputs(device="cpu"):
    positions = torch.tensor([0, 5, 9, 3], dtype=torch.int64, device=device)
    token_to_req = torch.tensor([0, 0, 1, 1], dtype=torch.int32, device=device)
    block_table = torch.tensor([[2, 0, 1], [4, 3, -1]], dtype=torch.int32, device=device)
    slot_mapping = torch.tensor([1, 2, -1, 7], dtype=torch.int64, device=device)
    return positions, token_to_req, block_table, slot_mapping


def mla_inputs(requires_grad=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 64, generator=g, dtype=torch.float16).requires_grad_(requires_grad)
    cache = torch.randn(4, 8, 64, generator=g, dtype=torch.float16)
    indices = torch.tensor([[0, 3, 31, -1], [7, 8, 100, 2]], dtype=torch.int32)
    return q, cache, indices


def test_dispatcher_calls_sends_public_calls_through_torch_ops(dispatched, monkeypatch):
    """Inside ``dispatcher_calls()`` a public call goes through ``torch.ops.sparse_mla``; the previous
    setting comes back on exit, also after an error and when it was already off."""
    inputs = swa_inputs()
    want = tsm.swa_indices(*inputs, window=4, block_size=2)
    assert dispatched == [] and _library.DIRECT_CALLS
    with _library.dispatcher_calls():
        assert not _library.DIRECT_CALLS
        got = tsm.swa_indices(*inputs, window=4, block_size=2)
    assert dispatched == ["swa_indices"] and _library.DIRECT_CALLS
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(KeyError), _library.dispatcher_calls():
        raise KeyError
    assert _library.DIRECT_CALLS
    monkeypatch.setattr(_library, "DIRECT_CALLS", False)
    with _library.dispatcher_calls():
        pass
    assert not _library.DIRECT_CALLS


def test_every_overload_has_a_direct_entry():
    """Every registered overload can be called directly, and its argument kinds follow its schema."""
    for name in _library.SCHEMAS:
        for overload in ([name, name + ".out"] if _library.SCHEMAS[name][0] else [name]):
            assert callable(_library._DIRECT[overload]) and overload in _library._OVERLOADS
    kinds = _library._argument_kinds("sparse_gqa_decode")
    assert kinds[:8] == (torch.Tensor,) * 6 + (int, float) and kinds[-2:] == (None, None)
    assert _library._argument_kinds("kv_cache_gather.out") == (torch.Tensor, torch.Tensor, str, torch.dtype)


def test_plain_eager_calls_skip_the_dispatcher(dispatched):
    args = swa_inputs()
    want = torch.ops.sparse_mla.swa_indices(*args, 4, 2)
    got = tsm.swa_indices(*args, window=4, block_size=2)
    out = (torch.full_like(want[0], -7), torch.full_like(want[1], -7))
    tsm.swa_indices(*args, window=4, block_size=2, out=out)
    assert dispatched == []
    for a, b, c in zip(want, got, out):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=0, atol=0)
    qsl = torch.tensor([0, 1, 3], dtype=torch.int32)
    seq_lens = torch.tensor([8, 6], dtype=torch.int32)
    table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    got = tsm.compressed_slot_mapping(qsl, seq_lens, table, block_size=2, compress_ratio=4, num_tokens=3)
    want = torch.ops.sparse_mla.compressed_slot_mapping(qsl, seq_lens, table, 3, 2, 4)
    assert dispatched == []
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    q, cache, indices = mla_inputs()
    with torch.inference_mode():
        o, lse = tsm.sparse_mla_decode(q, cache, indices, softmax_scale=0.125, head_dim_v=32)
    o2, lse2 = torch.ops.sparse_mla.sparse_mla_decode(q, cache, indices, 0.125, "auto", 32)
    assert dispatched == []
    torch.testing.assert_close(o, o2, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse2, rtol=0, atol=0)


@pytest.mark.parametrize("functional", [True, False], ids=["functional", "out"])
def test_a_known_signature_on_another_device_is_checked_again(functional):
    """The direct path's signature includes the device: a call that differs from an accepted one only
    in a tensor's device (a ``meta`` tensor, whose ``get_device()`` is -1 like a CPU tensor's) is
    checked, not run with the accepted call's kernel; so is a whole call of meta tensors."""
    positions, token_to_req, block_table, slot_mapping = swa_inputs()
    out = (torch.empty(4, 4, dtype=torch.int32), torch.empty(4, dtype=torch.int32))
    kwargs = dict(window=4, block_size=2, **({} if functional else {"out": out}))
    for _ in range(2):  # accepted, then known
        tsm.swa_indices(positions, token_to_req, block_table, slot_mapping, **kwargs)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"block_table: expected a tensor on cpu \(where the first argument "
                                             r"is\), got meta"):
            tsm.swa_indices(positions, token_to_req, block_table.to("meta"), slot_mapping, **kwargs)
    if functional:  # meta tensors throughout: the fake's outputs, on meta
        meta = [t.to("meta") for t in (positions, token_to_req, block_table, slot_mapping)]
        indices, lens = tsm.swa_indices(*meta, **kwargs)
        assert indices.device.type == lens.device.type == "meta" and indices.shape == (4, 4)


def test_inference_tensors_written_outside_inference_mode_take_the_dispatcher(dispatched):
    """A cache or ``out`` buffer created under ``torch.inference_mode()`` and written outside it: the
    call goes through the dispatcher, which refuses it (a CUDA kernel called directly would write it);
    inside the mode the same call stays direct, and so does one with a normal tensor written."""
    kv, slots = torch.randn(3, 576), torch.tensor([0, 5, 9])
    positions, token_to_req, block_table, slot_mapping = swa_inputs()
    with torch.inference_mode():
        cache = torch.zeros(4, 8, 576, dtype=torch.bfloat16)
        out = (torch.empty(4, 4, dtype=torch.int32), torch.empty(4, dtype=torch.int32))
    normal = torch.zeros(4, 8, 576, dtype=torch.bfloat16)
    for _ in range(2):  # the signature accepted, then known
        tsm.kv_cache_insert(kv, slots, normal)
        tsm.swa_indices(positions, token_to_req, block_table, slot_mapping, window=4, block_size=2,
                        out=(out[0].clone(), out[1].clone()))
    assert dispatched == []
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        tsm.kv_cache_insert(kv, slots, cache)
    assert dispatched == ["kv_cache_insert"]
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        tsm.swa_indices(positions, token_to_req, block_table, slot_mapping, window=4, block_size=2, out=out)
    assert dispatched == ["kv_cache_insert", "swa_indices.out"]
    with torch.inference_mode():
        tsm.kv_cache_insert(kv, slots, cache)
        tsm.swa_indices(positions, token_to_req, block_table, slot_mapping, window=4, block_size=2, out=out)
    assert dispatched == ["kv_cache_insert", "swa_indices.out"]
    assert torch.equal(cache, normal)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.*deprecated")
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "quantized", "mkldnn"])
def test_tensors_of_other_layouts_take_the_dispatcher(dispatched, layout):
    """A sparse, quantised or mkldnn tensor (each reports ``is_cpu``) sends the call through the
    dispatcher, whose error is the one ``torch.ops.sparse_mla`` gives, also after a strided call of
    the same shapes has been accepted."""
    positions, token_to_req, block_table, slot_mapping = swa_inputs()
    if layout == "mkldnn" and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no mkldnn")
    if layout == "quantized" and not hasattr(torch, "quantize_per_tensor"):
        pytest.skip("this torch release has no quantised tensors")
    odd = {"sparse_coo": lambda t: t.to_sparse(), "sparse_csr": lambda t: t.to_sparse_csr(),
           "quantized": lambda t: torch.quantize_per_tensor(t.float(), 1.0, 0, torch.qint32),
           "mkldnn": lambda t: t.float().to_mkldnn()}[layout](block_table)
    tsm.swa_indices(positions, token_to_req, block_table, slot_mapping, window=4, block_size=2)
    assert dispatched == []
    with pytest.raises(NotImplementedError) as direct:
        tsm.swa_indices(positions, token_to_req, odd, slot_mapping, window=4, block_size=2)
    assert dispatched == ["swa_indices"]
    with pytest.raises(NotImplementedError) as dispatcher:
        torch.ops.sparse_mla.swa_indices(positions, token_to_req, odd, slot_mapping, 4, 2)
    assert str(direct.value) == str(dispatcher.value)


def test_a_nested_tensor_after_a_known_signature_is_refused():
    """A strided nested tensor where a known signature has a dense one: the call goes to the dispatcher
    and raises its error (PyTorch's tensor guard, which recognises known signatures, would end the
    process on it). In a subprocess, so that a regression cannot take the test session down."""
    code = """if True:
        import warnings
        import torch, torch_sparse_mla as tsm
        warnings.simplefilter("ignore")
        p = torch.tensor([0, 5, 9, 3]); t = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
        bt = torch.tensor([[2, 0, 1], [4, 3, -1]], dtype=torch.int32); sm = torch.tensor([1, 2, -1, 7])
        out = (torch.empty(4, 3, dtype=torch.int32), torch.empty(4, dtype=torch.int32))
        for _ in range(2):
            tsm.swa_indices(p, t, bt, sm, window=3, block_size=4)
            tsm.swa_indices(p, t, bt, sm, window=3, block_size=4, out=out)
        nested = torch.nested.nested_tensor([p, p])
        for call in (lambda: tsm.swa_indices(nested, t, bt, sm, window=3, block_size=4),
                     lambda: tsm.swa_indices(p, t, bt, sm, window=3, block_size=4,
                                             out=(torch.nested.nested_tensor([out[0], out[0]]), out[1]))):
            try:
                call()
            except (NotImplementedError, RuntimeError) as e:
                print(type(e).__name__)
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["NotImplementedError", "NotImplementedError"], done.stdout


@pytest.mark.parametrize("case", ["int_past_int64", "negative_bit_output", "zero_tensor_input"])
def test_what_the_dispatcher_converts_or_refuses_takes_it(dispatched, case):
    """An int outside int64 (the dispatcher refuses it), an output with the negative bit set and a zero
    tensor (the dispatcher's fallbacks handle both): the direct path hands the call over, also after a
    plain call of the same shapes was accepted, and the outcome is the dispatcher's."""
    positions, token_to_req, block_table, slot_mapping = swa_inputs()
    q, cache, indices = mla_inputs()
    if case == "int_past_int64":
        good = lambda: tsm.swa_indices(positions, token_to_req, block_table, slot_mapping, window=4, block_size=2)
        direct = lambda: tsm.swa_indices(positions, token_to_req, block_table, slot_mapping, window=2**63,
                                         block_size=2)
        via_ops = lambda: torch.ops.sparse_mla.swa_indices.default(positions, token_to_req, block_table,
                                                                   slot_mapping, 2**63, 2)
        name = "swa_indices"
    elif case == "negative_bit_output":
        def negated():
            return torch.complex(torch.zeros(2, 3), torch.zeros(2, 3)).conj().imag
        o = torch.empty(2, 3, 32, dtype=torch.float16)
        good = lambda: tsm.sparse_mla_decode(q, cache, indices, softmax_scale=0.25, head_dim_v=32,
                                             out=(o, torch.empty(2, 3)))
        direct = lambda: tsm.sparse_mla_decode(q, cache, indices, softmax_scale=0.25, head_dim_v=32,
                                               out=(o, negated()))
        via_ops = lambda: torch.ops.sparse_mla.sparse_mla_decode.out(q, cache, indices, 0.25, "auto", 32, out=o,
                                                                     lse=negated())
        name = "sparse_mla_decode.out"
    else:
        zero = torch._efficientzerotensor(*cache.shape, dtype=cache.dtype)
        good = lambda: tsm.kv_cache_gather(torch.zeros_like(cache), torch.tensor([0, 5]))
        direct = lambda: tsm.kv_cache_gather(zero, torch.tensor([0, 5]))
        via_ops = lambda: torch.ops.sparse_mla.kv_cache_gather.default(zero, torch.tensor([0, 5]), "auto", None)
        name = "kv_cache_gather"
    good()
    good()
    assert dispatched == []
    outcomes = []
    for run in (direct, via_ops):
        try:
            outcomes.append(("ok", run()))
        except Exception as e:  # noqa: BLE001 - the outcome compared is the error itself
            outcomes.append((type(e), str(e)))
    assert dispatched == [name]
    (kind_a, a), (kind_b, b) = outcomes
    assert kind_a == kind_b
    if kind_a == "ok":
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    else:
        assert a == b

_OUT_CASES = [c for c in operator_cases() if c.endswith(".out")]


@pytest.mark.parametrize("case", _OUT_CASES, ids=str)
@pytest.mark.parametrize("path", ["direct", "dispatcher"])
def test_an_output_that_overlaps_itself_is_refused(case, path):
    """Each output of each ``.out`` overload, replaced by one row expanded over its rows (stride 0):
    ``ValueError`` naming it on both paths (the CPU kernels raised PyTorch's own error, the Triton
    kernels wrote it, last write winning)."""
    overload, args, outputs = operator_cases()[case]
    checked = 0
    for name, t in outputs.items():
        if t.shape[0] < 2:
            continue
        moved = {**outputs, name: t[:1].expand_as(t)}
        with pytest.raises(ValueError, match=rf"{name}: expected a tensor whose elements do not overlap"):
            if path == "direct":
                _library.call(case, *args, **moved)
            else:
                overload(*args, **moved)
        checked += 1
    assert checked >= 1


def test_an_output_that_is_no_tensor_gets_the_dispatcher_error(dispatched):
    """``call`` below the public functions (which refuse such an ``out``) with an int for an output:
    the dispatcher's own error, before and after the signature with a tensor there was accepted."""
    args = swa_inputs()
    out = (torch.empty(4, 4, dtype=torch.int32), torch.empty(4, dtype=torch.int32))
    for known in (False, True):
        if known:
            _library.call("swa_indices.out", *args, 4, 2, indices=out[0], lens=out[1])
        with pytest.raises(RuntimeError) as direct:
            _library.call("swa_indices.out", *args, 4, 2, indices=out[0], lens=3)
        with pytest.raises(RuntimeError) as dispatcher:
            torch.ops.sparse_mla.swa_indices.out(*args, 4, 2, indices=out[0], lens=3)
        assert str(direct.value) == str(dispatcher.value)


def _fresh(value):
    """``value``, or a tensor's :func:`same_layout_copy`: both paths of a comparison read and write
    identical memory."""
    return same_layout_copy(value) if isinstance(value, torch.Tensor) else value


def _inference_copy(t):
    with torch.inference_mode():
        return t.clone()


_OTHER_DTYPE = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.float32: torch.float64,
                torch.int32: torch.int64, torch.int64: torch.int32, torch.uint8: torch.int8}
# name -> the mutated argument, or None where the mutation does not apply
_TENSOR_MUTATIONS = {
    "other_dtype": lambda t: t.to(_OTHER_DTYPE[t.dtype]),
    "extra_dim": lambda t: t.unsqueeze(0),
    "one_row_fewer": lambda t: t[:-1] if t.shape[0] > 1 else None,
    "expanded": lambda t: t[:1].expand_as(t) if t.shape[0] > 1 else None,
    "column_major": lambda t: t.t().contiguous().t() if t.dim() == 2 else None,
    "meta": lambda t: t.to("meta"),
    "requires_grad": lambda t: t.detach().clone().requires_grad_() if t.is_floating_point() else None,
    "parameter": lambda t: torch.nn.Parameter(t, requires_grad=False),
    "inference": _inference_copy,
    "sparse": lambda t: t.to_sparse(),
}
_SCALAR_MUTATIONS = {
    "bool_for_int": lambda v: True if v.__class__ is int else None,
    "past_int64": lambda v: 2**63 if v.__class__ is int else None,
    "float_for_int": lambda v: float(v) if v.__class__ is int else None,
    "int_for_float": lambda v: int(v) if v.__class__ is float else None,
    "nan": lambda v: float("nan") if v.__class__ is float else None,
}


def _outcome(run, args, outputs):
    """What a call did: its error, or every tensor it returned or was given (written ones included)."""
    try:
        result = run(*args, **outputs)
    except Exception as e:  # noqa: BLE001 - the outcome compared is the error itself
        return "error", type(e).__name__, str(e)
    returned = result if isinstance(result, tuple) else () if result is None else (result,)
    return "ok", [*returned, *(a for a in args if isinstance(a, torch.Tensor)), *outputs.values()]


def _same_outcome(a, b) -> bool:
    if a[0] == "error" or b[0] == "error":
        return a == b
    if len(a[1]) != len(b[1]):
        return False
    for x, y in zip(a[1], b[1]):
        if (x.dtype, x.shape, x.device, x.layout) != (y.dtype, y.shape, y.device, y.layout):
            return False
        values = x.layout == torch.strided and x.device.type != "meta"
        if values and not torch.equal(x.nan_to_num(7.5), y.nan_to_num(7.5)):
            return False
    return True


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", list(operator_cases()), ids=str)
def test_direct_path_matches_the_dispatcher_on_mutated_calls(case):
    """Every argument and output of every overload, mutated one at a time (another dtype or rank, a row
    fewer, expanded, column-major, on ``meta``, requiring a gradient, a ``Parameter``, an inference
    tensor, sparse; for scalars another class, an int past int64, NaN): the call below the public
    functions gives what the dispatcher gives (the same error, or equal outputs and written tensors, NaN
    where NaN), both as the first call of its signature and after the unmutated call was accepted."""
    overload, base_args, base_outputs = operator_cases()[case]
    seen = signature_cache(_library._DIRECT[case])
    direct = functools.partial(_library.call, case)
    names = [a.name for a in overload._schema.arguments if not a.kwarg_only]
    targets = [(names[i], i) for i in range(len(base_args))] + [(n, n) for n in base_outputs]
    writes_cache = any(a.alias_info is not None and a.alias_info.is_write for a in overload._schema.arguments
                       if not a.kwarg_only)
    compared = 0
    for name, where in targets:
        value = base_args[where] if isinstance(where, int) else base_outputs[where]
        mutations = _TENSOR_MUTATIONS if isinstance(value, torch.Tensor) else _SCALAR_MUTATIONS
        for label, mutate in mutations.items():
            def build():
                args, outputs = [_fresh(a) for a in base_args], {n: _fresh(t) for n, t in base_outputs.items()}
                if isinstance(where, int):
                    args[where] = mutate(args[where])
                    return (None if args[where] is None else tuple(args)), outputs
                outputs[where] = mutate(outputs[where])
                return (None if outputs[where] is None else tuple(args)), outputs
            if value is None or build()[0] is None:
                continue
            if writes_cache and name == "slot_mapping" and label == "expanded":
                continue  # every token to one slot: which one wins is unspecified (kv_cache.md)
            want = _outcome(overload, *build())
            seen.clear()
            seen._forget()
            cold = _outcome(direct, *build())
            direct(*(_fresh(a) for a in base_args), **{n: _fresh(t) for n, t in base_outputs.items()})
            warm = _outcome(direct, *build())
            assert _same_outcome(cold, want), (name, label, "first call", cold[:3], want[:3])
            assert _same_outcome(warm, want), (name, label, "after the unmutated call", warm[:3], want[:3])
            compared += 1
    assert compared >= 10


def test_direct_calls_raise_the_dispatcher_path_errors(dispatched):
    positions, token_to_req, block_table, slot_mapping = swa_inputs()
    bad = block_table.to(torch.int64)
    with pytest.raises(ValueError) as direct:
        tsm.swa_indices(positions, token_to_req, bad, slot_mapping, window=4, block_size=2)
    assert dispatched == []
    with pytest.raises(ValueError) as dispatcher:
        torch.ops.sparse_mla.swa_indices(positions, token_to_req, bad, slot_mapping, 4, 2)
    assert str(direct.value) == str(dispatcher.value)
    with pytest.raises(ValueError, match="overlaps"):  # the per-call overlap check runs on the direct path too
        tsm.swa_indices(positions, token_to_req, block_table, slot_mapping, window=4, block_size=2,
                        out=(torch.empty(4, 4, dtype=torch.int32), token_to_req))
    assert dispatched == []


def test_recent_signatures(dispatched):
    """A known signature is recognised by PyTorch's tensor guard before any key is built; anything the
    guard or the scalar comparison tells apart is looked up (or validated) again: other shapes, other
    strides, a tensor that requires grad or is a subclass, a scalar of another class or value, an
    output that now overlaps an input."""
    assert _library._GUARDS is not None, "torch._C._dynamo.guards.TensorGuards is missing or changed"
    args = swa_inputs()
    other = tuple(torch.cat([a, a]) if a.dim() == 1 else a for a in args)
    direct = _library._DIRECT["swa_indices.out"]
    seen = signature_cache(direct)
    seen.clear()  # start from an empty ring: tests run before may have left it in its backoff
    seen._forget()
    for _ in range(3):  # two signatures in turn: both stay recent, both give their own results
        for a in (args, other):
            out = (torch.full((a[0].shape[0], 4), -7, dtype=torch.int32), torch.full_like(a[1], -7))
            tsm.swa_indices(*a, window=4, block_size=2, out=out)
            for x, y in zip(out, torch.ops.sparse_mla.swa_indices(*a, 4, 2)):
                torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert dispatched == []
    for a in (args, other):  # both signatures are recognised without building their keys
        outs = (torch.empty(a[0].shape[0], 4, dtype=torch.int32), torch.empty_like(a[1]))
        key, entry = seen.find((*a, 4, 2), outs, _library._direct_key)
        assert key is None and entry is not None
    dispatched.clear()
    out = (torch.empty(4, 4, dtype=torch.int32), torch.empty(4, dtype=torch.int32))
    # other strides of the same shape: validated again (and still right)
    table_t = args[2].t().contiguous().t()
    assert seen.find((args[0], args[1], table_t, args[3], 4, 2), out, _library._direct_key)[0] is not None
    tsm.swa_indices(args[0], args[1], table_t, args[3], window=4, block_size=2, out=out)
    torch.testing.assert_close(out[0], torch.ops.sparse_mla.swa_indices(*args, 4, 2)[0], rtol=0, atol=0)
    assert dispatched == []
    # an output that overlaps an input under a known signature: the overlap check still runs
    with pytest.raises(ValueError, match="overlaps"):
        tsm.swa_indices(*args, window=4, block_size=2, out=(out[0], args[1]))
    tsm.swa_indices(*args, window=4, block_size=2, out=out)
    # a tensor that requires grad, or a subclass, with the same metadata: the dispatcher
    q, cache, indices = mla_inputs()
    tsm.sparse_mla_decode(q, cache, indices, softmax_scale=0.125, head_dim_v=32)
    assert dispatched == []
    tsm.sparse_mla_decode(q.clone().requires_grad_(), cache, indices, softmax_scale=0.125, head_dim_v=32)
    assert dispatched[-1] == "sparse_mla_decode"
    tsm.sparse_mla_decode(torch.nn.Parameter(q.clone(), requires_grad=False), cache, indices, softmax_scale=0.125,
                          head_dim_v=32)
    assert len(dispatched) == 2
    # a scalar of another class (int for float) goes to the dispatcher; another value is another signature
    o_int, _ = tsm.sparse_mla_decode(q, cache, indices, softmax_scale=1, head_dim_v=32)
    assert len(dispatched) == 3
    o_half, _ = tsm.sparse_mla_decode(q, cache, indices, softmax_scale=0.5, head_dim_v=32)
    o_one, _ = tsm.sparse_mla_decode(q, cache, indices, softmax_scale=1.0, head_dim_v=32)
    assert len(dispatched) == 3
    torch.testing.assert_close(o_int, o_one, rtol=0, atol=0)
    # an optional tensor given, then None where the recognised signature has it: another signature
    sink = torch.zeros(3)
    for _ in range(2):
        for s in (sink, None, sink):
            o, lse = tsm.sparse_mla_decode(q, cache, indices, softmax_scale=0.5, head_dim_v=32, attn_sink=s)
            o2, lse2 = torch.ops.sparse_mla.sparse_mla_decode(q, cache, indices, 0.5, "auto", 32, None, s)
            torch.testing.assert_close((o, lse), (o2, lse2), rtol=0, atol=0)
    assert len(dispatched) == 3
    assert not torch.equal(o_half, o_one)


def test_recent_signature_ring():
    """The ring of recent signatures: right values whatever the pattern; signatures called in turn
    are all served by it once they fit; with more than fit it stays bounded (the key path serves the
    rest); once one signature repeats it is served again."""
    ring = _library._RECENT

    def key_of(args, outputs):
        return args[0].shape, args[1]

    for count, served_at_least, served_at_most in ((1, 1.0, 1.0), (ring, 1.0, 1.0), (ring + 4, 0.0, 1.0),
                                                   (3 * ring, 0.0, 1.0)):
        seen = _library._Validated()
        sigs = [(torch.zeros(n), n % 3) for n in range(1, count + 1)]
        for a in sigs:
            seen.put(key_of(a, ()), a[0].shape[0], a)
        for a in sigs:  # one cycle to settle
            seen.find(a, (), key_of)
        served = 0
        for _ in range(20):
            for a in sigs:
                key, value = seen.find(a, (), key_of)
                assert value == a[0].shape[0]
                served += key is None
        assert len(seen.ring) == min(count, ring)
        assert served_at_least <= served / (20 * count) <= served_at_most, (count, served)
    found = [seen.find(sigs[0], (), key_of) for _ in range(400)]
    assert all(v == 1 for _, v in found) and all(k is None for k, _ in found[-100:])
    # a scalar of another value or class, or a tensor of other strides, is not matched by the ring
    seen = _library._Validated()
    x = torch.zeros(4, 2)
    seen.put(key_of((x, 1), ()), "a", (x, 1))
    assert seen.find((torch.ones(4, 2), 1), (), key_of) == (None, "a")
    assert seen.find((torch.ones(4, 2), 2), (), key_of)[0] is not None
    assert seen.find((torch.ones(4, 2), True), (), key_of)[0] is not None
    assert seen.find((torch.ones(2, 4).t(), 1), (), key_of)[0] is not None


def test_a_signature_gets_a_ring_entry_per_dispatch_state():
    """A signature first seen inside a dispatch mode (its guard then holds that mode's dispatch-key
    state and refuses every later call made outside it) gets a ring entry made in the next call's
    state: from the call after that on, the ring serves it. Calls alternating between two states
    (in and out of ``torch.inference_mode``) are served by one entry each."""
    if _library._GUARDS is None:
        pytest.skip("torch._C._dynamo.guards.TensorGuards is missing or changed")
    seen = _library._Validated()
    built = []

    def key_of(args, outputs):
        built.append(1)
        return args[0].shape, args[1]

    x = torch.zeros(4, 2)

    class Remember(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.put(key_of((x, 1), ()), "a", (x, 1))  # inside the mode: its dispatch-key state
            return func(*args, **(kwargs or {}))

    with Remember():
        torch.ones(1) + 1
    built.clear()
    assert seen.find((torch.ones(4, 2), 1), (), key_of) == ((x.shape, 1), "a"), "the mode's guard should refuse"
    assert built == [1]
    for _ in range(5):
        assert seen.find((torch.ones(4, 2), 1), (), key_of) == (None, "a")
    assert built == [1] and seen.misses == 0
    # calls alternating between two states: after one call in each, the ring serves both
    y = torch.ones(4, 2)
    for step in range(12):
        with torch.inference_mode(step % 2 == 0):
            key, value = seen.find((y, 1), (), key_of)
        assert value == "a" and (step < 2 or key is None), step
    assert len(built) == 3  # the first call above, then one per state


def test_compiled_calls_are_recognised_by_the_ring(monkeypatch):
    """In compiled code every call of a known signature is recognised without building its key, the
    first compiled call included (which torch.compile may make inside a dispatch mode of its own)."""
    if _library._GUARDS is None:
        pytest.skip("torch._C._dynamo.guards.TensorGuards is missing or changed")
    built = []
    key_of = _library._metadata_key

    def counting(args, outputs=()):
        built.append(1)
        return key_of(args, outputs)

    monkeypatch.setattr(_library, "_metadata_key", counting)
    torch._dynamo.reset()
    seq = torch.tensor([5, 9, 3, 7, 1], dtype=torch.int32)  # a shape no other test uses
    fn = torch.compile(lambda s: torch.ops.sparse_mla.decode_runtime_metadata(s, 2)[1] + 1, fullgraph=True)
    rows = torch.arange(10)
    want = (seq.repeat_interleave(2) - 2 + rows % 2 + 1).to(torch.int32)  # qo_offset + 1, not the operator
    for _ in range(3):
        torch.testing.assert_close(fn(seq), want, rtol=0, atol=0)
    built.clear()
    for _ in range(10):
        torch.testing.assert_close(fn(seq), want, rtol=0, atol=0)
    assert built == [], f"{len(built)} of 10 compiled calls built their signature key"


def test_without_tensor_guards(monkeypatch):
    """Where PyTorch's tensor guard is missing (or fails the import-time self-test), every call builds
    its signature key, with the same results."""
    monkeypatch.setattr(_library, "_GUARDS", None)
    seen = _library._Validated()

    def key_of(args, outputs):
        return args[0].shape, args[1]

    x = torch.zeros(3)
    seen.put(key_of((x, 1), ()), "a", (x, 1))
    for _ in range(3):
        assert seen.find((torch.ones(3), 1), (), key_of) == (((3,), 1), "a")
    assert seen.find((torch.ones(4), 1), (), key_of) == (((4,), 1), None)
    assert seen.ring == []


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_dispatcher_is_used_where_it_can_be_observed(dispatched):
    args = swa_inputs()
    # a dispatch mode sees the operator
    with _Recorder() as rec:
        tsm.swa_indices(*args, window=4, block_size=2)
    assert dispatched == ["swa_indices"] and "sparse_mla.swa_indices.default" in rec.ops
    # fake tensors get the fake
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) for a in args]
        idx, lens = tsm.swa_indices(*fake, window=4, block_size=2)
    assert idx.shape == (4, 4) and dispatched[-1] == "swa_indices"
    # a torch-function mode (here the default-device context) is honoured
    with torch.device("cpu"):
        tsm.swa_indices(*args, window=4, block_size=2)
    assert len(dispatched) == 3
    # the profiler records the operator
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        tsm.swa_indices(*args, window=4, block_size=2)
    assert len(dispatched) == 4
    assert any(e.name == "sparse_mla::swa_indices" for e in prof.events())
    # an input that wants a gradient, and a scalar of another type than the schema's, are left to the
    # dispatcher (its autograd handling, its conversion)
    q, cache, indices = mla_inputs(requires_grad=True)
    tsm.sparse_mla_decode(q, cache, indices, softmax_scale=0.125, head_dim_v=32)
    assert dispatched[-1] == "sparse_mla_decode"
    q = q.detach()
    # an unhashable argument: the dispatcher's own error
    with pytest.raises(RuntimeError):
        tsm.swa_indices(*args, window=[4], block_size=2)
    assert dispatched[-1] == "swa_indices"
    del dispatched[-1]
    o_int, _ = tsm.sparse_mla_decode(q, cache, indices, softmax_scale=1, head_dim_v=32)
    assert len(dispatched) == 6
    o_float, _ = tsm.sparse_mla_decode(q, cache, indices, softmax_scale=1.0, head_dim_v=32)
    assert len(dispatched) == 6
    torch.testing.assert_close(o_int, o_float, rtol=0, atol=0)


def test_compiled_calls_use_the_operator():
    args = swa_inputs()

    def step(positions, token_to_req, block_table, slot_mapping):
        return tsm.swa_indices(positions, token_to_req, block_table, slot_mapping, window=4, block_size=2)

    torch._dynamo.reset()
    gm_ops = []

    def backend(gm, example_inputs):
        gm_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    got = torch.compile(step, backend=backend, fullgraph=True)(*args)
    assert "sparse_mla.swa_indices.default" in gm_ops
    for a, b in zip(got, torch.ops.sparse_mla.swa_indices(*args, 4, 2)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _FakeRun:
    global_scratch_size = 0
    profile_scratch_size = 0
    launch_cooperative_grid = False
    launch_pdl = False
    arg_annotations = "ann"
    kernel_signature = b"sig"
    launch = len  # any builtin


class _FakeCompiled:
    function = 1234
    packed_metadata = (4, 1, 0)
    run = _FakeRun()


def test_direct_launcher_conventions(monkeypatch):
    monkeypatch.setattr(_launch, "_ABI", (3, 6))
    launch, head, tail = _launch._direct_launcher(_FakeCompiled())
    assert launch is len and tail is None
    assert head == (1234, False, False, None, None, (4, 1, 0), None, None, None)
    for abi in ((3, 7), (3, 8), (3, 9)):  # 3.8's and 3.9's launch functions take 3.7's arguments
        monkeypatch.setattr(_launch, "_ABI", abi)
        launch, head, tail = _launch._direct_launcher(_FakeCompiled())
        assert launch is len
        assert head == (1234, False, False, (4, 1, 0), None, None, None, None, None) and tail == ("ann", b"sig")
    # 3.8's wrapper appends the sanitizer's state pointer to the arguments of an instrumented kernel
    compiled = _FakeCompiled()
    compiled.run = type("R", (_FakeRun,), {"gsan_enabled": True})()
    assert _launch._direct_launcher(compiled) == (compiled.run, (1234, (4, 1, 0), None, None, None), None)
    # a kernel that needs Triton to allocate scratch memory, or a wrapped launch function, keeps Triton's
    # launcher wrapper (CompiledKernel.run), still without the JIT's argument binding
    compiled = _FakeCompiled()
    compiled.run = type("R", (_FakeRun,), {"global_scratch_size": 128})()
    assert _launch._direct_launcher(compiled) == (compiled.run, (1234, (4, 1, 0), None, None, None), None)
    compiled.run = type("R", (_FakeRun,), {"launch": staticmethod(lambda *a: None)})()
    assert _launch._direct_launcher(compiled)[0] is compiled.run
    monkeypatch.setattr(_launch, "_ABI", None)
    assert _launch._direct_launcher(compiled)[0] is compiled.run
    assert _launch._direct_launcher(object()) is None


_WRAPPER_LAUNCH_CALLS = {
    # Triton's launcher wrapper (CudaLauncher.__call__) per release: its parameters and its call of the C
    # launch function, whose arguments _direct_launcher reproduces (3.6: head and the kernel's arguments;
    # 3.7 to 3.9: head, tail and the argument list)
    (3, 6): ("def __call__(self, gridX, gridY, gridZ, stream, function, *args)",
             "self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, "
             "global_scratch, profile_scratch, *args)"),
    (3, 7): ("def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, "
             "launch_enter_hook, launch_exit_hook, *args)",
             "self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, "
             "kernel_metadata, launch_metadata, launch_enter_hook, launch_exit_hook, global_scratch, "
             "profile_scratch, self.arg_annotations, self.kernel_signature, args)"),
    (3, 8): ("def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, "
             "launch_enter_hook, launch_exit_hook, *args)",
             "self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, "
             "kernel_metadata, launch_metadata, launch_enter_hook, launch_exit_hook, global_scratch, "
             "profile_scratch, self.arg_annotations, self.kernel_signature, kernel_args)"),
}
_WRAPPER_LAUNCH_CALLS[(3, 9)] = _WRAPPER_LAUNCH_CALLS[(3, 8)]


def test_launch_shortcut_versions(monkeypatch):
    monkeypatch.delenv("TORCH_SPARSE_MLA_JIT_LAUNCH", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not _launch.HAS_TRITON:
        pytest.skip("needs triton")
    for version, abi in (("3.6.0", (3, 6)), ("3.7.1", (3, 7)), ("3.8.0", (3, 8)), ("3.8.1+gitabc", (3, 8)),
                         ("3.9.0", (3, 9)), ("3.10.0", None), ("3.5.1", None), ("4.0.0", None), ("main", None)):
        monkeypatch.setattr(_launch.triton, "__version__", version)
        assert _launch._fast_launch_abi() == abi, version
    monkeypatch.setattr(_launch.triton, "__version__", "3.8.0")
    monkeypatch.setenv("TORCH_SPARSE_MLA_JIT_LAUNCH", "1")
    assert _launch._fast_launch_abi() is None
    monkeypatch.delenv("TORCH_SPARSE_MLA_JIT_LAUNCH")
    assert _launch._fast_launch_abi() == (3, 8)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")  # a ROCm build: Triton's AMD launch function
    assert _launch._fast_launch_abi() is None
    assert set(_WRAPPER_LAUNCH_CALLS) == set(_launch._FAST_LAUNCH_TRITON_VERSIONS)


def test_amd_buffer_ops_off_with_triton_36(monkeypatch):
    """Triton 3.6's AMD backend cannot build the portable sparse-MLA decode with its buffer operations
    (``ops/_launch.py::_amd_buffer_ops_off``): for an AMD target with 3.6 a launch compiles with them off
    for its own call only; every other release and target keeps Triton's setting. (The build itself:
    ``test_kernel_domains.py::test_portable_kernels_compile_for_other_gpus``, run with 3.6.)"""
    if not _launch.HAS_TRITON or not hasattr(_launch.triton, "knobs"):
        pytest.skip("needs triton")
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class Target:
        backend = "cuda"

        def get_current_target(self):
            return GPUTarget(self.backend, "gfx942" if self.backend == "hip" else 90, 64)

    target = Target()
    monkeypatch.setattr(driver, "_active", target)
    seen = []
    monkeypatch.setattr(_launch.KernelLaunch, "_jit_launch_here",
                        lambda self, args: seen.append(_launch.triton.knobs.amd.use_buffer_ops))
    for version, backend, off in (("3.6.0", "hip", True), ("3.6.1", "hip", True), ("3.7.1", "hip", False),
                                  ("3.9.0", "hip", False), ("3.6.0", "cuda", False)):
        monkeypatch.setattr(_launch.triton, "__version__", version)
        target.backend = backend
        _launch._amd_buffer_ops_off.cache_clear()
        assert _launch._amd_buffer_ops_off() is off, (version, backend)
        seen.clear()
        before = _launch.triton.knobs.amd.use_buffer_ops
        _launch.KernelLaunch.__new__(_launch.KernelLaunch)._jit_launch_scoped(())
        assert seen == [before and not off] and _launch.triton.knobs.amd.use_buffer_ops == before
    _launch._amd_buffer_ops_off.cache_clear()


def test_capability_choices_on_rocm(monkeypatch):
    """On a ROCm build of PyTorch a ``"cuda"`` device is an AMD GPU whose capability is its GFX version:
    ``(9, 0)`` for an MI200 (gfx90a), ``(9, 4)`` for an MI300 (gfx942). Neither may pick the sm_90
    (Gluon) kernels nor Triton's float8 types; on NVIDIA GPUs the choices stay as they were."""
    from torch_sparse_mla.ops import sparse_gqa_hopper, sparse_mla_hopper

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(_launch, "_CAPABILITY", {})
    for hip, capability, sm90, float8 in ((None, (9, 0), True, True), (None, (8, 9), False, True),
                                          (None, (8, 0), False, False), (None, (10, 0), False, True),
                                          ("6.4.43482", (9, 0), False, False), ("6.4.43482", (9, 4), False, False),
                                          ("6.4.43482", (9, 5), False, False), ("6.4.43482", (11, 0), False, False)):
        monkeypatch.setattr(torch.version, "hip", hip)
        _launch._CAPABILITY[0] = capability
        assert _launch.hip() is (hip is not None)
        assert sparse_mla_hopper._is_sm90(gpu) is sm90, (hip, capability)
        assert _launch.float8_conversions(gpu) is float8, (hip, capability)
    assert sparse_gqa_hopper._is_sm90 is sparse_mla_hopper._is_sm90  # one test for both Hopper kernels
    assert not _launch.float8_conversions(torch.device("cpu"))


def test_portable_kernel_warning_on_sm90(monkeypatch):
    """Where this Triton gives no Hopper kernels, an sm_90 GPU's call that one would serve runs the
    portable kernel, slower at the models' shapes: ``warn_portable_on_sm90`` says so once per operator, with the
    reason, and says nothing for other devices, other layouts or where the Hopper kernels exist. (The
    launchers' calls of it: ``test_kernel_domains.py::test_triton_interpreter_warns_without_hopper_kernels``.)"""
    import warnings

    from torch_sparse_mla.ops import sparse_mla_hopper as hopper

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(_launch, "_CAPABILITY", {0: (9, 0)})
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(hopper, "_WARNED", set())
    monkeypatch.setattr(hopper, "HAS_GLUON", False)
    monkeypatch.setattr(hopper, "GLUON_UNAVAILABLE", "triton 3.10.0 is not a release the Hopper kernels are "
                                                     "written for (3.6, 3.7, 3.8, 3.9)")
    with pytest.warns(hopper.PortableKernelWarning, match=r"sparse_mla_decode runs its portable Triton kernel on "
                      r"this sm_90 GPU.*triton 3\.10\.0 is not a release.*A triton from 3\.6 to 3\.9"):
        hopper.warn_portable_on_sm90("sparse_mla_decode", gpu, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hopper.warn_portable_on_sm90("sparse_mla_decode", gpu, True)  # once per operator
        hopper.warn_portable_on_sm90("sparse_gqa_decode", gpu, False)  # a layout the Hopper kernel refuses
        hopper.warn_portable_on_sm90("sparse_gqa_decode", torch.device("cpu"), True)
        _launch._CAPABILITY[0] = (8, 0)
        hopper.warn_portable_on_sm90("sparse_gqa_decode", gpu, True)  # not sm_90
        _launch._CAPABILITY[0] = (9, 0)
        monkeypatch.setattr(torch.version, "hip", "6.4.43482")
        hopper.warn_portable_on_sm90("sparse_gqa_decode", gpu, True)  # an MI200
        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setattr(hopper, "HAS_GLUON", True)
        hopper.warn_portable_on_sm90("sparse_gqa_decode", gpu, True)  # the Hopper kernels exist
    monkeypatch.setattr(hopper, "HAS_GLUON", False)
    with pytest.warns(hopper.PortableKernelWarning, match="sparse_gqa_decode"):
        hopper.warn_portable_on_sm90("sparse_gqa_decode", gpu, True)


def test_gluon_unavailable_reason():
    """The reason given where a Triton release is outside ``GLUON_TRITON_VERSIONS`` (a new process that
    sees triton's version as 3.10.0 when the package is imported)."""
    if not _launch.HAS_TRITON:
        pytest.skip("needs triton")
    code = ("import triton; triton.__version__ = '3.10.0'; from torch_sparse_mla.ops import sparse_mla_hopper as h; "
            "print(h.HAS_GLUON, '|', h.GLUON_UNAVAILABLE)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == ("False | triton 3.10.0 is not a release the Hopper kernels "
                                                      "are written for (3.6, 3.7, 3.8, 3.9)"), result.stdout


def test_shared_memory_per_block(monkeypatch):
    """The shared memory the portable sparse-MLA planner fits its tiles to: the device's opt-in size,
    else (a build whose properties report none) its plain per-block size, else the sm_90 figure."""
    import types

    gpu = torch.device("cuda", 0)
    for props, want in ((dict(shared_memory_per_block_optin=232_448, shared_memory_per_block=49_152), 232_448),
                        (dict(shared_memory_per_block=65_536), 65_536),
                        (dict(shared_memory_per_block_optin=0, shared_memory_per_block=65_536), 65_536),
                        ({}, _launch.DEFAULT_SHARED_BYTES)):
        monkeypatch.setattr(_launch, "_SHARED", {})
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index, p=props: types.SimpleNamespace(**p))
        assert _launch.shared_memory_per_block(gpu) == want, props
    assert _launch.shared_memory_per_block(torch.device("cpu")) == _launch.DEFAULT_SHARED_BYTES


def test_hopper_ptx_options(monkeypatch):
    """The Hopper kernels' ptxas options (``ops/_launch.py::hopper_ptx_options``): ptxas's default
    register-allocation level, given after Triton's own ``--regAllocOptLevel=2``, where the ptxas that
    builds sm_90 code is CUDA 13 or later; the user's ``PTXAS_OPTIONS`` after it (theirs win); Triton's
    defaults elsewhere. Both Hopper launchers build their launches with them."""
    if not _launch.HAS_TRITON:
        pytest.skip("needs triton")
    from torch_sparse_mla.ops import sparse_gqa_hopper, sparse_mla_hopper

    monkeypatch.delenv("PTXAS_OPTIONS", raising=False)
    for major, want in ((13, _launch.HOPPER_REG_ALLOC), (14, _launch.HOPPER_REG_ALLOC), (12, None), (None, None)):
        monkeypatch.setattr(_launch, "_sm90_ptxas_major", lambda major=major: major)
        assert _launch.hopper_ptx_options() == want, major
        monkeypatch.setenv("PTXAS_OPTIONS", "-O1 --regAllocOptLevel=2")
        assert _launch.hopper_ptx_options() == " ".join(filter(None, (want, "-O1 --regAllocOptLevel=2"))), major
        monkeypatch.delenv("PTXAS_OPTIONS")
    assert _launch.HOPPER_REG_ALLOC == "--regAllocOptLevel=4"

    # the version of the installed wheel's ptxas is read (3.6-3.8 build sm_90 code with CUDA 12.9's, 3.9 with
    # CUDA 13.4's), unless a path in the environment names another one
    monkeypatch.undo()
    major = _launch._sm90_ptxas_major()
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(90).path
    except Exception:  # noqa: BLE001 - no CUDA backend or no ptxas
        path = None
    if path is None or not os.path.exists(path):
        assert major is None
    elif not any(k.startswith("TRITON_PTXAS") for k in os.environ):
        assert major == (13 if release(_launch.triton.__version__) >= (3, 9) else 12)

    # the two Hopper launchers pass them on (the kernels are not built: the launch is only recorded)
    if not sparse_mla_hopper.HAS_GLUON:
        pytest.skip("no Hopper kernels with this triton")
    made = []

    class Recorder:
        def __init__(self, *args, **kwargs):
            made.append(kwargs)

    monkeypatch.delenv("PTXAS_OPTIONS", raising=False)
    monkeypatch.setattr(_launch, "_sm90_ptxas_major", lambda: 13)
    monkeypatch.setattr(sparse_mla_hopper, "KernelLaunch", Recorder)
    monkeypatch.setattr(sparse_gqa_hopper, "KernelLaunch", Recorder)
    for heads in (64, 16):
        q = torch.zeros(2, heads, 576, dtype=torch.bfloat16)
        plan = sparse_mla_hopper.plan_launch(2, heads, 2048, 132)
        sparse_mla_hopper.make_launch((), q, "fp8_656", None, None, None, None, plan)
    q = torch.zeros(2, 16, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 4, 64, 72, dtype=torch.uint8)  # NVFP4: 2 KV heads, pages of 64
    pages = torch.zeros(2, 2, 3, dtype=torch.int32)
    rows = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.zeros(2, dtype=torch.int32)
    out = torch.zeros(2, 16, 128, dtype=torch.bfloat16)
    plan = sparse_gqa_hopper.plan_launch(2, 2, 8, 3, 64, 132)
    sparse_gqa_hopper.make_launch(q, cache, pages, rows, lens, lens, 1, 0.1, 1.0, False, False, out, plan)
    assert [m["ptx_options"] for m in made] == [_launch.HOPPER_REG_ALLOC] * 3


def test_kernels_keep_fp_fusion(monkeypatch):
    """Every launch compiles its kernel with FP contraction on (``enable_fp_fusion=True``), as all the
    kernels were tested with, whatever ``TRITON_DEFAULT_FP_FUSION`` says: Triton 3.9 warns that its
    default becomes "off" in 3.10, and built with it off the NVFP4 cache writer's code changes (34
    fewer fused multiply-adds, docs/testing.md). Launches are recorded here, not compiled."""
    if not _launch.HAS_TRITON:
        pytest.skip("needs triton")
    from torch_sparse_mla.ops import kv_cache as kv_ops
    from torch_sparse_mla.ops import sparse_gqa as gqa_ops

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    seen = []
    monkeypatch.setattr(_launch.KernelLaunch, "_jit_launch_here",
                        lambda self, args: seen.append((self.kernel.__name__, dict(self.options))))
    monkeypatch.setattr(kv_ops, "_PLANS", _launch.PlanCache())
    monkeypatch.setattr(gqa_ops, "_PLANS", _launch.PlanCache())
    kv_ops.kv_cache_insert_triton(torch.zeros(3, 656 - 80, dtype=torch.bfloat16), torch.arange(3),
                                  torch.zeros(2, 4, 656, dtype=torch.uint8), "fp8_656")
    k = torch.zeros(3, 2, 128, dtype=torch.bfloat16)
    gqa_ops.gqa_kv_cache_insert_triton(k, k, torch.arange(3), torch.zeros(2, 4, 16, 72, dtype=torch.uint8))
    assert [name for name, _ in seen] == ["_kv_cache_insert_kernel", "_gqa_kv_cache_insert_kernel"]
    assert all(options["enable_fp_fusion"] is True for _, options in seen), seen


def test_launch_shortcut_matches_the_installed_triton():
    """The installed Triton's launcher wrapper still calls its C launch function the way the shortcut
    does (read from its source, so that a release that changes the convention fails here, on any
    machine, rather than at a GPU launch)."""
    import inspect
    import re

    if not _launch.HAS_TRITON:
        pytest.skip("needs triton")
    abi = release(_launch.triton.__version__)
    if abi not in _WRAPPER_LAUNCH_CALLS:
        pytest.skip(f"triton {_launch.triton.__version__}: the shortcut is off (normal launches)")
    from triton.backends.nvidia import driver

    source = re.sub(r"\s+", " ", inspect.getsource(driver.CudaLauncher.__call__))
    signature, call = _WRAPPER_LAUNCH_CALLS[abi]
    assert signature in source
    assert call in source
    if abi in ((3, 8), (3, 9)):  # the list passed is the kernel's arguments unless the sanitizer is on
        assert re.search(r"kernel_args = args if self\.gsan_enabled: .*kernel_args = \(\*args, [\w, ]+\)", source)
    if abi != (3, 6):  # the C launch function's argument format (3.6 generates its launcher per kernel)
        c_source = open(os.path.join(os.path.dirname(driver.__file__), "driver.c")).read()
        assert 'PyArg_ParseTuple(args, "iiiKKpp(iii)OOOOOOy*O"' in c_source


def test_launch_shortcut_call_form(monkeypatch):
    """The shortcut's call of a recorded launch function, without a GPU: device addresses in the
    tensor positions, the planned scalars and constexprs elsewhere, in each convention's order."""
    from torch_sparse_mla.ops import metadata as metadata_ops

    if not _launch.HAS_TRITON:
        pytest.skip("needs triton")
    calls = []
    monkeypatch.setattr(_launch, "_FAST", True)
    monkeypatch.setattr(_launch, "_get_device", lambda: 0)
    monkeypatch.setattr(_launch, "_raw_stream", lambda index: 77)
    a, b = torch.zeros(4, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    launch = _launch.KernelLaunch(metadata_ops._decode_runtime_metadata_kernel, (2,), (a, 5, b, 6, a, 7, 9, 10),
                                  {"BLOCK": 128}, num_warps=4, device=torch.device("cuda", 0))
    align = 0
    for t in (a, b, a):
        align = (align << 1) | (t.data_ptr() % 16 == 0)
    want = [a.data_ptr(), 5, b.data_ptr(), 6, a.data_ptr(), 7, 9, 10, 128]
    launch.compiled[align] = (lambda *args: calls.append(args), ("fn", "head"), None)
    launch(a, b, a)
    assert calls[-1] == (2, 1, 1, 77, "fn", "head", *want)
    launch.compiled[align] = (lambda *args: calls.append(args), ("fn",), ("ann", "sig"))
    launch(a, b, a)
    assert calls[-1] == (2, 1, 1, 77, "fn", "ann", "sig", want)


def test_recorded_launches(monkeypatch):
    """What a record keeps: each launch with the positions of its tensors among the call's own; no
    record when a launch got another tensor or an argument passed twice; records of two threads kept
    apart; no record nested in another."""
    import gc
    import threading
    import weakref

    from torch_sparse_mla.ops import metadata as metadata_ops

    calls = {}  # KernelLaunch -> the tensors of each of its launches (Triton's launch replaced)
    monkeypatch.setattr(_launch, "_FAST", False)
    monkeypatch.setattr(_launch.KernelLaunch, "_jit_launch",
                        lambda self, args: calls.setdefault(self, []).append([args[i] for i in self.tensor_pos]))

    def Launch():
        x = torch.zeros(1, dtype=torch.int32)
        return _launch.KernelLaunch(metadata_ops._decode_runtime_metadata_kernel, (1,), (x, 1, x, 1, x, 1, 1, 1),
                                    {"BLOCK": 128}, num_warps=4, device=torch.device("cpu"))

    first, second = Launch(), Launch()
    a, b, c = torch.zeros(2), torch.zeros(3), torch.zeros(4)

    def launcher(x, y, *, out):
        first(x, out, out)
        second(y, x, out)

    plan = _library._record(launcher, (a, b), {"out": c})
    assert plan[0] == () and [launch for launch, _ in plan[1]] == [first, second]
    a2, b2, c2 = torch.ones(2), torch.ones(3), torch.ones(4)
    _library._replay(plan, (a2, b2, c2))
    assert all(x is y for x, y in zip(calls[first][-1], (a2, c2, c2)))
    assert all(x is y for x, y in zip(calls[second][-1], (b2, a2, c2)))
    # a workspace of the launcher's own, or one object passed as two arguments: no record
    assert _library._record(lambda x, y, *, out: first(x, torch.zeros(1), out), (a, b), {"out": c}) is None
    assert _library._record(launcher, (a, a), {"out": c}) is None
    # a record inside a record (same thread) runs without recording; the outer one keeps all launches
    def outer(x, y, *, out):
        first(x, out, out)
        assert _library._record(launcher, (x, y), {"out": out}) is None
        second(y, x, out)

    plan = _library._record(outer, (a, b), {"out": c})
    assert [launch for launch, _ in plan[1]] == [first, first, second, second]
    # two threads record at the same time: each keeps its own launches
    started, release = threading.Event(), threading.Event()
    result = {}

    def slow(x, y, *, out):
        first(x, out, out)
        started.set()
        release.wait(10)
        second(y, x, out)

    worker = threading.Thread(target=lambda: result.update(plan=_library._record(slow, (a, b), {"out": c})))
    worker.start()
    assert started.wait(10)
    mine = _library._record(lambda x, y, *, out: second(y, x, out), (a, b), {"out": c})
    release.set()
    worker.join(10)
    assert [launch for launch, _ in mine[1]] == [second]
    assert [launch for launch, _ in result["plan"][1]] == [first, second]
    assert not _launch.RECORDERS
    # a buffer the launcher allocates through scratch(): the record keeps its size, not the buffer, and
    # each replay passes a new buffer of that size where the recorded launch had it
    def with_workspace(x, y, *, out):
        ws = _launch.scratch(5, torch.float32, x.device)
        first(x, ws, out)
        second(ws, y, out)

    plan = _library._record(with_workspace, (a, b), {"out": c})
    assert plan[0] == ((5, torch.float32, a.device),)
    ws_recorded = weakref.ref(calls[first][-1][1])
    del calls[first][-1], calls[second][-1]
    gc.collect()
    assert ws_recorded() is None  # the record did not keep the recorded call's buffer alive
    _library._replay(plan, (a2, b2, c2))
    ws_first, ws_second = calls[first][-1][1], calls[second][-1][0]
    assert ws_first is ws_second and ws_first.shape == (5,) and ws_first.dtype == torch.float32
    assert calls[first][-1][0] is a2 and calls[second][-1][1] is b2
    _library._replay(plan, (a2, b2, c2))
    assert calls[first][-1][1] is not ws_first  # a new buffer per replay


@pytest.mark.parametrize("fast", [False, True], ids=["jit_path", "shortcut"])
def test_replay_runs_the_launcher_for_an_unaligned_tensor(monkeypatch, fast):
    """A launch whose kernel needs a tensor 16-byte aligned (the Hopper kernels' caches) raises before
    launching when a call's tensor there is not; a replay of a record holding it reports that, and the
    later call of the signature runs the launcher instead (which plans another kernel on the GPU)."""
    from torch_sparse_mla.ops import metadata as metadata_ops

    launched = []
    monkeypatch.setattr(_launch, "_FAST", fast)
    monkeypatch.setattr(_launch, "_get_device", lambda: 0)
    monkeypatch.setattr(_launch.KernelLaunch, "_jit_launch",
                        lambda self, args: launched.append([args[i] for i in self.tensor_pos]))
    x = torch.zeros(1, dtype=torch.int32)
    device = torch.device("cuda", 0) if fast else torch.device("cpu")
    needy = _launch.KernelLaunch(metadata_ops._decode_runtime_metadata_kernel, (1,), (x, 1, x, 1, x, 1, 1, 1),
                                 {"BLOCK": 128}, num_warps=4, device=device, aligned=(2,))
    storage = torch.zeros(64, dtype=torch.int32)
    aligned, other, unaligned = storage[:8], storage[16:24], storage[1:9]  # 4 bytes past an aligned tensor
    assert aligned.data_ptr() % 16 == 0 == other.data_ptr() % 16 and unaligned.data_ptr() % 16 == 4
    needy(unaligned, aligned, unaligned)  # only the second tensor must be aligned
    assert len(launched) == 1
    with pytest.raises(_launch.MisalignedLaunch):
        needy(aligned, unaligned, aligned)
    assert len(launched) == 1

    def launcher(a, b, *, out):
        needy(a, b, out)
        launched.append("launcher")

    out = torch.zeros(8, dtype=torch.int32)
    record = _library._record(launcher, (aligned, other), {"out": out})
    assert launched[-1] == "launcher" and len(launched) == 3
    assert _library._replay(record, (other, aligned, out)) and len(launched) == 4
    assert not _library._replay(record, (aligned, unaligned, out)) and len(launched) == 4
    # a later call of the signature with the unaligned tensor: the launcher runs instead of the replay
    reuse = (((8,), torch.int32),), torch.device("cpu"), record
    _library._functional_again(lambda a, b, *, out: launched.append(("launcher", b)), ("out",), reuse,
                               (aligned, unaligned))
    assert launched[-1] == ("launcher", unaligned)
    _library._functional_again(lambda a, b, *, out: launched.append("no"), ("out",), reuse, (unaligned, other))
    assert launched[-1] != "no" and launched[-1][1] is other  # replayed: the needed tensor is aligned


@requires_cuda
def test_launch_shortcut_matches_triton_launch():
    """On the GPU: the second call of a planned launch takes the shortcut (when this Triton version
    has it) and gives the same results as Triton's own launch path."""
    from torch_sparse_mla.ops import metadata as metadata_ops

    args = swa_inputs("cuda")
    want = torch.ops.sparse_mla.swa_indices(*args, 4, 2)
    metadata_ops._PLANS.clear()
    for _ in range(3):
        idx = torch.full((4, 4), -7, dtype=torch.int32, device="cuda")
        lens = torch.full((4,), -7, dtype=torch.int32, device="cuda")
        metadata_ops.swa_indices_triton(*args, 4, 2, indices=idx, lens=lens)
        torch.testing.assert_close(idx, want[0], rtol=0, atol=0)
        torch.testing.assert_close(lens, want[1], rtol=0, atol=0)
    (launch,) = metadata_ops._PLANS.values()
    if _launch._FAST:
        (entry,) = launch.compiled.values()
        assert type(entry[0]).__name__ == "builtin_function_or_method"


@requires_cuda
def test_recorded_launches_replay_on_both_paths():
    """On the GPU, a signature's second and later calls replay the launches recorded on its first call
    (no launcher, no plan lookup), on the public functions' direct path and in the implementations
    registered for CUDA (what ``torch.ops.sparse_mla`` and compiled code call). Every call matches the
    CPU kernels, with new data each time, for functional and out overloads and for a writing operator."""
    gen = torch.Generator().manual_seed(0)
    idx = torch.empty(4, 4, dtype=torch.int32, device="cuda")
    lens = torch.empty(4, dtype=torch.int32, device="cuda")
    idx_ops, lens_ops = torch.empty_like(idx), torch.empty_like(lens)
    cache = torch.zeros(8, 64, 656, dtype=torch.uint8, device="cuda")
    cache_ops = torch.zeros_like(cache)
    cache_cpu = torch.zeros_like(cache, device="cpu")
    for step in range(4):
        positions = torch.randint(0, 12, (4,), generator=gen)
        token_to_req = torch.randint(0, 2, (4,), generator=gen, dtype=torch.int32)
        block_table = torch.randint(-1, 6, (2, 3), generator=gen, dtype=torch.int32)
        slot_mapping = torch.randint(-1, 9, (4,), generator=gen)
        cpu_args = (positions, token_to_req, block_table, slot_mapping)
        args = tuple(a.cuda() for a in cpu_args)
        want = torch.ops.sparse_mla.swa_indices(*cpu_args, 4, 2)
        got = [tsm.swa_indices(*args, window=4, block_size=2), torch.ops.sparse_mla.swa_indices(*args, 4, 2)]
        tsm.swa_indices(*args, window=4, block_size=2, out=(idx, lens))
        torch.ops.sparse_mla.swa_indices.out(*args, 4, 2, indices=idx_ops, lens=lens_ops)
        for result in (*got, (idx, lens), (idx_ops, lens_ops)):
            for a, b in zip(want, result):
                torch.testing.assert_close(b.cpu(), a, rtol=0, atol=0)
        kv = torch.randn(3, 576, generator=gen).to(torch.bfloat16)
        slots = torch.randperm(8 * 64, generator=gen)[:3]
        torch.ops.sparse_mla.kv_cache_insert(kv, slots, cache_cpu, "fp8_656")
        tsm.kv_cache_insert(kv.cuda(), slots.cuda(), cache, kv_format="fp8_656")
        torch.ops.sparse_mla.kv_cache_insert(kv.cuda(), slots.cuda(), cache_ops, "fp8_656")
        assert torch.equal(cache.cpu(), cache_cpu) and torch.equal(cache_ops.cpu(), cache_cpu)
        want = torch.ops.sparse_mla.kv_cache_gather(cache_cpu, slots, "fp8_656")
        for got in (tsm.kv_cache_gather(cache, slots.cuda(), kv_format="fp8_656"),
                    torch.ops.sparse_mla.kv_cache_gather(cache, slots.cuda(), "fp8_656")):
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)

    def recorded(fn, nested=False):
        """Whether a cached entry of ``fn`` holds recorded launches (the direct path of a functional
        overload keeps them inside its reuse tuple)."""
        seen = signature_cache(fn)
        records = [(e[-1][-1] if nested else e[-1]) for e in seen.values() if isinstance(e, tuple)]
        return any(record is not None and record[1] for record in records)  # (scratch sizes, launches)

    for overload in ("swa_indices", "swa_indices.out", "kv_cache_insert", "kv_cache_gather"):
        assert recorded(_library._DIRECT[overload], nested="." not in overload and overload != "kv_cache_insert"), overload
        assert recorded(_library.IMPLS[overload, "CUDA"]), overload


@requires_interpreter
def test_interpreter_mask_from_a_loaded_scalar():
    """A load and store masked by a block condition and a condition on a scalar loaded from memory (as
    the portable kernels mask an invalid slot) run under the interpreter and mask exactly. With triton
    3.9.0 the interpreter refuses such a mask unless ``tests/conftest.py`` mends it; this fails there
    without the mend, and checks that the mend is in place exactly where the interpreter needs it."""
    import numpy as np
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    @triton.jit
    def masked_copy(x_ptr, slot_ptr, out_ptr, n):
        slot = tl.load(slot_ptr)
        ok = (slot >= 0) & (slot < n)
        i = tl.arange(0, 8)
        mask = (i < 5) & ok
        tl.store(out_ptr + i, tl.load(x_ptr + i, mask=mask, other=-1.0), mask=mask)

    x = torch.arange(8, dtype=torch.float32) + 1
    for slot, want_copied in ((3, True), (-1, False), (10, False)):
        out = torch.zeros(8)
        masked_copy[(1,)](x, torch.tensor([slot]), out, 10)
        want = torch.where(torch.arange(8) < 5, x, 0.0) if want_copied else torch.zeros(8)
        assert torch.equal(out, want), (slot, out)
    try:
        interpreter._interpreter.load(np.zeros(1, np.uint64), np.zeros(1, np.int32), np.zeros(1, np.float32),
                                      np.dtype(np.float32))
        refuses_integer_masks = False
    except ValueError:
        refuses_integer_masks = True
    assert getattr(interpreter.InterpreterBuilder, "_tsm_mask_mended", False) == refuses_integer_masks
