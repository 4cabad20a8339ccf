"""Load a checkpoint saved at another TP/PP/DP layout (or with/without the distributed
optimizer) into this run's layout.

A checkpoint stores, per tensor-parallel rank r (an expert's: per expert-TP rank), each
parameter's TP shard under `model.tp{r}.{global name}` and its Adam state either whole
(`optimizer.{field}.tp{r}.{name}`) or, under the distributed optimizer, as pieces of the
flattened shard (`optimizer.{field}.tp{r}.{name}[start:end]`, one per data-parallel owner).
Names are the layout-independent ones, so a change of pipeline layout only changes which rank
loads what.

Each rank rebuilds the *full* tensor of every parameter it now holds — from all saved TP shards
(and DP pieces), with the vocabulary padding of the saved layout removed — and keeps its new
shard (and new pieces). Reads go through torch.distributed.checkpoint without collectives
(`no_dist=True`), one parameter at a time, so ranks holding different stages never wait on
each other and at most one full parameter is in memory at once. Under PyTorch DDP/FSDP2 the
fp32 parameters are the masters, and an FSDP2 shard (of a weight or of Adam's state) keeps its
own part of the rebuilt tensor (`copy_whole`).
"""

from __future__ import annotations

import re
import warnings
from collections import defaultdict

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from threefold.checkpoint.components import CheckpointComponents
from threefold.config import ConfigError
from threefold.model.lora import is_adapter
from threefold.parallel.data_parallel.torch_native import copy_whole
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.sharding import is_expert, shard_of, sharding_group, unshard
from threefold.safe_loading import SafeFileSystemReader

_KEY = re.compile(
    r"^(model|optimizer\.(exp_avg|exp_avg_sq|momentum_buffer|step|master))\.tp(\d+)\.(.+?)"
    r"(?:\[(\d+):(\d+)\])?$"
)
FIELDS = ("exp_avg", "exp_avg_sq", "momentum_buffer", "master")


class SavedTensors:
    """What a checkpoint directory holds, indexed by (kind, parameter name)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.reader = SafeFileSystemReader(path)  # one index read for every parameter
        metadata = self.reader.read_metadata().state_dict_metadata
        # (kind, name) -> {tp rank: [(start, end, key, shape)]}; start/end None for whole shards
        self.entries: dict[tuple[str, str], dict[int, list]] = defaultdict(
            lambda: defaultdict(list)
        )
        for key, meta in metadata.items():
            match = _KEY.match(key)
            if match is None or not hasattr(meta, "size"):
                continue
            kind = "model" if match.group(1) == "model" else match.group(2)
            start, end = match.group(5), match.group(6)
            self.entries[(kind, match.group(4))][int(match.group(3))].append(
                (
                    None if start is None else int(start),
                    None if end is None else int(end),
                    key,
                    tuple(meta.size),
                )
            )

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self.entries

    def _read(self, specs: list[tuple[str, tuple]]) -> dict[str, torch.Tensor]:
        tensors = {key: torch.empty(shape, dtype=torch.float32) for key, shape in specs}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(tensors, storage_reader=self.reader, no_dist=True)
        return tensors

    def full(self, kind: str, name: str, param: nn.Parameter, saved_tp: int) -> torch.Tensor:
        """The whole tensor of `kind` for a parameter, unpadded (valid rows only)."""
        per_rank = self.entries[(kind, name)]
        if is_expert(param):  # split over the saved expert-TP size, keyed by its ranks
            saved_tp = len(per_rank)
        if sorted(per_rank) != list(range(saved_tp)):
            raise ConfigError(
                f"checkpoint {self.path}: {kind} of {name} lacks some of the "
                f"{saved_tp} tensor-parallel shards"
            )
        shard_shapes = {
            r: spec[3] for r, specs in self.entries[("model", name)].items() for spec in specs
        }
        shards = []
        for rank in range(saved_tp):
            specs = sorted(per_rank[rank], key=lambda spec: spec[0] or 0)
            values = self._read([(spec[2], spec[3]) for spec in specs])
            if specs[0][0] is None:  # a whole shard
                shards.append(values[specs[0][2]])
            else:  # distributed-optimizer pieces of the flattened shard, in order
                flat = torch.cat([values[spec[2]].reshape(-1) for spec in specs])
                shards.append(flat.view(shard_shapes[rank]))
        full = unshard(shards, param) if saved_tp > 1 else shards[0]
        return unpadded(full, param, f"checkpoint {self.path}", f"{kind} of {name}")

    def step(self) -> torch.Tensor | None:
        for (kind, _), per_rank in self.entries.items():
            if kind == "step":
                spec = next(iter(per_rank.values()))[0]
                return self._read([(spec[2], spec[3])])[spec[2]]
        return None


def saved_tensors(path: str, megatron_step: float | None = None, optimizer: bool = False):
    """What a checkpoint directory holds: threefold's own shards, a Megatron-LM torch_dist
    checkpoint's stacked tensors (checkpoint/megatron/tensors.py; `megatron_step`: its Adam
    step from common.pt; `optimizer`: its optimizer state is to be read) or a legacy one's
    per-rank shards (checkpoint/megatron/legacy_tensors.py), behind one interface."""
    from threefold.checkpoint.megatron.format import is_megatron_checkpoint
    from threefold.checkpoint.megatron.legacy import is_legacy_checkpoint
    from threefold.checkpoint.megatron.legacy_tensors import LegacyTensors
    from threefold.checkpoint.megatron.tensors import MegatronTensors

    if is_megatron_checkpoint(path):
        return MegatronTensors(path, megatron_step, optimizer)
    if is_legacy_checkpoint(path):
        return LegacyTensors(path, optimizer)
    return SavedTensors(path)


def unpadded(full: torch.Tensor, param: nn.Parameter, source: str, what: str) -> torch.Tensor:
    """A whole tensor as stored, cut to the parameter's valid rows (a vocabulary's padding rows
    dropped: a checkpoint of another TP may pad it otherwise, even where this layout adds
    none). Any other difference from the parameter's shape means the checkpoint holds another
    model than the one built from what it says of itself: refused in one line, not cut or
    padded to fit."""
    if not param.dim() or param.valid_rows is None:
        return full
    whole = tuple(getattr(param, "master_shape", None) or param.shape)
    rows, vocabulary = param.valid_rows, getattr(param, "vocabulary_rows", False)
    if (
        tuple(full.shape[1:]) != whole[1:]
        or full.shape[0] < rows
        or (not vocabulary and full.shape[0] != rows)
    ):
        raise ConfigError(
            f"{source}: {what} is stored as {tuple(full.shape)}, but the model it describes "
            f"has {(rows, *whole[1:])}; the checkpoint's description of its model is not "
            "what threefold read (report it), or the checkpoint is damaged"
        )
    return full[:rows]


def _new_shard(full: torch.Tensor, param: nn.Parameter, parallel: ParallelContext) -> torch.Tensor:
    """This rank's shard of a full, unpadded tensor, padded as this layout pads it."""
    if param.dim() and full.shape[0] < param.master_shape[0]:
        padding = full.new_zeros((param.master_shape[0] - full.shape[0], *full.shape[1:]))
        full = torch.cat([full, padding])
    group = sharding_group(param, parallel)
    return shard_of(full, param, group.rank, group.size)


