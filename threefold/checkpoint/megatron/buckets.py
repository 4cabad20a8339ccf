"""Megatron-LM's default distributed-optimizer layout, dp_reshardable, read in model space.

Megatron-LM's distributed optimizer saves Adam's state as it holds it (megatron-core's
`sharded_param_state_dp_reshardable`): per model-parallel rank (`dp_group_idx_{r}`), per
gradient buffer (`gbuf_idx_{g}`, a model chunk's) and per bucket, one flat tensor of each
field (`param`, the fp32 masters; `exp_avg`; `exp_avg_sq`), the bucket's parameters one after
another as megatron-core's `_ParamAndGradBuffer` lays them out. Nothing in the checkpoint says
which parameter sits where; megatron-core knows it from the model it builds. Here the layout
is rebuilt from the checkpoint itself:

- the parameters: the model tensors' keys (every layer's and expert's slice), each rank's share
  by its saved TP/PP/EP layout from the args (the stages by `chunk_layers_of`, or by
  --pipeline-model-parallel-layout; `_chunks`: with prediction depths the final norm sits
  beside the last layer, and the depths' stage keeps a copy of the embedding);
- their order: megatron-core's registration order (`_LAYER_ORDER`, the multi-token prediction
  layers' `_MTP_ORDER`; Transformer Engine's spec fuses a norm into the linear layer after it,
  `_TE_FUSED`), walked backwards as the buffer is filled, each parameter starting at a multiple
  of 64 elements;
- the bucket boundaries: where each stored bucket tensor's length says the bucket ends (a
  bucket closes after the parameter that fills it, or before an embedding shared between
  stages, which megatron-core buckets alone: tied to the output layer, or copied to the
  prediction depths).

A layout that does not account for every stored bucket exactly is refused in one line, and
so is one whose fp32 masters are not the model's weights (checked as each parameter is read,
checkpoint/megatron/tensors.py): the state is read only where the rebuilt layout is
megatron-core's. Chained optimizers (the experts' beside the rest, under EP > 1) add their
`chained_{i}.` prefix, and the experts' buffers are numbered by the expert-TP x EP x PP rank.
GPT models with standard or multi-latent attention, dense or mixture-of-experts, with
multi-token prediction, and hybrids of Mamba, attention, MLP and expert layers (a Mamba
mixer's in_proj and conv1d stored a section at a time: one parameter here, `whole_sizes`; its
parameters in megatron-core 0.16's order or newer Megatron-LM's, `conv_own`, which the reader
tells apart, checkpoint/megatron/tensors.py) are laid out (tests/tools/test_megatron_buckets.py
compares with megatron-core's own buffers); not (refused as such): gated delta nets, a
hybrid's multi-token prediction, prediction depths over stages with tied or learned
embeddings (megatron-core 0.16 saves no such), `--overlap-param-gather-with-optimizer-step`'s
optimizer per chunk.
"""

from __future__ import annotations

import io
import math
import re
import warnings
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from threefold.checkpoint.megatron.format import arg_size, saved_chunks, saved_layers
from threefold.checkpoint.megatron.optimizer import MegatronOptimizer, find_loss_scaler, find_step
from threefold.checkpoint.megatron.param_order import (
    BUFFERS,
    MTP,
    MTP_ORDER,
    OUTSIDE_LAYERS,
    SECTIONS,
    layer_order,
    tp_split_dim,
)
from threefold.config import ConfigError

BUCKET = re.compile(
    r"^((?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+\.gbuf_idx_\d+\.dtype_.+"
    r"\.bucket_idx_\d+)\.(param|exp_avg|exp_avg_sq)$"
)
_STEM = re.compile(
    r"^((?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+\.gbuf_idx_\d+)\.dtype_(.+)"
    r"\.bucket_idx_(\d+)$"
)
# The distributed optimizer's objects of the first model-parallel rank: its own state_dict
# (parameter groups with the step), and fp16's loss scaler beside it
_OPTIMIZER_OBJECT = r"^(?:chained_0\.)?optimizer\.distributed\.dp_group_idx_0\.{}/"
_ALIGNMENT = 64  # megatron-core's `_pad_start_of_param_if_needed`
_EMBEDDING = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class Piece:
    """A parameter's place on one saved TP rank: the bucket tensor's key without its field,
    the first element and the number of elements."""

    stem: str
    start: int
    numel: int
    dim: int | None = None  # the dimension the saved TP ranks split it along (None: whole)


