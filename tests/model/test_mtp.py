"""Multi-token prediction (Megatron-LM's --mtp-num-layers): megatron-core's own MTP model gives
threefold's gradients, every layout trains as one process, and the log carries Megatron's
`mtp_k loss`."""

from __future__ import annotations

import os

import pytest
import torch

from tests import megatron_core_models as mc
from tests.distributed import run_distributed
from tests.parallel.test_expert_parallel import MOE
from tests.parity import (
    GPT2_STYLE,
    LLAMA_STYLE,
    TRAINING,
    _setup,
    assert_matches_reference,
    train_job,
)
from tests.tools.hf_models import convert_checkpoint
from threefold.checkpoint.load import load_model

MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]


def _gradients(
    path: str, scaling_factor: float | None = None, documents: bool = False
) -> tuple[float, dict]:
    """threefold's training-mode loss and gradients as megatron_core_models.gradients takes
    them, from a Megatron checkpoint."""
    config, model, _ = load_model(path, with_tokenizer=False)
    if scaling_factor is not None:
        model.mtp.weight = scaling_factor / config.model.mtp_num_layers
    model.train()
    tokens = mc.TOKENS
    extra = {}
    if documents:
        extra = {"position_ids": mc.DOCUMENT_POSITIONS, "attention_mask": mc.document_mask()}
    per_token = model(tokens[:, :-1], labels=tokens[:, 1:], loss_mask=mc.LOSS_MASK, **extra)
    loss = (per_token * mc.LOSS_MASK).sum() / mc.LOSS_MASK.sum()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """(Megatron checkpoint root, megatron-core's loss, its gradients): an MoE model (dense
    first layer, DeepSeek-V3 routing, a shared expert) with two MTP depths, MoE as its last
    layer is."""
    root = str(tmp_path_factory.mktemp("megatron_mtp"))
    run_distributed(1, mc.save, "moe_mtp", root, 10, 1, 1)
    path = os.path.join(root, "iter_0000010")
    loss, grads = run_distributed(1, mc.gradients, "moe_mtp", path)[0]
    return root, loss, grads


def test_gradients_are_megatron_cores(megatron):
    """Every parameter's gradient (the depths' own, and what their losses add to the main
    model's) within 1e-5 of megatron-core's; without the MTP loss they are not."""
    root, expected_loss, expected = megatron
    config, _, _ = load_model(root, with_tokenizer=False)
    assert (config.model.mtp_num_layers, config.model.mtp_loss_scaling_factor) == (2, 0.3)
    loss, grads = _gradients(root)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    assert grads.keys() == expected.keys()
    assert any(name.startswith("mtp.layers.1.transformer_layer.mlp.experts") for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=1e-5 * grad.abs().max())
    _, without = _gradients(root, scaling_factor=0.0)
    name = "decoder.layers.3.mlp.router.weight"
    assert (without[name] - expected[name]).abs().max() > 1e-3 * expected[name].abs().max()


def test_per_document_positions_and_attention_give_megatron_cores_gradients(tmp_path):
    """GPT-2 (learned positions, tied) with one depth over two documents (positions restart,
    attention stops at the boundary): megatron-core rolls the positions with the tokens for the
    depth's embedding; so does threefold. Without the documents the gradients differ."""
    root = str(tmp_path / "megatron")
    run_distributed(1, mc.save, "gpt2_mtp", root, 10, 1, 1)
    path = os.path.join(root, "iter_0000010")
    loss, expected = run_distributed(1, mc.gradients, "gpt2_mtp", path, True)[0]
    ours_loss, grads = _gradients(root, documents=True)
    assert ours_loss == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=1e-5 * grad.abs().max())
    _, plain = _gradients(root)
    name = "embedding.position_embeddings.weight"
    assert (plain[name] - expected[name]).abs().max() > 1e-3 * expected[name].abs().max()


def test_export_loads_into_megatron_core_with_the_same_gradients(megatron, tmp_path):
    root, expected_loss, expected = megatron
    out = str(tmp_path / "exported")
    converted = str(tmp_path / "converted")
    argv = ["--loader", "megatron", "--saver", "threefold", "--load-dir", root, "--save-dir"]
    assert convert_checkpoint.main(argv + [converted]) == 0
    argv = ["--loader", "threefold", "--saver", "megatron", "--load-dir", converted]
    assert convert_checkpoint.main(argv + ["--save-dir", out]) == 0
    loss, grads = run_distributed(1, mc.gradients, "moe_mtp", f"{out}/iter_0000000")[0]
    assert loss == expected_loss
    for name, grad in grads.items():
        assert torch.equal(grad, expected[name]), name


MOE_MTP = LLAMA_STYLE + TRAINING + MOE + MTP + ["--moe-router-topk", "2"]


