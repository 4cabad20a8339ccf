"""QK-clip (--qk-clip, Megatron-LM's MuonClip) and --log-max-attention-logit.

The factors scale each head's (query group's) largest score down to the threshold, exactly:
the same tokens through the rescaled weights score eta times what they did, for the query,
key, output-gate and bias rows of a fused QKV and for multi-latent attention's projections.
Every layout clips as one process does (the largest score is over the whole global batch:
without the maximum over data-parallel replicas each would clip by its own), and the factors
go into the fp32 masters, which the bf16 weights are written from."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.model.test_dsa import DSA
from tests.parity import (
    LLAMA_MHA_STYLE,
    LLAMA_STYLE,
    TRAINING,
    _setup,
    assert_matches_reference,
    train_job,
)
from threefold.arguments import parse_args
from threefold.model.attention import Attention

MLA = LLAMA_MHA_STYLE + ["--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank"]
MLA += ["16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12"]
MLA += ["--qk-layernorm"]  # (on the latents, before the projections it rescales)
# The tiny models' scores start near 0.07: this threshold clips every step.
CLIP = ["--qk-clip", "--qk-clip-threshold", "0.03"]


def _scores(trainer, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Each attention layer's largest score per head for `tokens`, in a training forward."""
    model = trainer.model_chunks[0]
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for layer in layers:
        layer.max_logits = None
    model.train()
    with torch.no_grad():
        model(input_ids=tokens)
    return [layer.max_logits.clone() for layer in layers]


@pytest.mark.parametrize(
    "style",
    [
        LLAMA_STYLE + ["--attention-output-gate", "--add-qkv-bias"],  # 8 heads in 4 groups
        MLA,
    ],
    ids=["gqa-gate-bias", "mla"],
)
def test_the_factors_bring_each_group_down_to_the_threshold(style):
    # (one layer: a second's input would change with the first's rescaling)
    argv = style + TRAINING + ["--num-layers", "1", "--qk-clip", "--qk-clip-alpha", "0.3"]
    trainer = _setup(argv)
    tokens = torch.randint(0, 1000, (2, 16))
    before = _scores(trainer, tokens)
    threshold = 0.6 * max(float(s.max()) for s in before)
    trainer.qk_clip.threshold = threshold
    factors = trainer.qk_clip.factors()
    assert factors and all(layer.max_logits is None for layer in trainer.qk_clip.layers)
    with torch.no_grad():
        for param, rows in factors.items():
            param.mul_(rows.view(-1, *(1,) * (param.dim() - 1)))
    after = _scores(trainer, tokens)
    per_group = 2 if "--group-query-attention" in style else 1
    if per_group == 2:  # a group's rows: 2 query heads, 2 gates, its key, its value
        (layer,) = trainer.qk_clip.layers
        eta = torch.clamp(threshold / before[0].view(4, 2).amax(dim=1), max=1.0)
        one = torch.ones_like(eta)
        expected = torch.stack([eta**0.3, eta**0.3, one, one, eta**0.7, one], dim=1)
        for param in (layer.linear_qkv.weight, layer.linear_qkv.bias):
            rows = factors[param].view(4, 6, -1)
            torch.testing.assert_close(rows, expected[..., None].expand_as(rows))
    for old, new in zip(before, after, strict=True):
        group_max = old.view(-1, per_group).amax(dim=1, keepdim=True)
        eta = torch.clamp(threshold / group_max, max=1.0)
        torch.testing.assert_close(new, (old.view(-1, per_group) * eta).view(-1), rtol=1e-5, atol=0)
        assert float(new.max()) == pytest.approx(min(threshold, float(old.max())), rel=1e-5)


