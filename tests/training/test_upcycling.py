"""--moe-use-upcycling (Megatron-LM's): a dense checkpoint turned into a mixture of experts.
threefold's upcycled tensors are megatron-core's `upcycling_utils` ones bitwise (granularity 2:
each expert half of the dense MLP, in virtual groups, scaled); through pretrain_gpt.py a
trained dense model upcycled at granularity 1 computes the dense model's logits, then trains on;
what megatron-core's upcycling cannot fill, or a second upcycling over a written --save, is
one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests import megatron_core_models as mc
from tests.distributed import run_distributed
from threefold.arguments import parse_args
from threefold.checkpoint.load import load_model
from threefold.checkpoint.upcycling import upcycled_state

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _megatron_cores_upcycling() -> tuple[dict, dict, dict]:
    """megatron-core's dense LLaMA, its 4-expert mixture of 48-wide experts (as initialized)
    and megatron-core's upcycled state of the two."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import upcycling_utils

    with mc.cpu_patches():
        dense = mc.build("llama", 1, 1, seed=1)
        parallel_state.destroy_model_parallel()
        moe = mc.build("llama_upcycled", 1, 1, seed=2)
        upcycled = upcycling_utils._convert_to_moe_state_dict(moe, dense)
        parallel_state.destroy_model_parallel()

    def tensors(state: dict) -> dict:
        return {k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}

    return tensors(dense.state_dict()), tensors(moe.state_dict()), tensors(upcycled)


def test_the_upcycled_tensors_are_megatron_cores():
    dense, init, expected = run_distributed(1, _megatron_cores_upcycling)[0]
    argv = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 96 "
    argv += "--swiglu --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 "
    argv += "--seq-length 16 --micro-batch-size 1 --mock-data --vocab-size 256"
    config = parse_args(argv.split()).model
    ours = upcycled_state(dense, init, config, granularity=2)
    assert ours.keys() == expected.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name
    # (the test can fail: the experts hold halves of the dense MLP, scaled, not copies)
    fc1 = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    assert fc1 in ours and ours[fc1].shape == (96, 64)
    assert not torch.equal(ours[fc1], dense["decoder.layers.0.mlp.linear_fc1.weight"][:96])


BASE = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
BASE += "--micro-batch-size 2 --global-batch-size 2 --mock-data --vocab-size 128 --swiglu "
BASE += "--normalization RMSNorm --disable-bias-linear --position-embedding-type rope "
BASE += "--lr 1e-3 --ffn-hidden-size 128 --train-iters 3 --eval-iters 1"
MOE = "--num-experts 4 --moe-router-topk 2 --moe-use-upcycling"


def _pretrain(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *BASE.split(), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("upcycling") / "dense")
    assert _pretrain("--save", root).returncode == 0
    return root


def test_a_dense_model_upcycled_computes_its_logits_then_trains(dense, tmp_path):
    """Granularity 1: every expert a copy of the dense MLP, softmax weights over the top 2
    that add up to 1: the dense model's function; the run trains on and saves."""
    moe = str(tmp_path / "moe")
    result = _pretrain(*MOE.split(), "--load", dense, "--save", moe)
    assert result.returncode == 0, result.stderr
    assert "upcycled --load" in result.stdout and "--no-load-optim --no-load-rng" in result.stdout
    assert {"iter_0000000", "iter_0000003"} <= set(os.listdir(moe))
    _, dense_model, _ = load_model(dense, with_tokenizer=False)
    config, upcycled, _ = load_model(moe, iteration=0, with_tokenizer=False)
    assert config.model.num_experts == 4
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = dense_model(tokens)
        torch.testing.assert_close(upcycled(tokens), expected, rtol=0, atol=1e-6)
        _, trained, _ = load_model(moe, with_tokenizer=False)
        assert (trained(tokens) - expected).abs().max() > 1e-4


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--moe-shared-expert-intermediate-size", "64"], "leaves it at its initialization"),
        (["--moe-upcycling-granularity", "3"], "a multiple of --moe-upcycling-granularity 3"),
        (["--openai-gelu"], "this model's activation is none of them"),
        (["--moe-latent-size", "16"], "latent experts at another"),
        ([], "give both, apart"),
    ],
    ids=["shared-expert", "granularity", "activation", "latent", "save-is-load"],
)
def test_what_megatron_cores_upcycling_cannot_fill_is_one_line(tmp_path, capsys, argv, named):
    save = str(tmp_path / "s") if argv else str(tmp_path)
    base = BASE.split() + MOE.split() + ["--load", str(tmp_path), "--save", save]
    if argv[:1] == ["--openai-gelu"]:  # (GELU's tanh approximation, in place of SwiGLU)
        base.remove("--swiglu")
    with pytest.raises(SystemExit):
        parse_args(base + argv)
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1


def test_a_second_upcycling_and_another_model_are_refused_in_one_line(dense, tmp_path):
    """Upcycling over --save's checkpoint (Megatron-LM asserts the same), before start-up;
    a dense model of another width, at start-up (every rank stops)."""
    save = str(tmp_path / "moe")
    assert _pretrain(*MOE.split(), "--load", dense, "--save", save).returncode == 0
    again = _pretrain(*MOE.split(), "--load", dense, "--save", save)
    assert again.returncode == 2 and "holds a checkpoint already" in again.stderr
    assert again.stderr.count("\n") == 1
    narrower = ["--moe-ffn-hidden-size", "48", "--load", dense, "--save", str(tmp_path / "n")]
    other = _pretrain(*MOE.split(), *narrower)
    assert other.returncode == 2 and "--ffn-hidden-size --moe-upcycling-granularity" in other.stderr
    assert other.stderr.strip().count("\n") == 0


def _upcycled_first_loss(argv: list[str]) -> float:
    """pretrain_gpt.py's start under --moe-use-upcycling (rank 0 writes, every rank loads in
    its own layout), then one training step's loss."""
    from tests.parity import _setup
    from threefold.checkpoint.load import load_checkpoint
    from threefold.checkpoint.upcycling import upcycle_on_rank_zero

    trainer = _setup(argv)
    upcycle_on_rank_zero(trainer.config, trainer.parallel)
    load_checkpoint(trainer.config.checkpoint.save, trainer.checkpoint_components(), finetune=True)
    return trainer.train_step()[0]


def test_ranks_upcycle_once_and_train_as_one_process(dense, tmp_path):
    """On EP2 ranks (alltoall) rank 0 reads and writes while the others wait (a read that
    asked the other ranks to agree on the iteration hung them), and the step is one
    process's."""
    argv = BASE.split() + MOE.split() + ["--load", dense, "--global-batch-size", "4"]
    argv += ["--hidden-dropout", "0", "--attention-dropout", "0"]  # (no layout's own draws)
    alone = run_distributed(1, _upcycled_first_loss, argv + ["--save", str(tmp_path / "one")])
    ep2 = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    ranks = run_distributed(2, _upcycled_first_loss, argv + ep2 + ["--save", str(tmp_path / "two")])
    for loss in ranks:
        assert loss == pytest.approx(alone[0], rel=1e-6)
