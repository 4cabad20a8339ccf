"""Megatron-LM torch_dist tensors in and out.

megatron-core names a GPT model's tensors as threefold does (both follow its local layer spec)
but stores them differently: the layers are stacked — `decoder.layers.{i}.X` of threefold is
the slice [i] of one tensor `decoder.layers.X'` of global shape [num_layers, ...] — and the
norms keep the names of Transformer Engine's fused norm+linear layers, which megatron-core's
local spec maps its own to (`input_layernorm.` -> `self_attention.linear_qkv.layer_norm_`,
`pre_mlp_layernorm.` -> `mlp.linear_fc1.layer_norm_`; a multi-latent attention model's as
its Transformer Engine spec does, `_TE_MLA_NAMES`, while its local spec keeps threefold's names,
which read as well). A mixture of experts' layer holds its experts as one tensor,
`mlp.experts.experts.X` of shape [experts, ...] (on a second axis when stacked) for threefold's
`mlp.experts.local_experts.{e}.X`; and where the layers differ (--moe-layer-freq other than 1)
megatron-core keeps each layer's tensors apart, `decoder.layers.{i}.X`, not stacked. The global
tensors are layout-free:
QKV is per query group `[q..., k, v]` and SwiGLU's fc1 `[gate; up]`, both as in threefold's
whole model, and the embedding keeps the saving run's vocabulary padding. A gated delta net's
projection and convolution are stored a section at a time, `in_proj.weight.query` ...
`.alpha` and `conv1d.weight.query` ... `.value` (megatron-core's `_split_tensor_factory`;
`SECTIONS`), whose concatenation is threefold's whole tensor, and its input norm under
Transformer Engine's name for the norm fused into in_proj. A hybrid model's layers differ,
so they are kept per layer; a Mamba mixer's in_proj is stored as z, x, B, C and dt, its
convolution's weight and bias as x, B and C, and the layer's norm is the one fused into
in_proj (`mixer.in_proj.layer_norm_weight`); the stack's final norm is `decoder.final_norm`.
A hybrid depth of multi-token prediction keeps its layers as the decoder's, under
`mtp.layers.{k}.mtp_model_layer.layers.{j}`.

Reading takes one layer's (and expert's) slice at a time out of the stacked tensors (a load
plan for just that chunk), so a rank never holds more than one parameter of the whole model
beyond its own. Adam's state, where megatron-core stored it in model space
(checkpoint/megatron/optimizer.py), is the same tensors under a prefix and is read the same
way; in the distributed optimizer's default buckets, a parameter's pieces are read from each
saved TP rank's bucket and joined (checkpoint/megatron/buckets.py).
"""

from __future__ import annotations

import io
import itertools
import math
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from threefold.checkpoint.megatron.buckets import (
    BucketLayout,
    Piece,
    has_buckets,
    sectioned,
    whole_sizes,
)
from threefold.checkpoint.megatron.common_file import read_common
from threefold.checkpoint.megatron.load_checks import masters_agree, masters_refused, unread_refused
from threefold.checkpoint.megatron.optimizer import FIELDS
from threefold.checkpoint.megatron.param_order import SECTIONS
from threefold.checkpoint.resharding import unpadded
from threefold.config import ConfigError
from threefold.parallel.parallel_context import Group
from threefold.parallel.tensor_parallel.sharding import unshard
from threefold.safe_loading import SafeFileSystemReader

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# megatron-core's linear layers in the transformer layers, MTP's projection and latent experts'
# projections (Transformer Engine's, each with its extra state)
_LINEAR = re.compile(r"^.*\.(linear_[^.]*|eh_proj|in_proj|out_proj|fc[12]_latent_proj)$")
# a GPT depth's one layer; a hybrid depth's stack of layers (megatron-core's HybridStack)
_MTP_LAYER = re.compile(
    r"^(mtp\.layers\.\d+\.(?:transformer_layer|mtp_model_layer\.layers\.\d+))\.(.+)$"
)
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_DT_BIAS = re.compile(r"^decoder\.layers\.\d+\.mixer\.dt_bias$")  # (a Mamba mixer's)
# megatron-core's local spec stores its norms under Transformer Engine's names.
_TE_NAMES = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    "norm.": "mixer.in_proj.layer_norm_",  # a hybrid model's Mamba layer's
}
# A hybrid model's stack (megatron-core's MambaStack / HybridStack) names its final norm so.
FINAL_NORMS = {"decoder.final_layernorm.": "decoder.final_norm."}
# Transformer Engine's multi-latent attention spec (Megatron-LM's default for MLA models; its
# local spec keeps threefold's names): the input norm is a module of its own, the latent norms
# are fused into the up projections.
_TE_MLA_NAMES = {
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}


