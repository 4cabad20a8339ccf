"""The --save directory, claimed before anything is built (torch-free, milliseconds).

Rank 0 creates it, proves it writable (a read-only directory, a file or a path under a file is
reported now, not after a full save interval of compute), takes an exclusive lock that lasts
as long as the process (a second run on the same directory is refused; the lock dies with
the process, so a restarted job takes it over), and tidies what a crash left: an unfinished
`iter_N.partial/`, stray `*.tmp.<pid>` files, or an `iter_N.replaced/` whose successor never
arrived (put back).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import time

from threefold.checkpoint.manifest import PARTIAL, REPLACED
from threefold.config import ConfigError

LOCK = ".threefold.lock"


class SaveDirectoryLock:
    """Held for the life of the run; `release` (or process exit) lets the next run in."""

    def __init__(self, descriptor: int) -> None:
        self.descriptor = descriptor

    def release(self) -> None:
        os.close(self.descriptor)


def claim_save_directory(save: str, wait_s: float = 5.0) -> SaveDirectoryLock:
    """Create, check and lock `save`; raises ConfigError in one line naming --save."""
    try:
        os.makedirs(save, exist_ok=True)
        probe = os.path.join(save, f".write-test.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
        descriptor = os.open(os.path.join(save, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise ConfigError(
            f"--save {save}: cannot write checkpoints there ({error.strerror}); "
            "give a writable directory"
        ) from None
    deadline = time.monotonic() + wait_s  # a restarted job: its old rank 0 may still be exiting
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as error:
            if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                print(
                    f"> --save {save}: this file system cannot lock files ({error.strerror}); "
                    "make sure no other run saves there",
                    flush=True,
                )
                break
            if not isinstance(error, BlockingIOError):
                raise ConfigError(f"--save {save}: cannot lock {LOCK} ({error.strerror})") from None
            if time.monotonic() > deadline:
                holder = os.pread(descriptor, 200, 0).decode("utf-8", "replace").strip()
                os.close(descriptor)
                raise ConfigError(
                    f"--save {save}: another run ({holder or 'unknown'}) is "
                    "saving checkpoints there; give each run its own --save"
                ) from None
            time.sleep(0.2)
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return SaveDirectoryLock(descriptor)


def tidy_save_directory(root: str) -> list[str]:
    """Under the lock: drop abandoned `.partial` saves and stray temporary files; put back a
    `.replaced` directory whose successor never arrived. Returns what it did."""
    done = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        if name.endswith(PARTIAL) or ".tmp." in name:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            done.append(f"removed the unfinished {name}")
        elif name.endswith(REPLACED):
            final = path[: -len(REPLACED)]
            if os.path.exists(final):
                shutil.rmtree(path)
            else:
                os.rename(path, final)
                done.append(f"restored {os.path.basename(final)}")
    return done


def claim_on_rank_zero(save: str | None) -> SaveDirectoryLock | None:
    """An entry point's first step with --save: rank 0 (torchrun's RANK) claims and tidies
    the directory, printing what it tidied. None without --save or on other ranks."""
    if not save or int(os.environ.get("RANK", "0")) != 0:
        return None
    lock = claim_save_directory(save)
    for done in tidy_save_directory(save):
        print(f"> --save {save}: {done} (left by an interrupted save)", flush=True)
    return lock
