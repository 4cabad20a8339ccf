"""The distributed optimizer's state in Megatron-LM's legacy format: `distrib_optim.pt`.

Beside each model-parallel rank's model_optim_rng.pt, Megatron-LM's distributed optimizer
writes its gradient buffers gathered over data parallelism (megatron-core's
`get_parameter_state_dp_zero`): per buffer `g`, one flat tensor per field (`param`, the fp32
masters; `exp_avg`; `exp_avg_sq`) and `numel_unpadded`, its buckets one after another with
their end padding cut, a list of two such states where the experts chain an optimizer of their
own. It is the dp_reshardable layout (checkpoint/megatron/buckets.py) with the buckets joined,
and what it does not record — where each bucket ends — megatron-core's DDP decides from the
args (`formed_buckets`: --overlap-grad-reduce, --ddp-bucket-size). So the layout is rebuilt as
for dp_reshardable, checked to add up to every stored buffer's length, and each parameter's
range of a field is read at its place in the file; the load then checks its fp32 masters
against the weights, as for dp_reshardable.
"""

from __future__ import annotations

import os
import re
import zipfile

import torch

from threefold.checkpoint.megatron.buckets import BucketLayout, Piece, formed_buckets, tp_split_dim
from threefold.checkpoint.megatron.common_file import StoredTensor, read_torch_file
from threefold.checkpoint.megatron.legacy import legacy_files, saved_sizes
from threefold.config import ConfigError

FILE = "distrib_optim.pt"
_FIELDS = ("param", "exp_avg", "exp_avg_sq")
_STEM = re.compile(r"^(.+)\.dtype_.+\.bucket_idx_(\d+)$")


class LegacyBuffers:
    """The distributed optimizer's buffers of a legacy checkpoint laid out: `pieces` as
    BucketLayout's ((model key, index) -> {saved TP rank: Piece}); `reason`: why not (None
    when they are)."""

    def __init__(self, path: str, args: dict, model_sizes: dict[str, tuple]) -> None:
        self.path = path
        self.pieces: dict = {}
        self.reason: str | None = None
        # a buffer's key prefix -> (file, {field: flat tensor}, its length)
        self.flat: dict[str, tuple[str, dict[str, StoredTensor], int]] = {}
        self._archives: dict[str, zipfile.ZipFile] = {}
        self.lengths = formed_buckets(model_sizes, args)
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
        layout = BucketLayout(sizes, args)
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
        shape = list(shards[min(shards)][1].shape)
        dim = tp_split_dim(key, te_spec)
        if dim is not None:
            shape[dim] *= len(shards)
        sizes[key] = (num_experts, *shape) if expert else tuple(shape)
    return sizes
