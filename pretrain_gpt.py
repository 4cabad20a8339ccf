"""Pretrain a GPT/LLaMA model with Megatron-LM's command line.

torchrun --nproc_per_node 2 pretrain_gpt.py --num-layers 2 --hidden-size 64 ... --mock-data
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from threefold.arguments import parse_args, print_refusal
from threefold.checkpoint.pretrained import starting_checkpoint
from threefold.checkpoint.save_directory import claim_on_rank_zero
from threefold.config import Config, ConfigError
from threefold.startup import frozen_imports, run_then_shut_down, start_processes
from threefold.training.exit_signals import exit_signal_handler
from threefold.validation import check_inputs

if TYPE_CHECKING:  # (torch is imported after the flags are read)
    import torch

    from threefold.parallel.parallel_context import ParallelContext
    from threefold.training.trainer import Trainer


def _summary(config, trainer, device_type: str) -> str:
    parallel = config.parallel
    layout = parallel.layout()
    if parallel.sequence_parallel:
        layout += ", sequence parallel"
        layout += ", its collectives overlapped" if parallel.tp_comm_overlap else ""
    if len(trainer.model_chunks) > 1:
        layout += f", {len(trainer.model_chunks)} virtual stages"
    if parallel.use_tp_pp_dp_mapping:
        layout += ", rank order TP-CP-EP-PP-DP"
    num_params = sum(p.numel() for _, p in trainer.layout_independent_parameters())
    return (
        f"> world size {parallel.world_size} ({layout}) on {device_type}; {num_params:,} "
        f"parameters on rank 0; vocabulary {config.model.vocab_size} padded to "
        f"{trainer.model_chunks[0].padded_vocab_size}; {trainer.num_microbatches} "
        "micro-batches per step"
    )


def main(argv: list[str] | None = None, prog: str = "pretrain_gpt.py", hybrid: bool = False) -> int:
    """Train as `prog`; `hybrid`: Megatron-LM's hybrid entry points (pretrain_hybrid.py,
    pretrain_mamba.py), which build a hybrid model only."""
    # Flags and input files first, before torch is even imported: a mistake costs a second.
    config = parse_args(argv, prog=prog)
    if config.training.exit_signal_handler:  # from the first second: start-up takes a while
        exit_signal_handler()
    try:
        if hybrid and not config.model.hybrid:
            raise ConfigError(
                f"{prog} builds a hybrid model: give --hybrid-layer-pattern (M Mamba, * "
                "attention, - MLP, E mixture-of-experts layers), or run pretrain_gpt.py"
            )
        # (--pretrained-checkpoint in --load's place while --load holds no checkpoint)
        config.checkpoint, starting_note = starting_checkpoint(config.checkpoint)
        check_inputs(config)
        if os.environ.get("THREEFOLD_VALIDATE_ONLY"):
            # The launchers' check before they spawn workers: a mistake is then one line and
            # exit code 2, not a line per worker and torchrun's ChildFailedError report.
            return 0
        lock = claim_on_rank_zero(config.checkpoint.save)  # noqa: F841 (held until exit)
    except ConfigError as error:
        print_refusal(prog, error)
        return 2

    with frozen_imports():  # what _train imports
        import threefold.checkpoint.load  # noqa: F401
        import threefold.training.trainer  # noqa: F401

    return run_then_shut_down(lambda: _train(config, starting_note, prog))


def _train(config: Config, starting_note: str | None = None, prog: str = "pretrain_gpt.py") -> int:
    """Start this process's groups, build the trainer, resume, train: the exit code. Whatever
    holds a group lives in this frame, gone before `state.shut_down` (which says why)."""
    from threefold.parallel.refusal import print_refusal_once
    from threefold.training import halting
    from threefold.training.out_of_memory import out_of_memory_refused
    from threefold.training.timers import SETUP

    started = start_processes(config, prog)
    if started is None:
        return 2
    device, parallel = started
    try:
        with out_of_memory_refused(config, "while building the model or loading its checkpoint"):
            trainer = _build_and_resume(config, device, parallel, starting_note)
    except ConfigError as error:  # from here on, possibly met by some ranks only
        print_refusal_once(prog, error, parallel.world.rank)
        return 2
    trainer.print(_summary(config, trainer, device.type))
    trainer.observability.print_timers(SETUP)
    return halting.train(trainer, prog)


def _build_and_resume(
    config: Config, device: torch.device, parallel: ParallelContext, starting_note: str | None
) -> Trainer:
    """The trainer, its checkpoint loaded (--load, or the dense model --moe-use-upcycling
    upcycles)."""
    from threefold.checkpoint.load import load_checkpoint
    from threefold.checkpoint.upcycling import upcycle_on_rank_zero
    from threefold.training.trainer import Trainer

    trainer = Trainer(config, device, parallel)
    if starting_note:
        trainer.print(starting_note)
    if config.model.moe_use_upcycling:
        with trainer.timers("load-checkpoint", 0):
            trainer.print(upcycle_on_rank_zero(config, parallel))
            load_checkpoint(config.checkpoint.save, trainer.checkpoint_components(), finetune=True)
    elif config.checkpoint.load:
        checkpoint = config.checkpoint
        with trainer.timers("load-checkpoint", 0):
            iteration = load_checkpoint(
                checkpoint.load,
                trainer.checkpoint_components(),
                load_optimizer=not checkpoint.no_load_optim,
                load_rng=not checkpoint.no_load_rng,
                finetune=checkpoint.finetune,
            )
        if iteration is not None and checkpoint.load == checkpoint.save and not checkpoint.finetune:
            trainer.checkpointer.last_saved = iteration  # on disk: never written over
        if iteration is None:
            said = f"> no checkpoint in --load {checkpoint.load}; starting from scratch"
        elif checkpoint.finetune:  # (weights only: the run counts from 0)
            said = f"> loaded the weights of {checkpoint.load} (iteration {iteration})"
        else:
            said = f"> resumed from {checkpoint.load} at iteration {iteration}"
        trainer.print(said)
        pending = iteration is not None and trainer.validation.after_load(
            checkpoint.load, iteration
        )
        if pending:  # --rerun-mode validate_results: an iteration to rerun from here
            trainer.print(pending)
    return trainer


if __name__ == "__main__":
    sys.exit(main())
