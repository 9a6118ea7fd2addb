"""Every schema of the ``sparse_mla`` namespace, and the registration of its implementations.

``torch.ops.sparse_mla`` is the library's namespace (it also holds the sparse GQA operator). Each
operator ``NAME`` has a functional overload that returns new tensors and an ``out`` overload that
writes caller-owned buffers and returns nothing (``kv_cache_insert`` and ``gqa_kv_cache_insert`` write
the cache and have only that form). Three implementations are registered for every overload, by name, at the bottom of this file:

- the fake (``meta_kernels/<family>.py``: ``NAME`` / ``NAME_out``), which validates the arguments from
  metadata alone and allocates the functional outputs;
- under ``CPU`` the vectorised PyTorch kernel (``ops/<family>.py``: ``NAME_torch``);
- under ``CUDA`` the Triton launcher (``ops/<family>.py``: ``NAME_triton``).

A real implementation runs the fake first (same checks, same output allocation, so the fake mirrors
the real shape logic exactly) and then its kernel; the checks read metadata only, so a call whose
argument signature (shapes, strides, dtypes, devices, scalar values) already passed them skips them. Kernel entry points take the ``out`` overload's
arguments with the schema's defaults (the dispatcher drops trailing arguments left at their default)
and the outputs as keyword arguments. Registration uses ``torch.library.Library.define``/``impl``
rather than ``custom_op``: it is cheaper per eager call and it is the route that allows the ``out``
overloads.

The public functions reach these implementations through :func:`call`, which skips the dispatcher
in a plain eager call (see "eager calls of the public functions" below).
"""

from __future__ import annotations

import contextlib
import operator
import threading

import torch

try:
    from .meta_kernels._common import check_no_overlap, check_no_self_overlap, memory_extent
    from .meta_kernels import kv_cache as kv_cache_meta
    from .meta_kernels import metadata as metadata_meta
    from .meta_kernels import sparse_gqa as sparse_gqa_meta
    from .meta_kernels import sparse_mla as sparse_mla_meta
    from .ops import kv_cache as kv_cache_ops
    from .ops import metadata as metadata_ops
    from .ops import sparse_gqa as sparse_gqa_ops
    from .ops import sparse_mla as sparse_mla_ops
    from .ops import _launch
except ModuleNotFoundError as exc:  # a source checkout imported without installation
    if exc.name not in ("torch_sparse_mla.ops", "torch_sparse_mla.meta_kernels"):
        raise
    raise ModuleNotFoundError(
        f"{exc.name} is missing: the repository's ops/ and meta_kernels/ folders become "
        "torch_sparse_mla.ops and torch_sparse_mla.meta_kernels only when the package is installed "
        "(package-dir in pyproject.toml). Run `pip install -e .` in the repository first.",
        name=exc.name) from exc

NAMESPACE = "sparse_mla"

# name -> (functional schema or None, out schema, output names of the out overload)
SCHEMAS: dict[str, tuple[str | None, str, tuple[str, ...]]] = {
    # -- metadata (docs/operators.md) ---------------------------------------------------------------
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
    # -- KV cache formats (docs/operators.md) ------------------------------------------------------------
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
    # -- attention (docs/operators.md) ----------------------------------------------------------------
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
        "float k_scale=1.0, float v_scale=1.0, Tensor? k_scale_tensor=None, "
        "Tensor? v_scale_tensor=None) -> Tensor",
        "(Tensor q, Tensor kv_cache, Tensor topk_pages, Tensor block_table, Tensor kv_segment_lens, "
        "Tensor qo_offset, int decode_query_len, float softmax_scale, float q_scale=1.0, "
        "float k_scale=1.0, float v_scale=1.0, Tensor? k_scale_tensor=None, "
        "Tensor? v_scale_tensor=None, *, Tensor(a!) out) -> ()",
        ("out",),
    ),
    "gqa_kv_cache_insert": (
        None,
        "(Tensor k, Tensor v, Tensor slot_mapping, Tensor(a!) kv_cache, float k_scale=1.0, "
        "float v_scale=1.0, Tensor? k_scale_tensor=None, Tensor? v_scale_tensor=None) -> ()",
        (),
    ),
}

_lib = torch.library.Library(NAMESPACE, "DEF")
for _name, (_functional_schema, _out_schema, _) in SCHEMAS.items():
    if _functional_schema is not None:
        _lib.define(_name + _functional_schema)
        _lib.define(_name + ".out" + _out_schema)
    else:
        _lib.define(_name + _out_schema)