# A gated delta net layer's (Megatron-LM's spec fuses its input norm into in_proj)
_TE_GDN_NAMES = {**_TE_NAMES, "input_layernorm.": "self_attention.in_proj.layer_norm_"}


def _renamed(rest: str, multi_latent_attention: bool, gated_delta_net: bool = False) -> str:
    """A layer's parameter name under megatron-core's names for its norms."""
    names = _TE_GDN_NAMES if gated_delta_net else _TE_NAMES
    for local, te in (_TE_MLA_NAMES if multi_latent_attention else names).items():
        if rest.startswith(local):
            return te + rest[len(local) :]
    return rest


@dataclass(frozen=True)
class _Split:
    """A transformer layer's parameter: its name within the layer (an expert's index taken
    out), the layer's own key prefix, its index in the stacked decoder layers (None for a
    multi-token prediction layer, never stacked) and the expert's index (or ())."""

    rest: str
    prefix: str
    layer: int | None
    expert: tuple[int, ...]


def split_name(name: str) -> _Split | None:
    """A decoder or multi-token prediction layer's parameter taken apart; None otherwise."""
    match, mtp = _LAYER.match(name), _MTP_LAYER.match(name)
    if match is not None:
        prefix, rest, layer = (
            f"decoder.layers.{match.group(1)}",
            match.group(2),
            int(match.group(1)),
        )
    elif mtp is not None:
        prefix, rest, layer = mtp.group(1), mtp.group(2), None
    else:
        return None
    expert = _EXPERT.match(rest)
    if expert is None:
        return _Split(rest, prefix, layer, ())
    # megatron-core stores a layer's experts as one [experts, ...] tensor
    return _Split(f"mlp.experts.experts.{expert.group(2)}", prefix, layer, (int(expert.group(1)),))


def megatron_key(
    name: str,
    multi_latent_attention: bool = False,
    stacked: bool = True,
    renamed: bool = True,
    gated_delta_net: bool = False,
) -> tuple[str, tuple[int, ...]]:
    """(megatron-core's key of a threefold parameter, the indices of its slice in that key's
    tensor). Stacked: `decoder.layers.X` with indices (layer,) or (layer, expert); per layer
    (models whose layers differ, and multi-token prediction layers): `decoder.layers.{layer}.X`
    (`mtp.layers.{k}.transformer_layer.X`) with () or (expert,). `renamed`: norms under the
    fused layers' names (else threefold's own); `gated_delta_net`: the layer is one."""
    split = split_name(name)
    if split is None:
        return name, ()
    rest = split.rest
    if renamed:
        rest = _renamed(rest, multi_latent_attention, gated_delta_net)
    if stacked and split.layer is not None:
        return f"decoder.layers.{rest}", (split.layer, *split.expert)
    return f"{split.prefix}.{rest}", split.expert


