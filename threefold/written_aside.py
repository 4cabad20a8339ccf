"""Files replaced whole or not at all. What a run or a tool writes goes under a temporary name
beside its destination, and is renamed over it only once complete and on disk: a failure (a
bad record, a full disk, Ctrl-C, a crash) leaves what was there before, never a half-written
file that a later step reads.

A temporary name holds `.tmp.<pid>` (the tidying of a save directory removes strays by it,
checkpoint/save_directory.py) and keeps its destination's extension, which libraries go by
(matplotlib's format, sentencepiece's `.model`/`.vocab`, megatron-core's `.bin`/`.idx`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def temporary_name(path: str) -> str:
    stem, extension = os.path.splitext(path)
    return f"{stem}.tmp.{os.getpid()}{extension}"


@contextlib.contextmanager
def written_aside(*paths: str) -> Iterator[list[str]]:
    """The names to write `paths` under. Leaving the block normally puts each file on disk and
    renames it over its path, in the order given (what a reader opens first goes last);
    leaving it by an exception removes them, and the paths keep what they held."""
    temporaries = [temporary_name(path) for path in paths]
    try:
        yield temporaries
        for temporary in temporaries:
            with open(temporary, "rb") as f:
                os.fsync(f.fileno())
        for temporary, path in zip(temporaries, paths):
            os.replace(temporary, path)
        for directory in dict.fromkeys(os.path.dirname(os.path.abspath(p)) for p in paths):
            fsync_directory(directory)  # (which makes the renames durable)
    finally:
        for temporary in temporaries:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temporary)


def write_atomically(path: str, text: str) -> None:
    """Replace `path` with `text`: a crash leaves the old file or the new one, never a mix."""
    with written_aside(path) as (temporary,), open(temporary, "w") as f:
        f.write(text)


def fsync_directory(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
