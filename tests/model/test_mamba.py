"""Hybrid models with Mamba-2 layers (--hybrid-layer-pattern, --mamba-*): the chunked SSD scan
is the recurrence, a Mamba layer computes what megatron-core's does (written out here from its
definition), the pattern builds Megatron-LM's layers, the layouts train as one process, and
bad settings stop in one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import ROOT
from tests.distributed import run_distributed
from tests.parallel.test_expert_parallel import MOE
from tests.parity import LLAMA_STYLE, TRAINING, _setup, assert_matches_reference, train_job
from threefold.arguments import parse_args
from threefold.kernels.ssd import chunk_ssd, recurrent_ssd
from threefold.model.sequence_mixing import causal_conv1d
from threefold.parallel.context_parallel.masks import shared

MAMBA = ["--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups", "4"]
# Mamba, attention, MLP and mixture-of-experts layers in four pipeline segments (one chunk
# each under PP2's two virtual stages; one process runs them as one)
PATTERN = "M*|-M|E*|M-"
HYBRID = LLAMA_STYLE + TRAINING + ["--hybrid-layer-pattern", PATTERN, *MAMBA, *MOE]


def _scan_inputs(seq: int, dtype=torch.float64):
    torch.manual_seed(0)
    b, heads, groups, p, n = 2, 4, 2, 3, 5
    x = torch.randn(b, seq, heads, p, dtype=dtype)
    dt = F.softplus(torch.randn(b, seq, heads, dtype=dtype))
    A = -(torch.rand(heads, dtype=dtype) * 4 + 0.5)
    B, C = (torch.randn(b, seq, groups, n, dtype=dtype) for _ in range(2))
    D = torch.randn(heads, dtype=dtype)
    return [t.requires_grad_() for t in (x, dt, A, B, C, D)]


@pytest.mark.parametrize("seq,chunk", [(37, 4), (37, 16), (64, 64), (5, 128)])
def test_the_chunked_scan_is_the_recurrence_with_its_gradients(seq, chunk):
    inputs = _scan_inputs(seq)
    expected = recurrent_ssd(*inputs)
    actual = chunk_ssd(*inputs, chunk_size=chunk)
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(expected)
    want = torch.autograd.grad(expected, inputs, grad)
    got = torch.autograd.grad(actual, inputs, grad)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9)


def test_the_recurrence_is_mamba2s_state_space_model():
    """Two tokens by hand: S_1 = dt_1 B_1 x_1^T, S_2 = exp(dt_2 A) S_1 + dt_2 B_2 x_2^T,
    y_2 = S_2^T C_2 + D x_2, head 3 of group 1 (two heads a group)."""
    x, dt, A, B, C, D = (t.detach() for t in _scan_inputs(2))
    y = recurrent_ssd(x, dt, A, B, C, D)
    h, g = 3, 1
    state = dt[0, 0, h] * torch.outer(B[0, 0, g], x[0, 0, h])
    state = (dt[0, 1, h] * A[h]).exp() * state + dt[0, 1, h] * torch.outer(B[0, 1, g], x[0, 1, h])
    torch.testing.assert_close(y[0, 1, h], state.T @ C[0, 1, g] + D[h] * x[0, 1, h])


# packed documents: boundaries inside chunks and on their edges, one a token long
DOCUMENT_IDS = torch.tensor([[0] * 5 + [1] * 11 + [2] * 21, [0] * 20 + [1] * 1 + [2] * 16])


@pytest.mark.parametrize("chunk", [4, 16])
def test_packed_documents_are_scanned_and_convolved_each_alone(chunk):
    """With document ids, the chunked scan (and its gradients) and the convolution equal each
    document's own, run apart."""
    inputs = _scan_inputs(37)
    packed = chunk_ssd(*inputs, DOCUMENT_IDS, chunk_size=chunk)
    grad = torch.randn_like(packed)
    got = torch.autograd.grad(packed, inputs, grad)
    apart, want = torch.zeros_like(packed), [torch.zeros_like(t) for t in inputs]
    x = torch.randn(37, 2, 6, dtype=torch.float64, requires_grad=True)
    weight, bias = torch.randn(6, 1, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    convolved = causal_conv1d(x, weight, bias, DOCUMENT_IDS)
    # (its indices kept once a micro-batch beside the masks, which offloading asks after)
    assert not shared(torch.zeros(1)) and causal_conv1d(x, weight, bias, DOCUMENT_IDS).equal(
        convolved
    )
    for row, ids in enumerate(DOCUMENT_IDS):
        for document in ids.unique():
            span = slice(*(ids == document).nonzero()[[0, -1], 0].add(torch.tensor([0, 1])))
            pieces = [t[row : row + 1, span] if t.dim() > 1 else t for t in inputs]
            alone = recurrent_ssd(*pieces)
            apart[row : row + 1, span] = alone.detach()
            for total, piece in zip(
                want, torch.autograd.grad(alone, pieces, grad[row : row + 1, span])
            ):
                if total.dim() > 1:
                    total[row : row + 1, span] += piece
                else:
                    total += piece
            own = causal_conv1d(x[span, row : row + 1], weight, bias)
            torch.testing.assert_close(convolved[row, span], own[0])
    torch.testing.assert_close(packed, apart, rtol=1e-10, atol=1e-10)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9)


