"""Megatron-LM's training loop around megatron-core on gloo CPU ranks
(tests/megatron_core_models.py builds the models): a few iterations with its DDP, optimizer and
LR scheduler, a checkpoint with Adam's state in one of its layouts, and its --load of one with
the optimizer, each followed by one more iteration whose weights are saved for comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch

from tests import megatron_core_hybrid as mh
from tests.megatron_core_models import SEQ, VOCAB, build, megatron_args, optimizer_patches, write
from tests.megatron_core_shapes import SHAPES

LR, WEIGHT_DECAY = 3e-3, 0.01
LEGACY_BUCKET_SIZE = 6000  # elements: the legacy save's buffers hold several buckets
# fp16's dynamic loss scale: no overflow here, its growth counter at 2 after 2 iterations
FP16_LOSS_SCALING = dict(initial_loss_scale=16384.0, loss_scale_window=3, hysteresis=2)


def batch(step: int, data_parallel: int) -> torch.Tensor:
    """The global batch [DP, SEQ] of training step `step` (DP rank r trains row r)."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (data_parallel, SEQ), generator=generator)


@contextlib.contextmanager
def _megatron_training(
    kind: str,
    tensor_parallel: int,
    distributed: bool,
    bucket_size: int | None = None,
    expert_parallel: int = 1,
    bf16: bool = False,
    fp16: bool = False,
):
    """Megatron-LM's training on TP x DP gloo ranks with megatron-core's DDP and optimizer (of
    its GPTModel, or a hybrid's MambaModel), as a namespace: `model`, `optimizer`, `scheduler`
    and `iteration(step)`, which trains on global batch `step` and returns the loss averaged
    over DP.

    As Megatron-LM's loop: constant LR through its OptimizerParamScheduler (which also keeps
    biases and norms free of weight decay; `use_checkpoint` takes a loaded checkpoint's
    schedule), clipping at 1.0, AdamW; each DP rank's loss the mean over its tokens, gradients
    averaged over DP by the DDP wrapper; `bucket_size`: its buckets' size, with
    --overlap-grad-reduce (else one bucket per buffer). `bf16`/`fp16`: Megatron-LM's --bf16 /
    --fp16 (fp16: FP16_LOSS_SCALING's dynamic loss scale, fp16 gradients)."""
    import types

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    with mh.hybrid_patches(), optimizer_patches():  # (a hybrid's Mamba mixers; the CPU's)
        if "hybrid_layer_pattern" in SHAPES[kind]:
            model = mh.build(kind, tensor_parallel, expert_parallel=expert_parallel)
        else:
            model = build(kind, tensor_parallel, 1, expert_parallel=expert_parallel)
        dp = parallel_state.get_data_parallel_world_size()
        module = model
        if bf16 or fp16:  # as Megatron-LM's get_model wraps it (bf16: gradients in fp32)
            from megatron.core.transformer.module import Float16Module

            model.config.bf16, model.config.fp16 = bf16, fp16
            module = Float16Module(model.config, model)
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=distributed,
            overlap_grad_reduce=bucket_size is not None,
            bucket_size=bucket_size,
            grad_reduce_in_fp32=bf16,
        )
        ddp = DistributedDataParallel(model.config, ddp_config, module)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=LR,
                min_lr=LR,
                weight_decay=WEIGHT_DECAY,
                clip_grad=1.0,
                use_distributed_optimizer=distributed,
                bf16=bf16,
                fp16=fp16,
                params_dtype=torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32,
                **(FP16_LOSS_SCALING if fp16 else {}),
            ),
            [ddp],
        )
        scheduler = OptimizerParamScheduler(
            optimizer,
            init_lr=LR,
            max_lr=LR,
            min_lr=LR,
            lr_warmup_steps=0,
            lr_decay_steps=1000,
            lr_decay_style="constant",
            start_wd=WEIGHT_DECAY,
            end_wd=WEIGHT_DECAY,
            wd_incr_steps=1000,
            wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=True,
        )
        positions = torch.arange(SEQ - 1)[None]
        mask = torch.triu(torch.ones(SEQ - 1, SEQ - 1), 1).bool()[None, None]

        def iteration(step: int) -> float:
            tokens = batch(step, dp)[parallel_state.get_data_parallel_rank()][None]
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            loss = ddp(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).mean()
            loss.backward()
            ddp.finish_grad_sync()
            updated, _, _ = optimizer.step()
            assert updated
            scheduler.step(increment=dp)
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=parallel_state.get_data_parallel_group())
            return mean.item() / dp

        yield types.SimpleNamespace(
            model=model, optimizer=optimizer, scheduler=scheduler, iteration=iteration, dp=dp
        )


