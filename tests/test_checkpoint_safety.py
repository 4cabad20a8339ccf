"""Loading a checkpoint or a dataset cache never runs code planted in it.

Each test plants a pickle payload that would create a marker file (and, as a real attacker
would, rewrites the manifest's checksum so the file verifies), then runs every entry point that
reads that kind of file: each refuses in one line with exit code 2, and the marker never
appears. The restricted readers themselves are checked directly too.
"""

import enum
import json
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.concurrent_runs import run_together
from tests.conftest import ROOT, TINY_MODEL
from threefold.checkpoint.manifest import MANIFEST, digest
from threefold.config import ConfigError
from threefold.safe_loading import (
    UnsafeFileError,
    check_npy_file,
    load_dcp_metadata,
    load_tensors_file,
)

TINY = TINY_MODEL + "--global-batch-size 4 --eval-iters 0 --log-interval 1 --lr 1e-3".split()


class Payload:
    """Unpickling this creates `marker` (what any code an attacker chose could do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def _refused_in_one_line(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr[-3000:]
    for word in words:
        assert word in errors[0], errors[0]


@pytest.fixture(scope="module")
def good_checkpoint(shakespeare_data, tmp_path_factory) -> str:
    """A 2-iteration run on the tokenized default corpus, saved with its tokenizer."""
    directory = str(tmp_path_factory.mktemp("good") / "run")
    result = _run(
        os.path.join(ROOT, "pretrain_gpt.py"),
        *TINY,
        "--train-iters",
        "2",
        "--data-path",
        shakespeare_data["DATA_PATH"],
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        shakespeare_data["TOKENIZER_MODEL"],
        "--split",
        "98,1,1",
        "--save",
        directory,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return directory


def _planted(good: str, tmp_path, relative: str, content: bytes) -> str:
    """A copy of the checkpoint with `relative` (in iteration 2) replaced, the manifest
    updated to match."""
    root = str(tmp_path / "planted")
    shutil.copytree(good, root)
    path = os.path.join(root, "iter_0000002")
    with open(os.path.join(path, relative), "wb") as f:
        f.write(content)
    manifest_path = os.path.join(path, MANIFEST)
    manifest = json.load(open(manifest_path))
    manifest["files"][relative] = digest(os.path.join(path, relative))
    json.dump(manifest, open(manifest_path, "w"))
    return root


def _entry_points(root: str, tmp_path, shakespeare_data) -> dict[str, list[str]]:
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"prompt": "To be", "response": " or not"}) + "\n")
    return {
        "pretrain_gpt.py": [
            os.path.join(ROOT, "pretrain_gpt.py"),
            *TINY,
            "--train-iters",
            "3",
            "--lr-decay-iters",  # (the checkpoint's: a resumed run keeps its schedule)
            "2",
            "--data-path",
            shakespeare_data["DATA_PATH"],
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            shakespeare_data["TOKENIZER_MODEL"],
            "--split",
            "98,1,1",
            "--load",
            root,
        ],
        "finetune.py": [
            os.path.join(ROOT, "finetune.py"),
            "--load",
            root,
            "--train-data-path",
            str(sft),
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "1",
            "--train-iters",
            "1",
            "--eval-iters",
            "0",
            "--no-load-optim",
        ],
        "generate.py": [
            os.path.join(ROOT, "tools", "generate.py"),
            "--load",
            root,
            "--prompt",
            "To be",
            "--max-new-tokens",
            "2",
        ],
        "convert_checkpoint.py": [
            os.path.join(ROOT, "tools", "convert_checkpoint.py"),
            "--loader",
            "threefold",
            "--saver",
            "hf",
            "--load-dir",
            root,
            "--save-dir",
            str(tmp_path / "hf"),
        ],
    }


@pytest.mark.parametrize("kind", ["dcp-metadata", "rng"])
def test_a_planted_pickle_in_a_checkpoint_never_runs(
    kind, good_checkpoint, tmp_path, shakespeare_data
):
    marker = str(tmp_path / "marker")
    if kind == "dcp-metadata":
        relative, content = ".metadata", pickle.dumps(Payload(marker))
        readers = ["pretrain_gpt.py", "finetune.py", "generate.py", "convert_checkpoint.py"]
    else:  # only a resumed run reads the RNG streams (finetune.py starts fresh ones)
        buffer = __import__("io").BytesIO()
        torch.save({"python": Payload(marker)}, buffer)
        relative, content = "rng/rank_00000.pt", buffer.getvalue()
        readers = ["pretrain_gpt.py"]
    root = _planted(good_checkpoint, tmp_path, relative, content)
    commands = _entry_points(root, tmp_path, shakespeare_data)
    for result in run_together(_run, {name: commands[name] for name in readers}).values():
        _refused_in_one_line(result, relative.split("/")[-1], "refused")
    assert not os.path.exists(marker), f"one of {readers} ran the payload"


def test_a_hostile_metadata_json_is_refused_in_one_line(
    good_checkpoint, tmp_path, shakespeare_data
):
    """metadata.json is JSON (it cannot carry code); one that is not a threefold checkpoint's
    is refused by every reader without a traceback."""
    root = _planted(
        good_checkpoint,
        tmp_path,
        "metadata.json",
        json.dumps({"config": "__import__('os').system('touch x')"}).encode(),
    )
    for result in run_together(_run, _entry_points(root, tmp_path, shakespeare_data)).values():
        _refused_in_one_line(result, "metadata.json")


def test_a_crafted_megatron_checkpoint_in_its_legacy_pickle_format_runs_nothing(
    tmp_path, shakespeare_data
):
    """Megatron-LM's --ckpt-format torch is one pickled model_optim_rng.pt per model-parallel
    rank, which Megatron-LM unpickles with torch.load(weights_only=False): threefold reads it
    with a restricted unpickler (checkpoint/megatron/legacy.py), so one whose args and weights
    are objects that would run code runs nothing and is refused by name in one line."""
    marker = str(tmp_path / "marker")
    root = tmp_path / "megatron"
    (root / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    crafted = {"args": Payload(marker), "iteration": 1, "model": {"w": Payload(marker)}}
    torch.save(crafted, root / "iter_0000001/mp_rank_00/model_optim_rng.pt")
    commands = _entry_points(str(root), tmp_path, shakespeare_data)
    convert = commands["convert_checkpoint.py"]
    convert[convert.index("--loader") + 1] = "megatron"
    for name, result in run_together(_run, commands).items():
        _refused_in_one_line(result, "model_optim_rng.pt has no Megatron-LM args")
        flag = "--load-dir" if name == "convert_checkpoint.py" else "--load"
        assert f"error: {flag} {root}: " in result.stderr, result.stderr[-2000:]
    assert not os.path.exists(marker)


def test_a_planted_dataset_index_cache_never_runs(shakespeare_data, tmp_path):
    """megatron-core loads its cached indices with numpy.load(allow_pickle=True): a pickle
    planted under a cached index's name is refused before megatron-core sees it."""
    cache, marker = tmp_path / "cache", str(tmp_path / "marker")
    argv = [
        os.path.join(ROOT, "pretrain_gpt.py"),
        *TINY,
        "--train-iters",
        "1",
        "--data-path",
        shakespeare_data["DATA_PATH"],
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        shakespeare_data["TOKENIZER_MODEL"],
        "--split",
        "98,1,1",
        "--data-cache-path",
        str(cache),
    ]
    assert _run(*argv).returncode == 0  # builds the cache
    (victim,) = [p for p in os.listdir(cache) if p.endswith("train-document_index.npy")]
    (cache / victim).write_bytes(pickle.dumps(Payload(marker)))
    _refused_in_one_line(_run(*argv), victim, "not a numpy .npy file")
    assert not os.path.exists(marker)


