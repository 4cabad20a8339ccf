"""Reading documents from JSONL (one JSON object per line) or plain text (one per line)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator


def read_documents(
    path: str, json_keys: list[str], on_bad_record: Callable[[str], None] | None = None
) -> Iterator[tuple[int, dict[str, str]]]:
    """Yields (line number, {key: text}) per document, streaming; plain-text files give their
    lines as 'text'. A bad record (not UTF-8, not JSON, a missing or non-text key) raises
    ValueError naming `path:line`, or with `on_bad_record` is reported to it and skipped."""
    is_json = path.endswith((".json", ".jsonl"))
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, 1):
            try:
                document = _parse(raw, is_json, json_keys)
            except ValueError as error:
                message = f"{path}:{line_number}: {error}"
                if on_bad_record is None:
                    raise ValueError(message) from None
                on_bad_record(message)
                continue
            if document is not None:
                yield line_number, document


def _parse(raw: bytes, is_json: bool, json_keys: list[str]) -> dict[str, str] | None:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"not UTF-8 text (byte {error.start})") from None
    if not line.strip():
        return None
    if not is_json:
        return {key: line.rstrip("\n") for key in json_keys}
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}, not an object with {json_keys[0]!r}")
    for key in json_keys:
        if key not in record:
            raise ValueError(f"no key {key!r}; set --json-keys to the field holding the text")
        if not isinstance(record[key], str):
            raise ValueError(f"{key!r} is {json.dumps(record[key])[:20]}, not text")
    return {key: record[key] for key in json_keys}
