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
"""

from __future__ import annotations

import pickle
import struct
import zipfile
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
_CONTAINERS = {
    ("collections", "OrderedDict"): dict,
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


def _number(tensor: Opaque, archive: zipfile.ZipFile, prefix: str) -> Any:
    """A one-element tensor's value from its storage's bytes; else the tensor's record."""
    if tensor.name != "torch._utils._rebuild_tensor_v2" or len(tensor.args) < 3:
        return tensor
    storage, offset, size = tensor.args[:3]
    fmt = _STORAGE_FORMATS.get(getattr(storage, "kind", None))
    if fmt is None or not isinstance(size, tuple) or any(d != 1 for d in size):
        return tensor
    width = 2 if fmt == "bf16" else struct.calcsize(fmt)
    with archive.open(f"{prefix}data/{storage.key}") as f:
        raw = f.read()[offset * width : (offset + 1) * width]
    if fmt == "bf16":
        return struct.unpack("<f", b"\x00\x00" + raw)[0]
    return struct.unpack(fmt, raw)[0]


def _plain(value: Any, archive: zipfile.ZipFile, prefix: str) -> Any:
    if isinstance(value, _Namespace):
        return {k: _plain(v, archive, prefix) for k, v in vars(value).items()}
    if isinstance(value, dict):
        return {k: _plain(v, archive, prefix) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v, archive, prefix) for v in value)
    if isinstance(value, Opaque):
        return _number(value, archive, prefix)
    return value


def read_common(path: str) -> dict:
    """The dict `common.pt` holds, as plain data (`args` a dict of Megatron's argument names)."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
            if len(pickles) != 1:
                raise ConfigError(f"{path}: not a torch.save file (no data.pkl)")
            with archive.open(pickles[0]) as f:
                value = _Unpickler(f).load()
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{path}: holds a {type(value).__name__}, not Megatron's common dict"
                )
            return _plain(value, archive, pickles[0][: -len("data.pkl")])
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, OSError, KeyError) as error:
        raise ConfigError(f"{path}: unreadable ({error}); the checkpoint is damaged") from None
