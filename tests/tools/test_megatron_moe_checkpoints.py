"""Megatron-LM torch_dist checkpoints of mixture-of-experts models in and out, against
megatron-core itself.

megatron-core's GPTModel with experts (its local spec's SequentialMLP, whose checkpoint keys its
grouped-GEMM experts share) saves two models (tests/megatron_core_models.py):
- "moe": a dense first layer, then MoE layers with DeepSeek-V3's routing (sigmoid scores, an
  expert bias, scaled weights) and a shared expert, saved at TP2 x EP2 (experts split over
  expert-TP 2). Its layers differ, so megatron-core keeps each layer's tensors apart
  (`decoder.layers.{i}.…`) and a layer's experts as one [experts, …] tensor.
- "moe_stacked": every layer MoE, softmax routing, saved at EP2: the layers are stacked as a
  dense model's are, experts on a second axis ([layers, experts, …]).
threefold reads both at other layouts and computes megatron-core's logits, and its export
loads back into megatron-core.
"""

from __future__ import annotations

import pytest
import torch

from tests import megatron_core_models as mc
from tests import megatron_core_training as mt
from tests.distributed import run_distributed
from tests.tools.hf_models import convert_checkpoint
from tests.tools.megatron_runs import (
    continue_argv,
    continue_training,
    export_and_go_on,
    exports,
    largest_difference,
    load_and_save,
    megatron_argv,
    per_token_losses,
    reference_losses,
    saved_by_megatron_core,
)
from threefold.checkpoint.files import checkpoint_dir
from threefold.checkpoint.load import load_model
from threefold.checkpoint.megatron.common_file import read_common
from threefold.safe_loading import SafeFileSystemReader

# kind -> (TP, PP, EP, ranks) megatron-core saves it at
SAVED = {"moe": (2, 1, 2, 4), "moe_stacked": (1, 1, 2, 2), "gpt_oss": (1, 1, 2, 2)}


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """kind -> (Megatron-LM checkpoint root, megatron-core's logits of TOKENS)."""
    return saved_by_megatron_core(tmp_path_factory, SAVED)


@pytest.mark.parametrize("kind", SAVED)
def test_one_process_computes_megatron_cores_logits(megatron, kind):
    root, reference = megatron[kind]
    config, model, _ = load_model(root, with_tokenizer=False)
    shape = mc.SHAPES[kind]
    model_config = config.model
    assert (model_config.num_experts, model_config.moe_ffn_hidden_size) == (4, 32)
    assert model_config.moe_layer_pattern(4) == ([0, 1, 1, 1] if kind == "moe" else [1] * 4)
    for name in ("moe_shared_expert_intermediate_size", "moe_router_score_function"):
        assert getattr(model_config, name) == shape[name]
    assert model_config.moe_router_enable_expert_bias == shape["moe_router_enable_expert_bias"]
    with torch.no_grad():
        logits = model(mc.TOKENS).transpose(0, 1)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
    if kind == "moe":  # the expert bias chooses the experts: without it, other logits
        with torch.no_grad():
            for layer in model.decoder.layers[1:]:
                layer.mlp.router.expert_bias.zero_()
            assert (model(mc.TOKENS).transpose(0, 1) - reference).abs().max() > 1e-3


