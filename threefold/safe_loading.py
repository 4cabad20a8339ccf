"""Reading files a user may have downloaded without running code hidden in them.

Python's pickle runs whatever a file tells it to, and three kinds of file threefold reads are
pickles or may be: torch.distributed.checkpoint's `.metadata` (plain `pickle.load` in
torch), the per-rank RNG files (`torch.save`), and megatron-core's cached dataset indices
(`numpy.load(allow_pickle=True)`). Each is read here under an allow-list:

    .metadata         an unpickler that builds only DCP's metadata dataclasses, torch.Size,
                      dtypes, paths and members of DCP's enums (`SafeFileSystemReader`, used
                      for every DCP load)
    rng/rank_*.pt     `torch.load(weights_only=True)`: tensors, numbers, strings, containers
                      (and numpy's array reconstruction, for RNG files of older threefold)
    cache/*.npy       the header must be numpy's, with a plain numeric dtype: megatron-core
                      maps such a file (mmap) and never unpickles it

A file that needs anything else is refused with `UnsafeFileError`, one line naming it.
"""

from __future__ import annotations

import enum
import os
import pickle

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader

from threefold.config import ConfigError

# What DCP's metadata pickle may name, module by module (torch 2.5 to 2.13 write these).
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # megatron-core's torch_dist checkpoints also keep every rank's save plan (all_local_plans)
    "torch.distributed.checkpoint.planner": {
        "LoadItemType",
        "WriteItemType",
        "SavePlan",
        "WriteItem",
        "TensorWriteData",
    },
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class UnsafeFileError(ConfigError):
    """A file that would need to run code (or is not the kind it claims to be): refused in
    one line, like any other bad input."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("builtins", "getattr"):
            return self._enum_member
        raise self._refused(f"{module}.{name}")

    def _enum_member(self, cls, name):
        """What `builtins.getattr` may do here: Python 3.11 pickles an enum member as
        `getattr(its class, its name)`, which DCP's metadata holds wherever torch leaves the
        enum's default (torch before 2.13: `_MEM_FORMAT_ENCODING`; every version's save-plan
        item types). Only a member of an allow-listed enum is looked up."""
        members = getattr(cls, "__members__", None) if isinstance(cls, enum.EnumMeta) else None
        if members is None or not isinstance(name, str) or name not in members:
            raise self._refused(f"getattr({getattr(cls, '__name__', type(cls).__name__)}, ...)")
        return members[name]

    def _refused(self, what: str) -> UnsafeFileError:
        return UnsafeFileError(
            f"{self.path}: refused to load: it asks to run {what}, "
            "which a checkpoint's metadata never needs (a tampered file?)"
        )


def load_dcp_metadata(path: str):
    """torch.distributed.checkpoint's Metadata from a `.metadata` file, unpickled under the
    allow-list."""
    with open(path, "rb") as f:
        try:
            return _MetadataUnpickler(f, path).load()
        except UnsafeFileError:
            raise
        except Exception as error:  # truncated or not a pickle at all
            raise UnsafeFileError(
                f"{path}: not a readable checkpoint index ({type(error).__name__}: {error})"
            ) from None


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader with the metadata read through the allow-list (tensor data is
    read by torch with `weights_only=True` already). One reader unpickles `.metadata` once:
    loading a parameter at a time (checkpoint/resharding.py) reuses it for every `dcp.load`,
    which otherwise read the whole index again per parameter (a 48-layer model's resharded
    load: 39 s that way, 0.6 s this way; bench/results/checkpoint_load.md)."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        cache = self.__dict__.setdefault("_threefold_metadata", {})
        rank = kwargs.get("rank")
        if rank not in cache:
            cache[rank] = load_dcp_metadata(os.fspath(self._get_metadata_path(rank)))
        metadata = cache[rank]
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _numpy_reconstruction() -> list:
    """What an ndarray's pickle names (RNG files of older threefold held numpy's state)."""
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_tensors_file(path: str) -> dict:
    """A `torch.save`d dict of tensors, numbers and strings, loaded without running code."""
    try:
        with torch.serialization.safe_globals(_numpy_reconstruction()):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else "unpickling"
        raise UnsafeFileError(
            f"{path}: refused to load: it holds more than tensors and numbers ({first[:160]})"
        ) from None
    except (RuntimeError, EOFError, OSError) as error:
        raise UnsafeFileError(f"{path}: not a readable state file ({error})") from None


def check_npy_file(path: str) -> None:
    """Refuse a cached index that numpy would unpickle rather than map: not a `.npy` file at
    all (numpy.load with allow_pickle unpickles anything else) or one with Python objects."""
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            header = (
                np.lib.format.read_array_header_1_0(f)
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0(f)
            )
        except ValueError:
            raise UnsafeFileError(
                f"{path}: refused: not a numpy .npy file (megatron-core would "
                "unpickle it); delete it so the cache is rebuilt"
            ) from None
    if header[2].hasobject:
        raise UnsafeFileError(
            f"{path}: refused: holds Python objects (megatron-core would "
            "unpickle them); delete it so the cache is rebuilt"
        )


def check_npy_cache(directory: str) -> None:
    """Every `.npy` file megatron-core may load from a dataset index cache directory."""
    if not os.path.isdir(directory):
        return
    for name in sorted(os.listdir(directory)):
        if name.endswith(".npy"):
            check_npy_file(os.path.join(directory, name))
