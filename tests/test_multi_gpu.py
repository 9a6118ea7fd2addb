"""Operators on any GPU of a host: the device of the inputs, whatever the current device is.

Sections: mixed devices rejected by every fake, for every tensor argument (optional ones and outputs
included), checked on fake tensors (``cuda:0`` with ``cuda:1``, CUDA with CPU: no GPU needed; on a
machine with one GPU the ``cuda:1`` cases are skipped, since a fake CUDA tensor needs its device to
exist there); then, on a machine with two GPUs, every operator (functional and ``.out``) on
``cuda:1`` tensors while the current device is ``cuda:0`` against the same call on ``cuda:0`` (same
kernels, same bits), a CUDA graph captured on ``cuda:1``, ``torch.compile(fullgraph=True)`` of a
decode step on ``cuda:1``, and real mixed-device calls rejected.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import formats_reference as ref
import torch_sparse_mla as tsm
from common import poison
from test_metadata import make_batch
from test_sparse_mla import Spec
from test_sparse_mla import make_inputs as mla_inputs

ops = torch.ops.sparse_mla
I32, I64, BF16, F16, F32 = torch.int32, torch.int64, torch.bfloat16, torch.float16, torch.float32

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
_skip_without_two_gpus = pytest.mark.skipif(
    not TWO_GPUS,
    reason="needs two CUDA GPUs: runs on a two-GPU machine (the fake-tensor checks above also run without CUDA)")


def requires_two_gpus(test):
    return pytest.mark.cuda(_skip_without_two_gpus(test))


# =====================================================================================================
# Every operator's arguments (schema order) and outputs, on CPU
# =====================================================================================================


def _gqa_args(seed=0):
    g = torch.Generator().manual_seed(seed)
    t, hq, hkv, dh, ps, pages = 6, 8, 2, 128, 16, 10
    cache = torch.randn(pages, hkv, ps, 2 * dh, generator=g).to(BF16)
    table = torch.stack([torch.randperm(pages, generator=g)[:4] for _ in range(3)]).to(I32)
    topk = torch.randint(-1, 4, (t, hkv, 3), generator=g).to(I32)
    lens = torch.full((t,), 4 * ps, dtype=I32)
    qo = (torch.arange(t) + 3 * ps).to(I32)
    return (torch.randn(t, hq, dh, generator=g).to(BF16), cache, topk, table, lens, qo, 2, 0.09, 1.0, 1.0, 1.0)


@functools.lru_cache(maxsize=1)
def operator_cases():
    """name -> (overload, positional arguments, output buffers) for every overload of every operator,
    on CPU, with every optional tensor argument given (built once; callers move copies)."""
    b = make_batch(0)
    t, k = b.local_indices.shape
    d = b.num_decode
    per_token = (b.token_to_req, b.block_table, b.slot_mapping)
    mla = mla_inputs(Spec(kv_format="fp8_584", T=3, H=20, K=40, K2=16, lengths=True, sink="finite", page_pad=5))
    mla_args = tuple(mla.get(n) for n in ("q", "kv_cache", "indices", "softmax_scale", "kv_format", "head_dim_v",
                                          "topk_length", "attn_sink", "extra_kv_cache", "extra_indices",
                                          "extra_topk_length"))
    cache = ref.make_cache(4, 16, "fp8_656", page_pad=3)
    ref.fill_cache(cache, range(64), torch.randn(64, 576, generator=torch.Generator().manual_seed(1)), "fp8_656")
    slots = torch.tensor([3, -1, 17, 63, 64, 0])
    gqa = _gqa_args()
    i32 = lambda *shape: torch.empty(*shape, dtype=I32)  # noqa: E731
    return {
        "compressed_slot_mapping": (ops.compressed_slot_mapping.default,
                                    (b.query_start_loc, b.seq_lens, b.block_table, t + 2, 4, 2), {}),
        "compressed_slot_mapping.out": (ops.compressed_slot_mapping.out,
                                        (b.query_start_loc, b.seq_lens, b.block_table, 4, 2),
                                        {"out": torch.empty(t + 2, dtype=I64)}),
        "c128a_topk_indices": (ops.c128a_topk_indices.default, (b.positions, *per_token, d, 2, 4, 9), {}),
        "c128a_topk_indices.out": (ops.c128a_topk_indices.out, (b.positions, *per_token, d, 2, 4, 9),
                                   {"decode_indices": i32(d, 9), "decode_lens": i32(d),
                                    "prefill_indices": i32(t - d, 9)}),
        "decode_runtime_metadata": (ops.decode_runtime_metadata.default, (b.seq_lens, 3), {}),
        "decode_runtime_metadata.out": (ops.decode_runtime_metadata.out, (b.seq_lens, 3),
                                        {"kv_segment_lens": i32(3 * b.seq_lens.shape[0]),
                                         "qo_offset": i32(3 * b.seq_lens.shape[0])}),
        "swa_indices": (ops.swa_indices.default, (b.positions, *per_token, 6, 4), {}),
        "swa_indices.out": (ops.swa_indices.out, (b.positions, *per_token, 6, 4),
                            {"indices": i32(t, 6), "lens": i32(t)}),
        "compressed_topk_to_global": (ops.compressed_topk_to_global.default, (b.local_indices, *per_token, 4), {}),
        "compressed_topk_to_global.out": (ops.compressed_topk_to_global.out, (b.local_indices, *per_token, 4),
                                          {"indices": i32(t, k), "lens": i32(t)}),
        "kv_cache_insert": (ops.kv_cache_insert.default,
                            (torch.randn(6, 576, generator=torch.Generator().manual_seed(2)).to(BF16), slots,
                             ref.make_cache(4, 16, "fp8_656", page_pad=3), "fp8_656"), {}),
        "kv_cache_gather": (ops.kv_cache_gather.default, (cache, slots, "fp8_656", F32), {}),
        "kv_cache_gather.out": (ops.kv_cache_gather.out, (cache, slots.int(), "fp8_656", None),
                                {"out": torch.empty(6, 576, dtype=BF16)}),
        "sparse_mla_decode": (ops.sparse_mla_decode.default, mla_args, {}),
        "sparse_mla_decode.out": (ops.sparse_mla_decode.out, mla_args,
                                  {"out": torch.empty(3, 20, 512, dtype=BF16), "lse": torch.empty(3, 20)}),
        "sparse_gqa_decode": (ops.sparse_gqa_decode.default, gqa, {}),
        "sparse_gqa_decode.out": (ops.sparse_gqa_decode.out, gqa, {"out": torch.empty(6, 8, 128, dtype=BF16)}),
    }


def _tensor_arguments(overload, args, outputs):
    """(name, position or output name) of every tensor argument of a call."""
    names = [a.name for a in overload._schema.arguments if not a.kwarg_only]
    found = [(names[i], i) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    return found + [(n, n) for n in outputs]


def _moved(args, outputs, where, device, others):
    """The call's arguments on ``others``, with the one at ``where`` on ``device``."""
    def place(key, t):
        return t.to(device if key == where else others) if isinstance(t, torch.Tensor) else t

    return tuple(place(i, a) for i, a in enumerate(args)), {n: place(n, t) for n, t in outputs.items()}