def unpack_out(name: str, out) -> tuple:
    """The ``out=`` argument of a public function, checked against the operator's outputs: one tensor
    for an operator with one output, a tuple (or list) of exactly its outputs otherwise."""
    names = SCHEMAS[name][2]
    if len(names) == 1:
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"out: expected a tensor (the {names[0]} buffer), got {type(out).__name__}")
        return (out,)
    if isinstance(out, (tuple, list)) and len(out) == len(names) and all(isinstance(t, torch.Tensor) for t in out):
        return tuple(out)
    got = (f"{type(out).__name__} of ({', '.join(type(t).__name__ for t in out)})" if isinstance(out, (tuple, list))
           else type(out).__name__)
    raise ValueError(f"out: expected a tuple of {len(names)} tensors ({', '.join(names)}), got {got}")


def _metadata_key(args: tuple, outputs=()) -> tuple:
    """Everything a fake's checks read: shape, strides, dtype and device of each tensor, and the value
    of every other argument. (The implementations registered for ``CPU`` and ``CUDA`` only see tensors
    of those two device types, so ``get_device()``, -1 on CPU, identifies the device.)"""
    key = [(a.shape, a.stride(), a.dtype, a.get_device()) if isinstance(a, torch.Tensor) else a for a in args]
    for a in outputs:
        key.append((a.shape, a.stride(), a.dtype, a.get_device()))
    return tuple(key)


