"""DeepSeek sparse attention (Megatron-LM's --experimental-attention-variant dsa): megatron-core's
own DSA model, saved and read back, gives threefold's logits and every gradient (its indexer's
KL loss included); every layout trains as one process, its indexer's gradient whole on every TP
rank; the log carries Megatron's `indexer loss`; what megatron-core's DSA lacks is refused."""

from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch

from tests import megatron_core_models as mc
from tests.distributed import run_distributed
from tests.megatron_core_layers import hadamard_by_matrix
from tests.model.test_mla import MLA
from tests.parity import (
    LLAMA_MHA_STYLE,
    TRAINING,
    _full,
    _setup,
    assert_close_dicts,
    assert_losses_close,
    gradient_job,
    merge_pipeline_stages,
    train_job,
)
from tests.tools.hf_models import convert_checkpoint
from tests.tools.megatron_runs import gradients_from
from threefold.arguments import parse_args
from threefold.checkpoint.load import load_model
from threefold.model import dsa
from threefold.model.rope import rotary_embedding
from threefold.parallel.parallel_context import ParallelContext
from threefold.safe_loading import SafeFileSystemReader

DSA = MLA + ["--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "4"]
DSA += ["--dsa-indexer-head-dim", "16", "--dsa-indexer-topk", "6"]
DSA += ["--dsa-indexer-loss-coeff", "0.1"]
INDEXER = "self_attention.core_attention.indexer."
# one micro-batch of 2 sequences per step (TRAINING's global batch of 8 over 4)
TRAINING_ONE_BATCH = TRAINING + ["--global-batch-size", "2"]


def test_the_hadamard_transform_is_sylvesters_matrix():
    """fast_hadamard_transform's rotation: x H / sqrt(d), in fp32 whatever the input."""
    x = torch.randn(3, 5, 64)
    torch.testing.assert_close(dsa.hadamard_transform(x), hadamard_by_matrix(x))
    half = x.to(torch.bfloat16)
    assert torch.equal(dsa.hadamard_transform(half), hadamard_by_matrix(half.float()).bfloat16())


_SAVED: dict[str, tuple] = {}


def _saved_by_megatron_core(kind: str, tmp_path_factory) -> tuple:
    """(kind, Megatron checkpoint root, megatron-core's logits, loss and gradients), once."""
    if kind not in _SAVED:
        root = str(tmp_path_factory.mktemp(f"megatron_{kind}"))
        run_distributed(1, mc.save, kind, root, 10, 1, 1)
        path = os.path.join(root, "iter_0000010")
        logits = run_distributed(1, mc.logits, kind, path)[0]
        loss, grads = run_distributed(1, mc.gradients, kind, path)[0]
        _SAVED[kind] = (kind, root, logits, loss, grads)
    return _SAVED[kind]


@pytest.fixture(scope="module", params=["dsa", "dsa_sparse_interleaved"])
def megatron(request, tmp_path_factory):
    return _saved_by_megatron_core(request.param, tmp_path_factory)


def test_megatron_cores_dsa_gives_threefolds_logits_and_gradients(megatron):
    """Each query over its 6 highest-scored keys of up to 15: megatron-core's logits within
    1e-5, its loss, and every gradient within 1e-5 of its largest: the indexer's, which only its
    KL loss (over all earlier keys, or the top 6 with --dsa-indexer-use-sparse-loss) reaches,
    and the rest; the indexer's RoPE as halves or MLA's way. (megatron-core 0.16 turned other
    dimensions: tests/megatron_core_layers.py runs Megatron-LM's since.) All keys (top 16) give
    other logits; no indexer loss, other gradients."""
    kind, root, expected_logits, expected_loss, expected = megatron
    config, _, _ = load_model(root, with_tokenizer=False)
    assert (config.model.experimental_attention_variant, config.model.dsa_indexer_topk) == (
        "dsa",
        6,
    )
    assert config.model.dsa_indexer_use_sparse_loss == (kind != "dsa")
    assert config.model.dsa_indexer_rope_interleaved == (kind != "dsa")
    loss, grads, logits = gradients_from(root)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-5)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    assert grads.keys() == expected.keys()
    assert sum(INDEXER in name for name in grads) == 4 * 5
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=1e-5 * grad.abs().max())
    if kind != "dsa":
        return
    _, _, dense = gradients_from(root, dsa_indexer_topk=16)
    assert (dense - expected_logits).abs().max() > 1e-3
    _, without, _ = gradients_from(root, dsa_indexer_loss_coeff=0.0)
    assert not any(INDEXER in name for name in without)


