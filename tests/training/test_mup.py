"""--use-mup (Megatron-LM's Maximal Update Parameterization, config/mup.py): each of its rules
is what megatron-core applies, a width multiplier of 1 with the standard attention scale is the
plain model bitwise, and the layouts train as one process."""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import (
    LLAMA_STYLE,
    TRAINING,
    _setup,
    assert_matches_reference,
    gradient_job,
    train_job,
)
from threefold.arguments import parse_args

# hidden 32 over a proxy of 8: m = 4
MUP = ["--use-mup", "--mup-base-hidden-size", "8"]
BASE = LLAMA_STYLE + TRAINING


def test_a_width_multiplier_of_one_with_the_standard_attention_scale_is_the_plain_model():
    plain = train_job(BASE, 3)
    neutral = train_job(BASE + ["--use-mup", "--mup-attn-scale-power", "0.5"], 3)
    assert neutral["losses"] == plain["losses"]
    assert all(
        torch.equal(torch.as_tensor(neutral["params"][n]), torch.as_tensor(v))
        for n, v in plain["params"].items()
    )


def test_initialization_is_scaled_by_the_width():
    """std 0.02: hidden matrices 0.02 / sqrt(m), the projections into the residual stream
    0.02 / sqrt(2 L m), embeddings and the untied output layer 0.02 (each within the sample's
    error: thousands of draws)."""
    flags = ["--hidden-size", "128", "--ffn-hidden-size", "256", "--init-method-std", "0.02"]
    trainer = _setup(BASE + ["--use-mup", "--mup-base-hidden-size", "32"] + flags)
    m, layers = 4.0, 2
    expected = {
        "self_attention.linear_qkv.weight": 0.02 / math.sqrt(m),
        "mlp.linear_fc1.weight": 0.02 / math.sqrt(m),
        "self_attention.linear_proj.weight": 0.02 / math.sqrt(2 * layers * m),
        "mlp.linear_fc2.weight": 0.02 / math.sqrt(2 * layers * m),
        "word_embeddings.weight": 0.02,
        "output_layer.weight": 0.02,
    }
    for name, param in trainer.model.named_parameters():
        for suffix, std in expected.items():
            if name.endswith(suffix):
                assert param.std().item() == pytest.approx(std, rel=0.05), name


def test_logits_embeddings_and_attention_are_multiplied():
    """At width 1: --mup-output-mult doubles the logits; at width 4 the logits are quartered
    by default; --mup-embedding-mult multiplies the embeddings; the queries carry the factor
    that makes the kernels' 1/sqrt(d) muP's 1/d (or sqrt(base head dim)/d)."""
    plain = gradient_job(BASE)["logits"]
    doubled = gradient_job(
        BASE + ["--use-mup", "--mup-attn-scale-power", "0.5"] + ["--mup-output-mult", "2"]
    )["logits"]
    torch.testing.assert_close(torch.as_tensor(doubled), 2 * torch.as_tensor(plain))
    model = parse_args(BASE + MUP).model
    assert model.mup_width_mult == 4.0 and model.mup_logits_mult == 0.25
    d = model.kv_channels  # 4
    assert model.mup_query_scale(d) == pytest.approx(1 / d * math.sqrt(d))
    model = parse_args(BASE + MUP + ["--mup-base-head-dim", "16"]).model
    assert model.mup_query_scale(d) == pytest.approx(4 / d * math.sqrt(d))
    trainer = _setup(BASE + ["--use-mup", "--mup-embedding-mult", "3"])
    tokens = torch.randint(0, 1000, (2, 16))
    embedding = trainer.model.embedding
    expected = 3 * embedding.word_embeddings.weight[tokens.t()]
    torch.testing.assert_close(embedding(tokens), expected)


