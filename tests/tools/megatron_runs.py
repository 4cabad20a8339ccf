"""Runs of threefold on a Megatron-LM checkpoint written by megatron-core
(tests/megatron_core_models.py): the flags that load it, the per-token losses of a layout,
a few training steps, and the files Megatron-LM writes beside it. Shared by the dense and the
mixture-of-experts interchange tests."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil

import torch

from tests import megatron_core_models as mc
from tests import megatron_core_training as mt
from threefold.checkpoint.files import read_metadata
from threefold.checkpoint.load import load_checkpoint, load_model


def reference_losses(logits: torch.Tensor) -> torch.Tensor:
    """Per-token losses of TOKENS[1:] given megatron-core's logits of TOKENS[:-1]."""
    return torch.nn.functional.cross_entropy(
        logits[0, :-1].double(), mc.TOKENS[0, 1:], reduction="none"
    ).float()


def per_token_losses(
    argv: list[str], root: str, length: int = mc.SEQ - 1, tokens: torch.Tensor = mc.TOKENS
) -> list | None:
    """Per-token losses of `tokens` (its first `length` + 1; the run's --seq-length) through a
    TP/PP run that --loads the Megatron checkpoint."""
    from tests.parity import _setup
    from threefold.parallel.pipeline_parallel.schedules import get_forward_backward_func

    trainer = _setup(argv)
    load_checkpoint(root, trainer.checkpoint_components(), finetune=True)
    for chunk in trainer.model_chunks:
        chunk.eval()
    tokens = tokens[:, : length + 1].repeat(2, 1)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}

    def step(batch, model, input_tensor=None):
        output = model(batch["tokens"], labels=batch["labels"], hidden_states=input_tensor)
        return output, lambda per_token: (per_token.mean(), per_token.detach())

    trainer.pipeline_options["tensor_shape"] = (length, 2, trainer.config.model.hidden_size)
    losses = get_forward_backward_func(trainer.parallel.pp)(
        step, iter([batch]), trainer.model_chunks, 1, forward_only=True, **trainer.pipeline_options
    )
    return losses[0][0].tolist() if trainer.parallel.is_last_pipeline_stage else None


def assert_same_weights(expected: str, root: str) -> tuple:
    """`root` loads into bitwise the weights `expected` loads into, name for name: (their
    configs, its state dict)."""
    config, model, _ = load_model(expected, with_tokenizer=False)
    other_config, other, _ = load_model(root, with_tokenizer=False)
    theirs, ours = model.state_dict(), other.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    return (config, other_config), ours


def megatron_argv(root: str, tp: int, pp: int, length: int = mc.SEQ - 1) -> list[str]:
    """A run whose model comes from the Megatron checkpoint's args (--use-checkpoint-args)."""
    return [
        "--load",
        root,
        "--use-checkpoint-args",  # (its tokenizer's files are not on this machine)
        "--mock-data",
        "--seq-length",
        str(length),
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "2",
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(pp),
    ]


def train_from(argv: list[str], root: str, finetune: bool, steps: int = 2) -> tuple[list, object]:
    from tests.parity import _setup

    trainer = _setup(argv)
    load_checkpoint(root, trainer.checkpoint_components(), load_optimizer=False, finetune=finetune)
    losses = [trainer.train_step()[0] for _ in range(steps)]
    return losses, trainer


def copy_with_args(root: str, destination: str, iteration: int = 10, **changes) -> str:
    """A copy of a Megatron checkpoint whose args (of `iteration`: in common.pt, or in every
    model_optim_rng.pt of the legacy format) have `changes`."""
    shutil.copytree(root, destination)
    directory = os.path.join(destination, f"iter_{iteration:07d}")
    path = os.path.join(directory, "common.pt")
    legacy = sorted(glob.glob(os.path.join(directory, "mp_rank_*", "model_optim_rng.pt")))
    for file in [path] if os.path.isfile(path) else legacy:
        common = torch.load(file, weights_only=False)  # the test's own file
        for name, value in changes.items():
            setattr(common["args"], name, value)
        torch.save(common, file)
    # (an export's file list would no longer match: dropped, as megatron-core writes none)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(os.path.dirname(path), "integrity.json"))
    return destination


def megatrons_integrity(path: str) -> dict:
    """What megatron-core's save_integrity_manifest writes (Megatron-LM's --verify-integrity;
    megatron-core 0.16.1 predates it): each file directly in the directory, its SHA-256."""
    files = {}
    for name in sorted(os.listdir(path)):
        if name != "integrity.json" and os.path.isfile(os.path.join(path, name)):
            with open(os.path.join(path, name), "rb") as f:
                files[name] = hashlib.sha256(f.read()).hexdigest()
    return {"algorithm": "sha256", "files": files}


