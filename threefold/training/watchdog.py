"""Hangs and stragglers, seen through the c10d store every rank already shares.

Every rank records where it is (a progress counter, the iteration and the phase: forward-backward,
gradient reduction, optimizer step, evaluation, checkpoint save) as it moves on. Ranks move
through the same phases in lockstep, so when a rank stops moving the others soon wait for it
inside a collective: their counters are ahead of its. A thread on every rank notices when its own
rank has made no progress for 80% of `--distributed-timeout-minutes` (before the collective
itself times out with a message that names nobody), reads everyone's position, names the ranks
that are behind and the phase they are stuck in, and ends the process; torchrun then stops the
rest.

Stragglers (`--log-straggler`): each rank also publishes the time it spent computing
(forward-backward, without the wait in the gradient reduction that follows) over each logging
window; rank 0 reports the ranks slower than `--straggler-factor` times the median.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time

import torch.distributed as dist

_PREFIX = "threefold/watchdog"


class Watchdog:
    def __init__(self, timeout_minutes: float, straggler_factor: float | None = None,
                 live: bool = True) -> None:
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
        if self.enabled:
            self.store = dist.distributed_c10d._get_default_store()
            self.enter("start-up", 0)
            self._thread = threading.Thread(target=self._watch, name="threefold-watchdog",
                                            daemon=True)
            self._thread.start()

    def _key(self, rank: int) -> str:
        return f"{_PREFIX}/progress/{rank}"

    def enter(self, phase: str, iteration: int) -> None:
        """This rank starts `phase` of `iteration` (called by the training loop)."""
        if not self.enabled:
            return
        self.progress += 1
        self.iteration, self.phase = iteration, phase
        self.store.set(self._key(self.rank), f"{self.progress}|{iteration}|{phase}")

    # -- stall detection -----------------------------------------------------------------------
    def _watch(self) -> None:
        limit = 0.8 * self.timeout_minutes * 60
        seen, since = self.progress, time.monotonic()
        while not self._stop.wait(min(1.0, limit / 20)):
            if self.progress != seen:
                seen, since = self.progress, time.monotonic()
            elif time.monotonic() - since > limit:
                print(self.stall_report(time.monotonic() - since), file=sys.stderr, flush=True)
                os._exit(3)

    def positions(self) -> dict[int, tuple[int, int, str]]:
        """(progress, iteration, phase) of every rank that has recorded one."""
        positions = {}
        for rank in range(self.world):
            if self.store.check([self._key(rank)]):
                progress, iteration, phase = self.store.get(self._key(rank)).decode().split(
                    "|", 2)
                positions[rank] = (int(progress), int(iteration), phase)
        return positions

    def stall_report(self, waited_s: float) -> str:
        positions = self.positions()
        lowest = min(progress for progress, _, _ in positions.values())
        behind = sorted(rank for rank, (progress, _, _) in positions.items()
                        if progress == lowest)
        _, iteration, phase = positions[behind[0]]
        where = f"in {phase} of iteration {iteration}"
        if len(behind) == len(positions):
            culprit = f"every rank is stuck {where} (a collective that cannot complete)"
        else:
            names = ", ".join(map(str, behind))
            culprit = (f"rank{'s' if len(behind) > 1 else ''} {names} stalled {where}; the "
                       "others wait for it")
        return (f"threefold watchdog on rank {self.rank}: no progress for {waited_s:.0f} s "
                f"(--distributed-timeout-minutes {self.timeout_minutes:g}): {culprit}. This "
                f"rank is in {self.phase} of iteration {self.iteration}. Ending the run.")

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
        listed = ", ".join(f"rank {rank} {t / iterations * 1e3:.0f} ms ({t / median:.1f}x)"
                           for rank, t in slow)
        return (f"  stragglers over iterations {first}-{last}: {listed}; median compute time "
                f"per iteration {median / iterations * 1e3:.0f} ms (--straggler-factor "
                f"{self.straggler_factor:g})")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
