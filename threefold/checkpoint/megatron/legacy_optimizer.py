"""Adam's state in Megatron-LM's legacy format: the distributed optimizer's `distrib_optim.pt`
(`LegacyBuffers`), the non-distributed optimizer's in model_optim_rng.pt (`LegacyPlainState`).

Beside each model-parallel rank's model_optim_rng.pt, Megatron-LM's distributed optimizer
writes its gradient buffers gathered over data parallelism (megatron-core's
`get_parameter_state_dp_zero`): per buffer `g`, one flat tensor per field (`param`, the fp32
masters; `exp_avg`; `exp_avg_sq`) and `numel_unpadded`, its buckets one after another with
their end padding cut, a list of two such states where the experts chain an optimizer of their
own. It is the dp_reshardable layout (checkpoint/megatron/buckets.py) with the buckets joined,
and what it does not record — where each bucket ends — megatron-core's DDP decides from the
args (`formed_buckets`: --overlap-grad-reduce, --ddp-bucket-size; a bucket's end cuts only the
padding before the next parameter, so it matters only where a size is no multiple of 64). So
the layout is rebuilt as for dp_reshardable, checked to add up to every stored buffer's
length, and each parameter's range of a field is read at its place in the file; the load then
checks its fp32 masters against the weights, as for dp_reshardable.
"""

from __future__ import annotations

import os
import re
import zipfile

import torch

from threefold.checkpoint.megatron.buckets import BucketLayout, Piece, formed_buckets
from threefold.checkpoint.megatron.common_file import StoredTensor, read_torch_file
from threefold.checkpoint.megatron.legacy import legacy_files, saved_sizes
from threefold.checkpoint.megatron.param_order import tp_split_dim
from threefold.config import ConfigError

FILE = "distrib_optim.pt"
_FIELDS = ("param", "exp_avg", "exp_avg_sq")
_STEM = re.compile(r"^(.+)\.dtype_.+\.bucket_idx_(\d+)$")


class LegacyBuffers:
    """The distributed optimizer's buffers of a legacy checkpoint laid out: `pieces` as
    BucketLayout's ((model key, index) -> {saved TP rank: Piece}); `reason`: why not (None
    when they are). `conv_own`: param_order.py's, told by the files' keys."""

    def __init__(
        self, path: str, args: dict, model_sizes: dict[str, tuple], conv_own: bool = False
    ) -> None:
        self.path = path
        self.pieces: dict = {}
        self.reason: str | None = None
        # a buffer's key prefix -> (file, {field: flat tensor}, its length)
        self.flat: dict[str, tuple[str, dict[str, StoredTensor], int]] = {}
        self._archives: dict[str, zipfile.ZipFile] = {}
        self.lengths = formed_buckets(model_sizes, args, conv_own)
        if not self.lengths:
            self.reason = "its buckets could not be laid out as megatron-core's"
            return
        tp, _, ep = saved_sizes(args)
        for (tp_rank, pp_rank, ep_rank), file in legacy_files(path, args).items():
            file = os.path.join(os.path.dirname(file), FILE)
            if os.path.isfile(file):
                self._index(file, tp_rank + tp * pp_rank, tp_rank + tp * (ep_rank + ep * pp_rank))
        if self.reason is not None:
            return
        for gbuf, lengths in self.lengths.items():
            if gbuf not in self.flat:
                self.reason = f"no {FILE} holds its buffer {gbuf}"
                return
            if sum(lengths) != self.flat[gbuf][2]:
                self.reason = f"its buffer {gbuf} is not the one megatron-core forms from its args"
                return
        extra = sorted(set(self.flat) - set(self.lengths))
        if extra:
            self.reason = f"its buffer {extra[0]} belongs to no parameter"
            return
        sizes = dict(model_sizes)
        for gbuf, lengths in self.lengths.items():
            for bucket, length in enumerate(lengths):
                sizes[f"{gbuf}.dtype_legacy.bucket_idx_{bucket}.param"] = (length,)
        layout = BucketLayout(sizes, args, conv_own)
        self.pieces, self.reason = layout.pieces, layout.reason

    def _index(self, file: str, dense: int, experts: int) -> None:
        """A file's buffers under their dp_reshardable key prefixes (`dense`, `experts`: the
        model-parallel ranks that number the dense and the experts' optimizer's buffers)."""
        state = read_torch_file(file, tensors=True)
        chained = isinstance(state, list) and len(state) > 1
        for i, optimizer in enumerate(state if isinstance(state, list) else [state]):
            if not isinstance(optimizer, dict):
                continue  # (None: that optimizer's data-parallel rank 0 wrote it elsewhere)
            if optimizer.get("buckets_coalesced") is not True:
                # (megatron-core before 0.7 saved a list per bucket, laid out otherwise)
                relative = os.path.relpath(file, self.path)
                self.reason = f"{relative} is an older megatron-core's (buckets not coalesced)"
                return
            prefix = f"chained_{i}." if chained else ""
            rank = experts if i == 1 else dense
            for gbuf, by_dtype in optimizer.items():
                if not isinstance(gbuf, int) or not isinstance(by_dtype, dict):
                    continue
                (buffer,) = by_dtype.values()  # (megatron-core: one dtype per buffer)
                fields = {f: buffer.get(f) for f in _FIELDS}
                numel = buffer.get("numel_unpadded")
                if not all(isinstance(t, StoredTensor) for t in fields.values()) or not isinstance(
                    numel, int
                ):
                    raise ConfigError(f"--load {self.path}: {file} is not a {FILE}; it is damaged")
                key = f"{prefix}optimizer.distributed.dp_group_idx_{rank}.gbuf_idx_{gbuf}"
                self.flat.setdefault(key, (file, fields, numel))

    def read(self, piece: Piece, field: str) -> torch.Tensor:
        """A parameter's elements of one of Adam's fields (`param`: the fp32 masters)."""
        found = _STEM.match(piece.stem)
        gbuf, bucket = found.group(1), int(found.group(2))
        file, fields, _ = self.flat[gbuf]
        if file not in self._archives:
            self._archives[file] = zipfile.ZipFile(file)
        start = sum(self.lengths[gbuf][:bucket]) + piece.start
        return fields[field].load_range(self._archives[file], file, start, piece.numel)


