"""Megatron-LM's release checkpoints: a tracker that says "release" and the checkpoint in
DIR/release, in either format (a model published or converted, as Megatron-LM's ModelOpt
examples save one). threefold's --load reads one as Megatron-LM's does: its weights, from
iteration 0 as --finetune loads them, no optimizer state or RNG; a run that saves into the same
directory resumes its own iterations afterwards and leaves the release as it was."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from tests import megatron_core_models as mc
from tests.conftest import ROOT
from tests.distributed import run_distributed
from tests.tools.megatron_runs import assert_same_weights, megatron_argv, train_from
from threefold.arguments import parse_args
from threefold.checkpoint.files import TRACKER
from threefold.checkpoint.load import find_checkpoint
from threefold.checkpoint.pretrained import starting_checkpoint
from threefold.config import ConfigError

FORMATS = ["torch_dist", "torch"]


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> dict:
    """format -> (megatron-core's checkpoint at iteration 10 (TP2), the same as a release)."""
    base = tmp_path_factory.mktemp("release")
    roots = {name: str(base / name) for name in FORMATS}
    run_distributed(2, mc.save_both, "llama", roots["torch_dist"], roots["torch"], 10, 2, 1)
    pairs = {}
    for name, root in roots.items():
        release = str(base / f"{name}_release")
        shutil.copytree(os.path.join(root, "iter_0000010"), os.path.join(release, "release"))
        with open(os.path.join(release, TRACKER), "w") as f:
            f.write("release\n")
        pairs[name] = (root, release)
    return pairs


def _digests(directory: str) -> dict[str, str]:
    found = {}
    for folder, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                found[os.path.join(folder, name)] = hashlib.sha256(f.read()).hexdigest()
    return found


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_release_holds_the_weights_of_the_iteration_it_was(released, fmt):
    root, release = released[fmt]
    (config, release_config), weights = assert_same_weights(root, release)
    assert release_config.model == config.model and len(weights) > 10


def test_a_run_starts_from_a_release_at_iteration_0_as_fine_tuning(released):
    """Megatron-LM's --load of a release: iteration 0, the weights only, whatever the flags."""
    root, release = released["torch_dist"]
    argv = megatron_argv(release, 1, 1)
    checkpoint, note = starting_checkpoint(parse_args(argv).checkpoint)
    assert checkpoint.finetune
    assert f"--load {release}: a release checkpoint (its {TRACKER} says 'release'" in note
    losses, trainer = train_from(argv, release, finetune=checkpoint.finetune)
    expected, _ = train_from(megatron_argv(root, 1, 1) + ["--finetune"], root, finetune=True)
    assert losses == expected
    assert trainer.checkpoint_components().train_state.iteration == 2


def test_a_run_saving_into_its_release_resumes_its_own_iterations(released, tmp_path):
    """--load and --save the same directory, as Megatron-LM's scripts have it: the first start
    fine-tunes from the release, its save moves the tracker on, and the next start resumes
    that; the release's files stay as they were."""
    directory = str(tmp_path / "checkpoints")
    shutil.copytree(released["torch_dist"][1], directory)
    before = _digests(os.path.join(directory, "release"))
    argv = megatron_argv(directory, 1, 1) + ["--save", directory, "--lr", "1e-3"]
    argv += ["--train-iters", "2", "--save-interval", "2", "--log-interval", "1"]
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "a release checkpoint" in result.stdout
    assert f"> loaded the weights of {directory} (iteration 0)" in result.stdout
    assert "iteration        2/       2 |" in result.stdout
    with open(os.path.join(directory, TRACKER)) as f:
        assert f.read().strip() == "2"
    assert _digests(os.path.join(directory, "release")) == before
    checkpoint, note = starting_checkpoint(parse_args(argv).checkpoint)
    assert not checkpoint.finetune and note is None


def test_a_release_tracker_without_its_directory_is_one_line(tmp_path):
    with open(tmp_path / TRACKER, "w") as f:
        f.write("release")
    with pytest.raises(ConfigError, match=r"the release checkpoint is damaged \(.*release does"):
        find_checkpoint(str(tmp_path))
