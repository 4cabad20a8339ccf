"""Supervised fine-tuning of a threefold checkpoint (for example one converted from Hugging
Face with tools/convert_checkpoint.py), with Megatron-LM's command line.

    torchrun --nproc_per_node 2 finetune.py --load checkpoints/converted \\
        --save checkpoints/sft --train-data-path sft_train.jsonl \\
        --valid-data-path sft_valid.jsonl --seq-length 512 --micro-batch-size 4 \\
        --global-batch-size 32 --train-iters 200 --lr 1e-4 --lora-rank 16 [--sft-packing]

The model's architecture, tokenizer and dropout come from the checkpoint (Megatron's
--use-checkpoint-args; a converted model's dropout is 0); training, layout and LoRA flags, and
a --hidden-dropout/--attention-dropout given, come from the command line. JSONL
records are {"prompt", "response"} or {"messages": [...]}; only responses carry loss (see
threefold/data/sft.py); --test-data-path is evaluated after training. The checkpoint's
weights are loaded (iteration 0, fresh optimizer) unless --load is the --save directory of
this fine-tuning run, which then resumes exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from threefold.arguments import (
    ToolParser,
    build_parser,
    parse_args,
    print_refusal,
    speaks_for_its_machine,
)
from threefold.checkpoint.args import checkpoint_flags, latest_config
from threefold.checkpoint.files import is_release, read_tracker
from threefold.checkpoint.pretrained import starting_checkpoint
from threefold.checkpoint.save_directory import claim_on_rank_zero
from threefold.config import Config, ConfigError
from threefold.startup import frozen_imports, run_then_shut_down, start_processes
from threefold.validation import check_inputs


def check_finetuning(config: Config) -> None:
    """What fine-tuning cannot do with these flags, as one-line ConfigErrors before torch is
    imported (the files themselves: `check_inputs`)."""
    data = config.data
    if config.checkpoint.pretrained_checkpoint:
        raise ConfigError(
            "finetune.py fine-tunes --load's model (and resumes itself when --save is --load): "
            "give the model as --load; --pretrained-checkpoint is pretrain_gpt.py's"
        )
    if data.sft:
        raise ConfigError(
            "--sft is pretrain_gpt.py's (Megatron-LM's SFT: a JSONL line a packed sample); "
            "finetune.py reads conversations itself, packed with --sft-packing: drop it"
        )
    if not data.train_data_path:
        raise ConfigError(
            "fine-tuning reads JSONL conversations: give --train-data-path FILE (and "
            "--valid-data-path, --test-data-path), not --data-path or --mock-data"
        )
    if data.tokenizer_type is None:
        raise ConfigError(
            "finetune.py needs a tokenizer: the checkpoint has none, pass "
            "--tokenizer-type and --tokenizer-model"
        )
    flags = data.document_flags()
    if flags:
        raise ConfigError(
            f"finetune.py: {flags[0]} is for pretraining token windows; SFT "
            "samples mask their prompts themselves, and --sft-packing keeps "
            "documents apart"
        )
    if data.fim_data:
        raise ConfigError(
            "finetune.py: --fim-data rearranges pretraining documents; SFT conversations "
            "keep their order (drop the flag)"
        )


def sft_datasets(packing: bool):
    """The trainer's `build_data`: --train-data-path, --valid-data-path and
    --test-data-path's conversations as samples (`check_finetuning` has passed)."""

    def build(config, tokenizer) -> list:
        from threefold.data.sft import SFTDataset, read_jsonl

        data, seq_length = config.data, config.model.seq_length

        warnings = []

        def dataset(paths: list[str] | None, flag: str) -> SFTDataset | None:
            if not paths:
                return None
            records = [record for path in paths for record in read_jsonl(path, flag)]
            built = SFTDataset(records, tokenizer, seq_length, packing)
            cut = f"--seq-length {seq_length} cuts off every response token of"
            if built.without_loss == len(records):  # (before: a run of loss 0.0000)
                raise ConfigError(
                    f"{cut} every conversation in {flag} (the shortest prompt is "
                    f"{built.shortest_prompt} tokens); raise --seq-length"
                )
            if built.without_loss:
                warnings.append(
                    f"{cut} {built.without_loss} of {len(records)} conversations in {flag}: "
                    "they train nothing"
                )
            return built

        train = dataset(data.train_data_path, "--train-data-path")
        if config.training.multiple_validation_sets:  # a set per file, evaluated on its own
            valid = [dataset([path], "--valid-data-path") for path in data.valid_data_path]
        else:
            valid = dataset(data.valid_data_path, "--valid-data-path")
        test = dataset(data.test_data_path, "--test-data-path")
        valid_samples = sum(map(len, valid)) if isinstance(valid, list) else valid and len(valid)
        warnings += dataset_size_warnings(config, len(train), valid_samples)
        for warning in warnings:
            if speaks_for_its_machine():
                print(f"WARNING: {warning}", flush=True)
        return [train, valid, test]

    return build


def dataset_size_warnings(config, train_samples: int, valid_samples: int | None) -> list[str]:
    """What a small fine-tuning set does to the run, said before it starts: epochs per step,
    and an evaluation that reads the validation set many times over."""
    training, warnings = config.training, []
    batch = training.global_batch_size
    if train_samples < batch:
        warnings.append(
            f"{train_samples} training samples (after --seq-length {config.model.seq_length}"
            f" and packing) against --global-batch-size {batch}: every step repeats the set; "
            "lower --global-batch-size or add data"
        )
    evaluated = training.eval_iters * batch
    if valid_samples and evaluated > 2 * valid_samples and not training.full_validation:
        warnings.append(
            f"each evaluation reads {evaluated} samples (--eval-iters {training.eval_iters} x "
            f"--global-batch-size {batch}) of a validation set of {valid_samples}: use "
            f"--eval-iters {max(1, -(-valid_samples // batch))}, or --full-validation (each "
            "sample once)"
        )
    return warnings


