"""Faults on purpose, for the reliability tests, switched on by environment variables that a
real run never sets (see also THREEFOLD_CRASH_AT in threefold/checkpoint/writer.py):

    THREEFOLD_NAN_AT=RANK@ITERATION     that rank's loss is nan in that iteration
    THREEFOLD_SPIKE_AT=RANK@ITERATION[xFACTOR]  that rank's loss (and gradients) times FACTOR
                                        (default 20) in that iteration: a loss spike
    THREEFOLD_STALL_AT=RANK@ITERATION   that rank hangs in that iteration's forward-backward
    THREEFOLD_SLOW_RANK=RANK:SECONDS    that rank computes this much longer in every iteration
    THREEFOLD_NODE_NAME=NAME            the node this process says it runs on (--rerun-mode's
                                        "another device", for a rescheduled job on one machine)
"""

from __future__ import annotations

import os
import time

import torch


def _rank_at(variable: str) -> tuple[int, int] | None:
    value = os.environ.get(variable)
    if not value:
        return None
    rank, iteration = value.split("@")
    return int(rank), int(iteration)


def _spike_factor(rank: int, iteration: int) -> float | None:
    value = os.environ.get("THREEFOLD_SPIKE_AT")
    if not value:
        return None
    where, _, factor = value.partition("x")
    spike_rank, spike_iteration = where.split("@")
    if (int(spike_rank), int(spike_iteration)) != (rank, iteration):
        return None
    return float(factor or 20)


def inject(loss_func, rank: int, iteration: int):
    """`loss_func` with the per-token losses it reduces multiplied by nan (THREEFOLD_NAN_AT:
    the loss and every gradient become nan, as after an overflow) or by a spike factor
    (THREEFOLD_SPIKE_AT), when asked for this rank and iteration."""
    factor = (
        torch.nan
        if _rank_at("THREEFOLD_NAN_AT") == (rank, iteration)
        else _spike_factor(rank, iteration)
    )
    if factor is None:
        return loss_func
    return lambda per_token_loss: loss_func(per_token_loss * factor)


def delay(rank: int, iteration: int) -> None:
    """Sleep as THREEFOLD_STALL_AT / THREEFOLD_SLOW_RANK ask, in `iteration` on `rank`."""
    if _rank_at("THREEFOLD_STALL_AT") == (rank, iteration):
        while True:
            time.sleep(60)
    slow = os.environ.get("THREEFOLD_SLOW_RANK")
    if slow:
        slow_rank, seconds = slow.split(":")
        if int(slow_rank) == rank:
            time.sleep(float(seconds))


def node_name() -> str | None:
    """THREEFOLD_NODE_NAME, when set."""
    return os.environ.get("THREEFOLD_NODE_NAME") or None
