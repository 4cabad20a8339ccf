"""The JSONL files of Megatron-LM's `--sft` data, checked whole and then read a line at a time.

A line is `{"messages": [{"role": ..., "content": ...}, ...]}`: one conversation, or several
packed into the line, each starting at a system turn (data/megatron_sft.py splits them there).
Every line is parsed once when the run starts, so a bad one is a line naming the flag, the
file and the line number before any model exists, not a KeyError hours in; the file's byte
offsets are kept, not its records, so a large file costs 8 bytes a line of memory. Nothing
in a file is executed: it is JSON, read by `json`.
"""

from __future__ import annotations

import json
import os

import numpy as np

from threefold.config import ConfigError

ROLES = ("system", "user", "assistant", "tool")  # what Megatron-LM's SFTTokenizer renders
_INDEXED: dict[tuple[str, int, int], np.ndarray] = {}  # (path, size, mtime) -> line offsets


def message_mistake(messages, masks: bool) -> str | None:
    """What makes `messages` no conversation the SFT tokenizer renders, else None. `masks`:
    the prompt format finds targets by role (all but `default`), which then takes only
    Megatron-LM's roles, and an assistant turn with text after a user or tool turn."""
    if not isinstance(messages, list) or not messages:
        return '"messages" must be a list of {"role": ..., "content": ...} turns'
    for turn, message in enumerate(messages, 1):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            return f'turn {turn} of "messages" needs a "role" and a "content", both text'
        role = message["role"]
        if masks and role not in ROLES:
            return f'turn {turn} has the role "{role[:20]}", not one of {", ".join(ROLES)}'
        if masks and role == "assistant":
            if not message["content"]:
                return f"turn {turn} is an empty assistant turn"
            if turn == 1 or messages[turn - 2]["role"] not in ("user", "tool"):
                return f"turn {turn} is an assistant turn that follows no user or tool turn"
    return None


def line_offsets(path: str, flag: str, masks: bool) -> np.ndarray:
    """The byte offset of every record of `path` (blank lines skipped), after checking each
    one; a ConfigError naming `flag`, the file and the line for the first bad one."""
    try:
        stat = os.stat(path)
    except OSError:
        raise ConfigError(f"{flag} {path}: no such file; fix the path") from None
    key = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
    if key in _INDEXED:
        return _INDEXED[key]
    offsets, offset = [], 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                mistake = _record_mistake(line, masks)
                if mistake:
                    raise ConfigError(f"{flag} {path}:{number}: {mistake}")
                offsets.append(offset)
            offset += len(line)
    if not offsets:
        raise ConfigError(f"{flag} {path}: holds no conversations")
    _INDEXED[key] = np.array(offsets, dtype=np.int64)
    return _INDEXED[key]


def _record_mistake(line: bytes, masks: bool) -> str | None:
    try:
        record = json.loads(line)
    except UnicodeDecodeError as error:
        return f"not UTF-8 text ({error.reason})"
    except json.JSONDecodeError as error:
        return f"not JSON ({error.msg}); give one JSON object a line (JSON Lines)"
    if not isinstance(record, dict) or "messages" not in record:
        return 'needs "messages": [{"role": ..., "content": ...}, ...]'
    return message_mistake(record["messages"], masks)


class Conversations:
    """A checked JSONL file's records' messages, by record number."""

    def __init__(self, path: str, offsets: np.ndarray) -> None:
        self.path, self.offsets = path, offsets

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> list[dict]:
        with open(self.path, "rb") as f:  # (opened per read: DataLoader workers fork)
            f.seek(int(self.offsets[index]))
            return json.loads(f.readline())["messages"]

    def where(self, index: int) -> str:
        """`PATH:LINE` of record `index` (blank lines are not records)."""
        with open(self.path, "rb") as f:
            line = f.read(int(self.offsets[index])).count(b"\n") + 1
        return f"{self.path}:{line}"
