"""Megatron-LM's `common.pt` read without running code and without torch.

megatron-core's torch_dist checkpoints keep everything that is not a sharded tensor — the run's
`args` (an argparse.Namespace), `iteration`, `checkpoint_version`, the LR scheduler's state —
in `iter_N/common.pt`, a `torch.save` pickle. Unpickling it with torch would call whatever the
file names (`torch.load(weights_only=False)` is what Megatron-LM does). Here a restricted
unpickler builds plain data only: dicts, lists, numbers, strings; a Namespace becomes a dict;
a torch dtype becomes its name; a one-element tensor (an optimizer's step, a loss scale)
becomes its number, decoded from its bytes; every other global the file names (enums of
Megatron's, larger tensors, devices, functions) becomes an inert `Opaque` record of its name and
arguments, never the real object, so nothing named in the file is ever called.

Megatron-LM's legacy checkpoints (`model_optim_rng.pt`, checkpoint/megatron/legacy.py) are the
same kind of file with the model's tensors in it: read with `tensors`, every tensor becomes a
`StoredTensor` record of where its bytes lie, which `load` turns into a tensor built from those
bytes by torch itself (never by a function the file names).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

from threefold.config import ConfigError

_DTYPES = {
    "float32",
    "float",
    "float16",
    "half",
    "bfloat16",
    "float64",
    "double",
    "int64",
    "int32",
    "int8",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
}
COMMON = "common.pt"
EMBEDDED_COMMON = "common_state/"  # megatron-core 0.19's sharded object of the common state
# A storage's element type -> struct format (bfloat16: the high half of a float32).
_STORAGE_FORMATS = {
    "FloatStorage": "<f",
    "DoubleStorage": "<d",
    "HalfStorage": "<e",
    "BFloat16Storage": "bf16",
    "LongStorage": "<q",
    "IntStorage": "<i",
    "ShortStorage": "<h",
    "CharStorage": "<b",
    "ByteStorage": "<B",
    "BoolStorage": "<?",
}
# A storage's element type -> the torch dtype its bytes are read as (legacy checkpoints).
_STORAGE_DTYPES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}
_REBUILD_TENSOR = "torch._utils._rebuild_tensor_v2"
# a parameter (with Python attributes: `_with_state`), its data rebuilt inside
_REBUILD_PARAMETERS = (
    "torch._utils._rebuild_parameter",
    "torch._utils._rebuild_parameter_with_state",
)
# a tensor with Python attributes (megatron-core's fp32 masters keep their TP marks): the
# function that rebuilds the tensor, its type, that function's arguments, the attributes
_REBUILD_FROM_TYPE = "torch._tensor._rebuild_from_type_v2"


class _OrderedDict(dict):
    """collections.OrderedDict's stand-in: the attributes pickled with one (a module state
    dict's `_metadata`) are dropped."""

    def __setstate__(self, state: Any) -> None:
        pass


_CONTAINERS = {
    ("collections", "OrderedDict"): _OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


class Opaque:
    """Stands for an object the file names but that is never built: `name` is the global the
    file asked for, `args` and `state` what it would have been built from."""

    name = "?"

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state = None

    def __new__(cls, *args: Any):  # NEWOBJ passes the arguments here too
        return super().__new__(cls)

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.name}{self.args!r}>"

    @property
    def value(self) -> Any:
        """An enum member's value (the one argument it is pickled with)."""
        return self.args[0] if len(self.args) == 1 else None


class _Namespace:
    """argparse.Namespace's stand-in: its attributes are restored by pickle's BUILD."""


class _Storage:
    """A tensor storage the file refers to: its element type and the archive entry of its
    bytes (read only for one-element tensors)."""

    def __init__(self, kind: str, key: str) -> None:
        self.kind, self.key = kind, key