def candidate_keys(name: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every key megatron-core may have stored a parameter under: its local and Transformer
    Engine specs' names (plain and MLA), stacked or per layer; a hybrid stack's final norm
    under its name."""
    split = split_name(name)
    if split is None:
        found = [(name, ())]
        for ours, theirs in FINAL_NORMS.items():
            if name.startswith(ours):
                found.append((theirs + name[len(ours) :], ()))
        return found
    found = []
    renamed = [_renamed(split.rest, mla, gdn) for mla, gdn in ((0, 0), (1, 0), (0, 1))]
    for rest in (*renamed, split.rest):
        if split.layer is not None:
            found.append((f"decoder.layers.{rest}", (split.layer, *split.expert)))
        found.append((f"{split.prefix}.{rest}", split.expert))
    return found


class _ChunkPlanner(DefaultLoadPlanner):
    """Reads one chunk of a stored tensor into `view` (shaped as the chunk) from `offsets`: a
    layer's (and expert's) slice of a stacked tensor, a whole tensor, or a parameter's range
    of a dp_reshardable bucket."""

    def __init__(self, key: str, offsets: tuple[int, ...], view: torch.Tensor) -> None:
        super().__init__()
        self.key, self.offsets, self.view = key, offsets, view

    def create_local_plan(self) -> LoadPlan:
        chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.view.shape)
        stored = self.metadata.state_dict_metadata[self.key]
        return LoadPlan(create_read_items_for_chunk_list(self.key, stored, [chunk]))

    def resolve_tensor(self, read_item) -> torch.Tensor:
        view = self.view
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, offset, length)
        return view


class MegatronTensors:
    """A Megatron-LM torch_dist checkpoint's model tensors (`kind` "model") and Adam state
    ("exp_avg", "exp_avg_sq", "master": model-space tensors, or the distributed optimizer's
    dp_reshardable buckets laid out by checkpoint/megatron/buckets.py), by threefold parameter
    name: what checkpoint/resharding.py's SavedTensors offers for threefold's own checkpoints."""

    def __init__(self, path: str, step: float | None = None, optimizer: bool = False) -> None:
        # (`optimizer` False: the dp_reshardable buckets are not looked into, even for the
        # fp32 masters, so a weights-only load never depends on their layout)
        self.path, self._step, self.optimizer = path, step, optimizer
        self.reader = SafeFileSystemReader(path)  # one index read for every parameter
        metadata = self.reader.read_metadata().state_dict_metadata
        self.sizes = {k: tuple(v.size) for k, v in metadata.items() if hasattr(v, "size")}
        self.dtypes = {k: v.properties.dtype for k, v in metadata.items() if hasattr(v, "size")}
        # a parameter stored a section at a time: under its own key, whole (its first
        # section's dtype)
        self.whole = whole_sizes(self.sizes)
        for key, dtype in list(self.dtypes.items()):
            found = sectioned(key)
            if found is not None:
                self.dtypes.setdefault(found[0], dtype)
        self.read: set[str] = set()  # the model tensors' keys read so far
        self._buckets: BucketLayout | None = None
        self._args: dict | None = None

    @property
    def args(self) -> dict:
        """The saving run's args (common.pt's)."""
        if self._args is None:
            self._args = read_common(self.path).get("args") or {}
        return self._args

    @property
    def buckets(self) -> BucketLayout | None:
        """The rebuilt layout of a dp_reshardable optimizer state (None without one). A model
        with Mamba mixers in the parameters' order of the Megatron-LM that saved it (which
        its keys do not tell; param_order.py's `conv_own`): the one where the first mixer's
        dt_bias masters are its weights."""
        if self._buckets is None and has_buckets(self.sizes):
            self._buckets = BucketLayout(self.sizes, self.args)
            probe = next((key for key in self.sizes if _DT_BIAS.match(key)), None)
            if probe is not None and not self._masters_are_weights(self._buckets, probe):
                newer = BucketLayout(self.sizes, self.args, conv_own=True)
                if self._masters_are_weights(newer, probe):
                    self._buckets = newer
        return self._buckets

    def _masters_are_weights(self, layout: BucketLayout, key: str) -> bool:
        """Whether a layout's fp32 masters of the one-dimensional tensor `key` (split over TP
        along it, if at all) round to its stored weights."""
        pieces = layout.pieces.get((key, ()))
        if not pieces:
            return False
        masters = torch.cat([self._read_piece(pieces[r], "param") for r in sorted(pieces)])
        weights = self._read(key, ())
        return torch.equal(masters.to(self.dtypes[key]).float(), weights)

    def _pieces(self, kind: str, name: str) -> dict[int, Piece] | None:
        """A parameter's pieces of the dp_reshardable buckets, for Adam's fields."""
        if kind not in FIELDS or not self.optimizer or self.buckets is None:
            return None
        found = self._key("model", name) or self._sectioned("model", name)
        return self.buckets.pieces.get(found) if found else None

    def _from_buckets(self, kind: str, name: str, param: nn.Parameter) -> torch.Tensor:
        """The whole tensor of one of Adam's fields out of the saved TP ranks' bucket pieces;
        the fp32 masters must be the stored weights (`kind` "master"), else the rebuilt
        layout is not the one megatron-core saved and nothing is read."""
        key, index = self._key("model", name) or self._sectioned("model", name)
        field = "param" if kind == "master" else kind
        shape = self.whole[key][len(index) :]
        full = from_pieces(
            self._pieces(kind, name), lambda piece: self._read_piece(piece, field), shape, param
        )
        if kind == "master" and not self._masters_agree(full, name, key):
            raise masters_refused(self.path, "dp_reshardable optimizer state", key, index)
        return full

    def _masters_agree(self, masters: torch.Tensor, name: str, key: str) -> bool:
        weights = self._weights("model", name)
        return masters_agree(masters, weights, self.dtypes[key], self.args)

    def _key(self, kind: str, name: str, suffix: str = "") -> tuple[str, tuple[int, ...]] | None:
        for prefix in FIELDS.get(kind, ("",) if kind == "model" else ()):
            for key, index in candidate_keys(name):
                if prefix + key + suffix in self.sizes:
                    return prefix + key, index
        return None

    def _sectioned(self, kind: str, name: str) -> tuple[str, tuple[int, ...]] | None:
        """The key a gated delta net's tensor is stored under a section at a time."""
        split = split_name(name)
        sections = SECTIONS.get(split.rest) if split else None
        return self._key(kind, name, "." + sections[0]) if sections else None

    def has(self, kind: str, name: str) -> bool:
        return (
            self._key(kind, name) is not None
            or self._sectioned(kind, name) is not None
            or self._pieces(kind, name) is not None
        )

    def full(self, kind: str, name: str, param: nn.Parameter, saved_tp: int) -> torch.Tensor:
        """The whole tensor of a parameter, unpadded (valid rows only), in fp32."""
        self._mark_read(name)
        if self._key(kind, name) is None and self._pieces(kind, name) is not None:
            target = self._from_buckets(kind, name, param)
        else:
            target = self._weights(kind, name)
            if kind == "master":
                key, index = self._key("model", name) or self._sectioned("model", name)
                if not self._masters_agree(target, name, key):
                    raise masters_refused(self.path, "optimizer state", key, index, True)
        return unpadded(target, param, f"--load {self.path}", f"{kind} of {name}")

    def _weights(self, kind: str, name: str) -> torch.Tensor:
        """A parameter's tensor in model space: stored whole, or a section at a time. Adam's
        moments before its first step (which Megatron-LM's torch Adam has not made yet) are
        zeros."""
        found = self._key(kind, name)
        if found is not None:
            return self._read(*found)
        if kind in ("exp_avg", "exp_avg_sq") and self._step == 0:
            return torch.zeros_like(self._weights("model", name))
        if self._sectioned(kind, name) is None:
            raise ConfigError(f"--load {self.path}: the checkpoint has no {kind} of {name}")
        key, index = self._sectioned(kind, name)
        sections = SECTIONS[split_name(name).rest]
        return torch.cat([self._read(f"{key}.{section}", index) for section in sections])

    def _read(self, key: str, index: tuple[int, ...]) -> torch.Tensor:
        """The slice [index] of the stored tensor `key`, in fp32."""
        size = self.sizes[key]
        if any(i >= n for i, n in zip(index, size)):
            raise ConfigError(f"--load {self.path}: {key} holds no slice {list(index)}")
        target = torch.empty(size[len(index) :], dtype=torch.float32)
        view = target.view((1,) * len(index) + tuple(target.shape))
        self._load(key, index + (0,) * (view.dim() - len(index)), view)
        return target

    def _read_piece(self, piece: Piece, field: str) -> torch.Tensor:
        """A parameter's elements of one of Adam's fields in its dp_reshardable bucket."""
        target = torch.empty(piece.numel, dtype=torch.float32)
        self._load(f"{piece.stem}.{field}", (piece.start,), target)
        return target

    def _load(self, key: str, offsets: tuple[int, ...], view: torch.Tensor) -> None:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                {key: view},
                storage_reader=self.reader,
                planner=_ChunkPlanner(key, offsets, view),
                no_dist=True,
            )

    def _mark_read(self, name: str) -> None:
        """The parameter's model tensors have a reader (whether its values come from there or
        from the fp32 masters beside them): each name it may be stored under (threefold's
        exports write an MoE layer's pre-MLP norm under two), a section at a time too."""
        split = split_name(name)
        sections = SECTIONS.get(split.rest, ()) if split else ()
        for key, _ in candidate_keys(name):
            for stored in (key, *(f"{key}.{section}" for section in sections)):
                if stored in self.sizes:
                    self.read.add(stored)

    def check_all_read(
        self, pipeline: Group, strictness: str, left_out: tuple[str, ...] = ()
    ) -> None:
        """After the model was read: `unread_refused` for the model tensors no parameter took
        (Adam's state under its prefixes is not looked at)."""
        optimizer = ("optimizer.", "chained_") + tuple(
            prefix for prefixes in FIELDS.values() for prefix in prefixes
        )
        stored = [key for key in self.sizes if not key.startswith(optimizer)]
        unread_refused(self.path, stored, self.read, pipeline, strictness, left_out)

    def step(self) -> torch.Tensor | None:
        """Adam's step (from common.pt), when the checkpoint holds Megatron's optimizer."""
        return None if self._step is None else torch.tensor(float(self._step))


