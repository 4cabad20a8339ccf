"""The configuration error every config dataclass raises (torch-free, imported by all of them)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration mistake; the message is one line naming the flag(s) and the fix."""


def flag(name: str) -> str:
    """The command-line spelling of a config field, for error messages."""
    return "--" + name.replace("_", "-")


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
