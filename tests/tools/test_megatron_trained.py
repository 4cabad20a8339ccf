"""threefold takes over runs of Megatron-LM's own pretrain_gpt.py.

tests/data/megatron_saved_models/trained/<run>/ (`python bench/megatron_training.py fixture
CHECKOUT`) holds what Megatron-LM's unchanged pretrain_gpt.py did on 4 gloo CPU ranks (warm-up
and cosine decay, weight decay, clipping, its distributed optimizer): its command line, its
checkpoint of iteration 2 and the learning rate, loss and gradient norm (and a mixture of
experts' load-balancing loss) it logged for iterations 1 to 6. `llama`: TP2 x DP2, the
optimizer state in its default dp_reshardable layout; `moe`: 4 experts over EP2 with the
alltoall dispatcher and a load-balancing loss, PP2, the state fully_reshardable. threefold's
pretrain_gpt.py on that command line, --load pointing at the checkpoint, must log Megatron-LM's
iterations 3 to 6: at the run's own layout, and resharded into one process.
bench/results/megatron_training.md shows the way back (Megatron-LM resuming threefold's
checkpoint of iteration 4).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.distributed import free_port
from threefold.checkpoint.megatron.vocabulary import checkpoint_vocabulary
from threefold.config import DataConfig

FIXTURE = os.path.join(ROOT, "tests", "data", "megatron_saved_models", "trained")
TRAINED = os.path.join(FIXTURE, "llama")
CORPUS = os.path.join(FIXTURE, "corpus")
ITERATION = re.compile(r" iteration +(\d+)/ +\d+ \|(.*)")
# each a printed value to within a unit in its last place (another CPU's rounding)
TOLERANCES = {"lm loss": 1.5e-6, "load_balancing_loss": 1.5e-6, "grad norm": 1.5e-3}


def _megatron_run(name: str = "llama") -> dict:
    with open(os.path.join(FIXTURE, name, "run.json")) as f:
        return json.load(f)


def _logged(output: str) -> dict[int, dict[str, str]]:
    """{iteration: {name: value}} of each log line's "name: value" fields."""
    found = {}
    for iteration, fields in ITERATION.findall(output):
        pairs = (field.partition(":") for field in fields.split(" | "))
        found[int(iteration)] = {name.strip(): value.strip() for name, _, value in pairs}
    return found


