"""Megatron-LM's default dp_reshardable optimizer layout, rebuilt from a checkpoint's keys
(threefold/checkpoint/megatron/buckets.py), against megatron-core's own gradient buffers: a
GPT-2-style model (tied embeddings, biases, LayerNorm, learned positions) at TP2 x PP2 with
small buckets, so that the first stage fills several buckets and both stages keep their copy
of the tied embedding in a bucket of its own. Reading the state through the layout is shown
in test_megatron_checkpoints.py and test_megatron_moe_checkpoints.py (training goes on as in
megatron-core)."""

from __future__ import annotations

from tests.distributed import run_distributed

BUCKET_SIZE = 6000  # elements: the first stage's layers span several buckets
DTYPE = "(torch.float32, torch.float32)"


def megatron_buffers(tensor_parallel: int, pipeline_parallel: int) -> tuple[dict, dict]:
    """On this rank of megatron-core's GPT-2 with its distributed optimizer's DDP: (the
    global shape of each model tensor of its sharded state dict, {(key, index): (bucket,
    start within the bucket, numel)} of each parameter in its gradient buffer) and the
    buckets' unpadded lengths under the rank's model-parallel index."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from tests.megatron_core_models import build, cpu_patches, optimizer_patches

    with cpu_patches(), optimizer_patches():
        model = build("gpt2", tensor_parallel, pipeline_parallel)
        stored = {}  # a tensor's address -> (key, index): its place in the checkpoint
        shapes = {}
        for sharded in model.sharded_state_dict().values():
            if isinstance(sharded, ShardedTensor):
                shapes[sharded.key] = tuple(sharded.global_shape)
                index = tuple(sharded.global_offset[: sharded.prepend_axis_num])
                stored[sharded.data.data_ptr()] = (sharded.key, index)
        # (before the DDP wrapper moves every parameter into its buffer)
        where = {param: stored.get(param.data_ptr()) for param in model.parameters()}
        config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=BUCKET_SIZE
        )
        ddp = DistributedDataParallel(model.config, config, model)
        (buffer,) = ddp.buffers
        rank = parallel_state.get_model_parallel_group().rank()
        stem = f"optimizer.distributed.dp_group_idx_{rank}.gbuf_idx_0.dtype_{DTYPE}"
        names = {param: name for name, param in model.named_parameters()}
        placed = {}
        for param, (start, end, bucket) in buffer.param_index_map.items():
            bucket_start = buffer.bucket_indices[bucket][0]
            found = where[param]
            # (the last stage's copy of the tied embedding is stored as the first stage's)
            if not names[param].startswith("output_layer."):
                tp_rank = parallel_state.get_tensor_model_parallel_rank()
                split = getattr(param, "tensor_model_parallel", False)
                placed[found + (tp_rank if split else 0,)] = (
                    f"{stem}.bucket_idx_{bucket}",
                    start - bucket_start,
                    end - start,
                )
        lengths = {
            f"{stem}.bucket_idx_{b}.param": (bucket.numel_unpadded,)
            for b, bucket in enumerate(buffer.buckets)
        }
    return shapes | lengths, placed


def test_the_rebuilt_layout_is_megatron_cores_own():
    from tests.megatron_core_models import megatron_args
    from threefold.checkpoint.megatron.buckets import BucketLayout

    results = run_distributed(4, megatron_buffers, 2, 2)
    sizes, expected = {}, {}
    for rank_sizes, placed in results:
        sizes |= rank_sizes
        for where, piece in placed.items():  # (a whole tensor: TP rank 0's copy)
            expected.setdefault(where, piece)
    assert sum(key.endswith(".param") for key in sizes) > 4  # several buckets, as meant
    args = vars(megatron_args("gpt2", 2, 2))
    layout = BucketLayout(sizes, args)
    assert layout.reason is None
    rebuilt = {
        (key, index, rank): (piece.stem, piece.start, piece.numel)
        for (key, index), pieces in layout.pieces.items()
        for rank, piece in pieces.items()
    }
    assert rebuilt == expected
    # A different spec puts the input norm elsewhere: the lengths still add up here, the
    # places do not (what the load's check of the fp32 masters against the weights catches).
    args["transformer_impl"] = "transformer_engine"
    other = BucketLayout(sizes, args)
    assert other.reason is not None or other.pieces != layout.pieces
