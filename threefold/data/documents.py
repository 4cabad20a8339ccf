"""Reading documents from JSONL (one JSON object per line) or plain text (one per line)."""

from __future__ import annotations

import json
from collections.abc import Iterator


def read_documents(path: str, json_keys: list[str]) -> Iterator[dict[str, str]]:
    """Yields {key: text} per document, streaming; plain-text files give their lines as 'text'."""
    is_json = path.endswith((".json", ".jsonl"))
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if not is_json:
                yield {key: line.rstrip("\n") for key in json_keys}
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({error.msg})") from None
            missing = [key for key in json_keys if key not in record]
            if missing:
                raise ValueError(f"{path}:{line_number}: no key {missing[0]!r}; "
                                 "set --json-keys to the field holding the text")
            yield {key: record[key] for key in json_keys}
