"""How every CUDA launcher of the library plans and launches its kernels.

One set of conventions for all of them (metadata, KV cache, sparse MLA, sparse GQA):

- **Plans from shapes only.** A launcher turns the shapes, strides, dtypes and flags of its arguments
  into a plan (grid, block sizes, warps, split count, constexprs). Plans are pure functions of that
  key and are cached in a :class:`PlanCache`, so an eager call in steady state does one dictionary
  lookup instead of re-deriving the configuration. No autotuning: a CUDA graph captures exactly the
  launches of the plan, and replays are valid for any tensor values.
- **Plain integer arithmetic.** :func:`cdiv` and :func:`next_pow2` are ordinary Python functions
  (``triton.cdiv`` is a ``constexpr_function`` wrapper that costs microseconds per call).
- **One device rule.** Kernels run on the device of their tensors, whatever the current device is:
  :class:`KernelLaunch` launches on that device's current stream, switching the current device only
  for the launch when it differs.
- **Cheap launches.** :class:`KernelLaunch` holds one kernel with a fixed grid and fixed constexprs.
  Its first call per pointer-alignment pattern goes through Triton's normal ``kernel[grid](...)``
  (which compiles or loads the kernel and returns the compiled handle); later calls hand that
  kernel's C launch function the argument list directly, skipping Triton's per-call argument
  binding, cache-key computation and launcher wrapper. Tensors are passed as their integer device
  addresses: Triton's launcher otherwise calls ``data_ptr()`` again and asks the driver to validate
  every pointer (``cuPointerGetAttribute``), one driver call per tensor argument. (The launchers only
  ever run on CUDA tensors that the operator's checks have already accepted.) The shortcut relies on
  the launch-function conventions of the Triton versions the library is tested with (3.6 to 3.9;
  3.8 and 3.9 have 3.7's); with any other version, for a kernel that needs Triton-allocated
  scratch memory or carries Triton's sanitizer instrumentation, under the Triton interpreter, or with
  ``TORCH_SPARSE_MLA_JIT_LAUNCH=1`` in the environment, every call takes the normal path; so does every
  call on a ROCm build of PyTorch (:func:`hip`), whose Triton backend has another launch function. Triton's
  launch hooks (``knobs.runtime.launch_enter_hook``, used by profilers such as proton) are not
  called on the shortcut; set that variable while profiling with them.
- **One offset rule.** Triton passes a Python int that fits in 32 bits as an ``i32`` (and the value 1 as
  the constexpr 1), so a product of two kernel arguments, or of an argument and a 32-bit index, wraps
  past 2**31. Every kernel therefore widens, at its top, every stride and every size that enters an
  address (``x = tl.cast(x, tl.int64)``; ``tl.cast`` also takes the constexpr 1), and the shared
  device functions of ``ops/_formats.py`` widen their stride and page-size arguments themselves.
  A product that forms an offset then always has an int64 operand and is computed in int64, whatever
  the index it multiplies (program id, ``tl.arange``, a loaded index). Sizes that are only compared
  (row counts, ``num_slots``) stay as they are.
- **Constants** shared by the attention kernels: :data:`LOG2E` (``LOG2E_CONST`` inside kernels), and
  :data:`OFF_CUDA_SMS`, the
  multiprocessor count plans assume off CUDA (the Triton interpreter on CPU tensors), small so that
  interpreter grids stay small.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading

import torch

from ._triton import HAS_TRITON, release, tl, triton

if HAS_TRITON:
    from triton.runtime.errors import OutOfResources
else:  # pragma: no cover - exercised only where Triton is absent
    OutOfResources = RuntimeError

LOG2E = 1.4426950408889634
OFF_CUDA_SMS = 4
# The same constant for use inside kernels (compiled kernels read only constexpr globals).
LOG2E_CONST = tl.constexpr(LOG2E) if HAS_TRITON else LOG2E

_PLAN_CACHE_SIZE = 4096


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def prev_pow2(n: int) -> int:
    """The largest power of two ``<= max(n, 1)``."""
    return 1 << (max(n, 1).bit_length() - 1)


DEFAULT_SHARED_BYTES = 232_448  # shared memory a thread block may use on sm_90 (H100, H200), opt-in

_SMS: dict[int, int] = {}
_SHARED: dict[int, int] = {}


def multiprocessor_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached), or :data:`OFF_CUDA_SMS` off CUDA."""
    if device.type != "cuda":
        return OFF_CUDA_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SMS.get(index)
    if count is None:
        count = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def hip() -> bool:
    """Whether PyTorch is a ROCm build, whose ``"cuda"`` devices are AMD GPUs. Their
    ``torch.cuda.get_device_capability`` is the GFX version (``(9, 0)`` for an MI200's gfx90a, ``(9, 4)``
    for an MI300's gfx942), not an NVIDIA compute capability: every choice made from a capability asks
    this first."""
    return torch.version.hip is not None