def train_and_save(
    kind: str,
    root: str,
    after: str,
    tensor_parallel: int,
    layout: str | None,
    steps: int,
    expert_parallel: int = 1,
    fp16: bool = False,
) -> float:
    """`steps` iterations of `_megatron_training` (`fp16`: Megatron-LM's --fp16), a checkpoint
    with the optimizer state under `root` (`layout`: the distributed optimizer's
    --dist-ckpt-optim-fully-reshardable ("fully_reshardable") or default ("dp_reshardable")
    layout, None: the non-distributed optimizer; Megatron-LM's legacy format with the
    distributed optimizer ("legacy") or the non-distributed one ("legacy_plain")), then one
    more iteration whose weights go (model only) under `after`. Returns that iteration's
    loss."""
    distributed = layout not in (None, "legacy_plain")
    bucket_size = LEGACY_BUCKET_SIZE if layout == "legacy" else None
    with _megatron_training(
        kind, tensor_parallel, distributed, bucket_size, expert_parallel, fp16=fp16
    ) as run:
        for step in range(steps):
            run.iteration(step)
        args = _args(run, kind, tensor_parallel, steps, distributed, expert_parallel)
        _precision(args, False, fp16)
        _save(run, args, layout, root, steps)
        loss = run.iteration(steps)
        state = {"args": args, "checkpoint_version": 3.0, "iteration": steps + 1}
        write(state | {"model": run.model.sharded_state_dict()}, after, steps + 1)
    return loss


def save_layouts(
    kind: str,
    roots: dict,
    tensor_parallel: int,
    steps: int,
    bf16: bool = False,
    bucket_size: int | None = None,
    fp16: bool = False,
) -> dict | None:
    """`steps` iterations of `_megatron_training` (in bf16/fp16: Megatron-LM's --bf16/--fp16,
    its fp32 masters in the optimizer), then the same optimizer state saved in each layout of
    `roots` ({layout: root}, as `train_and_save` names them; the distributed optimizer's, or
    the non-distributed one's: "torch_dist" and "legacy_plain"). One bucket per buffer, unless
    `bucket_size`: with several, megatron-core 0.16's fully_reshardable save misplaces the
    state of the buckets after the first (it slices the buckets' joined state, their padding
    cut, at the padded buffer's offsets). Returns fp16's loss scaler state, as numbers."""
    distributed = "legacy_plain" not in roots
    training = _megatron_training(
        kind, tensor_parallel, distributed, bucket_size, bf16=bf16, fp16=fp16
    )
    with training as run:
        for step in range(steps):
            run.iteration(step)
        args = _args(run, kind, tensor_parallel, steps, distributed, 1)
        _precision(args, bf16, fp16)
        for layout, root in roots.items():
            _save(run, args, None if layout == "torch_dist" else layout, root, steps)
        return loss_scaler_state(run.optimizer) if fp16 else None


def loss_scaler_state(optimizer) -> dict:
    """megatron-core's DynamicGradScaler's state (of its first chained optimizer), as numbers."""
    state = optimizer.chained_optimizers[0].grad_scaler.state_dict()
    return {name: float(value) for name, value in state.items()}


def _precision(args, bf16: bool, fp16: bool) -> None:
    """Megatron-LM's args of a --bf16 or --fp16 run (bf16 reduces its gradients in fp32)."""
    if bf16 or fp16:
        args.bf16, args.fp16 = bf16, fp16
        args.params_dtype = torch.bfloat16 if bf16 else torch.float16
        args.accumulate_allreduce_grads_in_fp32 = bf16


def _args(run, kind: str, tensor_parallel: int, steps: int, distributed: bool, ep: int):
    import torch.distributed as dist

    args = megatron_args(kind, tensor_parallel, 1)
    args.world_size, args.use_distributed_optimizer = dist.get_world_size(), distributed
    args.expert_model_parallel_size = ep
    args.consumed_train_samples = steps * run.dp
    return args


def _save(run, args, layout: str | None, root: str, iteration: int) -> None:
    """The checkpoint of iteration `iteration` with the optimizer state in `layout` (as
    `train_and_save` names them) under `root`."""
    if layout in ("legacy", "legacy_plain"):
        _save_legacy(run, argparse.Namespace(**vars(args)), root, iteration)
        return
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if layout is not None:
        metadata["distrib_optim_sharding_type"] = layout
    model_state = run.model.sharded_state_dict(metadata=metadata)
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "model": model_state,
        "optimizer": run.optimizer.sharded_state_dict(model_state, metadata=metadata),
        "opt_param_scheduler": run.scheduler.state_dict(),
    }
    write(state, root, iteration, metadata)


