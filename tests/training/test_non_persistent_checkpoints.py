"""Megatron-LM's non-persistent checkpoints (`--non-persistent-save-interval` with
`--non-persistent-ckpt-type global`): frequent saves into SAVE/non_persistent, of which only the
newest is kept, beside the persistent ones; a start loads whichever is newer, as Megatron-LM's
--load does."""

import os
import re
import subprocess
import sys

from tests.conftest import CLI_MODEL, ROOT
from threefold.arguments import parse_args
from threefold.checkpoint.files import TRACKER
from threefold.checkpoint.pretrained import starting_checkpoint

LOSS = re.compile(r" iteration +(\d+)/ +\d+ \|.*?\| lm loss: ([\d.E+-]+) \|")


def _losses(output: str) -> dict[int, str]:
    return {int(i): loss for i, loss in LOSS.findall(output)}


def _tracker(directory) -> str:
    with open(os.path.join(directory, TRACKER)) as f:
        return f.read().strip()


def test_a_run_killed_after_a_non_persistent_save_resumes_from_it(tmp_path):
    save = str(tmp_path / "run")
    argv = CLI_MODEL + ["--lr", "1e-3", "--train-iters", "8", "--log-interval", "1"]
    argv += ["--save", save, "--load", save, "--save-interval", "4"]
    argv += ["--non-persistent-save-interval", "3", "--non-persistent-ckpt-type", "global"]
    command = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv]

    def run(**environment) -> subprocess.CompletedProcess:
        return subprocess.run(
            command,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **environment},
        )

    # killed in the save at the end: the persistent checkpoint is iteration 4's, the
    # non-persistent one 6's (3's removed when 6's was complete)
    killed = run(THREEFOLD_CRASH_AT="before-shards@8")
    assert killed.returncode != 0
    non_persistent = os.path.join(save, "non_persistent")
    assert _tracker(save) == "4" and _tracker(non_persistent) == "6"
    assert sorted(os.listdir(non_persistent)) == ["iter_0000006", TRACKER]
    # (--ckpt-step names an iteration of --load itself)
    named, _ = starting_checkpoint(parse_args(argv + ["--ckpt-step", "4"]).checkpoint)
    assert named.load == save
    resumed = run()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        f"> loading the non-persistent checkpoint of iteration 6 in {non_persistent} (--load "
        f"{save} holds 4)" in resumed.stdout
    )
    assert f"> resumed from {non_persistent} at iteration 6" in resumed.stdout
    before, after = _losses(killed.stdout), _losses(resumed.stdout)
    assert sorted(after) == [7, 8] and all(after[i] == before[i] for i in (7, 8))
    assert _tracker(save) == "8"
    # the persistent checkpoint once newer: it is loaded, the older non-persistent one is not
    checkpoint, note = starting_checkpoint(parse_args(argv).checkpoint)
    assert checkpoint.load == save and note is None


def test_non_persistent_checkpoints_other_than_global_are_one_line(capsys):
    for flags, said in (
        (["--non-persistent-ckpt-type", "local"], "local and in-memory checkpoints"),
        (["--non-persistent-save-interval", "5"], "needs --non-persistent-ckpt-type global"),
    ):
        try:
            parse_args(CLI_MODEL + ["--train-iters", "4", "--save", "/tmp/x", *flags])
        except SystemExit:
            pass
        error = capsys.readouterr().err
        assert said in error and error.count("\n") == 1, error
