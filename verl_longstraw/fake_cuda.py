"""CUDA tensors without a GPU, for the dry run (``verl_longstraw.dryrun``): the one module holding the private torch
pieces it needs (``torch._subclasses.fake_tensor``, the "fake" process-group backend, ``torch.cuda``'s names);
tests/test_fake_cuda.py pins each. It imports nothing of the package.

``FakeCuda`` is a ``FakeTensorMode`` in which ``device="cuda"`` tensors exist as shapes, dtypes and strides only
(no memory, no compute: each op runs its meta kernel) and ops whose inputs are all real CPU tensors still run for
real, so validation and the plan read the real token ids. On a CPU-only torch build four things stand in the way
of autograd, indexing and counting on such tensors, and the mode answers them:
- C++ asks a tensor's device through ``prim.device`` and then wants CUDA's device guard, which a CPU build lacks
  (``x[i]``, ``x[i] = y`` and autograd's gradient accumulators fail with "not linked with support for cuda
  devices"): the mode answers ``meta`` to C++ while Python's ``tensor.device`` stays ``cuda:0`` (FakeTensor's own
  property), so every Python branch on the device type takes its CUDA side; but a DTensor (FSDP2's parameters,
  expert parallelism's experts) built on a fake tensor takes its device from C++ once, at construction, and must
  say cuda (FSDP2 refuses meta parameters): inside ``fake_cuda_runtime`` the mode answers cuda then; a tensor
  subclass's op is the subclass's to run (on its fake local tensors);
- composite C++ ops then build tensors with the meta device of ``tensor.options()``: the mode makes them cuda;
- ``torch.cuda`` streams and events (the host copies of ``state.host``) do not exist: ``fake_cuda_runtime`` gives
  no-op stand-ins, and ``torch.cuda.is_available()`` answers True inside it; pinning a fake host tensor (FSDP2's
  CPU offload) gives a fake host tensor;
- a few ops (``silu_backward``) have no CUDA kernel in a CPU build and would decompose into smaller ops before the
  mode sees them, each step's output counted: ``fake_cuda_runtime`` registers never-called CUDA stand-ins so they
  reach the mode as one op, and the mode counts an op whose fake implementation is itself a decomposition as one.

``fake_process_group(world, rank)`` is torch's "fake" backend: every collective returns at once with the right
shapes (an all-gather hands every rank this rank's input; under ``FakeCuda`` tensors hold nothing, and
``all_gather_object`` runs outside the mode: its pickles travel in real CPU tensors).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._guards import detect_fake_mode
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.nn import functional as F
from torch.nn.attention import SDPBackend
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry

CUDA = torch.device("cuda", 0)
_SDPA = F.scaled_dot_product_attention
_META = torch.device("meta")
_METERS: weakref.WeakSet = weakref.WeakSet()  # the DeviceBytes alive (``_resize_counted`` tells them)
_making_dtensor = 0  # DTensor constructions running (``fake_cuda_runtime``): C++ reads the device they wrap


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has no data (a dry run's): reading its values is not possible."""
    return isinstance(tensor, FakeTensor)


