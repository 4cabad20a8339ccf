"""--async-save with every training-thread collective that used to deadlock or corrupt it
(--exit-signal-handler, --check-for-nan-in-loss-and-grad, --exit-duration-in-mins) and a save
every iteration, over 20 iterations on 2 ranks, on TP2 x PP2 and on FSDP2 (DTensor shards, FP8
all-gather extensions; it crashed at its first async save before): no hang, no crash, and every
saved iteration's shards and RNG files equal those of the same run saved synchronously.
bench/async_save_stress.py runs the same comparison in a loop (bench/results/); here its runs go
two at a time."""

import os
import subprocess
import sys

from tests.conftest import ROOT


def test_async_saves_under_collectives_equal_synchronous_ones():
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "async_save_stress.py"),
            "--loops",
            "1",
            "--iterations",
            "10",
            "--layouts",
            "tp2pp2",
            "fsdp2-fp8",
            "--timeout",
            "240",
            "--jobs",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [
        line
        for line in result.stdout.splitlines()
        if line.startswith(("| tp2pp2 |", "| fsdp2-fp8 |"))
    ]
    assert len(rows) == 2 and all("| 1 | 1 | 0 | 0 | 0 |" in row for row in rows), rows
