"""Fine-grained activation offloading (Megatron-LM's --fine-grained-activation-offloading;
config/activation_offload.py).

A model chunk's `ActivationOffload` opens one `forward_pass` per micro-batch. Inside it each
module --offload-modules names runs in an `offload_group`: saved-tensor hooks take what its
operations keep for backward (not parameters, not the rotary tables and mask every layer
shares, not tensors under --min-offloaded-tensor-size elements), and when the next group
opens the group's tensors are copied to host memory and dropped on the device. In backward
the first tensor a group is asked for brings the whole group back and starts bringing back
the group before it, so the copy overlaps that group's backward. On CUDA the copies run on
streams of their own into pinned memory; elsewhere (the CPU tests) they are plain copies,
which exercise the same bookkeeping.

The first forward pass offloads every group but its last; later passes offload the groups
`offload_plan` (config/activation_offload.py) picks from the first pass's sizes: the last
stays on the device (its backward comes first), and so do the latest groups worth
pp_rank x --delta-offload-bytes-across-pp-ranks bytes and the latest beyond
--activation-offload-fraction of the rest.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import deque
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from threefold.config.activation_offload import offload_plan
from threefold.kernels.fp8 import held_for_step
from threefold.model.recompute import is_checkpointing
from threefold.parallel.context_parallel import masks

_PASS: contextvars.ContextVar[_Pass | None] = contextvars.ContextVar("offload_pass", default=None)


def offload_group(name: str, enabled: bool) -> contextlib.AbstractContextManager:
    """Runs the block as module `name` (one of config/activation_offload.py's MODULES): when
    `enabled` (the config offloads `name`), its saved tensors are offloaded during the
    training forward passes of `ActivationOffload.forward_pass`. Disabled, a plain context
    (one a compiled layer traces)."""
    return _group(name) if enabled else contextlib.nullcontext()


@contextlib.contextmanager
def _group(name: str) -> Iterator[None]:
    forward = _PASS.get()
    skip = forward is None or name not in forward.owner.modules or is_checkpointing()
    if skip or not torch.is_grad_enabled():  # (a recomputed region keeps only its inputs)
        yield
        return
    group = forward.open(name)
    try:
        with torch.autograd.graph.saved_tensors_hooks(group.pack, _unpack):
            yield
    finally:
        group.closed = True


def _unpack(saved):
    if isinstance(saved, tuple):  # (group, index): a tensor the group took
        group, index = saved
        return group.get(index)
    return saved


class _Copies:
    """Device <-> host copies: on CUDA on side streams into pinned memory, so that they overlap
    the compute stream; otherwise plain copies."""

    def __init__(self, max_inflight: int | None) -> None:
        self.max_inflight = max_inflight
        self.streams: dict[str, torch.cuda.Stream] = {}
        self.inflight: dict[str, deque] = {}

    def _stream(self, direction: str) -> torch.cuda.Stream:
        if direction not in self.streams:
            self.streams[direction] = torch.cuda.Stream()
        return self.streams[direction]

    def to_host(self, name: str, tensors: list[torch.Tensor]):
        """Host copies of `tensors` and the event that marks them complete (None: already)."""
        if not tensors or tensors[0].device.type != "cuda":
            return [t.to("cpu", copy=True) for t in tensors], None
        stream, compute = self._stream("d2h"), torch.cuda.current_stream()
        stream.wait_stream(compute)  # the tensors are written on the compute stream
        with torch.cuda.stream(stream):
            host = [torch.empty_like(t, device="cpu", pin_memory=True) for t in tensors]
            for h, t in zip(host, tensors):
                h.copy_(t, non_blocking=True)
                t.record_stream(stream)  # freed only once the copy has read it
            event = torch.cuda.Event()
            event.record(stream)
        if self.max_inflight is not None:
            pending = self.inflight.setdefault(name, deque())
            pending.append(event)
            while len(pending) > self.max_inflight:
                compute.wait_event(pending.popleft())
        return host, event

    def to_device(self, host: list[torch.Tensor], device: torch.device, after):
        """Device copies of `host`, started once the event `after` has passed; returns them
        and the event marking them complete."""
        if device.type != "cuda":
            return [h.to(device, copy=True) for h in host], None
        stream = self._stream("h2d")
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            copies = [torch.empty_like(h, device=device) for h in host]
            for c, h in zip(copies, host):
                c.copy_(h, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return copies, event


class _Group:
    """What one module kept for backward in one forward pass."""

    def __init__(self, forward: _Pass, name: str, index: int, previous: _Group | None) -> None:
        # (`forward` only while the pass runs: the pass lists its groups, and a cycle would
        # keep a group's reloaded tensors until the garbage collector found it)
        self.forward, self.owner = forward, forward.owner
        self.name, self.index, self.previous = name, index, previous
        self.tensors: list[torch.Tensor] = []
        self.slots: dict[tuple, int] = {}  # the same tensor saved twice is kept once
        self.bytes = 0
        self.device: torch.device | None = None
        self.host: list[torch.Tensor] | None = None
        self.host_ready = None
        self.reloaded: list[torch.Tensor] | None = None
        self.reload_ready = None
        self.ready = False  # the reloaded tensors may be read on the compute stream
        self.closed = False

    def pack(self, tensor: torch.Tensor):
        if not self.forward.takes(tensor):
            self.forward.passed(tensor)
            return tensor
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
        )
        if key not in self.slots:
            self.slots[key] = len(self.tensors)
            self.tensors.append(tensor)
            self.bytes += tensor.numel() * tensor.element_size()
            self.device = tensor.device
        return (self, self.slots[key])

    def offload(self, copies: _Copies) -> None:
        # A tensor whose storage an output-discarding recomputation freed stays: the
        # recomputation refills it (model/recompute.py).
        if not self.tensors or any(t.untyped_storage().nbytes() == 0 for t in self.tensors):
            return
        self.host, self.host_ready = copies.to_host(self.name, self.tensors)
        self.tensors = []

    def get(self, index: int) -> torch.Tensor:
        if self.host is None and self.reloaded is None:
            return self.tensors[index]
        if not self.ready:
            self.reload()
            if self.reload_ready is not None:
                compute = torch.cuda.current_stream()
                compute.wait_event(self.reload_ready)
                for tensor in self.reloaded:
                    tensor.record_stream(compute)
            self.ready = True
            # The group before this one comes back during this one's backward.
            earlier = self.previous
            while earlier is not None and earlier.host is None:
                earlier = earlier.previous
            if earlier is not None:
                earlier.reload()
        return self.reloaded[index]

    def reload(self) -> None:
        if self.reloaded is not None:
            return
        self.reloaded, self.reload_ready = self.owner.copies.to_device(
            self.host, self.device, self.host_ready
        )
        self.host = self.host_ready = None


class _Pass:
    """One micro-batch's forward pass through a model chunk."""

    def __init__(self, owner: ActivationOffload, keep: Iterable[torch.Tensor]) -> None:
        self.owner = owner
        self.keep = {t.untyped_storage().data_ptr() for t in keep if t is not None}
        self.groups: list[_Group] = []
        self.passed_through: list[torch.Tensor] = []  # (only while the owner measures)

    def passed(self, tensor: torch.Tensor) -> None:
        """A tensor a group left to autograd (a parameter, a shared table, a small one)."""
        if self.owner.resident is not None and not isinstance(tensor, nn.Parameter):
            self.passed_through.append(tensor)

    def resident(self) -> dict[int, torch.UntypedStorage]:
        """The storages the groups left on the device, by address."""
        tensors = self.passed_through + [t for group in self.groups for t in group.tensors]
        return {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}

    def takes(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is an activation to offload: a plain tensor (not a parameter, a
        view of one, a weight copy the step keeps, or a tensor subclass), not shared by every
        layer, large enough."""
        if type(tensor) is not torch.Tensor or tensor.numel() < self.owner.min_numel:
            return False
        if isinstance(tensor._base, nn.Parameter) or held_for_step(tensor):
            return False
        if masks.shared(tensor):  # (an attention mask every layer reads)
            return False
        return tensor.untyped_storage().data_ptr() not in self.keep

    def open(self, name: str) -> _Group:
        """A new group; the one before it goes to host memory (if the plan offloads it)."""
        previous = self.groups[-1] if self.groups else None
        # (a group opened inside another leaves the outer one to collect)
        if previous is not None and previous.closed and self.owner.offloads(previous.index):
            previous.offload(self.owner.copies)
        group = _Group(self, name, len(self.groups), previous)
        self.groups.append(group)
        return group


class ActivationOffload:
    """A model chunk's fine-grained activation offloading: its modules, tuning and plan."""

    def __init__(
        self,
        modules: Iterable[str],
        min_offloaded_tensor_size: int,
        activation_offload_fraction: float = 1.0,
        keep_on_device_bytes: int = 0,
        max_inflight_offloads: int | None = None,
        first_groups: int | None = None,
    ) -> None:
        """`first_groups`: offload those first groups of each pass, no others (layer-level
        offloading's layers); otherwise the plan's."""
        self.modules = frozenset(modules)
        self.min_numel = min_offloaded_tensor_size
        self.fraction = activation_offload_fraction
        self.keep_on_device_bytes = keep_on_device_bytes
        self.copies = _Copies(max_inflight_offloads)
        self.first_groups = first_groups
        # the groups offloaded, by index (None: all, in the first pass)
        self.planned: set[int] | None = None if first_groups is None else set(range(first_groups))
        self.surveyed = False
        self.offloaded_bytes: dict[str, int] = {}  # per module, one forward pass under the plan
        # Set to {} to measure: the storages the next pass's groups leave on the device
        # (training/memory.py's measurement, whose hooks the groups' own hooks hide them from).
        self.resident: dict[int, torch.UntypedStorage] | None = None

    @contextlib.contextmanager
    def forward_pass(self, keep: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        """One micro-batch's forward pass; `keep`: tensors every layer saves (never
        offloaded)."""
        forward = _Pass(self, keep)
        token = _PASS.set(forward)
        try:
            yield
        finally:
            _PASS.reset(token)
        if self.resident is not None:
            self.resident.update(forward.resident())
        if not self.surveyed and forward.groups:
            self.plan(forward.groups)
        for group in forward.groups:  # each group now lives as long as autograd holds it
            group.forward = None
        forward.groups = []

    def offloads(self, index: int) -> bool:
        return self.planned is None or index in self.planned

    def plan(self, groups: list[_Group]) -> None:
        """Which groups later passes offload, from the first pass's sizes."""
        self.surveyed = True
        if self.first_groups is None:
            sizes = [group.bytes for group in groups]
            self.planned = offload_plan(sizes, self.fraction, self.keep_on_device_bytes)
        self.offloaded_bytes = {}
        for group in groups:
            if group.index in self.planned:
                self.offloaded_bytes[group.name] = (
                    self.offloaded_bytes.get(group.name, 0) + group.bytes
                )


def offload_summary(model_chunks: Iterable[nn.Module]) -> str:
    """The line saying what this rank's model chunks offload per micro-batch, by module, as
    planned by their first forward pass."""
    per_module: dict[str, int] = {}
    for chunk in model_chunks:
        offload = chunk.activation_offload
        for name, size in (offload.offloaded_bytes if offload is not None else {}).items():
            per_module[name] = per_module.get(name, 0) + size
    modules = ", ".join(f"{name} {size / 2**20:.1f}" for name, size in per_module.items())
    total = sum(per_module.values()) / 2**20
    return (
        f"> activation offloading: {total:.1f} MiB of each micro-batch's activations on this "
        f"rank go to host memory during its forward pass ({modules or 'none yet'})"
    )