class FakeCuda(FakeTensorMode):
    """``with FakeCuda():`` device="cuda" tensors are fake (see the module docstring); real CPU tensors stay real.

    ``meter`` (a ``DeviceBytes``), when given, counts the fake device storages the ops allocate; ``flops`` sums the
    FLOPs of the ops on fake tensors by torch's formulas (``torch.utils.flop_counter``'s registry, what
    ``FlopCounterMode`` counts: matmuls, convolutions, attention kernels), without ``FlopCounterMode``'s module
    hooks, which keep activations alive past activation checkpointing. Both count the ops the caller dispatches, as
    a GPU runs them: an op whose fake implementation is a decomposition into smaller ops (``_log_softmax``,
    ``softplus_backward``, ...) is one kernel on a GPU, so only its outputs and its own FLOPs count, not the steps'
    intermediates."""

    def __init__(self, meter: DeviceBytes | None = None) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.meter = meter
        self.flops = 0
        self._depth = 0  # ops running inside an op's fake implementation (its decomposition)
        self._answers: Iterator[int | float] | None = None  # ``answering``'s values not yet read

    @contextlib.contextmanager
    def answering(self, values: Sequence[int | float]) -> Iterator[None]:
        """Inside the block, each host read of a fake tensor's value (``.item()``, ``.tolist()``: one read per
        element, in row-major order) returns the next of ``values``, which must be read exactly: ValueError for a
        read past them or a value left unread (either would be a value the caller did not know, a silent guess).
        Outside such a block a host read of a fake value raises (torch's DataDependentOutputException)."""
        if self._answers is not None:
            raise RuntimeError("FakeCuda.answering blocks do not nest")
        self._answers = iter(values)
        try:
            yield
            if next(self._answers, None) is not None:
                raise ValueError("FakeCuda.answering: fewer host reads of fake values than values given")
        finally:
            self._answers = None

    def _answer(self) -> int | float:
        value = next(self._answers, None)
        if value is None:
            raise ValueError("FakeCuda.answering: more host reads of fake values than values given")
        return value

    @property
    def avoid_device_init(self) -> bool:
        """Never copy a constant to a real CUDA device (FakeTensorMode asks ``torch.cuda.is_available()``, which
        ``fake_cuda_runtime`` answers True)."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.prim.device.default:  # C++ callers only: Python's tensor.device is its fake_device
            device = args[0].fake_device  # a fake host tensor's is the host (a CPU build has its device guard)
            return device if _making_dtensor or device.type != "cuda" else _META
        if func in _PINNING and isinstance(args[0], FakeTensor):  # no host memory to pin: a fake host tensor
            return True if func is _IS_PINNED else torch.empty_like(args[0])
        if func is _LOCAL_SCALAR and self._answers is not None and isinstance(args[0], FakeTensor):
            return self._answer()
        kwargs = kwargs or {}
        if isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type == "meta":
            kwargs = {**kwargs, "device": CUDA}  # a composite op's tensor.options()
        leaves = pytree.tree_leaves((args, kwargs))
        if any(type(x) not in _PLAIN and isinstance(x, torch.Tensor) for x in leaves):
            return NotImplemented  # a tensor subclass (a DTensor): it runs the op on its local fake tensors
        if self._depth:  # a step of an op's decomposition: one fused kernel on a GPU, counted as the op (fake, even
            # where the step makes a host tensor from no tensor: a fake tensor's copy to the host)
            return super().__torch_dispatch__(func, types, args, kwargs)
        if not any(isinstance(x, FakeTensor) or (isinstance(x, torch.device) and x.type == "cuda") for x in leaves):
            with unset_fake_temporarily():  # real CPU tensors only: run for real
                return func(*args, **kwargs)
        workspace = _flash_backward_workspace(*args) if func is _FLASH_BACKWARD else ()
        self._depth += 1
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if func._overloadpacket in flop_registry:  # inside: what the formula makes is not the op's
                self.flops += _flops(func, args, kwargs, out)
        finally:
            self._depth -= 1
        if self.meter is not None:  # the outputs beside the kernel's workspace, as on the GPU
            self.meter.saw(leaves, out, func)
        del workspace
        return out


_PLAIN = (torch.Tensor, nn.Parameter, FakeTensor)  # tensors this mode runs ops on itself
_IS_PINNED = torch.ops.aten.is_pinned.default
_PINNING = (torch.ops.aten._pin_memory.default, _IS_PINNED)  # pinned host memory (FSDP2's CPUOffloadPolicy)
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default  # a host read of one element (.item(), .tolist())


def _flops(func, args: tuple, kwargs: dict, out) -> int:
    """torch's FLOP formula of ``func`` (``flop_registry``); an attention op with fewer key heads than query heads,
    which older formulas refuse (torch 2.11: "query/key/value shapes are incompatible"), as its expanded heads. The
    formulas take shapes: an overload's dtype argument (``bmm.dtype``'s ``out_dtype``, the blocked attention's
    half-operand matmul with float32 sums) is not passed on."""
    count = flop_registry[func._overloadpacket]
    args = tuple(x for x in args if not isinstance(x, torch.dtype))
    try:
        return count(*args, **kwargs, out_val=out)
    except AssertionError:
        tensors = [x for x in args if isinstance(x, torch.Tensor) and x.dim() == 4]
        heads = max(x.shape[1] for x in tensors)
        grown = [x.new_empty(x.shape[0], heads, *x.shape[2:]) if isinstance(x, torch.Tensor) and x.dim() == 4 else x
                 for x in args]  # shapes only: fake
        return count(*grown, **kwargs, out_val=out)


def _flash_backward_workspace(grad_out, query, key, *args) -> tuple[torch.Tensor, ...]:
    """The device memory CUDA's flash backward allocates inside the kernel call besides its outputs (flash-attention
    2's ``mha_bwd``, which torch's flash op runs: ``softmax_d`` [B, H, Tq rounded to 128] and ``dq_accum``
    [B, Tq rounded, H, D rounded to 32] in float32, and with fewer key heads than query heads ``dk_expanded`` and
    ``dv_expanded`` [B, Tk, H, D] in the inputs' dtype), made here so the meter sees them beside the outputs.
    Layout [B, H, T, D] as the op takes it."""
    batch, heads, queries, dim = query.shape
    rows = -(-queries // 128) * 128
    made = [query.new_empty(batch, heads, rows, dtype=torch.float32),
            query.new_empty(batch, rows, heads, -(-dim // 32) * 32, dtype=torch.float32)]
    if key.shape[1] != heads:
        made += [key.new_empty(batch, key.shape[2], heads, dim) for _ in range(2)]
    return tuple(made)


def sdp_backend(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                enable_gqa=False) -> int:
    """The ``torch.nn.attention.SDPBackend`` that ``scaled_dot_product_attention`` picks for these CUDA inputs on an
    sm80+ GPU, in torch's order (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, its documented limits): flash
    for half inputs without a mask, one head dim for q, k, v, a multiple of 8 up to 256 (grouped heads too);
    else memory-efficient attention for q, k of one head dim and v's, each a multiple of 8 (masks too, grouped
    heads not); else math."""
    half = query.dtype in (torch.float16, torch.bfloat16)
    qk, v = query.shape[-1], value.shape[-1]
    if half and attn_mask is None and qk == key.shape[-1] == v and qk % 8 == 0 and qk <= 256:
        return int(SDPBackend.FLASH_ATTENTION)
    grouped = enable_gqa and query.shape[-3] != key.shape[-3]
    if query.dtype in (*(torch.float16, torch.bfloat16), torch.float32) and qk == key.shape[-1] and qk % 8 == 0 \
            and v % 8 == 0 and not grouped:
        return int(SDPBackend.EFFICIENT_ATTENTION)
    return int(SDPBackend.MATH)


def _cuda_sdpa(*args, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of a dry run: on fake CUDA tensors the kernel a GPU would take
    (``sdp_backend``; C++ picks the backend from the device it is told, meta under ``FakeCuda``, and would run the
    math path, which materialises the scores); anything else as torch does."""
    if not isinstance(args[0], FakeTensor):
        return _SDPA(*args, **kwargs)
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_arguments(*args, **kwargs)
    backend = sdp_backend(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if backend == int(SDPBackend.FLASH_ATTENTION):
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                                  scale=scale)[0]
    if backend == int(SDPBackend.EFFICIENT_ATTENTION):
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # as sdpa converts it: an additive bias
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, query.requires_grad, dropout_p, is_causal, scale=scale)[0]
    return _SDPA(*args, **kwargs)


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def storage_id(tensor: torch.Tensor) -> int:
    """Identity of a fake tensor's storage while it lives (meta storages have no data pointer to tell them apart)."""
    return tensor.untyped_storage()._cdata


