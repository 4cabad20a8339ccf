"""A Megatron-LM legacy checkpoint's model tensors (checkpoint/megatron/legacy.py), by
threefold parameter name.

Each file's tensors are indexed under the whole model's names — a chunk's layers renumbered by
the saved pipeline layout (`format.saved_chunks`: megatron-core's split, or the run's
--pipeline-model-parallel-layout), an EP rank's experts by its first expert,
Transformer Engine's grouped experts (`linear_fc1.weight{e}`) as `local_experts.{e}` — and read
from their bytes when a parameter asks; a tensor's TP shards are joined as megatron-core split
them (`tp_split_dim`).
"""

from __future__ import annotations

import os
import re
import zipfile

import torch
from torch import nn

from threefold.checkpoint.megatron.buckets import Piece
from threefold.checkpoint.megatron.common_file import StoredTensor, read_torch_file
from threefold.checkpoint.megatron.format import saved_chunks
from threefold.checkpoint.megatron.legacy import (
    MODEL,
    legacy_args,
    legacy_common,
    legacy_files,
    refuse_unread_kinds,
    saved_sizes,
)
from threefold.checkpoint.megatron.legacy_models import is_older_model, megatron_core_names
from threefold.checkpoint.megatron.legacy_optimizer import (
    LegacyBuffers,
    LegacyPlainState,
    model_sizes,
    whole_shape,
)
from threefold.checkpoint.megatron.load_checks import masters_agree, masters_refused, unread_refused
from threefold.checkpoint.megatron.optimizer import FIELDS, find_step
from threefold.checkpoint.megatron.param_order import BUFFERS, tp_split_dim
from threefold.checkpoint.megatron.tensors import candidate_keys, from_pieces, joined, split_name
from threefold.checkpoint.resharding import unpadded
from threefold.config import ConfigError
from threefold.parallel.parallel_context import Group

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# newer Megatron-LM's Mamba mixers' convolution parameters (param_order.py's `conv_own`)
_OWN_CONV = re.compile(r"^(.*\.mixer\.)conv1d_(weight|bias)$")
# Transformer Engine's GroupedMLP: one weight per local expert, numbered after the name
_GROUPED = re.compile(r"^(.*\.mlp\.experts)\.(linear_fc[12])\.(weight|bias)(\d+)$")


