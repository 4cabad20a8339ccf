"""Tensor and sequence parallelism reproduce the single-process model (real gloo ranks).

Vocabulary 1001 with --make-vocab-size-divisible-by 8 pads to 1008 at TP=1 and TP=2 but to
1024 at TP=4: the loss must not depend on the padding.
"""

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import (
    GPT2_STYLE,
    LLAMA_STYLE,
    TRAINING,
    _setup,
    assert_close_dicts,
    assert_losses_close,
    gradient_job,
    relative_error,
    train_job,
)
from threefold.parallel.tensor_parallel.mappings import COLLECTIVE_COUNTS

STYLES = {"gpt2_tied": GPT2_STYLE, "llama_untied": LLAMA_STYLE}
LAYOUTS = [(2, False), (2, True), (4, False), (4, True)]


def _tensor_parallel_argv(style: str, tp: int, sequence_parallel: bool) -> list[str]:
    argv = STYLES[style] + TRAINING + ["--tensor-model-parallel-size", str(tp)]
    return argv + (["--sequence-parallel"] if sequence_parallel else [])


@pytest.fixture(scope="module")
def references():
    return {
        style: {"grads": gradient_job(argv + TRAINING), "train": train_job(argv + TRAINING, 10)}
        for style, argv in STYLES.items()
    }


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("tp,sequence_parallel", LAYOUTS)
def test_logits_loss_and_gradients_match(references, style, tp, sequence_parallel):
    argv = _tensor_parallel_argv(style, tp, sequence_parallel)
    reference = references[style]["grads"]
    for result in run_distributed(tp, gradient_job, argv):
        assert relative_error(result["logits"], reference["logits"]) <= 1e-5
        assert abs(result["loss"] - reference["loss"]) <= 1e-5 * abs(reference["loss"])
        assert_close_dicts(result["grads"], reference["grads"], 1e-5, "gradient")


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("tp,sequence_parallel", LAYOUTS)
def test_ten_training_steps_match(references, style, tp, sequence_parallel):
    argv = _tensor_parallel_argv(style, tp, sequence_parallel)
    reference = references[style]["train"]
    result = run_distributed(tp, train_job, argv, 10)[0]
    assert_losses_close(result["losses"], reference["losses"], 1e-5)
    assert_close_dicts(result["params"], reference["params"], 1e-5, "parameter")


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("tp", [2, 4])
def test_overlapped_collectives_match(references, style, tp):
    """--tp-comm-overlap: each sequence-parallel collective a ring of slices around its GEMM
    (the reduce-scatters' sums in another order): first-step gradients and ten steps as one
    process; the weight gradients into main_grad, SwiGLU's fc1 blocks (llama) and biases (gpt2)
    included."""
    argv = _tensor_parallel_argv(style, tp, True) + ["--tp-comm-overlap"]
    reference = references[style]
    for result in run_distributed(tp, gradient_job, argv):
        assert relative_error(result["logits"], reference["grads"]["logits"]) <= 1e-5
        assert_close_dicts(result["grads"], reference["grads"]["grads"], 1e-5, "gradient")
    result = run_distributed(tp, train_job, argv, 10)[0]
    assert_losses_close(result["losses"], reference["train"]["losses"], 1e-5)
    assert_close_dicts(result["params"], reference["train"]["params"], 1e-5, "parameter")


def test_tensor_and_data_parallel_combined(references):
    argv = LLAMA_STYLE + TRAINING + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    result = run_distributed(4, train_job, argv, 10)[0]  # TP=2 x DP=2
    assert_losses_close(result["losses"], references["llama_untied"]["train"]["losses"], 1e-5)


def _collectives_per_step(argv: list[str]) -> dict:
    trainer = _setup(argv)
    batch = next(trainer.train_iterator())
    COLLECTIVE_COUNTS.clear()
    trainer.model(batch["tokens"], labels=batch["labels"]).mean().backward()
    return dict(COLLECTIVE_COUNTS)


def _per_layer_job(argv: list[str]) -> dict:
    one = _collectives_per_step(argv + ["--num-layers", "1"])
    two = _collectives_per_step(argv + ["--num-layers", "2"])
    return {key: two.get(key, 0) - one.get(key, 0) for key in set(one) | set(two)}


@pytest.mark.parametrize("sequence_parallel,overlap", [(False, False), (True, False), (True, True)])
def test_collectives_per_layer_follow_megatron_accounting(sequence_parallel, overlap):
    argv = GPT2_STYLE + TRAINING + ["--tensor-model-parallel-size", "2"]
    argv += ["--sequence-parallel"] if sequence_parallel else []
    argv += ["--tp-comm-overlap"] if overlap else []  # the same volume, in slices
    per_layer = run_distributed(2, _per_layer_job, argv)[0]
    activation_bytes = 16 * 2 * 32 * 4  # sequence x micro-batch x hidden, fp32
    if not sequence_parallel:
        # Forward: after attention and after the MLP; backward: before QKV and before fc1.
        assert per_layer == {"all_reduce": 4, "all_reduce:bytes": 4 * activation_bytes}
    else:
        # Each all-reduce becomes a reduce-scatter + all-gather pair of the same total volume;
        # with the overlap each runs in ring steps.
        assert per_layer == {
            "all_gather": 4,
            "all_gather:bytes": 4 * activation_bytes,
            "reduce_scatter": 4,
            "reduce_scatter:bytes": 4 * activation_bytes,
            **({"in_ring_steps": 8} if overlap else {}),
        }


