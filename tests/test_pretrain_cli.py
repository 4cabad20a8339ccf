"""`torchrun pretrain_gpt.py` trains end to end with TP=2 x DP=... and prints Megatron's log."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_torchrun_tensor_parallel_mock_data_run():
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               os.path.join(ROOT, "pretrain_gpt.py"), "--tensor-model-parallel-size", "2",
               "--sequence-parallel", "--num-layers", "2", "--hidden-size", "64",
               "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
               "--global-batch-size", "4", "--train-iters", "6", "--lr", "1e-3", "--mock-data",
               "--vocab-size", "500", "--log-interval", "3", "--eval-interval", "6",
               "--eval-iters", "1", "--distributed-backend", "gloo"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(" iteration")]
    assert len(lines) == 2
    assert re.match(r" iteration +6/ +6 \| consumed samples: +24 \| elapsed time per iteration "
                    r"\(ms\): [\d.]+ \| learning rate: [\d.E+-]+ \| global batch size: +4 \| "
                    r"lm loss: [\d.E+-]+ \| loss scale: 1\.0 \| grad norm: [\d.]+ \| number of "
                    r"skipped iterations: +0 \| number of nan iterations: +0 \|", lines[1])
    assert "TP=2, PP=1, DP=1, sequence parallel" in result.stdout
    assert "validation loss at iteration 6" in result.stdout
