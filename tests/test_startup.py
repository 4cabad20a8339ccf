"""The entry scripts import torch and the trainer with the cyclic collector paused and freeze
what those imports made (threefold/startup.py): no full collection passes over them while they
import, nor at exit."""

import gc
import os
import re
import subprocess
import sys

from tests.conftest import ROOT, TINY_MODEL
from threefold.startup import frozen_imports

# Reported by the training process itself at exit, before the interpreter's last collection.
REPORT_AT_EXIT = """
import atexit, gc, sys
atexit.register(lambda: sys.stderr.write(
    f"frozen {gc.get_freeze_count()} full collections {gc.get_stats()[2]['collections']}\\n"))
"""


def test_the_imports_run_without_the_collector_and_are_frozen_after():
    class Cycle:  # what an import makes: objects in reference cycles, kept for good
        def __init__(self) -> None:
            self.itself = self

    before = gc.get_freeze_count()
    try:
        with frozen_imports():
            assert not gc.isenabled()
            made = [Cycle() for _ in range(100)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= before + len(made)
        gc.disable()  # a caller that runs without the collector keeps it off
        with frozen_imports():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()  # the pytest process's objects back to the oldest generation


def run_reporting(
    tmp_path, report: str, command: list[str], timeout: float = 240
) -> subprocess.CompletedProcess:
    """`command` run from the checkout with `report` as its processes' sitecustomize (each
    Python process it starts runs it first: the place to register an exit report)."""
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=reporting_environment(tmp_path, report),
        timeout=timeout,
    )


def reporting_environment(tmp_path, report: str) -> dict[str, str]:
    """This process's environment, with `report` the sitecustomize of what it starts."""
    (tmp_path / "sitecustomize.py").write_text(report)
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


def test_a_training_process_collects_nothing_it_imported(tmp_path):
    argv = TINY_MODEL + ["--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3"]
    result = run_reporting(
        tmp_path,
        REPORT_AT_EXIT,
        [sys.executable, "pretrain_gpt.py", *argv, "--mock-data", "--vocab-size", "100"],
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = re.findall(r"frozen (\d+) full collections (\d+)", result.stderr)
    assert report, result.stderr[-500:]
    frozen, collections = map(int, report[-1])
    # torch and the trainer are some 300,000 objects; importing them with the collector on
    # ran five full collections over them. The one full collection is state.shut_down's,
    # which frees the run's groups before the teardown: frozen, the imports are not in it.
    assert frozen > 100_000 and collections == 1, result.stderr[-500:]