class DeviceBytes:
    """Bytes of the fake CUDA storages ops allocate: ``current`` (alive now), ``peak`` since the last
    ``reset_peak`` and the peak of each phase (``phase(name)``: ``phases[name]``), the largest storage seen
    (``largest``, bytes) and the most elements of one tensor (``largest_numel``; ``largest_made_by``: the op, shape
    and dtype of that tensor), both since ``reset_peak``. A storage counts from the op that returns it until it is
    freed; views and in-place results of storages that existed before are not new (``memory.AllocationMeter``'s
    rule). Tensors made before the meter (the parameters)
    are not counted.

    Each storage gets a serial number (``serial``). Storages made with one of the ``watch`` shapes (a dry run's
    parameter shapes) are kept track of at every peak, so those found out later to be parameter gradients can be
    taken out of the peaks they were alive at (``peak_without``, ``phase_without``)."""

    def __init__(self, watch: set[tuple[int, ...]] = frozenset()) -> None:
        self.watch = set(watch)
        self._live: dict[int, tuple[int, int]] = {}  # storage id -> (serial, bytes)
        self._watched: dict[int, int] = {}  # serial -> bytes: the live storages of a watched shape
        self._serials = 0
        self.current = 0
        self.peak = 0
        self.largest = 0
        self.largest_numel = 0
        self.largest_made_by: tuple[str, tuple[int, ...], torch.dtype] | None = None
        self.phases: dict[str, int] = {}
        self._watched_at_peak: dict[int, int] = {}
        self._phase_watched: dict[str, dict[int, int]] = {}
        self._phase: str | None = None
        _METERS.add(self)

    def resized(self, storage: torch.UntypedStorage, before: int) -> None:
        """``storage`` (``before`` bytes) was resized in place (FSDP2 frees an unsharded parameter's storage by
        resizing it to 0 bytes and allocates it again the same way): it counts at its new size."""
        entry = self._live.get(storage._cdata)
        if entry is None:
            return
        serial, nbytes = entry[0], storage.nbytes()
        self._live[storage._cdata] = (serial, nbytes)
        if serial in self._watched:
            self._watched[serial] = nbytes
        self.current += nbytes - before
        self.largest = max(self.largest, nbytes)
        self._peaked()

    def _release(self, key: int) -> None:
        serial, nbytes = self._live.pop(key)
        self._watched.pop(serial, None)
        self.current -= nbytes

    def serial(self, tensor: torch.Tensor) -> int | None:
        """The serial number of ``tensor``'s storage, None where the meter did not see it made."""
        entry = self._live.get(storage_id(tensor))
        return None if entry is None else entry[0]

    def saw(self, inputs: list, out, op=None) -> None:
        """``op`` (an aten op, for ``largest_made_by``) returned ``out`` from ``inputs``."""
        given = {storage_id(x) for x in inputs if isinstance(x, FakeTensor)}
        for x in pytree.tree_leaves(out):
            if not isinstance(x, FakeTensor) or x.device.type != "cuda":
                continue
            if x.numel() > self.largest_numel:
                self.largest_numel, self.largest_made_by = x.numel(), (str(op), tuple(x.shape), x.dtype)
            key = storage_id(x)
            if key in given or key in self._live:
                continue
            storage = x.untyped_storage()
            self._serials += 1
            self._live[key] = (self._serials, storage.nbytes())
            if tuple(x.shape) in self.watch:
                self._watched[self._serials] = storage.nbytes()
            self.current += storage.nbytes()
            self.largest = max(self.largest, storage.nbytes())
            weakref.finalize(storage, self._release, key)
        self._peaked()

    def _peaked(self) -> None:
        if self.current > self.peak:
            self.peak, self._watched_at_peak = self.current, dict(self._watched)
        if self._phase is not None and self.current > self.phases.get(self._phase, -1):
            self.phases[self._phase], self._phase_watched[self._phase] = self.current, dict(self._watched)

    def reset_peak(self) -> None:
        """``peak``, ``largest`` and ``largest_numel`` count from now (e.g. the walk's, not the parameters' set-up:
        expert parallelism slices each full expert weight)."""
        self.peak, self._watched_at_peak = self.current, dict(self._watched)
        self.largest = self.largest_numel = 0
        self.largest_made_by = None

    def peak_without(self, serials: set[int]) -> int:
        """``peak`` less the bytes of the storages numbered in ``serials`` that were alive at it."""
        return self.peak - sum(n for serial, n in self._watched_at_peak.items() if serial in serials)

    def phase_without(self, name: str, serials: set[int]) -> int:
        """``phases[name]`` less the bytes of the storages numbered in ``serials`` that were alive at it."""
        return self.phases[name] - sum(n for serial, n in self._phase_watched[name].items() if serial in serials)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Within the block, also track the peak of phase ``name`` (``phases[name]``, the most bytes alive)."""
        outer, self._phase = self._phase, name
        self._peaked()
        try:
            yield
        finally:
            self._phase = outer


def fake_empty(mode: FakeCuda, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A fake tensor [shape] of ``dtype`` on ``device`` (e.g. "cpu": a dry run's host memory, which ``FakeCuda``
    would otherwise allocate for real, as it does every CPU tensor made from real ones)."""
    with unset_fake_temporarily():  # inside FakeCuda a meta device means cuda
        meta = torch.empty(shape, dtype=dtype, device="meta")
    return mode.fake_tensor_converter.from_meta_and_device(mode, meta, torch.device(device))