@pytest.fixture(scope="module")
def reference():
    return train_job(MOE_MTP, 4)


# (cp2: each depth's shift takes a chunk's next token from the CP rank holding it, and its
# loss is the mean over the whole micro-batch's tokens)
@pytest.mark.parametrize(
    "layout",
    ["tp2-sp", "dp2", "ep2", "dp2-distributed-optimizer", "pp2", "cp2", "cp2-a2a-ep2", "cp4"],
)
def test_mtp_trains_as_one_process(reference, layout):
    world, extra = {
        "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        "dp2": (2, []),
        "ep2": (2, ["--expert-model-parallel-size", "2"]),
        "dp2-distributed-optimizer": (2, ["--use-distributed-optimizer"]),
        "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
        "cp2": (2, ["--context-parallel-size", "2"]),
        "cp2-a2a-ep2": (
            2,
            ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]
            + ["--expert-model-parallel-size", "2"],
        ),
        "cp4": (4, ["--context-parallel-size", "4"]),
    }[layout]
    results = run_distributed(world, train_job, MOE_MTP + extra, 4)
    assert_matches_reference(results, reference, 2e-6)


def test_the_last_stage_copy_of_tied_embeddings_and_positions_trains_as_one_process():
    """GPT-2 style (tied embeddings, learned positions) over interleaved PP2: the last stage
    embeds the shifted input with its copy of the first stage's embedding, word and position
    tables both kept equal to the first stage's by summing their gradients."""
    argv = GPT2_STYLE + TRAINING + MTP + ["--num-layers", "4"]
    reference = train_job(argv, 4)
    interleaved = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage"]
    results = run_distributed(2, train_job, argv + interleaved + ["1"], 4)
    assert_matches_reference(results, reference, 2e-6)


@pytest.mark.parametrize(
    "layout",
    [
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ["--context-parallel-size", "2"],
    ],
    ids=["tp2-sp", "cp2"],
)
def test_per_document_positions_and_attention_train_as_one_process(layout):
    """--reset-position-ids --reset-attention-mask with learned positions: every depth embeds
    the shifted documents' positions and attends within documents, at TP2+SP and CP2 (the
    documents' masks over the ranks' blocks, the loss masked by --eod-mask-loss unevenly
    over the ranks) as in one process."""
    argv = GPT2_STYLE + TRAINING + MTP + ["--tokenizer-type", "NullTokenizer"]
    argv += ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
    reference = train_job(argv, 4)
    assert_matches_reference(run_distributed(2, train_job, argv + layout, 4), reference, 2e-6)


def _logged(argv: list[str]) -> dict:
    trainer = _setup(argv)
    for _ in range(2):
        trainer.train_step()
    return trainer.mtp_losses.report(trainer.device)


def test_the_log_carries_each_depths_loss_averaged_over_replicas():
    from threefold.training.logging import IterationStats, format_iteration

    argv = LLAMA_STYLE + TRAINING + MTP
    reference = _logged(argv)
    assert list(reference) == ["mtp_1 loss", "mtp_2 loss"]
    assert all(4 < value < 7 for value in reference.values())  # about ln(vocabulary)
    for layout in ([], ["--context-parallel-size", "2"]):  # DP2; CP2: the whole sequence's
        for logged in run_distributed(2, _logged, argv + layout):
            for name, value in logged.items():
                assert value == pytest.approx(reference[name], rel=1e-5)
    stats = IterationStats(
        iteration=1, train_iters=2, consumed_samples=8, elapsed_ms=1.0, learning_rate=1e-3,
        global_batch_size=8, lm_loss=5.0, loss_scale=1.0, grad_norm=1.0, skipped_iterations=0,
        nan_iterations=0, tokens_per_second=1.0, tflops_per_device=1.0, mtp_losses=reference,
        moe_losses={"load_balancing_loss": 1.0},
    )  # fmt: skip
    line = format_iteration(stats)
    assert line.index("lm loss") < line.index("mtp_1 loss: ") < line.index("load_balancing_loss")


@pytest.mark.parametrize(
    "extra,named",
    [(["--mtp-hsm"], "multi-token prediction variants"), (["--mtp-detach-heads"], "variants")],
)
def test_what_is_not_built_is_refused_in_one_line(capsys, extra, named):
    from threefold.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + TRAINING + MTP + extra, world_size=2)
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1