MIXED_CASES = [(case, name, where, device) for case, (overload, args, outputs) in operator_cases().items()
               if len(_tensor_arguments(overload, args, outputs)) > 1
               for name, where in _tensor_arguments(overload, args, outputs) for device in ("cuda:1", "cpu")]

# A fake tensor on a CUDA device makes torch create a real one there first (FakeTensor's GPU context
# initialisation), so where CUDA is present cuda:1 must exist. Without CUDA (CI) and on two GPUs these
# fake-only checks run; on one GPU the cuda:1 cases are skipped and the CPU ones still run.
ONE_GPU = torch.cuda.is_available() and torch.cuda.device_count() < 2
_skip_cuda1_on_one_gpu = pytest.mark.skipif(
    ONE_GPU, reason="a fake tensor on cuda:1 needs that device where CUDA is present (runs without CUDA or on two "
                    "GPUs)")


# =====================================================================================================
# Mixed devices: every fake rejects them, naming the argument (fake tensors: no GPU needed)
# =====================================================================================================


@pytest.mark.parametrize("case,name,where,device", [
    pytest.param(*c, marks=_skip_cuda1_on_one_gpu if c[3] == "cuda:1" else ()) for c in MIXED_CASES],
    ids=[f"{c}-{n}-{d.replace(':', '')}" for c, n, _, d in MIXED_CASES])
def test_mixed_devices_rejected(case, name, where, device):
    """One tensor argument on ``cuda:1`` (or the CPU), the others on ``cuda:0``: ``ValueError`` that
    names it (or, when it is the first tensor, which sets the device, the first argument that differs)."""
    overload, args, outputs = operator_cases()[case]
    first = _tensor_arguments(overload, args, outputs)[0][0]
    with FakeTensorMode(allow_non_fake_inputs=True):
        moved_args, moved_outputs = _moved(args, outputs, where, device, "cuda:0")
        with pytest.raises(ValueError) as info:
            overload(*moved_args, **moved_outputs)
    message = str(info.value)
    if name == first:
        assert f"expected a tensor on {device} (where the first argument is), got cuda:0" in message, message
    else:
        assert message.startswith(f"{name}: expected a tensor on cuda:0 (where the first argument is), got {device}"), \
            message


