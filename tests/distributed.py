"""Run a function on N real gloo ranks, reusing the workers across tests.

Starting a rank costs seconds on a 2-core machine (each imports torch), so a pool of N workers
is started once per world size and kept for the whole session, each worker forked from a
server that imported torch and threefold once (`PRELOAD`). Each job runs
`fn(*args)` on every rank and returns the per-rank results in rank order; the job's process
groups are torn down after it so the next one can choose another layout.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import queue
import socket
import sys
import time
import traceback
from multiprocessing.reduction import ForkingPickler

import torch.multiprocessing as mp

JOB_TIMEOUT_S = 600
# What every rank imports before its first job. A fork server imports it once and forks each
# worker from itself: a spawned worker imported it anew, about 5 CPU-seconds a rank (torch,
# then torch._dynamo through the trainer's compiler-disabled functions), which the 2-core
# machine paid for every rank of every pool: 8 spawned ranks took 13.4 s to answer a first
# job, 8 forked ones 1.8 s.
PRELOAD = ["torch", "torch.distributed", "threefold.training.trainer", "tests.distributed"]
# Objects a collection finds in its oldest generation beyond which a job imported a library.
IMPORTED_OBJECTS = 50_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What torchrun gives each worker of a one-node job on this machine."""
    return dict(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    from threefold.kernels.dispatch import KERNELS
    from threefold.parallel import state

    os.environ.update(worker_environment(rank, world_size, port))
    torch.set_num_threads(1)
    # A rank that fails leaves its peers blocked in a collective: let them time out instead of
    # hanging the test session.
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
    )
    # The imports' objects (some 300,000) out of every collection: the collection after each
    # job, and the automatic ones during it, passed over all of them, 0.17 s of CPU a rank each
    # time (an 8-rank job that does nothing took 0.7 s); the parity files ran 20% faster.
    gc.freeze()
    while True:
        job = tasks.get()
        if job is None:
            break
        fn, args = job
        try:
            value = fn(*args)
            # The queue pickles in a background thread, where a failure would only be printed
            # and the test would wait for the job's timeout: fail here instead.
            ForkingPickler.dumps(value)
            results.put((rank, True, value))
        except BaseException:  # report everything, including assertion errors, to the test
            results.put((rank, False, traceback.format_exc()))
        finally:
            destroy_groups(state)
            KERNELS.use_reference()
            # The job's trainer, model and autograd graph hold its process groups in reference
            # cycles; until a collection frees them, each group keeps its gloo threads polling,
            # and hundreds of jobs' worth slowed every later test.
            gc.collect()
            # A job that imported a library (megatron-core, transformers: some 150,000
            # objects) has it join the frozen imports: each later collection passed over it
            # again, 66 ms of CPU a rank after every job. Only then: what else survived is
            # frozen with it, and a process group among it is never collected (freezing after
            # every job kept twice as many groups' gloo threads alive).
            if len(gc.get_objects(generation=2)) > IMPORTED_OBJECTS:
                gc.freeze()
    dist.destroy_process_group()


def destroy_groups(state) -> None:
    """Every process group a job left behind: threefold's layout, and megatron-core's own,
    which the tests that run its models build (its destroy only forgets its references, some
    not even those: a group still referenced keeps its gloo threads)."""
    import torch.distributed as dist

    state.destroy_model_parallel()
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
        for name, value in list(vars(ps).items()):
            if isinstance(value, dist.ProcessGroup):
                setattr(ps, name, None)
    for group in set(dist.distributed_c10d._world.pg_map):
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)


class WorkerPool:
    def __init__(self, world_size: int) -> None:
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)  # (read when the fork server first starts)
        port = free_port()
        self.world_size = world_size
        self.tasks = [context.Queue() for _ in range(world_size)]
        self.results = context.Queue()
        self.processes = [
            context.Process(
                target=_worker,
                args=(rank, world_size, port, self.tasks[rank], self.results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in self.processes:
            process.start()
        self.broken = False

    def run(self, fn, *args):
        for task_queue in self.tasks:
            task_queue.put((fn, args))
        outcomes = {}
        try:
            for _ in range(self.world_size):
                rank, ok, value = self.results.get(timeout=JOB_TIMEOUT_S)
                outcomes[rank] = (ok, value)
        except queue.Empty:
            self.broken = True
            raise TimeoutError(
                f"{self.world_size}-rank job {fn.__name__} did not finish in {JOB_TIMEOUT_S} s"
            ) from None
        failures = [f"rank {r}:\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
        if failures:
            self.broken = True  # peers may have timed out mid-collective: start afresh
            raise AssertionError("\n".join(failures))
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def ask_to_leave(self) -> None:
        for task_queue in self.tasks:
            try:
                task_queue.put(None)
            except (OSError, ValueError):
                pass

    def close(self, deadline: float | None = None) -> None:
        """Ask every worker to leave, give them until `deadline` (monotonic; default 1 s from
        now), then kill the rest: each exiting rank tears down gloo and torch, a second or so
        of a 2-core machine apiece, which at the session's end bought nothing (the pools took
        17 to 24 s, waited for one rank at a time)."""
        self.ask_to_leave()
        deadline = time.monotonic() + 1 if deadline is None else deadline
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join()


_POOLS: dict[int, WorkerPool] = {}


def run_distributed(world_size: int, fn, *args) -> list:
    """`fn(*args)` on `world_size` gloo ranks; returns the per-rank results."""
    pool = _POOLS.get(world_size)
    if pool is None or pool.broken:
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = WorkerPool(world_size)
    return pool.run(fn, *args)


def close_pools() -> None:
    pools = list(_POOLS.values())
    for pool in pools:  # every pool's workers leave at once
        pool.ask_to_leave()
    deadline = time.monotonic() + 1
    for pool in pools:
        pool.close(deadline)
    _POOLS.clear()


atexit.register(close_pools)
