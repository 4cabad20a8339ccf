"""Micro-batches for this rank: dataset + sampler -> {tokens, labels, loss_mask} tensors."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from threefold.config import Config, ConfigError, DataConfig, TrainingConfig
from threefold.data.gpt_dataset import MockGPTDataset, megatron_datasets
from threefold.data.sampler import PretrainingSampler
from threefold.parallel.context_parallel.sequence import split_batch
from threefold.parallel.parallel_context import ONE_DEVICE, Group


def build_datasets(config: Config, tokenizer=None) -> list:
    """Train, validation and test datasets (None where a split is empty; validation's a list
    of them with --multiple-validation-sets)."""
    model, data, training = config.model, config.data, config.training
    # What the run reads, as Megatron-LM sizes it: every training step's samples; on the
    # validation split, each evaluation reads on from the last (one per --eval-interval and
    # one after training); the test split is read once, after training.
    evaluation = max(training.evaluation_samples(), training.eval_global_batch_size)
    train = (
        training.train_samples
        if training.train_samples is not None
        else training.train_iters * max(training.rampup_batch_sizes())  # (a step schedule's)
    )
    validation = evaluation  # --skip-train's one evaluation, from the split's start
    if not training.skip_train:
        validation += training.validation_samples_read(training.train_iters)
    if training.full_validation:
        validation = None  # one epoch of the split, each sample once (megatron-core's None)
    sizes = [train, validation, evaluation]
    if data.mock_data:
        datasets = [
            MockGPTDataset(model.seq_length, model.vocab_size, training.seed, split, size)
            for split, size in enumerate(sizes)
        ]
    elif data.sft:  # Megatron-LM's JSONL conversations, packed (already masked)
        from threefold.data.megatron_sft import SFTData

        return megatron_datasets(config, tokenizer, sizes, SFTData(config, tokenizer))
    else:
        datasets = megatron_datasets(config, tokenizer, sizes)
    if data.dataloader_inter_document_masking:
        datasets = [_each(d, IndexedDocuments) for d in datasets]
    # (the flags that find documents by their end-of-document tokens)
    flags = [f for f in data.document_flags() if f != "--dataloader-inter-document-masking"]
    if not flags:
        return datasets
    if getattr(tokenizer, "eod", None) is None:
        raise ConfigError(
            f"{flags[0]} needs a tokenizer with an end-of-document token; give "
            "--tokenizer-type (with --mock-data: NullTokenizer and --vocab-size)"
        )

    def masked(dataset):
        return DocumentMasks(dataset, tokenizer.eod, data)

    return [_each(d, masked) for d in datasets]


def _each(dataset, wrap):
    """`wrap(dataset)`, for each of a list (--multiple-validation-sets); None stays None."""
    if isinstance(dataset, list):
        return [_each(d, wrap) for d in dataset]
    return None if dataset is None else wrap(dataset)


class SampleView:
    """A dataset whose samples are seen with more in them; its length and everything else
    (shuffled, source_of, ...) are the dataset's own."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str):
        return getattr(self.dataset, name)


class IndexedDocuments(SampleView):
    """Megatron-LM's --dataloader-inter-document-masking: each token attends only within its
    own document of the sample, and positions restart at each, the documents cut where
    megatron-core's index stitched them together (`MegatronSamples.document_pieces`), not at
    end-of-document tokens. Taken over --reset-attention-mask and --reset-position-ids
    (DocumentMasks, on the outside, keeps --eod-mask-loss's loss mask)."""

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        tokens = self.dataset[index]
        pieces = self.dataset.document_pieces(index, len(tokens) - 1)
        documents = np.repeat(np.arange(len(pieces)), pieces)
        starts = np.concatenate([[0], np.cumsum(pieces)[:-1]])
        return {
            "tokens": tokens,
            "document_ids": documents,
            "position_ids": np.arange(len(documents)) - np.repeat(starts, pieces),
        }


def validation_sets(validation, training: TrainingConfig) -> list[tuple[str, object]]:
    """The validation split's datasets, each with the name Megatron-LM's report gives it
    (`validation`, or --multiple-validation-sets' `validation-NAME`); empty ones left out."""
    if not isinstance(validation, list):
        return [] if validation is None else [(training.validation_set_name(0), validation)]
    names = training.validation_set_names
    if names and len(names) != len(validation):
        raise ConfigError(
            f"--validation-set-names: {len(names)} names for {len(validation)} "
            "--valid-data-path datasets; give one name each"
        )
    sets = enumerate(validation)
    return [(training.validation_set_name(i), d) for i, d in sets if d is not None]