def _megatron_mamba_mixer(mixer, x: torch.Tensor) -> torch.Tensor:
    """megatron-core's MambaMixer forward (TP 1), step by step from its definition."""
    z, xs, B, C, dt = (x @ mixer.in_proj.weight.T).split(mixer.local_sections, dim=-1)
    xbc = torch.cat((xs, B, C), dim=-1)  # causal depthwise convolution, tap by tap
    weight, width = mixer.conv1d.weight[:, 0], mixer.conv1d.weight.shape[-1]
    padded = F.pad(xbc, (0, 0, 0, 0, width - 1, 0))
    conv = sum(padded[i : i + x.shape[0]] * weight[:, i] for i in range(width))
    xs, B, C = F.silu(conv + mixer.conv1d.bias).transpose(0, 1).split(mixer.local_sections[1:4], -1)
    b, s = xs.shape[:2]
    y = recurrent_ssd(
        xs.reshape(b, s, mixer.heads, -1),
        F.softplus(dt.transpose(0, 1) + mixer.dt_bias),
        -mixer.A_log.exp(),
        B.reshape(b, s, mixer.groups, -1),
        C.reshape(b, s, mixer.groups, -1),
        mixer.D,
    ).reshape(b, s, -1)
    gated = (y * F.silu(z.transpose(0, 1))).reshape(b, s, mixer.groups, -1)
    normed = gated * torch.rsqrt(gated.square().mean(-1, keepdim=True) + 1e-5)
    normed = normed.reshape(b, s, -1) * mixer.norm.weight
    return normed.transpose(0, 1) @ mixer.out_proj.weight.T


def test_the_pattern_builds_megatron_lms_layers_and_a_mamba_layer_computes_its_mixer():
    trainer = _setup(HYBRID)
    layers = trainer.model.decoder.layers
    kinds = [
        type(layer).__name__
        if type(layer).__name__ == "MambaLayer"
        else type(layer.self_attention or layer.mlp).__name__
        for layer in layers
    ]
    assert kinds == ["MambaLayer", "SelfAttention", "MLP", "MambaLayer"] + [
        "MoELayer",
        "SelfAttention",
        "MambaLayer",
        "MLP",
    ]
    names = {n for n, _ in trainer.model.named_parameters()}
    # megatron-core's names: a Mamba layer's norm and mixer, one norm in the other layers
    for name in ("norm.weight", "mixer.in_proj.weight", "mixer.conv1d.bias", "mixer.A_log"):
        assert f"decoder.layers.0.{name}" in names
    assert "decoder.layers.1.input_layernorm.weight" in names
    assert "decoder.layers.1.pre_mlp_layernorm.weight" not in names
    assert "decoder.layers.2.pre_mlp_layernorm.weight" in names
    assert "decoder.layers.2.input_layernorm.weight" not in names
    mixer = layers[0].mixer
    assert (mixer.heads, mixer.groups) == (8, 4)  # 2 x 32 hidden / 8, as megatron-core
    torch.manual_seed(1)
    with torch.no_grad():
        mixer.norm.weight.uniform_(0.5, 1.5)  # not the ones it starts at
        x = torch.randn(16, 2, 32)
        torch.testing.assert_close(mixer(x), _megatron_mamba_mixer(mixer, x))


