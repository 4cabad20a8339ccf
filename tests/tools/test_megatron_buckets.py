"""Megatron-LM's default dp_reshardable optimizer layout, rebuilt from a checkpoint's keys
(threefold/checkpoint/megatron/buckets.py), against megatron-core's own gradient buffers: a
GPT-2-style model (tied embeddings, biases, LayerNorm, learned positions) at TP2 x PP2 with
small buckets, so that the first stage fills several buckets and both stages keep their copy
of the tied embedding in a bucket of its own. Reading the state through the layout is shown
in test_megatron_checkpoints.py and test_megatron_moe_checkpoints.py (training goes on as in
megatron-core)."""

from __future__ import annotations

import re

import pytest

from tests.distributed import run_distributed

BUCKET_SIZE = 6000  # elements: the first stage's layers span several buckets
DTYPE = "(torch.float32, torch.float32)"


def megatron_buffers(
    kind: str, tensor_parallel: int, pipeline_parallel: int, expert_parallel: int = 1
) -> tuple[dict, dict]:
    """On this rank of megatron-core's model `kind` with its distributed optimizer's DDP: the
    global shape of each model tensor of its sharded state dict and each bucket's unpadded
    length under its stored key; {(key, index, TP rank): (bucket key, start within the
    bucket, numel)} of each parameter in its gradient buffers (the experts' own under EP)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from tests.megatron_core_models import build, cpu_patches, optimizer_patches

    with cpu_patches(), optimizer_patches():
        model = build(kind, tensor_parallel, pipeline_parallel, expert_parallel=expert_parallel)
        stored = {}  # a tensor's address -> (key, index): its place in the checkpoint
        sizes = {}
        for name, sharded in model.sharded_state_dict().items():
            if isinstance(sharded, ShardedTensor):
                sizes[sharded.key] = tuple(sharded.global_shape)
                index = tuple(sharded.global_offset[: sharded.prepend_axis_num])
                stored[sharded.data.data_ptr()] = (sharded.key, index)
            elif isinstance(sharded, ShardedTensorFactory):  # SwiGLU's fc1: its place by name
                assert pipeline_parallel == 1  # (its layer numbers are the model's)
                expert = re.search(r"local_experts\.(\d+)\.", name)
                layer = re.match(r"decoder\.layers\.(\d+)\.", name)
                stacked = re.match(r"decoder\.layers\.\D", sharded.key) is not None
                rows, *others = sharded.data.shape  # (split over TP by rows)
                index, shape = (), (rows * tensor_parallel, *others)
                if expert:
                    local = model.config.num_moe_experts // expert_parallel
                    ep_rank = parallel_state.get_expert_model_parallel_rank()
                    index, shape = (
                        (ep_rank * local + int(expert.group(1)),),
                        (local * expert_parallel, *shape),
                    )
                if stacked:
                    index, shape = (int(layer.group(1)), *index), (model.config.num_layers, *shape)
                sizes[sharded.key] = shape
                stored[sharded.data.data_ptr()] = (sharded.key, index)
        # (before the DDP wrapper moves every parameter into its buffer)
        where = {param: stored.get(param.data_ptr()) for param in model.parameters()}
        names = {param: name for name, param in model.named_parameters()}
        config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=BUCKET_SIZE
        )
        ddp = DistributedDataParallel(model.config, config, model)
        chained = bool(ddp.expert_parallel_buffers)  # two optimizers: each key under its index
        dense = parallel_state.get_model_parallel_group().rank()
        experts = parallel_state.get_expert_tensor_model_pipeline_parallel_group().rank()
        placed = {}
        for optimizer, buffers, rank, tp_rank in (
            (0, ddp.buffers, dense, parallel_state.get_tensor_model_parallel_rank()),
            (
                1,
                ddp.expert_parallel_buffers,
                experts,
                parallel_state.get_expert_tensor_parallel_rank(),
            ),
        ):
            prefix = f"chained_{optimizer}." if chained else ""
            for (buffer,) in [buffers] if buffers else []:
                stem = f"{prefix}optimizer.distributed.dp_group_idx_{rank}.gbuf_idx_0.dtype_{DTYPE}"
                for param, (start, end, bucket) in buffer.param_index_map.items():
                    # (the last stage's copy of the tied embedding is stored as the first's)
                    if names[param].startswith("output_layer.") and where[param][0].startswith(
                        "embedding."
                    ):
                        continue
                    split = getattr(param, "tensor_model_parallel", False)
                    placed[where[param] + (tp_rank if split else 0,)] = (
                        f"{stem}.bucket_idx_{bucket}",
                        start - buffer.bucket_indices[bucket][0],
                        end - start,
                    )
                for b, bucket in enumerate(buffer.buckets):
                    sizes[f"{stem}.bucket_idx_{b}.param"] = (bucket.numel_unpadded,)
    return sizes, placed


def _layouts(results: list, args: dict) -> tuple[dict, dict, dict]:
    """(the stored sizes, megatron-core's places and the rebuilt ones) from every rank's
    `megatron_buffers` and the args."""
    from threefold.checkpoint.megatron.buckets import BucketLayout

    sizes, expected = {}, {}
    for rank_sizes, placed in results:
        sizes |= rank_sizes
        for where, piece in placed.items():  # (a whole tensor: TP rank 0's copy)
            expected.setdefault(where, piece)
    layout = BucketLayout(sizes, args)
    assert layout.reason is None
    rebuilt = {
        (key, index, rank): (piece.stem, piece.start, piece.numel)
        for (key, index), pieces in layout.pieces.items()
        for rank, piece in pieces.items()
    }
    return sizes, expected, rebuilt


@pytest.mark.parametrize(
    "kind,tp,pp,ep",
    [
        ("gpt2", 2, 2, 1),  # tied embeddings, biases, LayerNorm, learned positions
        ("mla", 2, 1, 1),  # multi-latent attention (the local spec splits its down projections)
        ("moe_mtp", 1, 1, 2),  # experts in buffers of their own, multi-token prediction
        ("gpt_oss", 1, 1, 2),  # softmax sinks, biased experts and router
    ],
    ids=["gpt2-tp2-pp2", "mla-tp2", "moe-mtp-ep2", "gpt-oss-ep2"],
)
def test_the_rebuilt_layout_is_megatron_cores_own(kind, tp, pp, ep):
    """Every parameter's bucket, offset and length on every saved rank, as megatron-core's
    `_ParamAndGradBuffer` placed it (with EP > 1 the experts' buffers under `chained_1.`)."""
    from tests.megatron_core_models import megatron_args
    from threefold.checkpoint.megatron.buckets import BucketLayout

    args = vars(megatron_args(kind, tp, pp)) | {"expert_model_parallel_size": ep}
    results = run_distributed(tp * pp * ep, megatron_buffers, kind, tp, pp, ep)
    sizes, expected, rebuilt = _layouts(results, args)
    assert sum(key.endswith(".param") for key in sizes) > 4  # several buckets, as meant
    assert any(key.startswith("chained_1.") for key in sizes) == (ep > 1)
    assert rebuilt == expected
    if kind == "gpt2":
        # Transformer Engine's spec puts the input norm after linear_proj: the lengths still
        # add up here, the places do not (the load's check of the masters catches that).
        other = BucketLayout(sizes, args | {"transformer_impl": "transformer_engine"})
        assert other.reason is None and other.pieces != BucketLayout(sizes, args).pieces


class _Marker:
    """Unpickling this would create a file: what a crafted checkpoint could do instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_the_optimizers_saved_state_is_read_without_running_code(tmp_path):
    """The distributed optimizer's own state (Adam's step) is a pickle inside the shards:
    one that names a callable is refused in one line, and the callable never runs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from threefold.checkpoint.megatron.buckets import optimizer_object
    from threefold.config import ConfigError
    from threefold.safe_loading import SafeFileSystemReader

    key = "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"
    marker = tmp_path / "ran"
    for value, fine in (([{"param_groups": [{"step": 3.0}]}], True), (_Marker(str(marker)), False)):
        path = tmp_path / ("fine" if fine else "crafted")
        planner = DefaultSavePlanner(flatten_state_dict=False)  # (one torch.save'd object)
        dcp.save({key: value}, checkpoint_id=str(path), planner=planner, no_dist=True)
        reader = SafeFileSystemReader(str(path))
        keys = reader.read_metadata().state_dict_metadata.keys()
        if fine:
            assert optimizer_object(reader, keys) == value
        else:
            with pytest.raises(ConfigError, match="holds more than plain data") as error:
                optimizer_object(reader, keys)
            assert "\n" not in str(error.value)
    assert not marker.exists()