def _groups(argv: list[str]) -> dict[str, tuple[float, float]]:
    """{parameter name: (its group's lr_mult, eps)} after the scheduler's first steps."""
    trainer = _setup(argv)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    optimizer = trainer.data_parallel.optimizer
    masters = {id(piece.master): names[id(piece.param)] for piece in optimizer.pieces}
    out = {}
    for group in optimizer.param_groups:
        for master in group["params"]:
            out[masters[id(master)]] = (group.get("lr_mult", 1.0), group.get("eps"))
    return out


@pytest.mark.parametrize(
    "flags",
    [[], ["--use-distributed-optimizer", "--bf16"], ["--decoupled-lr", "1e-3"]],
    ids=["replicated", "distributed-bf16", "decoupled-lr"],
)
def test_adam_steps_hidden_matrices_at_lr_and_eps_over_m(flags):
    groups = _groups(BASE + MUP + flags)
    for name, (lr_mult, eps) in groups.items():
        hidden = name.endswith(("linear_qkv.weight", "linear_proj.weight", "fc1.weight"))
        hidden |= name.endswith("fc2.weight")
        assert (lr_mult, eps) == ((0.25, 0.25e-8) if hidden else (1.0, 1e-8)), name
    assert sum(lr_mult != 1.0 for lr_mult, _ in groups.values()) == 8  # 4 matrices x 2 layers


def test_the_scheduler_gives_hidden_matrices_a_quarter_of_every_learning_rate():
    trainer = _setup(BASE + MUP)
    scheduler = trainer.scheduler
    for _ in range(5):  # warmup, then cosine decay
        scheduler.step()
        lrs = {group.get("lr_mult", 1.0): group["lr"] for group in scheduler.optimizer.param_groups}
        assert lrs[0.25] == pytest.approx(lrs[1.0] / 4, rel=1e-12) and lrs[1.0] > 0


def test_muon_keeps_its_matrices_at_its_own_scale():
    groups = _groups(BASE + MUP + ["--optimizer", "muon"])
    assert all(lr_mult == 1.0 for lr_mult, _ in groups.values())


LAYOUTS = {
    "tp2-sp-pp2": (
        4,
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
        + ["--pipeline-model-parallel-size", "2"],
    ),
    "dp2-distributed-optimizer": (2, ["--use-distributed-optimizer"]),
    "dp2-fsdp": (2, ["--distributed-strategy", "fsdp"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_train_as_one_process(layout):
    world, flags = LAYOUTS[layout]
    argv = BASE + MUP + ["--mup-embedding-mult", "2"]
    reference = train_job(argv, 4)
    assert_matches_reference(run_distributed(world, train_job, argv + flags, 4), reference, 1e-5)


def test_megatron_args_carry_mup_both_ways():
    from threefold.checkpoint.megatron.format import _model_config, megatron_args
    from threefold.config import Config

    config = parse_args(BASE + MUP + ["--mup-output-mult", "0.5"])
    args = megatron_args(Config(model=config.model), 10)
    assert args["use_mup"] and args["mup_base_hidden_size"] == 8
    back = _model_config(args, "test")
    assert back["use_mup"] and back["mup_base_hidden_size"] == 8 and back["mup_output_mult"] == 0.5


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--mup-base-hidden-size", "8"], "--mup-base-hidden-size: muP settings without --use-mup"),
        (["--use-mup", "--mup-base-hidden-size", "0"], "--mup-base-hidden-size must be positive"),
        (["--use-mup", "--init-method-xavier-uniform"], "muP sets the initialization itself"),
    ],
)
def test_refusals_are_one_line(capsys, flags, named):
    with pytest.raises(SystemExit):
        parse_args(BASE + flags)
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1


def test_hugging_face_export_of_a_scaled_model_is_refused():
    from threefold.checkpoint.hf import threefold_to_hf
    from threefold.config import ConfigError

    model = parse_args(BASE + MUP).model
    with pytest.raises(ConfigError, match="no muP multipliers"):
        threefold_to_hf({}, model, "LlamaForCausalLM")
