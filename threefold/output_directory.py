"""Where a run or a tool writes: checked before any work, so that a file standing where a
directory must be, or a directory this user cannot write, is one line naming the flag, not a
traceback after minutes of training, tokenizing or converting."""

from __future__ import annotations

import os

from threefold.config import ConfigError


def check_creatable(directory: str, flag: str, given: str | None = None) -> None:
    """A ConfigError naming `flag` (and the path `given` to it) unless `directory` is, or can
    be made as, a directory this user writes. Nothing is created."""
    given = given or directory
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(
            f"{flag} {given}: cannot write there ({existing} is a file); give a path in a "
            "writable directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{flag} {given}: {existing} is not writable by this user; give a path in a "
            "writable directory"
        )


def make_parent_directory(path: str, flag: str, a_file: bool = False) -> None:
    """Make the directory that `path` (a file or a directory a tool writes; `a_file`: a file)
    goes in; a ConfigError naming `flag` when it cannot be made or written, or no path is given
    (an empty one would write into whatever directory the tool was started in)."""
    if not path.strip():
        raise ConfigError(f"{flag} is empty: give the path to write")
    if a_file and os.path.isdir(path):  # (the file would be renamed over it, and fail)
        raise ConfigError(f"{flag} {path}: a directory; give the file to write")
    directory = os.path.dirname(os.path.abspath(path))
    check_creatable(directory, flag, path)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:  # (what changed since the check, or a full disk)
        raise ConfigError(
            f"{flag} {path}: cannot write there ({error.strerror}); give a path in a writable "
            "directory"
        ) from None