class _Unpickler(pickle.Unpickler):
    def __init__(self, file) -> None:
        super().__init__(file)
        self._opaque: dict[str, type] = {}

    def find_class(self, module: str, name: str):
        if (module, name) == ("argparse", "Namespace"):
            return _Namespace
        if (module, name) in _CONTAINERS:
            return _CONTAINERS[(module, name)]
        if module == "torch" and name in _DTYPES:
            return name
        key = f"{module}.{name}"
        if key not in self._opaque:
            self._opaque[key] = type(name, (Opaque,), {"name": key})
        return self._opaque[key]

    def persistent_load(self, pid):
        # torch.save's ('storage', storage type, key, location, numel)
        if isinstance(pid, tuple) and len(pid) >= 3 and isinstance(pid[1], type):
            return _Storage(getattr(pid[1], "name", "").rsplit(".", 1)[-1], str(pid[2]))
        return None


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of a torch.save file, not yet read: the archive entry of its storage's bytes,
    their element type, and the tensor's view into them."""

    entry: str
    kind: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def load(self, archive: zipfile.ZipFile, source: str):
        """The tensor, built from its bytes in `archive` (the file `source` names)."""
        import torch

        dtype = _STORAGE_DTYPES.get(self.kind)
        if dtype is None:
            raise ConfigError(f"{source}: a tensor of {self.kind}, which threefold does not read")
        try:
            raw = bytearray(archive.read(self.entry))
        except (KeyError, zipfile.BadZipFile, OSError) as error:
            raise ConfigError(f"{source}: unreadable ({error}); it is damaged") from None
        dtype = getattr(torch, dtype)
        if any(n == 0 for n in self.shape):
            return torch.empty(self.shape, dtype=dtype)
        width = torch.empty((), dtype=dtype).element_size()
        last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        if (
            len(raw) % width
            or self.offset < 0
            or any(s < 0 for s in self.stride)
            or last >= len(raw) // width
        ):  # (torch.frombuffer would raise on a length that is no multiple of the element)
            raise ConfigError(f"{source}: a tensor reaches past its storage; it is damaged")
        flat = torch.frombuffer(raw, dtype=dtype)
        return flat.as_strided(self.shape, self.stride, self.offset).clone()

    def load_range(self, archive: zipfile.ZipFile, source: str, start: int, count: int):
        """Elements [start, start + count) of a flat tensor, read at their place in the file
        (torch.save stores its entries uncompressed), not with the rest of the tensor."""
        import torch

        dtype = getattr(torch, _STORAGE_DTYPES.get(self.kind, "float32"))
        width = torch.empty((), dtype=dtype).element_size()
        info = archive.getinfo(self.entry)
        first = self.offset + start
        if (
            self.kind not in _STORAGE_DTYPES
            or len(self.shape) != 1
            or self.stride != (1,)
            or info.compress_type != zipfile.ZIP_STORED
            or start < 0
            or start + count > self.shape[0]
            or (first + count) * width > info.file_size
        ):
            raise ConfigError(f"{source}: {self.entry} is not the flat buffer it should be")
        with open(archive.filename, "rb") as f:
            f.seek(info.header_offset)
            header = f.read(30)  # the entry's local header: its name and extra field follow
            if header[:4] != b"PK\x03\x04":
                raise ConfigError(f"{source}: unreadable entry {self.entry}; it is damaged")
            name_length, extra_length = struct.unpack("<HH", header[26:30])
            f.seek(info.header_offset + 30 + name_length + extra_length + first * width)
            raw = f.read(count * width)
        if len(raw) != count * width:
            raise ConfigError(f"{source}: {self.entry} is cut short; it is damaged")
        return torch.frombuffer(bytearray(raw), dtype=dtype) if count else torch.empty(0)


def _rebuilt(tensor: Opaque) -> tuple | None:
    """The arguments `_rebuild_tensor_v2` would rebuild a tensor's record from (a parameter's
    data, a tensor's with Python attributes, which are dropped); None for another object."""
    args = tensor.args
    if tensor.name in _REBUILD_PARAMETERS and args and isinstance(args[0], Opaque):
        return _rebuilt(args[0])
    if tensor.name == _REBUILD_FROM_TYPE and len(args) >= 3 and isinstance(args[2], tuple):
        return args[2] if getattr(args[0], "name", None) == _REBUILD_TENSOR else None
    return args if tensor.name == _REBUILD_TENSOR else None


def _stored(tensor: Opaque, prefix: str) -> Any:
    """A tensor's record; else the object's record as it is."""
    args = _rebuilt(tensor)
    if args is None or len(args) < 4 or not isinstance(args[0], _Storage):
        return tensor
    storage, offset, shape, stride = args[:4]
    if not (
        isinstance(offset, int)
        and isinstance(shape, tuple)
        and isinstance(stride, tuple)
        and len(shape) == len(stride)
        and all(isinstance(n, int) for n in shape + stride)
    ):
        return tensor
    return StoredTensor(f"{prefix}data/{storage.key}", storage.kind, offset, shape, stride)


def _number(tensor: Opaque, archive: zipfile.ZipFile, prefix: str) -> Any:
    """A one-element tensor's value from its storage's bytes; else the tensor's record."""
    args = _rebuilt(tensor)
    if args is None or len(args) < 3:
        return tensor
    storage, offset, size = args[:3]
    fmt = _STORAGE_FORMATS.get(getattr(storage, "kind", None))
    if fmt is None or not isinstance(size, tuple) or any(d != 1 for d in size):
        return tensor
    width = 2 if fmt == "bf16" else struct.calcsize(fmt)
    with archive.open(f"{prefix}data/{storage.key}") as f:
        raw = f.read()[offset * width : (offset + 1) * width]
    if fmt == "bf16":
        return struct.unpack("<f", b"\x00\x00" + raw)[0]
    return struct.unpack(fmt, raw)[0]


