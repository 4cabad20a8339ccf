"""Faults on purpose, for the reliability tests, switched on by environment variables that a
real run never sets (see also THREEFOLD_CRASH_AT in threefold/checkpointing.py):

    THREEFOLD_NAN_AT=RANK@ITERATION     that rank's loss is nan in that iteration
    THREEFOLD_STALL_AT=RANK@ITERATION   that rank hangs in that iteration's forward-backward
    THREEFOLD_SLOW_RANK=RANK:SECONDS    that rank computes this much longer in every iteration
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


def nan_now(rank: int, iteration: int) -> bool:
    return _rank_at("THREEFOLD_NAN_AT") == (rank, iteration)


def poison(loss_func):
    """`loss_func` with the per-token losses it reduces multiplied by nan: the loss and every
    gradient become nan, as after an overflow."""
    return lambda per_token_loss: loss_func(per_token_loss * torch.nan)


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
