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
from tests.megatron_core_shapes import SHAPES

BUCKET_SIZE = 6000  # elements: the first stage's layers span several buckets
DTYPE = "(torch.float32, torch.float32)"


def _stored(sharded, sizes: dict, stored: dict) -> None:
    """Where one entry of megatron-core's sharded state dict puts its tensor: its global shape
    under `sizes`, (key, index) under the tensor's address in `stored`."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(sharded, ShardedTensorFactory):  # SwiGLU's fc1 halves, a Mamba's sections
        built = sharded.build()
        for piece in built:
            sizes[piece.key] = tuple(piece.global_shape)
        index = tuple(built[0].global_offset[: built[0].prepend_axis_num])
        stored[sharded.data.data_ptr()] = (sharded.key, index)
    elif isinstance(sharded, ShardedTensor):
        sizes[sharded.key] = tuple(sharded.global_shape)
        index = tuple(sharded.global_offset[: sharded.prepend_axis_num])
        stored[sharded.data.data_ptr()] = (sharded.key, index)


def megatron_buffers(
    kind: str, tp: int, pp: int, ep: int = 1, virtual_stages: int | None = None
) -> tuple[dict, dict]:
    """On this rank of megatron-core's model `kind` (each of its model chunks) with its
    distributed optimizer's DDP: the global shape of each model tensor of its sharded state
    dict and each bucket's unpadded length under its stored key; {(key, index, TP rank):
    (bucket key, start within the bucket, numel)} of each parameter in its gradient buffers
    (the experts' own under EP)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from tests import megatron_core_hybrid as mh
    from tests.megatron_core_models import build, optimizer_patches

    sizes, placed = {}, {}
    with mh.hybrid_patches(), optimizer_patches():
        chunks = []
        for chunk in range(virtual_stages or 1):
            vp_stage = chunk if virtual_stages else None
            if "hybrid_layer_pattern" in SHAPES[kind]:
                model = mh.build(kind, tp, 0, pp, ep)
            else:
                model = build(kind, tp, pp, 0, ep, virtual_stages, vp_stage)
            stored = {}  # a tensor's address -> (key, index): its place in the checkpoint
            # (a stage of multi-token prediction ties its embedding copy over DP x CP)
            dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
            for sharded in model.sharded_state_dict(metadata={"dp_cp_group": dp_cp}).values():
                _stored(sharded, sizes, stored)
            # (before the DDP wrapper moves every parameter into its buffer)
            where = {param: stored.get(param.data_ptr()) for param in model.parameters()}
            names = {param: name for name, param in model.named_parameters()}
            config = DistributedDataParallelConfig(
                use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=BUCKET_SIZE
            )
            # (Megatron-LM's training buckets a model chunk after the first as one)
            ddp = DistributedDataParallel(model.config, config, model, disable_bucketing=chunk > 0)
            chunks.append((ddp, where, names))
        chained = any(ddp.expert_parallel_buffers for ddp, _, _ in chunks)
        dense = parallel_state.get_model_parallel_group().rank()
        experts = parallel_state.get_expert_tensor_model_pipeline_parallel_group().rank()
        for optimizer, rank, tp_rank in (
            (0, dense, parallel_state.get_tensor_model_parallel_rank()),
            (1, experts, parallel_state.get_expert_tensor_parallel_rank()),
        ):
            prefix = f"chained_{optimizer}." if chained else ""
            gbuf = 0  # (the optimizer numbers every chunk's buffers in turn)
            for ddp, where, names in chunks:
                for buffer in ddp.expert_parallel_buffers if optimizer else ddp.buffers:
                    stem = f"{prefix}optimizer.distributed.dp_group_idx_{rank}.gbuf_idx_{gbuf}"
                    stem += f".dtype_{DTYPE}"
                    gbuf += 1
                    for param, (start, end, bucket) in buffer.param_index_map.items():
                        # (the last stage's copy of the tied embedding: stored as the first's)
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


def _layouts(results: list, args: dict, conv_own: bool) -> tuple[dict, dict, dict]:
    """(the stored sizes, megatron-core's places and the rebuilt ones) from every rank's
    `megatron_buffers` and the args."""
    from threefold.checkpoint.megatron.buckets import BucketLayout

    sizes, expected = {}, {}
    for rank_sizes, placed in results:
        sizes |= rank_sizes
        for where, piece in placed.items():  # (a whole tensor: TP rank 0's copy)
            expected.setdefault(where, piece)
    layout = BucketLayout(sizes, args, conv_own)
    assert layout.reason is None
    rebuilt = {
        (key, index, rank): (piece.stem, piece.start, piece.numel)
        for (key, index), pieces in layout.pieces.items()
        for rank, piece in pieces.items()
    }
    return sizes, expected, rebuilt


@pytest.mark.parametrize(
    "kind,tp,pp,ep,vpp",
    [
        ("gpt2", 2, 2, 1, None),  # tied embeddings, biases, LayerNorm, learned positions
        # multi-latent attention (the local spec splits its down projections over TP)
        ("mla", 2, 1, 1, None),
        ("moe_mtp", 1, 1, 2, None),  # experts in buffers of their own, multi-token prediction
        # the depths' stage keeps a copy of the embedding, as the first stage its own, each
        # in a bucket alone
        ("moe_mtp", 1, 2, 2, None),
        # --pipeline-model-parallel-layout Et|tttmm|L: the depths, the final norm and an
        # embedding copy on the middle stage, the output layer alone on the last
        ("moe_mtp_layout", 1, 3, 1, None),
        ("gpt_oss", 1, 1, 2, None),  # softmax sinks, biased experts and router
        ("gpt2", 1, 2, 1, 2),  # two virtual stages: a buffer per model chunk
        # Mamba mixers (dt_bias, A_log and D before in_proj; in_proj and conv1d a section at a
        # time), attention, MLP and expert layers
        ("hybrid", 2, 1, 2, None),
        ("hybrid4", 1, 2, 1, None),  # a hybrid's stages
        ("hybrid_newer", 2, 1, 2, None),  # newer Megatron-LM's mixers: conv1d's first
    ],
    ids=[
        "gpt2-tp2-pp2",
        "mla-tp2",
        "moe-mtp-ep2",
        "moe-mtp-pp2-ep2",
        "moe-mtp-pp3-layout",
        "gpt-oss-ep2",
        "gpt2-pp2-vpp2",
        "hybrid-tp2-ep2",
        "hybrid-pp2",
        "hybrid-newer-mixers-tp2-ep2",
    ],
)
def test_the_rebuilt_layout_is_megatron_cores_own(kind, tp, pp, ep, vpp):
    """Every parameter's bucket, offset and length on every saved rank, as megatron-core's
    `_ParamAndGradBuffer` placed it (with EP > 1 the experts' buffers under `chained_1.`)."""
    from tests.megatron_core_models import megatron_args
    from threefold.checkpoint.megatron.buckets import BucketLayout, formed_buckets

    args = vars(megatron_args(kind, tp, pp)) | {
        "expert_model_parallel_size": ep,
        "virtual_pipeline_model_parallel_size": vpp,
    }
    results = run_distributed(tp * pp * ep, megatron_buffers, kind, tp, pp, ep, vpp)
    conv_own = SHAPES[kind].get("mixer_conv_own", False)
    sizes, expected, rebuilt = _layouts(results, args, conv_own)
    assert sum(key.endswith(".param") for key in sizes) > 4  # several buckets, as meant
    assert any(key.startswith("chained_1.") for key in sizes) == (ep > 1)
    assert any(".gbuf_idx_1." in key for key in sizes) == (vpp is not None)
    assert rebuilt == expected
    # Megatron-LM's legacy format records no bucket lengths: formed from the args, as its DDP
    # forms them, they are the stored ones.
    stored = {}
    for key, size in sizes.items():
        found = re.match(r"^(.+)\.dtype_.+\.bucket_idx_(\d+)\.param$", key)
        if found:
            stored.setdefault(found[1], {})[int(found[2])] = size[0]
    stored = {gbuf: [lengths[b] for b in sorted(lengths)] for gbuf, lengths in stored.items()}
    bucketed = args | {"overlap_grad_reduce": True, "ddp_bucket_size": BUCKET_SIZE}
    model = {k: v for k, v in sizes.items() if not k.startswith(("optimizer.", "chained_"))}
    assert formed_buckets(model, bucketed, conv_own) == stored
    assert formed_buckets(model, args, conv_own) != stored  # (no --overlap-grad-reduce: one)
    if SHAPES[kind].get("mtp_num_layers") and pp > 1:  # (megatron-core 0.16 saves no such)
        tied = BucketLayout(sizes, args | {"untie_embeddings_and_output_weights": False})
        assert "prediction depths over stages, with tied" in tied.reason
    if kind == "gpt2" and vpp is None:
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