def joined(shards: list[torch.Tensor], dim: int | None, param: nn.Parameter) -> torch.Tensor:
    """A tensor whole from the shards the saved TP ranks hold, split along `dim` (None: each
    holds it whole), as threefold joins its own for this parameter."""
    if dim is None or len(shards) == 1:
        return shards[0]
    if getattr(param, "tensor_model_parallel", False) and param.partition_dim == dim:
        return unshard(shards, param)  # (SwiGLU's [gate; up] shards too)
    return torch.cat(shards, dim)  # split there, whole here (MLA's down projections)


def from_pieces(
    pieces: dict[int, Piece],
    read: Callable[[Piece], torch.Tensor],
    shape: tuple[int, ...],
    param: nn.Parameter,
) -> torch.Tensor:
    """The whole tensor (global `shape`) of one of Adam's fields from its pieces of the
    distributed optimizer's buckets on each saved TP rank, each `read` flat."""
    dim, shape = pieces[min(pieces)].dim, list(shape)
    if dim is not None:
        shape[dim] //= len(pieces)
    return joined([read(pieces[r]).view(shape) for r in sorted(pieces)], dim, param)


def extra_state() -> io.BytesIO:
    """An empty `_extra_state` (no FP8 metadata) as megatron-core stores one: a torch.save of
    the list of the objects' data, here [None], which its local and TE linear layers both load
    as "nothing to restore"."""
    buffer = io.BytesIO()
    torch.save([None], buffer)
    buffer.seek(0)
    return buffer