def model_sizes(index: dict, num_experts: int, te_spec: bool) -> dict[str, tuple]:
    """The whole model tensors' shapes as a torch_dist checkpoint keeps them per layer (an
    expert's under its layer's key, [experts, ...]), from a legacy checkpoint's TP shards
    (`index`: LegacyTensors')."""
    sizes = {}
    for (key, expert), shards in index.items():
        shape = whole_shape(key, shards, te_spec)
        sizes[key] = (num_experts, *shape) if expert else shape
    return sizes


def whole_shape(key: str, shards: dict, te_spec: bool) -> tuple[int, ...]:
    """A tensor's whole shape from its TP shards' records ({TP rank: (file, record)})."""
    shape = list(shards[min(shards)][1].shape)
    dim = tp_split_dim(key, te_spec)
    if dim is not None:
        shape[dim] *= len(shards)
    return tuple(shape)


class LegacyPlainState:
    """The non-distributed optimizer's state in a legacy checkpoint: each rank's
    model_optim_rng.pt holds its TP shard's Adam state as torch's Adam keeps it, by parameter
    number across its groups (a list of two such states where the experts chain an optimizer
    of their own), and under bf16/fp16 the fp32 masters group by group
    (`fp32_from_fp16_params`). megatron-core numbers the parameters as its `_get_param_groups`
    puts them: by group, each in the model chunks' parameter order, the groups told apart by
    what they record (`wd_mult`: 0 for biases and one-dimensional parameters; whether they are
    the experts', under EP > 1 only). `params`: each file's TP rank and parameters' (key,
    index, shape) in the model's order; `states`: each file's `optimizer` entry. `fields`:
    (key, index) -> {saved TP rank: {field: (file, tensor)}}; `reason`: why not read (None
    when read)."""

    def __init__(
        self,
        path: str,
        params: dict[str, tuple[int, list]],
        states: dict[str, object],
        expert_parallel: bool,
    ) -> None:
        self.path, self.expert_parallel = path, expert_parallel
        self.fields: dict = {}
        self.reason: str | None = None
        for file, (tp_rank, order) in params.items():
            state = states.get(file)
            optimizers = state if isinstance(state, list) else [state]
            for optimizer in optimizers:
                reason = self._index(file, tp_rank, order, optimizer)
                if reason is not None:
                    self.reason = f"{os.path.relpath(file, path)}: {reason}"
                    return

    def _index(self, file: str, tp_rank: int, order: list, optimizer) -> str | None:
        """One optimizer's state of a file (`order`: its parameters' (key, index, shape) in the
        model chunks' order), or why it is not megatron-core's."""
        inner = optimizer.get("optimizer", optimizer) if isinstance(optimizer, dict) else None
        if not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list):
            return "its optimizer state is not torch's Adam's"
        state, masters = inner.get("state") or {}, optimizer.get("fp32_from_fp16_params")
        if not state:  # (an fp16 run's first iterations, skipped while its loss scale falls)
            return (
                "it was saved before Adam's first step, so it holds no moments; threefold "
                "reads such a state in the torch_dist format only"
            )
        seen = set()
        for g, group in enumerate(inner["param_groups"]):
            kind = (group.get("wd_mult") == 0.0, bool(group.get("is_expert_parallel")))
            if kind in seen:
                return "two of its parameter groups hold the same kind of parameter"
            seen.add(kind)
            params = [p for p in order if _kind(p[0], p[2], self.expert_parallel) == kind]
            numbers = group.get("params") or []
            if len(numbers) != len(params):
                return f"its group {g} holds {len(numbers)} parameters, its model {len(params)}"
            for i, ((key, index, shape), number) in enumerate(zip(params, numbers)):
                each = state.get(number) or {}
                found = {f: each.get(f) for f in ("exp_avg", "exp_avg_sq")}
                if masters is not None:
                    found["master"] = masters[g][i]
                if any(getattr(t, "shape", None) != shape for t in found.values()):
                    return f"parameter {number} of its group {g} is not {key}'s shape"
                by_rank = self.fields.setdefault((key, index), {})
                by_rank.setdefault(tp_rank, {f: (file, t) for f, t in found.items()})
        return None


def _kind(key: str, shape: tuple[int, ...], expert_parallel: bool) -> tuple[bool, bool]:
    """(free of weight decay, an expert's under EP) of a parameter: megatron-core's default
    keeps biases and one-dimensional parameters free of it, and its experts' layers set their
    `allreduce` off (their own groups) only under expert parallelism."""
    expert = expert_parallel and ".mlp.experts." in key
    return key.endswith(".bias") or len(shape) == 1, expert