class LegacyTensors:
    """A legacy checkpoint's model tensors by threefold parameter name: what
    checkpoint/resharding.py's SavedTensors offers for threefold's own checkpoints."""

    def __init__(self, path: str, optimizer: bool = False) -> None:
        # (`optimizer` False: the optimizer's state is not looked into)
        self.path, self.optimizer = path, optimizer
        self.common = common = legacy_common(path)
        self.args = args = legacy_args(common, path)
        refuse_unread_kinds(args, path)
        self.distributed = bool(args.get("use_distributed_optimizer"))
        self._state: LegacyBuffers | LegacyPlainState | None = None
        # file -> (its TP rank, its parameters' (key, index, shape) in the model's order)
        self.params: dict[str, tuple[int, list]] = {}
        self._optimizer_states: dict[str, object] = {}  # file -> its optimizer's own state
        self.te_spec = args.get("transformer_impl", "transformer_engine") != "local"
        self.tied = not args.get("untie_embeddings_and_output_weights")
        self.conv_own = False  # (param_order.py's; set as the files are indexed)
        self.older_model = False  # megatron/legacy's GPT model (legacy_models.py)
        self._archives: dict[str, zipfile.ZipFile] = {}
        # (key, expert index or ()) -> {saved TP rank: (file, tensor record)}
        self.index: dict[tuple[str, tuple[int, ...]], dict[int, tuple[str, StoredTensor]]] = {}
        self.read: set[str] = set()
        run_order = saved_chunks(args)
        local_experts = (args.get("num_experts") or 0) // saved_sizes(args)[2]
        for (tp_rank, pp_rank, ep_rank), file in legacy_files(path, args).items():
            if not os.path.isfile(file):
                raise ConfigError(f"--load {path}: {os.path.relpath(file, path)} is missing")
            pp = saved_sizes(args)[1]
            chunks = [(first, count) for first, count, _ in run_order[pp_rank::pp]]
            self._index_file(file, tp_rank, chunks, ep_rank * local_experts)

    def _index_file(
        self, file: str, tp_rank: int, chunks: list[tuple[int, int]], first_expert: int
    ) -> None:
        """A rank's tensors under the whole model's names (`chunks`: its model chunks' first
        layer and number of layers; `first_expert`: its EP rank's)."""
        state = read_torch_file(file, tensors=True)
        relative = os.path.relpath(file, self.path)
        if not isinstance(state, dict):
            raise ConfigError(f"--load {self.path}: {relative} holds no state dict; it is damaged")
        self._optimizer_states[file] = state.get("optimizer")
        for name, value in state.items():
            found = MODEL.match(name)
            if found is None or not isinstance(value, dict):
                continue
            if is_older_model(value):  # (megatron/legacy's: its local spec's twin)
                value = megatron_core_names(value, f"--load {self.path}: {relative}")
                self.older_model, self.te_spec = True, False
            chunk = int(found.group(1) or 0)
            if chunk >= len(chunks):
                raise ConfigError(
                    f"--load {self.path}: {relative} holds model chunk {chunk}, which its args' "
                    "pipeline layout does not have; the checkpoint is damaged"
                )
            for key, tensor in value.items():
                if not isinstance(tensor, StoredTensor) or "_extra_state" in key:
                    continue  # (Transformer Engine's FP8 metadata: not weights)
                where = self._global(key, chunks[chunk], first_expert, file)
                self.index.setdefault(where, {}).setdefault(tp_rank, (file, tensor))
                if not key.endswith(BUFFERS):
                    order = self.params.setdefault(file, (tp_rank, []))[1]
                    order.append((*where, tensor.shape))

    def _global(
        self, key: str, chunk: tuple[int, int], first_expert: int, file: str
    ) -> tuple[str, tuple[int, ...]]:
        """A file's key under the whole model's layer and expert numbers (a Mamba mixer's own
        convolution parameters, newer Megatron-LM's, under their checkpoint keys)."""
        own = _OWN_CONV.match(key)
        if own:
            self.conv_own, key = True, f"{own.group(1)}conv1d.{own.group(2)}"
        grouped = _GROUPED.match(key)
        if grouped:
            module, layer, kind, expert = grouped.groups()
            key = f"{module}.local_experts.{expert}.{layer}.{kind}"
        local = _LOCAL_LAYER.match(key)
        if local:
            offset, count = chunk
            if int(local.group(1)) >= count:
                raise ConfigError(
                    f"--load {self.path}: {os.path.relpath(file, self.path)} holds {key}, past "
                    "its model chunk's layers by its args' pipeline layout; it is damaged"
                )
            key = f"decoder.layers.{offset + int(local.group(1))}.{local.group(2)}"
        split = split_name(key)
        if split is None or not split.expert:
            return key, ()
        return f"{split.prefix}.{split.rest}", (first_expert + split.expert[0],)

    def _find(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        return next((found for found in candidate_keys(name) if found in self.index), None)

    @property
    def state(self) -> LegacyBuffers | LegacyPlainState:
        """The optimizer's state: the distributed optimizer's buffers (distrib_optim.pt) laid
        out, or the non-distributed optimizer's per parameter."""
        if self._state is None and self.distributed:
            sizes = model_sizes(self.index, self.args.get("num_experts") or 0, self.te_spec)
            self._state = LegacyBuffers(self.path, self.args, sizes, self.conv_own)
        elif self._state is None:
            expert_parallel = saved_sizes(self.args)[2] > 1
            self._state = LegacyPlainState(
                self.path, self.params, self._optimizer_states, expert_parallel
            )
        return self._state

    def _optimizer_state(self, kind: str, name: str) -> dict | None:
        """A parameter's state of one of Adam's fields: its bucket pieces or its tensors, by
        saved TP rank."""
        found = self._find(name)
        if kind not in FIELDS or not self.optimizer or found is None:
            return None
        if self.distributed:
            return self.state.pieces.get(found)
        by_rank = self.state.fields.get(found)
        if not by_rank or any(kind not in fields for fields in by_rank.values()):
            return None  # (the masters: only a bf16/fp16 run's)
        return {rank: fields[kind] for rank, fields in by_rank.items()}

    def has(self, kind: str, name: str) -> bool:
        if kind == "model":
            return self._find(name) is not None
        return self._optimizer_state(kind, name) is not None

    def _load(self, file: str, tensor: StoredTensor) -> torch.Tensor:
        if file not in self._archives:
            self._archives[file] = zipfile.ZipFile(file)
        return tensor.load(self._archives[file], file)

    def _joined(self, key: str, shards: dict, param: nn.Parameter) -> torch.Tensor:
        """A tensor of `key` whole, in its stored dtype, from its TP shards (file, record)."""
        dim = tp_split_dim(key, self.te_spec)
        if dim is not None and sorted(shards) != list(range(len(shards))):
            raise ConfigError(f"--load {self.path}: {key} lacks some of its TP shards")
        ranks = sorted(shards) if dim is not None else [min(shards)]
        return joined([self._load(*shards[r]) for r in ranks], dim, param)

    def full(self, kind: str, name: str, param: nn.Parameter, saved_tp: int) -> torch.Tensor:
        """The whole tensor of a parameter, unpadded (valid rows only), in fp32. Adam's
        fields come from the distributed optimizer's buffers or the non-distributed
        optimizer's state; their fp32 masters must be the stored weights (else the state is
        laid out otherwise than it was read, and nothing is)."""
        found, state = self._find(name), self._optimizer_state(kind, name)
        if found is None or (kind != "model" and state is None):
            raise ConfigError(f"--load {self.path}: the checkpoint has no {kind} of {name}")
        self.read.add(found[0])
        if kind in ("model", "master"):  # (the moments need not the weights, the masters do)
            weights = self._joined(found[0], self.index[found], param)
        if kind == "model":
            full = weights
        elif self.distributed:
            field = "param" if kind == "master" else kind

            def read(piece: Piece) -> torch.Tensor:
                return self.state.read(piece, field)

            shape = whole_shape(found[0], self.index[found], self.te_spec)
            full = from_pieces(state, read, shape, param)
        else:
            full = self._joined(found[0], state, param)
        if kind == "master" and not masters_agree(full, weights, weights.dtype, self.args):
            raise masters_refused(self.path, "optimizer state", *found)
        return unpadded(full.float(), param, f"--load {self.path}", f"{kind} of {name}")

    def check_all_read(
        self, pipeline: Group, strictness: str, left_out: tuple[str, ...] = ()
    ) -> None:
        """`unread_refused` for the tensors no parameter took (a tied output layer's copy on
        the last stage is the embedding's, taken with it)."""
        stored = {key for key, _ in self.index}
        if self.tied:
            stored.discard("output_layer.weight")
        unread_refused(self.path, stored, self.read, pipeline, strictness, left_out)

    def step(self) -> torch.Tensor | None:
        """Adam's step, when the checkpoint's optimizer state is read."""
        step = find_step(self.common.get("optimizer")) if self.optimizer else None
        return None if step is None else torch.tensor(float(step))