LAYOUTS = {
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "dp2-distopt": (2, ["--use-distributed-optimizer"]),
    "fsdp2": (2, ["--use-torch-fsdp2"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_clip_as_one_process(layout):
    world_size, flags = LAYOUTS[layout]
    argv = LLAMA_STYLE + TRAINING + CLIP
    reference = train_job(argv, 3)
    unclipped = train_job(LLAMA_STYLE + TRAINING, 3)
    assert reference["losses"][1:] != unclipped["losses"][1:]  # (it clipped)
    results = run_distributed(world_size, train_job, argv + flags, 3)
    assert_matches_reference(results, reference, 1e-5)


CP_FEATURES = {
    "causal": ["--cp-comm-type", "p2p"],
    "window": ["--window-size", "3,0", "--cp-comm-type", "allgather"],
    "chunks": ["--no-rope-freq", "2", "--attention-chunk-size", "4"],
    "documents": ["--tokenizer-type", "NullTokenizer", "--vocab-size", "15"]
    + ["--reset-attention-mask", "--reset-position-ids", "--cp-comm-type", "a2a"],
}


@pytest.mark.parametrize("feature", CP_FEATURES)
def test_context_parallel_ranks_score_their_queries_against_every_key(feature):
    """CP2: each rank's queries (two chunks of the sequence) against every rank's keys,
    masked causally, by the window, the chunks or the documents, as one process masks the
    whole sequence."""
    argv = LLAMA_STYLE + TRAINING + CLIP + CP_FEATURES[feature]
    reference = train_job(argv, 3)
    results = run_distributed(2, train_job, argv + ["--context-parallel-size", "2"], 3)
    assert_matches_reference(results, reference, 1e-5)


def test_muon_clips_as_one_process():
    """MuonClip: Muon's steps, then the rescaling, at TP2 + SP x DP2 with the distributed
    optimizer (each matrix whole in one rank's shard)."""
    muon = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high"]  # (fp32 iterations)
    argv = LLAMA_STYLE + TRAINING + CLIP + muon
    reference = train_job(argv, 3)
    flags = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    results = run_distributed(4, train_job, argv + flags + ["--use-distributed-optimizer"], 3)
    assert_matches_reference(results, reference, 2e-5)


def test_bf16_weights_are_written_from_the_rescaled_masters():
    """At --lr 0 the step leaves the masters as they were, so the weights after it are the
    masters times the factors, rounded once to bf16 (the masters unscaled would write the
    weights back unclipped at the next step)."""
    trainer = _setup(LLAMA_STYLE + TRAINING + CLIP + ["--bf16", "--lr", "0", "--min-lr", "0"])
    qkv = trainer.qk_clip.layers[0].linear_qkv.weight
    (piece,) = trainer.optimizer.pieces_of()[qkv]
    master_before = piece.master.detach().clone()
    trainer.train_step()
    scaled = piece.master.detach()
    assert not torch.equal(scaled, master_before)
    rows = scaled.view(qkv.shape[0], -1)[:, 0] / master_before.view(qkv.shape[0], -1)[:, 0]
    torch.testing.assert_close(scaled, master_before * rows[:, None], rtol=1e-6, atol=0)
    assert torch.equal(qkv.detach(), scaled.to(torch.bfloat16))


def test_a_skipped_step_still_clips():
    """fp16's first steps overflow at the initial loss scale and are skipped; the weights
    that gave the scores are rescaled all the same, as Megatron-LM clips after every step."""
    trainer = _setup(LLAMA_STYLE + TRAINING + CLIP + ["--fp16"])
    qkv = trainer.qk_clip.layers[0].linear_qkv.weight
    (piece,) = trainer.optimizer.pieces_of()[qkv]
    master_before = piece.master.detach().clone()
    assert trainer.train_step()[2]  # (skipped)
    assert (piece.master.detach().abs() < master_before.abs()).any()
    assert torch.equal(qkv.detach(), piece.master.detach().to(torch.float16))


def test_the_largest_score_goes_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    argv = LLAMA_STYLE + TRAINING + ["--log-max-attention-logit", "--log-interval", "1"]
    trainer = _setup(argv + ["--tensorboard-dir", str(tmp_path), "--train-iters", "2"])
    trainer.train()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    values = [event.value for event in events.Scalars("max_attention_logit")]
    assert len(values) == 2 and all(0 < value < 1 for value in values)


@pytest.mark.parametrize(
    "flags,message",
    [
        (CLIP + ["--qk-clip-alpha", "1"], "--qk-clip-alpha 1.0 must be between 0 and 1"),
        (CLIP + ["--qk-clip-threshold", "0"], "--qk-clip-threshold 0.0 must be greater than 0"),
        (CLIP + ["--qk-layernorm"], "the norm of the queries and keys undoes the rescaling"),
        (CLIP + ["--lora-rank", "4"], "the query and key weights it rescales are frozen"),
        (
            CLIP + ["--fp8-format", "hybrid", "--fp8-param-gather", "--use-distributed-optimizer"],
            "--qk-clip with --fp8-param-gather is not built",
        ),
    ],
    ids=["alpha", "threshold", "qk-layernorm", "lora", "fp8-param-gather"],
)
def test_what_it_cannot_clip_is_refused_in_one_line(flags, message, capsys):
    _assert_refused(LLAMA_STYLE + TRAINING + flags, message, capsys)


def test_sparse_attention_is_refused_in_one_line(capsys):
    argv = DSA + TRAINING + ["--log-max-attention-logit"]
    message = "--log-max-attention-logit with --experimental-attention-variant dsa is not built"
    _assert_refused(argv, message, capsys)


def _assert_refused(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, world_size=2)
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert message in line