def test_export_names_transformer_engines_indexer_and_reads_back(tmp_path_factory, tmp_path):
    """Megatron -> threefold -> Megatron: the indexer under Transformer Engine's DSA spec names
    (megatron-core's `backend.linear()` layers, with their extra state, and its LayerNorm), read
    back to the same loss and gradients bitwise."""
    _, root, _, expected_loss, _ = _saved_by_megatron_core("dsa", tmp_path_factory)
    converted, out = str(tmp_path / "converted"), str(tmp_path / "exported")
    argv = ["--loader", "megatron", "--saver", "threefold", "--load-dir", root, "--save-dir"]
    assert convert_checkpoint.main(argv + [converted]) == 0
    argv = ["--loader", "threefold", "--saver", "megatron", "--load-dir", converted]
    assert convert_checkpoint.main(argv + ["--save-dir", out]) == 0
    keys = set(SafeFileSystemReader(f"{out}/iter_0000000").read_metadata().state_dict_metadata)
    for name in ("linear_wq_b", "linear_wk", "linear_weights_proj"):
        assert f"decoder.layers.{INDEXER}{name}.weight" in keys
        assert f"decoder.layers.{INDEXER}{name}._extra_state/shard_0_4" in keys
    assert {f"decoder.layers.{INDEXER}k_norm.{p}" for p in ("weight", "bias")} <= keys
    loss, grads, _ = gradients_from(root)
    again_loss, again, _ = gradients_from(out)
    assert again_loss == loss == pytest.approx(expected_loss, rel=1e-6)
    for name, grad in grads.items():
        assert torch.equal(again[name], grad), name


LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
}


