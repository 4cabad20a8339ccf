"""Out of memory is one line naming the need and the levers (training/out_of_memory.py), not
a traceback per rank."""

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import ROOT
from threefold.arguments import parse_args
from threefold.config import ConfigError
from threefold.training import halting
from threefold.training.out_of_memory import out_of_memory_line, out_of_memory_refused

TINY = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
TINY += "--micro-batch-size 2 --train-iters 1 --lr 1e-3 --mock-data --vocab-size 128"


def _overcommit_mode() -> str:
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def test_the_allocators_errors_become_one_line_with_the_estimate():
    config = parse_args(TINY.split() + ["--hidden-size", "4096", "--num-attention-heads", "32"])
    cuda = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB "
        "of which 1.2 GiB is free. Of the allocated memory 75.3 GiB is allocated by PyTorch"
    )
    cpu = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 120000000000 bytes. Error code 12 (Cannot allocate memory)"
    )
    for error, asked in ((cuda, "2.00 GiB more"), (cpu, "111.76 GiB more")):
        with pytest.raises(ConfigError) as refused, out_of_memory_refused(config, "while training"):
            raise error
        line = str(refused.value)
        assert "\n" not in line and refused.value.__cause__ is None
        assert line.startswith(f"out of memory while training: torch could not allocate {asked}")
        # 2 layers of 12 h^2 and the 128 x h embedding, 16 bytes a parameter in fp32 with Adam
        assert "this layout needs about 6.0 GiB a device (6.0 GiB of weights" in line, line
        assert "--micro-batch-size" in line and "tools/plan_layout.py" in line
    assert "could not allocate more memory" in out_of_memory_line(RuntimeError(), config, "x")


def test_other_errors_pass_through():
    config = parse_args(TINY.split())
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        with out_of_memory_refused(config, "while training"):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)")


def test_a_micro_batch_too_large_stops_training_in_one_line(capsys):
    """halting.train, as pretrain_gpt.py and finetune.py run it: exit code 2 and the line."""
    config = parse_args(TINY.split())

    def train():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB.")

    rank = SimpleNamespace(world=SimpleNamespace(rank=0))
    trainer = SimpleNamespace(config=config, parallel=rank, train=train)
    assert halting.train(trainer, "pretrain_gpt.py") == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(
        "pretrain_gpt.py: error: out of memory while training: torch could not allocate 8.00 GiB"
    ), line


@pytest.mark.skipif(
    _overcommit_mode() not in ("0", "2"),
    reason="the kernel refuses an allocation beyond memory up front only when it does not "
    "overcommit without limit (vm.overcommit_memory 0 or 2)",
)
def test_a_model_too_large_for_the_machine_stops_in_one_line():
    """A hidden size of 100,000: 240 billion parameters, each layer's matrices larger than
    the machine; torch's allocator refuses the first."""
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *TINY.split()]
        + ["--hidden-size", "100000"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "pretrain_gpt.py: error: out of memory while building the model or loading its "
        "checkpoint: torch could not allocate"
    ), line
    assert "this layout needs about 3577.0 GiB a device" in line, line
    assert time.monotonic() - start < 60