def _tensor_guards():
    """PyTorch's compiled check of tensor metadata (``torch._C._dynamo.guards.TensorGuards``: Python
    class, dispatch keys, dtype, device, ``requires_grad``, sizes and strides of many tensors in one
    call), or None where it is missing or does not behave as this module needs (it is not a public
    API; the signature keys below then serve every call)."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        def make(*tensors):
            return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                                dynamic_dims_strides=[list(t.stride()) for t in tensors])

        a, b = torch.zeros(2, 3), torch.zeros(4, dtype=torch.int32)
        guard = make(a, b)
        ok = (guard.check(torch.ones(2, 3), torch.ones(4, dtype=torch.int32))
              and not guard.check(torch.zeros(3, 2).t(), b) and not guard.check(torch.zeros(2, 4), b)
              and not guard.check(a.double(), b)
              and not guard.check(torch.zeros(2, 3, requires_grad=True), b)
              and not guard.check(torch.nn.Parameter(a, requires_grad=False), b) and not guard.check(None, b))
        return make if ok else None
    except Exception:  # noqa: BLE001 - any failure means: do without
        return None


_GUARDS = _tensor_guards()
_RECENT = 16  # signatures per overload recognised by guard before the signature key is built


def _pick(positions: tuple):
    """A function returning ``tuple(args[i] for i in positions)``."""
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*positions) if positions else (lambda args: ())


class _Validated(dict):
    """Argument signatures the fake has already accepted, with what later calls of the signature reuse.
    The checks read metadata only, so a signature that passed once passes again: a real call with a
    known signature skips them. Bounded like the launch-plan caches.

    :meth:`find` first tries to recognise the call's signature without building its key: a ring holds
    the last ``_RECENT`` signatures, each with a guard, and each remembers which signature came after
    it last time. The call is checked against that successor of the previous call's signature, then
    against the previous signature itself: one guard check for a signature called again and again, and
    for signatures called in turn (one per layer). A check is one call of PyTorch's tensor guard (every
    tensor's class, dispatch keys, dtype, device, ``requires_grad``, sizes, strides) and a comparison
    of the other arguments' classes and values. Otherwise the key is built (several Python attribute
    reads per tensor) and looked up, and the signature joins the ring.

    Building a guard costs about two signature keys, so a workload the ring cannot serve (more
    signatures in turn than it holds) is kept from paying for it on every call: once the ring is full
    only every fourth signature it missed replaces an entry, and after 8 known signatures in a row it
    did not serve it is tried, and refreshed, on one call in 32 only, until it serves one again.
    """

    def __init__(self, any_tensor: bool = False):
        super().__init__()
        # whether calls may pass tensors of any kind (the public functions' direct path); the
        # registered CPU and CUDA implementations only ever see dense CPU and CUDA tensors
        self.any_tensor = any_tensor
        self._forget()

    def _forget(self):
        # ring entries: (len(args), tensor picker, other picker, their classes, their values, guard, value, key)
        self.ring, self.succ, self.where = [], [], {}  # entries, successor index of each, key -> index
        self.last = 0  # index of the previous call's signature
        self.slot = 0  # the entry replaced next once the ring is full
        self.misses = 0  # known signatures in a row the ring did not serve
        self.calls = 0  # calls while it is tried on one call in 32
        self.skipped = 0  # signatures the full ring missed since it last took one

    def put(self, key, value, args=None, outputs=()):
        if len(self) >= 4096:
            self.clear()
            self._forget()
        self[key] = value
        if args is not None and self.misses < 8:
            self._follow(self._remember(key, args, outputs, value))
        return value

    def find(self, args: tuple, outputs, key_of) -> tuple:
        """``(key, value)`` of a call's signature: ``(None, value)`` when the ring recognises it,
        ``(key, value or None)`` otherwise. ``key_of(args, outputs)`` builds the signature key."""
        ring = self.ring
        trying = bool(ring) and (self.misses < 8 or self._probe())
        if trying:
            last = self.last
            try:
                for i in (self.succ[last], last):
                    n_args, tensors_of, others_of, classes, values, guard, value, _ = ring[i]
                    if n_args == len(args):
                        others = others_of(args)
                        if tuple(map(type, others)) == classes and others == values:
                            tensors = (*tensors_of(args), *outputs)
                            # PyTorch's guard ends the process on a strided nested tensor (it reads
                            # its strides outside any error handling); the key below refuses one
                            if self.any_tensor:
                                try:
                                    if any(map(_is_nested, tensors)):
                                        continue
                                except AttributeError:  # None where the signature has a tensor
                                    continue
                            if not guard(*tensors):
                                continue
                            self.succ[last] = i
                            self.last = i
                            self.misses = 0
                            return None, value
            except IndexError:  # the ring was reset by another thread meanwhile
                pass
        key = key_of(args, outputs)
        value = self.get(key)
        if value is not None:  # a known signature the ring did not serve (a new one is no miss)
            if trying:
                self.misses += 1
            index = self.where.get(key)
            if index is None and (trying or not ring):
                index = self._remember(key, args, outputs, value)
            elif index is not None and trying:
                index = self._find_state(key, args, outputs, value)
            self._follow(index)
        return key, value

    def _find_state(self, key, args, outputs, value):
        """The ring entry of a known signature that the ring did not serve: one of its entries whose
        guard accepts the call, else a new entry. A guard also holds the thread's dispatch-key state
        at its making and refuses calls made in another (a first call made inside a dispatch mode, such
        as the aliasing check torch.compile runs a compiled function's first call under; calls
        alternating in and out of ``torch.inference_mode``), so a signature gets an entry per state,
        each found through the successor of the previous call's."""
        ring = self.ring
        for i, entry in enumerate(ring):
            if entry[7] == key:
                try:
                    if entry[5](*entry[1](args), *outputs):
                        self.where[key] = i
                        return i
                except Exception:  # noqa: BLE001 - a changed ring or an argument the guard refuses
                    return None
        return self._remember(key, args, outputs, value, force=True)

    def _follow(self, index):
        """Record that the signature at ``index`` came after the previous call's."""
        if index is not None:
            try:
                self.succ[self.last] = index
            except IndexError:
                pass
            self.last = index

    def _probe(self) -> bool:
        self.calls += 1
        return not self.calls & 31

    def _remember(self, key, args, outputs, value, force=False):
        """Add a signature to the ring; its index, or None when it was not added (once the ring is full,
        only every fourth signature unless ``force``)."""
        if _GUARDS is None:
            return None
        full = len(self.ring) >= _RECENT
        if full and not force:
            self.skipped += 1
            if self.skipped < 4:
                return None
            self.skipped = 0
        tensor_pos = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        other_pos = tuple(i for i in range(len(args)) if i not in tensor_pos)
        others = _pick(other_pos)(args)
        try:
            guard = _GUARDS(*_pick(tensor_pos)(args), *outputs).check
        except Exception:  # noqa: BLE001 - a tensor the guard cannot describe: no shortcut for it
            return None
        entry = (len(args), _pick(tensor_pos), _pick(other_pos), tuple(map(type, others)), others, guard, value, key)
        # Entries are replaced whole, never mutated, so a concurrent find() reads complete ones.
        if not full:
            index = len(self.ring)
            self.ring.append(entry)
            self.succ.append(index)
        else:
            index = self.slot
            self.slot = (index + 1) % _RECENT
            if self.where.get(self.ring[index][7]) == index:
                del self.where[self.ring[index][7]]
            self.ring[index] = entry
            self.succ[index] = index
        self.where[key] = index
        return index