@dataclass(frozen=True)
class Part:
    """A tensor's place in megatron-core's state dict: the slice `index` (layer and expert, or
    expert, or () for a whole tensor) of `key`; `stacked`: the key stacks the decoder's layers."""

    key: str
    index: tuple[int, ...]
    tensor: torch.Tensor
    stacked: bool


def layer_kinds(names: Iterable[str]) -> tuple[set[str], set[str]]:
    """The key prefixes of the layers with experts (a router) and of the gated delta net
    layers, among parameter `names` (those of whole layers)."""
    names = list(names)
    moe = {split_name(name).prefix for name in names if ".mlp.router." in name}
    gdn = {split_name(name).prefix for name in names if ".self_attention.in_proj." in name}
    return moe, gdn


def megatron_parts(
    name: str,
    tensor: torch.Tensor,
    kinds: tuple[set[str], set[str]],
    multi_latent_attention: bool = False,
    stacked: bool = True,
    sections: dict[str, list[int]] | None = None,
) -> tuple[list[Part], Part | None]:
    """Where one whole tensor (threefold name) goes in megatron-core's state dict (see
    `stacked_state_dict`; `kinds`: `layer_kinds` of the model), and the linear module whose
    `_extra_state` goes beside it (its key, index and stacking as a Part of no tensor), if any."""
    moe_layers, gdn_layers = kinds
    split = split_name(name)
    gdn = split is not None and split.prefix in gdn_layers
    keys = [megatron_key(name, multi_latent_attention, stacked, gated_delta_net=gdn)]
    if split and split.rest.startswith("pre_mlp_layernorm.") and split.prefix in moe_layers:
        keys.append(megatron_key(name, multi_latent_attention, stacked, renamed=False))
    layered = bool(stacked and split and split.layer is not None)
    parts = [Part(key, index, tensor, layered) for key, index in keys]
    if split is not None and split.rest in SECTIONS:
        pieces = tensor.split(sections[split.rest])
        parts = [
            Part(f"{key}.{section}", index, piece, layered)
            for key, index in keys
            for section, piece in zip(SECTIONS[split.rest], pieces)
        ]
    module = keys[0][0].rsplit(".", 1)[0]
    linear = _LINEAR.match(module) and (split or module.startswith("mtp."))
    return parts, Part(module, keys[0][1], None, layered) if linear else None


