"""--init-model-with-meta-device (model/meta_device.py): a model built on the meta device and
materialized where it lives trains bitwise as the one built whole, in each strategy; under
FSDP2 no rank ever holds the whole model."""

import ctypes

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.parallel.test_expert_parallel import EP2, MOE
from tests.parallel.test_fp8 import RECIPES
from tests.parity import LLAMA_STYLE, TRAINING, _setup, train_job
from tests.training.test_checkpointing import _resume_job
from threefold.arguments import parse_args
from threefold.parallel import state
from threefold.training.build import build_model_chunks

META = ["--init-model-with-meta-device"]
FSDP = ["--distributed-strategy", "fsdp"]
LAYOUTS = {
    # FSDP2 over DP 2 around threefold's TP 2 with sequence parallelism: the shards are cut
    # from tensor-parallel pieces
    "fsdp2-dp2xtp2-sp": (4, FSDP + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    # the experts sharded over expert DP 2, the rest over DP 4
    "fsdp2-ep2-alltoall": (4, MOE + EP2 + FSDP + ["--moe-token-dispatcher-type", "alltoall"]),
    # FP8 weights gathered in FP8 (their FSDP2 shard type), the scaling state in buffers
    "fsdp2-fp8-param-gather": (2, FSDP + RECIPES["delayed"] + ["--fp8-param-gather"]),
    # threefold's own data parallelism: each stage materialized on its device at once
    "megatron-pp2xdp2-bf16-distributed-optimizer": (
        4,
        ["--pipeline-model-parallel-size", "2", "--bf16", "--use-distributed-optimizer"],
    ),
}


def _built_both_ways(argv: list[str], steps: int) -> tuple[list[float], bool]:
    """The losses built whole, and whether the run built on the meta device had the same
    losses, parameters and FP8 scaling state, bitwise."""
    whole, meta = train_job(argv, steps), train_job(argv + META, steps)
    same = whole["losses"] == meta["losses"]
    for kind in ("params", "fp8"):
        same &= whole[kind].keys() == meta[kind].keys()
        same &= all(np.array_equal(whole[kind][n], meta[kind][n]) for n in whole[kind])
    return whole["losses"], same


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_model_built_on_the_meta_device_trains_bitwise_as_one_built_whole(layout):
    ranks, flags = LAYOUTS[layout]
    results = run_distributed(ranks, _built_both_ways, LLAMA_STYLE + TRAINING + flags, 3)
    for losses, same in results:
        assert same and np.isfinite(losses).all(), layout


def _mib(key: str) -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def _host_memory_of_start_up(argv: list[str]) -> tuple[float, float, float]:
    """(the model's size whole, the peak and the final growth of this process's resident
    memory over the trainer's start-up), in MiB."""
    libc = ctypes.CDLL("libc.so.6")
    # A fixed threshold: tensors of 1 MiB and more are mapped, and unmapped when freed, so the
    # resident size follows the live tensors (glibc's adaptive one keeps freed ones).
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak (VmHWM) restarts from the resident size now
    before = _mib("VmRSS")
    trainer = _setup(argv)
    whole = 4 * sum(param.numel() for param in trainer.model.parameters()) / 2**20
    return whole, _mib("VmHWM") - before, _mib("VmRSS") - before


def test_fsdp2_ranks_never_hold_the_whole_model():
    """At DP 8 a rank's parameters, gradients and Adam's two moments are half the model. Built
    whole, each rank held all of it before FSDP2 cut its shards; built on the meta device the
    peak is what the rank keeps."""
    argv = LLAMA_STYLE + TRAINING + FSDP + ["--global-batch-size", "16"]
    widths = {"--hidden-size": "512", "--ffn-hidden-size": "1408", "--num-layers": "4"}
    argv = [widths.get(argv[i - 1], flag) if i else flag for i, flag in enumerate(argv)]
    whole = run_distributed(8, _host_memory_of_start_up, argv)
    meta = run_distributed(8, _host_memory_of_start_up, argv + META)
    for (size, peak, final), (_, meta_peak, meta_final) in zip(whole, meta):
        assert size > 40  # 12.3M parameters
        assert peak - final > 0.5 * size, (size, peak, final)
        assert meta_peak - meta_final < 0.1 * size, (size, meta_peak, meta_final)
        assert meta_peak < 0.6 * size, (size, meta_peak)


def _parameters_on_meta(argv: list[str]) -> list[bool]:
    config = parse_args(argv, world_size=state.global_world_size())
    parallel = state.initialize_layout(config.parallel)
    chunks = build_model_chunks(config, parallel, torch.device("cpu"), torch.float32)
    return [param.is_meta for chunk in chunks for param in chunk.parameters()]


def test_only_fsdp2_leaves_the_built_model_on_the_meta_device():
    """FSDP2 cuts the shards of meta parameters and materializes only them; DDP and threefold's
    own data parallelism get their model materialized as built."""
    argv = LLAMA_STYLE + TRAINING + META
    fsdp, ddp = (
        run_distributed(2, _parameters_on_meta, argv + strategy)
        for strategy in (FSDP, ["--distributed-strategy", "ddp"])
    )
    assert all(all(rank) for rank in fsdp) and not any(any(rank) for rank in ddp)


def test_a_run_built_on_the_meta_device_resumes_bitwise(tmp_path):
    """Three steps, saved, loaded into a model built on the meta device and materialized by
    FSDP2: the next three losses are the uninterrupted run's (FP8 scaling state included)."""
    ranks, flags = LAYOUTS["fsdp2-fp8-param-gather"]
    argv = LLAMA_STYLE + TRAINING + flags + META
    for result in run_distributed(ranks, _resume_job, argv, str(tmp_path / "ckpt")):
        assert result["resumed_losses"] == result["straight"]["losses"][3:]
