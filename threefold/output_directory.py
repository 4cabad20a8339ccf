"""Where a tool writes: the directory of its output made before any work, or the flag refused
in one line (a file in the way, a directory this user cannot write), not a traceback after
minutes of tokenizing or converting."""

from __future__ import annotations

import os

from threefold.config import ConfigError


def make_parent_directory(path: str, flag: str) -> None:
    """Make the directory that `path` (a file or a directory the tool writes) goes in; a
    ConfigError naming `flag` when it cannot be made or written."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise ConfigError(
            f"{flag} {path}: cannot write there ({_in_the_way(directory) or error.strerror}); "
            "give a path in a writable directory"
        ) from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{flag} {path}: {directory} is not writable by this user; give a path in a "
            "writable directory"
        )


def _in_the_way(directory: str) -> str | None:
    """'X is a file' for the file standing where a directory of `directory`'s path must be."""
    while directory != os.path.dirname(directory):
        if os.path.exists(directory) and not os.path.isdir(directory):
            return f"{directory} is a file"
        directory = os.path.dirname(directory)
    return None
