"""Pretrain a GPT/LLaMA model with Megatron-LM's command line.

    torchrun --nproc_per_node 2 pretrain_gpt.py --num-layers 2 --hidden-size 64 ... --mock-data
"""

from __future__ import annotations

import sys

from threefold.arguments import parse_args
from threefold.checkpointing import load_checkpoint
from threefold.config import ConfigError
from threefold.parallel import state
from threefold.training.trainer import Trainer, print_rank_0


def _summary(config, trainer: Trainer, device_type: str) -> str:
    parallel = config.parallel
    layout = (f"TP={parallel.tensor_model_parallel_size}, "
              f"PP={parallel.pipeline_model_parallel_size}, DP={parallel.data_parallel_size}")
    if parallel.sequence_parallel:
        layout += ", sequence parallel"
    if len(trainer.model_chunks) > 1:
        layout += f", {len(trainer.model_chunks)} virtual stages"
    num_params = sum(p.numel() for _, p in trainer.layout_independent_parameters())
    return (f"> world size {parallel.world_size} ({layout}) on {device_type}; {num_params:,} "
            f"parameters on rank 0; vocabulary {config.model.vocab_size} padded to "
            f"{trainer.model_chunks[0].padded_vocab_size}; {trainer.num_microbatches} "
            "micro-batches per step")


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    device = state.initialize_from_config(config.parallel)
    try:
        trainer = Trainer(config, device)
        if config.checkpoint.load:
            checkpoint = config.checkpoint
            iteration = load_checkpoint(checkpoint.load, trainer,
                                        load_optimizer=not checkpoint.no_load_optim,
                                        load_rng=not checkpoint.no_load_rng,
                                        finetune=checkpoint.finetune)
            print_rank_0(f"> resumed from {config.checkpoint.load} at iteration {iteration}"
                         if iteration is not None else
                         f"> no checkpoint in --load {config.checkpoint.load}; starting from "
                         "scratch")
    except ConfigError as error:
        print_rank_0(f"pretrain_gpt.py: error: {error}")
        return 2
    print_rank_0(_summary(config, trainer, device.type))
    trainer.train()
    state.destroy_model_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
