"""Jobs and comparisons for parity tests: a layout must reproduce the single-process run.

Every job runs the real `Trainer` in-process on whatever ranks call it. The reference is the
same job in the test process itself, with no process group at all (TP=PP=DP=1). Parameters and
gradients come back as full, unpadded numpy arrays keyed by layout-independent names, gathered
from the TP shards, so any two layouts compare directly.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import numpy as np
import torch

from threefold.arguments import parse_args
from threefold.checkpoint.load import load_checkpoint
from threefold.checkpoint.save import save_checkpoint
from threefold.parallel import state
from threefold.parallel.data_parallel.torch_native import full
from threefold.parallel.tensor_parallel.mappings import gather_from_tensor_parallel_region
from threefold.parallel.tensor_parallel.sharding import gather_tensor_parallel, sharding_group
from threefold.training.trainer import Trainer

GPT2_STYLE = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--max-position-embeddings",
    "16",
]
LLAMA_STYLE = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "8",
    "--group-query-attention",
    "--num-query-groups",
    "4",
    "--ffn-hidden-size",
    "64",
    "--seq-length",
    "16",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--position-embedding-type",
    "rope",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
]
# LLaMA with a key and value head per query head (multi-latent attention takes no GQA)
LLAMA_MHA_STYLE = [
    flag
    for i, flag in enumerate(LLAMA_STYLE)
    if flag not in ("--group-query-attention", "--num-query-groups")
    and LLAMA_STYLE[i - 1] != "--num-query-groups"
]
# FP8 runs of a few steps: each recipe, and full recomputation (a second forward per step).
FP8_STEP_VARIANTS = {
    "delayed": ["--fp8-format", "hybrid"],
    "tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "rowwise": ["--fp8-format", "hybrid", "--fp8-recipe", "rowwise"],
    "blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
    "delayed-full-recompute": ["--fp8-format", "hybrid", "--recompute-granularity", "full"]
    + ["--recompute-method", "uniform", "--recompute-num-layers", "1"],
}
TRAINING = [
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "10",
    "--lr",
    "3e-3",
    "--lr-warmup-iters",
    "2",
    "--clip-grad",
    "1.0",
    "--mock-data",
    "--vocab-size",
    "1001",
    "--make-vocab-size-divisible-by",
    "8",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--seed",
    "1234",
    "--log-interval",
    "1000",
    "--eval-iters",
    "0",
    # A broken schedule must fail the test within a minute, not hang it.
    "--distributed-timeout-minutes",
    "1",
]


def _setup(argv: list[str]) -> Trainer:
    config = parse_args(argv, world_size=state.global_world_size())
    if torch.distributed.is_initialized():
        parallel = state.initialize_layout(config.parallel)
    else:
        parallel = state.parallel_context()
    return Trainer(config, torch.device("cpu"), parallel)


def _full(trainer: Trainer, attribute: str = "data") -> dict[str, np.ndarray]:
    """This rank's parameters (or their `main_grad`s), gathered over TP (an expert's: over
    expert TP), by global name; in the run's dtype (--fp8-param-gather stores FP8 weights in
    FP8)."""
    with trainer.data_parallel.parameters_in_model_dtype():
        return {
            name: gather_tensor_parallel(
                full(getattr(param, attribute)), param, sharding_group(param, trainer.parallel)
            )
            .detach()
            .float()
            .numpy()
            .copy()
            for name, param in trainer.layout_independent_parameters()
        }


def merge_pipeline_stages(per_rank: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One dictionary from the stages' parameter dictionaries. A name held by several stages
    (tied embeddings on the first and last stage) must hold the same values there."""
    merged: dict[str, np.ndarray] = {}
    for params in per_rank:
        for name, value in params.items():
            if name in merged:
                assert np.array_equal(merged[name], value), f"{name} differs between stages"
            merged[name] = value
    return merged


