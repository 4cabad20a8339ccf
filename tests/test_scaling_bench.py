"""bench/scaling.py: weak scaling runs at 1 and 2 gloo ranks, the table's batches and
efficiency column consistent with its tokens/s, the logs kept and plotted."""

import os
import re
import subprocess
import sys

from tests.conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))

import scaling  # noqa: E402


def test_efficiency_and_batches():
    assert scaling.efficiency({1: 100.0, 2: 150.0, 4: 400.0}) == {1: 1.0, 2: 0.75, 4: 1.0}
    assert [scaling.global_batch("weak", "dp", n, 8) for n in (1, 2, 4)] == [8, 16, 32]
    assert scaling.global_batch("weak", "tp", 4, 8) == 8  # a bigger replica, not more of them
    assert scaling.global_batch("strong", "dp", 4, 8) == 8


def test_scaling_runs_and_reports(tmp_path):
    small = "--num-layers 1 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    small += "--max-position-embeddings 64"
    result = subprocess.run(
        [sys.executable, "bench/scaling.py", "--ranks", "1", "2", "--modes", "weak"]
        + ["--train-iters", "4"]
        + ["--warmup", "1", "--extra", small, "--log-dir", str(tmp_path)]
        + ["--plot", str(tmp_path / "scaling.png")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for mode, batches in (("weak", [8, 16]),):
        table = result.stdout.split(f"## {mode} scaling")[1].split("##")[0]
        rows = re.findall(r"^\| (\d+) \| (\d+) \| (\d+) \| ([\d.]+)x \| (\d+)% \|$", table, re.M)
        assert [int(row[0]) for row in rows] == [1, 2]
        assert [int(row[1]) for row in rows] == batches
        rates = [int(row[2]) for row in rows]
        assert abs(int(rows[1][4]) - 100 * rates[1] / (2 * rates[0])) <= 1
        for ranks in (1, 2):
            with open(tmp_path / f"{mode}_dp{ranks}.log") as log:
                assert len(re.findall(r" iteration +\d+/ +4 \|", log.read())) == 4
    assert (tmp_path / "scaling.png").stat().st_size > 10_000