def test_megatron_cores_gpt_oss_exports_as_transformers_gpt_oss(megatron, tmp_path):
    """megatron-core's GPT-OSS-shaped model (biased experts and router, quick-GELU GLU with a
    clamp, learned sinks, windows in every other layer, unrounded YaRN), exported to Hugging
    Face as threefold guesses it (GptOssForCausalLM): transformers computes megatron-core's
    logits."""
    from tests.tools.hf_models import has_transformers

    if not has_transformers():
        pytest.skip("transformers is not installed")
    import json

    from transformers import AutoModelForCausalLM

    root, reference = megatron["gpt_oss"]
    hf = str(tmp_path / "hf")
    argv = ["--loader", "megatron", "--saver", "hf", "--load-dir", root, "--save-dir", hf]
    assert convert_checkpoint.main(argv) == 0
    with open(f"{hf}/config.json") as f:
        assert json.load(f)["architectures"] == ["GptOssForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(mc.TOKENS).logits
    torch.testing.assert_close(theirs, reference[..., : theirs.shape[-1]], rtol=0, atol=1e-5)


def _load_without_router_bias(argv: list[str], root: str) -> str:
    """What a run whose router has no bias (threefold before it had megatron-core's) says
    when it --loads the checkpoint: its refusal, or what it printed loading."""
    import contextlib
    import io

    from tests.parity import _setup
    from threefold.checkpoint.load import load_checkpoint
    from threefold.config import ConfigError
    from threefold.model.moe import router

    build = router.TopKRouter.__init__

    def without_bias(self, *args, **kwargs):
        build(self, *args, **kwargs)
        self.bias = None

    router.TopKRouter.__init__ = without_bias  # (a pooled worker: put back below)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            load_checkpoint(root, _setup(argv).checkpoint_components(), finetune=True)
    except ConfigError as error:
        return f"refused: {error}"
    finally:
        router.TopKRouter.__init__ = build
    return printed.getvalue()


@pytest.mark.parametrize(
    "pp,strictness",
    [(1, None), (2, None), (1, "log_unexpected"), (2, "assume_ok_unexpected")],
    ids=["one-process", "pp2", "log_unexpected", "pp2-assume_ok_unexpected"],
)
def test_a_tensor_the_model_would_not_read_is_refused_not_dropped(megatron, pp, strictness):
    """A Megatron-LM checkpoint's tensor that no parameter of the model takes would leave the
    model computing something else (threefold before its router had megatron-core's bias gave
    other logits for "gpt_oss"): the load is refused in one line naming it. Under PP the
    stages pool what they read (each reads only its layers, the first the embedding, the last
    the final norm), and every stage refuses. --dist-ckpt-strictness log_unexpected loads
    without it and says so; assume_ok_unexpected (Megatron-LM's default) does not look."""
    root, _ = megatron["gpt_oss"]
    argv = megatron_argv(root, 1, pp)
    argv += ["--dist-ckpt-strictness", strictness] if strictness else []
    said = run_distributed(pp, _load_without_router_bias, argv, root)
    named = "holds decoder.layers.mlp.router.bias"
    if strictness is None:
        for line in said:
            assert line.startswith("refused: ") and named in line, line
            assert "decoder.final_layernorm" not in line and "embedding" not in line
    elif strictness == "log_unexpected":
        assert f"{named}, left behind" in said[0]
    else:
        assert all("router.bias" not in out for out in said)


def test_the_converter_refuses_what_it_would_leave_behind_unless_told(
    megatron, monkeypatch, tmp_path, capsys
):
    """tools/convert_checkpoint.py takes --dist-ckpt-strictness too: refused by default in one
    line naming the tensor, converted without it (and said) with log_unexpected."""
    from threefold.model.moe import router

    root, _ = megatron["gpt_oss"]
    build = router.TopKRouter.__init__

    def without_bias(self, *args, **kwargs):
        build(self, *args, **kwargs)
        self.bias = None

    monkeypatch.setattr(router.TopKRouter, "__init__", without_bias)
    argv = ["--loader", "megatron", "--saver", "threefold", "--load-dir", root]
    with pytest.raises(SystemExit) as stop:
        convert_checkpoint.main([*argv, "--save-dir", str(tmp_path / "refused")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "holds decoder.layers.mlp.router.bias, which" in err
    assert err.count("\n") == 1 and not (tmp_path / "refused").exists()
    saved = str(tmp_path / "told")
    strictness = ["--dist-ckpt-strictness", "log_unexpected"]
    assert convert_checkpoint.main([*argv, "--save-dir", saved, *strictness]) == 0
    assert "decoder.layers.mlp.router.bias, left behind" in capsys.readouterr().out


@pytest.mark.parametrize(
    "kind,tp,pp,ep,flags",
    [
        ("moe", 1, 1, 2, []),
        ("moe", 2, 1, 2, ["--sequence-parallel", "--seq-length", "14"]),
        ("moe", 1, 2, 1, []),
        ("moe_stacked", 1, 2, 2, []),
    ],
    ids=["ep2", "tp2-sp-ep2", "pp2", "stacked-pp2-ep2"],
)
def test_any_layout_computes_megatron_cores_losses(megatron, kind, tp, pp, ep, flags):
    root, reference = megatron[kind]
    ranks = tp * pp * ep  # EP within data parallelism: DP = EP here
    argv = megatron_argv(root, tp, pp) + ["--expert-model-parallel-size", str(ep), *flags]
    argv += ["--global-batch-size", str(2 * ep)]  # each rank's micro-batch of 2
    # Sequence parallelism splits the sequence over TP: 14 of the causal model's 15 tokens.
    length = 14 if "--sequence-parallel" in flags else mc.SEQ - 1
    results = run_distributed(ranks, per_token_losses, argv, root, length)
    expected = reference_losses(reference)[:length]
    for losses in (r for r in results if r is not None):
        torch.testing.assert_close(torch.tensor(losses), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", SAVED)
def test_export_loads_into_megatron_core(megatron, kind, tmp_path):
    """threefold -> Megatron: megatron-core's MoE GPTModel reads the export of a model trained
    on (its expert bias moved too) and computes threefold's logits; Megatron -> threefold ->
    Megatron gives megatron-core's own logits bitwise."""
    root, reference = megatron[kind]
    ours, written = exports(root, reference, tmp_path)
    assert (ours - reference).abs().max() > 1e-3  # training moved it
    for path, expected, tolerance in written:
        # Transformer Engine's spec (Megatron-LM's default) names an MoE layer's pre-MLP norm
        # as a module of its own; the local spec, as a dense layer's (fused into fc1).
        keys = SafeFileSystemReader(path).read_metadata().state_dict_metadata
        te_norm = {
            "moe": ["decoder.layers.1.pre_mlp_layernorm.weight"],
            "moe_stacked": ["decoder.layers.pre_mlp_layernorm.weight"],
            "gpt_oss": ["decoder.layers.pre_mlp_layernorm.weight"],
        }[kind]
        assert all(key in keys for key in te_norm)
        assert "decoder.layers.0.pre_mlp_layernorm.weight" not in keys  # dense: TE fuses it
        theirs = run_distributed(1, mc.logits, kind, path)
        torch.testing.assert_close(theirs[0], expected, rtol=0, atol=tolerance)


@pytest.fixture(scope="module")
def megatron_trained(tmp_path_factory):
    """layout -> (checkpoint root, megatron-core's weights one iteration later, its loss):
    megatron-core trained "moe" 2 iterations at DP2 with its distributed optimizer (at EP 1 one
    for all parameters), saved fully reshardable and in its default dp_reshardable layout; and
    at DP2 x EP2 in dp_reshardable (the experts' buffers, and optimizer, their own)."""
    runs = {}
    for name, layout, ep in (
        ("fully_reshardable", "fully_reshardable", 1),
        ("dp_reshardable", "dp_reshardable", 1),
        ("dp_reshardable_ep2", "dp_reshardable", 2),
    ):
        directory = tmp_path_factory.mktemp(f"megatron_moe_{name}")
        root, after = str(directory / "run"), str(directory / "after")
        losses = run_distributed(2, mt.train_and_save, "moe", root, after, 1, layout, 2, ep)
        runs[name] = (root, after, losses[0])
    return runs


@pytest.mark.parametrize(
    "layout,tp,pp,dp,flags",
    [
        ("fully_reshardable", 1, 1, 1, []),
        (
            "fully_reshardable",
            1,
            1,
            2,
            ["--use-distributed-optimizer", "--expert-model-parallel-size", "2"],
        ),
        ("fully_reshardable", 1, 2, 1, []),
        ("dp_reshardable", 1, 1, 1, []),
        (
            "dp_reshardable",
            1,
            1,
            2,
            ["--use-distributed-optimizer", "--expert-model-parallel-size", "2"],
        ),
        ("dp_reshardable", 1, 2, 1, []),
        ("dp_reshardable_ep2", 1, 1, 1, []),  # saved at EP2: its experts' buffers joined
    ],
    ids=[
        "one-process",
        "dp2-ep2-distributed-optimizer",
        "pp2",
        "dp-reshardable-one-process",
        "dp-reshardable-dp2-ep2",
        "dp-reshardable-pp2",
        "dp-reshardable-saved-at-ep2",
    ],
)
def test_training_goes_on_from_megatrons_optimizer_as_in_megatron(
    megatron_trained, layout, tp, pp, dp, flags
):
    """megatron-core's Adam state of the experts, the router and the rest, read into threefold
    at another layout: the next iteration's loss and weights are megatron-core's. (The harness
    steps megatron-core's optimizer without Megatron-LM's finalize_model_grads, which moves the
    expert bias; threefold's bias update is off to match.)"""
    root, after, megatron_loss = megatron_trained[layout]
    argv = continue_argv(root, tp, pp, dp) + flags + ["--moe-router-bias-update-rate", "0"]
    results = run_distributed(tp * pp * dp, continue_training, argv, root, after, True)
    for loss, difference in results:
        assert loss == pytest.approx(megatron_loss, rel=1e-6)
        assert difference < 1e-6
    if dp == 1 and pp == 1:  # the state is what makes it so: a fresh optimizer steps elsewhere
        _, difference = continue_training(argv + ["--no-load-optim"], root, after, False)
        assert difference > 1e-4


def test_an_export_with_adams_state_goes_on_in_megatron_core_as_megatron_core(
    megatron_trained, tmp_path
):
    """Megatron -> threefold -> Megatron with the optimizer's state of the experts, the router
    and the rest: megatron-core's distributed optimizer reads threefold's export at DP2 and
    takes the iteration it took from its own checkpoint."""
    root, after, megatron_loss = megatron_trained["fully_reshardable"]
    argv = continue_argv(root, 1, 1, 1) + ["--moe-router-bias-update-rate", "0"]
    argv += ["--use-distributed-optimizer"]  # (for which the export is shaped)
    _, loss, weights = export_and_go_on(argv, root, tmp_path, "moe", 1, 2)
    assert loss == pytest.approx(megatron_loss, rel=1e-6)
    assert largest_difference(weights, after) < 1e-6


@pytest.mark.parametrize(
    "native,distributed",
    [(False, True), (True, True), (False, False)],
    ids=["converted", "saved-by-an-ep2-run", "converted-for-the-non-distributed-optimizer"],
)
def test_an_export_goes_on_where_megatron_core_steps_the_experts_apart(
    megatron_trained, native, distributed, tmp_path
):
    """At EP 2 megatron-core chains an optimizer of the experts' own to the rest's, and its
    --load takes only the state shaped so (Megatron-LM refuses its own EP-2 checkpoint's at
    EP 1): an export for EP 2 (the converter's --target-expert-parallel-size, or a threefold
    run at EP 2 saving Megatron-LM's format) goes on there as megatron-core did at EP 1, with
    its distributed optimizer or its non-distributed one (whose experts' groups are exactly
    theirs: weight decay for all)."""
    root, after, megatron_loss = megatron_trained["fully_reshardable"]
    argv = continue_argv(root, 1, 1, 2 if native else 1) + ["--moe-router-bias-update-rate", "0"]
    argv += ["--use-distributed-optimizer"] if distributed else []
    if native:
        argv += ["--expert-model-parallel-size", "2"]
    ranks_here = 2 if native else 1
    path, loss, weights = export_and_go_on(
        argv, root, tmp_path, "moe", 1, 2, native, ranks_here, 2, distributed
    )
    assert sorted(read_common(path)["optimizer"]) == [0, 1]
    assert loss == pytest.approx(megatron_loss, rel=1e-6)
    assert largest_difference(weights, after) < 1e-6


@pytest.mark.parametrize(
    "layout,apart",
    [
        (["--target-tensor-parallel-size", "2", "--target-expert-tensor-parallel-size", "1"], 1),
        (["--target-tensor-parallel-size", "2"], 0),  # (the experts split as the rest)
    ],
    ids=["tp2-expert-tp1", "tp2"],
)
def test_an_export_steps_the_experts_apart_where_their_tp_is_not_tp(
    megatron_trained, tmp_path, capsys, layout, apart
):
    """Megatron-LM (d98e8a64; megatron-core 0.16 at EP > 1 only) reduces the experts'
    gradients over their own groups, and steps them with an optimizer of their own, wherever
    their TP is not TP, as its MoE recipes run them (--expert-tensor-parallel-size 1 beside TP
    > 1): the converter told that layout shapes the state for the chained optimizer, the
    experts' groups in its second entry."""
    root, _, _ = megatron_trained["fully_reshardable"]
    argv = continue_argv(root, 1, 1, 1) + ["--moe-router-bias-update-rate", "0"]
    threefold, export = str(tmp_path / "threefold"), str(tmp_path / "export")
    load_and_save(argv + ["--use-distributed-optimizer"], root, threefold, export, False)
    flags = ["--loader", "threefold", "--saver", "megatron", "--load-dir", threefold]
    assert convert_checkpoint.main([*flags, *layout, "--save-dir", export]) == 0
    said = "at TP 2, EP 1, expert TP " + ("1 (an optimizer of their own" if apart else "2 (one")
    assert said in capsys.readouterr().out
    optimizer = read_common(checkpoint_dir(export, 2))["optimizer"]
    if apart:
        experts = [g["is_expert_parallel"] for g in optimizer[1]["optimizer"]["param_groups"]]
        dense = [g["is_expert_parallel"] for g in optimizer[0]["optimizer"]["param_groups"]]
        assert all(experts) and not any(dense)
    else:
        assert "param_groups" in optimizer["optimizer"]


EP2 = ["--target-expert-parallel-size", "2"]
SAID = "it goes with --loader threefold --saver megatron"


@pytest.mark.parametrize(
    "loader,saver,flags,line",
    [
        ("hf", "megatron", EP2, SAID),
        ("threefold", "hf", EP2, SAID),
        ("threefold", "megatron", ["--target-expert-parallel-size", "0"], "at least 1, not 0"),
        ("hf", "megatron", ["--target-tensor-parallel-size", "2"], SAID),
        ("threefold", "megatron", ["--target-expert-tensor-parallel-size", "0"], "not 0"),
        ("hf", "megatron", ["--no-target-use-distributed-optimizer"], SAID),
        ("megatron", "threefold", ["--target-use-distributed-optimizer"], SAID),
    ],
)
def test_the_target_runs_flags_are_refused_where_they_shape_nothing(
    loader, saver, flags, line, tmp_path, capsys
):
    """The --target-*-parallel-size flags and --[no-]target-use-distributed-optimizer shape
    the optimizer state of a threefold checkpoint's export to Megatron-LM, and nothing else."""
    argv = ["--loader", loader, "--saver", saver, "--load-dir", str(tmp_path / "run")]
    argv += ["--save-dir", str(tmp_path / "out"), *flags]
    with pytest.raises(SystemExit) as refused:
        convert_checkpoint.main(argv)
    assert refused.value.code == 2 and line in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["mixtral", "qwen3-moe"])
def test_a_hugging_face_moe_goes_to_megatron_with_its_logits(kind, tmp_path):
    """Mixtral (every layer MoE: stacked) and Qwen3-MoE (a dense layer among MoE ones: per
    layer) from Hugging Face to Megatron-LM's layout and back into threefold: transformers'
    logits."""
    from tests.tools.hf_models import VOCAB, build_hf_model, has_transformers

    if not has_transformers():
        pytest.skip("transformers is not installed")
    hf, megatron = str(tmp_path / "hf"), str(tmp_path / "megatron")
    hf_model = build_hf_model(kind, hf)
    argv = ["--loader", "hf", "--saver", "megatron", "--load-dir", hf, "--save-dir", megatron]
    assert convert_checkpoint.main(argv) == 0
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    _, model, _ = load_model(megatron, with_tokenizer=False)
    with torch.no_grad():
        logits = model(tokens)[..., :VOCAB].transpose(0, 1)
        expected = hf_model(tokens).logits
    assert (logits - expected).abs().max() / expected.abs().max() < 1e-4