def _functional_first(fake, kernel, on_cuda: bool, names: tuple, args: tuple):
    """First call of a functional overload's signature: the fake checks and allocates, the kernel fills
    the outputs (its launches recorded on CUDA). Returns the outputs and what later calls reuse:
    ``(specs, device, launches)``."""
    result = fake(*args)
    result = result if isinstance(result, tuple) else (result,)
    named = dict(zip(names, result))
    launches = None
    if on_cuda:
        launches = _record(kernel, args, named)
    else:
        kernel(*args, **named)
    # Plain tuples: torch.empty parses a tuple of ints faster than a torch.Size (about 0.8 µs per output).
    return result, (tuple((tuple(r.shape), r.dtype) for r in result), result[0].device, launches)


def _functional_again(kernel, names: tuple, reuse: tuple, args: tuple) -> tuple:
    """A later call of a known signature: new outputs of the cached specs, then the kernel's recorded
    launches (or the kernel)."""
    specs, device, launches = reuse
    result = tuple([torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs])
    if launches is None or not _replay(launches, (*args, *result)):
        kernel(*args, **dict(zip(names, result)))
    return result


def _functional(name: str, fake, kernel, on_cuda: bool):
    """The real functional overload: ``fake`` checks and allocates, ``kernel`` fills the outputs. On
    CUDA the first call of a signature records the kernel's launches and later calls replay them
    (:func:`_record`)."""
    names = SCHEMAS[name][2]
    seen = _Validated()  # signature -> (specs, device, launches) of _functional_first

    def impl(*args):
        key, reuse = seen.find(args, (), _metadata_key)
        if reuse is None:
            result, reuse = _functional_first(fake, kernel, on_cuda, names, args)
            seen.put(key, reuse, args)
        else:
            result = _functional_again(kernel, names, reuse, args)
        return result if len(result) > 1 else result[0]

    impl.__name__ = f"{name}_{kernel.__name__.rsplit('_', 1)[-1]}"
    return impl


def _written_args(name: str) -> tuple[tuple[str, ...], frozenset[str]]:
    """Names of the positional arguments of an overload and of those it writes (``Tensor(a!)``)."""
    base, _, overload = name.partition(".")
    schema = getattr(getattr(torch.ops.sparse_mla, base), overload or "default")._schema
    positional = tuple(a.name for a in schema.arguments if not a.kwarg_only)
    written = frozenset(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write)
    return positional, written


def _overlap_layout(positional, written_names, args, outputs) -> tuple:
    """What :func:`check_no_overlap` needs besides the data pointers: names, a picker of the tensors
    from ``(*args, *outputs.values())``, extents, the positions of the written ones, and a cell holding
    the last data pointers that passed (a signature's later calls repeat the check only when a pointer
    changed: the caching allocator often hands a loop the same buffers step after step)."""
    entries = [(n, i, memory_extent(a)) for i, (n, a) in enumerate(zip(positional, args))
               if isinstance(a, torch.Tensor)]
    entries += [(n, len(args) + k, memory_extent(a)) for k, (n, a) in enumerate(outputs.items())]
    entries = [e for e in entries if e[2] > 0]
    written = tuple(k for k, (n, _, _) in enumerate(entries) if n in written_names or n in outputs)
    return (tuple(n for n, _, _ in entries), _pick(tuple(i for _, i, _ in entries)), tuple(e for _, _, e in entries),
            written if len(entries) > 1 else (), [None])


def _check_overlap(layout, pool: tuple) -> None:
    """The overlap check of a call whose arguments and outputs are ``pool = (*args, *outputs.values())``."""
    names, pick, extents, written, passed = layout
    if written:
        starts = [t.data_ptr() for t in pick(pool)]
        if starts != passed[0]:
            check_no_overlap(names, starts, extents, written)
            passed[0] = starts


def _out_first(fake_out, kernel, on_cuda: bool, positional, written_names, args: tuple, outputs: dict) -> tuple:
    """First call of an ``out`` overload's signature: the fake's checks, the overlap check, the kernel
    (its launches recorded on CUDA). Returns what later calls reuse: ``(overlap layout, launches)``.
    An output must not overlap itself either (an expanded buffer, say): a metadata property, so checked
    here once per signature, not in the fakes (whose symbolic sizes it would specialise). The caches the
    writers write have their own layout checks in the fakes."""
    fake_out(*args, **outputs)
    for name, t in outputs.items():
        check_no_self_overlap(name, t)
    layout = _overlap_layout(positional, written_names, args, outputs)
    _check_overlap(layout, (*args, *outputs.values()))
    if on_cuda:
        return layout, _record(kernel, args, outputs)
    kernel(*args, **outputs)
    return layout, None