@pytest.fixture(scope="module")
def reference():
    return train_job(DSA + TRAINING, 5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dsa_trains_as_one_process(reference, layout):
    world, extra = LAYOUTS[layout]
    results = run_distributed(world, train_job, DSA + TRAINING + extra, 5)
    for result in results:
        assert_losses_close(result["losses"], reference["losses"], 2e-6)
    # Adam's first steps move the indexer, whose only gradient is its small KL loss's, by the
    # sign of elements that are rounding noise: its weights agree to 1.4e-5, the rest of the
    # model's to 5e-7 (measured at each layout; its gradients in the test below).
    params = merge_pipeline_stages([result["params"] for result in results])
    _assert_close_apart(params, reference["params"], 1e-4, 2e-6, "parameter")


def _assert_close_apart(actual: dict, expected: dict, indexer: float, rest: float, what: str):
    """The indexer's tensors within `indexer`, the rest of the model's within `rest`."""
    for tolerance, is_indexer in ((indexer, True), (rest, False)):
        ours, theirs = (
            {name: t for name, t in tensors.items() if (INDEXER in name) == is_indexer}
            for tensors in (actual, expected)
        )
        assert_close_dicts(ours, theirs, tolerance, what)


def test_the_indexers_gradient_is_whole_on_every_tp_rank():
    """Every TP rank runs the whole indexer on the whole sequence and sums the attention's
    heads over TP for its loss: its gradient is one process's, not a share to be summed (which
    Adam's normalized steps would hide from a training comparison). The KL gradient is a
    difference of near-equal probabilities: the indexer's gradients agree to 2e-5, the rest
    to 5e-7 (measured); a share would be off by 1."""
    expected = gradient_job(DSA + TRAINING)
    world, extra = LAYOUTS["tp2_sp"]
    for result in run_distributed(world, gradient_job, DSA + TRAINING + extra):
        indexer = {name: g for name, g in result["grads"].items() if INDEXER in name}
        assert len(indexer) == 2 * 5 and all(abs(g).max() > 0 for g in indexer.values())
        _assert_close_apart(result["grads"], expected["grads"], 1e-4, 2e-6, "gradient")


def test_per_token_loss_sums_the_indexer_loss_over_the_queries():
    """--calculate-per-token-loss: the indexer's KL is summed over the queries, as the main
    loss over the tokens (Megatron-LM's since megatron-core 0.16), and the step's gradients
    are divided by its tokens. Every token counts here (one micro-batch of 2 x 16), so the
    gradients are those of the default means; a mean under the flag would leave the indexer's
    32 times smaller."""
    expected = _step_gradients(DSA + TRAINING_ONE_BATCH)
    per_token = _step_gradients(DSA + TRAINING_ONE_BATCH + ["--calculate-per-token-loss"])
    _assert_close_apart(per_token, expected, 1e-5, 1e-6, "gradient")


def _step_gradients(argv: list[str]) -> dict:
    """A training step's gradients as the optimizer takes them: through the trainer's own
    forward and backward, divided by the step's tokens under --calculate-per-token-loss."""
    trainer = _setup(argv)
    losses = trainer._forward_backward(trainer.num_microbatches, 1)
    trainer.data_parallel.finish_grad_sync()
    _, tokens = trainer._global_loss_totals(losses)
    divisor = tokens if trainer.config.training.calculate_per_token_loss else 1.0
    return {name: g / divisor for name, g in _full(trainer, "main_grad").items()}


@pytest.mark.parametrize(
    "recompute",
    [
        [],
        [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
    ],
    ids=["", "full-recompute"],
)
def test_the_log_carries_megatrons_indexer_loss(monkeypatch, recompute):
    """`indexer loss`: the layers' losses (with their coefficient) averaged over the
    micro-batches and the layers, as Megatron-LM logs it, once though backward computes them
    again; the kernels line names the mask."""
    computed = []
    divergence = dsa.indexer_loss

    def recorded(*args):
        computed.append(divergence(*args).mean().item())
        return divergence(*args)

    monkeypatch.setattr(dsa, "indexer_loss", recorded)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer = _setup(DSA + TRAINING + recompute)
    assert "dsa: the attention above under a mask of each query's top-k keys" in printed.getvalue()
    trainer.train_step()
    forwards = 2 if recompute else 1
    assert len(computed) == 2 * 4 * forwards  # two layers, four micro-batches
    expected = 0.1 * sum(computed) / forwards / 4 / 2
    assert trainer.indexer_losses.report(trainer.device)["indexer loss"] == pytest.approx(expected)


MLA_FLAGS = MLA[len(LLAMA_MHA_STYLE) :]
DSA_FLAGS = DSA[len(MLA) :]


@pytest.mark.parametrize(
    "argv,named",
    [
        (MLA_FLAGS + ["--dsa-indexer-topk", "8"], "--dsa-indexer-topk: DeepSeek sparse attention"),
        (["--experimental-attention-variant", "dsa"], "dsa is sparse multi-latent attention"),
        (MLA_FLAGS + DSA_FLAGS[:2], "needs --dsa-indexer-n-heads --dsa-indexer-head-dim"),
        (MLA_FLAGS + DSA_FLAGS + ["--dsa-indexer-head-dim", "12"], "a power of 2"),
        (MLA_FLAGS + DSA_FLAGS + ["--window-size", "4,0"], "--window-size with"),
        (MLA_FLAGS + DSA_FLAGS + ["--dsa-indexer-topk-freq", "2"], "other options"),
    ],
    ids=["without-dsa", "without-mla", "no-sizes", "head-dim", "window", "later"],
)
def test_what_megatron_cores_dsa_lacks_is_one_line(capsys, argv, named):
    with pytest.raises(SystemExit):
        parse_args(LLAMA_MHA_STYLE + argv + TRAINING)
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1


def test_the_memory_estimate_counts_the_indexer():
    from threefold.training.memory_estimate import parameter_count

    trainer = _setup(DSA + TRAINING)
    model = trainer.config.model
    counted = sum(p.numel() for p in trainer.model.parameters())
    indexer = sum(p.numel() for n, p in trainer.model.named_parameters() if INDEXER in n)
    assert indexer == 2 * (24 * 4 * 16 + 32 * 16 + 2 * 16 + 32 * 4)
    assert parameter_count(model, model.padded_vocab_size(1)) == counted


def test_the_indexer_picks_the_keys_transformers_deepseek_v32_picks():
    """The same weights in transformers' DeepseekV32Indexer (DeepSeek-V3.2's model: RoPE on
    the first dimensions as halves, its key norm's epsilon 1e-6; no Hadamard rotation, which
    changes no dot product): each query picks the same earlier keys."""
    from tests.tools.hf_models import has_transformers

    if not has_transformers():
        pytest.skip("transformers is not installed")
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf

    torch.manual_seed(0)
    s, b = 24, 2
    flags = ["--rope-type", "rope", "--dsa-indexer-k-norm-epsilon", "1e-6"]
    config = parse_args(DSA + TRAINING + flags + ["--seq-length", str(s)]).model
    ours = dsa.DSAIndexer(config, ParallelContext(), None)
    weights = {
        "wq_b.weight": ours.linear_wq_b.weight,
        "wk.weight": ours.linear_wk.weight,
        "k_norm.weight": ours.k_norm.weight,
        "k_norm.bias": ours.k_norm.bias,
        "weights_proj.weight": ours.linear_weights_proj.weight,
    }
    with torch.no_grad():
        for name, param in weights.items():
            param.copy_(torch.randn_like(param) * (0.1 if "norm" in name else 0.3))
        ours.k_norm.weight.add_(1.0)
    shape = dict(hidden_size=32, q_lora_rank=24, qk_rope_head_dim=8, index_topk=6)
    theirs = hf.DeepseekV32Indexer(
        hf.DeepseekV32Config(**shape, index_n_heads=4, index_head_dim=16), layer_idx=0
    )
    theirs.load_state_dict(weights)
    x, latent = torch.randn(s, b, 32), torch.randn(s, b, 24)
    cos, sin = rotary_embedding(config)(s, x.device)
    _, picked = ours(x, latent, (cos, sin))
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None]
    tables = tuple(t.reshape(s, -1)[None].expand(b, -1, -1) for t in (cos, sin))
    expected = theirs(x.transpose(0, 1), latent.transpose(0, 1), tables, causal, None)
    for batch in range(b):
        for row in range(s):  # (past its row a query's picks are keys it may not attend)
            mine = {int(i) for i in picked[batch, row] if i <= row}
            hers = {int(i) for i in expected[batch, row] if i <= row}
            assert len(mine) == min(6, row + 1) and mine == hers, (batch, row)


def test_packed_documents_are_each_its_own_sequence():
    """Two documents packed in one sequence (positions restarting, attention within each, as
    --reset-attention-mask makes them): each gets the logits it gets alone, its indexer
    picking among its own keys, and each query's indexer KL is the one it has in its document
    alone. Without the documents' mask the second document's logits differ."""
    from threefold.parallel.context_parallel.sequence import document_mask

    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()):
        model = _setup(DSA + TRAINING + ["--seq-length", "24"]).model
    with torch.no_grad():  # an indexer far from the attention's distribution: a KL of order 1
        for name, param in model.named_parameters():
            if INDEXER + "linear" in name:
                param.mul_(30)
    first, second = torch.randint(0, 1000, (1, 10)), torch.randint(0, 1000, (1, 14))
    losses = []
    monkey = pytest.MonkeyPatch()
    divergence = dsa.indexer_loss
    monkey.setattr(dsa, "indexer_loss", lambda *a: losses.append(divergence(*a)) or losses[-1])
    # (each call's KL per query [1, s])
    try:
        alone = [model(tokens) for tokens in (first, second)]
        ids = torch.tensor([[0] * 10 + [1] * 14])
        positions = torch.cat([torch.arange(10), torch.arange(14)])[None]
        packed = model(
            torch.cat([first, second], 1), position_ids=positions, attention_mask=document_mask(ids)
        )
        unmasked = model(torch.cat([first, second], 1), position_ids=positions)
    finally:
        monkey.undo()
    torch.testing.assert_close(packed[:10], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[10:], alone[1], rtol=0, atol=1e-5)
    assert (unmasked[10:] - alone[1]).abs().max() > 1e-3
    for layer in range(2):  # (each layer's KL: alone first, then second, then packed)
        by_document = torch.cat([losses[layer], losses[2 + layer]], dim=1)
        torch.testing.assert_close(losses[4 + layer], by_document, rtol=1e-5, atol=1e-7)