def stacked_state_dict(
    tensors: dict[str, torch.Tensor],
    num_layers: int,
    multi_latent_attention: bool = False,
    stacked: bool = True,
    sections: dict[str, list[int]] | None = None,
) -> dict:
    """megatron-core's torch_dist state dict of a whole model given by threefold names: the
    layers stacked into one tensor per name, or (`stacked` False) kept per layer as
    megatron-core keeps them when the layers differ (--moe-layer-freq other than 1); each
    layer's experts stacked into one [experts, ...] tensor either way. `sections`: the row
    sizes of the tensors megatron-core stores a section at a time (`SECTIONS`). An MoE layer's
    pre-MLP norm is fused into fc1's name by the local spec, as a dense layer's, but a module
    of its own in Transformer Engine's (Megatron-LM's default): it is written under both
    names, so that either spec loads the export."""
    state: dict = {}
    slices: dict[str, dict[tuple[int, ...], torch.Tensor]] = {}
    # Modules whose (empty) `_extra_state` megatron-core's local and TE layers load as objects.
    linear_modules: dict[str, set[tuple[int, ...]]] = {}
    stacked_keys = set()  # the keys of the decoder layers' stacks
    kinds = layer_kinds(tensors)
    for name, tensor in tensors.items():
        parts, module = megatron_parts(
            name, tensor, kinds, multi_latent_attention, stacked, sections
        )
        for part in parts:
            if part.index:
                slices.setdefault(part.key, {})[part.index] = part.tensor
            else:
                state[part.key] = part.tensor
            if part.stacked:
                stacked_keys.add(part.key)
        if module is not None:
            linear_modules.setdefault(module.key, set()).add(module.index)
            if module.stacked:
                stacked_keys.add(module.key)
    for key, pieces in slices.items():
        shape = _grid(key, pieces, num_layers if key in stacked_keys else None)
        whole = torch.stack([pieces[index] for index in itertools.product(*map(range, shape))])
        state[key] = whole.view(*shape, *whole.shape[1:])
    for module, indices in sorted(linear_modules.items()):
        layers = num_layers if module in stacked_keys else None
        shape = _grid(module, dict.fromkeys(indices), layers) or (1,)
        for index in itertools.product(*map(range, shape)):
            state[extra_state_key(module, index, shape)] = extra_state()
    return state


def extra_state_key(module: str, index: tuple[int, ...], shape: tuple[int, ...]) -> str:
    """The key of one of a module's `_extra_state` objects: its slice `index` of `shape`
    (megatron-core's ShardedObject naming)."""
    offsets, sizes = ".".join(map(str, index)), ".".join(map(str, shape))
    return f"{module}._extra_state/shard_{offsets}_{sizes}"


def _grid(key: str, pieces: dict, num_layers: int | None) -> tuple[int, ...]:
    """The leading shape the slices of one key fill: all of it, and every layer if stacked."""
    shape = tuple(
        max(index[axis] for index in pieces) + 1 for axis in range(len(next(iter(pieces))))
    )
    if len(pieces) != math.prod(shape) or (num_layers is not None and shape[0] != num_layers):
        raise ConfigError(f"{key}: the model lacks some of its layers or experts")
    return shape