@pytest.mark.parametrize("case", list(operator_cases()), ids=str)
def test_mixed_devices_name_the_first_in_schema_order(case):
    """Two tensor arguments (after the first, which sets the device) on another device (``meta``: no
    GPU needed): the error names the earlier of the two in the schema, for every pair."""
    overload, args, outputs = operator_cases()[case]
    tensors = _tensor_arguments(overload, args, outputs)[1:]
    pairs = [(a, b) for i, a in enumerate(tensors) for b in tensors[i + 1:]]
    for (name, where), (_, other) in pairs:
        moved_args = tuple(t.to("meta") if i in (where, other) and isinstance(t, torch.Tensor) else t
                           for i, t in enumerate(args))
        moved_outputs = {n: t.to("meta") if n in (where, other) else t for n, t in outputs.items()}
        with pytest.raises(ValueError) as info:
            overload(*moved_args, **moved_outputs)
        assert str(info.value).startswith(f"{name}: expected a tensor on "), (name, other, str(info.value))


@_skip_cuda1_on_one_gpu
@pytest.mark.parametrize("case", list(operator_cases()), ids=str)
def test_one_device_accepted(case):
    """The same calls with every tensor on ``cuda:1`` pass the fake (so each rejection above comes from
    the device alone)."""
    overload, args, outputs = operator_cases()[case]
    with FakeTensorMode(allow_non_fake_inputs=True):
        moved_args, moved_outputs = _moved(args, outputs, None, "cuda:1", "cuda:1")
        result = overload(*moved_args, **moved_outputs)
    for r in (result if isinstance(result, tuple) else () if result is None else (result,)):
        assert r.device == torch.device("cuda:1")


# =====================================================================================================
# Two GPUs: cuda:1 tensors while the current device is cuda:0
# =====================================================================================================


def _call(case, device):
    """Run one overload with every tensor on ``device``; returns its outputs (or written cache) on CPU."""
    overload, args, outputs = operator_cases()[case]
    moved_args, moved_outputs = _moved(args, outputs, None, device, device)
    for t in moved_outputs.values():
        poison(t)
    result = overload(*moved_args, **moved_outputs)
    if case == "kv_cache_insert":
        result = (moved_args[2],)
    elif moved_outputs:
        result = tuple(moved_outputs.values())
    result = result if isinstance(result, tuple) else (result,)
    for r in result:
        assert r.device == torch.device(device)
    return [r.cpu() for r in result]


def _bits(t):
    return t.view({F32: I32, BF16: torch.int16, F16: torch.int16}.get(t.dtype, t.dtype))


@requires_two_gpus
@pytest.mark.parametrize("case", list(operator_cases()), ids=str)
def test_operator_on_second_gpu(case):
    with torch.cuda.device(0):
        on_1 = _call(case, "cuda:1")
        assert torch.cuda.current_device() == 0, "the launcher must restore the current device"
        torch.cuda.synchronize(1)
        on_0 = _call(case, "cuda:0")
    for a, b in zip(on_1, on_0):
        assert torch.equal(_bits(a), _bits(b)), f"{case}: cuda:1 and cuda:0 disagree"