def _without_key_bias(params: dict[str, np.ndarray], trainer: Trainer) -> dict:
    """Drop the key rows of QKV biases. Attention is invariant to a key bias (it shifts every
    score of a query by the same amount), so that gradient is exactly zero up to rounding, and
    Adam turns rounding noise (~1e-10) into full-size steps whose sign depends on summation
    order. Those few entries measure noise, not the layout; the gradient tests keep them."""
    config = trainer.config.model
    heads_per_group = config.num_attention_heads // config.num_query_groups
    for name in [n for n in params if n.endswith("k_layernorm.bias")]:
        del params[name]
    for name in [n for n in params if n.endswith("linear_qkv.bias")]:
        grouped = params[name].reshape(config.num_query_groups, heads_per_group + 2, -1)
        params[name] = np.delete(grouped, heads_per_group, axis=1).reshape(-1)
    return params


def train_job(argv: list[str], steps: int) -> dict:
    """Losses of `steps` training iterations, the final full parameters, with FP8 the
    scaling state a checkpoint would hold, and with --eval-iters the validation loss after
    them (None without)."""
    trainer = _setup(argv)
    losses = [trainer.train_step()[0] for _ in range(steps)]
    fp8 = trainer.fp8.state_tensors() if trainer.fp8 is not None else {}
    return {
        "losses": losses,
        "params": _without_key_bias(_full(trainer), trainer),
        "fp8": {name: tensor.numpy().copy() for name, tensor in fp8.items()},
        "valid": trainer.evaluate(),
    }


def inference_job(
    directory: str, pipeline: int, tensor: int, prompt: str | list[int], tokens: list[int]
) -> tuple[list[int], float]:
    """Greedy continuation (12 tokens) of `prompt` (a text for the checkpoint's tokenizer, or
    token ids) and the mean loss of `tokens` (windows of 16), by the checkpoint under
    `directory` on TP x PP ranks: the tools' path (their layout, `load_model` of this rank's
    stage, the inference loops); on one device without torch.distributed when both are 1."""
    from threefold.checkpoint.load import load_model
    from threefold.inference import generate, score

    distributed = pipeline * tensor > 1
    parallel = state.initialize_for_inference(pipeline, tensor)[1] if distributed else None
    try:
        _, model, tokenizer = load_model(
            directory, parallel=parallel, with_tokenizer=isinstance(prompt, str)
        )
        ids = tokenizer.tokenize(prompt) if isinstance(prompt, str) else prompt
        return generate(model, ids, 12, 64), score(model, tokens, 16)[0]
    finally:
        if distributed:
            state.destroy_model_parallel()


def gradient_job(argv: list[str]) -> dict:
    """Logits, mean loss and full gradients of the first micro-batch (needs DP=1)."""
    trainer = _setup(argv)
    model = trainer.model
    batch = next(trainer.train_iterator())
    logits = gather_from_tensor_parallel_region(model(batch["tokens"]), trainer.parallel.tp)
    logits = logits[..., : model.vocab_size].detach().numpy().copy()
    # every buffer's reduction (the experts' and FP8 weights' too), as a training step's
    trainer.data_parallel.start_step(1)
    loss = model(batch["tokens"], labels=batch["labels"]).mean()
    loss.backward()
    trainer.data_parallel.finish_grad_sync()
    grads = _full(trainer, "main_grad")
    return {"logits": logits, "loss": loss.item(), "grads": grads}


def first_step_gradients_job(argv: list[str]) -> dict:
    """The reduced gradients of the first global batch, through the trainer's own schedule,
    batches and gradient reduction (any layout without the distributed optimizer)."""
    trainer = _setup(argv)
    data_parallel, micro_batches = trainer.data_parallel, trainer.num_microbatches
    data_parallel.start_step(micro_batches)
    losses = trainer._schedule(trainer.train_iterator(), micro_batches)
    data_parallel.finish_grad_sync()
    return {"loss": trainer._mean_loss(losses), "grads": _full(trainer, "main_grad")}


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def assert_close_dicts(actual: dict, expected: dict, tolerance: float, what: str) -> None:
    assert actual.keys() == expected.keys(), f"{what}: names differ"
    for name in expected:
        assert actual[name].shape == expected[name].shape, f"{what} {name}: shape differs"
        error = relative_error(actual[name], expected[name])
        assert error <= tolerance, f"{what} {name}: relative error {error:.2e} > {tolerance}"