@dataclass(frozen=True)
class _Param:
    key: str | None  # the model tensor (None: a tied output layer's copy, not stored)
    index: tuple[int, ...]
    numel: int  # on one TP rank
    tp_rank: int
    order: tuple
    dim: int | None


def has_buckets(sizes: dict[str, tuple]) -> bool:
    return any(BUCKET.match(key) for key in sizes)


def _layer_order(rest: str, expert: int | None, saved: _Saved) -> tuple:
    order = layer_order(rest, expert, saved.te_spec, saved.mla, saved.grouped, saved.conv_own)
    if order is None:
        raise _Unknown(rest)
    return order


class _Unknown(Exception):
    pass


# a stacked layers' key (`decoder.layers.X`, not `decoder.layers.{i}.X`)
_STACKED = re.compile(r"^decoder\.layers\.\D")


@dataclass
class _Saved:
    """The saving run's layout, from its args."""

    tp: int
    pp: int
    ep: int
    etp: int
    te_spec: bool
    grouped: bool
    tied: bool
    mla: bool
    mtp: bool  # multi-token prediction depths
    chunks: list[tuple[int, int, bool]]  # format.saved_chunks'
    conv_own: bool = False  # (param_order.py)

    @classmethod
    def of(cls, args: dict, conv_own: bool = False) -> _Saved:
        def size(name: str, default: int = 1) -> int:
            return arg_size(args, name, default)

        if args.get("overlap_param_gather_with_optimizer_step"):
            raise _Unknown("--overlap-param-gather-with-optimizer-step")
        parallel, _ = saved_layers(args)
        tp = parallel.tensor_model_parallel_size
        try:
            chunks = saved_chunks(args)
        except ConfigError as error:  # (a layout string megatron-core would not parse)
            raise _Unknown(str(error)) from None
        return cls(
            tp=tp,
            pp=parallel.pipeline_model_parallel_size,
            ep=size("expert_model_parallel_size"),
            etp=size("expert_tensor_parallel_size", tp),
            te_spec=args.get("transformer_impl", "transformer_engine") != "local",
            grouped=bool(args.get("moe_grouped_gemm")),
            tied=not args.get("untie_embeddings_and_output_weights"),
            mla=bool(args.get("multi_latent_attention")),
            mtp=bool(args.get("mtp_num_layers")),
            chunks=chunks,
            conv_own=conv_own,
        )


@dataclass(frozen=True)
class _Stored:
    """A parameter as the checkpoint's model tensors hold it: the key, its slice (layer and
    expert, as megatron_key indexes), the layer, the expert, the name within the layer (or
    the key) and the whole tensor's number of elements."""

    key: str | None
    index: tuple[int, ...]
    layer: int | None
    expert: int | None
    rest: str
    numel: int
    depth: int | None = None  # a multi-token prediction layer's


def sectioned(key: str) -> tuple[str, str] | None:
    """(the parameter's key, the section) of a key megatron-core stores a section of a
    parameter under (`SECTIONS`: a layer's, stacked or not, a multi-token prediction
    depth's), else None."""
    base, _, section = key.rpartition(".")
    for rest, sections in SECTIONS.items():
        if section in sections and base.endswith("." + rest):
            return base, section
    return None


def whole_sizes(sizes: dict[str, tuple]) -> dict[str, tuple]:
    """The model tensors' shapes with a parameter stored a section at a time under its own key,
    whole (its sections' rows together)."""
    whole = {}
    for key, size in sizes.items():
        found = sectioned(key)
        if found is None:
            whole[key] = size
            continue
        rows = 1 if _STACKED.match(found[0]) else 0  # (after the layer index)
        before = whole.get(found[0])
        if before is not None:
            size = size[:rows] + (before[rows] + size[rows],) + size[rows + 1 :]
        whole[found[0]] = size
    return whole


