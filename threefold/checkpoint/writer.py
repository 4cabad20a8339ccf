"""Writing a checkpoint so that nothing good is ever replaced by something half-written.

    1. every rank writes its files into DIR/iter_N.partial/ (torch.distributed.checkpoint
       shards, RNG state; rank 0 the metadata and tokenizer)
    2. every rank digests a slice of the files; rank 0 writes manifest.json
    3. rank 0 renames iter_N.partial -> iter_N (an older iter_N is moved aside to
       iter_N.replaced first and deleted after), then replaces the tracker atomically

A crash at any point leaves the tracker naming a complete, verifiable directory; leftovers
(`.partial`, `.replaced`) are tidied when the next run starts (checkpoint/save_directory.py).

`--async-save` runs steps 1-3 in a background thread on a process group of its own (gloo), so
its collectives never interleave with the training thread's (which is how torch's own
async_save on the default group deadlocked against the loss all-reduce). The training loop only
polls the thread: a failed write is reported at the next iteration.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.tensor import DTensor

from threefold.checkpoint.files import TRACKER, checkpoint_dir
from threefold.checkpoint.manifest import (
    PARTIAL,
    REPLACED,
    checkpoint_files,
    complete_iterations,
    digest,
    my_slice,
    write_integrity,
    write_manifest,
)
from threefold.parallel.data_parallel.torch_native import local
from threefold.written_aside import fsync_directory, write_atomically

# Threads that checksum a rank's files (hashlib releases the GIL). DCP's writer itself stays at
# one thread per rank: with thread_count > 1, torch (2.13) drops an exception raised in its
# extra threads (a full disk) and commits metadata that lacks their tensors.
_DIGEST_THREADS = 4


class CheckpointSaveError(RuntimeError):
    """A save that could not be completed (the previous checkpoint is untouched)."""


def crash_point(name: str, iteration: int) -> None:
    """Fault injection for the crash-safety tests: THREEFOLD_CRASH_AT=<name>@<iteration> kills
    this process (SIGKILL, no clean-up) at that point of that iteration's save."""
    if os.environ.get("THREEFOLD_CRASH_AT") == f"{name}@{iteration}":
        os.kill(os.getpid(), signal.SIGKILL)


def _error_line(error: BaseException) -> str:
    """The root cause of a failed save in a line (DCP wraps each rank's error)."""
    failures = getattr(error, "failures", None)  # CheckpointException: {rank: exception}
    if failures:
        rank, cause = next(iter(sorted(failures.items())))
        cause = cause[0] if isinstance(cause, tuple) else cause
        return f"rank {rank}: {type(cause).__name__}: {cause}".splitlines()[0]
    return f"{type(error).__name__}: {error}".splitlines()[0]


def superseded(older: list[int], keep_latest: int | None, retain_interval: int | None) -> list[int]:
    """Which of the complete checkpoints `older` (newest first) than a save just committed
    to delete: none unless asked; beyond the newest `keep_latest` (counting the new one), and
    (--save-retain-interval) those whose iteration is not a multiple of `retain_interval`."""
    if keep_latest is None and retain_interval is None:
        return []
    keep = set(older[: max(keep_latest - 1, 0)]) if keep_latest is not None else set()
    if retain_interval is not None:
        keep |= {i for i in older if i % retain_interval == 0}
    return [i for i in older if i not in keep]


