"""Megatron-LM's blends from files, for lists too long for a command line:
`--data-args-path FILE` holds what `--data-path` would (PREFIX ... or WEIGHT PREFIX ..., split
at whitespace), `--per-split-data-args-path FILE.json` what `--train-data-path`,
`--valid-data-path` and `--test-data-path` would, as `{"train": ..., "valid": ..., "test":
...}` (each a string of them, a list, or null). Read when the flags are parsed, so the
prefixes are checked like any given on the command line."""

from __future__ import annotations

import json

from threefold.config.errors import ConfigError

SPLITS = {"train": "train_data_path", "valid": "valid_data_path", "test": "test_data_path"}


def _read(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or "not UTF-8 text"
        raise ConfigError(f"{flag} {path}: cannot read it ({reason}); fix the path") from None


def read_data_args(data) -> None:
    """Fill `data`'s (a DataConfig) paths from the files its flags name, once: the flags are
    cleared when read."""
    if data.data_args_path is not None:
        if data.data_path:
            raise ConfigError("--data-args-path holds the --data-path blend: give one of them")
        data.data_path = _read(data.data_args_path, "--data-args-path").split()
        if not data.data_path:
            raise ConfigError(f"--data-args-path {data.data_args_path}: the file is empty")
        data.data_args_path = None  # (read: the blend is --data-path's now)
    path = data.per_split_data_args_path
    if path is None:
        return
    given = [f"--{name.replace('_', '-')}" for name in SPLITS.values() if getattr(data, name)]
    if given:
        raise ConfigError(f"--per-split-data-args-path holds {given[0]}'s blend: give one of them")
    flag = f"--per-split-data-args-path {path}"
    try:
        blends = json.loads(_read(path, "--per-split-data-args-path"))
    except json.JSONDecodeError as error:
        raise ConfigError(f"{flag}: not JSON ({error})") from None
    if not isinstance(blends, dict) or set(blends) != set(SPLITS):
        raise ConfigError(f'{flag}: give an object with "train", "valid" and "test" keys')
    for split, name in SPLITS.items():
        value = blends[split]
        if isinstance(value, str):
            value = value.split()
        if value is not None and not (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        ):
            raise ConfigError(f'{flag}: "{split}" must be a string, a list of strings, or null')
        setattr(data, name, value or [])
    data.per_split_data_args_path = None  # (read, as above)