class WholeSplit:
    """A split read once through in whole global batches (--full-validation): its samples,
    then copies of its first ones with no loss (a loss mask of zeros) up to a multiple of
    `global_batch_size`. Every rank and step then runs whole micro-batches (the pipeline and
    expert parallelism's all-to-alls need the same count everywhere), and a token-weighted
    loss counts each real sample once."""

    def __init__(self, dataset, global_batch_size: int) -> None:
        self.dataset, self.size = dataset, len(dataset)
        self.steps = -(-self.size // global_batch_size)  # (the last one padded)
        self.length = self.steps * global_batch_size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        sample = self.dataset[index % self.size]
        if not isinstance(sample, dict):  # pretraining: a token window, loss everywhere
            sample = {"tokens": sample}
        mask = sample.get("loss_mask")
        if mask is None:
            mask = np.ones(len(sample["tokens"]) - 1, dtype=np.float32)
        if index >= self.size:
            mask = np.zeros_like(mask)
        return {**sample, "loss_mask": mask}


class DocumentMasks(SampleView):
    """Token windows of a pretraining dataset, with what Megatron's GPTDataset derives from the
    end-of-document (EOD) tokens in them. A document ends with its EOD token, so position i
    belongs to the document numbered by the EODs among inputs 0..i-1:
    --reset-position-ids  positions restart at 0 after every EOD;
    --reset-attention-mask  a token attends only to earlier tokens of its own document;
    --eod-mask-loss  no loss where the input token is an EOD (predicting across documents)."""

    def __init__(self, dataset, eod: int, data: DataConfig) -> None:
        super().__init__(dataset)
        self.eod, self.data = eod, data

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        sample = self.dataset[index]
        sample = dict(sample) if isinstance(sample, dict) else {"tokens": sample}
        tokens = sample["tokens"]
        is_eod = tokens[:-1] == self.eod
        documents = np.concatenate([[0], np.cumsum(is_eod[:-1])])
        if self.data.eod_mask_loss:
            sample["loss_mask"] = (~is_eod).astype(np.float32)
        if self.data.dataloader_inter_document_masking:  # (its documents, not the EODs')
            return sample
        if self.data.reset_position_ids:
            starts = np.flatnonzero(np.concatenate([[True], is_eod[:-1]]))
            sample["position_ids"] = np.arange(len(documents)) - starts[documents]
        if self.data.reset_attention_mask:
            sample["document_ids"] = documents
        return sample


def micro_batches(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    seed: int,
    device: torch.device,
    dp: Group,
    shuffle: bool = True,
    num_workers: int = 0,
) -> Iterator[dict]:
    """This data-parallel rank's micro-batches (`dp`: the group of replicas that share a
    global batch), from `consumed_samples` on; read by `num_workers` processes ahead of the
    step (Megatron-LM's --num-workers), or in this one at 0."""
    # megatron-core's datasets are shuffled by their own indices: read them in order.
    shuffle = shuffle and not getattr(dataset, "shuffled", False)
    sampler = PretrainingSampler(
        len(dataset), consumed_samples, micro_batch_size, dp.rank, dp.size, seed, shuffle
    )
    if num_workers:
        hosts = iter(_worker_loader(dataset, sampler, num_workers, device))
    else:
        hosts = (stack_samples([dataset[i] for i in indices]) for indices in sampler)
    for host in hosts:
        yield to_batch(host, device)


def _worker_loader(dataset, sampler, num_workers: int, device: torch.device):
    """PyTorch's DataLoader over the sampler's micro-batches, as Megatron-LM's: worker
    processes read and stack the samples (a sample's cost, --fim-data's re-tokenization say,
    then overlaps the steps), two micro-batches ahead each, in the sampler's order; pinned
    for a GPU. A sample is the same whichever process reads it (data/fim.py seeds by index)."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=stack_samples,
        pin_memory=device.type == "cuda",
        persistent_workers=True,
        # its own generator for the workers' seeds: drawn from the global one, the seeds
        # would move the dropout stream of the run by one draw
        generator=torch.Generator().manual_seed(0),
    )


def stack_samples(items: list) -> dict[str, torch.Tensor]:
    """Samples (token windows, or dicts of arrays) stacked into a micro-batch's host tensors."""
    if not isinstance(items[0], dict):  # pretraining: token windows, loss everywhere
        items = [{"tokens": item} for item in items]
    host = {"tokens": np.stack([item["tokens"] for item in items])}
    for name in ("loss_mask", "document_ids", "position_ids"):
        if name in items[0]:
            host[name] = np.stack([item[name] for item in items])
    return {name: torch.from_numpy(value) for name, value in host.items()}


def collate(items: list[dict[str, np.ndarray]], device: torch.device) -> dict:
    """A micro-batch for one device from samples of `seq_length + 1` tokens (and optionally
    a loss mask, the document ids of packed documents, whose attention mask it then holds,
    and positions)."""
    return split_batch(to_batch(stack_samples(items), device), ONE_DEVICE)


def to_batch(host: dict[str, torch.Tensor], device: torch.device) -> dict:
    """A micro-batch on `device` from its stacked host tensors."""
    moved = {name: to_device(value, device) for name, value in host.items()}
    # Inputs and targets are two windows of one copy, as in Megatron's get_batch.
    tokens = moved.pop("tokens")
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    batch["loss_mask"] = moved.pop("loss_mask", None)
    if batch["loss_mask"] is None:  # pretraining: a loss at every position, made in place
        batch["loss_mask"] = torch.ones(tokens.shape[0], tokens.shape[1] - 1, device=device)
    # position_ids; document_ids, which the trainer's `split_batch` makes the attention's
    # mask (on one rank [b, 1, s, s], built where it is used; over CP ranks a block at a time)
    batch.update(moved)
    return batch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To a GPU it goes from pinned (page-locked) memory, as
    Megatron's data loader pins its batches: a copy from pageable memory may make the host
    wait for the GPU's queue to drain, after which a small model's GPU idles while the host
    launches the next kernels (docs/performance.md)."""
    if device.type == "cuda" and not tensor.is_pinned():  # (the workers' batches are)
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