def assert_losses_close(actual: list[float], expected: list[float], tolerance: float) -> None:
    assert len(actual) == len(expected)
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= tolerance * abs(e), (
            f"step {step}: loss {a!r} vs reference {e!r} (relative {abs(a - e) / abs(e):.2e})"
        )


# Data parallelism changes only the order of gradient sums. Over 10 AdamW steps that rounding
# stays near fp32's resolution, except where Adam divides by a tiny second moment (embedding
# rows that few tokens touch); PyTorch's fused AdamW rounds those slightly differently from
# its for-loop version, hence 2e-6 rather than 1e-6. A wrong reduction is off by 1e-3 or more.
DP_TOLERANCE = 2e-6


def assert_matches_reference(results: list[dict], reference: dict, tolerance: float) -> None:
    """Every rank's losses, and the parameters merged over pipeline stages, match the
    reference run's within `tolerance` (relative)."""
    for result in results:  # every stage reports the last stage's loss
        assert_losses_close(result["losses"], reference["losses"], tolerance)
    params = merge_pipeline_stages([r["params"] for r in results])
    assert_close_dicts(params, reference["params"], tolerance, "parameter")


# FP8 runs are compared a step at a time. Their rounding makes a run chaotic: a layout's
# reordered fp32 sums put an activation a hair to the other side of an FP8 rounding boundary,
# that element moves by a whole FP8 step, and Adam's normalized updates spread it. How soon
# that happens depends on the CPU's GEMM kernels: on an AVX-512 Xeon one device on one thread
# and on two drifts apart to a median parameter error of 1e-2 by step 10, as far as a TP run
# that skips the amax reduction. So the layout saves a checkpoint before every step, and the
# reference takes each step from that checkpoint: every compared step starts from the same
# state, and only that step's arithmetic may differ.
Record = Callable[[Trainer], dict]


def train_steps(trainer: Trainer, steps: int, record: Record, directory: str | None = None) -> dict:
    """Train `steps` steps: the losses, and `record(trainer)` after the last. With a
    `directory`, a step at a time: the state each step but the first starts from is
    checkpointed under `directory`/<step>, and `after` holds `record(trainer)` after each."""
    losses, after = [], []
    for step in range(steps):
        if directory is not None and step > 0:
            save_checkpoint(os.path.join(directory, str(step)), trainer.checkpoint_components())
        losses.append(trainer.train_step()[0])
        if directory is not None:
            after.append(record(trainer))
    if directory is None:
        return {"losses": losses, **record(trainer)}
    return {"losses": losses, **after[-1], "after": after}


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Compute as a rank of tests/distributed.py does: on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def one_device_steps(
    argv: list[str],
    steps: int,
    directory: str,
    record: Record,
    setup: Callable[[list[str]], Trainer] = _setup,
) -> dict:
    """The one-device reference of `train_steps` with a directory: each step taken by a fresh
    one-device trainer (`setup(argv)`), the first from its own initialization (a layout that
    initializes otherwise fails there), every later one from the layout's checkpoint of its
    start."""
    losses, after = [], []
    with one_thread():
        for step in range(steps):
            trainer = setup(argv)
            if step > 0:
                path = os.path.join(directory, str(step))
                assert load_checkpoint(path, trainer.checkpoint_components()) == step
            losses.append(trainer.train_step()[0])
            after.append(record(trainer))
    return {"losses": losses, "after": after}
