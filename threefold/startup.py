"""The start-up the entry scripts share, after their flags and input files are checked: torch
and the trainer imported with the cyclic collector paused, the process environment
`--deterministic-mode` and the NCCL flight recorder need (before any NCCL communicator or
cuBLAS handle exists), then torch.distributed and the groups for the layout. A mistake found
here (nccl without a GPU, a determinism variable set to a racy value) is one line and exit
code 2, as a flag mistake is."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator

from threefold.arguments import print_refusal
from threefold.config import Config, ConfigError


@contextlib.contextmanager
def frozen_imports() -> Iterator[None]:
    """Import inside: Python's cyclic collector is paused while the block imports, then what
    the imports made is frozen (`gc.freeze`), out of every later collection.

    A module's objects live as long as the process, so collecting them never frees anything,
    yet torch's and the trainer's hundreds of thousands of objects cost every full collection
    a pass over each: five such passes while they import, and the interpreter's last one at
    exit, 0.5 s and 1 s of a tiny run's 5 s on a 2-core machine (bench/results/startup.md).
    Frozen, they are also left alone by the collections of a forked data-loader worker, whose
    pages then stay shared (what Python's documentation of `gc.freeze` advises before fork).

    Frozen with them are the imports' garbage cycles (torch.fx's `wrap` keeps its own frame in
    a local), and through those frames' `f_back` the caller's frame: whatever the caller's
    locals come to hold lives until exit. So the entry scripts hold their trainer in a
    function called after the block, not in the caller."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.freeze()


def run_then_shut_down(run: Callable[[], int]) -> int:
    """`run()`'s exit code; after a 0, or a stop every rank made together (exit 16 or 17 of
    --rerun-mode, a non-finite loss: `halting.StoppedTogether`), this process's groups are
    destroyed and freed (`state.shut_down`, which says why they must go before the
    interpreter's teardown). Whatever holds a group (trainer, model, ParallelContext) lives
    in `run`'s own frame, gone by then, not in the caller's."""
    from threefold.training.halting import StoppedTogether

    code = run()
    if code == 0 or isinstance(code, StoppedTogether):
        from threefold.parallel import state

        state.shut_down()
    return code


def start_processes(config: Config, prog: str):
    """(device, ParallelContext) of this process, or None once the refusal is printed."""
    from threefold.kernels.determinism import deterministic_environment
    from threefold.parallel import state
    from threefold.parallel.flight_recorder import flight_recorder_environment

    try:
        if config.kernels.deterministic_mode:
            deterministic_environment()
        # (before the first group: PyTorch reads the recorder's variables when one is made)
        for line in flight_recorder_environment(config.parallel):
            if os.environ.get("RANK", "0") == "0":
                print(line, flush=True)
        return state.initialize_from_config(config.parallel)
    except ConfigError as error:
        print_refusal(prog, error)
        return None
