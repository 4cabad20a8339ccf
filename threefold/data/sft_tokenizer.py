"""Megatron-LM's SFTTokenizer (`--tokenizer-type SFTTokenizer`): a Hugging Face tokenizer that
renders a conversation in one of `--sft-tokenizer-prompt-format`'s layouts and says which of
its tokens are targets (the rest carry IGNORE_INDEX).

    nemotron-h-aligned  <SPECIAL_10>System\\n{system}\\n  <SPECIAL_11>User\\n{user}\\n
                        <SPECIAL_11>Assistant\\n  {assistant}\\n    (the header ends the user turn)
    nemotron-nano-v2    as above, but the assistant turn opens with its own header (its first
                        3 tokens, no targets) and ends with \\n<SPECIAL_12>\\n; "/think" and
                        "/no_think" are removed from system and user turns
    identity            the contents alone, back to back
    default             the tokenizer's own chat template, every token a target

The Nemotron layouts strip each content of surrounding white space. Tool turns render nothing
but in `default`. The text is tokenized without added special tokens, as transformers'
`apply_chat_template` does. System, user and tool turns are masked; a turn's tokens are found
as Megatron-LM finds them, by tokenizing the turn alone, so a tokenizer that merges tokens
across a turn boundary is refused (naming the conversation), as megatron-core asserts.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config import ConfigError
from threefold.data.tokenizer import HuggingFaceTokenizer

IGNORE_INDEX = -100


def _nemotron_h_aligned(role: str, content: str) -> str:
    content = content.strip()
    return {
        "system": f"<SPECIAL_10>System\n{content}\n",
        "user": f"<SPECIAL_11>User\n{content}\n<SPECIAL_11>Assistant\n",
        "assistant": f"{content}\n",
    }.get(role, "")


def _nemotron_nano_v2(role: str, content: str) -> str:
    if role == "assistant":
        return f"<SPECIAL_11>Assistant\n{content.strip()}\n<SPECIAL_12>\n"
    content = content.replace("/think", "").replace("/no_think", "").strip()
    return {
        "system": f"<SPECIAL_10>System\n{content}\n",
        "user": f"<SPECIAL_11>User\n{content}\n",
    }.get(role, "")


def _identity(role: str, content: str) -> str:
    return content


@dataclass(frozen=True)
class PromptFormat:
    render: object  # (role, content) -> the turn's text; None: the tokenizer's chat template
    pad_token: str | None  # None: the tokenizer's pad token, else its end of sequence
    markers: tuple[str, ...]  # special tokens the layout needs as single tokens
    assistant_prefix_len: int = 0  # the assistant turn's header tokens: no targets


PROMPT_FORMATS = {
    "nemotron-h-aligned": PromptFormat(
        _nemotron_h_aligned, "<SPECIAL_233>", ("<SPECIAL_10>", "<SPECIAL_11>")
    ),
    "nemotron-nano-v2": PromptFormat(
        _nemotron_nano_v2, "<unk>", ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>"), 3
    ),
    "identity": PromptFormat(_identity, "<unk>", ()),
    "default": PromptFormat(None, None, ()),
}


class SFTTokenizer(HuggingFaceTokenizer):
    """A Hugging Face tokenizer directory rendering conversations in `prompt_format`."""

    def __init__(self, directory: str, prompt_format: str) -> None:
        super().__init__(directory)
        self.prompt_format, self.layout = prompt_format, PROMPT_FORMATS[prompt_format]
        flag = f"--sft-tokenizer-prompt-format {prompt_format}"
        for marker in (*self.layout.markers, self.layout.pad_token):
            if marker is not None and len(self._single(marker)) != 1:
                raise ConfigError(
                    f"{flag} needs the token {marker}, which the tokenizer in --tokenizer-model "
                    f"{directory} does not have as one token; use identity or default for "
                    "another tokenizer"
                )
        if self.layout.render is None:
            if not super().has_chat_template:
                raise ConfigError(
                    f"{flag} renders with the tokenizer's own chat template, and "
                    f"--tokenizer-model {directory} has none; use identity or a Nemotron format"
                )
            pad = getattr(self.tokenizer, "pad_token_id", None)
            self.pad = pad if pad is not None else self.eod
        else:
            self.pad = self._single(self.layout.pad_token)[0]

    @property
    def unique_identifiers(self) -> dict:
        """What megatron-core's datasets record of their tokenizer."""
        return {"class": "SFTTokenizer", "directory": self.model_file, "format": self.prompt_format}

    def _single(self, token: str) -> list[int]:
        found = self.token_id(token)
        return [found] if found is not None and self.tokenize(token) == [found] else []

    @property
    def has_chat_template(self) -> bool:
        return True  # (the layout's, or `default`'s checked above)

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        """The conversation's ids as the layout renders it (its custom templates, as
        Megatron-LM's, have no generation prompt)."""
        if self.layout.render is None:
            return super().chat_ids(messages, add_generation_prompt)
        return self.tokenize("".join(self._turn_texts(messages)))

    def _turn_texts(self, messages: list[dict]) -> list[str]:
        return [self.layout.render(m["role"], m["content"]) for m in messages]

    def tokenize_conversation(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """(tokens, targets) of one conversation: the targets are the tokens but where they
        carry IGNORE_INDEX (system, user and tool turns, the assistant header)."""
        if self.layout.render is None:  # (Megatron-LM: every token a target)
            tokens = self.chat_ids(messages)
            return tokens, list(tokens)
        texts = self._turn_texts(messages)
        tokens, targets = self.tokenize("".join(texts)), []
        for message, text in zip(messages, texts):
            turn = self.tokenize(text)
            if tokens[len(targets) : len(targets) + len(turn)] != turn:
                break
            masked = len(turn)
            if message["role"] == "assistant":
                masked = min(self.layout.assistant_prefix_len, len(turn))
            targets += [IGNORE_INDEX] * masked + turn[masked:]
        if len(targets) != len(tokens):  # (a turn alone is not its part of the whole)
            raise ConfigError(
                f"--sft-tokenizer-prompt-format {self.prompt_format}: the tokenizer in "
                f"--tokenizer-model {self.model_file} tokenizes a conversation's turns "
                "differently alone than together, so their targets cannot be told (the "
                f"conversation begins {texts[0][:40]!r})"
            )
        return tokens, targets