def _out_again(kernel, layout, launches, args: tuple, outputs: dict) -> None:
    """A later call of a known signature: the overlap check, then the recorded launches (or the kernel)."""
    pool = (*args, *outputs.values())  # the overlap check's tensors and the replayed launches' own
    _check_overlap(layout, pool)
    if launches is None or not _replay(launches, pool):
        kernel(*args, **outputs)


def _out(name: str, fake_out, kernel, on_cuda: bool):
    """The real ``out`` overload (or the only overload of a writing operator): check, then write.

    Besides the fake's checks (cached by signature), every call checks that no written tensor
    overlaps another tensor argument (``check_no_overlap``): that needs data pointers, so only the
    extents of the tensors are cached with the signature. On CUDA the first call of a signature
    records the kernel's launches and later calls replay them (:func:`_record`)."""
    seen = _Validated()  # signature -> (overlap layout, launches) of _out_first
    positional, written_names = _written_args(name)

    def impl(*args, **outputs):
        key, entry = seen.find(args, outputs.values(), _metadata_key)
        if entry is None:
            seen.put(key, _out_first(fake_out, kernel, on_cuda, positional, written_names, args, outputs), args,
                     outputs.values())
        else:
            _out_again(kernel, *entry, args, outputs)

    impl.__name__ = f"{name}_out_{kernel.__name__.rsplit('_', 1)[-1]}"
    return impl


#: (overload, "CPU" or "CUDA") -> the implementation registered for it (tests read their records)
IMPLS: dict[tuple[str, str], object] = {}


def _impl(overload: str, device: str, impl) -> None:
    IMPLS[overload, device] = impl
    _lib.impl(overload, impl, device)


def _register(name: str, *, fake, fake_out, cpu, cuda, functional_cpu=None, functional_cuda=None) -> None:
    """Fakes and the CPU / CUDA kernels of one operator. ``functional_*`` are the kernels the functional
    overload calls where it has arguments the ``out`` kernels do not take."""
    if fake is not None:
        functional_cpu, functional_cuda = functional_cpu or cpu, functional_cuda or cuda
        _impl(name, "CPU", _functional(name, fake, functional_cpu, False))
        _impl(name, "CUDA", _functional(name, fake, functional_cuda, True))
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_lib)
        _DIRECT[name] = _functional_direct(name, fake, functional_cpu, functional_cuda)
        name = name + ".out"
    _impl(name, "CPU", _out(name, fake_out, cpu, False))
    _impl(name, "CUDA", _out(name, fake_out, cuda, True))
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake_out, lib=_lib)
    _DIRECT[name] = _out_direct(name, fake_out, cpu, cuda)


# -- eager calls of the public functions ---------------------------------------------------------------
#
# The PyTorch dispatcher's call into a Python kernel (argument parsing against the schema, boxing,
# unboxing) costs several microseconds per call, as much as the library's own checks. The public
# functions therefore call the kernels themselves, through the same checks, when nothing the dispatcher
# would do can matter: plain eager execution (not compiling, tracing, vmapping or profiling; no dispatch
# or torch-function mode active), every tensor argument an exact strided, unquantised ``torch.Tensor``
# on CPU or CUDA that does not require a gradient (not nested, negated or a zero tensor), every other
# argument of exactly its schema type (an int within int64). The fake runs first, as in the registered
# implementations, so results and errors are identical. Whether a signature qualifies is decided once
# and cached with the fake's verdict (the classes, devices, layouts and ``requires_grad`` of the tensors
# are part of that signature); the modes are checked on every call, and so is a written tensor created
# under ``torch.inference_mode()`` (outside that mode the dispatcher refuses to write it, which a CUDA
# kernel called directly would not). Anything else goes through ``torch.ops.sparse_mla``, which is also
# what ``torch.ops.sparse_mla.*`` called directly, and compiled code, always use.

#: Set to False to send every call of the public functions through the dispatcher (the benchmark's
#: host-overhead table measures both).
DIRECT_CALLS = True


@contextlib.contextmanager
def dispatcher_calls():
    """Inside it, every call of the public functions goes through the dispatcher (``DIRECT_CALLS`` off,
    the path compiled code always takes); the previous setting comes back on exit."""
    global DIRECT_CALLS
    saved, DIRECT_CALLS = DIRECT_CALLS, False
    try:
        yield
    finally:
        DIRECT_CALLS = saved


