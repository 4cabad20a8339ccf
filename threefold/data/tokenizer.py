"""Tokenizers behind one small interface: `tokenize`, `detokenize`, `token_id`, `vocab_size`,
`eod`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

from threefold.config import ConfigError, DataConfig

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


@contextlib.contextmanager
def _read_as(files: str, kind: str) -> Iterator[None]:
    """A tokenizer file the library cannot read becomes one line naming the flag and file.
    The libraries raise what they like for a malformed file (sentencepiece a RuntimeError,
    `tokenizers` a bare Exception, transformers a ValueError or a JSONDecodeError)."""
    try:
        yield
    except ImportError:
        raise
    except Exception as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"{files}: not a readable {kind} ({reason})") from None


def check_hf_directory(directory: str) -> None:
    """`--tokenizer-model DIR` of a Hugging Face tokenizer: a directory holding its files."""
    if not os.path.isdir(directory):
        raise ConfigError(
            f"--tokenizer-model {directory}: no such directory; give the "
            "local directory holding tokenizer.json / tokenizer_config.json"
        )
    if not any(os.path.isfile(os.path.join(directory, name)) for name in HF_TOKENIZER_FILES):
        raise ConfigError(
            f"--tokenizer-model {directory}: holds no tokenizer.json or "
            "tokenizer_config.json; give a Hugging Face tokenizer directory"
        )


class SentencePieceTokenizer:
    def __init__(self, model_file: str) -> None:
        import sentencepiece

        if not os.path.isfile(model_file):
            raise ConfigError(
                f"--tokenizer-model {model_file}: no such file; train one with "
                "tools/train_tokenizer.py or fix the path"
            )
        self.model_file = model_file
        with _read_as(f"--tokenizer-model {model_file}", "sentencepiece model"):
            self.processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = self.processor.vocab_size()
        self.eod = self.processor.eos_id()
        self.bos = self.processor.bos_id()

    def tokenize(self, text: str) -> list[int]:
        return self.processor.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        return self.processor.decode([int(i) for i in ids])

    def token_id(self, token: str) -> int | None:
        """One piece's id (None if the model has no such piece)."""
        found = self.processor.piece_to_id(token)
        return found if self.processor.id_to_piece(found) == token else None


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron-LM's Llama2Tokenizer: sentencepiece with a BOS before every text (so a
    prompt gets its BOS from `tokenize` itself)."""

    def tokenize(self, text: str) -> list[int]:
        return [self.bos, *self.processor.encode(text)]


class HuggingFaceTokenizer:
    """A Hugging Face tokenizer from a local directory (`--tokenizer-model DIR`): through
    `transformers.AutoTokenizer` when installed (chat templates included), else the
    `tokenizers` library's tokenizer.json."""

    def __init__(self, directory: str) -> None:
        check_hf_directory(directory)
        self.model_file = directory
        try:
            from transformers import AutoTokenizer
        except ImportError:
            AutoTokenizer = None
        with _read_as(f"--tokenizer-model {directory}", "Hugging Face tokenizer"):
            if AutoTokenizer is not None:
                self.tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
            else:
                from tokenizers import Tokenizer

                self.tokenizer = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        if AutoTokenizer is not None:
            self._encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)
            self._decode = self.tokenizer.decode
            self.vocab_size = len(self.tokenizer)
            eod, bos = self.tokenizer.eos_token_id, self.tokenizer.bos_token_id
            # Whether the tokenizer starts every text with BOS (Llama's do): the models it
            # was made for were pretrained so.
            self.adds_bos = bos is not None and self.tokenizer("a")["input_ids"][:1] == [bos]
        else:
            self._encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False).ids
            self._decode = self.tokenizer.decode
            self.vocab_size = self.tokenizer.get_vocab_size()
            eod = bos = None
            self.adds_bos = False
        self.eod = eod if eod is not None else self.vocab_size - 1
        self.bos = bos

    def tokenize(self, text: str) -> list[int]:
        return list(self._encode(text))

    def detokenize(self, ids: list[int]) -> str:
        return self._decode([int(i) for i in ids])

    def token_id(self, token: str) -> int | None:
        """One token's id, special tokens included (None if the vocabulary lacks it)."""
        if hasattr(self.tokenizer, "token_to_id"):  # the `tokenizers` library's
            return self.tokenizer.token_to_id(token)
        found = self.tokenizer.convert_tokens_to_ids(token)
        known = found is not None and self.tokenizer.convert_ids_to_tokens(found) == token
        return found if known else None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        """The token ids `transformers`' `apply_chat_template` gives for a conversation."""
        ids = self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
        )
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def prompt_ids(tokenizer, text: str) -> list[int]:
    """A prompt's ids as fine-tuning samples and generation start them: with the
    beginning-of-sequence token where the tokenizer itself starts texts with one (a Hugging
    Face tokenizer of a model pretrained so), else the text alone, as threefold's pretraining
    data has it (tools/preprocess_data.py writes no BOS)."""
    bos = tokenizer.bos if getattr(tokenizer, "adds_bos", False) else None
    return ([] if bos is None else [bos]) + tokenizer.tokenize(text)