@pytest.mark.parametrize("init", [[], ["--init-method-xavier-uniform"]], ids=["normal", "xavier"])
def test_initialization_is_layout_independent(init):
    """A TP=2 model holds exactly the shards of the TP=1 model with the same seed."""
    argv = LLAMA_STYLE + TRAINING + init
    reference = train_job(argv, 0)["params"]
    result = run_distributed(2, train_job, argv + ["--tensor-model-parallel-size", "2"], 0)[0]
    assert_close_dicts(result["params"], reference, 0.0, "initial parameter")
    if init:  # Megatron-LM's: U(-a, a), a = sqrt(6 / (fan_in + fan_out)), for every matrix
        for name, value in reference.items():
            if value.ndim == 2:
                bound = (6 / sum(value.shape)) ** 0.5
                assert abs(value).max() <= bound and abs(value).max() > 0.9 * bound, name
                assert abs(value.var() - bound**2 / 3) < 0.1 * bound**2 / 3, name


def test_dropout_masks_differ_across_tp_ranks_inside_tp_regions_only():
    results = run_distributed(4, _dropout_masks_job)  # TP=2 x DP=2: ranks 0,1 and 2,3 are TP
    assert all(torch.equal(r["replicated"], results[0]["replicated"]) for r in results)
    assert not torch.equal(results[0]["split"], results[1]["split"])
    # Data-parallel replicas draw the same masks: rank 2 mirrors rank 0, rank 3 rank 1.
    assert torch.equal(results[0]["split"], results[2]["split"])
    assert torch.equal(results[1]["split"], results[3]["split"])


def _dropout_masks_job() -> dict:
    from threefold.parallel import state
    from threefold.parallel.tensor_parallel.random import get_rng_tracker, set_random_seed

    state.initialize_model_parallel(2, 1)
    set_random_seed(1234, state.parallel_context())
    replicated = torch.nn.functional.dropout(torch.ones(64), 0.5)
    with get_rng_tracker().fork():
        split = torch.nn.functional.dropout(torch.ones(64), 0.5)
    return {"replicated": replicated, "split": split}


def test_region_boundaries_are_skipped_without_tensor_parallelism():
    # At TP=1 (no process group) no autograd node and no copy: the input itself comes back.
    from threefold.parallel.parallel_context import Group
    from threefold.parallel.tensor_parallel import mappings

    x = torch.randn(4, 2, 8, requires_grad=True)
    for name in (
        "copy_to_tensor_parallel_region",
        "reduce_from_tensor_parallel_region",
        "gather_from_sequence_parallel_region",
        "reduce_scatter_to_sequence_parallel_region",
    ):
        assert getattr(mappings, name)(x, Group()) is x, name


def test_squared_relu_mlps_match_at_tp2_with_sequence_parallelism():
    """--squared-relu: the column-parallel fc1's shards go through relu(x)^2 on their own, as
    GELU's do; gradients at TP2 + SP are one process's."""
    argv = GPT2_STYLE + TRAINING + ["--squared-relu"]
    reference = gradient_job(argv)
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    for result in run_distributed(2, gradient_job, argv + layout):
        assert relative_error(result["logits"], reference["logits"]) <= 1e-5
        assert_close_dicts(result["grads"], reference["grads"], 1e-5, "gradient")
    gelu = gradient_job(GPT2_STYLE + TRAINING)
    assert relative_error(gelu["logits"], reference["logits"]) > 1e-3


def _test_mode_check(argv: list[str]) -> dict:
    """--test-mode at TP2: a step, then one bit of a QK-norm weight flipped on TP rank 1."""
    import torch

    from threefold.training.replica_check import ReplicaMismatchError

    trainer = _setup(argv + ["--test-mode", "--qk-layernorm"])
    check = trainer.replica_check
    trainer.train_step()
    line = check.check(1, trainer.layout_independent_parameters())
    name, param = next(
        (n, p) for n, p in trainer.layout_independent_parameters() if "q_layernorm" in n
    )
    if trainer.parallel.tp.rank == 1:
        with torch.no_grad():
            param.data.view(-1)[:1].view(torch.int32).bitwise_xor_(1)
    try:
        check.check(2, trainer.layout_independent_parameters())
    except ReplicaMismatchError as error:
        return {"line": line, "error": str(error), "name": name, "interval": check.interval}
    return {"line": line, "error": None, "name": name, "interval": check.interval}


def test_test_mode_compares_weights_every_tensor_parallel_rank_holds_whole():
    """Megatron-LM's --test-mode compares the QK norms across TP (and DP) ranks: here every
    iteration, every weight TP ranks hold whole."""
    argv = LLAMA_STYLE + TRAINING + ["--tensor-model-parallel-size", "2"]
    for result in run_distributed(2, _test_mode_check, argv):
        assert result["interval"] == 1
        assert result["line"] == ">>> Weight hashes match after 1 iterations..."
        assert result["error"] is not None and f"{result['name']} on rank 1" in result["error"]