_DIRECT: dict[str, object] = {}  # overload ("name" or "name.out") -> direct(args, outputs)
_OVERLOADS: dict[str, object] = {}  # overload -> torch.ops.sparse_mla OpOverload
_NOT_DIRECT = object()  # what a direct call returns when the dispatcher must take the call
_Tensor = torch.Tensor
_dtype = torch.dtype
_strided = torch.strided
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_is_nested = operator.attrgetter("is_nested")
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode = torch._C._is_torch_function_mode_enabled
_transforms = torch._C._functorch.peek_interpreter_stack
_jit_tracing = torch._C._get_tracing_state
_profiler = torch.autograd.profiler
_inference_mode = torch.is_inference_mode_enabled
_KINDS = {"Tensor": _Tensor, "Optional[Tensor]": None, "float": float, "int": int, "SymInt": int, "str": str,
          "Optional[ScalarType]": _dtype}


def _argument_kinds(overload: str) -> tuple:
    """Per positional argument of ``overload``: the exact class its value must have for a direct call
    (``None`` for an optional tensor, ``torch.dtype`` for an optional dtype, which may also be None)."""
    base, _, name = overload.partition(".")
    op = getattr(getattr(torch.ops.sparse_mla, base), name or "default")
    _OVERLOADS[overload] = op
    return tuple(_KINDS[str(a.real_type)] for a in op._schema.arguments if not a.kwarg_only)


def _direct_key(args: tuple, outputs) -> tuple:
    """:func:`_metadata_key` plus what decides whether a call may skip the dispatcher: the class of
    every argument; ``requires_grad``, the layout, the negative bit and zero-tensor flag of every tensor,
    and its device itself (this path sees tensors of every device type and kind, and ``get_device()``
    is -1 for a CPU and a ``meta`` tensor alike). Raises ``TypeError`` for an unhashable argument
    (``RuntimeError`` for a tensor without strides)."""
    key = [(a.__class__, a.shape, a.stride(), a.dtype, a.device, a.requires_grad, a.layout, a.is_neg(),
            a._is_zerotensor()) if isinstance(a, _Tensor) else (a.__class__, a) for a in args]
    for a in outputs:
        key.append((a.__class__, a.shape, a.stride(), a.dtype, a.device, a.requires_grad, a.layout, a.is_neg(),
                    a._is_zerotensor()))
    return tuple(key)


def _qualifies(kinds: tuple, args: tuple, outputs: dict) -> bool | None:
    """None when the call must go through the dispatcher; else whether it runs on CUDA."""
    if len(args) > len(kinds):
        return None
    tensors = list(outputs.values())
    for value, kind in zip(args, kinds):
        cls = value.__class__
        if cls is _Tensor:
            if kind is _Tensor or kind is None:
                tensors.append(value)
                continue
            return None
        if cls is not kind and not (value is None and (kind is None or kind is _dtype)):
            return None
        if cls is int and not _INT64_MIN <= value <= _INT64_MAX:
            return None  # the dispatcher's own error for an int it cannot pass as int64
    on_cuda = False
    for t in tensors:
        if (t.__class__ is not _Tensor or t.requires_grad or t.layout is not _strided or t.is_quantized
                or t.is_neg() or t._is_zerotensor()):
            return None  # the dispatcher's own handling of a sparse, mkldnn, quantised, negated or zero tensor
        if t.is_cuda:
            on_cuda = True
        elif not t.is_cpu:
            return None
    return on_cuda


def _record(kernel, args: tuple, outputs: dict):
    """Run a CUDA launcher and return its launches as ``(scratch, ((KernelLaunch, getter), ...))``:
    ``scratch`` the ``(numel, dtype, device)`` of each buffer the launcher allocated for the call
    (``ops/_launch.py::scratch``, a split workspace), ``getter(tensors)`` picks a launch's tensors from
    ``(*args, *outputs.values(), *scratch buffers)`` of a later call. None (after the same run) when a
    launch received a tensor that is not exactly one of those (a view, an argument passed twice, a
    buffer the launcher allocated otherwise).

    A later call with the same signature replays these launches without the launcher: CUDA launchers
    read only metadata, so the same signature makes the same launches with the same arguments, and
    their only effect is those launches (their KernelLaunch objects stay valid when the launchers'
    plan caches evict them). This saves the launcher's own plan lookup on every eager call. The record
    keeps no tensor: a replay allocates its own scratch buffers, as the launcher would."""
    thread = threading.get_ident()
    if thread in _launch.RECORDERS:  # already recording in this thread: never interleave two records
        kernel(*args, **outputs)
        return None
    launches = _launch.RECORDERS[thread] = []
    try:
        kernel(*args, **outputs)
    finally:
        del _launch.RECORDERS[thread]
    scratch = [spec for launch, spec in launches if launch is None]  # (buffer, numel, dtype, device)
    pool = (*args, *outputs.values(), *(spec[0] for spec in scratch))
    plan = []
    for launch, tensors in launches:
        if launch is None:
            continue
        where = []
        for t in tensors:
            hits = [i for i, p in enumerate(pool) if p is t]
            if len(hits) != 1:
                return None
            where.append(hits[0])
        plan.append((launch, _pick(tuple(where))))
    return tuple(spec[1:] for spec in scratch), tuple(plan)


