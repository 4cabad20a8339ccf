"""--optimizer muon (Megatron-LM's Muon): each weight matrix takes the orthogonalized momentum
step, query/key/value apart, the rest Adam's; every layout takes one device's steps, and the
momentum resumes in another layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.parallel.test_expert_parallel import MOE
from tests.parity import (
    LLAMA_STYLE,
    TRAINING,
    _setup,
    assert_matches_reference,
    first_step_gradients_job,
    relative_error,
    train_job,
)
from tests.training.test_resharding import _check, _load_then_step, _save_then_continue
from threefold.training.muon import newton_schulz, scale_factor

# fp32 Newton-Schulz: the layouts' gradients differ by rounding, which bf16 iterations
# would turn into differences of a bf16 ulp in the update (the default, medium, is bf16)
MUON = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high", "--muon-momentum", "0.8"]
MUON += ["--muon-extra-scale-factor", "0.2", "--lr", "1e-3"]


def test_newton_schulz_turns_a_matrix_towards_its_orthogonal_factor():
    """NS(X) ~ U S' V^T for X = U S V^T: the same singular vectors, the singular values spread
    around 1 (Muon's coefficient sets trade exactness for speed; cubic5's up to 1.3)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 48, generator=generator) @ torch.diag(torch.linspace(0.1, 3, 48))
    u, s, vh = torch.linalg.svd(x.double(), full_matrices=False)
    for kind, steps in (("quintic", 5), ("polar_express", 5), ("deepseekv4", 10), ("cubic5", 5)):
        for bf16 in (False, True):
            core = u.T @ newton_schulz(x, steps, kind, bf16).double() @ vh.T
            off_diagonal = core - torch.diag(torch.diagonal(core))
            assert off_diagonal.abs().max() < 0.03, (kind, bf16)
            assert torch.diagonal(core).min() > 0.6 and torch.diagonal(core).max() < 1.35
    # taller than wide: orthogonalized as its transpose
    assert torch.equal(
        newton_schulz(x.T, 5, "quintic", False), newton_schulz(x, 5, "quintic", False).T
    )


def test_the_first_step_is_muons_on_matrices_and_adams_on_the_rest():
    argv = LLAMA_STYLE + TRAINING + MUON + ["--weight-decay", "0.1", "--clip-grad", "0"]
    argv += ["--lr-warmup-iters", "0", "--lr-decay-style", "constant"]
    before, after = train_job(argv, 0)["params"], train_job(argv, 1)["params"]
    grads = first_step_gradients_job(argv)["grads"]
    lr, decay, groups, d = 1e-3, 0.1, 4, 32 // 8
    stepped = set()
    for name, weight in before.items():
        if weight.ndim != 2 or name.endswith(("word_embeddings.weight", "output_layer.weight")):
            continue
        grad = torch.from_numpy(grads[name])
        # the first momentum is (1 - momentum) x the gradient; NS does not see the factor
        parts = [grad]
        if name.endswith("linear_qkv.weight"):  # per query group: 2 query heads, a key, a value
            parts = grad.view(groups, 4 * d, -1).split([2 * d, d, d], dim=1)
            parts = [part.reshape(-1, grad.shape[1]) for part in parts]
        updates = [
            newton_schulz(0.2 * part, 5, "quintic", False) * scale_factor(*part.shape, "spectral")
            for part in parts
        ]
        if len(updates) == 3:
            update = torch.cat([u.view(groups, -1, grad.shape[1]) for u in updates], dim=1)
        else:
            update = updates[0]
        expected = weight * (1 - lr * decay) - lr * 0.2 * update.reshape(weight.shape).numpy()
        assert relative_error(after[name] - weight, expected - weight) < 1e-5, name
        stepped.add(name)
    assert len(stepped) == 2 * 4  # qkv, proj, fc1, fc2 of two layers
    # Adam's first step is about lr x sign(gradient), whatever the gradient's size
    for name in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight"):
        change = after[name] - before[name] * (1 - lr * decay * (before[name].ndim > 1))
        moved = np.abs(grads[name]) > 1e-4  # (Adam's epsilon matters below)
        assert np.allclose(change[moved], -lr * np.sign(grads[name][moved]), rtol=1e-3)


def _matrices(argv: list[str]) -> list[str]:
    trainer = _setup(argv)
    muon = trainer.data_parallel.optimizer.muon
    names = {p: n for n, p in trainer.layout_independent_parameters()}
    return sorted(names[p] for p in muon.matrices)


def test_muon_steps_every_matrix_of_a_mixture_of_experts_but_the_embeddings():
    names = _matrices(LLAMA_STYLE + TRAINING + MUON + MOE)
    layer = [n[len("decoder.layers.0.") :] for n in names if n.startswith("decoder.layers.0.")]
    experts = [
        f"mlp.experts.local_experts.{e}.linear_fc{i}.weight" for e in range(4) for i in (1, 2)
    ]
    assert layer == [
        *experts,
        "mlp.router.weight",  # 2-D: Megatron-LM's Muon takes it too
        "self_attention.linear_proj.weight",
        "self_attention.linear_qkv.weight",
    ]