def continue_training(argv: list[str], root: str, after: str, load_optimizer: bool) -> tuple:
    """One iteration after --load of Megatron's checkpoint, on megatron-core's next global
    batch: (the loss, the largest difference to megatron-core's weights after that step)."""
    from tests.parity import _full, _setup
    from threefold.data.loader import collate

    trainer = _setup(argv)
    assert load_checkpoint(root, trainer.checkpoint_components(), load_optimizer) == 2
    dp = trainer.parallel.dp
    rows = mt.batch(2, 2).chunk(dp.size)[dp.rank]
    items = [{"tokens": row.numpy()} for row in rows]
    trainer._train_iterator = iter([collate(items, trainer.device)])
    loss, _, _ = trainer.train_step()
    _, megatron_model, _ = load_model(after, with_tokenizer=False)
    expected = {
        megatron_model.layout_independent_name(n): p.detach()
        for n, p in megatron_model.named_parameters()
    }
    difference = max(
        float((torch.from_numpy(value) - expected[name][: value.shape[0]]).abs().max())
        for name, value in _full(trainer).items()
    )
    return loss, difference


def continue_argv(root: str, tp: int, pp: int, dp: int) -> list[str]:
    """megatron-core's hyperparameters (tests/megatron_core_models.py) as threefold flags."""
    return megatron_argv(root, tp, pp) + [
        "--micro-batch-size",
        str(2 // dp),
        "--lr",
        str(mt.LR),
        "--min-lr",
        str(mt.LR),
        "--lr-decay-style",
        "constant",
        "--weight-decay",
        str(mt.WEIGHT_DECAY),
        "--clip-grad",
        "1.0",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
    ]


def saved_by_megatron_core(tmp_path_factory, layouts: dict, models=mc) -> dict:
    """kind -> (Megatron-LM checkpoint root, megatron-core's logits of TOKENS) for each
    kind's layout (TP, PP, EP, ranks) megatron-core saves it at (iteration 10); `models`:
    the module that builds megatron-core's model (its GPTModel; tests/megatron_core_hybrid.py
    its MambaModel)."""
    from tests.distributed import run_distributed

    checkpoints = {}
    for kind, (tp, pp, ep, ranks) in layouts.items():
        root = str(tmp_path_factory.mktemp(f"megatron_{kind}"))
        run_distributed(ranks, models.save, kind, root, 10, tp, pp, ep)
        path = os.path.join(root, "iter_0000010")
        reference = run_distributed(1, models.logits, kind, path)[0]
        checkpoints[kind] = (root, reference)
    return checkpoints


def exports(root: str, reference: torch.Tensor, directory) -> tuple[torch.Tensor, list]:
    """threefold's logits of TOKENS after two fine-tuning steps from the Megatron checkpoint
    `root`, and Megatron-LM checkpoints threefold exports, each as (its iter_N directory, the
    logits megatron-core must compute from it, the tolerance): the trained model's (threefold's
    logits, 1e-5) and Megatron -> threefold -> Megatron's (megatron-core's own, bitwise). Each
    carries Megatron-LM's --verify-integrity list as megatron-core would write it."""
    from tests.tools.hf_models import convert_checkpoint
    from threefold.checkpoint.save import save_checkpoint

    trained, converted = str(directory / "trained"), str(directory / "converted")
    argv = megatron_argv(root, 1, 1) + ["--finetune", "--save", trained]
    _, trainer = train_from(argv, root, True)
    save_checkpoint(trained, trainer.checkpoint_components())
    _, model, _ = load_model(trained, with_tokenizer=False)
    with torch.no_grad():
        ours = model(mc.TOKENS).transpose(0, 1)
    argv = ["--loader", "megatron", "--saver", "threefold", "--load-dir", root, "--save-dir"]
    assert convert_checkpoint.main(argv + [converted]) == 0
    written = []
    for source, expected, tolerance in ((trained, ours, 1e-5), (converted, reference, 0)):
        out = source + "_megatron"
        argv = ["--loader", "threefold", "--saver", "megatron", "--load-dir", source]
        assert convert_checkpoint.main(argv + ["--save-dir", out]) == 0
        iteration = int(open(os.path.join(out, "latest_checkpointed_iteration.txt")).read())
        path = os.path.join(out, f"iter_{iteration:07d}")
        # the samples read so far go along, for Megatron-LM's data loaders to skip
        samples = [read_metadata(d, iteration)["train_state"] for d in (source, out)]
        for key in ("consumed_train_samples", "consumed_valid_samples"):
            assert samples[0].get(key, 0) == samples[1].get(key, 0), key
        with open(os.path.join(path, "integrity.json")) as f:
            assert json.load(f) == megatrons_integrity(path)
        written.append((path, expected, tolerance))
    return ours, written


def load_and_save(argv: list[str], root: str, threefold: str, export: str, native: bool) -> int:
    """threefold's run `argv` loads `root` with Adam's state and saves it: in Megatron-LM's
    format at `export` (`native`), else its own at `threefold`. Returns the iteration."""
    from tests.parity import _setup
    from threefold.checkpoint.megatron.training_save import save_megatron_training_checkpoint
    from threefold.checkpoint.save import save_checkpoint
    from threefold.checkpoint.writer import CheckpointWriter

    trainer = _setup(argv)
    iteration = load_checkpoint(root, trainer.checkpoint_components())
    if native:
        writer = CheckpointWriter(export)
        save_megatron_training_checkpoint(export, trainer.checkpoint_components(), writer)
    else:
        save_checkpoint(threefold, trainer.checkpoint_components())
    return iteration


def export_and_go_on(
    argv: list[str],
    root: str,
    directory,
    kind: str,
    tp: int,
    ranks: int,
    native: bool = False,
    ranks_here: int = 1,
    expert_parallel: int = 1,
    distributed: bool = True,
    convert_flags: tuple[str, ...] = (),
    fp16: bool = False,
):
    """threefold reads megatron-core's checkpoint `root` with Adam's state (`argv`, on
    `ranks_here` ranks) and saves its own; that is exported to Megatron-LM's format (by the
    converter with `convert_flags`; `native`: the run saves Megatron-LM's format itself,
    --ckpt-format torch_dist), and megatron-core's distributed optimizer (without
    `distributed`, its non-distributed one; `fp16`: in fp16) reads the export on `ranks` ranks
    at TP `tp`, as Megatron-LM's --load does, and takes the next iteration (at EP
    `expert_parallel`, for which the converter shapes the experts' optimizer state). Returns
    (the export's iter_N directory, megatron-core's loss, its weights after the iteration, by
    threefold name)."""
    from tests.distributed import run_distributed
    from tests.tools.hf_models import convert_checkpoint

    threefold, export = str(directory / "threefold"), str(directory / "export")
    where = (argv, root, threefold, export, native)
    if ranks_here == 1:
        iteration = load_and_save(*where)
    else:
        iteration = run_distributed(ranks_here, load_and_save, *where)[0]
    if not native:
        convert = ["--loader", "threefold", "--saver", "megatron", "--load-dir", threefold]
        if expert_parallel > 1:
            convert += ["--target-expert-parallel-size", str(expert_parallel)]
        assert convert_checkpoint.main([*convert, *convert_flags, "--save-dir", export]) == 0
    path, again = os.path.join(export, f"iter_{iteration:07d}"), str(directory / "again")
    losses = run_distributed(
        ranks, mt.load_and_continue, kind, path, again, tp, expert_parallel, distributed, fp16
    )
    _, model, _ = load_model(again, with_tokenizer=False)
    return path, losses[0], dict(model.named_parameters())


def largest_difference(weights: dict, checkpoint: str) -> float:
    """The largest difference between `weights` and a checkpoint's, by threefold name."""
    _, model, _ = load_model(checkpoint, with_tokenizer=False)
    expected = dict(model.named_parameters())
    return max(float((value - expected[name]).abs().max()) for name, value in weights.items())


def gradients_from(path: str, **changes) -> tuple[float, dict, torch.Tensor]:
    """threefold's training-mode loss, gradients (as megatron_core_models.gradients takes
    them) and logits, from a Megatron checkpoint whose model config takes `changes`."""
    config, model, _ = load_model(path, with_tokenizer=False)
    if changes:
        from threefold.model import GPTModel

        for name, value in changes.items():
            setattr(config.model, name, value)
        changed = GPTModel(config.model, model.padded_vocab_size)
        changed.load_state_dict(model.state_dict())
        model = changed
    with torch.no_grad():
        logits = model.eval()(mc.TOKENS).transpose(0, 1)
    model.train()
    per_token = model(mc.TOKENS[:, :-1], labels=mc.TOKENS[:, 1:], loss_mask=mc.LOSS_MASK)
    loss = (per_token * mc.LOSS_MASK).sum() / mc.LOSS_MASK.sum()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, logits