_CAPABILITY: dict[int, tuple[int, int]] = {}


def compute_capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` of a CUDA device (cached): on a ROCm build the GFX version (see :func:`hip`)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _CAPABILITY.get(index)
    if cap is None:
        cap = _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return cap


# Columns of tensor memory (128 lanes of 32 bits each) a program may use on the GPUs that have it (sm_100
# and sm_103). Triton 3.6 to 3.9 build a kernel whose accumulators need more without an error: its
# metadata's ``tmem_size`` is larger and its code is one ``trap``, which ends the process's CUDA context
# when launched (docs/sparse_mla.md, "Tensor memory").
TENSOR_MEMORY_COLUMNS = 512


def tensor_memory_columns(metadata) -> int:
    """The tensor-memory columns a compiled kernel's metadata gives: 0 where it uses none, and for a
    Triton whose metadata has no ``tmem_size``."""
    return getattr(metadata, "tmem_size", 0) or 0


def nvidia_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of ``device`` where Triton's NVIDIA backend builds its kernels (a CUDA GPU
    of a CUDA build of PyTorch), else None: choices of NVIDIA-only compile options (``maxnreg``, the
    PTX ``.maxnreg`` directive) ask this."""
    return compute_capability(device) if device.type == "cuda" and not hip() else None


def float8_conversions(device: torch.device) -> bool:
    """Whether kernels for ``device`` may use Triton's float8 types: an NVIDIA GPU of compute capability
    8.9 or later. Triton refuses them on an earlier GPU (Ampere), and the kernels take float8 tensors
    there as their bytes (``uint8`` views) and convert by integer operations, as they do under the
    interpreter (False off CUDA). False on AMD GPUs (:func:`hip`) too: Triton converts the float8 type
    there by emulation on most of them, where the integer routes give the bits the tests check."""
    return device.type == "cuda" and not hip() and compute_capability(device) >= (8, 9)


def shared_memory_per_block(device: torch.device) -> int:
    """Bytes of shared memory one thread block may use on a CUDA device (cached), or
    :data:`DEFAULT_SHARED_BYTES` off CUDA (the interpreter plans as for an sm_90 GPU)."""
    if device.type != "cuda":
        return DEFAULT_SHARED_BYTES
    index = device.index if device.index is not None else torch.cuda.current_device()
    size = _SHARED.get(index)
    if size is None:
        props = torch.cuda.get_device_properties(index)
        # the opt-in size (NVIDIA GPUs since Volta), else the plain one (a build that reports no opt-in)
        size = getattr(props, "shared_memory_per_block_optin", None) or getattr(props, "shared_memory_per_block", None)
        size = _SHARED[index] = int(size or DEFAULT_SHARED_BYTES)
    return size


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """The launch configuration of an attention kernel (sparse MLA and sparse GQA), from shapes only.

    ``block_h`` query heads per program (``head_blocks`` programs cover the heads of a token or of a
    KV head's group), ``block_n`` keys per tile, the key list of each row split over ``num_splits``
    programs (merged by a combine kernel when > 1), ``num_warps`` and ``num_stages`` for the compiler;
    ``transposed`` the transposed tile products (keys on the M side, heads on the N side): in sparse GQA
    for a value cache whose head block would otherwise use per-warp key groups
    (``ops/sparse_gqa.py::key_groups``), in the Hopper sparse-MLA kernel for at most 32 heads
    (``ops/sparse_mla_hopper.py::plan_launch``; the portable MLA kernel ignores it). Launchers accept
    ``num_splits=`` and ``config={field: value}`` overrides (tests use them to reach every path on
    small inputs, ``scripts/sweep_*.py`` to time alternatives).
    """

    block_h: int
    head_blocks: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    transposed: bool = False

    def with_overrides(self, config: dict | None) -> "LaunchPlan":
        if not config:
            return self
        unknown = set(config) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"config: unknown launch settings {sorted(unknown)}")
        return dataclasses.replace(self, **config)


class PlanCache(dict):
    """Launch plans by key (shapes, strides, dtypes, flags, device). Bounded: when full it starts
    over, so a workload that never repeats a shape cannot grow it without limit."""

    def put(self, key, plan):
        if len(self) >= _PLAN_CACHE_SIZE:
            self.clear()
        self[key] = plan
        return plan


# Triton releases whose launch-function convention the shortcut knows. The C launch functions of 3.8
# and 3.9 take the arguments of 3.7's (the same parse format and argument extraction); their Python
# wrapper differs only where it appends the sanitizer's state pointer (``gsan_enabled``), which the
# shortcut leaves to the wrapper.
_FAST_LAUNCH_TRITON_VERSIONS = ((3, 6), (3, 7), (3, 8), (3, 9))


def _fast_launch_abi() -> tuple[int, int] | None:
    """The Triton version whose launch-function convention the shortcut uses, or None (no shortcut)."""
    if not HAS_TRITON or os.environ.get("TORCH_SPARSE_MLA_JIT_LAUNCH") == "1":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if hip():  # the launch function of Triton's AMD backend takes its arguments in another order
        return None
    version = release(triton.__version__)
    return version if version in _FAST_LAUNCH_TRITON_VERSIONS else None


_ABI = _fast_launch_abi()
_FAST = _ABI is not None


def _direct_launcher(compiled):
    """``(launch, head, tail)`` for launching a compiled kernel without Triton's JIT binding, or None
    where the compiled handle does not have the expected attributes.

    Where possible ``launch`` is the kernel's C launch function, called without Triton's Python
    launcher wrapper: Triton 3.6 ``launch(gx, gy, gz, stream, *head, *args)``, Triton 3.7
    ``launch(gx, gy, gz, stream, *head, *tail, args)``. A kernel that needs Triton-allocated scratch
    memory (which that wrapper allocates per launch), or whose launch function is wrapped (tensor
    descriptors), gets the wrapper itself (``CompiledKernel.run``, same call form as 3.6's)."""
    run = getattr(compiled, "run", None)
    if run is None or not hasattr(compiled, "function") or not hasattr(compiled, "packed_metadata"):
        return None
    wrapper = (run, (compiled.function, compiled.packed_metadata, None, None, None), None)
    launch = getattr(run, "launch", None)
    if launch is None or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return wrapper
    if type(launch).__name__ != "builtin_function_or_method":  # wrapped (tensor descriptors)
        return wrapper
    if getattr(run, "gsan_enabled", False):  # 3.8+: the wrapper appends the sanitizer's state pointer
        return wrapper
    if _ABI is None:
        return wrapper
    coop, pdl = run.launch_cooperative_grid, run.launch_pdl
    if _ABI == (3, 6):
        return launch, (compiled.function, coop, pdl, None, None, compiled.packed_metadata, None, None, None), None
    # every later release of _FAST_LAUNCH_TRITON_VERSIONS
    return (launch, (compiled.function, coop, pdl, compiled.packed_metadata, None, None, None, None, None),
            (run.arg_annotations, run.kernel_signature))


# Register allocation of the Hopper kernels. From 3.7 Triton hands ptxas ``--regAllocOptLevel=2`` for
# every kernel (its guard against a fault of CUDA 13's ptxas). With ptxas 12.9, which 3.7 and 3.8 build
# sm_90 code with, the level changes no 64-head sparse-MLA or sparse-GQA cubin and only the register
# assignment of some few-heads ones, none spilling in a loop either way: there the kernels keep Triton's
# level. With CUDA 13.4's, which 3.9 builds sm_90 code with, at level 2 the 64-head sparse-MLA consumer
# loads and stores spilled registers 16 times per block inside its loop (none at the default) and the
# 32-head few-heads kernel 30 times, and the 64-head kernel ran 9-15% slower (docs/sparse_mla_hopper.md,
# "Register allocation with ptxas 13"). ptxas takes the last of repeated options, so
# ``--regAllocOptLevel=4`` after Triton's restores its default (the same cubin as no option at all).
HOPPER_REG_ALLOC = "--regAllocOptLevel=4"


@functools.cache
def _sm90_ptxas_major() -> int | None:
    """The major version of the ptxas Triton builds sm_90 code with (asked once: it runs the tool)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return int(str(get_ptxas(90).version).split(".")[0])
    except Exception:  # noqa: BLE001 - no CUDA backend or no ptxas: nothing to adjust
        return None


def hopper_ptx_options() -> str | None:
    """The ptxas options the Hopper (Gluon) kernels are built with: :data:`HOPPER_REG_ALLOC` where the
    ptxas that builds sm_90 code is CUDA 13 or later, followed by the user's own ``PTXAS_OPTIONS``
    (Triton's environment variable, which a kernel's explicit options would otherwise replace), so that
    a level the user sets still wins. ``None`` (Triton's defaults) elsewhere."""
    user = triton.knobs.nvidia.ptxas_options if HAS_TRITON and hasattr(triton, "knobs") else None
    major = _sm90_ptxas_major() if HAS_TRITON else None
    if major is None or major < 13:
        return user
    return f"{HOPPER_REG_ALLOC} {user}" if user else HOPPER_REG_ALLOC


@functools.cache
def _amd_buffer_ops_off() -> bool:
    """Whether Triton 3.6 compiles the kernels for an AMD GPU. Its pass that turns loads and stores into
    buffer operations stops on the portable sparse-MLA decode (an assertion in its axis analysis,
    "PassManager::run failed"; 3.7 to 3.9 build the kernel). There every launch of this library runs
    with that pass off (Triton's ``AMDGCN_USE_BUFFER_OPS=0``, set for the call only: the knob also
    enters the arguments' specialisation, so each call sees the same setting). Asked once, at the
    first launch (the active driver's target)."""
    if not HAS_TRITON or release(triton.__version__) != (3, 6):
        return False
    try:
        from triton.runtime.driver import driver

        return driver.active.get_current_target().backend == "hip"
    except Exception:  # noqa: BLE001 - no usable driver (the interpreter without a GPU): not an AMD build
        return False


def _get_device() -> int:
    return torch._C._cuda_getDevice()


def _raw_stream(index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(index)


# thread id -> list of (KernelLaunch, tensors) while torch_sparse_mla._library records which launches a
# launcher makes in that thread (see there), with (None, (tensor, numel, dtype, device)) for each buffer
# the launcher allocated through scratch(); empty otherwise
RECORDERS: dict[int, list] = {}


@triton.jit
def wait_for_prior_grid():
    """First statement of a kernel launched with ``launch_pdl`` (programmatic dependent launch, which
    may schedule it before the kernel it depends on has finished): waits until that grid has completed
    and its memory operations are visible (``griddepcontrol.wait``). The prior kernel lets it be
    scheduled early with ``griddepcontrol.launch_dependents`` (``sparse_mla_hopper._launch_dependents``)."""
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


def scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new uninitialised 1-D buffer a launcher needs for one call (a split workspace). Its size must
    depend on shapes only. A recorded call notes it, so that a replay of the call's launches allocates a
    buffer of its own of the same size instead of running the launcher."""
    buffer = torch.empty(numel, dtype=dtype, device=device)
    if RECORDERS:
        recorder = RECORDERS.get(threading.get_ident())
        if recorder is not None:
            recorder.append((None, (buffer, numel, dtype, device)))
    return buffer


class MisalignedLaunch(Exception):
    """A :class:`KernelLaunch` called with a tensor its kernel needs 16-byte aligned that is not; raised
    before anything is launched."""


class KernelLaunch:
    """One Triton kernel with a fixed grid, constexprs and compile options, ready to launch.

    ``args`` is the kernel's positional (run-time) arguments of the first call: tensors at some
    positions, integers and floats elsewhere. Only the tensors change from call to call: a call passes
    them, in the order they have in ``args``, and the planned integers and floats are reused (they
    belong to the plan's key). ``meta`` holds the constexprs, which must be the kernel's remaining
    parameters. No tensor of ``args`` is kept. With ``reinterpret=True`` their dtypes are: a call may
    then pass a tensor of another dtype of the same element size (a bf16 tensor where the plan was
    made with its int16 view), which the kernel reads as the planned dtype, without the cost of a
    ``view`` per call. Without it, the tensors of ``args`` may be placeholders (``out`` standing in
    for an absent optional tensor) and every call's tensors are passed as they are. ``reinterpret``
    may also be a tuple of positions in ``args``: only those tensors' dtypes are kept (a float8 tensor
    planned as its ``uint8`` view beside placeholders).

    ``aligned``: positions in ``args`` of tensors the kernel only serves 16-byte aligned (the Hopper
    kernels' ``cp.async`` cache-row copies do not compile for a base the JIT cannot prove aligned).
    Their launchers choose such a kernel only for aligned tensors, but a launch recorded for replay
    (``torch_sparse_mla/_library.py``) may meet a later call's tensors of the same shapes and strides
    at other addresses: a call with one of them unaligned raises :class:`MisalignedLaunch` before
    launching anything, and the replay runs the launcher instead, which picks another kernel.
    """

    __slots__ = ("kernel", "grid", "meta", "options", "template", "tensor_pos", "dtypes", "device", "compiled",
                 "needs")

    def __init__(self, kernel, grid, args: tuple, meta: dict, *, num_warps: int, num_stages: int | None = None,
                 device: torch.device, reinterpret: bool | tuple[int, ...] = False, maxnreg: int | None = None,
                 launch_pdl: bool = False, aligned: tuple[int, ...] = (), ptx_options: str | None = None):
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.meta = meta
        # FP contraction (a * b + c as one fused multiply-add) as every kernel was tested with: Triton's
        # default, which 3.9 warns becomes "off" in 3.10 (TRITON_DEFAULT_FP_FUSION), no longer decides it
        self.options = {"num_warps": num_warps, "enable_fp_fusion": True}
        if launch_pdl:  # programmatic dependent launch: may be scheduled before the previous kernel ends
            self.options["launch_pdl"] = True
        if num_stages is not None:
            self.options["num_stages"] = num_stages
        if maxnreg is not None:  # registers per thread, so that several CTAs fit on an SM
            self.options["maxnreg"] = maxnreg
        if ptx_options is not None:  # extra ptxas options (hopper_ptx_options)
            self.options["ptx_options"] = ptx_options
        self.tensor_pos = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        # the alignment bits (below: one per tensor, the first tensor's the highest) that must be set
        self.needs = sum(1 << (len(self.tensor_pos) - 1 - self.tensor_pos.index(i)) for i in set(aligned))
        if reinterpret is True:
            self.dtypes = tuple(args[i].dtype for i in self.tensor_pos)
        elif reinterpret:
            self.dtypes = tuple(args[i].dtype if i in reinterpret else None for i in self.tensor_pos)
        else:
            self.dtypes = None
        template = [None if isinstance(a, torch.Tensor) else a for a in args]
        names = getattr(kernel, "arg_names", None)
        if names is not None:  # the shortcut passes every parameter, constexprs included, in order
            if len(args) + len(meta) != len(names) or any(n not in meta for n in names[len(args):]):
                raise TypeError(f"{kernel.__name__}: {len(args)} arguments and constexprs {sorted(meta)} do not "
                                f"match its parameters {names}")
            template += [meta[n] for n in names[len(args):]]
        self.template = template
        self.device = device.index if device.type == "cuda" else None
        self.compiled = {}

    def __call__(self, *tensors) -> None:
        if RECORDERS:
            recorder = RECORDERS.get(threading.get_ident())
            if recorder is not None:
                recorder.append((self, tensors))
        args = self.template.copy()
        if self.device is None or not _FAST:
            if self.needs and self._alignment(tensors) & self.needs != self.needs:
                raise MisalignedLaunch(self.kernel.__name__)
            self._jit_launch(self._with_tensors(args, tensors))
            return
        align = 0
        for i, t in zip(self.tensor_pos, tensors):
            ptr = args[i] = t.data_ptr()
            align = (align << 1) | (ptr % 16 == 0)
        entry = self.compiled.get(align)
        if entry is None:  # a new alignment pattern (only patterns that passed are ever stored)
            if align & self.needs != self.needs:
                raise MisalignedLaunch(self.kernel.__name__)
            compiled = self._jit_launch(self._with_tensors(args, tensors))
            entry = _direct_launcher(compiled)
            if entry is not None:
                self.compiled[align] = entry
            return
        if _get_device() == self.device:
            self._launch(entry, args)
        else:
            with torch.cuda.device(self.device):
                self._launch(entry, args)

    @staticmethod
    def _alignment(tensors) -> int:
        align = 0
        for t in tensors:
            align = (align << 1) | (t.data_ptr() % 16 == 0)
        return align

    def _with_tensors(self, args, tensors):
        if self.dtypes is None:
            for i, t in zip(self.tensor_pos, tensors):
                args[i] = t
        else:
            for i, t, dtype in zip(self.tensor_pos, tensors, self.dtypes):
                args[i] = t if dtype is None or t.dtype == dtype else t.view(dtype)
        return args

    def _launch(self, entry, args):
        launch, head, tail = entry
        g0, g1, g2 = self.grid
        if tail is None:
            launch(g0, g1, g2, _raw_stream(self.device), *head, *args)
        else:
            launch(g0, g1, g2, _raw_stream(self.device), *head, *tail, args)

    def build_resources(self, *tensors) -> tuple[int, int]:
        """``(shared memory bytes, tensor-memory columns)`` per block of this launch's kernel as compiled
        for the current GPU, with ``tensors`` as a call would pass them; the columns are 0 where the build
        uses no tensor memory (every GPU but sm_100 and sm_103, and every Triton without the metadata).
        Nothing is launched: a first launch with tensors of the same specialisation finds the build in
        Triton's cache. For planners whose estimate of a kernel's resources may fall short of what the
        compiler gives on some GPU (:data:`TENSOR_MEMORY_COLUMNS`)."""
        meta = self._jit_launch(self._with_tensors(self.template.copy(), tensors), compile_only=True).metadata
        return meta.shared, tensor_memory_columns(meta)

    def _jit_launch(self, args, compile_only=False):
        n = len(args) - len(self.meta) if getattr(self.kernel, "arg_names", None) is not None else len(args)
        if self.device is None or _get_device() == self.device:
            return self._jit_launch_scoped(args[:n], compile_only)
        with torch.cuda.device(self.device):
            return self._jit_launch_scoped(args[:n], compile_only)

    def _jit_launch_scoped(self, args, compile_only=False):
        here = self._compile_here if compile_only else self._jit_launch_here
        if not _amd_buffer_ops_off():
            return here(args)
        with triton.knobs.amd.scope():
            triton.knobs.amd.use_buffer_ops = False
            return here(args)

    def _compile_here(self, args):
        """The kernel's build for ``args`` (compiled, or found in Triton's cache), not launched."""
        return self.kernel.warmup(*args, grid=self.grid, **self.meta, **self.options)

    def _jit_launch_here(self, args):
        try:
            return self.kernel[self.grid](*args, **self.meta, **self.options)
        except OutOfResources:
            # Software-pipelining buffers are the one thing that can be given up for shared memory;
            # the compile failure happens before any launch, so retrying is safe. Kept for later calls.
            if self.options.get("num_stages", 1) <= 1:
                raise
            self.options["num_stages"] = 1
            return self.kernel[self.grid](*args, **self.meta, **self.options)


__all__ = ["DEFAULT_SHARED_BYTES", "HOPPER_REG_ALLOC", "LOG2E", "LOG2E_CONST", "OFF_CUDA_SMS", "KernelLaunch",
           "LaunchPlan", "MisalignedLaunch", "PlanCache", "TENSOR_MEMORY_COLUMNS", "cdiv", "compute_capability",
           "float8_conversions", "hip", "hopper_ptx_options", "multiprocessor_count", "next_pow2", "nvidia_capability",
           "prev_pow2", "scratch", "shared_memory_per_block", "tensor_memory_columns", "wait_for_prior_grid"]