def _pretrain(argv: list[str], nproc: int = 1, **environment) -> subprocess.CompletedProcess:
    """threefold's pretrain_gpt.py on `nproc` processes (torchrun's beyond one)."""
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
        launch += ["--master_port", str(free_port())]
    return subprocess.run(
        [*launch, os.path.join(ROOT, "pretrain_gpt.py"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, **environment),
    )


def _take_over(
    tmp_path, nproc: int, flags: list[str], name: str = "llama"
) -> dict[int, dict[str, str]]:
    """threefold's pretrain_gpt.py on Megatron-LM's command line of run `name` (and `flags`),
    resuming its checkpoint (a copy, in tmp_path/checkpoints, where the run saves) on `nproc`
    processes: {iteration: {name: value}} as logged."""
    root, run = tmp_path / "checkpoints", os.path.join(FIXTURE, name)
    shutil.copytree(os.path.join(run, "iter_0000002"), root / "iter_0000002")
    shutil.copy(os.path.join(run, "latest_checkpointed_iteration.txt"), root)
    argv = _megatron_run(name)["argv"] + ["--data-path", CORPUS]
    argv += ["--data-cache-path", str(tmp_path), "--load", str(root), "--save", str(root)]
    result = _pretrain([*argv, *flags], nproc)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "the model's vocabulary is the checkpoint's 64 rows" in result.stdout
    return _logged(result.stdout)


def _assert_megatrons(logged: dict, iterations, name: str = "llama") -> None:
    """Megatron-LM's values (those it logged) to the digits its log prints."""
    theirs = _megatron_run(name)["logged"]
    for iteration in iterations:
        ours, expected = logged[iteration], theirs[str(iteration)]
        # (the learning rate is the scheduler's Python arithmetic: the same on any CPU)
        assert ours["learning rate"] == expected["learning rate"], iteration
        for field in expected.keys() - {"learning rate"}:
            difference = abs(float(ours[field]) - float(expected[field]))
            assert difference <= TOLERANCES[field], (iteration, field, ours, expected)


@pytest.mark.parametrize(
    "name,nproc,flags",
    [
        ("llama", 4, []),
        ("llama", 1, ["--tensor-model-parallel-size", "1"]),
        ("moe", 4, []),
        ("moe", 1, ["--pipeline-model-parallel-size", "1", "--expert-model-parallel-size", "1"]),
    ],
    ids=[
        "llama-its-layout-tp2-dp2",
        "llama-one-process",
        "moe-its-layout-pp2-ep2-dp2",
        "moe-one-process",
    ],
)
def test_threefold_goes_on_with_megatron_lms_run_as_megatron_lm(tmp_path, name, nproc, flags):
    """Its weights, Adam's moments and step (sharded over DP in the dp_reshardable buckets, or
    in model space; the experts' with their own optimizer's), the LR schedule and the data
    position: iterations 3 to 6 are Megatron-LM's, the mixture of experts' routing and
    load-balancing loss with them. One process reads the TP, PP, EP and DP shards whole and
    takes its global batch in 4 micro-batches."""
    _assert_megatrons(_take_over(tmp_path, nproc, flags, name), range(3, 7), name)


def test_without_its_optimizer_state_the_run_goes_another_way(tmp_path):
    """The comparison can fail: Adam started afresh (--no-load-optim) gives iteration 3's loss
    (the loaded weights) but not iteration 4's."""
    flags = ["--tensor-model-parallel-size", "1", "--no-load-optim", "--ckpt-format", "threefold"]
    logged = _take_over(tmp_path, 1, flags)
    _assert_megatrons(logged, [3])
    expected = float(_megatron_run()["logged"]["4"]["lm loss"])
    assert abs(float(logged[4]["lm loss"]) - expected) > 1e-3
    # Saved in threefold's format, the model keeps the 64 rows, and the command line resumes it.
    assert checkpoint_vocabulary(str(tmp_path / "checkpoints"), 61)[0] == 64


def test_the_checkpoints_padded_vocabulary_is_taken_only_where_it_is_this_runs_padding():
    """Megatron-LM keeps 64 rows (NullTokenizer's 61 ids padded to a multiple of 32 x TP2): a
    vocabulary that pads to them takes them; another stays, for the load to refuse."""
    rows, note = checkpoint_vocabulary(TRAINED, 61)
    assert rows == 64 and "padded to a multiple of 64" in note
    assert checkpoint_vocabulary(TRAINED, 60)[0] == 64  # (another tokenizer's 60: the same)
    assert checkpoint_vocabulary(TRAINED, 64) == (64, None)
    assert checkpoint_vocabulary(TRAINED, 65) == (65, None)
    assert checkpoint_vocabulary(None, 61) == (61, None)


def test_use_checkpoint_args_gives_its_null_tokenizer_megatron_lms_end_of_document_id():
    """Megatron-LM's --vocab-size 60, not the padded rows less one: its NullTokenizer's
    end-of-document id is 60, as in Megatron-LM (which mock data and --eod-mask-loss use)."""
    from threefold.checkpoint.args import checkpoint_flags
    from threefold.data.tokenizer import build_tokenizer

    flags = checkpoint_flags(TRAINED, with_tokenizer=True)
    assert flags[flags.index("--vocab-size") + 1] == "60"
    assert "NullTokenizer" in flags
    assert build_tokenizer(DataConfig(tokenizer_type="NullTokenizer"), 60).eod == 60


def test_a_vocabulary_the_checkpoint_does_not_pad_to_is_refused_in_one_line(tmp_path):
    argv = _megatron_run()["argv"] + ["--data-path", CORPUS]
    argv += ["--load", TRAINED, "--save", str(tmp_path), "--vocab-size", "100"]
    argv += ["--data-cache-path", str(tmp_path)]  # (not beside the fixture's corpus)
    argv += ["--tensor-model-parallel-size", "1"]
    result = _pretrain(argv, THREEFOLD_VALIDATE_ONLY="1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"pretrain_gpt.py: error: --load {TRAINED}: the checkpoint's model has --vocab-size "
        "64 but this run has 101; use the checkpoint's model flags"
    ]
