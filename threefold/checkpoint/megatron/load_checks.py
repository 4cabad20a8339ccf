"""The checks a Megatron-LM checkpoint's read passes before training goes on from it (shared by
the torch_dist reader, checkpoint/megatron/tensors.py, and the legacy one, legacy_tensors.py):
an optimizer state's fp32 masters must be its weights, and every model tensor must be taken
by some parameter."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from threefold.config import ConfigError
from threefold.parallel.parallel_context import Group


def masters_agree(
    masters: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype, args: dict
) -> bool:
    """Whether fp32 masters round to the weights stored in `dtype`, as the optimizer copies
    them after each step; a run's FP8 weights (--fp8-param-gather's linear layers, saved
    dequantized) are not checked, its norms and biases are."""
    if args.get("fp8_param_gather") and weights.dim() > 1:
        return True
    return torch.equal(masters.to(dtype).float(), weights.float())


def masters_refused(
    path: str, what: str, key: str, index: tuple[int, ...], misplaced: bool = False
) -> ConfigError:
    """The refusal of an optimizer state whose fp32 masters of `key`[index] are not its
    weights: a bucket layout read otherwise than it was saved, or (`misplaced`) model-space
    state saved in the wrong places."""
    if misplaced:  # (Megatron-LM fixed it after megatron-core 0.16)
        why = (
            "so it is not the state saved with them (megatron-core 0.16's "
            "--dist-ckpt-optim-fully-reshardable save misplaces the state after a gradient "
            "buffer's first bucket, under --overlap-grad-reduce); pass --no-load-optim"
        )
    else:
        why = (
            "so its buckets are laid out otherwise than threefold rebuilt them; pass "
            "--no-load-optim, or load it in Megatron-LM once and save with "
            "--dist-ckpt-optim-fully-reshardable"
        )
    return ConfigError(
        f"--load {path}: the {what}'s fp32 masters of {key}{list(index)} are not its weights, "
        + why
    )


def unread_refused(
    path: str,
    stored: Iterable[str],
    read: set[str],
    pipeline: Group,
    strictness: str,
    left_out: tuple[str, ...] = (),
) -> None:
    """After the model was read, on every rank of the `pipeline` group (whose stages together
    hold every layer): a model tensor of the checkpoint (`stored`) that no parameter took
    (`read`: those taken on this rank) — a part threefold's model lacks, megatron-core's
    router bias before threefold had one, say — leaves the model computing something else.
    `strictness` (--dist-ckpt-strictness, megatron-core's names): refused (raise_*,
    threefold's default), named (log_*, return_*), or not looked for (assume_ok_unexpected,
    Megatron-LM's default, and ignore_all). `left_out`: the prefixes of the tensors the run
    leaves out (said when it loads: multi-token prediction depths it has none of)."""
    if strictness in ("assume_ok_unexpected", "ignore_all"):
        return
    if pipeline.size > 1:
        everyone: list = [None] * pipeline.size
        dist.all_gather_object(everyone, sorted(read), group=pipeline.group)
        read = set().union(*everyone)
    unread = sorted(key for key in stored if key not in read and not key.startswith(left_out))
    if not unread:
        return
    more = f" and {len(unread) - 3} more" if len(unread) > 3 else ""
    what = f"--load {path}: the checkpoint holds {', '.join(unread[:3])}{more}"
    if strictness.startswith("raise"):
        raise ConfigError(
            f"{what}, which this model has no parameter for: its model flags differ from "
            "the checkpoint's (try --use-checkpoint-args), or it has a part threefold does "
            "not build (--dist-ckpt-strictness log_unexpected loads it without them)"
        )
    if pipeline.rank == 0 and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"> {what}, left behind: no parameter takes them (--dist-ckpt-strictness)")