def _replay(record, pool: tuple) -> bool:
    """The recorded launches on the tensors of ``pool``; False where a launch needs a tensor 16-byte
    aligned that is not (``ops/_launch.py::KernelLaunch`` raises before launching it; such launches come
    first in their records): the launcher recorded a kernel for aligned tensors, and the caller runs
    the launcher instead, which plans another kernel for these addresses."""
    scratch, launches = record
    if scratch:
        pool = (*pool, *[torch.empty(numel, dtype=dtype, device=device) for numel, dtype, device in scratch])
    try:
        for launch, getter in launches:
            launch(*getter(pool))
    except _launch.MisalignedLaunch:
        return False
    return True


def _lookup(seen: "_Validated", args: tuple, outputs) -> tuple:
    """``(signature, its cached entry or None)``; ``(None, _NOT_DIRECT)`` for an unhashable argument,
    a tensor without strides (sparse CSR) or an output that is no tensor, which only the dispatcher can
    reject properly."""
    try:
        return seen.find(args, outputs, _direct_key)
    except (TypeError, RuntimeError, AttributeError):
        return None, _NOT_DIRECT


def _writes_inference(args: tuple, outputs: dict, written_args: tuple) -> bool:
    """Whether a tensor the call writes (an ``out`` buffer, or a cache at ``written_args``) was created
    under ``torch.inference_mode()``."""
    for t in outputs.values():
        if t.__class__ is _Tensor and t.is_inference():
            return True
    for i in written_args:
        t = args[i] if i < len(args) else None
        if t.__class__ is _Tensor and t.is_inference():
            return True
    return False


def _out_direct(name: str, fake_out, cpu, cuda):
    """Direct call of an ``out`` overload (or of a writing operator's only overload). The public
    functions pass the outputs in schema order, so the signature need not name them."""
    seen = _Validated(any_tensor=True)  # signature -> (kernel, overlap layout, launches or None), or _NOT_DIRECT
    positional, written_names = _written_args(name)
    kinds = _argument_kinds(name)
    written_args = tuple(i for i, n in enumerate(positional) if n in written_names)  # kv_cache of the writers

    def direct(args, outputs):
        if not _inference_mode() and _writes_inference(args, outputs, written_args):
            return _NOT_DIRECT  # the dispatcher refuses it: an inference tensor written outside the mode
        key, entry = _lookup(seen, args, outputs.values())
        if entry is None:
            on_cuda = _qualifies(kinds, args, outputs)
            if on_cuda is None:
                return seen.put(key, _NOT_DIRECT, args, outputs.values())
            kernel = cuda if on_cuda else cpu
            seen.put(key, (kernel, *_out_first(fake_out, kernel, on_cuda, positional, written_names, args, outputs)),
                     args, outputs.values())
            return None
        if entry is _NOT_DIRECT:
            return entry
        _out_again(*entry, args, outputs)

    return direct


def _functional_direct(name: str, fake, cpu, cuda):
    """Direct call of a functional overload: the fake's output specs are cached with the signature."""
    seen = _Validated(any_tensor=True)  # signature -> (kernel, (specs, device, launches)), or _NOT_DIRECT
    kinds = _argument_kinds(name)
    names = SCHEMAS[name][2]

    def direct(args, outputs):
        key, entry = _lookup(seen, args, ())
        if entry is None:
            on_cuda = _qualifies(kinds, args, outputs)
            if on_cuda is None:
                return seen.put(key, _NOT_DIRECT, args)
            kernel = cuda if on_cuda else cpu
            result, reuse = _functional_first(fake, kernel, on_cuda, names, args)
            seen.put(key, (kernel, reuse), args)
        elif entry is _NOT_DIRECT:
            return entry
        else:
            result = _functional_again(entry[0], names, entry[1], args)
        return result if len(result) > 1 else result[0]

    return direct