class GPT2BPETokenizer:
    """GPT-2's byte-level BPE from `--vocab-file vocab.json --merge-file merges.txt`;
    end of document is `<|endoftext|>`."""

    def __init__(self, vocab_file: str | None, merge_file: str | None) -> None:
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                given = f" ({path!r} is not a file)" if path else ""
                raise ConfigError(f"--tokenizer-type GPT2BPETokenizer needs {flag} FILE{given}")
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        self.model_file = None
        with _read_as(f"--vocab-file {vocab_file} / --merge-file {merge_file}", "GPT-2 BPE"):
            self.tokenizer = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        self.tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tokenizer.decoder = decoders.ByteLevel()
        self.vocab_size = self.tokenizer.get_vocab_size()
        eod = self.tokenizer.token_to_id("<|endoftext|>")
        self.eod = eod if eod is not None else self.vocab_size - 1
        self.bos = None

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def token_id(self, token: str) -> int | None:
        """One token's id (None if the vocabulary lacks it)."""
        return self.tokenizer.token_to_id(token)


class NullTokenizer:
    """Megatron's NullTokenizer: ids are given, `--vocab-size` of them plus one end-of-document."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size + 1
        self.eod = vocab_size
        self.bos = None

    def tokenize(self, text: str) -> list[int]:
        """The text's ids, separated by white space: a word that is not one is a ValueError."""
        ids = []
        for word in text.split():
            try:
                ids.append(int(word))
            except ValueError:
                raise ValueError(
                    f"{word[:20]!r} is not a token id (NullTokenizer reads ids separated by spaces)"
                ) from None
        outside = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if outside is not None:
            raise ValueError(
                f"token id {outside} is outside the vocabulary (--vocab-size {self.eod}: ids 0 to "
                f"{self.eod - 1}, and {self.eod} for the end of document)"
            )
        return ids

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def token_id(self, token: str) -> int | None:
        """A token given as its id (the only names this tokenizer has)."""
        return int(token) if token.isdigit() and int(token) < self.vocab_size else None


def build_tokenizer(config: DataConfig, vocab_size: int | None):
    """The tokenizer `--tokenizer-type` names, or None for `--mock-data` without a tokenizer."""
    if config.tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        return SentencePieceTokenizer(config.tokenizer_model)
    if config.tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(config.tokenizer_model)
    if config.tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(config.vocab_file, config.merge_file)
    if config.tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(config.tokenizer_model)
    if config.tokenizer_type == "SFTTokenizer":
        from threefold.data.sft_tokenizer import SFTTokenizer

        return SFTTokenizer(config.tokenizer_model, config.sft_tokenizer_prompt_format)
    if config.tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    return None


def model_vocab_size(tokenizer, vocab_size_flag: int | None) -> int:
    """The model's vocabulary: the tokenizer's, or `--vocab-size` when it is at least as large."""
    if tokenizer is None:
        if vocab_size_flag is None:
            raise ConfigError("--mock-data without a tokenizer needs --vocab-size")
        return vocab_size_flag
    if isinstance(tokenizer, NullTokenizer) or vocab_size_flag is None:
        return tokenizer.vocab_size
    if vocab_size_flag < tokenizer.vocab_size:
        raise ConfigError(
            f"--vocab-size {vocab_size_flag} is smaller than the tokenizer's "
            f"vocabulary ({tokenizer.vocab_size}); drop the flag or raise it"
        )
    return vocab_size_flag