def materialize(model: nn.Module, mode: FakeCuda) -> nn.Module:
    """``model`` (built on the meta device) with every parameter and buffer replaced by a fake cuda tensor of its
    shape and dtype, tied parameters staying tied; ``requires_grad`` kept. In place; returns ``model``."""
    fakes: dict[int, torch.Tensor] = {}
    with mode:
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    if id(param) not in fakes:
                        fakes[id(param)] = nn.Parameter(torch.empty_like(param, device=CUDA),
                                                        requires_grad=param.requires_grad)
                    module._parameters[name] = fakes[id(param)]
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = torch.empty_like(buffer, device=CUDA)
    return model


class _Stream:
    """``torch.cuda.Stream`` of a dry run: work on it is the fake ops' (none)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None) -> _Event:
        return event or _Event()


class _Event:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream=None) -> None:
        pass


class _Cudart:
    """``torch.cuda.cudart()`` of a dry run: registering host memory (pinning) succeeds and does nothing."""

    @staticmethod
    def cudaHostRegister(address: int, nbytes: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        return 0

    @staticmethod
    def cudaHostUnregister(address: int) -> int:  # noqa: N802
        return 0


@contextlib.contextmanager
def fake_cuda_runtime(name: str = "NVIDIA H100 80GB HBM3", capability: tuple[int, int] = (9, 0)) -> Iterator[None]:
    """``torch.cuda`` as the dry run's CUDA code reads it: available, one device (the current one, 0) named ``name``
    of compute capability ``capability``, streams and events that do nothing (``torch.cuda.stream(s)`` a no-op context,
    ``Tensor.record_stream`` too), host memory registration (pinning) that succeeds, no real CUDA tensor made to
    start a context (``fake_tensor.init_gpu_context``, which a CUDA build of torch runs); and
    ``F.scaled_dot_product_attention`` taking the GPU's kernel on fake tensors (``_cuda_sdpa``); the ops a CUDA build
    runs as one kernel dispatched as one op (``_cuda_kernels_of_a_cuda_build``); DTensors built on fake CUDA tensors
    on device cuda (``_dtensor_on_cuda``); storages resized in place counted at their new size by every
    ``DeviceBytes`` (``_resize_counted``); a fake tensor's ``is_meta`` its fake device's (FSDP2 moves no meta
    parameter to the host); DTensor's shape inference uncounted (``_uncounted``)."""
    cuda = torch.cuda
    names = ("is_available", "Stream", "Event", "stream", "current_stream", "device_count", "get_device_capability",
             "get_device_name", "cudart", "current_device", "set_device", "_lazy_init", "is_current_stream_capturing")
    saved = {name: getattr(cuda, name) for name in names}
    record_stream = torch.Tensor.record_stream
    torch.Tensor.record_stream = lambda tensor, stream: None
    init_gpu_context = fake_tensor.init_gpu_context  # makes a real CUDA tensor when CUDA looks available
    fake_tensor.init_gpu_context = lambda device: None
    F.scaled_dot_product_attention = _cuda_sdpa
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.get_device_capability = lambda device=None: capability
    cuda.get_device_name = lambda device=None: name
    cuda.Stream, cuda.Event, cuda.cudart = _Stream, _Event, _Cudart
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.current_stream = lambda device=None: _Stream()
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda._lazy_init = lambda: None
    cuda.is_current_stream_capturing = lambda: False  # the optimizers ask
    is_meta = FakeTensor.is_meta  # Tensor's: C++ reads the device (meta)
    FakeTensor.is_meta = property(lambda tensor: tensor.fake_device.type == "meta")  # FSDP2's offload asks
    propagate = ShardingPropagator._propagate_tensor_meta_non_cached
    ShardingPropagator._propagate_tensor_meta_non_cached = _uncounted(propagate)
    resize = torch.UntypedStorage.resize_
    torch.UntypedStorage.resize_ = _resize_counted(resize)
    make_dtensor = DTensor.__new__
    DTensor.__new__ = _dtensor_on_cuda(make_dtensor)
    kernels = _cuda_kernels_of_a_cuda_build()
    try:
        yield
    finally:
        kernels._destroy()
        DTensor.__new__ = make_dtensor
        torch.UntypedStorage.resize_ = resize
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate
        FakeTensor.is_meta = is_meta
        for name, value in saved.items():
            setattr(cuda, name, value)
        torch.Tensor.record_stream = record_stream
        fake_tensor.init_gpu_context = init_gpu_context
        F.scaled_dot_product_attention = _SDPA


