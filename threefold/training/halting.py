"""How a training job that had to stop tells the person running it, and its exit code.

    CheckpointSaveError     a save failed (disk full, ...): the previous checkpoint is untouched
    NonFiniteError          --check-for-nan-in-loss-and-grad found a bad loss or gradient
    ReplicaMismatchError    --check-weight-hash-across-dp-replicas-interval found replicas apart
    RerunExit               --rerun-mode validate_results: Megatron-LM's exit codes 16 and 17
    ConfigError             an input found bad only when read (an --sft conversation whose
                            turns the tokenizer cannot tell apart), or a layout whose
                            micro-batch does not fit the device (training/out_of_memory.py):
                            exit code 2

One line on stderr (the first two name the checkpoint that stays the last good state) and
the exit code, instead of a traceback per rank. A failed save is said by the first rank that
met it (a disk can fill on one node only: parallel/refusal.py), the rest by rank 0.

The last three are decided by a collective, so every rank stops at the same point with no
collective in flight: their codes are `StoppedTogether`, and the process groups are freed
before exit as after a run that completed (startup.run_then_shut_down). A failed save may be
one rank's alone while its peers wait in a collective, so its code is a plain int.
"""

from __future__ import annotations

import os
import sys

from threefold.checkpoint.files import read_tracker
from threefold.checkpoint.writer import CheckpointSaveError
from threefold.config import ConfigError
from threefold.parallel.refusal import print_refusal_once
from threefold.training.numerics import NonFiniteError
from threefold.training.out_of_memory import out_of_memory_refused
from threefold.training.replica_check import ReplicaMismatchError
from threefold.training.rerun import RerunExit


class StoppedTogether(int):
    """An exit code every rank returns at the same point, none still in a collective: like a
    0, it lets the groups be destroyed and freed before the interpreter tears down (without
    that, a gloo thread finishing its last collective then can abort the rank, and exit 16
    reach the scheduler as -6). After a stop one rank meets alone, destroying an NCCL
    communicator its peers are still waiting on can hang, so those codes stay plain."""


def train(trainer, program: str) -> int:
    """`trainer.train()`, and the exit code: 0, or that of the reason it stopped."""
    rank_zero = trainer.parallel.world.rank == 0
    try:
        with out_of_memory_refused(trainer.config, "while training"):
            trainer.train()
    except CheckpointSaveError as error:
        print_refusal_once(program, error, trainer.parallel.world.rank)
        return 1
    except ConfigError as error:  # (the rank that read it alone: a plain int)
        print_refusal_once(program, error, trainer.parallel.world.rank)
        return 2
    except RerunExit as stop:
        if rank_zero:
            print(f"{program}: {stop}", file=sys.stderr, flush=True)
        return StoppedTogether(stop.code)
    except (NonFiniteError, ReplicaMismatchError) as error:
        if rank_zero:
            save = trainer.config.checkpoint.save
            last = read_tracker(save) if save and os.path.isdir(save) else None
            kept = (
                f"the last checkpoint, iteration {last} in {save}, is untouched"
                if last is not None
                else "no checkpoint was saved"
            )
            print(
                f"{program}: {error}; stopping without saving: {kept}", file=sys.stderr, flush=True
            )
        return StoppedTogether(1)
    return 0