def _own_flags() -> argparse.ArgumentParser:
    own = ToolParser(prog="finetune.py", add_help=False)
    group = own.add_argument_group("fine-tuning (finetune.py)")
    group.add_argument(
        "--sft-packing",
        action="store_true",
        help="pack several conversations per sample (per-document attention)",
    )
    return own


def main(argv: list[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    if {"-h", "--help"} & set(argv):
        build_parser("finetune.py", __doc__, _own_flags()).print_help()
        return 0
    args, rest = _own_flags().parse_known_args(argv)
    probe = ToolParser(prog="finetune.py", add_help=False)
    probe.add_argument("--load")
    probe.add_argument("--save")
    probe.add_argument("--tokenizer-type")
    known, _ = probe.parse_known_args(rest)
    if not known.load:
        print_refusal("finetune.py", "--load CHECKPOINT_DIR is required (the model to fine-tune)")
        return 2
    try:
        iteration, _ = latest_config(known.load)
        prefix = checkpoint_flags(
            known.load, with_tokenizer=known.tokenizer_type is None, finetuning=True
        )
    except ConfigError as error:
        print_refusal("finetune.py", error)
        return 2
    config = parse_args(prefix + rest, prog="finetune.py")
    resuming = known.save is not None and (
        os.path.abspath(known.save) == os.path.abspath(known.load)
    )
    # Weights only, at iteration 0 with a fresh optimizer, unless the run resumes itself (a
    # release checkpoint holds no run to resume).
    config.checkpoint = dataclasses.replace(
        config.checkpoint,
        finetune=config.checkpoint.finetune or not resuming or is_release(known.load),
    )
    # The flags, the files and the checkpoint's metadata first, before torch is imported: a
    # mistake costs a second.
    try:
        check_finetuning(config)
        # (a resumed run's newer non-persistent checkpoint in --load's place, as pretrain_gpt.py)
        config.checkpoint, starting_note = starting_checkpoint(config.checkpoint)
        check_inputs(config, indexed_data=False)
        if os.environ.get("THREEFOLD_VALIDATE_ONLY"):  # (a launcher's check, as pretrain_gpt.py's)
            return 0
        lock = claim_on_rank_zero(config.checkpoint.save)  # noqa: F841 (held until exit)
    except ConfigError as error:
        print_refusal("finetune.py", error)
        return 2
    with frozen_imports():  # what _fine_tune imports
        import threefold.checkpoint.load  # noqa: F401
        import threefold.training.trainer  # noqa: F401

    load = config.checkpoint.load
    iteration = iteration if load == known.load else read_tracker(load)
    return run_then_shut_down(
        lambda: _fine_tune(config, args.sft_packing, load, resuming, iteration, starting_note)
    )


def _fine_tune(
    config: Config,
    sft_packing: bool,
    load: str,
    resuming: bool,
    iteration: int | None,
    starting_note: str | None = None,
) -> int:
    """Start this process's groups, load the model, tune it: the exit code. Whatever holds a
    group lives in this frame, gone before `state.shut_down` (which says why)."""
    from threefold.checkpoint.load import load_checkpoint
    from threefold.parallel.refusal import print_refusal_once
    from threefold.training import halting
    from threefold.training.out_of_memory import out_of_memory_refused
    from threefold.training.trainer import Trainer

    started = start_processes(config, "finetune.py")
    if started is None:
        return 2
    device, parallel = started
    try:
        with out_of_memory_refused(config, "while building the model or loading its checkpoint"):
            trainer = Trainer(config, device, parallel, build_data=sft_datasets(sft_packing))
            loaded = load_checkpoint(
                load, trainer.checkpoint_components(), finetune=config.checkpoint.finetune
            )
            # --rerun-mode validate_results: an iteration a resumed run must rerun first
            pending = (
                resuming and loaded is not None and trainer.validation.after_load(load, loaded)
            )
    except ConfigError as error:  # from here on, possibly met by some ranks only
        print_refusal_once("finetune.py", error, parallel.world.rank)
        return 2
    for note in (starting_note, pending):
        if note:
            trainer.print(note)
    trainable = sum(
        p.numel() for _, p in trainer.layout_independent_parameters() if p.requires_grad
    )
    total = sum(p.numel() for _, p in trainer.layout_independent_parameters())
    trainer.print(
        f"> fine-tuning from {load} (iteration {iteration}): "
        f"{len(trainer.datasets[0])} training samples, {trainable:,} of {total:,} "
        "parameters trainable on rank 0"
        + (f", LoRA rank {config.model.lora_rank}" if config.model.lora_rank else "")
    )
    for name, dataset in trainer.validation_sets:
        # (advance=False: the first evaluation reads these batches again)
        initial = trainer.evaluate(advance=False, dataset=dataset)
        if initial is not None:
            trainer.print(f" {name} loss before fine-tuning | lm loss value: {initial:.6E} |")
    return halting.train(trainer, "finetune.py")


if __name__ == "__main__":
    sys.exit(main())