def _uncounted(propagate):
    """DTensor's output-shape inference (``ShardingPropagator._propagate_tensor_meta_non_cached``: it runs the op on
    fake tensors of the global shape, in the active fake mode) not counted as the device's bytes or FLOPs: no GPU
    allocates it."""

    def run(self, op_schema):
        mode = detect_fake_mode()
        if not isinstance(mode, FakeCuda):
            return propagate(self, op_schema)
        mode._depth += 1  # as a step inside an op: neither metered nor counted
        try:
            return propagate(self, op_schema)
        finally:
            mode._depth -= 1

    return run


def _resize_counted(resize):
    """``UntypedStorage.resize_`` telling every ``DeviceBytes`` the storage's new size (no op reaches the mode: a
    meta storage resizes in C++ directly)."""

    def resize_(storage, size):
        before = storage.nbytes()
        out = resize(storage, size)
        for meter in list(_METERS):
            meter.resized(storage, before)
        return out

    return resize_


def _dtensor_on_cuda(make_dtensor):
    """``DTensor.__new__`` (C++: it reads its local tensor's device through ``prim.device``) answered with the fake
    tensor's own device, cuda, where ``FakeCuda`` answers meta to every other C++ caller."""

    def new(cls, local_tensor, spec, *, requires_grad):
        global _making_dtensor
        _making_dtensor += 1
        try:
            return make_dtensor(cls, local_tensor, spec, requires_grad=requires_grad)
        finally:
            _making_dtensor -= 1

    return new


