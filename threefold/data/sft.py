"""Supervised fine-tuning data: JSONL conversations -> samples with loss on responses only.

Records are `{"prompt": ..., "response": ...}` or `{"messages": [{"role", "content"}, ...]}`.
Messages are rendered with the tokenizer's chat template when it has one (Hugging Face): the
token ids are exactly `apply_chat_template`'s, and the tokens each assistant turn adds after
the template's generation prompt (its content and end-of-turn) carry loss. Without a template,
a plain "Role: content" rendering with loss on assistant turns, and prompt/response records,
end with the end-of-document token (which carries loss: learning to stop). Samples are
`seq_length + 1` tokens:
- padding: one conversation per sample, truncated, padded with the end-of-document token;
- packing: conversations concatenated into samples, each keeping its own positions (restarting
  at 0) and attending only within itself (the loader turns `document_ids` into a
  block-diagonal causal mask).
"""

from __future__ import annotations

import json

import numpy as np

from threefold.config import ConfigError
from threefold.data.conversations import message_mistake
from threefold.data.tokenizer import prompt_ids


def read_jsonl(path: str, flag: str) -> list[dict]:
    """The records of `flag`'s JSONL file, or a ConfigError naming the flag, file and line."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ConfigError(f"{flag} {path}:{number}: not JSON ({error.msg})") from None
                mistake = _record_mistake(record)
                if mistake:
                    raise ConfigError(f"{flag} {path}:{number}: {mistake}")
                records.append(record)
    except FileNotFoundError:
        raise ConfigError(f"{flag} {path}: no such file") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{flag} {path}: not UTF-8 text ({error.reason})") from None
    if not records:
        raise ConfigError(f"{flag} {path}: no records")
    return records


def _record_mistake(record) -> str | None:
    """What makes a record no conversation threefold can render, else None."""
    if not isinstance(record, dict) or not (
        "messages" in record or {"prompt", "response"} <= record.keys()
    ):
        return 'needs "prompt" and "response", or "messages"'
    if "messages" not in record:
        wrong = [key for key in ("prompt", "response") if not isinstance(record[key], str)]
        return f'"{wrong[0]}" is {json.dumps(record[wrong[0]])[:20]}, not text' if wrong else None
    return message_mistake(record["messages"], masks=False)


def _has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "has_chat_template", False))


def _render_chat(messages: list[dict], tokenizer) -> tuple[list[int], list[bool]]:
    """`apply_chat_template`'s ids; loss on what each assistant turn adds after the generation
    prompt (the template's assistant header), found by rendering the conversation's prefixes."""
    ids = tokenizer.chat_ids(messages)
    response = [False] * len(ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        header = (
            len(tokenizer.chat_ids(messages[:index], add_generation_prompt=True)) if index else 0
        )
        through = tokenizer.chat_ids(messages[: index + 1])
        if ids[: len(through)] != through or header > len(through):
            raise ConfigError(
                "the tokenizer's chat template does not render a conversation's turns as "
                "prefixes of the whole; use prompt/response records"
            )
        response[header : len(through)] = [True] * (len(through) - header)
    return ids, response


def render(record: dict, tokenizer) -> tuple[list[int], list[bool]]:
    """Token ids of a record and, per token, whether it is a response token (carries loss)."""
    if "messages" in record and _has_chat_template(tokenizer):
        return _render_chat(record["messages"], tokenizer)
    ids: list[int] = prompt_ids(tokenizer, "")
    response: list[bool] = [False] * len(ids)

    def add(text: str, is_response: bool) -> None:
        tokens = tokenizer.tokenize(text)
        ids.extend(tokens)
        response.extend([is_response] * len(tokens))

    if "messages" not in record:
        add(record["prompt"], False)
        add(record["response"], True)
    else:
        for message in record["messages"]:
            add(f"{message['role'].capitalize()}: ", False)
            add(message["content"] + "\n", message["role"] == "assistant")
    ids.append(tokenizer.eod)
    response.append(True)  # learning to stop
    return ids, response


class SFTDataset:
    def __init__(
        self, records: list[dict], tokenizer, seq_length: int, packing: bool = False
    ) -> None:
        self.seq_length, self.packing, self.eod = seq_length, packing, tokenizer.eod
        conversations = [render(record, tokenizer) for record in records]
        size = seq_length + 1
        # A conversation whose response tokens all lie past the sample trains nothing (the
        # label of position i is token i + 1: the first token is never one).
        self.without_loss = sum(not any(response[1:size]) for _, response in conversations)
        self.shortest_prompt = min(
            next((i for i, flag in enumerate(response) if flag), len(response))
            for _, response in conversations
        )
        if not packing:
            self.samples = [[c] for c in conversations]
        else:  # greedy packing in order; a conversation never straddles two samples
            self.samples, current, used = [], [], 0
            for ids, response in conversations:
                length = min(len(ids), size)
                if current and used + length > size:
                    self.samples.append(current)
                    current, used = [], 0
                current.append((ids[:size], response[:size]))
                used += length
            if current:
                self.samples.append(current)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        size = self.seq_length + 1
        tokens = np.full(size, self.eod, dtype=np.int64)
        response = np.zeros(size, dtype=bool)
        documents = np.full(size, -1, dtype=np.int64)  # -1: padding
        positions = np.zeros(size, dtype=np.int64)
        offset = 0
        for number, (ids, is_response) in enumerate(self.samples[index]):
            length = min(len(ids), size - offset)
            tokens[offset : offset + length] = ids[:length]
            response[offset : offset + length] = is_response[:length]
            documents[offset : offset + length] = number
            positions[offset : offset + length] = np.arange(length)
            offset += length
        # The label of position i is token i + 1: it carries loss when that token is part of a
        # response of the same document.
        loss_mask = response[1:] & (documents[1:] == documents[:-1])
        sample = {"tokens": tokens, "loss_mask": loss_mask.astype(np.float32)}
        if self.packing:
            sample["document_ids"] = documents[:-1]
            sample["position_ids"] = positions[:-1]
        return sample