def call(overload: str, *args, **outputs):
    """``torch.ops.sparse_mla.<overload>(*args, **outputs)``, with the dispatcher skipped for a plain
    eager call (see above). ``overload`` is ``"name"`` (the functional or only overload) or
    ``"name.out"``."""
    if (DIRECT_CALLS and not torch.compiler.is_compiling() and not _dispatch_modes() and not _function_mode()
            and _transforms() is None and _jit_tracing() is None and not _profiler._is_profiler_enabled):
        result = _DIRECT[overload](args, outputs)
        if result is not _NOT_DIRECT:
            return result
    return _OVERLOADS[overload](*args, **outputs)


def _without_num_tokens(kernel):
    """A ``compressed_slot_mapping`` kernel as its functional overload calls it: ``num_tokens`` only
    sizes the output (the fake allocates it), the kernels do not take it."""

    def run(query_start_loc, seq_lens, block_table, num_tokens, block_size, compress_ratio, *, out):
        kernel(query_start_loc, seq_lens, block_table, block_size, compress_ratio, out=out)

    run.__name__ = kernel.__name__
    return run


# -- metadata ------------------------------------------------------------------------------------------
_register("compressed_slot_mapping",
          fake=metadata_meta.compressed_slot_mapping, fake_out=metadata_meta.compressed_slot_mapping_out,
          cpu=metadata_ops.compressed_slot_mapping_torch, cuda=metadata_ops.compressed_slot_mapping_triton,
          functional_cpu=_without_num_tokens(metadata_ops.compressed_slot_mapping_torch),
          functional_cuda=_without_num_tokens(metadata_ops.compressed_slot_mapping_triton))
_register("c128a_topk_indices",
          fake=metadata_meta.c128a_topk_indices, fake_out=metadata_meta.c128a_topk_indices_out,
          cpu=metadata_ops.c128a_topk_indices_torch, cuda=metadata_ops.c128a_topk_indices_triton)
_register("decode_runtime_metadata",
          fake=metadata_meta.decode_runtime_metadata, fake_out=metadata_meta.decode_runtime_metadata_out,
          cpu=metadata_ops.decode_runtime_metadata_torch, cuda=metadata_ops.decode_runtime_metadata_triton)
_register("swa_indices",
          fake=metadata_meta.swa_indices, fake_out=metadata_meta.swa_indices_out,
          cpu=metadata_ops.swa_indices_torch, cuda=metadata_ops.swa_indices_triton)
_register("compressed_topk_to_global",
          fake=metadata_meta.compressed_topk_to_global, fake_out=metadata_meta.compressed_topk_to_global_out,
          cpu=metadata_ops.compressed_topk_to_global_torch, cuda=metadata_ops.compressed_topk_to_global_triton)
# -- KV cache --------------------------------------------------------------------------------------------
_register("kv_cache_insert",
          fake=None, fake_out=kv_cache_meta.kv_cache_insert,
          cpu=kv_cache_ops.kv_cache_insert_torch, cuda=kv_cache_ops.kv_cache_insert_triton)
_register("kv_cache_gather",
          fake=kv_cache_meta.kv_cache_gather, fake_out=kv_cache_meta.kv_cache_gather_out,
          cpu=kv_cache_ops.kv_cache_gather_torch, cuda=kv_cache_ops.kv_cache_gather_triton)
# -- attention -------------------------------------------------------------------------------------------
_register("sparse_mla_decode",
          fake=sparse_mla_meta.sparse_mla_decode, fake_out=sparse_mla_meta.sparse_mla_decode_out,
          cpu=sparse_mla_ops.sparse_mla_decode_torch, cuda=sparse_mla_ops.sparse_mla_decode_triton)
_register("sparse_gqa_decode",
          fake=sparse_gqa_meta.sparse_gqa_decode, fake_out=sparse_gqa_meta.sparse_gqa_decode_out,
          cpu=sparse_gqa_ops.sparse_gqa_decode_torch, cuda=sparse_gqa_ops.sparse_gqa_decode_triton)
_register("gqa_kv_cache_insert",
          fake=None, fake_out=sparse_gqa_meta.gqa_kv_cache_insert,
          cpu=sparse_gqa_ops.gqa_kv_cache_insert_torch, cuda=sparse_gqa_ops.gqa_kv_cache_insert_triton)