def test_the_restricted_readers(tmp_path):
    marker = str(tmp_path / "marker")
    evil = tmp_path / "evil"
    evil.write_bytes(pickle.dumps(Payload(marker)))
    for load in (load_dcp_metadata, load_tensors_file, check_npy_file):
        with pytest.raises(UnsafeFileError, match="refused|not a readable"):
            load(str(evil))
    assert not os.path.exists(marker)
    assert issubclass(UnsafeFileError, ConfigError)  # entry points print it in one line
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(UnsafeFileError, match="Python objects"):
        check_npy_file(str(tmp_path / "objects.npy"))
    np.save(tmp_path / "plain.npy", np.arange(5))
    check_npy_file(str(tmp_path / "plain.npy"))
    # A legacy RNG file (numpy's state as an ndarray) still loads.
    torch.save({"numpy": np.random.get_state()}, tmp_path / "legacy.pt")
    assert load_tensors_file(str(tmp_path / "legacy.pt"))["numpy"][0] == "MT19937"


class _EnumsByName(pickle.Pickler):
    """Pickles enum members as Python 3.11's Enum does by default: `getattr(class, name)` (DCP's
    metadata under torch before 2.13, whose memory-format enum kept that default). `planted`:
    also `getattr` of one object, not an enum, with an attribute of its own."""

    def __init__(self, file, planted=None) -> None:
        super().__init__(file)
        self.planted = planted

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        if self.planted is not None and obj is self.planted[0]:
            return getattr, self.planted[1]
        return NotImplemented


def test_dcp_metadata_with_enum_members_by_name(tmp_path):
    """Such metadata loads, each member looked up in its allow-listed enum; a `getattr` of
    anything but an enum member is refused (an attacker's way to a method of an allowed
    class)."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))
    tensor = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([4]), [chunk])
    metadata = Metadata(state_dict_metadata={"weight": tensor})
    path = tmp_path / ".metadata"
    with open(path, "wb") as f:
        _EnumsByName(f).dump(metadata)
    assert b"getattr" in path.read_bytes()
    loaded = load_dcp_metadata(str(path)).state_dict_metadata["weight"]
    assert loaded.properties.memory_format == torch.contiguous_format
    assert loaded.properties.dtype == torch.bfloat16 and loaded.size == torch.Size([4])
    for attribute in ((TensorProperties, "__init__"), (type(chunk), "__class__")):
        with open(path, "wb") as f:
            _EnumsByName(f, planted=(chunk, attribute)).dump(metadata)
        with pytest.raises(UnsafeFileError, match="refused to load: it asks to run getattr"):
            load_dcp_metadata(str(path))
