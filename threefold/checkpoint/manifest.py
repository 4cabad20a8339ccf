"""Which checkpoint directories are complete, and whether their bytes are still the ones written.

A save is written into `iter_NNNNNNN.partial/` and renamed to `iter_NNNNNNN/` only after every
rank has finished and `manifest.json` (the size and SHA-256 of every file in it) is written, so
a directory named `iter_NNNNNNN` with a manifest is complete. Ranks digest (and at load,
verify) disjoint slices of the sorted file list, so the work spreads over the ranks.

    DIR/iter_0000100/manifest.json    {"files": {"__0_0.distcp": [size, sha256], ...}}

Megatron-LM's checkpoints carry their own list when saved with `--verify-integrity`
(megatron-core's `dist_checkpointing.validation.save_integrity_manifest`): the SHA-256 of each
file directly in the directory, without sizes. threefold verifies it as it verifies its own,
and writes it into the checkpoints it exports to Megatron-LM.

    DIR/iter_0000100/integrity.json   {"algorithm": "sha256", "files": {"common.pt": sha256, ...}}
"""

from __future__ import annotations

import hashlib
import json
import os
import re

MANIFEST = "manifest.json"
INTEGRITY = "integrity.json"  # Megatron-LM's
PARTIAL = ".partial"  # a save in progress (or abandoned by a crash)
REPLACED = ".replaced"  # an older save of the same iteration, kept until the new one is in
_ITERATION = re.compile(r"^iter_(\d{7})$")


def checkpoint_files(path: str) -> list[str]:
    """Every file under a checkpoint directory (relative, sorted), the manifest excepted."""
    files = []
    for directory, _, names in os.walk(path):
        for name in names:
            relative = os.path.relpath(os.path.join(directory, name), path)
            if relative != MANIFEST:
                files.append(relative)
    return sorted(files)


def digest(path: str) -> list:
    """[size in bytes, SHA-256] of a file."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            sha.update(chunk)
        return [f.tell(), sha.hexdigest()]


def my_slice(files: list[str], rank: int, world_size: int) -> list[str]:
    return files[rank::world_size]


def write_manifest(path: str, digests: dict[str, list]) -> None:
    from threefold.written_aside import write_atomically

    write_atomically(
        os.path.join(path, MANIFEST), json.dumps({"files": dict(sorted(digests.items()))}, indent=1)
    )


def read_manifest(path: str) -> dict[str, list] | None:
    """The manifest's {file: [size, sha256]}, or None when the directory has none (a
    checkpoint written before threefold kept manifests) or it is unreadable."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return files if isinstance(files, dict) else None


def write_integrity(path: str, digests: dict[str, list] | None = None) -> None:
    """Megatron-LM's integrity.json for the files directly in `path` (a Megatron checkpoint
    being written), from their `digests` ({file: [size, sha256]}) where known."""
    from threefold.written_aside import write_atomically

    names = sorted(
        name
        for name in os.listdir(path)
        if name not in (INTEGRITY, MANIFEST) and os.path.isfile(os.path.join(path, name))
    )
    digests = digests or {}
    files = {name: (digests.get(name) or digest(os.path.join(path, name)))[1] for name in names}
    write_atomically(
        os.path.join(path, INTEGRITY), json.dumps({"algorithm": "sha256", "files": files}, indent=2)
    )


def read_integrity(path: str) -> dict[str, list] | None:
    """Megatron-LM's integrity.json as a manifest ({file: [None, sha256]}: no sizes), or None
    when the directory has none or it is unreadable or not SHA-256."""
    try:
        with open(os.path.join(path, INTEGRITY)) as f:
            data = json.load(f)
        files = data["files"]
        if data.get("algorithm", "sha256") != "sha256" or not isinstance(files, dict):
            return None
        return {name: [None, str(sha)] for name, sha in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def verify_slice(
    path: str, manifest: dict[str, list], rank: int = 0, world_size: int = 1, contents: bool = True
) -> str | None:
    """None when every file of the manifest is there and (`contents`) this rank's slice of them
    has the sizes and SHA-256s written; else what is wrong."""
    present = checkpoint_files(path)
    missing = sorted(set(manifest) - set(present))
    if missing:
        return f"{missing[0]} is missing"
    if not contents:
        return None
    for name in my_slice(sorted(manifest), rank, world_size):
        full = os.path.join(path, name)
        size, sha = manifest[name]
        actual_size = os.path.getsize(full)
        if size is not None and actual_size != size:
            return f"{name} has {actual_size} bytes, {size} were written"
        if digest(full)[1] != sha:
            return f"{name} does not match its checksum (corrupted after it was written)"
    return None


def iterations(root: str) -> list[int]:
    """Iterations under `root` that have a directory (complete or not), newest first."""
    if not os.path.isdir(root):
        return []
    return sorted(
        (int(m.group(1)) for m in map(_ITERATION.match, os.listdir(root)) if m), reverse=True
    )


def complete_iterations(root: str) -> list[int]:
    """Iterations under `root` whose directory is complete (has a manifest), newest first."""
    return [
        i for i in iterations(root) if os.path.isfile(os.path.join(root, f"iter_{i:07d}", MANIFEST))
    ]


def has_iteration_directories(root: str) -> bool:
    return os.path.isdir(root) and any(map(_ITERATION.match, os.listdir(root)))
