"""Megatron-LM's default dp_reshardable optimizer layout, rebuilt from a checkpoint's keys
(threefold/checkpoint/megatron/buckets.py), against megatron-core's own gradient buffers: a
GPT-2-style model (tied embeddings, biases, LayerNorm, learned positions) at TP2 x PP2 with
small buckets, so that the first stage fills several buckets and both stages keep their copy
of the tied embedding in a bucket of its own. Reading the state through the layout is shown
in test_megatron_checkpoints.py and test_megatron_moe_checkpoints.py (training goes on as in
megatron-core)."""

from __future__ import annotations

import re

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
                assert tensor_parallel == 1  # (its global shape is then the parameter's)
                expert = re.search(r"local_experts\.(\d+)\.", name)
                experts = (model.config.num_moe_experts,) if expert else ()
                sizes[sharded.key] = experts + tuple(sharded.data.shape)
                local = model.config.num_moe_experts // expert_parallel if expert else 0
                ep_rank = parallel_state.get_expert_model_parallel_rank()
                index = (ep_rank * local + int(expert.group(1)),) if expert else ()
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


def test_the_rebuilt_layout_is_megatron_cores_own():
    from tests.megatron_core_models import megatron_args
    from threefold.checkpoint.megatron.buckets import BucketLayout

    args = vars(megatron_args("gpt2", 2, 2))
    sizes, expected, rebuilt = _layouts(run_distributed(4, megatron_buffers, "gpt2", 2, 2), args)
    assert sum(key.endswith(".param") for key in sizes) > 4  # several buckets, as meant
    assert rebuilt == expected
    # A different spec puts the input norm elsewhere: the lengths still add up here, the
    # places do not (what the load's check of the fp32 masters against the weights catches).
    args["transformer_impl"] = "transformer_engine"
    other = BucketLayout(sizes, args)
    assert (
        other.reason is not None
        or other.pieces != BucketLayout(sizes, vars(megatron_args("gpt2", 2, 2))).pieces
    )


def test_the_experts_buffers_are_megatron_cores_own():
    """A mixture of experts at EP2 (a dense first layer, a shared expert): the experts' own
    buffers under a second chained optimizer, numbered by expert-TP x EP x PP rank."""
    from tests.megatron_core_models import megatron_args

    args = vars(megatron_args("moe", 1, 1)) | {"expert_model_parallel_size": 2}
    results = run_distributed(2, megatron_buffers, "moe", 1, 1, 2)
    sizes, expected, rebuilt = _layouts(results, args)
    assert any(key.startswith("chained_1.") for key in sizes)
    assert rebuilt == expected
