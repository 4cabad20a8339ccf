"""Megatron-LM's older GPT models (`megatron/legacy`, trained with --use-legacy-models; gone
from Megatron-LM since May 2026, and with them its tools/checkpoint/loader_legacy.py) in its
legacy torch checkpoints: their tensors under megatron-core's local-spec names, which the
legacy reader (checkpoint/megatron/legacy_tensors.py) then reads as any.

A model chunk's state dict nests as the older GPTModel's `state_dict_for_save_checkpoint`
wrote it (some tools flattened it to the dotted names):

    language_model.embedding.word_embeddings.weight       (the first stage)
    language_model.embedding.position_embeddings.weight   (learned positions)
    language_model.encoder.layers.{i}.input_norm.*        -> decoder.layers.{i}.input_layernorm.*
        .self_attention.query_key_value.*                 -> .self_attention.linear_qkv.*
        .self_attention.dense.*                           -> .self_attention.linear_proj.*
        .post_attention_norm.*                            -> .pre_mlp_layernorm.*
        .mlp.dense_h_to_4h.* / .mlp.dense_4h_to_h.*       -> .mlp.linear_fc1.* / .linear_fc2.*
    language_model.encoder.final_norm.*                   -> decoder.final_layernorm.*
    language_model.output_layer.weight                    (untied)
    word_embeddings_for_head.weight                       (tied: the last stage's copy)

Each tensor is its megatron-core twin, shape and TP split alike: the older ParallelAttention
lays a TP shard's query, key and value rows out per query group, (groups, heads per group + 2,
head size), as megatron-core's linear_qkv does, and a gated MLP's dense_h_to_4h holds the
shard's gate rows then its up rows, as linear_fc1 does. Runs before late 2023 named the norms
input_layernorm, post_attention_layernorm and final_layernorm; older ones the attention
`attention` and the encoder `transformer` (Megatron-LM's own load took those too).
"""

from __future__ import annotations

import re

from threefold.config import ConfigError

_LANGUAGE_MODEL = "language_model"
# the older names of a layer's modules, in the order they are tried
_LAYER_NAMES = (
    ("input_norm.", "input_layernorm."),
    ("input_layernorm.", "input_layernorm."),
    ("self_attention.query_key_value.", "self_attention.linear_qkv."),
    ("self_attention.dense.", "self_attention.linear_proj."),
    ("post_attention_norm.", "pre_mlp_layernorm."),
    ("post_attention_layernorm.", "pre_mlp_layernorm."),
    ("mlp.dense_h_to_4h.", "mlp.linear_fc1."),
    ("mlp.dense_4h_to_h.", "mlp.linear_fc2."),
)
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_FINAL_NORM = re.compile(r"^final_(?:norm|layernorm)\.(weight|bias)$")
# the older models' Transformer Engine layers (--transformer-impl transformer_engine)
_TE_LAYER = re.compile(r"\.(layernorm_qkv|layernorm_mlp|self_attention\.proj)\.")
_SWITCH_MLP = re.compile(r"\.mlp\.(router|local_experts)\.")


def is_older_model(chunk: dict) -> bool:
    """Whether a model chunk's state dict is one of the older models'."""
    return any(key == _LANGUAGE_MODEL or key.startswith(_LANGUAGE_MODEL + ".") for key in chunk)


def _flattened(tree: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flattened(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _layer_key(rest: str) -> str | None:
    """A layer's key under megatron-core's names (`rest`: after `layers.{i}.`), else None."""
    rest = (
        rest.replace("attention.", "self_attention.", 1) if rest.startswith("attention.") else rest
    )
    for older, newer in _LAYER_NAMES:
        if rest.startswith(older):
            return newer + rest[len(older) :]
    return None


def megatron_core_names(chunk: dict, source: str) -> dict[str, object]:
    """An older model's chunk as megatron-core's local spec names its tensors; a key of no
    counterpart keeps its own name (and is then refused as a tensor nothing took). `source`
    names the file in a refusal."""
    renamed = {}
    for key, value in _flattened(chunk).items():
        if _TE_LAYER.search(key):
            raise ConfigError(
                f"{source}: a checkpoint of Megatron-LM's older models built with Transformer "
                f"Engine's layers ({key}), which threefold does not read; threefold reads "
                "those of --transformer-impl local"
            )
        if _SWITCH_MLP.search(key):
            raise ConfigError(
                f"{source}: a checkpoint of Megatron-LM's older models with mixture-of-experts "
                f"layers (SwitchMLP: {key}), which threefold does not read"
            )
        renamed[_core_name(key) or key] = value
    return renamed


def _core_name(key: str) -> str | None:
    if key == "word_embeddings_for_head.weight":
        return "output_layer.weight"
    if not key.startswith(_LANGUAGE_MODEL + "."):
        return None
    key = key[len(_LANGUAGE_MODEL) + 1 :]
    if key.startswith("embedding.") or key == "output_layer.weight":
        return key
    part, _, rest = key.partition(".")
    if part not in ("encoder", "transformer"):
        return None
    final = _FINAL_NORM.match(rest)
    if final:
        return f"decoder.final_layernorm.{final.group(1)}"
    layer = _LAYER.match(rest)
    named = _layer_key(layer.group(2)) if layer else None
    return None if named is None else f"decoder.layers.{layer.group(1)}.{named}"
