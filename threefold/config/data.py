"""Data: datasets, splits, the tokenizer and document handling."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from threefold.config.data_args import read_data_args
from threefold.config.errors import ConfigError
from threefold.config.errors import require as _require
from threefold.config.fields import arg

TOKENIZERS = (
    None,
    "SentencePieceTokenizer",
    # Megatron-LM's sentencepiece tokenizers of LLaMA-2-style models: the same model file, no
    # special tokens added (GPTSentencePiece) or a BOS before every document (Llama2)
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    # Megatron-LM's tokenizer of --sft conversations: a Hugging Face tokenizer directory and
    # --sft-tokenizer-prompt-format's turn markers (data/sft_tokenizer.py)
    "SFTTokenizer",
    "GPT2BPETokenizer",
    "NullTokenizer",
)
SENTENCEPIECE = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
HF_DIRECTORY = ("HuggingFaceTokenizer", "SFTTokenizer")  # --tokenizer-model DIR
# Megatron-LM's --sft-tokenizer-prompt-format values (data/sft_tokenizer.py renders them)
PROMPT_FORMATS = ("nemotron-h-aligned", "nemotron-nano-v2", "identity", "default")
# Megatron-LM tokenizers threefold does not have, and what to use instead
_MISSING_TOKENIZERS = {
    "TikTokenizer": "tiktoken vocabularies are not read by threefold; save the tokenizer "
    "as a Hugging Face tokenizer.json and use --tokenizer-type HuggingFaceTokenizer",
    "MultimodalTokenizer": "multimodal models are not built by threefold",
    "BertWordPieceLowerCase": "BERT models are not built by threefold",
    "BertWordPieceCase": "BERT models are not built by threefold",
}


@dataclass
class DataConfig:
    data_path: list[str] = arg(
        default_factory=list,
        help="PREFIX of a Megatron .bin/.idx pair, or WEIGHT PREFIX WEIGHT PREFIX ... to blend",
    )
    # Megatron's per-split paths; finetune.py reads JSONL conversations from them.
    train_data_path: list[str] = arg(
        default_factory=list,
        help="per-split [WEIGHT] PREFIX ... (finetune.py: JSONL conversations)",
    )
    valid_data_path: list[str] = arg(
        default_factory=list, help="per-split [WEIGHT] PREFIX ... of the validation data"
    )
    test_data_path: list[str] = arg(
        default_factory=list, help="per-split [WEIGHT] PREFIX ... of the test data"
    )
    data_args_path: str | None = arg(
        None, help="a file holding --data-path's blend, for one too long for a command line"
    )
    per_split_data_args_path: str | None = arg(
        None,
        help='a JSON file {"train": ..., "valid": ..., "test": ...} holding the per-split '
        "blends (--train-data-path, ...), for ones too long for a command line",
    )
    data_cache_path: str | None = arg(
        None, help="where megatron-core caches the document/sample/shuffle indices"
    )
    mock_data: bool = arg(False, help="random tokens instead of a dataset (needs --vocab-size)")
    split: str = arg(
        "969,30,1", help="train,validation,test weights of --data-path's documents, e.g. 98,2,0"
    )
    # (checked in `finalize`, so a Megatron-LM tokenizer threefold lacks is named in one line)
    tokenizer_type: str | None = arg(
        None,
        metavar="{" + ",".join(t for t in TOKENIZERS if t) + "}",
        help="how text becomes tokens (needed to read text; .bin files hold token ids)",
    )
    tokenizer_model: str | None = arg(
        None,
        help="SentencePieceTokenizer: the .model file; HuggingFaceTokenizer, SFTTokenizer: the "
        "directory",
    )
    sft_tokenizer_prompt_format: str = arg(
        "nemotron-h-aligned",
        choices=PROMPT_FORMATS,
        help="SFTTokenizer: how conversations are rendered (default: the tokenizer's own chat "
        "template, loss on every token)",
    )
    vocab_file: str | None = arg(None, help="GPT2BPETokenizer: vocab.json")  # GPT2BPETokenizer
    merge_file: str | None = arg(None, help="GPT2BPETokenizer: merges.txt")
    num_workers: int = arg(
        0,
        help="processes that read training batches ahead of the step (PyTorch DataLoader "
        "workers, as Megatron-LM's, whose default is 2); 0: read in the training process",
    )
    mmap_bin_files: bool = arg(
        True,
        help="read the .bin files through file handles instead of memory-mapping them",
        flag="--no-mmap-bin-files",
    )  # False: read .bin files through file handles
    mid_level_dataset_surplus: float = arg(
        0.005,
        minimum=0,
        help="the share of extra samples megatron-core builds for each dataset of a weighted "
        "blend; raise it when it reports too few samples for the blend",
    )
    num_dataset_builder_threads: int = arg(
        1, minimum=1, help="threads megatron-core builds a blend's datasets with"
    )
    # Pretraining windows split at end-of-document tokens (data/loader.DocumentMasks).
    reset_position_ids: bool = arg(
        False, help="positions restart at 0 after each end-of-document token"
    )
    reset_attention_mask: bool = arg(
        False, help="tokens attend only within their own document of the sample"
    )
    eod_mask_loss: bool = arg(
        False, help="no loss on predicting the token after an end-of-document token"
    )
    dataloader_inter_document_masking: bool = arg(
        False,
        help="tokens attend only within their own document of the sample, as the dataset's "
        "index cuts it (no end-of-document token needed), positions restarting at each",
    )
    sft: bool = arg(
        False,
        help="Megatron-LM's SFT: the data paths are JSONL files of conversations, a line a "
        "packed sample (needs --tokenizer-type SFTTokenizer)",
    )
    # Fill-in-the-middle samples (data/fim.py), Megatron-LM's flags and defaults.
    fim_data: bool = arg(False, help="rearrange documents for fill-in-the-middle training")
    fim_rate: float = arg(0.5, help="--fim-data: the share of documents rearranged")
    fim_spm_rate: float = arg(
        0.5, help="--fim-data: the share of those in suffix-prefix-middle order (else PSM)"
    )
    fim_split_sample: str | None = arg(
        None, help="--fim-data: a token cutting documents into fragments rearranged apart"
    )
    fim_fragment_rate: float | None = arg(
        None, help="--fim-split-sample: the share of fragments rearranged"
    )
    fim_no_prefix: str | None = arg(
        None, help="--fim-data: leave pieces whose text starts with this as they are"
    )
    fim_prefix_token: str = arg("<fim_prefix>", help="--fim-data: the prefix sentinel token")
    fim_middle_token: str = arg("<fim_middle>", help="--fim-data: the middle sentinel token")
    fim_suffix_token: str = arg("<fim_suffix>", help="--fim-data: the suffix sentinel token")
    fim_pad_token: str = arg("<fim_pad>", help="--fim-data: fills a sample rearranging shortened")
    fim_eod_token: str = arg(
        "<|endoftext|>", help="--fim-data: the end-of-document token documents are cut at"
    )

    def document_flags(self) -> list[str]:
        """Megatron's flags given that split pretraining token windows into their documents."""
        return [
            flag
            for flag, value in (
                ("--reset-position-ids", self.reset_position_ids),
                ("--reset-attention-mask", self.reset_attention_mask),
                ("--eod-mask-loss", self.eod_mask_loss),
                ("--dataloader-inter-document-masking", self.dataloader_inter_document_masking),
            )
            if value
        ]

    def split_weights(self) -> list[float]:
        # Megatron-LM's Llama-3 example passes --split "'99,1,0'": the quotes reach argv.
        parts = self.split.strip("'\"").replace("/", ",").split(",")
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            raise ConfigError(f"--split {self.split!r} must be numbers such as 969,30,1") from None
        weights = (weights + [0.0, 0.0, 0.0])[:3]
        _require(
            sum(weights) > 0 and all(0 <= w < math.inf for w in weights),
            f"--split {self.split!r} needs finite, non-negative weights with a positive sum",
        )
        return [w / sum(weights) for w in weights]

    def finalize(self) -> list[str]:
        """Checks the data flags (ConfigError); returns the warnings to print."""
        read_data_args(self)  # (--data-args-path, --per-split-data-args-path)
        _require(
            bool(self.data_path) + self.mock_data + bool(self.train_data_path) == 1,
            "give exactly one of --data-path PREFIX, --train-data-path and --mock-data",
        )
        _require(
            not (self.valid_data_path or self.test_data_path) or self.train_data_path,
            "--valid-data-path/--test-data-path need --train-data-path",
        )
        _require(self.num_workers >= 0, f"--num-workers {self.num_workers} must be >= 0")
        self.finalize_tokenizer()
        self.split_weights()
        self.finalize_fim()
        self.finalize_sft()
        if self.dataloader_inter_document_masking:
            given = [
                flag
                for flag, on in (("--mock-data", self.mock_data), ("--fim-data", self.fim_data))
                if on
            ]
            _require(
                not given,
                f"--dataloader-inter-document-masking with {' '.join(given)}: its documents are "
                "those of indexed data as megatron-core samples them; drop one",
            )
        return self.unread_tokenizer_files()

    def unread_tokenizer_files(self) -> list[str]:
        """A warning for each tokenizer file given that --tokenizer-type does not read
        (Megatron-LM ignores them too, and launch scripts pass GPT-2's files to any type)."""
        reads = {"GPT2BPETokenizer": ("vocab_file", "merge_file")}
        reads |= {name: ("tokenizer_model",) for name in (*SENTENCEPIECE, *HF_DIRECTORY)}
        by = (
            f"by --tokenizer-type {self.tokenizer_type}"
            if self.tokenizer_type
            else "without --tokenizer-type"
        )
        return [
            f"--{field.replace('_', '-')} {getattr(self, field)} is not read {by}"
            for field in ("tokenizer_model", "vocab_file", "merge_file")
            if getattr(self, field) and field not in reads.get(self.tokenizer_type, ())
        ]

    def finalize_sft(self) -> None:
        """--sft: Megatron-LM's conversations, which only its SFTTokenizer renders, packed with
        their own positions and per-conversation attention (megatron-core asserts that the
        document flags are off)."""
        if not self.sft:
            return
        _require(
            self.tokenizer_type == "SFTTokenizer",
            "--sft renders conversations with --tokenizer-type SFTTokenizer (a Hugging Face "
            "--tokenizer-model DIR and --sft-tokenizer-prompt-format); add them",
        )
        _require(
            not self.mock_data,
            "--sft reads JSONL conversations: give --data-path FILE.jsonl, not --mock-data",
        )
        flags = self.document_flags() + ["--fim-data"] * self.fim_data
        _require(
            not flags,
            f"--sft with {flags[0] if flags else ''}: a conversation's sample carries its own "
            "positions, attention and loss mask; drop the flag",
        )

    def finalize_fim(self) -> None:
        """--fim-*: rates that are probabilities, and no flag without --fim-data."""
        if not self.fim_data:
            given = [
                "--" + field.name.replace("_", "-")
                for field in fields(self)
                if field.name.startswith("fim_") and getattr(self, field.name) != field.default
            ]
            _require(
                not given,
                f"{' '.join(given)}: fill-in-the-middle flags without --fim-data; add it or "
                "drop them",
            )
            return
        _require(
            not self.mock_data,
            "--fim-data rearranges the text of documents: give --data-path, not --mock-data",
        )
        for flag, rate in (
            ("--fim-rate", self.fim_rate),
            ("--fim-spm-rate", self.fim_spm_rate),
            ("--fim-fragment-rate", self.fim_fragment_rate),
        ):
            _require(
                rate is None or 0 <= rate <= 1, f"{flag} {rate} must be a probability in [0, 1]"
            )
        _require(
            self.fim_split_sample is None or self.fim_fragment_rate is not None,
            "--fim-split-sample needs --fim-fragment-rate (the share of fragments rearranged)",
        )

    def finalize_tokenizer(self) -> None:
        """The tokenizer flags alone (the tools that sample a checkpoint take only these)."""
        _require(
            self.tokenizer_type not in _MISSING_TOKENIZERS,
            f"--tokenizer-type {self.tokenizer_type}: "
            f"{_MISSING_TOKENIZERS.get(self.tokenizer_type)}",
        )
        _require(
            self.tokenizer_type in TOKENIZERS,
            f"--tokenizer-type {self.tokenizer_type} is not supported; use one of "
            f"{', '.join(t for t in TOKENIZERS if t)}",
        )
        if self.tokenizer_type in (*SENTENCEPIECE, *HF_DIRECTORY):
            _require(
                self.tokenizer_model is not None,
                f"--tokenizer-type {self.tokenizer_type} needs --tokenizer-model "
                f"{'DIR' if self.tokenizer_type in HF_DIRECTORY else 'FILE'}",
            )
        _require(
            self.tokenizer_type == "SFTTokenizer"
            or self.sft_tokenizer_prompt_format == "nemotron-h-aligned",
            f"--sft-tokenizer-prompt-format {self.sft_tokenizer_prompt_format} is "
            "SFTTokenizer's; add --tokenizer-type SFTTokenizer or drop it",
        )
        if self.tokenizer_type is None and (self.vocab_file or self.merge_file):
            # GPT-2's files name their tokenizer (Megatron-LM's GPT-3 example passes no type)
            _require(
                bool(self.vocab_file and self.merge_file),
                "--vocab-file and --merge-file (GPT2BPETokenizer's files) go together; give "
                "both, or --tokenizer-type for another tokenizer",
            )
            self.tokenizer_type = "GPT2BPETokenizer"