def _stored_parameters(sizes: dict[str, tuple]) -> list[_Stored]:
    """Each parameter the model tensors hold, a layer's and an expert's slice at a time."""
    found = []
    for key, size in whole_sizes(sizes).items():
        if key.startswith(("optimizer.", "chained_")) or key.endswith(BUFFERS):
            continue
        numel = math.prod(size)
        if key.startswith("decoder.layers."):
            rest = key[len("decoder.layers.") :]
            head, _, tail = rest.partition(".")
            per_layer = head.isdigit()
            layers = [int(head)] if per_layer else range(size[0])
            rest = tail if per_layer else rest
            inner = size[0 if per_layer else 1 :]
            experts = rest.startswith("mlp.experts.experts.")
            for layer in layers:
                index = () if per_layer else (layer,)
                for expert in range(inner[0]) if experts else (None,):
                    shape = inner[1:] if experts else inner
                    own = index + (() if expert is None else (expert,))
                    found.append(_Stored(key, own, layer, expert, rest, math.prod(shape)))
        elif key.rsplit(".", 1)[0] in OUTSIDE_LAYERS:
            found.append(_Stored(key, (), None, None, key, numel))
        elif MTP.match(key):
            depth, rest = MTP.match(key).groups()
            experts = rest.startswith("transformer_layer.mlp.experts.experts.")
            for expert in range(size[0]) if experts else (None,):
                index, each = ((expert,), numel // size[0]) if experts else ((), numel)
                found.append(_Stored(key, index, None, expert, rest, each, int(depth)))
        else:
            raise _Unknown(key)
    return found


def _buffers(sizes: dict[str, tuple], saved: _Saved) -> dict[str, list[list[_Param]]]:
    """Each optimizer's buffers, in order, by the stored prefix of their keys: the parameters
    of each (in registration order)."""
    stored = _stored_parameters(sizes)
    experts_total = max((p.expert for p in stored if p.expert is not None), default=-1) + 1
    local_experts = experts_total // saved.ep if experts_total else 0
    embedding = next((p for p in stored if p.key == _EMBEDDING), None)
    if saved.mtp and saved.pp > 1:
        # (megatron-core 0.16 cannot save tied embeddings so; its depths' stage would keep
        # learned positions of its own)
        if saved.tied or any(p.key.startswith("embedding.position_") for p in stored):
            raise _Unknown("prediction depths over stages, with tied or learned embeddings")
    buffers: dict[str, list[list[_Param]]] = {}
    chunks_of = _chunks(saved)
    for pp_rank in range(saved.pp):
        dense_buffers, expert_buffers = {}, {}
        for chunk in chunks_of[pp_rank]:
            mine = [s for s in stored if chunk.holds(s)]
            if chunk.post and saved.tied and not chunk.pre and embedding is not None:
                # the tied output layer's copy of the embedding, in a bucket alone
                mine.append(_Stored(None, (), None, None, "output_layer.weight", embedding.numel))
            if chunk.mtp and not chunk.pre and embedding is not None:
                # the prediction depths' copy of it (megatron-core's `mtp_process`), likewise
                mine.append(_Stored(None, (), None, None, _EMBEDDING, embedding.numel))
            # Without expert parallelism the experts' gradients are reduced over DP like the
            # rest (megatron-core's `allreduce` attribute), so they share the rest's buffer.
            separate = saved.ep > 1
            if experts_total and not separate and saved.etp != saved.tp:
                raise _Unknown("experts split over another TP size without EP")
            for tp_rank in range(saved.tp):
                dense = [
                    _param(s, tp_rank, saved.tp, saved)
                    for s in mine
                    if s.expert is None or not separate
                ]
                prefix = f"optimizer.distributed.dp_group_idx_{tp_rank + saved.tp * pp_rank}"
                dense_buffers.setdefault(prefix, []).append(dense)
            for ep_rank in range(saved.ep if experts_total and separate else 0):
                held = range(ep_rank * local_experts, (ep_rank + 1) * local_experts)
                for etp_rank in range(saved.etp):
                    experts = [
                        _param(s, etp_rank, saved.etp, saved)
                        for s in mine
                        if s.expert is not None and s.expert in held
                    ]
                    if experts:
                        rank = etp_rank + saved.etp * (ep_rank + saved.ep * pp_rank)
                        prefix = f"optimizer.distributed.dp_group_idx_{rank}"
                        expert_buffers.setdefault(f"chained_1.{prefix}", []).append(experts)
        # A stage with experts chains two optimizers, each key under its index.
        chained = "chained_0." if expert_buffers else ""
        buffers.update({chained + k: v for k, v in dense_buffers.items()})
        buffers.update(expert_buffers)
    return buffers


@dataclass(frozen=True)
class _Chunk:
    """What a model chunk of the saving run holds: layers [offset, offset + count), the
    embedding (`pre`), the output layer (`post`), the prediction depths (`mtp`) and the final
    norm (`final_norm`)."""

    offset: int
    count: int
    pre: bool
    post: bool
    mtp: bool
    final_norm: bool

    def holds(self, stored: _Stored) -> bool:
        if stored.layer is not None:
            return self.offset <= stored.layer < self.offset + self.count
        key = stored.key
        return (
            (self.pre and key.startswith("embedding."))
            or (
                self.final_norm
                and key.startswith(("decoder.final_layernorm.", "decoder.final_norm."))
            )
            or (self.post and key.startswith("output_layer."))
            or (self.mtp and key.startswith("mtp."))
        )


def _chunks(saved: _Saved) -> list[list[_Chunk]]:
    """Each pipeline rank's model chunks, in order (format.saved_chunks': chunk g is virtual
    stage g // PP of rank g % PP). With prediction depths, megatron-core puts the final norm
    beside the last layer, and the depths' stage (the last, or one of their own) keeps a copy
    of the embedding."""
    last_layer = max((g for g, (_, count, _) in enumerate(saved.chunks) if count), default=0)
    chunks: list[list[_Chunk]] = [[] for _ in range(saved.pp)]
    for g, (offset, count, depths) in enumerate(saved.chunks):
        post = g == len(saved.chunks) - 1
        final_norm = g == last_layer if saved.mtp else post
        chunks[g % saved.pp].append(_Chunk(offset, count, g == 0, post, depths, final_norm))
    return chunks


def _param(stored: _Stored, tp_rank: int, tp: int, saved: _Saved) -> _Param:
    """A stored parameter's share on one TP rank of a saved buffer."""
    split = tp_split_dim(stored.rest, saved.te_spec) is not None
    if split and stored.numel % tp:
        raise _Unknown(stored.rest)
    # The model's parts in order: embeddings (0), layers (1), final norm (2), multi-token
    # prediction (3), output layer (4).
    if stored.depth is not None:
        module, _, rest = stored.rest.partition(".")
        where = MTP_ORDER.index(module + ".")
        inner = _layer_order(rest, stored.expert, saved) if module == "transformer_layer" else ()
        order = (3, stored.depth, (where, inner, rest.endswith("bias")))
    elif stored.layer is None:
        module = OUTSIDE_LAYERS.index(stored.rest.rsplit(".", 1)[0])
        order = ((0, 0, 2, 4, 2)[module], module, stored.rest.endswith("bias"))
    else:
        order = (1, stored.layer, _layer_order(stored.rest, stored.expert, saved))
    numel = stored.numel // tp if split and tp > 1 else stored.numel
    dim = tp_split_dim(stored.rest, saved.te_spec) if tp > 1 else None
    return _Param(stored.key, stored.index, numel, tp_rank if split else 0, order, dim)


def _placed(params: list[_Param], stem: str, bucket_sizes: list[int]) -> dict:
    """Each parameter's piece in the buckets megatron-core fills from the last parameter
    backwards; the stored bucket lengths say where each bucket ends."""
    pieces, bucket, position, filled = {}, 0, 0, False
    ordered = sorted(params, key=lambda p: p.order, reverse=True)
    for param, following in zip(ordered, ordered[1:]):
        if param.order == following.order:  # two parameters of no known order
            raise _Unknown(f"{param.key} and {following.key}: their order")
    for param in ordered:
        start = -(-position // _ALIGNMENT) * _ALIGNMENT
        if filled and bucket < len(bucket_sizes) and start == bucket_sizes[bucket]:
            bucket, start, filled = bucket + 1, 0, False  # (a tied embedding's own bucket)
        if bucket >= len(bucket_sizes) or start + param.numel > bucket_sizes[bucket]:
            raise _Unknown(f"{stem}: bucket {bucket}")
        piece = Piece(stem.format(bucket=bucket), start, param.numel, param.dim)
        if param.key is not None:
            pieces.setdefault((param.key, param.index), {})[param.tp_rank] = piece
        position, filled = start + param.numel, True
        if position == bucket_sizes[bucket]:
            bucket, position, filled = bucket + 1, 0, False
    if bucket != len(bucket_sizes):
        raise _Unknown(f"{stem}: {len(bucket_sizes) - bucket} buckets left over")
    return pieces


def _bucket_size(args: dict, prefix: str, gbuf: int, saved: _Saved) -> int | None:
    """The elements after which megatron-core's DDP closes a bucket of one gradient buffer:
    none without --overlap-grad-reduce, on a pipeline stage after the first or in a model
    chunk after the first (Megatron-LM's `disable_bucketing`); else --ddp-bucket-size or
    megatron-core's default, max(40M, 1M x the data-parallel size)."""
    if args.get("ddp_num_buckets") or args.get("overlap_param_gather_with_optimizer_step"):
        raise _Unknown("--ddp-num-buckets" if args.get("ddp_num_buckets") else "its chunks")
    rank = int(prefix.rsplit("_", 1)[1])
    stage = rank // (saved.etp * saved.ep if prefix.startswith("chained_1.") else saved.tp)
    if not args.get("overlap_grad_reduce") or stage > 0 or gbuf > 0:
        return None
    if isinstance(args.get("ddp_bucket_size"), int):
        return args["ddp_bucket_size"]
    model_parallel = saved.tp * saved.pp * arg_size(args, "context_parallel_size")
    return max(40_000_000, 1_000_000 * (arg_size(args, "world_size") // model_parallel))


def _formed(params: list[_Param], bucket_size: int | None, saved: _Saved) -> list[int]:
    """The unpadded lengths of the buckets megatron-core's `_ParamAndGradBuffer` forms from a
    buffer's parameters: filled from the last backwards, each at a multiple of 64 elements,
    a bucket closing once it holds `bucket_size` elements, and a tied embedding's copy (under
    PP) in a bucket of its own."""
    lengths, position, filling = [], 0, False
    for param in sorted(params, key=lambda p: p.order, reverse=True):
        start = -(-position // _ALIGNMENT) * _ALIGNMENT
        shared = (saved.tied or saved.mtp) and saved.pp > 1 and param.key in (None, _EMBEDDING)
        if shared and filling:
            lengths.append(start)
            start = 0
        end, filling = start + param.numel, True
        if (bucket_size is not None and end >= bucket_size) or shared:
            lengths.append(end)
            position, filling = 0, False
        else:
            position = end
    return lengths + [position] if filling else lengths


def formed_buckets(
    sizes: dict[str, tuple], args: dict, conv_own: bool = False
) -> dict[str, list[int]]:
    """{a gradient buffer's key prefix: its buckets' unpadded lengths}, formed as
    megatron-core forms them from the model tensors `sizes` and the saving run's args (for
    Megatron-LM's legacy format, whose buffers do not record them); {} where no layout is
    rebuilt. (`conv_own`: param_order.py's)"""
    try:
        saved = _Saved.of(args, conv_own)
        return {
            f"{prefix}.gbuf_idx_{g}": _formed(params, _bucket_size(args, prefix, g, saved), saved)
            for prefix, chunks in _buffers(sizes, saved).items()
            for g, params in enumerate(p for p in chunks if p)
        }
    except _Unknown:
        return {}


class BucketLayout:
    """(model key, index) -> {saved TP rank: Piece} for every stored parameter; `reason`: why
    no layout was rebuilt (None when one was). `conv_own`: param_order.py's."""

    def __init__(self, sizes: dict[str, tuple], args: dict, conv_own: bool = False) -> None:
        self.pieces: dict[tuple[str, tuple[int, ...]], dict[int, Piece]] = {}
        self.reason: str | None = None
        try:
            self._rebuild(sizes, _Saved.of(args, conv_own))
        except _Unknown as unknown:
            self.reason = f"its buckets could not be laid out as megatron-core's ({unknown})"
            self.pieces = {}

    def _rebuild(self, sizes: dict[str, tuple], saved: _Saved) -> None:
        stored: dict[tuple[str, int], dict[int, int]] = {}  # (buffer, gbuf) -> bucket sizes
        dtypes = {}
        for key, size in sizes.items():
            match = BUCKET.match(key)
            if match:
                stem = _STEM.match(match.group(1))
                gbuf = stem.group(1)
                stored.setdefault(gbuf, {})[int(stem.group(3))] = size[0]
                dtypes[gbuf] = stem.group(2)
        expected = set()
        for prefix, chunks in _buffers(sizes, saved).items():
            for g, params in enumerate(p for p in chunks if p):
                gbuf = f"{prefix}.gbuf_idx_{g}"
                expected.add(gbuf)
                lengths = stored.get(gbuf)
                if lengths is None or sorted(lengths) != list(range(len(lengths))):
                    raise _Unknown(f"no buckets stored for {gbuf}")
                stem = f"{gbuf}.dtype_{dtypes[gbuf]}.bucket_idx_{{bucket}}"
                placed = _placed(params, stem, [lengths[b] for b in range(len(lengths))])
                for where, by_rank in placed.items():  # (a whole tensor: TP rank 0's copy)
                    for rank, piece in by_rank.items():
                        self.pieces.setdefault(where, {}).setdefault(rank, piece)
        if set(stored) - expected:
            raise _Unknown(f"{sorted(set(stored) - expected)[0]} belongs to no parameter")


def dp_reshardable_optimizer(reader, keys, sizes: dict[str, tuple], args: dict):
    """The MegatronOptimizer of a dp_reshardable checkpoint: readable where its layout is
    rebuilt, with Adam's step and the fp16 loss scaler from the optimizer's own state."""
    layout = BucketLayout(sizes, args)
    if layout.reason is not None:
        return MegatronOptimizer("dp_reshardable", False, reason=layout.reason)
    try:  # (a weights-only load does without it: refused only when Adam's state is loaded)
        state = optimizer_object(reader, keys)
    except ConfigError as error:
        return MegatronOptimizer("dp_reshardable", False, reason=f"{error}")
    step = find_step(state)
    if step is None:
        return MegatronOptimizer("dp_reshardable", False, reason="it holds no Adam step")
    scaler = optimizer_object(reader, keys, "grad_scaler")
    if isinstance(scaler, list) and scaler:  # (megatron-core's: a list of its one state)
        scaler = scaler[0]
    scaler = find_loss_scaler({"grad_scaler": scaler})
    return MegatronOptimizer("dp_reshardable", True, step, scaler)


class _ObjectPlanner(DefaultLoadPlanner):
    """Reads megatron-core's ShardedObjects (torch.save'd) with `weights_only=True`."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)
        self.loaded: dict = {}

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.loaded[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def optimizer_object(reader, keys, part: str = "optimizer") -> object | None:
    """One of the distributed optimizer's objects of the first model-parallel rank: its own
    state_dict (`optimizer`: parameter groups, Adam's step) or fp16's loss scaler's
    (`grad_scaler`), or None."""
    pattern = re.compile(_OPTIMIZER_OBJECT.format(part))
    key = next((k for k in keys if pattern.match(k)), None)
    if key is None:
        return None
    planner = _ObjectPlanner()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load({key: io.BytesIO()}, storage_reader=reader, planner=planner, no_dist=True)
        except (Exception, CheckpointException) as error:  # a pickle naming more than data
            raise ConfigError(
                f"its optimizer state {key} is refused ({type(error).__name__}: it holds more "
                "than plain data)"
            ) from None
    return planner.loaded.get(key)