def _never_runs(*args, **kwargs):
    raise AssertionError("a dry run's CUDA kernel stand-in ran: fake tensors dispatch to the fake mode first")


def _cuda_kernels_of_a_cuda_build() -> torch.library.Library:
    """Stand-in CUDA kernels for the aten ops that have a CPU kernel and a composite (decomposing) one but, in a
    CPU-only build, no CUDA kernel (``silu_backward``, ``mish_backward``, ``native_channel_shuffle``): without one,
    fake CUDA tensors take the composite path before the fake mode sees the op, and the dry run would count its
    intermediates ([tokens, MLP width] tensors each, for ``silu_backward``), which a CUDA build's fused kernel never
    makes. With one, the op reaches the mode as one op, as on a CUDA build (the stand-in itself never runs). Returns
    the registrations; ``_destroy()`` takes them back."""
    library = torch.library.Library("aten", "IMPL")
    for name in torch._C._dispatch_get_all_op_names():
        if (name.startswith("aten::")
                and torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")
                and torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
                and not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")):
            library.impl(name.removeprefix("aten::"), _never_runs, "CUDA")
    return library


@contextlib.contextmanager
def fake_process_group(world: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """The default process group of ``world`` ranks as rank ``rank`` sees it, on torch's "fake" backend: every
    collective returns at once; yields the group. Destroys it on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("a dry run's fake process group needs no other default process group in this process")
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    gather_objects = dist.all_gather_object

    def all_gather_object(*args, **kwargs):  # pickled objects travel in real CPU tensors, not fake ones
        with unset_fake_temporarily():
            return gather_objects(*args, **kwargs)

    dist.all_gather_object = all_gather_object
    try:
        yield dist.group.WORLD
    finally:
        dist.all_gather_object = gather_objects
        dist.destroy_process_group()