class CheckpointWriter:
    """Saves into `root`, synchronously or in the background; owns the save's process group,
    its thread and its staging buffers. `single_process`: written by this process alone
    (tools/convert_checkpoint.py), whatever process group exists."""

    def __init__(
        self,
        root: str,
        asynchronous: bool = False,
        single_process: bool = False,
        keep_latest: int | None = None,
        retain_interval: int | None = None,
    ) -> None:
        self.root = root
        self.asynchronous = asynchronous
        self.keep_latest, self.retain_interval = keep_latest, retain_interval
        self.distributed = distributed = dist.is_initialized() and not single_process
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        # A group of its own (every rank creates it, in the same order, at start-up).
        self.group = dist.new_group(backend="gloo") if asynchronous and distributed else None
        self._executor = ThreadPoolExecutor(1, "threefold-save") if asynchronous else None
        self._staging: dict[str, torch.Tensor] = {}
        self.pending: Future | None = None
        self.pending_iteration: int | None = None

    # -- the training thread --------------------------------------------------------------
    def save(
        self,
        iteration: int,
        write_rank_files: Callable[[str], None],
        tensors: dict[str, torch.Tensor],
        planner: SavePlanner | None = None,
        integrity: bool = False,
    ) -> str:
        """Write iteration `iteration`: `write_rank_files(directory)` writes this rank's small
        files (RNG, and on rank 0 metadata and tokenizer); `tensors` go through DCP (by
        `planner`, DCP's default without). `integrity`: Megatron-LM's integrity.json is written
        too. Returns the final directory; with --async-save it is complete once `wait`
        returns."""
        self.wait()
        final = checkpoint_dir(self.root, iteration)
        partial = final + PARTIAL
        try:
            if self.rank == 0:
                if os.path.isdir(partial):
                    shutil.rmtree(partial)
                os.makedirs(partial)
            self._barrier(None)
            write_rank_files(partial)
        except OSError as error:
            raise CheckpointSaveError(
                f"--save {self.root}: could not write iteration {iteration}: {error}"
            ) from None
        crash_point("before-shards", iteration)
        written = (planner, integrity)
        if not self.asynchronous:
            self._write_and_commit(iteration, tensors, partial, final, *written)
            return final
        staged = self._stage(tensors)  # the training thread may change `tensors` from now on
        self.pending_iteration = iteration
        self.pending = self._executor.submit(
            self._write_and_commit, iteration, staged, partial, final, *written
        )
        return final

    def poll(self) -> int | None:
        """The iteration of a background save that has just completed (None if none); raises
        CheckpointSaveError if it failed."""
        if self.pending is None or not self.pending.done():
            return None
        return self.wait()

    def wait(self) -> int | None:
        """Block until a background save is complete; its iteration (None if none)."""
        if self.pending is None:
            return None
        pending, iteration, self.pending = self.pending, self.pending_iteration, None
        pending.result()
        return iteration

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def _stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of the tensors in CPU memory, reused from save to save (pinned when the
        tensors live on a GPU, so the copy runs at full bus speed). A DTensor (FSDP2's
        shards) is staged as its local shard, wrapped again in its sharding, as torch's own
        async staging does, so DCP writes each rank's piece of the whole tensor."""
        staged = {}
        for key, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):  # (serialized objects, made for this save)
                staged[key] = tensor
                continue
            shard = local(tensor).detach()
            buffer = self._staging.get(key)
            if buffer is None or buffer.shape != shard.shape or buffer.dtype != shard.dtype:
                buffer = torch.empty(
                    shard.shape, dtype=shard.dtype, device="cpu", pin_memory=shard.is_cuda
                )
                self._staging[key] = buffer
            buffer.copy_(shard, non_blocking=shard.is_cuda)
            if isinstance(tensor, DTensor):
                buffer = DTensor(buffer, tensor._spec, requires_grad=False)
            staged[key] = buffer
        if any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors.values()):
            torch.cuda.synchronize()
        return staged

    # -- either thread: only collectives on self.group -----------------------------------
    def _barrier(self, group) -> None:
        if self.world_size > 1:
            dist.barrier(group=group)

    def _write_and_commit(
        self,
        iteration: int,
        tensors: dict[str, torch.Tensor],
        partial: str,
        final: str,
        planner: SavePlanner | None = None,
        integrity: bool = False,
    ) -> None:
        try:
            dcp.save(
                tensors,
                storage_writer=dcp.FileSystemWriter(partial),
                planner=planner,
                process_group=self.group,
                no_dist=not self.distributed,
            )
            self._barrier(self.group)  # every rank's files are on disk
            names = my_slice(checkpoint_files(partial), self.rank, self.world_size)
            with ThreadPoolExecutor(_DIGEST_THREADS) as pool:
                mine = dict(
                    zip(names, pool.map(digest, [os.path.join(partial, name) for name in names]))
                )
            everyone = [mine]
            if self.world_size > 1:
                everyone = [None] * self.world_size
                dist.all_gather_object(everyone, mine, group=self.group)
            if self.rank == 0:
                digests = {k: v for part in everyone for k, v in part.items()}
                if integrity:
                    write_integrity(partial, digests)
                write_manifest(partial, digests)
        except (Exception, CheckpointException) as error:  # (DCP's is a BaseException)
            free = shutil.disk_usage(self.root).free / 2**30  # the usual cause, said plainly
            raise CheckpointSaveError(
                f"--save {self.root}: saving iteration {iteration} "
                f"failed ({_error_line(error)}; {free:.1f} GiB free "
                "there); the previous checkpoint is untouched"
            ) from None
        self._barrier(self.group)
        crash_point("before-tracker", iteration)
        if self.rank == 0:
            self._commit(iteration, partial, final)
        self._barrier(self.group)

    def _commit(self, iteration: int, partial: str, final: str) -> None:
        replaced = final + REPLACED
        if os.path.exists(final):  # saving an iteration again: the old one stays until then
            if os.path.exists(replaced):
                shutil.rmtree(replaced)
            os.rename(final, replaced)
        os.rename(partial, final)
        fsync_directory(self.root)
        write_atomically(os.path.join(self.root, TRACKER), f"{iteration}\n")
        if os.path.exists(replaced):
            shutil.rmtree(replaced)
        older = [i for i in complete_iterations(self.root) if i < iteration]
        for old in superseded(older, self.keep_latest, self.retain_interval):
            shutil.rmtree(checkpoint_dir(self.root, old))
