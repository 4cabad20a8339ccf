"""Activation recomputation (Megatron's --recompute-granularity / -method / -num-layers /
-modules; config/recompute.py).

Recomputed regions keep only their inputs during the forward pass and run again during the
backward pass. Dropout inside them must draw the same masks both times: torch's checkpoint
restores the default generator, and `context_fn` here additionally snapshots the TP-split
stream of threefold's RNG tracker at the original forward and reinstates it for the
recomputation (what Megatron's CheckpointFunction does for its CUDA tracker).

`OutputDiscardingCheckpoint` is megatron-core's CheckpointWithoutOutput, for small modules
whose output the next module keeps anyway (a norm's output is the QKV projection's saved
input): the output is kept until that consumer has run, then its storage is freed, and
refilled by a recomputation just before the consumer's backward reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch.utils.checkpoint

from threefold.parallel.tensor_parallel.random import get_rng_tracker


class _TrackerSnapshot:
    def __init__(self) -> None:
        self.states = None

    @contextlib.contextmanager
    def during_forward(self):
        global _checkpointing
        self.states = {name: s.clone() for name, s in get_rng_tracker().states.items()}
        _checkpointing += 1
        try:
            yield
        finally:
            _checkpointing -= 1

    @contextlib.contextmanager
    def during_recompute(self):
        global _recomputing
        tracker = get_rng_tracker()
        current = tracker.states
        tracker.states = {name: s.clone() for name, s in self.states.items()}
        _recomputing += 1
        try:
            yield
        finally:
            _recomputing -= 1
            tracker.states = current


_recomputing = 0
# Inside a checkpointed region's first forward: its saved tensors are the checkpoint's, which
# an output-discarding recomputation inside could not refill.
_checkpointing = 0


def is_checkpointing() -> bool:
    """Inside a checkpointed region's first forward: what it saves is the checkpoint's to
    drop (activation offloading leaves it alone)."""
    return _checkpointing > 0


def is_recomputing() -> bool:
    """Inside the backward pass's second forward of a recomputed region: what the forward
    records (MoE routing statistics) was recorded the first time."""
    return _recomputing > 0


# Inside a layer compiled whole (--compile-layers) the recomputed region runs eager between two
# compiled graphs: the compiler's own checkpoint cannot take this `context_fn`.
@torch.compiler.disable
def checkpoint(function, *args):
    """`function(*args)`, recomputed in backward instead of keeping its activations."""
    snapshot = _TrackerSnapshot()
    return torch.utils.checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        context_fn=lambda: (snapshot.during_forward(), snapshot.during_recompute()),
    )


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _rerun(ctx) -> None:
    """Runs the function again, with a graph, from its saved inputs."""
    global _recomputing
    _recomputing += 1
    # Leaves of its own (what an unpack returns may be a copy: activation offloading's).
    ctx.leaves = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
    try:
        with torch.enable_grad():
            recomputed = ctx.function(*ctx.leaves)
    finally:
        _recomputing -= 1
    ctx.recomputed = recomputed if isinstance(recomputed, tuple) else (recomputed,)


class _DiscardedOutput(torch.autograd.Function):
    """`function(*inputs)`, its outputs detached from the graph they were computed in (which
    is dropped at once); its backward takes the graph the recomputation built (`_rerun`)
    through to the inputs and parameters."""

    @staticmethod
    def forward(ctx, function, owner, *inputs):
        # Detached leaves: the recomputation's graph ends at them, and backward returns
        # their gradients as the inputs'.
        leaves = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
        # Run as the recomputation will run, with autograd on (a kernel may take another path
        # without it: CPU rms_norm rounds differently), its graph dropped at once; its saved
        # tensors bypass any outer saved-tensor hooks (a measurement would count them).
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            outputs = function(*leaves)
        outputs = (
            tuple(out.detach() for out in outputs)
            if isinstance(outputs, tuple)
            else outputs.detach()
        )
        ctx.save_for_backward(*leaves)
        # Read before backward without unpacking the saved inputs (which activation
        # offloading may have moved to the host).
        ctx.input_storages = {x.untyped_storage().data_ptr() for x in inputs}
        ctx.function, ctx.recomputed, owner.ctx = function, None, ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if ctx.recomputed is None:  # nothing was discarded (its consumer needs no gradient)
            _rerun(ctx)
        pairs = [(out, g) for out, g in zip(ctx.recomputed, grads) if g is not None]
        pairs = [(out, g) for out, g in pairs if out.requires_grad]
        if pairs:
            torch.autograd.backward(*zip(*pairs))
        inputs, ctx.leaves, ctx.recomputed, ctx.function = ctx.leaves, None, None, None
        return (None, None, *(x.grad if x.requires_grad else None for x in inputs))


class OutputDiscardingCheckpoint:
    """One call's output-discarding recomputation:

        norm = OutputDiscardingCheckpoint(enabled)
        attention = self.self_attention(norm.checkpoint(self.input_layernorm, hidden_states))
        norm.discard_output_and_register_recompute(attention)

    `function` takes and returns tensors and draws no random numbers (norms, activations,
    MLA's up projections), so the recomputation needs no RNG state. Disabled (or without
    autograd) both calls are plain: the function runs and its output stays."""

    def __init__(self, enabled: bool = True) -> None:
        # Inside a checkpointed region (--recompute-modules moe with moe_act) the region's
        # recomputation serves: it keeps only the region's input.
        self.enabled = enabled and torch.is_grad_enabled() and not (_checkpointing or _recomputing)
        self.ctx = None
        self.discarded: list[tuple[int, torch.Tensor]] = []

    def checkpoint(self, function: Callable, *inputs: torch.Tensor):
        if not self.enabled:
            return function(*inputs)
        outputs = _DiscardedOutput.apply(function, self, *inputs)
        self.discarded = list(enumerate(outputs if isinstance(outputs, tuple) else (outputs,)))
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Frees the outputs' storage (the consumer has run and saved what it needs), and
        refills it when `hook_tensor`'s gradient is ready: before the backward of the
        consumer that produced it."""
        if not (self.enabled and hook_tensor.requires_grad):
            return
        inputs = self.ctx.input_storages
        # (an output aliasing an input would free the input: kept whole)
        self.discarded = [
            (i, out) for i, out in self.discarded if out.untyped_storage().data_ptr() not in inputs
        ]
        for _, out in self.discarded:
            out.untyped_storage().resize_(0)
        hook_tensor.register_hook(self._recompute)

    def _recompute(self, grad: torch.Tensor) -> None:
        ctx, self.ctx = self.ctx, None
        if ctx is None:  # (a second backward through the same graph)
            return
        _rerun(ctx)
        with torch.no_grad():
            for i, out in self.discarded:
                storage = ctx.recomputed[i].untyped_storage()
                out.untyped_storage().resize_(storage.nbytes())
                out.untyped_storage().copy_(storage)
        self.discarded = []