def _plain(value: Any, archive: zipfile.ZipFile, prefix: str, tensors: bool) -> Any:
    if isinstance(value, _Namespace):
        return {k: _plain(v, archive, prefix, tensors) for k, v in vars(value).items()}
    if isinstance(value, dict):
        return {k: _plain(v, archive, prefix, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v, archive, prefix, tensors) for v in value)
    if isinstance(value, Opaque):
        return _stored(value, prefix) if tensors else _number(value, archive, prefix)
    return value


def read_torch_file(path: str, tensors: bool = False, data: bytes | None = None) -> dict | list:
    """The dict (or list) a torch.save file holds, as plain data (a Namespace as a dict); its
    tensors as `StoredTensor` records (`tensors`), else as numbers where they hold one
    element. `data`: the file's bytes, where they lie inside another file (`path` then names
    where, for the messages)."""
    try:
        with zipfile.ZipFile(path if data is None else io.BytesIO(data)) as archive:
            names = archive.namelist()
            pickles = [n for n in names if n.endswith("data.pkl")]
            if len(pickles) != 1:
                raise ConfigError(f"{path}: not a torch.save file (no data.pkl)")
            prefix = pickles[0][: -len("data.pkl")]
            if f"{prefix}byteorder" in names and (
                archive.read(f"{prefix}byteorder").strip() != b"little"
            ):
                raise ConfigError(f"{path}: saved on a big-endian machine; threefold reads none")
            with archive.open(pickles[0]) as f:
                value = _Unpickler(f).load()
            if not isinstance(value, (dict, list)):
                raise ConfigError(f"{path}: holds a {type(value).__name__}, not a dict")
            return _plain(value, archive, prefix, tensors)
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, OSError, KeyError) as error:
        raise ConfigError(f"{path}: unreadable ({error}); the checkpoint is damaged") from None
    except (TypeError, ValueError, AttributeError, IndexError) as error:  # a crafted pickle
        raise ConfigError(f"{path}: not a checkpoint pickle ({error}); it is damaged") from None


def read_common(directory: str) -> dict:
    """A torch_dist checkpoint's common state (`directory`: its iter_N), as plain data (`args`
    a dict of Megatron's argument names): `common.pt`'s dict, or where megatron-core 0.19 and
    later keep it, the `common_state` object among the sharded tensors (`embedded_common`)."""
    path = os.path.join(directory, COMMON)
    if not os.path.isfile(path):
        return embedded_common(directory)
    common = read_torch_file(path)
    if not isinstance(common, dict):
        raise ConfigError(f"{path}: holds a list, not Megatron's common dict")
    return common


def embedded_common(directory: str) -> dict:
    """megatron-core 0.19's common state (July 2026; it reads common.pt still): one sharded
    object, `common_state/shard_0_1`, a torch.save of [the dict] stored as bytes in one of the
    .distcp files, where the DCP `.metadata` says (its file, offset and length). `.metadata` is
    a pickle too: read by the same restricted unpickler, its records only looked into."""
    incomplete = ConfigError(
        f"--load {directory}: holds neither {COMMON} nor megatron-core's embedded common state; "
        "the checkpoint is incomplete"
    )
    try:
        with open(os.path.join(directory, ".metadata"), "rb") as f:
            metadata = _Unpickler(f).load()
    except FileNotFoundError:
        raise incomplete from None
    except (OSError, pickle.UnpicklingError, EOFError, TypeError, ValueError) as error:
        raise ConfigError(f"--load {directory}: .metadata is unreadable ({error})") from None
    storage = (getattr(metadata, "state", None) or {}).get("storage_data")
    for index, info in storage.items() if isinstance(storage, dict) else ():
        fqn = (getattr(index, "state", None) or {}).get("fqn")
        if isinstance(fqn, str) and fqn.startswith(EMBEDDED_COMMON):
            return _embedded(directory, getattr(info, "state", None) or {})
    raise incomplete


def _embedded(directory: str, where: dict) -> dict:
    """The common dict from the bytes `where` (a DCP _StorageInfo's state) points at."""
    name, offset, length = (where.get(k) for k in ("relative_path", "offset", "length"))
    if not (
        isinstance(name, str)
        and name == os.path.basename(name)  # (a file of this directory, nowhere else)
        and isinstance(offset, int)
        and isinstance(length, int)
        and not where.get("transform_descriptors")  # (stored as written: not compressed)
    ):
        raise ConfigError(f"--load {directory}: .metadata places its common state at {where!r}")
    try:
        with open(os.path.join(directory, name), "rb") as f:
            f.seek(offset)
            data = f.read(length)
    except OSError as error:
        raise ConfigError(f"--load {directory}: {name} is unreadable ({error})") from None
    common = read_torch_file(os.path.join(directory, name), data=data)
    if not (isinstance(common, list) and len(common) == 1 and isinstance(common[0], dict)):
        raise ConfigError(f"--load {directory}: its common state is not Megatron's; it is damaged")
    return common[0]
