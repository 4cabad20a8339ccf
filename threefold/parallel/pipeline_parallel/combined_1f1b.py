"""--overlap-moe-expert-parallel-comm: Megatron-LM's combined 1F1B. The forward pass of one
micro-batch runs together with the backward pass of the micro-batch before it, and each pass's
expert-parallel all-to-alls travel while the other pass computes.

Megatron-LM cuts every layer into nodes with detached boundaries (attention and router, the
dispatch, the experts, the combine) and calls the nodes of the two passes in a fixed interleaved
order. Here the passes stay whole. The backward runs on a helper thread and the forward on the
caller's, and they take turns, never running at once: an exchange starts its all-to-all, hands
the turn to the other pass, and waits for its data only when the turn comes back
(`hand_over`, called by the alltoall dispatcher's exchanges in both directions). The backward
takes the first turn, so one MoE layer of each pass goes

    backward: ... start the combine's gradient all-to-all
    forward :     attention, router, start the dispatch
    backward:     wait; the experts' backward, start the dispatch's gradient all-to-all
    forward :     wait; the experts, start the combine
    backward:     wait; the attention's backward, ..., the next layer's combine gradient
    forward :     wait; the residual, the next layer's attention, ...

which is the order Megatron-LM's TransformerLayerSchedulePlan.run gives its nodes. The
computation of each micro-batch is unchanged, and so is the order in which its gradients
accumulate (each backward still runs whole before the next starts). Every rank runs the same
passes in the same turns, so every rank starts the same collectives in the same order; a pass
that has finished no longer takes turns and the other runs on alone. Under
--delay-wgrad-compute the backward, having started an exchange, first computes the weight
gradients it deferred (tensor_parallel/delayed_wgrad.py), then hands over.

On a GPU an all-to-all started with `async_op` runs on the communicator's stream while the
other pass's kernels run on the compute stream; on gloo it runs on gloo's own threads.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from threefold.parallel.tensor_parallel import delayed_wgrad

T = TypeVar("T")
_OTHER = {"forward": "backward", "backward": "forward"}


class _Turns:
    """Two passes taking turns: the one whose turn it is runs, the other waits."""

    def __init__(self, first: str) -> None:
        self._condition = threading.Condition()
        self._turn = first
        self._finished: set[str] = set()
        self.handovers = 0

    def wait_for_turn(self, side: str) -> None:
        with self._condition:
            self._condition.wait_for(lambda: self._turn == side)

    def hand_over(self, side: str) -> None:
        other = _OTHER[side]
        with self._condition:
            if other in self._finished:
                return
            self.handovers += 1
            self._turn = other
            self._condition.notify_all()
            self._condition.wait_for(lambda: self._turn == side)

    def finish(self, side: str) -> None:
        with self._condition:
            self._finished.add(side)
            self._turn = _OTHER[side]
            self._condition.notify_all()


_turns: _Turns | None = None  # the combined step in progress, if any


def in_progress() -> bool:
    """Whether a combined step is running (its exchanges then hand over)."""
    return _turns is not None


def hand_over(side: str) -> None:
    """An exchange of the `side` ("forward" or "backward") pass has started: the other pass of
    the combined step in progress runs until it hands back (nothing outside a combined step)."""
    turns = _turns
    if turns is not None:
        if side == "backward":  # --delay-wgrad-compute: the deferred GEMMs beside the exchange
            delayed_wgrad.flush()
        turns.hand_over(side)


def run_together(
    forward: Callable[[], T], backward: Callable[[], None], delay_wgrad: bool = False
) -> tuple[T, int]:
    """`forward()` on this thread and `backward()` on a helper thread, taking turns at their
    exchanges, the backward first; `delay_wgrad` (--delay-wgrad-compute): the backward's
    weight gradients deferred to its exchanges (delayed_wgrad.py). Returns the forward's
    result and how many times the turn passed."""
    global _turns
    if _turns is not None:
        raise RuntimeError("combined 1F1B steps do not nest")
    turns = _turns = _Turns(first="backward")
    failures: list[BaseException] = []
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def backward_pass() -> None:
        try:
            if device is not None:  # a new thread starts on device 0
                torch.cuda.set_device(device)
            with delayed_wgrad.collected() if delay_wgrad else contextlib.nullcontext():
                backward()
        except BaseException as error:  # re-raised on the caller's thread
            failures.append(error)
        finally:
            turns.finish("backward")

    helper = threading.Thread(target=backward_pass, name="combined-1f1b-backward", daemon=True)
    helper.start()
    try:
        turns.wait_for_turn("forward")
        result = forward()
    finally:
        turns.finish("forward")
        helper.join()
        _turns = None
    if failures:
        raise failures[0]
    return result, turns.handovers