def test_megatrons_step_sizes_and_decays_start_in_their_ranges():
    mixer = _setup(HYBRID).model.decoder.layers[0].mixer
    dt = F.softplus(mixer.dt_bias.detach())
    assert dt.min() >= 1e-4 and dt.max() <= 0.1 + 1e-6
    decay = mixer.A_log.detach().exp()
    assert decay.min() >= 1 and decay.max() <= 16
    assert torch.equal(mixer.D.detach(), torch.ones(8))


LAYOUTS = {
    # the pattern's four segments, two virtual stages a rank
    "tp2-sp-pp2": (
        4,
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
        + ["--pipeline-model-parallel-size", "2"],
    ),
    # the Mamba layers' all-to-all over CP beside the attention layers' ring
    "cp2-tp2-sp": (
        4,
        [
            "--context-parallel-size",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
    ),
    "ep2-distributed-optimizer": (
        2,
        ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"],
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_train_as_one_process(layout):
    world, flags = LAYOUTS[layout]
    reference = train_job(HYBRID, 4)
    assert_matches_reference(run_distributed(world, train_job, HYBRID + flags, 4), reference, 1e-5)


def test_the_pattern_sets_the_layer_count_and_the_pipeline_chunks(capsys):
    config = parse_args(HYBRID + ["--pipeline-model-parallel-size", "2"], world_size=2)
    assert config.model.num_layers == 8
    assert config.parallel.pipeline_model_parallel_layout == "Ett|tt|tt|ttL"
    assert config.parallel.virtual_pipeline_model_parallel_size == 2
    assert parse_args(HYBRID).parallel.pipeline_model_parallel_layout is None  # (one chunk)
    config = parse_args(HYBRID + ["--num-layers", "3"])
    assert config.model.num_layers == 8
    assert "--num-layers 3 is replaced by that" in capsys.readouterr().out


SMALL = ["--hybrid-layer-pattern", "M*-", *MAMBA]


@pytest.mark.parametrize(
    "argv,named",
    [
        (MAMBA, "--mamba-state-dim --mamba-head-dim --mamba-num-groups: hybrid settings"),
        (["--hybrid-layer-pattern", "M*D-"], "D marks DeepSeek sparse attention layers"),
        (
            SMALL + ["--experimental-attention-variant", "gdn", "--linear-attention-freq", "2"],
            "--hybrid-layer-pattern's G marks the gated delta net layers",
        ),
        (["--hybrid-layer-pattern", "M*x-"], "x is none of them"),
        (["--hybrid-layer-pattern", "M*||-"], "segments that each hold a layer"),
        (["--hybrid-layer-pattern", "M*E-"], "has mixture-of-experts layers (E): add --num"),
        (SMALL + MOE, "without mixture-of-experts layers"),
        (SMALL + ["--mamba-num-groups", "3"], "--mamba-num-groups 3 must divide the 8"),
        (SMALL + ["--mtp-num-layers", "1"], "write each depth's layers after / in"),
        (SMALL + ["--parallel-attention-mlp"], "side by side (a hybrid stack keeps them"),
        (
            SMALL + ["--mamba-num-groups", "2", "--tensor-model-parallel-size", "4"],
            "the 2 Mamba groups are not divisible by --tensor-model-parallel-size 4",
        ),
        (
            SMALL + ["--mamba-num-groups", "2", "--context-parallel-size", "4"],
            "the 2 Mamba groups are not divisible by TP x --context-parallel-size 4",
        ),
        (
            ["--hybrid-layer-pattern", "M*|M-", *MAMBA, "--pipeline-model-parallel-size", "2"]
            + ["--virtual-pipeline-model-parallel-size", "2"],
            "| cuts set the pipeline chunks",
        ),
    ],
)
def test_refusals_are_one_line(capsys, argv, named):
    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + TRAINING + argv, world_size=4)
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1, error


# documents inside samples (end-of-document id 15 of a 16-token vocabulary)
DOCUMENTS = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "15", "--eod-mask-loss"]
DOCUMENTS += ["--reset-attention-mask", "--position-embedding-type", "none"]


@pytest.mark.parametrize(
    "world,layout", [(1, []), (4, LAYOUTS["cp2-tp2-sp"][1])], ids=["one-process", "cp2-tp2-sp"]
)
def test_packed_documents_are_read_each_alone(world, layout):
    """--reset-attention-mask: a hybrid model's logits of a sequence of packed documents are
    each document's alone (its Mamba layers convolve and scan each alone, its attention layers
    attend within it); at CP2 x TP2+SP it trains as one process does, and not as without the
    mask."""
    argv = HYBRID + DOCUMENTS
    if world == 1:
        from threefold.parallel.context_parallel.sequence import document_mask

        model = _setup(argv).model.eval()
        tokens = torch.randint(0, 15, (1, 16), generator=torch.Generator().manual_seed(0))
        ids = torch.tensor([[0] * 6 + [1] * 10])
        with torch.no_grad():
            packed = model(tokens, attention_mask=document_mask(ids))
            first, second = model(tokens[:, :6]), model(tokens[:, 6:])
        torch.testing.assert_close(packed, torch.cat([first, second]), rtol=1e-5, atol=1e-5)
        return
    reference = train_job(argv, 4)
    assert_matches_reference(run_distributed(world, train_job, argv + layout, 4), reference, 1e-5)
    unmasked = train_job([a for a in argv if a != "--reset-attention-mask"], 4)
    assert unmasked["losses"] != reference["losses"]


# gated delta net layers (G): 4 query/key heads of 8, 8 value heads of 6
WITH_GDN = LLAMA_STYLE + TRAINING + ["--hybrid-layer-pattern", "MG*-G-", *MAMBA]
WITH_GDN += ["--linear-num-key-heads", "4", "--linear-num-value-heads", "8"]
WITH_GDN += ["--linear-key-head-dim", "8", "--linear-value-head-dim", "6"]


def test_gated_delta_net_layers_of_a_pattern_train_as_one_process():
    """G: megatron-core's hybrid gated delta net layer (a norm and GatedDeltaNet as its
    self-attention, no MLP); counted as the built model holds it, and CP2 x TP2+SP (its heads'
    all-to-all beside the Mamba layers' and the attention's ring) trains as one process."""
    from threefold.training.memory_estimate import parameter_count

    trainer = _setup(WITH_GDN)
    layer = trainer.model.decoder.layers[1]
    assert type(layer.self_attention).__name__ == "GatedDeltaNet" and layer.mlp is None
    model = trainer.config.model
    counted = sum(p.numel() for p in trainer.model.parameters())
    assert parameter_count(model, model.padded_vocab_size(1)) == counted
    reference = train_job(WITH_GDN, 4)
    layout = LAYOUTS["cp2-tp2-sp"][1]
    assert_matches_reference(run_distributed(4, train_job, WITH_GDN + layout, 4), reference, 1e-5)


def test_a_checkpoint_reshards_from_tp2_pp2_to_one_process_and_cp2(tmp_path):
    """Saved at TP2 x PP2 (two virtual stages a rank, in_proj's sections split by heads and
    groups), resumed by one process, at CP2 and at PP2 with the pattern cut elsewhere (the
    same layers: `|` places stages): the next step is the saving run's."""
    from tests.training.test_resharding import _check, _load_then_step, _save_then_continue

    directory = str(tmp_path)
    saving = LAYOUTS["tp2-sp-pp2"][1]
    saved = run_distributed(4, _save_then_continue, HYBRID + saving, directory)
    _check(saved, [_load_then_step(HYBRID, directory)])
    cp2 = ["--context-parallel-size", "2"]
    _check(saved, run_distributed(2, _load_then_step, HYBRID + cp2, directory))
    recut = [a if a != PATTERN else "M*-M|E*M-" for a in HYBRID]
    pp2 = ["--pipeline-model-parallel-size", "2"]
    _check(saved, run_distributed(2, _load_then_step, recut + pp2, directory))


def test_parameters_and_flops_are_counted_per_layer_kind():
    """The counts the memory estimate and MFU read: a Mamba layer's parameters as the module
    holds them, and an attention (or gated delta net) layer and an MLP layer as one GPT layer
    (two norms, each part's FLOPs)."""
    from threefold.training.flops import training_flops_per_iteration
    from threefold.training.memory_estimate import parameter_count

    trainer = _setup(HYBRID)
    model = trainer.config.model
    counted = sum(p.numel() for p in trainer.model.parameters())
    assert parameter_count(model, model.padded_vocab_size(1)) == counted
    gpt = parse_args(LLAMA_STYLE + TRAINING + ["--num-layers", "1"]).model
    split = parse_args(LLAMA_STYLE + TRAINING + ["--hybrid-layer-pattern", "*-"]).model
    assert parameter_count(split, 1008) == parameter_count(gpt, 1008)
    assert training_flops_per_iteration(split, 8, 1008) == training_flops_per_iteration(
        gpt, 8, 1008
    )
    gdn = WITH_GDN[WITH_GDN.index("--linear-num-key-heads") :]
    split = parse_args(LLAMA_STYLE + TRAINING + ["--hybrid-layer-pattern", "G-", *gdn]).model
    gpt = parse_args(
        LLAMA_STYLE
        + TRAINING
        + ["--num-layers", "1", *gdn]
        + ["--linear-attention-freq", "[1]", "--experimental-attention-variant", "gdn"]
    ).model
    assert parameter_count(split, 1008) == parameter_count(gpt, 1008)
    assert training_flops_per_iteration(split, 8, 1008) == training_flops_per_iteration(
        gpt, 8, 1008
    )
    mamba = parse_args(LLAMA_STYLE + TRAINING + ["--hybrid-layer-pattern", "M", *MAMBA]).model
    h, inner, n = 32, 64, 8  # in_proj to z, x (2 x 32 each), B, C (4 groups of 8), dt (8)
    layer = 2 * h * (2 * inner + 2 * 4 * n + 8) + 7 * inner * n + 2 * inner * h
    logits = 2 * h * 1008
    assert training_flops_per_iteration(mamba, 8, 1008) == 3 * (layer + logits) * 8 * 16


def test_megatrons_hybrid_entry_points_train_and_need_a_pattern(tmp_path):
    """pretrain_hybrid.py (and its older name pretrain_mamba.py) run pretrain_gpt.py's trainer,
    for a hybrid model only."""
    flags = LLAMA_STYLE + TRAINING + ["--hybrid-layer-pattern", "M*-", *MAMBA]
    flags += ["--train-iters", "2", "--log-interval", "1"]
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_hybrid.py"), *flags],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"> done: 2 iterations", result.stdout), result.stdout[-2000:]
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_mamba.py"), *LLAMA_STYLE, *TRAINING],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("pretrain_mamba.py: error: pretrain_mamba.py builds a hybrid")
    assert result.stderr.count("\n") == 1
