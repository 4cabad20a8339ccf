"""Megatron-LM torch_dist tensors in and out.

megatron-core names a GPT model's tensors as threefold does (both follow its local layer spec)
but stores them differently: the layers are stacked — `decoder.layers.{i}.X` of threefold is
the slice [i] of one tensor `decoder.layers.X'` of global shape [num_layers, ...] — and the
norms keep the names of Transformer Engine's fused norm+linear layers, which megatron-core's
local spec maps its own to (`input_layernorm.` -> `self_attention.linear_qkv.layer_norm_`,
`pre_mlp_layernorm.` -> `mlp.linear_fc1.layer_norm_`; a multi-latent attention model's as
its Transformer Engine spec does, `_TE_MLA_NAMES`, while its local spec keeps threefold's names,
which read as well). The global tensors are layout-free:
QKV is per query group `[q..., k, v]` and SwiGLU's fc1 `[gate; up]`, both as in threefold's
whole model, and the embedding keeps the saving run's vocabulary padding.

Reading takes one layer's slice at a time out of the stacked tensors (a load plan for just that
chunk), so a rank never holds more than one parameter of the whole model beyond its own. Adam's
state, where megatron-core stored it in model space (checkpoint/megatron/optimizer.py), is the
same tensors under a prefix and is read the same way.
"""

from __future__ import annotations

import io
import re
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from threefold.checkpoint.megatron.optimizer import FIELDS
from threefold.config import ConfigError
from threefold.safe_loading import SafeFileSystemReader

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# megatron-core's local spec stores its norms under Transformer Engine's names.
_TE_NAMES = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
# Transformer Engine's multi-latent attention spec (Megatron-LM's default for MLA models; its
# local spec keeps threefold's names): the input norm is a module of its own, the latent norms
# are fused into the up projections.
_TE_MLA_NAMES = {
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}


def megatron_key(name: str, multi_latent_attention: bool = False) -> tuple[str, int | None]:
    """(megatron-core's key, layer index or None) of a threefold parameter name."""
    match = _LAYER.match(name)
    if match is None:
        return name, None
    rest = match.group(2)
    for local, te in (_TE_MLA_NAMES if multi_latent_attention else _TE_NAMES).items():
        if rest.startswith(local):
            rest = te + rest[len(local) :]
    return f"decoder.layers.{rest}", int(match.group(1))


def _local_key(name: str) -> str:
    """The key without the TE renaming (checkpoints of specs that keep their own names)."""
    match = _LAYER.match(name)
    return name if match is None else f"decoder.layers.{match.group(2)}"


class _SlicePlanner(DefaultLoadPlanner):
    """Reads the slice [layer] of stacked tensors (or whole unstacked ones) into targets."""

    def __init__(self, targets: dict[str, tuple[int | None, torch.Tensor]]) -> None:
        super().__init__()
        self.targets = targets

    def _view(self, key: str) -> torch.Tensor:
        layer, target = self.targets[key]
        return target if layer is None else target.unsqueeze(0)

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, (layer, _) in self.targets.items():
            view = self._view(key)
            offsets = (0,) * view.dim() if layer is None else (layer,) + (0,) * (view.dim() - 1)
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.shape)
            items += create_read_items_for_chunk_list(
                key, self.metadata.state_dict_metadata[key], [chunk]
            )
        return LoadPlan(items)

    def resolve_tensor(self, read_item) -> torch.Tensor:
        view = self._view(read_item.dest_index.fqn)
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, offset, length)
        return view


class MegatronTensors:
    """A Megatron-LM torch_dist checkpoint's model tensors (`kind` "model") and model-space
    Adam state ("exp_avg", "exp_avg_sq", "master"), by threefold parameter name: what
    checkpoint/resharding.py's SavedTensors offers for threefold's own checkpoints."""

    def __init__(self, path: str, step: float | None = None) -> None:
        self.path, self._step = path, step
        self.reader = SafeFileSystemReader(path)  # one index read for every parameter
        metadata = self.reader.read_metadata().state_dict_metadata
        self.sizes = {k: tuple(v.size) for k, v in metadata.items() if hasattr(v, "size")}

    def _key(self, kind: str, name: str) -> tuple[str, int | None] | None:
        (key, layer), (mla_key, _) = megatron_key(name), megatron_key(name, True)
        for prefix in FIELDS.get(kind, ("",) if kind == "model" else ()):
            for candidate in (key, mla_key, _local_key(name)):
                if prefix + candidate in self.sizes:
                    return prefix + candidate, layer
        return None

    def has(self, kind: str, name: str) -> bool:
        return self._key(kind, name) is not None

    def full(self, kind: str, name: str, param: nn.Parameter, saved_tp: int) -> torch.Tensor:
        """The whole tensor of a parameter, unpadded (valid rows only), in fp32."""
        found = self._key(kind, name)
        if found is None:
            raise ConfigError(f"--load {self.path}: the checkpoint has no {kind} of {name}")
        key, layer = found
        size = self.sizes[key] if layer is None else self.sizes[key][1:]
        if layer is not None and layer >= self.sizes[key][0]:
            raise ConfigError(f"--load {self.path}: {key} holds no layer {layer}")
        target = torch.empty(size, dtype=torch.float32)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                {key: target},
                storage_reader=self.reader,
                planner=_SlicePlanner({key: (layer, target)}),
                no_dist=True,
            )
        if param.dim() and param.valid_rows is not None:
            target = target[: param.valid_rows]
        return target

    def step(self) -> torch.Tensor | None:
        """Adam's step (from common.pt), when the checkpoint holds Megatron's optimizer."""
        return None if self._step is None else torch.tensor(float(self._step))


def _extra_state() -> io.BytesIO:
    """An empty `_extra_state` (no FP8 metadata) as megatron-core stores one: a torch.save of
    the list of the objects' data, here [None], which its local and TE linear layers both load
    as "nothing to restore"."""
    buffer = io.BytesIO()
    torch.save([None], buffer)
    buffer.seek(0)
    return buffer


def stacked_state_dict(
    tensors: dict[str, torch.Tensor], num_layers: int, multi_latent_attention: bool = False
) -> dict:
    """megatron-core's torch_dist state dict of a whole model given by threefold names."""
    state: dict = {}
    layers: dict[str, dict[int, torch.Tensor]] = {}
    # Modules whose (empty) `_extra_state` megatron-core's local and TE layers load as objects.
    linear_modules = set()
    for name, tensor in tensors.items():
        key, layer = megatron_key(name, multi_latent_attention)
        if layer is None:
            state[key] = tensor
        else:
            layers.setdefault(key, {})[layer] = tensor
            module = _LAYER.match(name).group(2).rsplit(".", 1)[0]
            if module.rsplit(".", 1)[-1].startswith("linear_"):
                linear_modules.add(module)
    for key, per_layer in layers.items():
        if sorted(per_layer) != list(range(num_layers)):
            raise ConfigError(f"{key}: the model lacks some of its {num_layers} layers")
        state[key] = torch.stack([per_layer[i] for i in range(num_layers)])
    for module in sorted(linear_modules):
        for layer in range(num_layers):
            key = f"decoder.layers.{module}._extra_state/shard_{layer}_{num_layers}"
            state[key] = _extra_state()
    return state
