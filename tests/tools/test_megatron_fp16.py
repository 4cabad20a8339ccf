"""fp16 runs and Megatron-LM's checkpoints: the dynamic loss scale and the iterations it skips.

Megatron-LM's fp16 run starts at a loss scale of 2^32, and skips each iteration whose
gradients overflow until the scale fits: its DynamicGradScaler's state (a one-element fp32
tensor and two counters) is in the optimizer's state, and its LR schedule counts only the
iterations that updated. threefold's own save in Megatron-LM's format (--ckpt-format
torch_dist) carries both over and its resume reads them back; it reads megatron-core's from
each of its optimizer layouts; megatron-core's fp16 optimizer goes on from threefold's export
as from its own checkpoint. Megatron-LM's own pretrain_gpt.py taking such runs over, and
handing them back, is bench/megatron_takeovers.py's (`llama-fp16`, `llama-fp16-distributed`).
"""

from __future__ import annotations

import os

import torch

from tests.distributed import run_distributed
from tests.parity import LLAMA_STYLE, TRAINING, _setup
from threefold.checkpoint.files import checkpoint_dir
from threefold.checkpoint.load import load_checkpoint
from threefold.checkpoint.megatron.common_file import read_common

TORCH_DIST = ["--ckpt-format", "torch_dist", "--use-distributed-optimizer"]


def _run(root: str, argv: list[str], save: bool) -> dict:
    """Two fp16 iterations saved, then two more; or that checkpoint loaded, then the two
    more. The losses and skips of the two more, and the loss scaler's state at the save."""
    trainer = _setup(argv)
    if save:
        for _ in range(2):
            trainer.train_step()
        trainer.checkpointer.save(2)
    else:
        assert load_checkpoint(root, trainer.checkpoint_components()) == 2
    saved = trainer.loss_scaler.state_dict()
    steps = [trainer.train_step() for _ in range(2)]
    return {"scaler": saved, "losses": [s[0] for s in steps], "skipped": [s[2] for s in steps]}


def test_an_fp16_runs_loss_scale_is_saved_as_megatron_cores_grad_scaler(tmp_path):
    """The scale goes into common.pt as megatron-core's DynamicGradScaler saves its own state
    stepped the same way (the scale a one-element fp32 tensor, which its load moves with
    `.cuda()`: a number there stopped Megatron-LM's --load), and threefold resumes it. Two
    updates in a window of 3 leave the growth counter at 2, which the next one carries on."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    from tests.megatron_core_models import optimizer_patches

    root = str(tmp_path / "run")
    argv = LLAMA_STYLE + TRAINING + TORCH_DIST + ["--save", root]
    argv += ["--fp16", "--initial-loss-scale", "16384", "--loss-scale-window", "3"]
    went_on = run_distributed(2, _run, root, argv, True)[0]
    assert went_on["scaler"] == {"scale": 16384.0, "growth_tracker": 2, "hysteresis_tracker": 2}
    common = os.path.join(checkpoint_dir(root, 2), "common.pt")  # (the test's own file)
    written = torch.load(common, weights_only=False)["optimizer"]["grad_scaler"]
    with optimizer_patches():  # (its tensors made on "cuda", here on the CPU)
        settings = dict(initial_scale=16384.0, min_scale=1.0, growth_factor=2.0)
        settings |= dict(backoff_factor=0.5, growth_interval=3, hysteresis=2)
        theirs = DynamicGradScaler(**settings)
    for _ in range(2):
        theirs.update(found_inf=False)
    own = theirs.state_dict()
    assert written.keys() == own.keys()
    assert written["scale"].dtype == own["scale"].dtype
    assert torch.equal(written["scale"], own["scale"])
    assert all(written[k] == own[k] for k in ("growth_tracker", "hysteresis_tracker"))
    resumed = run_distributed(2, _run, root, argv + ["--load", root], False)
    assert all(each == went_on for each in resumed)


def test_the_iterations_fp16_skipped_are_not_in_the_lr_schedule_saved_or_resumed(tmp_path):
    """A scale of 2^21 overflows twice (--hysteresis 1 halves it each time), then trains: the
    checkpoint of iteration 2 has consumed 16 samples, but its LR schedule, as Megatron-LM's
    counts it, none; resumed, the run warms up from the first iteration that updated, as the
    run that went on did (the resume once counted the schedule from the iteration)."""
    root = str(tmp_path / "run")
    argv = LLAMA_STYLE + TRAINING + TORCH_DIST + ["--save", root]
    argv += ["--fp16", "--initial-loss-scale", str(2.0**21), "--hysteresis", "1"]
    went_on = run_distributed(2, _run, root, argv, True)[0]
    assert went_on["scaler"]["scale"] == 2.0**19 and went_on["skipped"] == [False, False]
    common = read_common(checkpoint_dir(root, 2))
    assert common["opt_param_scheduler"]["num_steps"] == 0
    assert common["args"]["consumed_train_samples"] == 16
    resumed = run_distributed(2, _run, root, argv + ["--load", root], False)
    assert all(each == went_on for each in resumed)


def test_megatron_cores_fp16_loss_scale_is_read_from_each_optimizer_layout(tmp_path):
    """megatron-core's fp16 run (two iterations, TP2 x DP2, the distributed optimizer) saves its
    DynamicGradScaler's state where each layout keeps it: in common.pt (model space), as an
    object of its own beside the dp_reshardable buckets (which threefold once did not look
    for: the growth counter restarted at 0), in the legacy format's model_optim_rng.pt."""
    from tests import megatron_core_training as mt
    from threefold.checkpoint.megatron.format import megatron_metadata
    from threefold.checkpoint.megatron.legacy import legacy_metadata

    layouts = ("fully_reshardable", "dp_reshardable", "legacy")
    roots = {layout: str(tmp_path / layout) for layout in layouts}
    theirs = run_distributed(4, mt.save_layouts, "llama", roots, 2, 2, False, None, True)[0]
    assert theirs == {"scale": 16384.0, "growth_tracker": 2, "hysteresis_tracker": 2}
    for layout, root in roots.items():
        metadata = legacy_metadata if layout == "legacy" else megatron_metadata
        assert metadata(checkpoint_dir(root, 2))["loss_scaler"] == theirs, layout


def test_an_fp16_export_goes_on_in_megatron_cores_fp16_optimizer(tmp_path):
    """megatron-core's fp16 run (TP2 x DP2, the non-distributed optimizer) saved after two
    iterations; threefold takes it over (fp16 weights, fp32 masters, Adam's moments, the loss
    scaler) and saves it in Megatron-LM's format itself; megatron-core's fp16 optimizer loads
    that (its scale through `.cuda()`) and takes the iteration it took from its own
    checkpoint: the same loss and weights."""
    from tests import megatron_core_training as mt
    from tests.tools.megatron_runs import continue_argv, export_and_go_on, largest_difference

    root, after = str(tmp_path / "run"), str(tmp_path / "after")
    theirs = run_distributed(4, mt.train_and_save, "llama", root, after, 2, None, 2, 1, True)[0]
    scaling = mt.FP16_LOSS_SCALING
    argv = continue_argv(root, 1, 1, 1) + ["--fp16", "--initial-loss-scale", "1"]
    argv += ["--loss-scale-window", str(scaling["loss_scale_window"])]
    _, loss, weights = export_and_go_on(
        argv, root, tmp_path, "llama", 2, 4, native=True, distributed=False, fp16=True
    )
    assert loss == theirs
    assert largest_difference(weights, after) == 0