@torch.no_grad()
def load_weights(
    path: str,
    named_parameters,
    saved_tensor_parallel_size: int,
    parallel: ParallelContext,
    saved=None,
    strictness: str = "raise_unexpected",
    left_out: tuple[str, ...] = (),
) -> dict[nn.Parameter, torch.Tensor]:
    """Fill parameters (layout-independent names) from a checkpoint of any layout; returns
    the fp32 shard each was filled from (the masters' values when the checkpoint has them).
    `strictness`: what a Megatron-LM checkpoint's tensors no parameter takes do
    (--dist-ckpt-strictness); `left_out`: the prefixes of those the run leaves out, said."""
    saved = saved or saved_tensors(path)
    loaded = {}
    for name, param in named_parameters:
        if not saved.has("model", name):
            raise ConfigError(f"--load {path}: the checkpoint has no {name}; it is another model")
        # fp32 masters are the most precise copy of the weights when the checkpoint has them.
        source = "master" if saved.has("master", name) else "model"
        loaded[param] = _new_shard(
            saved.full(source, name, param, saved_tensor_parallel_size), param, parallel
        )
        copy_whole(param, loaded[param])
    if hasattr(saved, "check_all_read"):  # a Megatron-LM checkpoint: every tensor read?
        saved.check_all_read(parallel.pp, strictness, left_out)
    return loaded


@torch.no_grad()
def load_resharded(
    path: str,
    components: CheckpointComponents,
    saved_tensor_parallel_size: int,
    load_optimizer: bool,
    without_adapters: bool = False,
    megatron_step: float | None = None,
    left_out: tuple[str, ...] = (),
) -> None:
    """Fill the parameters (and optimizer state) from a checkpoint of any layout (`left_out`:
    the prefixes of the checkpoint's tensors the run leaves out)."""
    saved = saved_tensors(path, megatron_step, load_optimizer)
    parallel = components.parallel
    step = saved.step() if load_optimizer else None
    named = [(n, p) for n, p in components.parameters() if not (without_adapters and is_adapter(n))]
    strictness = components.config.checkpoint.dist_ckpt_strictness
    loaded = load_weights(
        path, named, saved_tensor_parallel_size, parallel, saved, strictness, left_out
    )
    if not load_optimizer:
        return

    def full_shard(field: str, name: str, param: nn.Parameter) -> torch.Tensor:
        full = saved.full(field, name, param, saved_tensor_parallel_size)
        return _new_shard(full, param, parallel)

    components.optimizer.load_resharded(named, full_shard, loaded, step)