MOE_MUON = LLAMA_STYLE + TRAINING + MUON + MOE + ["--moe-router-topk", "2"]


@pytest.fixture(scope="module")
def reference():
    return train_job(MOE_MUON, 4)


@pytest.mark.parametrize(
    "layout", ["tp2-sp", "dp2", "ep2-etp2", "pp2", "dp2-distributed-optimizer", "tp2-ep2-dp2-do"]
)
def test_muon_trains_as_one_process(reference, layout):
    world, extra = {
        "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        "dp2": (2, []),
        # experts over EP2 and each split over expert-TP: gathered over their own group
        "ep2-etp2": (
            4,
            ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"]
            + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ),
        "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
        # each matrix whole in one DP rank's shard, its TP peers owning theirs
        # several buckets (each laid out whole per shard), reduced and gathered overlapped
        "dp2-distributed-optimizer": (
            2,
            ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
            + ["--ddp-bucket-size", "20000"],
        ),
        "tp2-ep2-dp2-do": (
            4,
            ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
            + ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"],
        ),
    }[layout]
    results = run_distributed(world, train_job, MOE_MUON + extra, 4)
    assert_matches_reference(results, reference, 2e-5)


def test_blockwise_orthogonalizes_each_tensor_parallel_shard_alone(reference):
    """Megatron-LM's blockwise TP mode: each shard orthogonalized alone, a different step from
    one device's; what the duplicated default's equality above rests on."""
    argv = MOE_MUON + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    argv += ["--muon-tp-mode", "blockwise"]
    params = run_distributed(2, train_job, argv, 4)[0]["params"]
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    assert relative_error(params[name], reference["params"][name]) > 1e-3


def test_momentum_resumes_in_another_layout(tmp_path):
    argv = LLAMA_STYLE + TRAINING + MUON + ["--num-layers", "4"]
    tp2 = ["--tensor-model-parallel-size", "2"]
    saved = run_distributed(2, _save_then_continue, argv + tp2, str(tmp_path))
    # into PP2, and into DP2 with the distributed optimizer (each rank's whole matrices)
    for layout in (["--pipeline-model-parallel-size", "2"], ["--use-distributed-optimizer"]):
        _check(saved, run_distributed(2, _load_then_step, argv + layout, str(tmp_path)))


def test_a_resume_in_the_same_layout_is_bitwise_and_adam_takes_no_muon_state(tmp_path):
    from threefold.checkpoint.load import load_checkpoint
    from threefold.config import ConfigError

    argv = LLAMA_STYLE + TRAINING + MUON
    saved = _save_then_continue(argv, str(tmp_path))
    resumed = _load_then_step(argv, str(tmp_path))
    assert resumed["loss"] == saved["loss"]
    for name, value in saved["params"].items():
        assert np.array_equal(resumed["params"][name], value), name
    adam = _setup(LLAMA_STYLE + TRAINING)
    with pytest.raises(ConfigError, match="holds muon's optimizer state and this run has"):
        load_checkpoint(str(tmp_path), adam.checkpoint_components())


def test_megatrons_dist_muon_is_muon_with_the_distributed_optimizer(capsys):
    from threefold.arguments import parse_args

    argv = LLAMA_STYLE + TRAINING + MUON + ["--optimizer", "dist_muon"]
    config = parse_args(argv + ["--no-use-layer-wise-param-layout"], world_size=2)
    assert config.training.optimizer == "muon" and config.parallel.use_distributed_optimizer
    printed = capsys.readouterr()
    assert "dist_muon is --optimizer muon --use-distributed-optimizer" in printed.out + printed.err
    assert "keeps every parameter whole" in printed.out + printed.err


@pytest.mark.parametrize(
    "extra,named",
    [
        (["--fp8-format", "hybrid", "--fp8-param-gather"], "with --fp8-param-gather"),
        (["--optimizer", "sgd"], "--optimizer sgd is not built"),
        (["--muon-tp-mode", "distributed"], "duplicated gives the same updates"),
        (["--muon-fp32-matmul-prec", "low"], "--muon-fp32-matmul-prec low"),
        (["--muon-use-syrk"], "--muon-use-syrk"),
        (["--muon-scalar-optimizer", "lion"], "--muon-scalar-optimizer lion"),
        (["--muon-coefficient-type", "custom"], "--muon-coefficient-type custom"),
        (["--muon-coefficient-type", "cubic5", "--muon-num-ns-steps", "6"], "five steps"),
        (["--lion-beta1", "0.9"], "the Lion optimizer"),
    ],
)
def test_what_is_not_built_is_refused_in_one_line(capsys, extra, named):
    from threefold.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + TRAINING + MUON + extra, world_size=2)
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1