def _save_legacy(run, args, root: str, iteration: int) -> None:
    """Megatron-LM's save in its legacy format with the distributed optimizer (`save_checkpoint`
    for a CheckpointType.LEGACY save, TP (x EP) x DP here): every rank gathers the optimizer's
    buffers (`save_parameter_state`, written to distrib_optim.pt where an optimizer's DP rank
    is 0; the experts' optimizer's DP ranks are its own), expert-DP rank 0 of each
    model-parallel rank writes model_optim_rng.pt."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    args.ckpt_format, args.overlap_grad_reduce = "torch", True
    args.ddp_bucket_size = LEGACY_BUCKET_SIZE
    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ps.get_expert_model_parallel_world_size() > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    directory = os.path.join(root, f"iter_{iteration:07d}", name)
    os.makedirs(directory, exist_ok=True)
    if args.use_distributed_optimizer:
        run.optimizer.save_parameter_state(os.path.join(directory, "distrib_optim.pt"))
    if ps.get_expert_data_parallel_rank() == 0:
        state = {
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": iteration,
            "model": run.model.state_dict_for_save_checkpoint(),
            "optimizer": run.optimizer.state_dict(),
            "opt_param_scheduler": run.scheduler.state_dict(),
        }
        torch.save(state, os.path.join(directory, "model_optim_rng.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


@contextlib.contextmanager
def _torch_adams_steps_on_load(optimizer):
    """Two faults of megatron-core's load into torch's Adam, its fallback without Transformer
    Engine (whose FusedAdam, what Megatron-LM steps with on GPUs, keeps the step in its groups
    instead): the fully_reshardable load looks each parameter's step up among the
    checkpoint's per-parameter tensors, which hold none (the step stays as the groups set it
    here), and every parameter gets one shared step tensor, which torch's Adam then advances
    once per parameter (each gets its own here)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def keeping_the_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        step = self.optimizer.state[main_param].get("step")
        original(self, model_param, tensors if step is None else {**tensors, "step": step})

    DistributedOptimizer._set_main_param_and_optimizer_states = keeping_the_step
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original
    for inner in optimizer.chained_optimizers:
        for state in inner.optimizer.state.values():
            state["step"] = state["step"].clone()


def load_and_continue(
    kind: str,
    path: str,
    after: str,
    tensor_parallel: int,
    expert_parallel: int = 1,
    distributed: bool = True,
    fp16: bool = False,
) -> float:
    """Megatron-LM's --load of the iter_N directory `path` with its distributed optimizer (or
    without `distributed`, its non-distributed one: FP32Optimizer, or in `fp16`
    Float16OptimizerWithFloat16Params and its loss scaler) (model, optimizer state and LR
    schedule, read as its `load_checkpoint` reads them), then iteration N, whose weights go
    (model only) under `after`. Returns that iteration's loss. At `expert_parallel` > 1 the
    experts have an optimizer of their own, chained with the rest's."""
    from megatron.core import dist_checkpointing

    iteration = int(os.path.basename(path).split("_")[1])
    training = _megatron_training(
        kind, tensor_parallel, distributed, expert_parallel=expert_parallel, fp16=fp16
    )
    with training as run:
        # megatron-core builds the sharded state dict of torch's Adam (its fallback without
        # Transformer Engine, whose FusedAdam keeps the step in its groups) only once its
        # state exists: zeros at step 0 here, all of which the load replaces.
        for optimizer in run.optimizer.chained_optimizers:
            for group in optimizer.optimizer.param_groups:
                for param in group["params"]:
                    optimizer.optimizer.state[param] = {
                        "step": torch.zeros(()),
                        "exp_avg": torch.zeros_like(param),
                        "exp_avg_sq": torch.zeros_like(param),
                    }
        metadata = dist_checkpointing.load_content_metadata(path)
        model_state = run.model.sharded_state_dict(metadata=metadata)
        state = {
            "model": model_state,
            "optimizer": run.optimizer.sharded_state_dict(
                model_state, is_loading=True, metadata=metadata
            ),
        }
        state = dist_checkpointing.load(state, path)
        run.model.load_state_dict(state["model"])
        with _torch_adams_steps_on_load(run.optimizer):
            run.optimizer.load_state_dict(state["optimizer"])
        run.scheduler.load_state_dict(state["opt_param_scheduler"])
        loss = run.iteration(iteration)
        args = megatron_args(kind, tensor_parallel, 1)
        state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration + 1}
        write(state | {"model": run.model.sharded_state_dict()}, after, iteration + 1)
    return loss