def test_flops_count_each_depth_as_megatron_does():
    """Megatron-LM's num_floating_point_operations: each depth a layer of the last layer's
    kind, its norms (3h) and projection (2h^2) multiply-adds, and its own logits."""
    from threefold.arguments import parse_args
    from threefold.training.flops import training_flops_per_iteration

    with_mtp = parse_args(MOE_MTP).model
    without = parse_args(LLAMA_STYLE + TRAINING + MOE + ["--moe-router-topk", "2"]).model
    h, s, vocab, batch = 32, 16, 1024, 8
    layer = 2 * h * 4 * (8 + 2 * 4) + 2 * h * h + 2 * 2 * s * h  # QKV, projection, attention
    layer += 2 * 3 * h * 32 * 2 + 2 * h * 4  # two experts of 32 (SwiGLU), the router
    per_depth = layer + 2 * (3 * h + 2 * h * h) + 2 * h * vocab
    added = training_flops_per_iteration(with_mtp, batch, vocab) - training_flops_per_iteration(
        without, batch, vocab
    )
    assert added == pytest.approx(3.0 * 2 * per_depth * batch * s)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("layout", ["tp2-sp", "pp2"])
def test_fp8_depths_train_as_one_process(tmp_path, layout, recipe):
    """The depths' layers and projections run in FP8 (as megatron-core's, in its FP8 context),
    and TP2+SP or PP2 take each step as one device does, within tests/parallel/test_fp8.py's
    bounds (compared a step at a time, as there)."""
    from tests.parallel.test_fp8 import (
        RECIPES,
        assert_match_one_device,
        fp8_train_job,
        stepwise_parity,
    )

    argv = LLAMA_STYLE + TRAINING + RECIPES[recipe] + ["--mtp-num-layers", "1"]
    extra = {
        "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        "pp2": ["--pipeline-model-parallel-size", "2"],
    }[layout]
    results, reference = stepwise_parity(2, fp8_train_job, argv + extra, argv, tmp_path)
    state = reference["after"][-1]["fp8"]
    assert "mtp.layers.0.eh_proj.scale" in state
    assert "mtp.layers.0.transformer_layer.mlp.linear_fc2.scale" in state
    assert_match_one_device(results, reference, recipe)


def test_hugging_face_export_is_the_next_token_model_and_says_so(tmp_path, capsys):
    from tests.tools.hf_models import has_transformers
    from threefold.checkpoint.save import save_checkpoint

    if not has_transformers():
        pytest.skip("transformers is not installed")
    from transformers import AutoModelForCausalLM

    saved, hf = str(tmp_path / "saved"), str(tmp_path / "hf")
    trainer = _setup(LLAMA_STYLE + TRAINING + ["--mtp-num-layers", "1", "--save", saved])
    trainer.train_step()
    save_checkpoint(saved, trainer.checkpoint_components())
    argv = ["--loader", "threefold", "--saver", "hf", "--load-dir", saved, "--save-dir", hf]
    assert convert_checkpoint.main(argv) == 0
    assert "multi-token prediction depths (mtp.layers.*) stay behind" in capsys.readouterr().out
    _, model, _ = load_model(saved, with_tokenizer=False)
    theirs = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ours = model(mc.TOKENS).transpose(0, 1)[..., : theirs.config.vocab_size]
        torch.testing.assert_close(theirs(mc.TOKENS).logits, ours, rtol=0, atol=1e-4)


def test_a_run_without_depths_fine_tunes_from_a_checkpoint_with_them(tmp_path, capsys):
    """As Megatron-LM's --load does, a run without --mtp-num-layers takes the rest of a model
    with depths (threefold's checkpoint and its Megatron-LM export), said in one line, when it
    does not load the optimizer state (whose layout holds the depths'); resuming with it is
    refused, naming both ways on."""
    from threefold.checkpoint.load import load_checkpoint
    from threefold.checkpoint.save import save_checkpoint
    from threefold.config import ConfigError

    saved, exported = str(tmp_path / "saved"), str(tmp_path / "megatron")
    with_depths = _setup(LLAMA_STYLE + TRAINING + MOE + MTP)
    with_depths.train_step()
    save_checkpoint(saved, with_depths.checkpoint_components())
    argv = ["--loader", "threefold", "--saver", "megatron", "--load-dir", saved]
    assert convert_checkpoint.main(argv + ["--save-dir", exported]) == 0
    for source in (saved, exported):
        trainer = _setup(LLAMA_STYLE + TRAINING + MOE)
        capsys.readouterr()
        load_checkpoint(source, trainer.checkpoint_components(), finetune=True)
        assert "2 multi-token prediction depths are left out" in capsys.readouterr().out
        _, model, _ = load_model(source, with_tokenizer=False)
        expected = dict(model.named_parameters())
        for name, param in trainer.model.named_parameters():
            torch.testing.assert_close(param, expected[name], rtol=0, atol=0, msg=name)
    trainer = _setup(LLAMA_STYLE + TRAINING + MOE)
    with pytest.raises(ConfigError, match="pass --mtp-num-layers 2 .or --finetune"):
        load_checkpoint(saved, trainer.checkpoint_components())
