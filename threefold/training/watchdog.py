"""Hangs and stragglers, seen through the c10d store every rank already shares.

Every rank notes where it is (a progress counter, the iteration and the phase: forward-backward,
gradient reduction, optimizer step, evaluation, checkpoint save) as it moves on. When a rank
stops moving, the others soon wait for it inside a collective. A thread on every rank notices
when its own rank has made no progress for 70% of `--distributed-timeout-minutes` (before the
collective itself times out with a message that names nobody) and publishes where its training
thread is, read from that thread's Python stack: inside which collective, or outside any, and at
which line. A rank outside any collective is the one the others wait for; a rank whose watchdog
does not answer is stopped or dead. The report names them and the operation the others wait in,
and the process ends; torchrun then stops the rest.

Stragglers (`--log-straggler`): each rank also publishes the time it spent computing
(forward-backward, without the wait in the gradient reduction that follows) over each logging
window; rank 0 reports the ranks slower than `--straggler-factor` times the median.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
import traceback

import torch.distributed as dist

_PREFIX = "threefold/watchdog"
# torch.distributed's blocking entry points: a thread inside one waits for the other ranks.
_COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "reduce_scatter_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "batch_isend_irecv",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "reduce",
}


def _names(ranks: list[int]) -> str:
    return ", ".join(map(str, sorted(ranks)))


class Watchdog:
    def __init__(
        self, timeout_minutes: float, straggler_factor: float | None = None, live: bool = True
    ) -> None:
        """`live=False`: a stand-in that records nothing (outside the training loop)."""
        self.enabled = live and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.enabled else 0
        self.world = dist.get_world_size() if self.enabled else 1
        self.timeout_minutes = timeout_minutes
        self.straggler_factor = straggler_factor
        self.progress, self.iteration, self.phase = 0, 0, "start-up"
        self.busy_s = 0.0
        self._stop = threading.Event()
        self._thread = None
        self._main_thread = threading.get_ident()  # the training loop's thread
        if self.enabled:
            self.store = dist.distributed_c10d._get_default_store()
            self.enter("start-up", 0)
            self._thread = threading.Thread(
                target=self._watch, name="threefold-watchdog", daemon=True
            )
            self._thread.start()

    def enter(self, phase: str, iteration: int) -> None:
        """This rank starts `phase` of `iteration` (called by the training loop)."""
        if not self.enabled:
            return
        self.progress += 1
        self.iteration, self.phase = iteration, phase

    # -- stall detection -----------------------------------------------------------------------
    def _watch(self) -> None:
        limit = 0.7 * self.timeout_minutes * 60
        seen, since = self.progress, time.monotonic()
        while not self._stop.wait(min(1.0, limit / 20)):
            if self.progress != seen:
                seen, since = self.progress, time.monotonic()
            elif time.monotonic() - since > limit:
                print(self.stall_report(time.monotonic() - since), file=sys.stderr, flush=True)
                os._exit(3)

    def where(self) -> dict:
        """Where this rank's training thread is now, read from its Python stack: inside a
        collective (or waiting on an asynchronous one) or not, and the code location."""
        frame = sys._current_frames().get(self._main_thread)
        stack = traceback.extract_stack(frame) if frame is not None else []
        waiting = next(
            (
                f
                for f in reversed(stack)
                if f.name in _COLLECTIVES and "torch/distributed" in f.filename.replace(os.sep, "/")
            ),
            None,
        )
        if waiting is None:  # Work.wait() on an asynchronous collective is C++: see the call
            waiting = next((f for f in reversed(stack[-2:]) if ".wait()" in (f.line or "")), None)
        ours = [f for f in stack if "torch/" not in f.filename.replace(os.sep, "/")]
        frame = ours[-1] if ours else (stack[-1] if stack else None)
        location = (
            f"{os.path.relpath(frame.filename)}:{frame.lineno} in {frame.name}"
            if frame is not None
            else "unknown"
        )
        operation = (
            waiting.name
            if waiting is not None and waiting.name in _COLLECTIVES
            else ("a collective" if waiting is not None else None)
        )
        return {
            "progress": self.progress,
            "iteration": self.iteration,
            "phase": self.phase,
            "collective": operation,
            "location": location,
        }

    def _gather_positions(self) -> dict[int, dict]:
        """Every rank's `where()`, as their own watchdogs publish them on a stall; a rank whose
        watchdog cannot answer (a stopped or dead process) is missing."""
        self.store.set(f"{_PREFIX}/stall/{self.rank}", json.dumps(self.where()))
        keys = {rank: f"{_PREFIX}/stall/{rank}" for rank in range(self.world)}
        # Short: the report must be out before the collectives' own timeout ends the ranks.
        deadline = time.monotonic() + max(1.0, 0.05 * self.timeout_minutes * 60)
        while time.monotonic() < deadline and not self.store.check(list(keys.values())):
            time.sleep(0.2)
        return {
            rank: json.loads(self.store.get(key))
            for rank, key in keys.items()
            if self.store.check([key])
        }

    def stall_report(self, waited_s: float) -> str:
        positions = self._gather_positions()
        silent = [rank for rank in range(self.world) if rank not in positions]
        busy = [rank for rank, p in positions.items() if p["collective"] is None]
        parts = []
        if silent:
            parts.append(
                f"rank{'s' if len(silent) > 1 else ''} {_names(silent)} did not answer "
                "(process stopped, dead or unreachable)"
            )
        for rank in busy:
            p = positions[rank]
            parts.append(
                f"rank {rank} stalled outside any collective at {p['location']} "
                f"({p['phase']} of iteration {p['iteration']})"
            )
        if not parts:
            lowest = min(p["progress"] for p in positions.values())
            behind = [rank for rank, p in positions.items() if p["progress"] == lowest]
            if len(behind) < len(positions):
                p = positions[behind[0]]
                parts.append(
                    f"rank{'s' if len(behind) > 1 else ''} {_names(behind)} behind, "
                    f"in {p['collective']} at {p['location']} ({p['phase']} of "
                    f"iteration {p['iteration']})"
                )
            else:
                parts.append("every rank waits in a collective that cannot complete")
        waiting = [rank for rank in positions if rank not in busy]
        if waiting and (silent or busy):
            p = positions[waiting[0]]
            parts.append(f"the others wait in {p['collective']} at {p['location']}")
        mine = positions.get(self.rank, self.where())
        return (
            f"threefold watchdog on rank {self.rank}: no progress for {waited_s:.0f} s "
            f"(--distributed-timeout-minutes {self.timeout_minutes:g}): "
            f"{'; '.join(parts)}. This rank is in {mine['phase']} of iteration "
            f"{mine['iteration']}. Ending the run."
        )

    # -- stragglers ----------------------------------------------------------------------------
    def add_busy_time(self, seconds: float) -> None:
        self.busy_s += seconds

    def straggler_report(self, window: int, first: int, last: int) -> str | None:
        """Collective over the store: every rank publishes its busy time for iterations
        `first`..`last`; rank 0 returns a report when some rank is a straggler."""
        if not self.enabled or self.straggler_factor is None:
            return None
        busy, self.busy_s = self.busy_s, 0.0
        self.store.set(f"{_PREFIX}/busy/{window}/{self.rank}", f"{busy}")
        if self.rank != 0:
            return None
        keys = [f"{_PREFIX}/busy/{window}/{rank}" for rank in range(self.world)]
        times = [float(self.store.get(key)) for key in keys]  # waits for every rank's
        for key in keys:
            self.store.delete_key(key)
        median = statistics.median(times)
        slow = [(rank, t) for rank, t in enumerate(times) if t > self.straggler_factor * median]
        if not slow:
            return None
        iterations = last - first + 1
        listed = ", ".join(
            f"rank {rank} {t / iterations * 1e3:.0f} ms ({t / median:.1f}x)" for rank, t in slow
        )
        return (
            f"  stragglers over iterations {first}-{last}: {listed}; median compute time "
            f"per iteration {median / iterations * 1e3:.0f} ms (--straggler-factor "
            f"{self.straggler_factor:g})"
        )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