@requires_two_gpus
def test_split_workspace_on_second_gpu():
    """A split-K sparse_mla_decode (its workspace is allocated on the inputs' device) on cuda:1."""
    kwargs = mla_inputs(Spec(kv_format="fp8_656", T=1, H=16, K=1024, lengths=True))
    results = []
    for device in ("cuda:1", "cuda:0"):
        with torch.cuda.device(0):
            moved = {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in kwargs.items()}
            out, lse = tsm.sparse_mla_decode(**moved)
            assert out.device == torch.device(device)
            results.append((out.cpu(), lse.cpu()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@dataclasses.dataclass
class _Step:
    """A DeepSeek-V4-like decode step: metadata, cache insert, sparse MLA; buffers on one device."""

    device: str

    def __post_init__(self):
        g = torch.Generator().manual_seed(3)
        self.cache = ref.make_cache(8, 16, "fp8_584", device=self.device)
        every = torch.randn(128, 512, generator=g).to(BF16).to(self.device)  # no slot left with NaN bytes
        ops.kv_cache_insert(every, torch.arange(128, device=self.device), self.cache, "fp8_584")
        self.positions = torch.tensor([5, 40, 77, 100], device=self.device)
        self.token_to_req = torch.tensor([0, 1, 2, 3], dtype=I32, device=self.device)
        self.block_table = torch.randperm(8, generator=g)[:8].view(4, 2).to(I32).to(self.device)
        self.kv = torch.randn(4, 512, generator=g).to(BF16).to(self.device)
        self.q = torch.randn(4, 16, 512, generator=g).to(BF16).to(self.device)
        self.slot_mapping = torch.tensor([5, 40, 77, 100], device=self.device)
        self.indices = torch.empty(4, 128, dtype=I32, device=self.device)
        self.lens = torch.empty(4, dtype=I32, device=self.device)
        self.out = torch.empty(4, 16, 512, dtype=BF16, device=self.device)
        self.lse = torch.empty(4, 16, device=self.device)

    def __call__(self):
        ops.kv_cache_insert(self.kv, self.slot_mapping, self.cache, "fp8_584")
        ops.swa_indices.out(self.positions, self.token_to_req, self.block_table, self.slot_mapping, 128, 16,
                            indices=self.indices, lens=self.lens)
        ops.sparse_mla_decode.out(self.q, self.cache, self.indices, 0.06, "fp8_584", 512, self.lens,
                                  out=self.out, lse=self.lse)


@requires_two_gpus
def test_cuda_graph_captured_on_second_gpu():
    """Captured with cuda:1 current (a capture records the current device's stream), replayed from
    cuda:0 on new inputs; matches the eager step."""
    step, eager = _Step("cuda:1"), _Step("cuda:1")
    with torch.cuda.device(1):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # compiles the kernels outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    with torch.cuda.device(0):
        for seed in range(3):
            g = torch.Generator().manual_seed(10 + seed)
            q, positions = torch.randn(4, 16, 512, generator=g).to(BF16), torch.randint(0, 128, (4,), generator=g)
            for s in (step, eager):
                s.q.copy_(q)
                s.positions.copy_(positions)
            graph.replay()
            eager()
            torch.cuda.synchronize(1)
            assert torch.equal(step.out.cpu(), eager.out.cpu()) and torch.equal(step.lse.cpu(), eager.lse.cpu())
            assert torch.equal(ref_bytes(step.cache), ref_bytes(eager.cache))


def ref_bytes(cache):
    return torch.empty(0, dtype=torch.uint8, device=cache.device).set_(cache.untyped_storage()).cpu()


@requires_two_gpus
def test_compile_decode_step_on_second_gpu():
    """torch.compile(fullgraph=True) of a decode step whose tensors are on cuda:1, current device cuda:0."""

    def decode(q, kv, positions, token_to_req, block_table, slot_mapping, cache, seq_lens):
        tsm.kv_cache_insert(kv, slot_mapping, cache, kv_format="fp8_584")
        indices, lens = tsm.swa_indices(positions, token_to_req, block_table, slot_mapping, window=64, block_size=16)
        out, lse = tsm.sparse_mla_decode(q, cache, indices, softmax_scale=0.06, kv_format="fp8_584", topk_length=lens)
        kv_lens, qo = tsm.decode_runtime_metadata(seq_lens, decode_query_len=1)
        return out, lse, kv_lens, qo

    def inputs():
        s = _Step("cuda:1")
        return (s.q, s.kv, s.positions, s.token_to_req, s.block_table, s.slot_mapping, s.cache,
                s.positions.to(I32) + 1)

    with torch.cuda.device(0):
        torch._dynamo.reset()
        compiled = torch.compile(decode, fullgraph=True)
        got = compiled(*inputs())
        want = decode(*inputs())
        assert torch.cuda.current_device() == 0
    for a, b in zip(got, want):
        assert a.device == torch.device("cuda:1")
        assert torch.equal(a.cpu(), b.cpu())


@requires_two_gpus
@pytest.mark.parametrize("device", ["cuda:1", "cpu"])
def test_real_mixed_devices_rejected(device):
    """Real tensors (not fakes): one argument elsewhere, a ValueError that names it."""
    kwargs = mla_inputs(Spec(kv_format="fp8_656", T=2, H=4, K=8, lengths=True, sink="finite"))
    moved = {n: v.to("cuda:0") if isinstance(v, torch.Tensor) else v for n, v in kwargs.items()}
    moved["attn_sink"] = moved["attn_sink"].to(device)
    with pytest.raises(ValueError, match=rf"attn_sink: expected a tensor on cuda:0 \(where the first argument is\), "
                                         rf"got {device}"):
        tsm.sparse_mla_decode(**moved)
    b = make_batch(0)
    with pytest.raises(ValueError, match=rf"block_table: expected a tensor on cuda:0.*got {device}"):
        tsm.swa_indices(b.positions.cuda(0), b.token_to_req.cuda(0), b.block_table.to(device), b.slot_mapping.cuda(0),
                        window=4, block_size=4)
